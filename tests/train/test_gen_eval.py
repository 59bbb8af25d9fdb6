"""Evaluation by generation: the program sandbox (limits, timeouts, no network, crashes are
failures), pass@1 and exact match scoring, and the trainer early-stopping on generated output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from farskip_jax.config import GenEvalConfig, load_config
from farskip_jax.errors import UserError
from farskip_jax.train import trainer as trainer_mod
from farskip_jax.train.gen_eval import Task, exact_match, extract_program, load_tasks, pass_at_1, run_program

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "farskip_jax" / "data" / "tasks" / "code_tasks_tiny.jsonl"
LIMITS = GenEvalConfig(timeout_s=3.0, cpu_s=3, memory_mb=512, workers=2)
SOLUTIONS = [
    "def add(a, b):\n    return a + b",
    "def reverse_words(s):\n    return ' '.join(reversed(s.split()))",
    "def is_palindrome(s):\n    return s == s[::-1]",
    "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "def max_of_list(xs):\n    return max(xs)",
]


@pytest.mark.parametrize("source, passed, why", [
    ("assert 1 + 1 == 2", True, "passed"),
    ("assert 1 + 1 == 3", False, "AssertionError"),
    ("import sys\nsys.exit(3)", False, "exit status 3"),
    ("while True:\n    pass", False, "timeout"),  # CPU limit or wall clock, whichever comes first
    ("x = bytearray(2 * 1024**3)", False, "MemoryError"),
    ("import socket\nsocket.create_connection(('example.com', 80))", False, "network access is disabled"),
    ("open('left_behind.txt', 'w').write('x')", True, "passed"),
])
def test_sandbox(source, passed, why, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ok, reason = run_program(source, LIMITS)
    assert ok is passed, reason
    if why == "timeout":
        assert "timeout" in reason or "exit status" in reason  # SIGXCPU kills it first on a fast machine
    else:
        assert why in reason
    assert not (tmp_path / "left_behind.txt").exists()  # programs run in their own throwaway directory


def test_pass_at_1_on_the_bundled_tasks():
    metric, tasks = load_tasks(BUNDLED)
    assert metric == "pass_at_1" and len(tasks) == len(SOLUTIONS)
    fenced = [f"Here you go:\n```python\n{s}\n```\nDone." for s in SOLUTIONS]
    assert pass_at_1(tasks, fenced, LIMITS) == 1.0
    wrong = SOLUTIONS[:3] + ["def count_vowels(s):\n    return 0", "def fib(n):\n    return fib(n)", "oops("]
    assert pass_at_1(tasks, wrong, LIMITS) == pytest.approx(3 / 6)
    assert extract_program("no fence at all") == "no fence at all"


def test_exact_match_and_task_file_errors(tmp_path):
    tasks = [Task("p", answer="w1 w2"), Task("q", answer="w3")]
    assert exact_match(tasks, [" w1 w2 ", "w4"]) == 0.5
    bad = tmp_path / "bad.jsonl"
    records = [{"prompt": "p", "answer": "a"}, {"prompt": "q", "tests": "x"}]
    bad.write_text("\n".join(map(json.dumps, records)))
    with pytest.raises(UserError, match="mixes 'answer' and 'tests'"):
        load_tasks(bad)
    bad.write_text('{"prompt": "p"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:1: needs an 'answer'"):
        load_tasks(bad)


def _answer_file(tiny_data: dict[str, str], path: Path, n: int = 8) -> Path:
    """Held-out prompts of the tiny chat data with their gold answers (exact_match records)."""
    with open(path, "w") as f:
        for line in Path(tiny_data["eval"]).read_text().splitlines()[:n]:
            user, assistant = json.loads(line)["messages"]
            f.write(json.dumps({"prompt": user["content"], "answer": assistant["content"]}) + "\n")
    return path


RUN = {"train.total_steps": 6, "train.eval_every": 2, "train.checkpoint_every": 100, "train.warmup_steps": 1}


# slow (CI time budget): the default suite keeps early stopping in the trainer's loop
# (tests/train/test_trainer.py::test_early_stopping_in_loop) and the generation metrics, sandbox and
# file checks below.
@pytest.mark.slow
def test_trainer_evaluates_and_stops_on_generation(tiny_data, overrides, tmp_path):
    """exact_match by free-running greedy decoding is logged and drives early stopping."""
    answers = _answer_file(tiny_data, tmp_path / "answers.jsonl")
    extra = {**RUN, "train.eval_metric": "exact_match", "train.patience": 1,
             "train.gen_eval": {"path": str(answers), "max_new_tokens": 8, "batch_size": 4}}
    cfg = load_config("tiny_farskip", overrides(tiny_data, tmp_path / "run", **extra))
    summary = trainer_mod.Trainer(cfg).run()
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["kind"] == "eval"]
    assert evals and all(0.0 <= r["exact_match"] <= 1.0 and r["gen_samples"] == 8 for r in evals)
    assert all(r["metric"] == r["exact_match"] for r in evals)
    # A constant metric is a plateau: patience 1 stops at the second evaluation.
    if len({r["exact_match"] for r in evals}) == 1:
        assert summary["steps"] == 4 and "no improvement" in summary["stop_reason"]


@pytest.mark.slow  # the sandbox's containment is tested above; this is the same path inside training
def test_trainer_survives_garbage_programs(tiny_data, overrides, tmp_path):
    """A pass@1 file whose completions are garbage programs evaluates to 0 and training goes on."""
    extra = {**RUN, "train.eval_metric": "pass_at_1",
             "train.gen_eval": {"path": str(BUNDLED), "max_new_tokens": 6, "timeout_s": 2.0}}
    cfg = load_config("tiny_farskip", overrides(tiny_data, tmp_path / "run", **extra))
    summary = trainer_mod.Trainer(cfg).run()
    assert summary["steps"] == 6 and summary["last_eval"]["pass_at_1"] == 0.0


def test_eval_metric_needs_a_matching_file(tiny_data, overrides, tmp_path):
    from farskip_jax.config import ConfigError

    with pytest.raises(ConfigError, match="set train.gen_eval.path"):
        load_config("tiny_farskip", overrides(tiny_data, tmp_path, **{"train.eval_metric": "pass_at_1"}))
    cfg = load_config("tiny_farskip", overrides(tiny_data, tmp_path, **{
        "train.eval_metric": "exact_match", "train.gen_eval": {"path": str(BUNDLED)}}))
    with pytest.raises(UserError, match="holds pass_at_1 records"):
        trainer_mod.Trainer(cfg)
