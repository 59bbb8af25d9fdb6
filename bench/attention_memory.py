"""Peak temporary memory of one MLA attention core, forward + backward: [T, T] reference vs blockwise.

Compiles (never runs) the vjp of `attention_core` on abstract DeepSeek-V2-Lite shapes (16 heads,
q/k head dim 192, v head dim 128, bf16, one sequence, causal + segment ids) and reads
``compiled.memory_analysis().temp_size_in_bytes``: the scratch XLA allocates beyond inputs and
outputs, where the reference keeps its [H, T, T] fp32 scores and probabilities. The blockwise
forward has a separate inference layout (model/flash.py), so its forward alone is compiled too.
Nothing is allocated, so 32k tokens compiles on any CPU. `--target h200` compiles for a deviceless H200
instead (needs the jax-cuda13 plugin wheels, see farskip_jax/xla/aot.py).

    JAX_PLATFORMS=cpu .venv/bin/python bench/attention_memory.py [--tokens 1024 4096 8192 32768]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from farskip_jax.model.attention import attention_core


def temp_bytes(impl: str, t: int, heads: int, qk_dim: int, v_dim: int, dtype: str, block: int,
               sharding: jax.sharding.Sharding | None = None, backward: bool = True) -> tuple[int, float]:
    """Compiled temp bytes of (q, k, v, d_out) -> (dq, dk, dv) for one attention core, or of
    (q, k, v) -> out with `backward=False` (inference); compile seconds."""
    def core(q, k, v, seg):
        return attention_core(q, k, v, seg, qk_dim ** -0.5, impl, block, block)

    def fwd_bwd(q, k, v, seg, d_out):
        _, vjp = jax.vjp(lambda q, k, v: core(q, k, v, seg), q, k, v)
        return vjp(d_out)

    qk = jax.ShapeDtypeStruct((1, t, heads, qk_dim), dtype, sharding=sharding)
    v = jax.ShapeDtypeStruct((1, t, heads, v_dim), dtype, sharding=sharding)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=sharding)
    t0 = time.perf_counter()
    if backward:
        compiled = jax.jit(fwd_bwd).lower(qk, qk, v, seg, v).compile()
    else:
        compiled = jax.jit(core).lower(qk, qk, v, seg).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192, 32768])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--qk-dim", type=int, default=192)
    ap.add_argument("--v-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--block", type=int, default=512, help="attention_block_q = attention_block_kv")
    ap.add_argument("--target", default="cpu", choices=["cpu", "h200"])
    args = ap.parse_args()
    sharding = None
    if args.target != "cpu":
        from farskip_jax.xla import aot

        mesh = aot.make_target_mesh(args.target, {"tensor": 1})
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    print(f"MLA attention core fwd+bwd, 1 sequence, {args.heads} heads, qk {args.qk_dim} / v {args.v_dim}, "
          f"{args.dtype}, block {args.block}, target {args.target}")
    print(f"{'tokens':>7} | {'reference temp':>15} | {'blockwise temp':>15} | {'ratio':>7} | "
          f"{'blockwise fwd-only':>18} | compile s (ref / blk / blk fwd)")
    for t in args.tokens:
        shape = (t, args.heads, args.qk_dim, args.v_dim, args.dtype, args.block, sharding)
        ref, ref_s = temp_bytes("reference", *shape)
        blk, blk_s = temp_bytes("blockwise", *shape)
        inf, inf_s = temp_bytes("blockwise", *shape, backward=False)
        print(f"{t:>7} | {ref / 2**20:>11.1f} MiB | {blk / 2**20:>11.1f} MiB | {ref / blk:>6.1f}x | "
              f"{inf / 2**20:>14.1f} MiB | {ref_s:.1f} / {blk_s:.1f} / {inf_s:.1f}", flush=True)


if __name__ == "__main__":
    main()
