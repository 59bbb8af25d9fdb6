"""Orbax -> HF DeepSeek-V2/V3 (Instella-MoE) / Qwen3-MoE / Llama-4: size-limited safetensors shards written as
the parameters stream by.

Inputs: a directory written by `convert_hf_to_orbax` (marker `farskip_checkpoint.json`), or a
training checkpoint step directory. For the latter we assume the trainer's Orbax CheckpointManager
layout `RUN_DIR/checkpoints/STEP/{params,opt_state,meta}`: item "params" is the student's parameter
pure dict (the same tree as `nnx.to_pure_dict(nnx.state(model, nnx.Param))`) saved as a standard
Orbax PyTree, and item "meta" is a JSON item whose `model_config` (or `model`, or `config.model`)
holds our ModelConfig as a dict (an HF config.json dict is accepted as well). Only "params" is read.

A FarSkip model is exported with `modeling_farskip_{deepseek_v2,deepseek_v3,qwen3_moe,llama4}.py`
(this package's remote code for transformers) registered in config.json, so that transformers runs
FarSkip with trust_remote_code.

Host memory stays bounded by a few groups (a layer's experts each; `convert.memory_bound`): every
parameter group is restored on its own (a partial restore), `workers` of them ahead, and shards are
plain files whose header is computed up front from the planned tensor list, so each tensor is
written at its offset as soon as it exists, by `workers` threads at once, in row blocks (the shard
files: `safetensors_shards`; the temp dir and resume rules shared with `convert`: `output_dir`).
"""

from __future__ import annotations

import collections
import json
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from farskip_jax import hf_config
from farskip_jax.checkpoint import common, hf_tokenizer
from farskip_jax.checkpoint.common import (
    copy_into,
    nest_get,
    nest_set,
    raise_problems,
    release_freed_memory,
    row_ranges,
)
from farskip_jax.checkpoint.convert import (
    DEFAULT_WORKERS,
    Group,
    Summary,
    check_workers,
    group_specs,
    hf_key_label,
    parse_dtype,
    progress_bar,
)
from farskip_jax.checkpoint.hf_io import (
    SCALE_SUFFIX,
    CheckpointError,
    fp8_block_size,
    fp8_quantizes,
    fp8_scale_shape,
    np_dtype,
    quantize_fp8,
)
from farskip_jax.checkpoint.hf_keys import FusedJoin, ParamSpec, hf_entries, param_specs
from farskip_jax.checkpoint.orbax_io import (
    MARKER,
    PARAMS_ITEM,
    check_marker_params,
    is_orbax_checkpoint,
    is_trainer_step,
    load_model_config,
    read_marker,
    restore_group,
    restore_tree,
    saved_tree_metadata,
)
from farskip_jax.checkpoint.output_dir import atomic_output_dir, output_errors
from farskip_jax.checkpoint.safetensors_shards import (
    ST_TAGS,
    Entry,
    ShardSet,
    entry_bytes,
    plan_shards,
    shard_bytes,
    shards_on_disk,
)
from farskip_jax.config import ConfigError, ModelConfig, from_dict, migrate_stored_config, override

FP8_DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3 / R1 as published
INDEX = "model.safetensors.index.json"


def parse_size(text: str) -> int:
    """'5GB', '500MB', '20KB', '1000' -> bytes (decimal units, as transformers' max_shard_size)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"--max-shard-size {text!r}: expected e.g. 5GB, 500MB, 20KB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * scale)


# --------------------------------------------------------------------------------------------
# Reading parameter groups


class ParamsReader:
    """Reads one parameter group at a time as numpy arrays in their stored dtype."""

    def __init__(self, path: str | Path, **overrides: Any):
        self.path = Path(path)
        if is_orbax_checkpoint(self.path):
            self.kind = "converted"
            marker = read_marker(self.path)
            self.cfg = load_model_config(self.path, **overrides)
            check_marker_params(self.path, marker, self.cfg)
            self.version = marker["version"]
            self._groups = {g["name"]: g for g in marker["groups"]} if self.version == 1 else {}
            self.stored_dtype = marker["dtype"]
        elif is_trainer_step(self.path):
            self.kind = "training checkpoint"
            self.cfg = override(trainer_model_config(self.path), overrides, "model")
            self.stored_dtype = self._trainer_dtype()
        else:
            raise CheckpointError(f"{self.path}: neither a converted checkpoint ({MARKER}) nor a training "
                                  "checkpoint step (params/ and meta/ items)")

    def _trainer_dtype(self) -> str:
        tree = saved_tree_metadata(self.path / "params")
        problems, dtypes = [], set()
        for s in param_specs(self.cfg):
            try:
                leaf = nest_get(tree, tuple(str(p) for p in s.path))
            except (KeyError, TypeError):
                problems.append(f"{self.path / 'params'}: parameter {s.name} is missing")
                continue
            if tuple(leaf.shape) != s.shape:
                problems.append(f"{self.path / 'params'}: parameter {s.name} has shape "
                                f"{list(leaf.shape)}, the config needs {list(s.shape)}")
            dtypes.add(np.dtype(leaf.dtype).name)
        raise_problems(f"training checkpoint {self.path}", problems)
        if len(dtypes) != 1:
            raise CheckpointError(f"{self.path / 'params'}: mixed parameter dtypes {sorted(dtypes)}")
        return dtypes.pop()

    def read(self, group: Group) -> dict:
        """The group's parameters as numpy arrays (a partial restore of the "params" item)."""
        if self.kind == "converted" and self.version == 1:
            return restore_group(self.path, self._groups[group.name], np_dtype(self.stored_dtype), None)
        import jax

        target: dict = {}
        for s in group.specs:
            nest_set(target, s.path, jax.ShapeDtypeStruct(s.shape, np_dtype(self.stored_dtype)))
        return restore_tree(self.path / PARAMS_ITEM, target, partial=True)


def _trainer_metas(step_dir: Path) -> list[dict]:
    """The JSON dicts of a training checkpoint's "meta" item."""
    metas = []
    for f in sorted((step_dir / "meta").iterdir()):
        if not f.is_file() or f.name.startswith("_"):
            continue
        try:
            meta = json.loads(f.read_text())
        except ValueError:
            continue
        if isinstance(meta, dict):
            metas.append(meta)
    return metas


def trainer_config_dict(step_dir: Path) -> dict | None:
    """The whole training config stored in a training checkpoint's meta (None if absent), in
    today's layout (`migrate_stored_config`: a checkpoint from before `ExecutionConfig` keeps the
    execution keys under "model")."""
    stored = next((m["config"] for m in _trainer_metas(step_dir) if isinstance(m.get("config"), dict)), None)
    return None if stored is None else migrate_stored_config(stored)


def trainer_model_config(step_dir: Path) -> ModelConfig:
    """Our assumption about the trainer's "meta" JSON item (see the module docstring); the model
    section of a config stored before `ExecutionConfig` existed is migrated (its execution keys,
    which export and description do not read, moved out)."""
    for meta in _trainer_metas(step_dir):
        for cand in (meta.get("model_config"), meta.get("model"), (meta.get("config") or {}).get("model")):
            if isinstance(cand, dict):
                if "num_hidden_layers" in cand:
                    return hf_config.model_config(cand)
                return from_dict(ModelConfig, migrate_stored_config({"model": cand})["model"], "model")
    raise CheckpointError(f"{step_dir / 'meta'}: no JSON with a model config under 'model_config', 'model' "
                          "or 'config.model'")


# --------------------------------------------------------------------------------------------
# Exporting (the shard files themselves: `safetensors_shards`)


def export_plan(src: Path, out_dtype: str, overrides: dict[str, Any], max_shard_size: str,
                fp8_block: tuple[int, int] | None) -> dict:
    """What an export writes, as JSON: a resumed export must match it exactly (the same checkpoint
    files by size and modification time, and the same settings)."""
    files = sorted(f for f in src.rglob("*") if f.is_file())
    return {"direction": "orbax-to-hf", "source": str(src.resolve()), "dtype": out_dtype,
            "overrides": {k: overrides[k] for k in sorted(overrides)}, "max_shard_size": max_shard_size,
            "fp8_block": list(fp8_block) if fp8_block else None,
            "files": {str(f.relative_to(src)): [f.stat().st_size, f.stat().st_mtime_ns] for f in files}}


def source_quantization(src: Path) -> dict | None:
    """The FP8 quantization_config of the HF checkpoint a converted directory came from (its copied
    config.json), None when it was not quantized or `src` is a training checkpoint."""
    cfg_file = src / "config.json"
    if not cfg_file.is_file():
        return None
    quant = json.loads(cfg_file.read_text()).get("quantization_config")
    return quant if quant and fp8_block_size({"quantization_config": quant}) else None


def with_fp8(entries: list[tuple[str, tuple[int, ...]]], out_dtype: str,
             block: tuple[int, int] | None) -> list[Entry]:
    """The planned tensors: each in `out_dtype`, or (with a block) those the published FP8 layout
    quantizes as float8_e4m3fn followed by their float32 `_scale_inv`."""
    planned: list[Entry] = []
    for key, shape in entries:
        if block is not None and fp8_quantizes(key, shape):
            planned += [(key, shape, "float8_e4m3fn"),
                        (key + SCALE_SUFFIX, fp8_scale_shape(shape, block), "float32")]
        else:
            planned.append((key, shape, out_dtype))
    return planned


class TensorWriter:
    """Writes one HF tensor into its shard in row blocks of `common.BLOCK_BYTES`: cast to the export dtype
    or FP8-quantized block by block into a buffer each writer thread reuses (the shard set's
    `staging`, placed for direct I/O), so a writer holds one block (an FP8 block's quantizer
    temporaries: about 4 blocks) whatever the tensor's size. A tensor already C-contiguous in the
    export dtype is written from the restored array (with direct I/O, through its copy buffer)."""

    def __init__(self, files: ShardSet, out_dtype: str, block: tuple[int, int] | None, quantized: set[str],
                 bar: Any):
        self.files, self.dtype, self.block, self.quantized = files, np_dtype(out_dtype), block, quantized
        self._bar, self._bar_lock = bar, threading.Lock()

    def _put(self, key: str, data: np.ndarray, first_row: int) -> None:
        if not self.files.is_done(key):
            self.files.file(key).write(key, data, first_row)
            with self._bar_lock:
                self._bar.update(data.nbytes)

    def write(self, key: str, t: np.ndarray) -> None:
        """All of tensor `key` (`t` in the HF layout, any strides, the stored dtype)."""
        if key in self.quantized:  # from the stored values, never through the export dtype
            assert self.block is not None
            b0 = self.block[0]
            # A quarter block of float32 rows at a time: quantize_fp8 makes ~4 float32 copies.
            for r0, r1 in row_ranges(t.shape, 4, common.BLOCK_BYTES // 4, align=b0):
                q, scale_inv = quantize_fp8(np.asarray(t[r0:r1], np.float32), self.block)
                self._put(key, q, r0)
                self._put(key + SCALE_SUFFIX, scale_inv, r0 // b0)
            for k in (key, key + SCALE_SUFFIX):
                if not self.files.is_done(k):
                    self.files.finished(k)
            return
        if t.dtype == self.dtype and t.flags.c_contiguous:
            self._put(key, t, 0)
        else:
            for r0, r1 in row_ranges(t.shape, self.dtype.itemsize):
                part = t[r0:r1] if t.ndim else t
                buf = self.files.staging(key, r0, part.shape, self.dtype)
                copy_into(buf, part)  # the cast and the transpose in one pass (tiled: see copy_into)
                self._put(key, buf, r0)
        self.files.finished(key)


def stream_groups(reader: ParamsReader, todo: list[Group], tensor: TensorWriter,
                  to_write: Callable[[str], bool], workers: int) -> None:
    """Restores the groups in `todo` and writes their HF tensors, `workers` restores and `workers`
    tensor writes at once: at most workers + 1 groups in memory (being restored, restored, or with
    tensors still being written), each freed once its last tensor is written."""
    slots = threading.Semaphore(workers + 1)
    errors: list[BaseException] = []

    def write_group(tree: dict, group: Group, pool: ThreadPoolExecutor) -> None:
        jobs = []
        fused = FusedJoin()  # a fused tensor's parts are in one group
        for spec in group.specs:
            for key, t in fused.add(spec, spec.to_hf(np.asarray(nest_get(tree, spec.path)))):
                if to_write(key):
                    jobs.append((key, t))
        if not jobs:
            slots.release()
            return
        left = [len(jobs)]
        lock = threading.Lock()

        def one(key: str, t: np.ndarray) -> None:
            try:
                tensor.write(key, t)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                errors.append(e)
            finally:
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    release_freed_memory()  # what TensorStore read the group into (see there)
                    slots.release()  # the group's arrays are referenced by no job any more

        for key, t in jobs:
            pool.submit(one, key, t)

    with (ThreadPoolExecutor(workers, thread_name_prefix="farskip-restore") as restores,
          ThreadPoolExecutor(workers, thread_name_prefix="farskip-write") as writes):
        ahead: collections.deque = collections.deque()
        queue = iter(todo)
        for group in todo:
            # Restores ahead hold at most `workers` slots, so the one that frees up is always a
            # group being written.
            while len(ahead) < workers and (g := next(queue, None)) is not None:
                slots.acquire()
                if errors:
                    raise errors[0]
                ahead.append((g, restores.submit(reader.read, g)))
            g, future = ahead.popleft()
            assert g is group
            write_group(future.result(), group, writes)
            if errors:
                raise errors[0]
    if errors:
        raise errors[0]


def convert_orbax_to_hf(input_dir: str | Path, output_dir: str | Path, *, dtype: str | None = None,
                        overrides: dict[str, Any] | None = None, max_shard_size: str = "5GB",
                        dry_run: bool = False, overwrite: bool = False, progress: bool = True,
                        resume: bool = False, fp8: bool = False, workers: int = DEFAULT_WORKERS,
                        direct_io: bool = True, log: Callable[[str], None] = print) -> Summary:
    """A converted or training checkpoint -> HF safetensors shards + index + config.json.

    `fp8`: the published DeepSeek-V3 layout: every weight it quantizes (`fp8_quantizes`) written as
    float8_e4m3fn with a float32 `<name>_scale_inv` per block, the rest in `dtype`; the blocks are
    those of the HF checkpoint a converted directory came from (its config.json's
    quantization_config), else 128 x 128. Weights that came from FP8 and were kept in float32 are
    written back bitwise (`quantize_fp8`).
    `resume`: continue an interrupted export of the same checkpoint with the same settings, writing
    the shards it had not finished; the result is bitwise the uninterrupted one.
    `workers`: groups restored ahead and tensors written at once (`stream_groups`); the files do not
    depend on it. `direct_io`: shards written past the page cache (O_DIRECT) where the file system
    takes it, else buffered (`safetensors_shards`); the files do not depend on it either."""
    check_workers(workers)
    src, out = Path(input_dir), Path(output_dir)
    reader = ParamsReader(src, **(overrides or {}))
    out_dtype = parse_dtype(dtype) or reader.stored_dtype
    if out_dtype not in ST_TAGS:
        raise CheckpointError(f"{src}: stored dtype {out_dtype}; pass --dtype bf16 or fp32")
    cfg = override(reader.cfg, {"param_dtype": "bfloat16" if out_dtype == "bfloat16" else "float32"}, "model")
    raise_problems("the output", output_errors(out, overwrite, [src]))
    specs = param_specs(cfg)
    groups = group_specs(specs)
    quant = None
    if fp8:
        published = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                     "weight_block_size": list(FP8_DEFAULT_BLOCK)}
        quant = source_quantization(src) or published
    block = fp8_block_size({"quantization_config": quant}) if quant else None
    # Planned in the order the groups are read, which is the order tensors reach the writer.
    entries = with_fp8(hf_entries([s for g in groups for s in g.specs]), out_dtype, block)
    quantized = {k for k, _, dt in entries if dt == "float8_e4m3fn"}
    if fp8 and not quantized:
        raise CheckpointError(f"{src}: --fp8, but no tensor of this model is one the FP8 layout quantizes")
    shards = plan_shards(entries, parse_size(max_shard_size))
    summary = Summary(tensors=len(entries), params=sum(int(np.prod(s.shape)) for s in specs))
    total = sum(entry_bytes(e) for e in entries)
    layout = (f"FP8 e4m3 in blocks of {list(block)} ({len(quantized)} weights, a float32 *{SCALE_SUFFIX} "
              f"each), the rest {out_dtype}" if block else out_dtype)
    if dry_run:
        _print_plan(log, specs, reader.stored_dtype, out_dtype, shards, total, out, reader.kind, layout,
                    quantized)
        return summary
    t0 = time.perf_counter()
    n = len(shards)
    names = (["model.safetensors"] if n == 1
             else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    weight_map = {k: names[i] for i, sh in enumerate(shards) for k, *_ in sh}
    plan = export_plan(src, out_dtype, overrides or {}, max_shard_size, block)
    with (atomic_output_dir(out, log, plan=plan, resume=resume) as tmp,
          progress_bar(total, "Orbax -> HF", progress) as bar):
        files = ShardSet(tmp, names, shards, shards_on_disk(tmp, names, shards), direct=direct_io)
        # An HF tensor still to write: it (or its FP8 scale, which may lie in another shard) is in a
        # shard the interrupted export did not finish. Groups with none are not read again.
        to_write = lambda key: not (files.is_done(key) and files.is_done(key + SCALE_SUFFIX)
                                    if key in quantized else files.is_done(key))
        todo = [g for g in groups if any(to_write(k) for k, _ in hf_entries(list(g.specs)))]
        if files.done:
            done_bytes = sum(shard_bytes(shards[i]) for i in files.done)
            log(f"resuming {out}: {len(files.done)} of {n} shards ({done_bytes / 1e9:.3f} GB) already "
                "written")
            bar.update(done_bytes)
        tensor = TensorWriter(files, out_dtype, block, quantized, bar)
        try:
            stream_groups(reader, todo, tensor, to_write, workers)
        finally:
            files.close()
        if unfinished := [names[i] for i, left in files.left.items() if left]:
            raise CheckpointError(f"internal error: shard(s) {unfinished[:3]} not complete after the export")
        if n > 1:
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2) + "\n")
        config_json, assets, ids = _write_config_and_tokenizer(tmp, cfg, src, reader.kind, quant)
    summary.bytes, summary.seconds = total, time.perf_counter() - t0
    log(summary.line(f"wrote {out} ({n} shard(s), {layout}):"))
    _log_what_serving_needs(log, out, src, cfg, config_json, assets, ids)
    return summary



def _write_config_and_tokenizer(
        tmp: Path, cfg: ModelConfig, src: Path, kind: str, quant: dict[str, Any] | None,
) -> tuple[dict[str, Any], hf_tokenizer.TokenizerAssets | None, dict[str, int]]:
    """config.json (for FarSkip with the remote-code class, its modeling file copied beside it) and
    the files of the tokenizer the checkpoint was trained with, bos/eos/pad ids taken from it. Returns
    the config written, the tokenizer's assets (None if none was found) and the ids."""
    config_json = hf_config.hf_dict(cfg)
    if quant:
        config_json["quantization_config"] = quant
    if config_json["farskip"]:
        remote_code, remote_cls = REMOTE_CODE[config_json["model_type"]]
        config_json.update({"architectures": [remote_cls],
                            "auto_map": {"AutoModelForCausalLM": f"{remote_code.stem}.{remote_cls}"}})
        shutil.copyfile(remote_code, tmp / remote_code.name)
    trainer_cfg = trainer_config_dict(src) if kind == "training checkpoint" else None
    assets = hf_tokenizer.find(src, trainer_cfg)
    if assets is not None:
        ids = hf_tokenizer.write(assets, tmp, config_json)
    else:
        ids = {}
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            config_json.pop(k, None)  # a family default would name a token of another vocabulary
    (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    return config_json, assets, ids


def _log_what_serving_needs(log: Callable[[str], None], out: Path, src: Path, cfg: ModelConfig,
                            config_json: dict[str, Any], assets: hf_tokenizer.TokenizerAssets | None,
                            ids: dict[str, int]) -> None:
    """The export's tokenizer (or the warning that it has none) and, for FarSkip, how to load it."""
    if assets is not None:
        written = sorted(p.name for p in out.iterdir() if p.name in hf_tokenizer.TOKENIZER_FILES)
        log(f"tokenizer from {assets.source}: {', '.join(written)}; ids {ids}")
    else:
        log(f"warning: no tokenizer found for {src} (a training checkpoint's data.tokenizer, or the "
            f"converted checkpoint's {hf_tokenizer.SUBDIR}/): the export has no tokenizer files and no "
            "bos/eos ids; copy the tokenizer's files into it before serving")
    if config_json["farskip"]:
        first, last = config_json["farskip_start_idx"], config_json["farskip_end_idx"]
        remote_code = REMOTE_CODE[config_json["model_type"]][0]
        stock = hf_config.hf_dict(cfg)["architectures"][0]  # what transformers builds without remote code
        log(f"warning: FarSkip model (layers {first}..{last}): "
            f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True), "
            f"which runs {remote_code.name}; without trust_remote_code transformers builds the stock "
            f"{stock}, which ignores the FarSkip keys and runs regular connectivity (a different model)")

# By config.json model_type: the modeling file copied into every FarSkip export and its model class,
# which config.json registers (`auto_map`) so that transformers' Auto classes build the FarSkip model
# (with trust_remote_code=True).
_HERE = Path(__file__).parent
REMOTE_CODE = {
    "deepseek_v2": (_HERE / "modeling_farskip_deepseek_v2.py", "FarSkipDeepseekV2ForCausalLM"),
    "qwen3_moe": (_HERE / "modeling_farskip_qwen3_moe.py", "FarSkipQwen3MoeForCausalLM"),
    # DeepSeek-V3 and Instella-MoE (its gated attention included).
    "deepseek_v3": (_HERE / "modeling_farskip_deepseek_v3.py", "FarSkipDeepseekV3ForCausalLM"),
    "llama4_text": (_HERE / "modeling_farskip_llama4.py", "FarSkipLlama4ForCausalLM"),
}


def _print_plan(log, specs: list[ParamSpec], stored: str, out_dtype: str, shards: list[list[Entry]],
                total: int, out: Path, kind: str, layout: str, quantized: set[str]) -> None:
    rows = [("our path", "our shape", "HF key(s)", "HF shape", "dtype")]
    for s in specs:
        n = len(s.hf_keys)
        written = "float8_e4m3fn" if s.hf_keys[0] in quantized else out_dtype
        rows.append((s.name, str(list(s.shape)), hf_key_label(s),
                     (f"{n} x " if n > 1 else "") + str(list(s.hf_shape)), f"{stored}->{written}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        log("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    log(f"\n{kind} -> {sum(len(s) for s in shards)} HF tensors in {len(shards)} shard(s), {total:,} bytes "
        f"({total / 1e9:.3f} GB) to write to {out}; layout: {layout}")
