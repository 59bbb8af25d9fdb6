"""The inspect CLI as a newcomer runs it: a subprocess with a clean environment (no JAX_PLATFORMS,
no XLA_FLAGS, no PYTHONPATH), which must arrange the deviceless compile itself, stay quiet about
absent GPUs, and write every report; plus its one-line user errors."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from farskip_jax.inspect import cli

ROOT = Path(__file__).resolve().parents[2]
# tiny_farskip with a 16-wide q/k head (8 + 8): XLA's Triton GEMM emitter finds no tiling for the
# default tiny config's 48 x 16 attention-gradient matmul on the H200 target (see cli._compile).
TINY = ["--config", "tiny_farskip", "--set", "model.qk_rope_head_dim=8", "--seq-len", "64"]


def _clean_env() -> dict[str, str]:
    return {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin"}


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
                    reason="jax-cuda13-pjrt not installed")
def test_clean_environment_h200_fcsd(tmp_path: Path) -> None:
    """`inspect --mode fcsd` (the step `train.py` runs: the student's forward and backward plus the
    frozen teacher's forward) in a clean environment, on the 4-layer tiny model (3 MoE layers)."""
    out = tmp_path / "insp"
    res = subprocess.run([sys.executable, "-m", "farskip_jax", "inspect", *TINY,
                          "--target", "h200", "--mode", "fcsd", "--out", str(out)],
                         cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    # no plugin tracebacks: cuDNN check skipped (cpu platforms), ROCm's "No AMD GPUs" dropped
    assert "Traceback" not in res.stderr and "configuration error" not in res.stderr, res.stderr[-3000:]
    for name in ("report_farskip.json", "report_farskip.md", "report_farskip.trace.json",
                 "report_farskip.timeline.png", "scheduled_farskip.hlo.txt.gz"):
        assert (out / name).stat().st_size > 1000, name
    assert (out / "report_farskip.timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with gzip.open(out / "scheduled_farskip.hlo.txt.gz", "rt") as f:
        head = f.read(4000)
    assert head.startswith("HloModule") and "is_scheduled=true" in head

    rep = json.loads((out / "report_farskip.json").read_text())
    mem = rep["memory"]
    # The memory section of a small compile: every buffer class present, peak = what the runtime
    # allocates, HBM from the h200 target spec.
    assert mem["device_memory_size"] == 151397597184
    assert mem["argument_bytes"] > 100_000 and mem["output_bytes"] > 100_000 and mem["temp_bytes"] > 100_000
    assert mem["alias_bytes"] > 0  # the state is donated: new params/optimizer state reuse it
    assert mem["peak_bytes_per_device"] == (mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"]
                                            + mem["temp_bytes"])
    # XLA's simulated live peak is a lower bound of what is allocated (never above it)
    assert 0 < mem["xla_live_peak_bytes"] <= mem["peak_bytes_per_device"]
    assert mem["fraction"] == pytest.approx(mem["peak_bytes_per_device"] / mem["device_memory_size"])
    assert 0 < mem["fraction"] < 1e-3
    assert "Memory per device (XLA buffer assignment): peak" in (out / "report_farskip.md").read_text()
    t = rep["totals"]
    assert t["by_direction"]["fwd"]["count"] > 0 and t["by_direction"]["bwd"]["count"] > 0
    assert "compile" in res.stdout and "peak" in res.stdout

    # The tiny step fits an H200 with the teacher's routed experts on every device, so
    # `mesh.teacher_experts: auto` runs it so (train/remat.py), and the report says which program
    # it is: the Dispatch/Combine row exchanges (not the small count exchanges) are the student's
    # alone, forward and backward, 3 MoE layers x 2; the teacher runs layer by layer beside it.
    meta = rep["meta"]
    assert meta["remat_auto"]["policy"].endswith("+local_teacher"), meta["remat_auto"]
    assert (meta["teacher_experts"], meta["teacher_lockstep"]) == ("local", True)
    rows = [c for c in rep["collectives"] if c["kind"] in ("all-to-all", "ragged-all-to-all")
            and c["role"] in ("dispatch", "combine") and c["bytes"] >= 32 * 32 * 4]
    fwd = [c for c in rows if c["direction"] == "fwd"]
    bwd = [c for c in rows if c["direction"] == "bwd"]
    assert len(fwd) == 3 * 2 and len(bwd) == 3 * 2, (len(fwd), len(bwd))
    assert sorted(c["layer"] for c in fwd) == [1] * 2 + [2] * 2 + [3] * 2
    assert "mesh.teacher_experts=local (chosen by the memory search" in res.stdout


def test_user_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--config", "no_such_config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: config 'no_such_config' not found")
    assert cli.main(["--config", "tiny", "--set", "model.bogus=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown config key 'model.bogus'" in err[0]
    assert cli.main(["--config", "tiny", "--seq-len", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


def test_local_target_compiles_for_this_machines_devices(tmp_path: Path) -> None:
    """--target local: the real devices (8 host CPUs here) in a mesh with the model's Auto axes,
    compiled and analysed like a deviceless target (EP=8 on 2 processes runs the same code path:
    docs/gpus-and-multi-node.md)."""
    from farskip_jax.config import load_config, parse_overrides
    from farskip_jax.inspect import steps

    cfg = load_config("tiny_farskip", parse_overrides(["model.num_layers=2"]))
    parser = cli.add_inspect_args(argparse.ArgumentParser())
    args = parser.parse_args(["--target", "local", "--modes", "farskip", "--no-timeline", "--no-save-hlo",
                              "--out", str(tmp_path)])
    args.mesh = {"data": 1, "expert": 8, "tensor": 1}
    rep = cli.run_inspect(args, steps.build_train_step(cfg, seqs_per_device=1, seq_len=16))["farskip"]
    a2a = [c for c in rep["collectives"] if c["kind"] in ("all-to-all", "ragged-all-to-all")]
    assert a2a and all(c["role"] in ("dispatch", "combine", "counts") for c in a2a), \
        sorted({c["role"] for c in a2a})
    assert (tmp_path / "report_farskip.json").exists()


def test_compare_four_modes_and_their_user_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """--compare four compiles regular_bs1 (the paper's baseline), regular_bsN, farskip_bs1,
    farskip_bsN (N: the config's batch split, else 2); its errors are caught before any compile."""
    from farskip_jax.config import load_config
    from farskip_jax.inspect import steps

    dsv2 = load_config("dsv2lite_farskip")
    assert dsv2.execution.batch_split == 1 and dsv2.model.farskip.enabled
    assert steps.four_modes(dsv2) == ["regular_bs1", "regular_bs2", "farskip_bs1", "farskip_bs2"]
    base = steps.config_for(dsv2, "regular_bs1")
    assert (base.execution.batch_split, base.model.farskip.enabled) == (1, False)
    split = steps.config_for(dsv2, "farskip_bs4")
    assert (split.execution.batch_split, split.model.farskip.enabled) == (4, True)
    # --compare-regular: the config's own split
    assert steps.config_for(dsv2, "farskip_bs2").model == dsv2.model
    assert steps.config_for(dsv2, "regular").execution == dsv2.execution
    tiny = load_config("tiny")
    assert tiny.execution.batch_split == 1 and steps.four_modes(tiny)[-1] == "farskip_bs2"
    with pytest.raises(ValueError):
        steps.config_for(dsv2, "farskip_bs0")
    assert cli.main(["--config", "tiny", "--mode", "prefill", "--compare", "four"]) == 2
    assert "--compare four needs --mode train or fcsd" in capsys.readouterr().err
    odd = ["--config", "tiny", "--mode", "fcsd", "--compare", "four", "--seqs-per-device", "3"]
    assert cli.main(odd) == 2
    assert "batch split 2 does not divide --seqs-per-device 3" in capsys.readouterr().err


def _changed(a, b, prefix: str = "") -> set[str]:
    """Dotted keys whose values differ between two config dicts."""
    out = set()
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out |= _changed(x, y, f"{prefix}{k}.")
        elif x != y:
            out.add(prefix + k)
    return out


@pytest.mark.parametrize("name", ["dsv2lite_farskip", "dsv2lite", "tiny"])
def test_baselines_change_one_section_only(name: str) -> None:
    """The inspector's regular baseline differs from the FarSkip run in model.farskip alone (the
    batch split, and every other execution field, is the config's own); in `--compare four` the
    split rows differ from the one-stream rows in execution.batch_split alone."""
    from farskip_jax.config import load_config, to_dict
    from farskip_jax.inspect import steps

    cfg = load_config(name)
    modes = ("farskip", "regular", *steps.four_modes(cfg))
    runs = {mode: to_dict(steps.config_for(cfg, mode)) for mode in modes}
    assert _changed(runs["farskip"], runs["regular"]) == {"model.farskip.enabled"}
    assert _changed(to_dict(cfg), runs["farskip" if cfg.model.farskip.enabled else "regular"]) == set()
    assert runs["regular"]["execution"] == runs["farskip"]["execution"] == to_dict(cfg)["execution"]
    regular_1, regular_n, farskip_1, farskip_n = steps.four_modes(cfg)
    assert _changed(runs[regular_1], runs[regular_n]) == {"execution.batch_split"}
    assert _changed(runs[farskip_1], runs[farskip_n]) == {"execution.batch_split"}
    assert _changed(runs[regular_1], runs[farskip_1]) == {"model.farskip.enabled"}
    assert _changed(runs[regular_n], runs[farskip_n]) == {"model.farskip.enabled"}
    assert runs[regular_1]["execution"]["batch_split"] == 1


def test_useful_flops_of_the_step_main_compiles() -> None:
    """The accounting's useful side for the modes `main` builds: the DSV2-Lite FCSD step on 8 GPUs x
    4 x 4096 tokens is the issue's 358 TFLOP per device, whatever the connectivity or split."""
    from farskip_jax.config import load_config

    cfg = load_config("dsv2lite_farskip")
    args = argparse.Namespace(mesh={"data": 1, "expert": 8, "tensor": 1}, mode="fcsd", seq_len=4096,
                              seqs_per_device=4, batch=1, doc_len=None)
    useful = cli._useful_flops(cfg, args, ep=True)
    for mode in ("farskip", "regular_bs1", "farskip_bs2"):
        assert useful(mode)["per_device"] == pytest.approx(358e12, rel=2e-3)
    args.doc_len = 512  # packed documents: less attention, nothing else changes
    assert useful("farskip")["per_device"] < 350e12
