"""Tiny chat data + WordLevel tokenizer + config builder for the trainer tests (no network)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

SPECIALS = ["[UNK]", "<bos>", "<eos>", "User:", "Assistant:"]
WORDS = [f"w{i}" for i in range(100)]
TEMPLATE = {"bos": "<bos>", "eos": "<eos>", "user_prefix": "User: ", "user_suffix": "\n",
            "assistant_prefix": "Assistant: ", "assistant_suffix": "\n", "system_prefix": "",
            "system_suffix": "\n"}


def make_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))


def make_chat(path: Path, n: int, seed: int) -> None:
    """Assistant turns follow simple rules (count up from the prompt's last word) so a model can learn."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = [rng.randrange(100) for _ in range(rng.randint(2, 5))]
            start = prompt[-1]
            answer = [(start + j + 1) % 100 for j in range(rng.randint(2, 6))]
            rec = {"messages": [{"role": "user", "content": " ".join(f"w{i}" for i in prompt)},
                                {"role": "assistant", "content": " ".join(f"w{i}" for i in answer)}]}
            f.write(json.dumps(rec) + "\n")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tiny_data")
    make_tokenizer(d / "tokenizer.json")
    make_chat(d / "train.jsonl", 400, 0)
    make_chat(d / "eval.jsonl", 40, 1)
    return {"tokenizer": str(d / "tokenizer.json"), "train": str(d / "train.jsonl"),
            "eval": str(d / "eval.jsonl")}


def tiny_overrides(data: dict[str, str], out: Path, **extra: Any) -> dict[str, Any]:
    o: dict[str, Any] = {
        "data.paths": [data["train"]], "data.eval_paths": [data["eval"]], "data.tokenizer": data["tokenizer"],
        "data.template": TEMPLATE, "data.read_threads": 0, "data.seq_len": 32, "data.batch_size": 8,
        "train.output_dir": str(out), "train.log_every": 1, "train.eval_batches": 2,
        "train.kl_chunk_tokens": 64,
    }
    o.update(extra)
    return o


@pytest.fixture(scope="session")
def overrides():
    """The `tiny_overrides` builder (a fixture, since test modules should not import conftest)."""
    return tiny_overrides
