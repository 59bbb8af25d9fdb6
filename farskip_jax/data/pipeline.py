"""Grain input pipeline for FCSD: chat / plain-text JSONL and Parquet -> packed, masked int32 batches.

Stages (all grain, so the whole chain is checkpointable through ``DatasetIterator.get_state()``):

    RecordSource (random access over every record of every file, in sorted file order)
      -> [process_index::process_count]      strided data-parallel shard: disjoint, together covering
      -> .shuffle(shuffle_seed)              deterministic global shuffle of this process's shard
      -> .repeat(num_epochs)                 grain reseeds the shuffle every epoch
      -> .map(tokenise) / .filter            malformed records are counted, logged and dropped
      -> .to_iter_dataset()
      -> FirstFitPackIterDataset             packs documents into rows of seq_len with segment ids
      -> .map(rename) -> .batch(batch_size)

Each output batch is a dict of int32 ``[batch_size, seq_len]`` arrays:
``input_ids``, ``targets`` (next token), ``loss_mask``, ``segment_ids`` (1..n per document in a row,
0 for padding) and ``positions`` (restart at 0 for each document).

Documents are shifted (``input_ids = tokens[:-1]``, ``targets = tokens[1:]``) *before* packing, so the last
target of a document is that document's own final token (its EOS): no target ever predicts the next
document's first token, and padding has target 0 and loss_mask 0. Documents longer than ``seq_len + 1``
tokens are truncated (counted in ``DataCounters.truncated``).

Chat template (``ChatTemplate``; the default is DeepSeek-V2-Chat's)::

    {bos}{system_prefix}{system}{system_suffix}{user_prefix}{user}{user_suffix}
    {assistant_prefix}{assistant}{eos}{assistant_suffix}{user_prefix}...

Every piece is tokenised on its own (no special tokens added by the tokenizer), so the loss mask is exact:
it is 1 on the assistant content tokens and the EOS that ends each assistant turn, 0 elsewhere. The price
is that a BPE merge across a piece boundary is not made (the tokens can differ from tokenising the rendered
string in one go at those boundaries). Plain-text records (``{"text": ...}``) become
``{bos}{text}{eos}`` with every token counted.

Counters are per process and count records *read*, including records read ahead by grain's prefetch
threads, and records read again after a resume.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import mmap
import os
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import grain
import numpy as np
import pyarrow.parquet as pq
import tokenizers

logger = logging.getLogger(__name__)

FORMATS = ("auto", "jsonl", "parquet")
ON_MALFORMED = ("skip", "stop")
ROLES = ("system", "user", "assistant")
_JSONL_EXT = (".jsonl", ".json", ".ndjson")
_PARQUET_EXT = (".parquet", ".pq")
_MAX_EXAMPLES = 100  # malformed (file, line, reason) triples kept for the report; the counts are exact


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """Role prefixes/suffixes and BOS/EOS token strings. Default: DeepSeek-V2-Chat.

    An assistant turn renders as ``assistant_prefix + content + eos + assistant_suffix``; only
    ``content + eos`` is trained. ``bos`` (if non-empty) starts every document. ``bos`` and ``eos`` must be
    single tokens of the tokenizer (checked when the pipeline is built). For ChatML, e.g.:
    ``ChatTemplate(bos="", eos="<|im_end|>", user_prefix="<|im_start|>user\\n", user_suffix="<|im_end|>\\n",
    assistant_prefix="<|im_start|>assistant\\n", assistant_suffix="\\n", ...)``.
    """

    bos: str = "<｜begin▁of▁sentence｜>"
    eos: str = "<｜end▁of▁sentence｜>"
    system_prefix: str = ""
    system_suffix: str = "\n\n"
    user_prefix: str = "User: "
    user_suffix: str = "\n\n"
    assistant_prefix: str = "Assistant: "
    assistant_suffix: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What to read and how to pack it. ``paths`` may hold glob patterns; matches are sorted."""

    paths: Sequence[str]
    tokenizer: str
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    seq_len: int = 4096
    batch_size: int = 8
    shuffle_seed: int = 0
    num_epochs: int | None = None  # None: repeat forever (stop by step count; keeps processes in lock-step)
    template: ChatTemplate = ChatTemplate()
    on_malformed: Literal["skip", "stop"] = "skip"
    packing_bins: int | None = None  # first-fit bins held open at once; None: batch_size
    drop_remainder: bool = True
    read_threads: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.paths, str) or not self.paths:
            raise ValueError(f"paths must be a non-empty list of file paths or globs; got {self.paths!r}")
        object.__setattr__(self, "paths", tuple(self.paths))
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}; got {self.format!r}")
        if self.on_malformed not in ON_MALFORMED:
            raise ValueError(f"on_malformed must be one of {ON_MALFORMED}; got {self.on_malformed!r}")
        for name, low in (("seq_len", 2), ("batch_size", 1), ("read_threads", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
        if not isinstance(self.shuffle_seed, int) or not 0 <= self.shuffle_seed < 2**32:
            raise ValueError(f"shuffle_seed must be an int in [0, 2**32); got {self.shuffle_seed!r}")
        if self.num_epochs is not None and (not isinstance(self.num_epochs, int) or self.num_epochs < 1):
            raise ValueError(f"num_epochs must be None (forever) or an int >= 1; got {self.num_epochs!r}")
        if self.packing_bins is not None and (
            not isinstance(self.packing_bins, int) or self.packing_bins < 1
        ):
            raise ValueError(f"packing_bins must be None or an int >= 1; got {self.packing_bins!r}")
        if not isinstance(self.template, ChatTemplate):
            raise ValueError(f"template must be a ChatTemplate; got {type(self.template).__name__}")


class MalformedRecordError(ValueError):
    """Raised (``on_malformed="stop"``) for a record that cannot be used; the message names file and line."""


class DataCounters:
    """Thread-safe tallies of what the pipeline read (grain maps records in several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.records_ok = 0
        self.truncated = 0
        self.malformed: Counter[str] = Counter()
        self.examples: list[tuple[str, int, str]] = []  # (file, line, reason), first _MAX_EXAMPLES

    def ok(self, truncated: bool) -> None:
        with self._lock:
            self.records_ok += 1
            self.truncated += int(truncated)

    def bad(self, path: str, line: int, reason: str) -> None:
        with self._lock:
            self.malformed[reason.split(":")[0]] += 1
            if len(self.examples) < _MAX_EXAMPLES:
                self.examples.append((path, line, reason))

    @property
    def num_malformed(self) -> int:
        return sum(self.malformed.values())

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "records_ok": self.records_ok,
                "truncated": self.truncated,
                "malformed": dict(self.malformed),
                "examples": list(self.examples),
            }


# ----------------------------------------------------------------------------------------------------------
# Sources: one random-access view over all records of all files.


def resolve_paths(patterns: Sequence[str]) -> list[str]:
    """Expands globs; sorted so every process sees the same record order."""
    out: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise FileNotFoundError(f"no file matches {pattern!r}")
        for path in matches:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"not a file: {path!r}")
        out.extend(matches)
    return out


def _detect_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    lower = path.lower()
    if lower.endswith(_JSONL_EXT):
        return "jsonl"
    if lower.endswith(_PARQUET_EXT):
        return "parquet"
    raise ValueError(
        f"cannot tell the format of {path!r} from its extension; set format='jsonl' or 'parquet'"
    )


@dataclasses.dataclass(frozen=True)
class RawRecord:
    path: str
    line: int  # 1-based line (JSONL) or row (Parquet)
    payload: bytes | dict | None  # JSONL: the raw line; Parquet: the row as a dict


class _JsonlFile:
    """Line offsets of one JSONL file; lines are read with pread, so lookups need no shared file position."""

    def __init__(self, path: str) -> None:
        self.path = path
        size = os.path.getsize(path)
        if size == 0:
            starts = ends = np.zeros(0, np.int64)
        else:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                newlines = np.flatnonzero(np.frombuffer(mm, np.uint8) == ord("\n")).astype(np.int64)
            ends = newlines if (newlines.size and newlines[-1] == size - 1) else np.append(newlines, size)
            starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        self.line_numbers = np.arange(1, starts.size + 1, dtype=np.int64)
        keep = ends > starts  # empty lines are not records (and not errors)
        self.starts, self.ends, self.line_numbers = starts[keep], ends[keep], self.line_numbers[keep]
        self._fd: int | None = None

    def __len__(self) -> int:
        return int(self.starts.size)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_fd"] = None  # file descriptors do not survive pickling (grain multiprocessing)
        return state

    def get(self, i: int) -> RawRecord:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        start, end = int(self.starts[i]), int(self.ends[i])
        return RawRecord(self.path, int(self.line_numbers[i]), os.pread(self._fd, end - start, start))


class _ParquetFile:
    """One Parquet file. The needed columns are loaded whole on first use (Arrow keeps them compact):
    row-group-at-a-time reads would decode a whole group per record under a global shuffle."""

    def __init__(self, path: str) -> None:
        self.path = path
        pf = pq.ParquetFile(path)
        self._n = pf.metadata.num_rows
        self._columns = [c for c in ("messages", "text") if c in pf.schema_arrow.names]
        self._table = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._n

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_table"], state["_lock"] = None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def get(self, i: int) -> RawRecord:
        if self._table is None:
            with self._lock:
                if self._table is None:
                    self._table = pq.read_table(self.path, columns=self._columns)
        row = self._table.slice(i, 1).to_pylist()[0] if self._columns else {}
        return RawRecord(self.path, i + 1, row)


class RecordSource(grain.sources.RandomAccessDataSource):
    """All records of all files, file after file, as ``RawRecord``s (parsed later, to count errors)."""

    def __init__(self, paths: Sequence[str], fmt: str = "auto") -> None:
        self._files = [_JsonlFile(p) if _detect_format(p, fmt) == "jsonl" else _ParquetFile(p) for p in paths]
        self._offsets = np.cumsum([0] + [len(f) for f in self._files]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, index: int) -> RawRecord:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(index)
        k = int(np.searchsorted(self._offsets, index, side="right")) - 1
        return self._files[k].get(index - int(self._offsets[k]))

    def __repr__(self) -> str:
        return f"RecordSource({len(self._files)} files, {len(self)} records)"


# ----------------------------------------------------------------------------------------------------------
# Tokenisation with the chat template.


def load_tokenizer(path: str) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(path)


def _check_special(tok: tokenizers.Tokenizer, name: str, text: str) -> None:
    if text and tok.token_to_id(text) is None:
        raise ValueError(f"template.{name}={text!r} is not a single token of the tokenizer")


class Tokenize:
    """RawRecord -> dict(input_ids, targets, loss_mask) int32 arrays of one document, or None if malformed."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        template: ChatTemplate,
        seq_len: int,
        counters: DataCounters,
        on_malformed: str = "skip",
    ) -> None:
        _check_special(tokenizer, "bos", template.bos)
        _check_special(tokenizer, "eos", template.eos)
        self.tok, self.t, self.seq_len = tokenizer, template, seq_len
        self.counters, self.on_malformed = counters, on_malformed

    def _ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids if text else []

    def _pieces(self, record: Any) -> list[tuple[str, int]]:
        """(text, trained) pieces of a parsed record; raises ValueError('reason: detail') if unusable."""
        t = self.t
        if not isinstance(record, dict):
            raise ValueError(f"not_an_object: got {type(record).__name__}")
        messages, text = record.get("messages"), record.get("text")
        if messages is None:
            if text is None:
                raise ValueError("missing_field: neither 'messages' nor 'text'")
            if not isinstance(text, str) or not text:
                raise ValueError("bad_text: 'text' must be a non-empty string")
            return [(t.bos, 0), (text, 1), (t.eos, 1)]
        if not isinstance(messages, list) or not messages:
            raise ValueError("bad_messages: 'messages' must be a non-empty list")
        pieces: list[tuple[str, int]] = [(t.bos, 0)]
        for j, msg in enumerate(messages):
            if not isinstance(msg, dict) or not isinstance(msg.get("content"), str):
                raise ValueError(f"bad_message: message {j} needs a string 'content'")
            role, content = msg.get("role"), msg["content"]
            if role not in ROLES:
                raise ValueError(f"bad_role: message {j} has role {role!r}, allowed {ROLES}")
            if role == "assistant":
                pieces += [(t.assistant_prefix, 0), (content, 1), (t.eos, 1), (t.assistant_suffix, 0)]
            else:
                prefix, suffix = (
                    (t.user_prefix, t.user_suffix) if role == "user" else (t.system_prefix, t.system_suffix)
                )
                pieces += [(prefix, 0), (content, 0), (suffix, 0)]
        if not any(m["role"] == "assistant" and m["content"] for m in messages):
            raise ValueError("no_assistant_turn: nothing to train on")
        return pieces

    def __call__(self, raw: RawRecord) -> dict[str, np.ndarray] | None:
        try:
            if isinstance(raw.payload, bytes):
                if not raw.payload.strip():
                    return None  # a whitespace-only line is not a record
                try:
                    record = json.loads(raw.payload)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ValueError(f"bad_json: {e}") from None
            else:
                record = raw.payload
            pieces = self._pieces(record)
        except ValueError as e:
            self.counters.bad(raw.path, raw.line, str(e))
            msg = f"malformed record at {raw.path}:{raw.line}: {e}"
            if self.on_malformed == "stop":
                raise MalformedRecordError(msg) from None
            logger.warning("%s (skipped)", msg)
            return None
        ids: list[int] = []
        trained: list[int] = []
        for text, flag in pieces:
            piece = self._ids(text)
            ids += piece
            trained += [flag] * len(piece)
        tokens = np.asarray(ids, np.int32)
        mask = np.asarray(trained, np.int32)
        truncated = tokens.size > self.seq_len + 1
        tokens, mask = tokens[: self.seq_len + 1], mask[: self.seq_len + 1]
        if tokens.size < 2 or not mask[1:].any():
            # e.g. a conversation whose every assistant token fell past seq_len.
            self.counters.bad(raw.path, raw.line, "no_loss_tokens: nothing trainable within seq_len")
            return None
        self.counters.ok(truncated)
        # The mask of token i says whether token i is a training target, hence the shift with the targets.
        return {"input_ids": tokens[:-1], "targets": tokens[1:], "loss_mask": mask[1:]}


def _rename_packed(ex: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # The packer gives segment ids / positions per feature; all three features share the same layout.
    return {
        "input_ids": ex["input_ids"].astype(np.int32),
        "targets": ex["targets"].astype(np.int32),
        "loss_mask": ex["loss_mask"].astype(np.int32),
        "segment_ids": ex["input_ids_segment_ids"].astype(np.int32),
        "positions": ex["input_ids_positions"].astype(np.int32),
    }


# ----------------------------------------------------------------------------------------------------------
# Public entry point.


@dataclasses.dataclass
class DataPipeline:
    """The built pipeline. ``iter(pipeline)`` gives a grain ``DatasetIterator``; save
    ``it.get_state()`` next to the model checkpoint and ``it.set_state(state)`` on a fresh iterator to
    resume with the same data order (same config, process_index and process_count)."""

    config: DataConfig
    dataset: grain.IterDataset
    counters: DataCounters
    tokenizer: tokenizers.Tokenizer
    num_records: int  # records in this process's shard, per epoch (before dropping malformed ones)

    def __iter__(self) -> grain.DatasetIterator:
        return iter(self.dataset)


def build_pipeline(config: DataConfig, *, process_index: int = 0, process_count: int = 1) -> DataPipeline:
    """Builds the grain pipeline for one data-parallel process (``jax.process_index()/process_count()``)."""
    if not isinstance(process_count, int) or process_count < 1:
        raise ValueError(f"process_count must be an int >= 1; got {process_count!r}")
    if not isinstance(process_index, int) or not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be an int in [0, {process_count}); got {process_index!r}")
    tok = load_tokenizer(config.tokenizer)
    counters = DataCounters()
    tokenize = Tokenize(tok, config.template, config.seq_len, counters, config.on_malformed)

    source = RecordSource(resolve_paths(config.paths), config.format)
    records = grain.MapDataset.source(source)[process_index::process_count]
    num_records = len(records)
    if num_records == 0:
        raise ValueError(f"process {process_index}/{process_count} has no records in {config.paths}")
    ds = records.shuffle(seed=config.shuffle_seed).repeat(config.num_epochs)
    ds = ds.map(tokenize).filter(lambda ex: ex is not None)
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=config.read_threads, prefetch_buffer_size=64))
    seq = config.seq_len
    packed = grain.experimental.FirstFitPackIterDataset(
        it_ds,
        length_struct={"input_ids": seq, "targets": seq, "loss_mask": seq},
        num_packing_bins=config.packing_bins or config.batch_size,
        seed=config.shuffle_seed,
        shuffle_bins=True,
    )
    batched = packed.map(_rename_packed).batch(config.batch_size, drop_remainder=config.drop_remainder)
    return DataPipeline(config, batched, counters, tok, num_records)
