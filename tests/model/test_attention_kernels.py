"""The fused-kernel attention path (model/attention_kernels.py) and how `attention: auto` picks it.

CPU part (fp32): everything that is ours in the kernel path (document starts, the tokamax Mask,
the custom VJP carrying the kernel's softmax statistics, the per-device batch split of
custom_partitioning, GQA's unrepeated key/value heads) runs with tokamax's "xla" implementation,
which takes the same arguments and Mask as the GPU kernels, against `reference_attention`,
forward and gradients, on packed documents of odd lengths with padding (id 0) at the end of a
row. Negative controls: wrong document starts, and a segment id split over two runs (outside the
kernel path's contract), give different results.

Deviceless part: the training-style forward + backward compiled for an H200 holds tokamax's Mosaic
GPU kernels (one forward, two backward custom calls) and no [T, T] array; batch-sharded over 8
GPUs it runs per device with no collective; the tensor-parallel prefill compiles with it. MI300X
(in a subprocess, as tests/inspect/test_rocm.py): the Pallas-Triton kernels compile for gfx942.
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
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import record
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax.config import ConfigError
from farskip_jax.model import attention_kernels as ak
from farskip_jax.model.attention import attention_core, reference_attention, resolve_attention

BAR = 1e-5
SCALE = 0.3
ROOT = Path(__file__).resolve().parents[2]


def _segments(t: int, lengths: list[int]) -> np.ndarray:
    """Row 0: documents 1..n of `lengths`, then padding (id 0, the pipeline's) to t; row 1: one
    document of id 7 (no padding)."""
    row = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(t - sum(lengths))])
    return np.stack([row, np.full(t, 7)]).astype(np.int32)


def _inputs(t: int, h: int, g: int, kd: int, vd: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (2, t, h, kd))
    k = jax.random.normal(ks[1], (2, t, g, kd))
    v = jax.random.normal(ks[2], (2, t, g, vd))
    return q, k, v, jax.random.normal(ks[3], (2, t, h, vd))


def _reference(q, k, v, seg):
    group = q.shape[2] // k.shape[2]
    return reference_attention(q, jnp.repeat(k, group, 2), jnp.repeat(v, group, 2), seg, SCALE)


def _value_and_grads(fn, q, k, v, d_out):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(d_out))


def _err(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def test_document_starts() -> None:
    seg = np.array([[3, 3, 3, 5, 9, 9, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0, 4, 4, 2, 2, 2, 2, 6]], np.int32)
    want = [[0, 0, 0, 3, 4, 4, 6, 6], [0] * 8, [0, 1, 1, 3, 3, 3, 3, 7]]
    assert np.asarray(ak.document_starts(jnp.asarray(seg))).tolist() == want
    assert ak.document_starts(jnp.asarray(seg)).dtype == jnp.int32


# (T, query heads, key/value heads, q/k head dim, v head dim, document lengths): MLA's unequal head
# dims, GQA's grouped heads, odd lengths, one-token documents, padding runs of 0, 1 or many tokens.
CASES = {
    "mla_t45": (45, 3, 3, 12, 8, [10, 1, 20]),
    "mla_t61_no_padding": (61, 3, 3, 12, 8, [7, 30, 24]),
    "gqa_t45": (45, 4, 2, 8, 8, [3, 17, 9, 1]),
    "gqa_t61_mqa": (61, 4, 1, 8, 8, [60]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_path_matches_reference_fp32(name: str) -> None:
    t, h, g, kd, vd, lengths = CASES[name]
    q, k, v, d_out = _inputs(t, h, g, kd, vd, seed=t + h)
    seg = jnp.asarray(_segments(t, lengths))
    ours = jax.jit(lambda q, k, v: ak.kernel_attention(q, k, v, seg, SCALE, "xla"))
    got = _value_and_grads(ours, q, k, v, d_out)
    want = _value_and_grads(jax.jit(lambda q, k, v: _reference(q, k, v, seg)), q, k, v, d_out)
    for part, a, b in zip(("out", "dq", "dk", "dv", "out_no_grad"), (*got, ours(q, k, v)), (*want, want[0]),
                          strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, part
        err = _err(a, b)
        record("kernel_path_vs_reference", f"{name}_{part}", err)
        assert err <= BAR, (part, err)
    assert float(jnp.abs(want[2]).max()) > 0.1  # the gradients are not trivially zero


def test_wrong_document_starts_differ() -> None:
    """Negative control: the same call with every start at 0 (causal across documents) or shifted
    by one token is far from the reference; the right starts match it."""
    t, h, g, kd, vd, lengths = CASES["mla_t45"]
    q, k, v, _ = _inputs(t, h, g, kd, vd)
    seg = jnp.asarray(_segments(t, lengths))
    want = _reference(q, k, v, seg)
    starts = ak.document_starts(seg)
    run = jax.jit(lambda s: ak._attend(q, k, v, s, SCALE, "xla", None))
    assert _err(run(starts), want) <= BAR
    for wrong in (jnp.zeros_like(starts), jnp.maximum(starts - 1, 0)):
        assert _err(run(wrong), want) > 0.05


def test_split_document_is_outside_the_contract() -> None:
    """A segment id in two separate runs of a row is one document to the reference and two to the
    kernel path (module contract): the second run's rows differ, the first run's agree."""
    t = 24
    q, k, v, _ = _inputs(t, 2, 2, 8, 8)
    seg = jnp.asarray(np.repeat(np.array([[1, 2, 1], [1, 2, 1]], np.int32), [8, 8, 8], axis=1))
    got, want = ak.kernel_attention(q, k, v, seg, SCALE, "xla"), _reference(q, k, v, seg)
    assert _err(got[:, :16], want[:, :16]) <= BAR
    assert _err(got[:, 16:], want[:, 16:]) > 0.05


def test_batch_sharded_runs_per_device() -> None:
    """Batch split over conftest's 8 CPU devices: forward and gradients equal the one-device run and
    the compiled program moves nothing between devices (custom_partitioning keeps each row local)."""
    t, h, g, kd, vd, lengths = CASES["gqa_t45"]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    rows = NamedSharding(mesh, P("x"))
    ks = jax.random.split(jax.random.key(3), 4)
    q, k, v, d_out = (jax.random.normal(kk, (8, t, hh, d)) for kk, hh, d in
                      zip(ks, (h, g, g, h), (kd, kd, vd, vd), strict=True))
    seg = jnp.asarray(np.concatenate([_segments(t, lengths)] * 4))

    def grads(q, k, v, seg, d_out):
        fn = lambda q, k, v: ak.kernel_attention(q, k, v, seg, SCALE, "xla")  # noqa: E731
        return _value_and_grads(fn, q, k, v, d_out)

    sharded = jax.jit(grads, in_shardings=(rows,) * 5, out_shardings=(rows,) * 4)
    hlo = sharded.lower(q, k, v, seg, d_out).compile().as_text()
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", hlo)
    for a, b in zip(sharded(q, k, v, seg, d_out), jax.jit(grads)(q, k, v, seg, d_out), strict=True):
        assert _err(a, b) <= BAR
    want = _reference(q, k, v, seg)
    assert _err(sharded(q, k, v, seg, d_out)[0], want) <= BAR


def test_auto_resolution() -> None:
    """auto: the fused kernel on Hopper / gfx942 for bf16 and fp16, blockwise on CPU, other GPUs and
    fp32; tokamax without a kernel and cudnn are ConfigErrors naming the fix."""
    cpu = jax.devices()[0]
    h200 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200 141GB HBM3e", compute_capability="9.0")
    a100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
    mi300x = SimpleNamespace(platform="gpu", device_kind="MI300X", compute_capability="<unknown>")
    mi300x_real = SimpleNamespace(platform="rocm", device_kind="AMD Instinct MI300X",
                                  compute_capability="gfx942")
    mi250 = SimpleNamespace(platform="rocm", device_kind="AMD Instinct MI250X", compute_capability="gfx90a")
    bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
    assert resolve_attention("auto", h200, bf16) == resolve_attention("auto", h200, f16) == "mosaic_gpu"
    assert resolve_attention("tokamax", h200, bf16) == "mosaic_gpu"
    assert resolve_attention("auto", mi300x, bf16) == "pallas_triton"
    assert resolve_attention("auto", mi300x_real, bf16) == "pallas_triton"
    for dev, dt in ((cpu, bf16), (cpu, f32), (h200, f32), (a100, bf16), (mi250, bf16), (mi300x, f32)):
        assert resolve_attention("auto", dev, dt) == "blockwise"
    with pytest.raises(ConfigError, match="tokamax: no fused attention kernel.*auto or blockwise"):
        resolve_attention("tokamax", cpu, bf16)
    with pytest.raises(ConfigError, match="tokamax: no fused attention kernel.*float32"):
        resolve_attention("tokamax", h200, f32)
    assert resolve_attention("blockwise", h200, bf16) == "blockwise"
    assert resolve_attention("reference", h200, bf16) == "reference"
    with pytest.raises(ConfigError, match="cudnn is not supported for MLA.*192 vs 128"):
        resolve_attention("cudnn", h200, bf16, (192, 128))
    with pytest.raises(ConfigError, match="cudnn is not supported: .*no segment ids"):
        resolve_attention("cudnn", h200, bf16, (128, 128))
    with pytest.raises(ConfigError, match="must be one of"):
        resolve_attention("flash", cpu, bf16)


def test_attention_core_on_cpu_is_blockwise_with_grouped_heads() -> None:
    """On the CPU `auto` and `tokamax`-less configs run blockwise; GQA's unrepeated key/value heads
    are repeated there (query head h reads head h // (H / G))."""
    t, h, g, kd, vd, lengths = CASES["gqa_t45"]
    q, k, v, _ = _inputs(t, h, g, kd, vd)
    seg = jnp.asarray(_segments(t, lengths))
    got = jax.jit(lambda q, k, v: attention_core(q, k, v, seg, SCALE, "auto", 8, 8))(q, k, v)
    assert _err(got, _reference(q, k, v, seg)) <= BAR
    with pytest.raises(ConfigError, match="execution.attention=tokamax"):
        attention_core(q, k, v, seg, SCALE, "tokamax")


# ---------------------------------------------------------------------------------------------------
# Deviceless compiles.

_T = 1024  # reduced: 2 rows of 1024 tokens, 4 heads (the report's full-size numbers: module doc)


def _h200_mesh(n: int) -> jax.sharding.Mesh:
    pytest.importorskip("jax_plugins.xla_cuda13", reason="jax-cuda13-pjrt not installed")
    from farskip_jax.xla import aot

    return aot.make_target_mesh("h200", {"x": n})


def _train_hlo(mesh: jax.sharding.Mesh, impl: str, b: int, h: int, g: int, kd: int, vd: int
               ) -> tuple[str, dict]:
    """Scheduled HLO and memory of jax.grad of a loss through attention_core (bf16, rows over x)."""
    from farskip_jax.xla import aot

    rows = NamedSharding(mesh, P("x"))

    def loss(q, k, v, seg, ct):
        return jnp.sum(attention_core(q, k, v, seg, 0.1, impl).astype(jnp.float32) * ct)

    spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=rows)  # noqa: E731
    specs = (spec((b, _T, h, kd)), spec((b, _T, g, kd)), spec((b, _T, g, vd)), spec((b, _T), jnp.int32),
             spec((b, _T, h, vd), jnp.float32))
    # The target as the default device while tracing (compile_scheduled_hlo does it too, once its
    # xla/aot.py change is in): attention `auto` reads it.
    with jax.default_device(mesh.devices.flat[0]):
        art = aot.compile_scheduled_hlo(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), *specs, target="h200")
    return art.hlo_text, art.memory


def _kernel_calls(hlo: str, target: str = "mosaic_gpu_v2") -> list[str]:
    return [ln for ln in hlo.splitlines() if f'custom_call_target="{target}"' in ln]


def _t_by_t(hlo: str) -> list[str]:
    return sorted(set(re.findall(rf"\w+\[(?:\d+,)*{_T},{_T}(?:,\d+)*\]", hlo)))


def test_h200_training_attention_is_the_mosaic_kernel() -> None:
    """MLA head dims (192 / 128), one device: three Mosaic GPU kernels (forward, dq, dk/dv), no
    array with a [T, T] pair of dims, a few MiB of temporaries; the reference's control has them."""
    mesh = _h200_mesh(1)
    hlo, mem = _train_hlo(mesh, "auto", 2, 4, 4, 192, 128)
    assert len(_kernel_calls(hlo)) == 3
    assert _t_by_t(hlo) == []
    print(f"KERNEL h200 MLA forward+backward B=2 T={_T} H=4: temp {mem['temp_bytes'] / 2**20:.1f} MiB")
    assert mem["temp_bytes"] < 64 * 2**20
    ref_hlo, _ = _train_hlo(mesh, "reference", 2, 4, 4, 192, 128)
    assert _kernel_calls(ref_hlo) == [] and any(s.startswith("f32[") for s in _t_by_t(ref_hlo))


def test_h200_gqa_reads_unrepeated_heads_and_splits_the_batch() -> None:
    """GQA (8 query heads over 2 key/value heads), 8 rows over 8 GPUs: each kernel sees one row and
    the 2 key/value heads (nothing repeats them), and no collective appears."""
    hlo, _ = _train_hlo(_h200_mesh(8), "auto", 8, 8, 2, 128, 128)
    calls = _kernel_calls(hlo)
    assert len(calls) == 3
    fwd = next(c for c in calls if re.search(r"= \(bf16\[1024,8,128\]\S*, f32\[8,1024\]", c))
    assert f"bf16[{_T},2,128]" in fwd and f"bf16[8,{_T}" not in fwd  # one row per device, G=2 heads
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", hlo)
    assert _t_by_t(hlo) == []


def test_h200_tensor_parallel_prefill_compiles_with_the_kernel() -> None:
    """The TP prefill (the whole model in one shard_map over `tensor`, 2 heads per rank) of the tiny
    config in bf16: every layer's attention is the Mosaic kernel."""
    gpus = _h200_mesh(2)
    from farskip_jax.config import load_config, parse_overrides
    from farskip_jax.inspect import steps
    from farskip_jax.xla import aot

    cfg = load_config("tiny", parse_overrides(["model.dtype=bfloat16", "model.num_layers=2"]))
    mesh = jax.sharding.Mesh(gpus.devices.reshape(1, 1, 2), ("data", "expert", "tensor"))
    fn, specs = steps.build_prefill_step(cfg, batch=1, seq_len=128)(mesh, "farskip")
    with jax.default_device(gpus.devices.flat[0]):
        hlo = aot.compile_scheduled_hlo(fn, *specs, target="h200").hlo_text
    attn = [c for c in _kernel_calls(hlo) if "attention/core" in c]
    assert len(attn) == 2


ROCM_SCRIPT = r"""
import json, re, sys
from farskip_jax.xla import rocm_standins
rocm_standins.enable()
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from farskip_jax.xla import aot
from farskip_jax.model.attention import attention_core
T = 1024
out = {}
for n, b in ((1, 2), (8, 8)):
    mesh = aot.make_target_mesh("mi300x", {"x": n})
    rows = NamedSharding(mesh, P("x"))
    spec = lambda s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=rows)
    qkv = (spec((b, T, 4, 192)), spec((b, T, 4, 192)), spec((b, T, 4, 128)), spec((b, T), jnp.int32))
    fwd = jax.jit(lambda q, k, v, s: attention_core(q, k, v, s, 0.1, "auto"))
    loss = lambda q, k, v, s, ct: jnp.sum(attention_core(q, k, v, s, 0.1, "auto").astype(jnp.float32) * ct)
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for name, fn, args in (("fwd", fwd, qkv), ("train", bwd, qkv + (spec((b, T, 4, 128), jnp.float32),))):
        with jax.default_device(mesh.devices.flat[0]):
            art = aot.compile_scheduled_hlo(fn, *args, target="mi300x")
        txt = art.hlo_text
        out[f"{name}_{n}"] = {
            "kernels": len(re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton"', txt)),
            "t_by_t": sorted(set(re.findall(r"\w+\[(?:\d+,)*%d,%d(?:,\d+)*\]" % (T, T), txt))),
            "collectives": len(re.findall(r"all-gather|all-reduce|all-to-all|collective-permute", txt)),
            "temp_mib": art.memory["temp_bytes"] / 2**20}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.rocm
@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_rocm7") is None,
                    reason="jax-rocm7-pjrt not installed")
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for the stand-ins")
def test_mi300x_attention_is_the_pallas_triton_kernel() -> None:
    """gfx942, MLA head dims: forward one Triton kernel and no [T, T] array; forward + backward two
    kernels (tokamax's backward is one kernel for dq, dk, dv) with its dense boolean mask as the only
    [T, T] arrays (pred/s32 index arrays of the mask, no fp32 scores); 8 rows over 8 GPUs: per device,
    no collective."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    res = subprocess.run([sys.executable, "-c", ROCM_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, res.stderr[-3000:]
    out = json.loads(line[7:])
    for n in (1, 8):
        fwd, train = out[f"fwd_{n}"], out[f"train_{n}"]
        assert fwd["kernels"] == 1 and fwd["t_by_t"] == []
        assert train["kernels"] == 2
        assert train["t_by_t"] and all(s.startswith(("pred[", "s32[")) for s in train["t_by_t"])
        assert fwd["collectives"] == train["collectives"] == 0
        print(f"KERNEL mi300x MLA forward+backward on {n} device(s): temp {train['temp_mib']:.1f} MiB")
