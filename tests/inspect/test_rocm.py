"""Deviceless MI300X compile through the ROCm plugin with stand-in libraries (rocm_standins).

Runs in a subprocess: the stand-ins and the GPU-count patch must be in place before JAX discovers
its plugins, which the pytest process has already done. In the default suite (``make test``
installs the plugin and builds the stand-ins); about 45 s for this file on 2 cores."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from overlap_claims import assert_farskip_exposes_less

pytestmark = [
    pytest.mark.rocm,
    pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_rocm7") is None,
                       reason="jax-rocm7-pjrt not installed"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for the stand-ins"),
]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import json, sys
sys.path.insert(0, "tests/inspect")
from farskip_jax.xla import rocm_standins
rocm_standins.enable()
import toy_programs
from farskip_jax.xla import aot
from farskip_jax.inspect import hlo
mesh = aot.make_target_mesh("mi300x", {"x": 8})
out = {"device_kind": mesh.devices.flat[0].device_kind}
for name, lhs in (("no_lhs", False), ("lhs", True)):
    fn, specs = toy_programs.build_step(mesh, "overlap")
    art = aot.compile_scheduled_hlo(fn, *specs, target="mi300x", default_options=False,
        compiler_options={"xla_gpu_enable_latency_hiding_scheduler": lhs}, dump_lhs_schedule=True)
    a = hlo.analyze(art.hlo_text, "mi300x", art.lhs_schedule_text)
    out[name] = {"lhs_ran": a.lhs_stats is not None,
                 "collectives": {c.kind: [c.is_async, c.compute_between_us] for c in a.collectives}}
print("RESULT " + json.dumps(out))
"""


def test_mi300x_lhs_makes_collectives_async() -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, res.stderr[-3000:]
    out = json.loads(line[7:])
    assert out["device_kind"] == "MI300X"
    # without the flag the latency-hiding scheduler does not run on ROCm and both collectives stay sync
    assert not out["no_lhs"]["lhs_ran"]
    assert out["no_lhs"]["collectives"] == {"all-to-all": [False, 0.0], "all-reduce": [False, 0.0]}
    assert out["lhs"]["lhs_ran"]
    for is_async, between in out["lhs"]["collectives"].values():
        assert is_async and between > 0.5


# slow: 199 s on the CI machine's 2 cores (four full compiles: two modes, each priced by the
# synthetic PGLE profile), which put the default suite at 17 min; the H200 production-path test in
# tests/inspect/test_model_overlap.py carries FarSkip's claim in the default suite.
@pytest.mark.slow
def test_mi300x_production_train_step_farskip_exposes_less_than_regular(tmp_path: Path) -> None:
    """FarSkip's claim on the MI300X target for the step `train.py` runs, from a clean environment:
    the reduced DSV2-Lite step (3 layers, 8192-token vocabulary, 2 x 1024 tokens per device) with
    the production execution (bounded ragged dropless exchange, hipBLASLt grouped GEMM, the
    Pallas-Triton attention, one stream (`execution.batch_split: 1`), the synthetic PGLE
    profile, `execution.remat: auto`, which keeps every activation here as it does for the
    full-size step on MI300X), FarSkip vs regular with the same execution. Measured on jaxlib 0.12:
    ragged all-to-all exposed 251.6 vs 378.9 us (0.66x), all collectives 56.7% vs 49.1% hidden
    (batch split 2: 134.1 vs 204.4 us, also 0.66x). Bar 0.85x as on H200
    (tests/inspect/test_model_overlap.py)."""
    out = tmp_path / "insp"
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "farskip_jax", "inspect", "--config", "dsv2lite_farskip",
           "--set", "model.num_layers=3", "--set", "model.vocab_size=8192",
           "--seqs-per-device", "2", "--seq-len", "1024", "--no-save-hlo", "--no-timeline",
           "--target", "mi300x", "--mode", "train", "--compare-regular", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    far = json.loads((out / "report_farskip.json").read_text())["totals"]
    reg = json.loads((out / "report_regular.json").read_text())["totals"]
    f_x, r_x = far["by_kind"]["ragged-all-to-all"], reg["by_kind"]["ragged-all-to-all"]
    print(f"OVERLAP mi300x production train ragged a2a exposed: farskip {f_x['sim_exposed_us']:.1f} us, "
          f"regular {r_x['sim_exposed_us']:.1f} us")
    from farskip_jax.config import load_config

    chunks = load_config("dsv2lite_farskip").execution.batch_split
    assert_farskip_exposes_less(far, reg, chunks=chunks)


# The padded exchange, the one this test was first written for; slow since FarSkip's claim is carried
# by the production-path tests.
@pytest.mark.slow
def test_mi300x_model_train_step_farskip_beats_regular(tmp_path: Path) -> None:
    """End to end on the MI300X target, from a clean environment (no JAX_PLATFORMS, no PYTHONPATH):
    the reduced DSV2-Lite train step, FarSkip vs regular.

    Reduced for the default suite: 3 layers (2 MoE), 8192-token vocabulary, 1024 tokens per device
    (two compiles, about a minute on 2 cores). The exchange is the dense all_to_all
    (execution.ep_exchange=padded), the one this test has always measured: with the ragged exchange, FarSkip
    and regular hide about the same share of it on gfx942 (12.2% vs 11.7% measured), an open model
    question that this test of the MI300X path does not decide.
    """
    out = tmp_path / "insp"
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "farskip_jax", "inspect", "--config", "dsv2lite_farskip",
           "--set", "model.num_layers=3", "--set", "model.vocab_size=8192", "--set", "execution.remat=none",
           "--set", "execution.ep_exchange=padded", "--set", "execution.batch_split=1",
           "--seqs-per-device", "1", "--seq-len", "1024", "--no-save-hlo", "--no-timeline",
           "--target", "mi300x", "--mode", "train", "--compare-regular", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "configuration error" not in res.stderr, res.stderr[-3000:]
    far = json.loads((out / "report_farskip.json").read_text())
    reg = json.loads((out / "report_regular.json").read_text())
    assert far["meta"]["device_kind"] == "MI300X"
    assert far["memory"]["device_memory_size"] == 205822885888 and 0 < far["memory"]["fraction"] < 1

    def exchanges(rep: dict) -> list[dict]:
        return [c for c in rep["collectives"] if c["kind"] in ("all-to-all", "ragged-all-to-all")
                and c["role"] in ("dispatch", "combine")]

    def hidden(rep: dict) -> float:
        cs = exchanges(rep)
        covered = sum(min(c["compute_between_us"], c["transfer_us"]) for c in cs)
        return covered / sum(c["transfer_us"] for c in cs)

    a2a_far = exchanges(far)
    # 2 MoE layers x (Dispatch, Combine) x (forward, backward) row exchanges, all async
    assert len([c for c in a2a_far if c["bytes"] > 2**20]) == 8
    # Async, all but the last MoE layer's forward Combine: under FarSkip its result feeds the final
    # norm and the LM head at once, there is no compute it may run under, and jaxlib 0.12's
    # async-to-sync converter makes such a collective synchronous (it was async with nothing under it
    # on 0.10.2). The physical limit, as the first Dispatch's is in the H200 tests.
    last_fwd_combine = max((c for c in a2a_far if c["direction"] == "fwd" and c["role"] == "combine"),
                           key=lambda c: c["start_index"])
    assert all(c["is_async"] for c in a2a_far if c is not last_fwd_combine)
    f, r = hidden(far), hidden(reg)
    print(f"OVERLAP mi300x train dispatch/combine hidden: farskip {f:.3f} regular {r:.3f}")
    assert f > r + 0.05
