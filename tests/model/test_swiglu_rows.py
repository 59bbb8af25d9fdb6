"""The routed experts' activation kernel (model/swiglu_rows.py) against XLA's silu(gate) * up.

On CPU the Pallas kernel runs in Pallas' interpreter (the same kernel body the GPU lowering
compiles); rows the kernel does not write come back NaN there, so these tests also see which rows
it leaves alone. Inside an expert-parallel shard_map: tests/parallel/test_dropless_ep.py. The
deviceless compiles for both targets: below.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from farskip_jax.model import swiglu_rows as sr
from farskip_jax.model.dispatch import grouped_ffn


def _inputs(r: int, f: int, dtype=jnp.float32, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    gate = (3.0 * jax.random.normal(keys[0], (r, f), jnp.float32)).astype(dtype)  # silu's bend and tails
    up = jax.random.normal(keys[1], (r, f), jnp.float32).astype(dtype)
    d_h = jax.random.normal(keys[2], (r, f), jnp.float32).astype(dtype)
    return gate, up, d_h


def _value_and_grads(kernel: str, gate, up, d_h, rows: int):
    def fwd(g, u):
        return sr.swiglu_rows(g, u, jnp.int32(rows), kernel)

    h, vjp = jax.vjp(fwd, gate, up)
    return (h, *vjp(d_h))


@pytest.mark.parametrize("r,f,rows", [(256, 48, 100), (256, 48, 256), (256, 48, 0), (200, 1408 // 11, 129),
                                      (24, 16, 5)])
def test_kernel_equals_xla_on_the_rows_in_use(r: int, f: int, rows: int) -> None:
    """fp32: value, d gate and d up equal XLA's autodiff of silu(gate) * up (<= 1e-6 of the largest)
    on every row before `rows`; every row of a block that starts at or past `rows` is left unwritten
    (NaN in the interpreter), and nothing before `rows` is."""
    gate, up, d_h = _inputs(r, f)
    want = _value_and_grads("xla", gate, up, d_h, rows)
    got = jax.jit(lambda g, u, d: _value_and_grads("pallas_triton", g, u, d, rows))(gate, up, d_h)
    block_r, _ = sr._blocks(r, f)
    written = -(-rows // block_r) * block_r  # the kernel writes whole blocks of rows
    for name, a, b in zip(("h", "d_gate", "d_up"), want, got, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert not np.isnan(b[:rows]).any(), name
        if rows:
            assert np.abs(a[:rows] - b[:rows]).max() <= 1e-6 * np.abs(a[:rows]).max(), name
        assert np.isnan(b[written:]).all(), name


def test_bf16_kernel_rounds_once() -> None:
    """bf16 inputs: the kernel's error against float64 is at most XLA's (which rounds after each
    op) plus half a bf16 ulp of the value, forward and both gradients."""
    gate, up, d_h = _inputs(512, 128, jnp.bfloat16, seed=1)
    g64, u64, dh64 = (np.asarray(a, np.float64) for a in (gate, up, d_h))
    s = 1.0 / (1.0 + np.exp(-g64))
    exact = (g64 * s * u64, dh64 * u64 * s * (1.0 + g64 * (1.0 - s)), dh64 * g64 * s)
    want = _value_and_grads("xla", gate, up, d_h, 512)
    got = jax.jit(lambda g, u, d: _value_and_grads("pallas_triton", g, u, d, 512))(gate, up, d_h)
    for name, e, a, b in zip(("h", "d_gate", "d_up"), exact, want, got, strict=True):
        err_xla = np.abs(np.asarray(a, np.float64) - e)
        err_kernel = np.abs(np.asarray(b, np.float64) - e)
        half_ulp = np.abs(e) * 2.0**-8
        print(f"SWIGLU_BF16 {name}: max err kernel {err_kernel.max():.3e}, xla {err_xla.max():.3e}")
        assert (err_kernel <= err_xla + half_ulp + 1e-30).all(), name
        assert err_kernel.mean() <= err_xla.mean(), name


def test_grouped_ffn_with_the_kernel_equals_xla() -> None:
    """The three ragged dots with the kernel between them: the rows in the groups give XLA's
    values and the weights' and inputs' gradients (fp32, <= 1e-6 relative); rows past the groups
    reach no weight gradient."""
    rng = np.random.default_rng(0)
    r, d, f, g = 96, 32, 48, 4
    x = jnp.asarray(rng.normal(size=(r, d)), jnp.float32)
    w = [jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32)
         for s in ((g, d, f), (g, d, f), (g, f, d))]
    starts = jnp.asarray([0, 10, 10, 41, 70], jnp.int32)  # an empty group; rows 70..95 in none
    ct = jnp.asarray(rng.normal(size=(r, d)), jnp.float32)
    in_groups = (jnp.arange(r) < 70)[:, None]

    def loss(x, wg, wu, wd, swiglu):
        y = grouped_ffn(x, starts, wg, wu, wd, "ragged", r, swiglu)
        return jnp.sum(jnp.where(in_groups, y * ct, 0.0))

    want = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, *w, "xla")
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), static_argnums=4)(x, *w, "pallas_triton")
    assert abs(float(got[0]) - float(want[0])) <= 1e-6 * abs(float(want[0]))
    for a, b in zip(want[1], got[1], strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape[0] == r:  # dx: rows past the groups get no gradient, both ways
            a, b = a[:70], b[:70]
        assert np.isfinite(b).all()
        assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max()


def test_hopper_op_equals_tokamax_and_the_activation_apart() -> None:
    """Hopper's one op, `swiglu_ffn` (its backward kernel writes d gate and d up side by side and the
    activation transposed, a kernel transposes the rows in use, the input gradient is one GEMM,
    unmasked), against three tokamax GEMMs and XLA's activation with JAX's autodiff, tokamax's XLA
    implementation on CPU: value, the input gradient on the rows in the groups, all three weights'
    gradients, fp32 (<= 1e-6 relative; the kernels' unwritten rows past the groups are NaN in the
    interpreter and reach nothing)."""
    from farskip_jax.model.grouped_matmul import tokamax_ragged_dot

    rng = np.random.default_rng(0)
    r, d, f, g = 256, 32, 48, 4
    x = jnp.asarray(rng.normal(size=(r, d)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(g, d, f)) / np.sqrt(d), jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(g, f, d)) / np.sqrt(f), jnp.float32)
    sizes = jnp.asarray([10, 0, 31, 29], jnp.int32)  # 70 rows in groups, an empty one
    ct = jnp.asarray(rng.normal(size=(r, d)), jnp.float32)
    in_groups = (jnp.arange(r) < 70)[:, None]

    def plain(x, wg, wu, wd):
        gate = tokamax_ragged_dot(x, wg, sizes, implementation="xla")
        up = tokamax_ragged_dot(x, wu, sizes, implementation="xla")
        y = tokamax_ragged_dot(jax.nn.silu(gate) * up, wd, sizes, implementation="xla")
        return jnp.sum(jnp.where(in_groups, y * ct, 0.0))

    def hopper(x, wg, wu, wd):
        y = sr.swiglu_ffn(x, wg, wu, wd, sizes, implementation="xla")
        return jnp.sum(jnp.where(in_groups, y * ct, 0.0))

    want = jax.value_and_grad(plain, argnums=(0, 1, 2, 3))(x, w_gate, w_up, w_down)
    got = jax.jit(jax.value_and_grad(hopper, argnums=(0, 1, 2, 3)))(x, w_gate, w_up, w_down)
    assert abs(float(got[0]) - float(want[0])) <= 1e-6 * abs(float(want[0]))
    for a, b in zip(want[1], got[1], strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape[0] == r:
            a, b = a[:70], b[:70]
        assert np.isfinite(b).all()
        assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max()


@pytest.mark.parametrize("rows", [0, 1, 128, 200, 512])
def test_transpose_kernel_writes_the_blocks_in_use(rows: int) -> None:
    """`swiglu_ffn`'s backward transposes its rows by the kernel: every 128-row block that starts before
    the row count is the exact transpose, every block past it unwritten (NaN in the interpreter)."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(512, 256)), jnp.bfloat16)
    x_t = np.asarray(sr._call(sr._transpose_body, sr.KERNEL_NAMES[2], jnp.asarray([rows], jnp.int32),
                              (x,), ("fr",))[0], np.float32)
    written = -(-rows // 128) * 128
    np.testing.assert_array_equal(x_t[:, :written], np.asarray(x, np.float32).T[:, :written])
    assert np.isnan(x_t[:, written:]).all()


def test_resolution() -> None:
    """auto: xla on CPU and with grouped matmuls that compute every row; the kernel on Hopper
    with tokamax (and on gfx942: test_mi300x_compiles_the_kernel_and_prices_it_at_the_fill); an
    explicit choice is kept where the kernel can run; a wrong one is refused."""
    cpu = jax.devices("cpu")[0]
    assert sr.resolve_swiglu("auto", cpu, "blocked") == "xla"
    assert sr.resolve_swiglu("auto", cpu, "ragged") == "xla"
    assert sr.resolve_swiglu("pallas_triton", cpu, "ragged") == "pallas_triton"  # the interpreter
    assert sr.resolve_swiglu("pallas_triton", cpu, "blocked") == "xla"  # every row computed anyway
    with pytest.raises(ValueError, match="expert_swiglu='triton'"):
        sr.resolve_swiglu("triton", cpu, "ragged")

    class Device:  # a compile-only device as the CUDA plugin describes it
        platform, device_kind = "cuda", "NVIDIA H200"

        def __init__(self, cc: str) -> None:
            self.compute_capability = cc

    assert sr.resolve_swiglu("auto", Device("9.0"), "tokamax") == "pallas_triton"
    assert sr.resolve_swiglu("auto", Device("9.0"), "padded") == "xla"
    assert sr.resolve_swiglu("auto", Device("9.0"), "ragged") == "xla"  # fp32: not compiled with it
    assert sr.resolve_swiglu("auto", Device("8.0"), "tokamax") == "xla"  # not compiled here


def test_h200_runs_the_kernels_and_no_op_passes_over_the_whole_buffer() -> None:
    """Deviceless Hopper, `expert_swiglu: auto` with tokamax's grouped GEMMs, one tiny EP=8 MoE
    layer, forward and backward: the activation's kernels and the transpose kernel over the receive
    buffer's rows; tokamax's weight-gradient kernels read the two transposed results ([F, R]
    activation, [D, R] rows) as they lie; no XLA op transposes, copies or adds over a whole
    [R, D] or [R, F] buffer (with the activation and the GEMM apart there was a transpose of the
    activation, K29; with gate and up two GEMMs an add of their input gradients and a transpose of
    the rows, K30); and gate's and up's weights are joined in the backward only (a teacher's
    forward never pays for it: K30)."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="jax-cuda13-pjrt not installed")
    import re

    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from farskip_jax.config import load_config
    from farskip_jax.model.moe import MoE
    from farskip_jax.parallel import ExpertParallel
    from farskip_jax.xla import aot

    mesh = aot.make_target_mesh("h200", {"data": 1, "expert": 8, "tensor": 1})
    # F = 64 and D = 32: no buffer shape of one is the other's, nor 2F's (tokamax: N a multiple of 64)
    tiny = load_config("tiny", {"model.n_routed_experts": 16, "model.dtype": "bfloat16",
                                "model.moe_intermediate_size": 64})
    cfg, exe = tiny.model, tiny.execution
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    graphdef, state = nnx.split(MoE(cfg, nnx.Rngs(0), exe=exe), nnx.Param)
    par = ExpertParallel(mesh)
    specs = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
            mesh, P("expert") if "experts" in jax.tree_util.keystr(path) else P())), state)
    x = jax.ShapeDtypeStruct((16, 32, d), jnp.bfloat16, sharding=NamedSharding(mesh, P(("data", "expert"))))

    def loss(s, x):
        shared, routed, _ = nnx.merge(graphdef, s)(x, par.routed_fn)
        return jnp.mean((shared + routed).astype(jnp.float32) ** 2)

    hlo = aot.compile_scheduled_hlo(jax.jit(jax.grad(loss, argnums=(0, 1))), specs, x, target="h200").hlo_text
    calls = re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton"[^\n]*?'
                       r'op_name="[^"]*[/(]((?:swiglu_rows|rows)_\w+)[/)]', hlo)
    assert sorted(set(calls)) == ["rows_transpose", "swiglu_rows_bwd", "swiglu_rows_fwd"], calls
    rows = int(re.search(rf"= bf16\[(\d+),{f}\]\S* custom-call\([^\n]*swiglu_rows_fwd", hlo).group(1))
    for t, kernel in ((f"bf16[{f},{rows}]", "swiglu_rows_bwd"), (f"bf16[{d},{rows}]", "rows_transpose")):
        # made by the kernel only, and read as it lies by tokamax's kernel
        assert not re.findall(rf"= {re.escape(t)}\S* (?:transpose|fusion|copy)\(", hlo), t
        taken = re.search(rf"%([\w.\-]+) = {re.escape(t)}\S* "
                          rf"(?:get-tuple-element\(%([\w.\-]+)\)|custom-call)", hlo)
        assert taken is not None, t
        made = taken.group(2) or taken.group(1)
        assert re.search(rf"%{re.escape(made)} = [^\n]*{kernel}", hlo), t
        assert re.search(rf"custom-call\([^\n]*%{re.escape(taken.group(1))}[,)][^\n]*mosaic_gpu_v2", hlo), t
    for shape in (f"bf16[{rows},{d}]", f"bf16[{rows},{f}]", f"bf16[{rows},{2 * f}]"):
        assert not re.findall(rf"= {re.escape(shape)}\S* (?:transpose|fusion|copy|add|select)\(", hlo), shape
    # the routed experts' (2 per device; not the shared ones), joined or joined and transposed
    joined = [name for name in re.findall(rf"= bf16\[2,(?:{d},{2 * f}|{2 * f},{d})\]\S* \w+\("
                                          r'[^\n]*op_name="([^"]*)"', hlo) if "shard_map/experts" in name]
    assert joined and all("transpose(jvp" in name for name in joined), joined


ROCM_SCRIPT = r"""
import json, re
from farskip_jax.xla import rocm_standins
rocm_standins.enable()
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from farskip_jax.xla import aot
from farskip_jax.xla.costs import CostModel, HARDWARE
from farskip_jax.xla.hlo_parse import parse_hlo
from farskip_jax.model import swiglu_rows as sr
mesh = aot.make_target_mesh("mi300x", {"x": 1})
kernel = sr.resolve_swiglu("auto", mesh.devices.flat[0], "ragged")
spec = lambda s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(mesh, P()))
def f(g, u, n, ct):
    h, vjp = jax.vjp(lambda g, u: sr.swiglu_rows(g, u, n, kernel), g, u)
    return h, vjp(ct)
art = aot.compile_scheduled_hlo(jax.jit(f), spec((4096, 1408)), spec((4096, 1408)), spec((), jnp.int32),
                                spec((4096, 1408)), target="mi300x")
mod = parse_hlo(art.hlo_text)
times = {}
for fill in (1.0, 0.5):
    cost = CostModel(mod, HARDWARE["mi300x"], grouped_fill=fill)
    times[fill] = sum(cost.op_time_us(c, i) for c in mod.computations.values() for i in c.instrs
                      if 'custom_call_target="__gpu$xla.gpu.triton"' in i.attrs)
calls = re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton"[^\n]*?'
                   r'op_name="[^"]*[/(](swiglu_rows_\w+)[/)]', art.hlo_text)
print("RESULT " + json.dumps({"kernel": kernel, "calls": sorted(calls), "us": times}))
"""


def test_mi300x_compiles_the_kernel_and_prices_it_at_the_fill() -> None:
    """Deviceless gfx942 (the ROCm plugin with stand-in libraries, in a subprocess): auto picks the
    kernel, forward and backward compile to XLA's Triton custom call, and the cost model charges
    them at the grouped GEMMs' fill of their rows (half at 0.5)."""
    pytest.importorskip("jax_plugins.xla_rocm7", reason="jax-rocm7-pjrt not installed")
    proc = subprocess.run([sys.executable, "-c", ROCM_SCRIPT], capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    print(f"SWIGLU_MI300X {res}")
    assert res["kernel"] == "pallas_triton"
    assert res["calls"] == ["swiglu_rows_bwd", "swiglu_rows_fwd"]
    assert res["us"]["1.0"] > 0 and res["us"]["0.5"] == pytest.approx(res["us"]["1.0"] / 2)
