"""The one-read MLA decode kernel (model/mla_decode.py): equal to the two-einsum reference on the CPU
(the kernel body interpreted), equal inside the model's decode, and, compiled deviceless for H200
and MI300X, the only reader of the latent cache (where the reference reads it twice)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import farskip_jax
from farskip_jax.config import load_config, parse_overrides
from farskip_jax.model import attention, mla_decode
from farskip_jax.model.attention import LatentCache


def _inputs(b: int, t: int, h: int, c: int, r: int, s: int, dtype=jnp.float32, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(b, t, h, c), (b, t, h, r), (b, s, c), (b, s, r)]
    return [jax.random.normal(k, sh, jnp.float32).astype(dtype) for k, sh in zip(keys, shapes, strict=True)]


@pytest.mark.parametrize("family", ["cuda", "rocm"])
@pytest.mark.parametrize("slots", [48, 128])
def test_kernel_equals_reference(family, slots):
    """Rows of different lengths (one sees slot 0 only, one the whole cache), T=2 new tokens x 3
    heads (6 rows, padded to 16), caches of 3 / 2-4 slot blocks (block 16 at 48 slots; 64 / 32 at
    128): the blocks past a row's position, whole and partial, are masked or never read."""
    b, t, h, c, r = 3, 2, 3, 32, 16
    q_lat, q_rope, latent, rope = _inputs(b, t, h, c, r, slots)
    positions = jnp.asarray([[5, 6], [slots - 2, slots - 1], [0, 1]], jnp.int32)
    ref = mla_decode.reference(q_lat, q_rope, latent, rope, positions, 0.17)
    got = mla_decode.latent_attention(q_lat, q_rope, latent, rope, positions, 0.17, family, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_kernel_equals_reference_in_bf16():
    """bf16 inputs and output, fp32 accumulation in both: equal to bf16 rounding."""
    q_lat, q_rope, latent, rope = _inputs(2, 1, 2, 64, 16, 64, jnp.bfloat16, seed=1)
    positions = jnp.asarray([[40], [63]], jnp.int32)
    ref = mla_decode.reference(q_lat, q_rope, latent, rope, positions, 0.1).astype(jnp.float32)
    got = mla_decode.latent_attention(q_lat, q_rope, latent, rope, positions, 0.1, interpret=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), np.asarray(ref), rtol=2e-2, atol=2e-2)


def test_shapes_the_kernel_takes():
    assert mla_decode.fits(512, 64, 4096) and mla_decode.slot_block(4096, "cuda") == 64
    assert mla_decode.slot_block(4096, "rocm") == 32 and mla_decode.slot_block(48, "cuda") == 16
    assert not mla_decode.fits(16, 4, 64)  # the tiny test model's rope dim: the einsums run
    assert not mla_decode.fits(512, 64, 40)  # no 16-slot block divides the cache
    with pytest.raises(ValueError, match="powers of two"):
        mla_decode.latent_attention(*_inputs(1, 1, 1, 24, 16, 32), jnp.zeros((1, 1), jnp.int32), 1.0)


def test_model_decode_through_the_kernel_equals_the_einsums(monkeypatch):
    """The wiring in MLAttention.decode (absorbed query, cache write, W_UV after): a tiny DSV2-shaped
    model with kernel-sized latent widths, prefill then 3 decode steps, once as the CPU runs it and
    once with the kernel forced (as on a GPU target), interpreted: the same logits."""
    run_cfg = load_config("tiny", parse_overrides(["model.kv_lora_rank=32", "model.qk_rope_head_dim=16"]))
    cfg = run_cfg.model
    model = farskip_jax.Transformer(cfg, nnx.Rngs(0), run_cfg.execution)
    ids = jnp.asarray([[5, 17, 3, 60, 22, 9, 41], [12, 7, 33, 2, 90, 14, 8]], jnp.int32)
    prompt = 4

    def run() -> np.ndarray:
        # jitted per run, so that each run traces the attention it is patched to: op by op, the
        # interpreted kernel took ~20 s
        @functools.partial(nnx.jit, static_argnames="prefill")
        def step(m, tokens, positions, caches, prefill):
            if not prefill:
                decode_traces.append(tokens.shape)
            hidden, caches, _ = m.cached_forward(tokens, positions, caches, prefill=prefill)
            return m.logits(hidden), caches

        caches = tuple(LatentCache.empty(cfg, 2, 16, jnp.float32) for _ in range(cfg.num_layers))
        logits, caches = step(model, ids[:, :prompt], jnp.arange(prompt)[None].repeat(2, 0), caches, True)
        out = [logits]
        for i in range(prompt, ids.shape[1]):
            logits, caches = step(model, ids[:, i:i + 1], jnp.full((2, 1), i, jnp.int32), caches, False)
            out.append(logits)
        return np.asarray(jnp.concatenate(out, axis=1))

    decode_traces = []
    plain = run()
    calls = []
    decode_traces.clear()
    interpreted = mla_decode.latent_attention

    def kernel(*args, **kw):
        calls.append(1)
        return interpreted(*args, **kw, interpret=True)

    monkeypatch.setattr(attention, "decode_kernel_family", lambda *a: "cuda")
    monkeypatch.setattr(mla_decode, "latent_attention", kernel)
    forced = run()
    # every layer of every traced decode step took the kernel (the 3 steps run what was traced)
    assert decode_traces and len(calls) == len(decode_traces) * cfg.num_layers
    np.testing.assert_allclose(forced, plain, rtol=1e-5, atol=1e-5)


def _readers_of_parameter(hlo_text: str, shape: str) -> list[str]:
    """Opcodes (custom calls by target) of the ENTRY instructions reading the parameter of `shape`."""
    entry = hlo_text[hlo_text.index("ENTRY"):]
    param = re.search(rf"(%[\w.]+) = {re.escape(shape)}\S* parameter\(", entry)
    assert param, shape
    readers = []
    for line in entry.splitlines():
        lhs, _, rhs = line.partition(" = ")
        if param.group(1) + ")" in rhs or param.group(1) + "," in rhs:
            target = re.search(r'custom_call_target="([^"]*)"', rhs)
            readers.append(target.group(1) if target else rhs.split("(")[0].split()[-1])
    return readers


@pytest.mark.parametrize("target", ["h200", "mi300x"])
def test_deviceless_decode_reads_the_latent_cache_once(target, tmp_path):
    """DSV2-Lite's per-device decode shapes under TP8 (2 heads, 512 + 64 latent, 4096 slots, 64
    sequences), compiled for the target: the latent cache's only reader is the Triton kernel; the
    reference program reads it in two matrix ops (scores, values)."""
    import subprocess
    import sys

    script = f"""
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from farskip_jax.xla import aot
aot.prepare_deviceless({target!r})
from farskip_jax.model import attention
mesh = aot.make_target_mesh({target!r}, {{"tensor": 1}})
sh = NamedSharding(mesh, P())
bf = jnp.bfloat16
shapes = [((64, 1, 2, 512), bf), ((64, 1, 2, 64), bf), ((64, 4096, 512), bf), ((64, 4096, 64), bf),
          ((64, 1), jnp.int32)]
specs = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in shapes]
for impl in ("auto", "blockwise"):
    fn = jax.jit(lambda a, b, c, d, e: attention.latent_decode_core(a, b, c, d, e, 0.1, impl))
    art = aot.compile_scheduled_hlo(fn, *specs, target={target!r})
    open({str(tmp_path)!r} + "/" + impl + ".hlo", "w").write(art.hlo_text)
"""
    subprocess.run([sys.executable, "-c", script], check=True, env={**__import__("os").environ,
                                                                   "JAX_PLATFORMS": "cpu"})
    kernel = _readers_of_parameter((tmp_path / "auto.hlo").read_text(), "bf16[64,4096,512]")
    assert kernel == ["__gpu$xla.gpu.triton"], kernel
    einsums = _readers_of_parameter((tmp_path / "blockwise.hlo").read_text(), "bf16[64,4096,512]")
    assert len(einsums) == 2 and "__gpu$xla.gpu.triton" not in einsums, einsums
