"""User errors in train.py and convert_torch_ckpt.py end as one line naming the problem and the fix,
exit status 2, no traceback, and before any model is built."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import convert_torch_ckpt  # noqa: E402
import train  # noqa: E402


def test_mesh_larger_than_machine_is_one_line():
    # One CPU device: no forced host device count, no accelerator.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "CUDA_VISIBLE_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", "dsv2lite_farskip"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - t0
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    print(f"exit {proc.returncode} in {took:.1f} s: {err}")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = [ln for ln in err if ln.startswith("error:")]
    assert len(lines) == 1, err
    assert "needs 8 devices, 1 available" in lines[0]
    assert "--set mesh.expert=1" in lines[0] and "8 GPUs" in lines[0]
    # It failed before building DeepSeek-V2-Lite (which would take minutes and ~60 GB).
    assert took < 120


def _train(argv: list[str], capsys) -> tuple[int, str]:
    rc = train.main(["--xla-flags", "none", *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("sets, expected", [
    (["data.paths=[/nonexistent/train.jsonl]"], "data.paths: no file matches '/nonexistent/train.jsonl'"),
    (["train.init_checkpoint=/nonexistent/ckpt"],
     "train.init_checkpoint: '/nonexistent/ckpt' does not exist"),
    (["model.num_layers=0"], "model.num_layers must be > 0"),
    (["mesh.tensor=2"], "set --set mesh.tensor=1"),
])
def test_train_user_errors(sets, expected, capsys, tmp_path):
    argv = ["--config", "tiny_farskip", "--set", f"train.output_dir={tmp_path}"]
    for s in sets:
        argv += ["--set", s]
    rc, err = _train(argv, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in lines[0]


def test_train_missing_tokenizer(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    rc, err = _train(["--config", "tiny_farskip", "--set", f"data.paths=[{data}]",
                      "--set", f"data.tokenizer={tmp_path / 'missing.json'}"], capsys)
    assert rc == 2 and "data.tokenizer:" in err and "missing.json" in err and "--set data.tokenizer=" in err


def test_convert_missing_input(capsys, tmp_path):
    rc = convert_torch_ckpt.main(["--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: --input") and "no such directory" in err
    assert "\n" not in err
