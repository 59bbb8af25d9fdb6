"""Synthetic PGLE profiles (farskip_jax/xla/pgle.py): costing, XLA's acceptance, schedule change.

The compile tests use a toy EP=8 MoE train step (forward + backward) in FarSkip and regular
connectivity. H200 runs in the pytest process (default suite; the CUDA topology coexists with the
8 fake CPU devices, see test_deviceless.py); MI300X runs in a subprocess because the ROCm
stand-ins must be in place before JAX discovers its plugins (``pytest -m rocm``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax.inspect import hlo
from farskip_jax.xla import costs, hlo_parse, links, pgle

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
HAS_ROCM = importlib.util.find_spec("jax_plugins.xla_rocm7") is not None

# Toy sizes: 2 layers, 2048 tokens x 1024 per device, top-2 so each Dispatch/Combine moves 8 MiB per
# device; attention, shared and expert GEMMs are each shorter than one all-to-all on both targets,
# so where the scheduler puts them decides how much is hidden (communication-bound, like
# DeepSeek-V2-Lite's MI300X step).
LAYERS, TOKENS, D, TOP_K, FFN = 2, 2048, 1024, 2, 1024
# all-to-alls per step: layers x (Dispatch, Combine) x (forward, backward), less FarSkip's first
# backward Dispatch (layer 0's MoE reads the step input, whose gradient nobody asks for: XLA drops it)
A2A_COUNT = {"farskip": 4 * LAYERS - 1, "regular": 4 * LAYERS}


def moe_step(mesh: Any, mode: str, layers: int = LAYERS) -> tuple[Any, tuple[Any, ...]]:
    """Jitted gradient of a toy EP=8 MoE stack over mesh axis 'x' and its abstract arguments.

    farskip: A = attn(y), R = moe(x), S = shared(x); y' = x + A + S; x' = y' + R (the R of layer k
    is not needed before layer k+1's MoE). regular: h = x + attn(x); x' = h + shared(h) + moe(h).
    """

    def attn(h: Any, w: dict[str, Any]) -> Any:
        with jax.named_scope("attention"):
            return jnp.tanh(h @ w["qkv"])[:, :D] @ w["o"]

    def moe(h: Any, w: dict[str, Any]) -> Any:
        with jax.named_scope("dispatch"):
            d = jax.lax.all_to_all(jnp.tile(h, (TOP_K, 1)), "x", 0, 0, tiled=True)
        with jax.named_scope("experts"):
            e = jax.nn.gelu(d @ w["e1"]) @ w["e2"]
        with jax.named_scope("combine"):
            c = jax.lax.all_to_all(e, "x", 0, 0, tiled=True)
        return c.reshape(TOP_K, TOKENS, D).sum(0)

    def shared(h: Any, w: dict[str, Any]) -> Any:
        with jax.named_scope("shared"):
            return jax.nn.gelu(h @ w["s1"]) @ w["s2"]

    def loss(ws: list[dict[str, Any]], x: Any) -> Any:
        y = x
        for i, w in enumerate(ws):
            with jax.named_scope(f"layer_{i}"):
                if mode == "farskip":
                    a, r, s = attn(y, w), moe(x, w), shared(x, w)
                    y = x + a + s
                    x = y + r
                else:
                    h = x + attn(x, w)
                    x = h + shared(h, w) + moe(h, w)
        return jax.lax.psum(jnp.sum(x.astype(jnp.float32) ** 2), "x")

    shapes = {"qkv": (D, 3 * D), "o": (D, D), "e1": (D, FFN), "e2": (FFN, D), "s1": (D, FFN), "s2": (FFN, D)}
    rep = NamedSharding(mesh, P())
    ws = [{k: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=rep) for k, s in shapes.items()}
          for _ in range(layers)]
    x = jax.ShapeDtypeStruct((8 * TOKENS, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    fn = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(), P("x")), out_specs=P(),
                               check_vma=False))
    return fn, (ws, x)


def summarize(res: pgle.PgleCompile, target: str) -> dict[str, Any]:
    """Before/after numbers of one synthetic-PGLE compile (JSON-able, for the subprocess too)."""
    out: dict[str, Any] = {"num_costs": res.num_costs, "profile": Path(res.profile_path).name,
                           "fingerprint": res.fingerprint}
    for name, art in (("base", res.baseline), ("pgle", res.artifacts)):
        a = hlo.analyze(art.hlo_text, target)
        mod = hlo_parse.parse_hlo(art.hlo_text)
        out[name] = {"a2a_hidden": a.totals["by_kind"]["all-to-all"]["hidden_frac"],
                     "all_hidden": a.totals["all"]["hidden_frac"], "step_us": a.totals["est_step_us"],
                     "a2a_count": a.totals["by_kind"]["all-to-all"]["count"],
                     "sync": a.totals["all"]["sync"],
                     "order": [i.name for i in mod.computations[mod.entry].instrs]}
    out["same_order"] = out["base"].pop("order") == out["pgle"].pop("order")
    return out


def rejected(fn: Any, specs: tuple[Any, ...], target: str, profile: Path) -> str:
    """Compile with ``profile`` under the strict checker; returns XLA's error text ('' = accepted)."""
    from farskip_jax.xla import aot

    opts = dict(pgle.STRICT_OPTIONS, **{pgle.PROFILE_OPTION: str(profile)})
    try:
        aot.compile_scheduled_hlo(fn, *specs, target=target, compiler_options=opts)
    except Exception as e:  # JaxRuntimeError / XlaRuntimeError depending on jaxlib
        return str(e)
    return ""


def drop_most_expensive(profile: str, out: Path) -> str:
    """Write ``profile`` minus its most expensive compute op that is not a Triton GEMM fusion to
    ``out``; returns the dropped line.

    Why not the GEMM fusions (jaxlib 0.12, H200 deviceless): a profile that lacks a
    ``gemm_fusion*`` op's cost fails the compile in XLA's autotuner ("No supported config found"),
    before the scheduler's accuracy checker runs; a profile that lacks any other op gets the
    checker's "missing instructions". The first is checked apart
    (``test_h200_profile_without_a_gemm_fusion_is_refused``)."""
    lines = Path(profile).read_text().splitlines()
    compute = [ln for ln in lines if ln.startswith("costs") and "-start" not in ln
               and 'name: "gemm_fusion' not in ln]
    top = max(compute, key=lambda ln: float(re.search(r"cost_us: ([0-9.e+-]+)", ln).group(1)))
    out.write_text("\n".join(ln for ln in lines if ln != top) + "\n")
    return top


def negative_controls(fn: Any, specs: tuple[Any, ...], target: str, res: pgle.PgleCompile,
                      tmp: Path) -> dict[str, str]:
    """The profile minus its most expensive compute op, and the profile of another module (every name
    changed): the strict checker must reject both (else 'accepted' in the main test would prove
    nothing). Triton GEMM fusions keep their entries in both, for ``drop_most_expensive``'s reason:
    without them XLA's autotuner fails the compile before the checker is reached."""
    top = drop_most_expensive(res.profile_path, tmp / "drop.pbtxt")
    other = [re.sub(r'name: "((?!gemm_fusion)[^"]+)"', r'name: "\1_other"', ln)
             for ln in Path(res.profile_path).read_text().splitlines()]
    (tmp / "other.pbtxt").write_text("\n".join(other) + "\n")
    return {"dropped": top, "drop": rejected(fn, specs, target, tmp / "drop.pbtxt"),
            "other_module": rejected(fn, specs, target, tmp / "other.pbtxt")}


# ------------------------------------------------------------------ costing, no compile ------

_FP = "0123456789abcdef0123456789abcdef"
_GEMM_CFG = ('backend_config={"gemm_backend_config":{"dot_dimension_numbers":'
             '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}')
_CARRY = "(s32[], bf16[2048,1024]{1,0}, bf16[1024,1024]{1,0})"
# A module as XLA dumps it at scheduler entry: collectives still wrapped in async-start/-done, a
# while loop with a known trip count, one all-to-all in groups of 4.
_ENTRY_HLO = "\n".join([
    "HloModule jit_step, is_scheduled=true, num_partitions=8, "
    f'frontend_attributes={{fingerprint_before_lhs="{_FP}"}}',
    "",
    "%async_computation (param_0: bf16[2048,1024]) -> bf16[2048,1024] {",
    "  %param_0 = bf16[2048,1024]{1,0} parameter(0)",
    "  ROOT %all_to_all.3 = bf16[2048,1024]{1,0} all-to-all(%param_0), channel_id=1, "
    "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}",
    "}",
    "",
    f"%body (p: {_CARRY}) -> {_CARRY} {{",
    f"  %p = {_CARRY} parameter(0)",
    "  %i = s32[] get-tuple-element(%p), index=0",
    "  %h = bf16[2048,1024]{1,0} get-tuple-element(%p), index=1",
    "  %w = bf16[1024,1024]{1,0} get-tuple-element(%p), index=2",
    "  %custom-call.7 = (bf16[2048,1024]{1,0}, s8[0]{0}) custom-call(%h, %w), "
    f'custom_call_target="__cublas$lt$matmul", {_GEMM_CFG}',
    "  %g = bf16[2048,1024]{1,0} get-tuple-element(%custom-call.7), index=0",
    f"  ROOT %t = {_CARRY} tuple(%i, %g, %w)",
    "}",
    "",
    f"%cond (c: {_CARRY}) -> pred[] {{",
    f"  %c = {_CARRY} parameter(0)",
    "  %ci = s32[] get-tuple-element(%c), index=0",
    "  %k = s32[] constant(3)",
    "  ROOT %lt = pred[] compare(%ci, %k), direction=LT",
    "}",
    "",
    "ENTRY %main (x: bf16[2048,1024], w: bf16[1024,1024]) -> bf16[2048,1024] {",
    "  %x = bf16[2048,1024]{1,0} parameter(0)",
    "  %w0 = bf16[1024,1024]{1,0} parameter(1)",
    "  %all-to-all-start = ((bf16[2048,1024]{1,0}), bf16[2048,1024]{1,0}) async-start(%x), "
    "calls=%async_computation",
    "  %zero = s32[] constant(0)",
    f"  %init = {_CARRY} tuple(%zero, %x, %w0)",
    f"  %while.1 = {_CARRY} while(%init), condition=%cond, body=%body, "
    'backend_config={"known_trip_count":{"n":"3"}}',
    "  %all-to-all-done = bf16[2048,1024]{1,0} async-done(%all-to-all-start)",
    "  %out = bf16[2048,1024]{1,0} get-tuple-element(%while.1), index=1",
    "  ROOT %add.1 = bf16[2048,1024]{1,0} add(%out, %all-to-all-done)",
    "}",
    "",
])


def test_profile_costs_every_scheduled_instruction() -> None:
    costs = pgle.profile_costs(_ENTRY_HLO, "mi300x")
    # entry, while body and condition; not the async-wrapped computation; dones left out
    assert "all-to-all-done" not in costs and "all_to_all.3" not in costs and "param_0" not in costs
    mod = hlo_parse.parse_hlo(_ENTRY_HLO)
    scheduled = {i.name for c in ("main", "body", "cond") for i in mod.computations[c].instrs}
    assert set(costs) == scheduled - {"all-to-all-done"}
    # all-to-all of 4 MiB in groups of 4 (read from the wrapped op, not the default 8 partitions):
    # 3/4 of the buffer over 3 xGMI links of 64 GB/s + 5 us floor
    assert costs["all-to-all-start"] == pytest.approx(4 * 2**20 * 0.75 / (3 * 64e9) * 1e6 + 5.0)
    assert costs["all-to-all-start"] == pytest.approx(21.384, abs=1e-3)
    gemm = 2 * 2048 * 1024 * 1024 / 1307.4e12 * 1e6  # compute-bound at bf16 peak
    assert costs["custom-call.7"] == pytest.approx(gemm) and gemm == pytest.approx(3.285, abs=1e-3)
    assert costs["while.1"] == pytest.approx(3 * gemm)  # trip count x body
    for bookkeeping in ("x", "w0", "init", "zero", "out", "i", "h", "t", "c", "k"):
        assert costs[bookkeeping] == 0.0
    assert costs["add.1"] > 0  # elementwise: HBM traffic at 5.3 TB/s
    h200 = pgle.profile_costs(_ENTRY_HLO, "h200")
    assert h200["all-to-all-start"] == pytest.approx(4 * 2**20 * 0.75 / 450e9 * 1e6 + 5.0)


# jaxlib 0.12 makes some small dynamic slices inside loops async fusions (the FCSD step's loss-chunk
# loop on H200): at the scheduler's entry an async-start/-done pair wrapping the fusion (after it,
# fusion-start/-done). XLA's PGLE looks both up, unlike a collective's done.
_ASYNC_FUSION_HLO = "\n".join([
    "HloModule jit_async_fusion, is_scheduled=true, num_partitions=8",
    "",
    "%fused_slice (p0: f32[4], p1: s32[]) -> f32[1] {",
    "  %p0 = f32[4]{0} parameter(0)",
    "  %p1 = s32[] parameter(1)",
    "  ROOT %ds = f32[1]{0} dynamic-slice(%p0, %p1), dynamic_slice_sizes={1}",
    "}",
    "",
    "%async_computation (a0: f32[4], a1: s32[]) -> f32[1] {",
    "  %a0 = f32[4]{0} parameter(0)",
    "  %a1 = s32[] parameter(1)",
    "  ROOT %fusion = f32[1]{0} fusion(%a0, %a1), kind=kLoop, calls=%fused_slice",
    "}",
    "",
    "ENTRY %main (x: f32[4], i: s32[]) -> f32[1] {",
    "  %x = f32[4]{0} parameter(0)",
    "  %i = s32[] parameter(1)",
    "  %fusion-start = ((f32[4]{0}, s32[]), f32[1]{0}, u32[]) async-start(%x, %i), "
    "calls=%async_computation",
    "  ROOT %fusion-done = f32[1]{0} async-done(%fusion-start)",
    "}",
    "",
])


def test_async_fusion_start_and_done_are_both_costed() -> None:
    """The strict checker rejected the H200 EP32 FCSD profile (a 5-layer slice) for leaving those
    dones out ("Found 2 missing instructions": fusion-done, fusion-done.1)."""
    costs = pgle.profile_costs(_ASYNC_FUSION_HLO, "h200")
    assert set(costs) == {"x", "i", "fusion-start", "fusion-done"}
    assert costs["fusion-done"] == 0.0 and costs["fusion-start"] > 0.0


def test_write_profile_is_named_by_fingerprint(tmp_path: Path) -> None:
    path = Path(pgle.write_profile(_ENTRY_HLO, "mi300x", tmp_path / "prof"))
    assert path.name == f"{_FP}.pbtxt" and path.parent == tmp_path / "prof"
    entry_re = r'costs \{ name: "([\w.\-]+)" cost_us: ([0-9.e+-]+) \}'
    entries = re.findall(entry_re, path.read_text())
    assert {e[0]: float(e[1]) for e in entries} == pytest.approx(pgle.profile_costs(_ENTRY_HLO, "mi300x"),
                                                               rel=1e-5)
    with pytest.raises(pgle.PgleError, match="fingerprint_before_lhs"):
        pgle.module_fingerprint(_ENTRY_HLO.replace("fingerprint_before_lhs", "other"))


def test_compile_refuses_targets_without_a_cost_model() -> None:
    with pytest.raises(ValueError, match="cost_target"):  # local needs the hardware it stands for
        pgle.compile_with_synthetic_pgle(None, target="local", profile_dir=".")
    with pytest.raises(ValueError, match="tpu"):
        pgle.compile_with_synthetic_pgle(None, target="tpu", profile_dir=".")


# ------------------------------------------------------------------ H200 (default suite) -----

@pytest.fixture(scope="module")
def h200(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not HAS_CUDA:
        pytest.skip("jax-cuda13-pjrt not installed")
    from farskip_jax.xla import aot

    mesh = aot.make_target_mesh("h200", {"x": 8})
    out = {}
    for mode in ("farskip", "regular"):
        fn, specs = moe_step(mesh, mode)
        res = pgle.compile_with_synthetic_pgle(fn, *specs, target="h200",
                                               profile_dir=tmp_path_factory.mktemp(f"pgle_{mode}"))
        out[mode] = {"fn": fn, "specs": specs, "res": res, "summary": summarize(res, "h200")}
    return out


# The H200 profile's tests are `slow` (CI time budget): H200 compiles with XLA's own estimator by
# default (docs/inspector.md); the MI300X profile, the default there, keeps the same claims in the
# default suite (test_mi300x_profile_accepted: the order changes, costs matched, wrong or foreign
# profiles refused, FarSkip hides more).
@pytest.mark.slow
def test_h200_profile_accepted_and_changes_schedule(h200: dict[str, Any]) -> None:
    for mode in ("farskip", "regular"):
        s = h200[mode]["summary"]
        print(f"PGLE h200 {mode}: all-to-all hidden {s['base']['a2a_hidden']:.3f} -> "
              f"{s['pgle']['a2a_hidden']:.3f}, all {s['base']['all_hidden']:.3f} -> "
              f"{s['pgle']['all_hidden']:.3f}, est step {s['base']['step_us']:.1f} -> "
              f"{s['pgle']['step_us']:.1f} us, {s['num_costs']} costs")
        # the strict checker accepted it (compile_with_synthetic_pgle raises otherwise)
        assert "xla_gpu_pgle_profile_file_or_directory_path" in h200[mode]["res"].artifacts.compiler_options
        assert s["num_costs"] > 80 and s["profile"] == f"{s['fingerprint']}.pbtxt"
        assert s["base"]["a2a_count"] == s["pgle"]["a2a_count"] == A2A_COUNT[mode]
        assert s["base"]["sync"] <= 1 and s["pgle"]["sync"] <= 1  # the first Dispatch may stay bare
    far = h200["farskip"]["summary"]
    assert not far["same_order"]
    # the profile moves compute under the all-to-alls (measured 0.630 -> 0.740 with jaxlib 0.10.2)
    assert far["pgle"]["a2a_hidden"] > far["base"]["a2a_hidden"] + 0.05
    assert far["pgle"]["step_us"] < far["base"]["step_us"]


@pytest.mark.slow
def test_h200_profile_prices_all_to_all_by_link_model(h200: dict[str, Any]) -> None:
    text = Path(h200["farskip"]["res"].profile_path).read_text()
    a2a = [float(v) for v in re.findall(r'"all-to-all-start[.\d]*" cost_us: ([0-9.e+-]+)', text)]
    assert len(a2a) == A2A_COUNT["farskip"]
    # each moves TOP_K x 2048 x 1024 bf16 = 8 MiB per device, 7/8 of it over NVLink at 450 GB/s
    assert a2a == pytest.approx([8 * 2**20 * 7 / 8 / 450e9 * 1e6 + 5.0] * len(a2a))
    assert "all-to-all-done" not in text


@pytest.mark.slow
def test_h200_strict_checker_rejects_incomplete_profile(h200: dict[str, Any], tmp_path: Path) -> None:
    far = h200["farskip"]
    neg = negative_controls(far["fn"], far["specs"], "h200", far["res"], tmp_path)
    assert "missing instructions" in neg["drop"], (neg["dropped"], neg["drop"][:500])
    assert "missing instructions" in neg["other_module"], neg["other_module"][:500]


@pytest.mark.slow
def test_h200_profile_without_a_gemm_fusion_is_refused(h200: dict[str, Any], tmp_path: Path) -> None:
    """The profile minus its most expensive Triton GEMM fusion is refused too: XLA's autotuner
    fails the compile before the checker runs (what ``drop_most_expensive`` avoids)."""
    far = h200["farskip"]
    lines = Path(far["res"].profile_path).read_text().splitlines()
    gemms = [ln for ln in lines if ln.startswith('costs { name: "gemm_fusion')]
    assert gemms, "the H200 step has Triton GEMM fusions"
    top = max(gemms, key=lambda ln: float(re.search(r"cost_us: ([0-9.e+-]+)", ln).group(1)))
    (tmp_path / "drop.pbtxt").write_text("\n".join(ln for ln in lines if ln != top) + "\n")
    assert rejected(far["fn"], far["specs"], "h200", tmp_path / "drop.pbtxt"), top


# slow, like the H200 profile tests above.
@pytest.mark.slow
def test_h200_profile_survives_rematerialization(h200: dict[str, Any], tmp_path: Path) -> None:
    """Memory limit at its floor (slop factor 0 -> 64 MiB): rematerialization renames instructions
    after the scheduler, which the ERROR level's name verifier rejects; coverage is still checked
    first, so a complete profile is applied at WARN level and an incomplete one still fails."""
    fn, specs = h200["farskip"]["fn"], h200["farskip"]["specs"]
    tight = {"xla_gpu_memory_limit_slop_factor": 0}
    res = pgle.compile_with_synthetic_pgle(fn, *specs, target="h200", profile_dir=tmp_path / "prof",
                                           compiler_options=tight)
    assert res.checker.startswith("error before scheduling; warn")
    opts = res.artifacts.compiler_options
    assert opts["xla_gpu_pgle_accuracy_checker"] == "PGLE_STRICTNESS_LEVEL_WARN"
    assert opts[pgle.PROFILE_OPTION] == res.profile_path and opts["xla_gpu_memory_limit_slop_factor"] == 0
    drop_most_expensive(res.profile_path, tmp_path / "drop.pbtxt")
    from farskip_jax.xla import aot

    with pytest.raises(Exception, match="missing instructions"):
        aot.compile_scheduled_hlo(fn, *specs, target="h200", compiler_options=dict(
            tight, **pgle.STRICT_OPTIONS, **{pgle.PROFILE_OPTION: str(tmp_path / "drop.pbtxt")}))


# ------------------------------------------------------------------ MI300X (pytest -m rocm) --

_ROCM_SCRIPT = r"""
import json, sys
from pathlib import Path
from farskip_jax.xla import rocm_standins
rocm_standins.enable()
sys.path.insert(0, "tests/inspect")
import test_pgle as t
from farskip_jax.xla import aot, pgle
mesh = aot.make_target_mesh("mi300x", {"x": 8})
out = {}
for mode in ("farskip", "regular"):
    fn, specs = t.moe_step(mesh, mode)
    res = pgle.compile_with_synthetic_pgle(fn, *specs, target="mi300x",
                                           profile_dir=Path(sys.argv[1]) / f"pgle_{mode}")
    out[mode] = t.summarize(res, "mi300x")
    if mode == "farskip":
        out["negative"] = t.negative_controls(fn, specs, "mi300x", res, Path(sys.argv[1]))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.rocm
@pytest.mark.skipif(not HAS_ROCM, reason="jax-rocm7-pjrt not installed")
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for the stand-ins")
def test_mi300x_profile_accepted(tmp_path: Path) -> None:
    """The synthetic profile steers XLA's MI300X schedule (the order changes, every cost matched,
    a wrong or foreign profile refused), and under it FarSkip hides more all-to-all time than
    regular connectivity.

    What it no longer asserts: that the profile hides more than XLA's own estimator on this toy.
    On jaxlib 0.10.2 it did (0.675 -> 0.727: T-shirt costs thought ~5 GEMMs cover an all-to-all);
    jaxlib 0.12 gives gfx942 the speed-of-light estimator, and on this 2-layer toy it hides a little
    more than the profile (0.673 vs 0.627, measured here). The choice of the inspector's MI300X cost
    source is made on the full-size DSV2-Lite programs, where the profile hides more and estimates
    shorter steps (train, prefill, decode; BENCHMARKS.md, "MI300X cost source")."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    res = subprocess.run([sys.executable, "-c", _ROCM_SCRIPT, str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, res.stderr[-3000:]
    out = json.loads(line[7:])
    for mode in ("farskip", "regular"):
        s = out[mode]
        print(f"PGLE mi300x {mode}: all-to-all hidden {s['base']['a2a_hidden']:.3f} -> "
              f"{s['pgle']['a2a_hidden']:.3f}, all {s['base']['all_hidden']:.3f} -> "
              f"{s['pgle']['all_hidden']:.3f}, est step {s['base']['step_us']:.1f} -> "
              f"{s['pgle']['step_us']:.1f} us, {s['num_costs']} costs")
        assert not s["same_order"]
        assert s["base"]["a2a_count"] == s["pgle"]["a2a_count"] == A2A_COUNT[mode]
    far, reg = out["farskip"], out["regular"]
    assert far["pgle"]["a2a_hidden"] > reg["pgle"]["a2a_hidden"] + 0.2
    assert far["pgle"]["step_us"] < reg["pgle"]["step_us"]
    assert "missing instructions" in out["negative"]["drop"], out["negative"]
    assert "missing instructions" in out["negative"]["other_module"]


_GROUPED_CFG = ('backend_config={"grouped_gemm_backend_config":{"gemm_backend_config":'
                '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}}')
# An EP=8 Dispatch as XLA writes it: the ragged all-to-all sends the 1024 rows this device owns
# into a receive buffer sized for every peer sending all of them (8192 rows), and the grouped GEMM
# (ragged_dot) runs over that static buffer.
_EP_HLO = "\n".join([
    "HloModule jit_ep, is_scheduled=true, num_partitions=8, "
    f'frontend_attributes={{fingerprint_before_lhs="{_FP}"}}',
    "",
    "ENTRY %main (x: bf16[1024,2048], buf: bf16[8192,2048], w: bf16[8,2048,1408], o: s64[8]) "
    "-> bf16[8192,1408] {",
    "  %x = bf16[1024,2048]{1,0} parameter(0)",
    "  %buf = bf16[8192,2048]{1,0} parameter(1)",
    "  %w = bf16[8,2048,1408]{2,1,0} parameter(2)",
    "  %o = s64[8]{0} parameter(3)",
    "  %ragged-all-to-all.1 = bf16[8192,2048]{1,0} ragged-all-to-all(%x, %buf, %o, %o, %o, %o), "
    "channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}",
    "  %sizes = s64[8]{0} convert(%o)",
    "  %custom-call.3 = (bf16[8192,1408]{1,0}, s8[64]{0}) custom-call(%ragged-all-to-all.1, %w, %sizes), "
    f'custom_call_target="__cublas$lt$groupedMatmul", {_GROUPED_CFG}',
    "  ROOT %y = bf16[8192,1408]{1,0} get-tuple-element(%custom-call.3), index=0",
    "}",
    "",
])


def test_grouped_gemm_priced_at_fill_and_ragged_exchange_at_rows_sent() -> None:
    full = pgle.profile_costs(_EP_HLO, "mi300x")
    balanced = pgle.profile_costs(_EP_HLO, "mi300x", grouped_fill=0.125)
    gemm = 2 * 8192 * 2048 * 1408 / 1307.4e12 * 1e6  # static rows, compute-bound at bf16 peak
    assert full["custom-call.3"] == pytest.approx(gemm)
    assert balanced["custom-call.3"] == pytest.approx(gemm / 8)
    # what moves is the 1024 rows sent (4 MiB), not the 8192-row receive buffer; the same price in
    # the profile and in the overlap analysis
    sent = links.transfer_time_us("ragged-all-to-all", 1024 * 2048 * 2, 8, costs.HARDWARE["mi300x"])
    assert full["ragged-all-to-all.1"] == pytest.approx(sent) == balanced["ragged-all-to-all.1"]
    (rec,) = hlo.analyze(_EP_HLO, "mi300x", grouped_fill=0.125).collectives
    assert rec.transfer_us == pytest.approx(sent)
    with pytest.raises(ValueError, match="grouped_fill"):
        pgle.profile_costs(_EP_HLO, "mi300x", grouped_fill=0.0)


# The same exchange as XLA hands it to the scheduler: wrapped in an async-start whose computation's
# parameters (not the entry's instructions) are the wrapped op's operands.
_EP_ASYNC_HLO = "\n".join([
    "HloModule jit_ep, is_scheduled=true, num_partitions=8, "
    f'frontend_attributes={{fingerprint_before_lhs="{_FP}"}}',
    "",
    "%async_ragged (p0: bf16[1024,2048], p1: bf16[8192,2048], p2: s64[8]) -> bf16[8192,2048] {",
    "  %p0 = bf16[1024,2048]{1,0} parameter(0)",
    "  %p1 = bf16[8192,2048]{1,0} parameter(1)",
    "  %p2 = s64[8]{0} parameter(2)",
    "  ROOT %ragged-all-to-all.1 = bf16[8192,2048]{1,0} ragged-all-to-all(%p0, %p1, %p2, %p2, %p2, %p2), "
    "channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}",
    "}",
    "",
    "ENTRY %main (x: bf16[1024,2048], buf: bf16[8192,2048], o: s64[8]) -> bf16[8192,2048] {",
    "  %x = bf16[1024,2048]{1,0} parameter(0)",
    "  %buf = bf16[8192,2048]{1,0} parameter(1)",
    "  %o = s64[8]{0} parameter(2)",
    "  %ragged-start = ((bf16[1024,2048]{1,0}, bf16[8192,2048]{1,0}, s64[8]{0}), bf16[8192,2048]{1,0}) "
    "async-start(%x, %buf, %o), calls=%async_ragged",
    "  ROOT %ragged-done = bf16[8192,2048]{1,0} async-done(%ragged-start)",
    "}",
    "",
])


def test_wrapped_ragged_exchange_priced_at_rows_sent() -> None:
    sent = links.transfer_time_us("ragged-all-to-all", 1024 * 2048 * 2, 8, costs.HARDWARE["mi300x"])
    assert pgle.profile_costs(_EP_ASYNC_HLO, "mi300x")["ragged-start"] == pytest.approx(sent)


def test_balanced_fill_of_the_dsv2lite_buffers() -> None:
    import dataclasses

    from farskip_jax.config import load_config
    from farskip_jax.model.dispatch import balanced_grouped_fill

    dsv2 = load_config("dsv2lite")
    m, e = dsv2.model, dsv2.execution  # K=6 of 64 experts, moe_buffer_factor 2
    worst = dataclasses.replace(e, moe_buffer_factor=0.0)
    # EP=8, dropless: 16384 tokens send 6 rows each; balanced, a rank receives 8 x 16384 x 6 / 8 rows,
    # into the bounded buffer of twice that, or the worst case's 8 x 16384 x min(6, 8)
    assert e.moe_buffer_factor == 2.0
    assert balanced_grouped_fill(m, e, {"expert": 8}, True, 16384, 4096) == pytest.approx(1 / 2)
    assert balanced_grouped_fill(m, worst, {"expert": 8}, True, 16384, 4096) == pytest.approx(1 / 8)
    # a capacity of 1.25: 8 local experts x 1.25 x 4 sequences x 4096 x 6 / 64 rows per source (the
    # worst case, below the bound)
    cap = dataclasses.replace(e, capacity_factor=1.25)
    assert balanced_grouped_fill(m, cap, {"expert": 8}, True, 16384, 4096) == pytest.approx(0.8)
    # TP=8: every rank sorts all assignments and computes its eighth, in a bounded buffer of twice that
    assert balanced_grouped_fill(m, e, {"tensor": 8}, False, 4096, 4096) == pytest.approx(1 / 2)
    assert balanced_grouped_fill(m, worst, {"tensor": 8}, False, 4096, 4096) == pytest.approx(1 / 8)
    assert balanced_grouped_fill(m, e, {"expert": 1}, True, 4096, 4096) == 1.0
