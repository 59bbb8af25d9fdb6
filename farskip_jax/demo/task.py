"""A synthetic chat task with a measurable answer, its local tokenizer, and held-out exact-match sets.

The task ("reverse"): the user sends a short string of symbols, the assistant answers it reversed::

    <bos> User: c a k e Assistant: e k a c <eos>

Exact match is all-or-nothing over the answer, so chance is (1/symbols)^len: near zero. Reversal needs
attention to positions and content (a model cannot solve it from the current token alone), which makes it a
good probe of what FarSkip's one-sub-block-stale inputs break. Every symbol is one whitespace-separated word
of a WordLevel tokenizer written locally (no network), so the pipeline's piece-wise tokenisation and the
evaluation's encoding below are identical by construction.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>", "User:", "Assistant:"]
# Task words: the first word of the prompt names the operation. More than one task lets reproduce.py measure
# forgetting (distil on one task, test the other), as the paper's SFT-vs-KL ablation does on benchmarks.
OPS = {"rev": lambda p: p[::-1], "srt": sorted, "cpy": list}
# The chat template handed to the data pipeline (data.template); suffixes are empty because whitespace is
# not a token of this tokenizer.
TEMPLATE = {"bos": "<bos>", "eos": "<eos>", "system_prefix": "", "system_suffix": "",
            "user_prefix": "User:", "user_suffix": "", "assistant_prefix": "Assistant:",
            "assistant_suffix": ""}


def symbols(n: int) -> list[str]:
    """n distinct one-token symbols: a..z, then s26, s27, ..."""
    letters = [chr(ord("a") + i) for i in range(26)]
    return letters[:n] + [f"s{i}" for i in range(26, n)]


def vocab(n_symbols: int) -> dict[str, int]:
    return {t: i for i, t in enumerate(SPECIALS + list(OPS) + symbols(n_symbols))}


def write_tokenizer(path: Path, n_symbols: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab(n_symbols), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))


def make_example(rng: random.Random, ops: list[str], syms: list[str], min_len: int, max_len: int
                 ) -> tuple[list[str], list[str]]:
    op = rng.choice(ops)
    body = [rng.choice(syms) for _ in range(rng.randint(min_len, max_len))]
    # sorted() orders by the symbol's index, not its spelling, so that s26 sorts after z.
    answer = sorted(body, key=syms.index) if op == "srt" else OPS[op](body)
    return [op, *body], answer


def _examples(n: int, seed: int, ops: list[str], syms: list[str], min_len: int, max_len: int,
              exclude: set[tuple[str, ...]] | None = None) -> list[tuple[list[str], list[str]]]:
    rng = random.Random(seed)
    out, seen = [], set(exclude or ())
    while len(out) < n:
        p, a = make_example(rng, ops, syms, min_len, max_len)
        # Held-out sets exclude training prompts so accuracy measures the rule, not memorisation.
        if exclude is not None and tuple(p) in seen:
            continue
        out.append((p, a))
    return out


def write_jsonl(path: Path, examples: list[tuple[list[str], list[str]]]) -> None:
    with open(path, "w") as f:
        for p, a in examples:
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(p)},
                                             {"role": "assistant", "content": " ".join(a)}]}) + "\n")


def prepare(out_dir: Path, demo: dict[str, Any], seed: int, exclude: set[tuple[str, ...]] | None = None
            ) -> dict[str, Any]:
    """Writes tokenizer.json and, per task set, <name>_train/_eval/_test.jsonl under out_dir.

    `demo["tasks"]` are the operations the data mixes (e.g. [rev]); every op in `demo.get("test_tasks",
    tasks)` also gets its own encoded test set. Returns paths, the vocabulary size and the encoded test sets
    by op (see `encode`) and their prompts (`test_prompts`). Prompts in `exclude` (another data set's
    held-out prompts) are kept out of the training and eval data."""
    out_dir.mkdir(parents=True, exist_ok=True)
    n_sym, lo, hi = int(demo["symbols"]), int(demo["min_len"]), int(demo["max_len"])
    syms, ops = symbols(n_sym), list(demo["tasks"])
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"demo.tasks: unknown {unknown}; known {sorted(OPS)}")
    train = _examples(int(demo["n_train"]), seed, ops, syms, lo, hi, exclude=exclude)
    train_set = {tuple(p) for p, _ in train}
    evals = _examples(int(demo["n_eval"]), seed + 1, ops, syms, lo, hi,
                      exclude=train_set | (exclude or set()))
    tok = out_dir / "tokenizer.json"
    write_tokenizer(tok, n_sym)
    for name, ex in (("train", train), ("eval", evals)):
        write_jsonl(out_dir / f"{name}.jsonl", ex)
    tests, test_prompts = {}, set()
    for k, op in enumerate(demo.get("test_tasks", ops)):
        test = _examples(int(demo["n_test"]), seed + 2 + k, [op], syms, lo, hi, exclude=train_set)
        write_jsonl(out_dir / f"test_{op}.jsonl", test)
        tests[op] = encode(test, vocab(n_sym), 2 * hi + 5)
        test_prompts |= {tuple(p) for p, _ in test}
    return {"tokenizer": str(tok), "train": str(out_dir / "train.jsonl"), "eval": str(out_dir / "eval.jsonl"),
            "vocab_used": len(vocab(n_sym)), "tests": tests, "test_prompts": test_prompts}


def encode(examples: list[tuple[list[str], list[str]]], voc: dict[str, int], length: int
           ) -> dict[str, np.ndarray]:
    """One example per row, right-padded to `length` - 1 (the pipeline's shifted layout):
    input_ids, targets, loss_mask (answer + EOS), segment_ids (1 on real tokens), positions."""
    t = length - 1
    rows = {k: np.zeros((len(examples), t), np.int32)
            for k in ("input_ids", "targets", "loss_mask", "segment_ids", "positions")}
    for i, (p, a) in enumerate(examples):
        head = ["<bos>", "User:", *p, "Assistant:"]  # p starts with the op word
        toks = [voc[s] for s in head + a + ["<eos>"]]
        n = len(toks) - 1
        rows["input_ids"][i, :n] = toks[:-1]
        rows["targets"][i, :n] = toks[1:]
        rows["loss_mask"][i, len(head) - 1:n] = 1  # targets from the first answer token through EOS
        rows["segment_ids"][i, :n] = 1
        rows["positions"][i, :n] = np.arange(n)
    return rows
