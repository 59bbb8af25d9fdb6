"""The FCSD ablation study's statistics and report (farskip_jax.ablations), on hand-made records; the
training runs themselves are the trainer's and are exercised in one slow end-to-end test."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from farskip_jax import ablations

REPO = Path(__file__).resolve().parents[2]


def test_interval_is_the_student_t_interval():
    # [1, 2, 3]: mean 2, sample sd 1, t(0.975, 2) = 4.3027 -> half-width 4.3027 / sqrt(3)
    m, h = ablations.interval([1.0, 2.0, 3.0])
    assert m == 2.0 and abs(h - 4.302653 / math.sqrt(3)) < 1e-5
    # Coverage by simulation: ~95% of intervals from 6 normal draws contain the true mean.
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(2000):
        m, h = ablations.interval(list(rng.normal(0.3, 1.0, 6)))
        hits += abs(m - 0.3) <= h
    assert 0.93 <= hits / 2000 <= 0.97
    assert math.isnan(ablations.interval([0.5])[1])


def test_verdict_needs_the_interval_to_exclude_zero():
    assert ablations.verdict([0.10, 0.12, 0.11, 0.09], expect_positive=True) == "agrees"
    assert ablations.verdict([0.10, 0.12, 0.11, 0.09], expect_positive=False) == "disagrees"
    assert ablations.verdict([0.2, -0.1, 0.05, -0.02], expect_positive=True) == "not resolved at this scale"
    assert ablations.verdict([0.0, 0.0, 0.0], expect_positive=True) == "not resolved at this scale"
    assert ablations.verdict([0.3], expect_positive=True) == "not resolved at this scale"


def test_seed_lists():
    assert ablations.parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    assert ablations.parse_seeds("60,150") == [60, 150]


def _write(out: Path, arm: str, steps: int, seed: int, rev: float, cpy: float) -> None:
    (out / "ablations").mkdir(parents=True, exist_ok=True)
    rec = {"arm": arm, "seed": seed, "steps": steps, "rev": rev, "cpy": cpy, "final_loss": 0.1, "wall_s": 1.0}
    (out / "ablations" / f"{ablations.slug(arm)}_{steps}steps_seed{seed}.json").write_text(json.dumps(rec))


def test_section_pairs_arms_by_seed_and_judges_each_finding(tmp_path):
    # Seeds differ a lot from each other but SFT is always 0.05 below KL on cpy: only pairing sees it.
    rng = np.random.default_rng(1)
    for seed in range(8):
        base = float(rng.uniform(0.2, 0.8))
        _write(tmp_path, "KL (FCSD)", 60, seed, base, base)
        _write(tmp_path, "SFT", 60, seed, base, base - 0.05)
        _write(tmp_path, "KL + L2 hidden", 60, seed, base + (0.01 if seed % 2 else -0.01), base)
        _write(tmp_path, "KL, last 75% of layers", 60, seed, base - 0.2, base - 0.2)
    md = "\n".join(ablations.section(tmp_path))
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert "| KL (FCSD) | " in md and "| 8 |" in rows["KL (FCSD)"]
    assert rows["SFT forgets more than KL (the under-represented skill)"].endswith("| agrees |")
    assert "+0.050 ± 0.000" in rows["SFT forgets more than KL (the under-represented skill)"]
    assert rows["KL alone beats KL + L2 hidden (average)"].endswith("| not resolved at this scale |")
    assert rows["FarSkip on the last 75% of layers recovers faster than on all (average)"].endswith(
        "| disagrees |")
    assert (tmp_path / "ablations.png").stat().st_size > 0


def test_section_without_runs_says_how_to_make_them(tmp_path):
    assert "python -m farskip_jax.ablations" in "\n".join(ablations.section(tmp_path))


@pytest.mark.slow
def test_end_to_end_two_seeds(tmp_path):
    """Teacher, every arm for two seeds at two tiny budgets over two worker processes, then the report."""
    cmd = [sys.executable, "-m", "farskip_jax.ablations", "--out", str(tmp_path / "out"), "--work-dir",
           str(tmp_path / "work"), "--seeds", "0-1", "--steps", "2,3", "--workers", "2",
           "--set", "demo.teacher.train.total_steps=5", "--set", "demo.n_test=16",
           "--set", "demo.n_train=500"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    files = sorted(p.name for p in (tmp_path / "out" / "ablations").iterdir())
    assert len(files) == 6 * 2 * 2
    assert "### 2 distillation steps (2 seeds)" in done.stdout and "### 3 distillation steps" in done.stdout
