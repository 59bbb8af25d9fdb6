"""Peak temporary memory of the KL loss + gradient: full logits vs chunked over tokens.

Compiles (never runs) ``jax.jit(jax.value_and_grad(loss))`` on abstract shapes and reads
``compiled.memory_analysis().temp_size_in_bytes``: the scratch XLA allocates beyond inputs and outputs,
which is where [tokens x vocab] logits, softmaxes and their gradients live. Nothing is allocated, so
the 102400-vocab case compiles on any CPU.

    JAX_PLATFORMS=cpu .venv/bin/python bench/kl_memory.py [--tokens 4096 --d 2048 --vocab 102400]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from farskip_jax.train import losses


def _temp_bytes(fn, *args) -> tuple[int, float]:
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    return int(mem.temp_size_in_bytes), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=102400)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--topk", type=int, default=64)
    args = ap.parse_args()

    n, d, v, k = args.tokens, args.d, args.vocab, args.topk
    dt = jnp.dtype(args.dtype)
    hid = jax.ShapeDtypeStruct((n, d), dt)
    head = jax.ShapeDtypeStruct((d, v), dt)
    mask = jax.ShapeDtypeStruct((n,), jnp.int32)
    t_lp = jax.ShapeDtypeStruct((n, k), jnp.float32)
    t_id = jax.ShapeDtypeStruct((n, k), jnp.int32)

    def grad_of(loss_fn):
        # Gradient w.r.t. the student's hidden states and LM head, as the trainer needs.
        return jax.value_and_grad(loss_fn, argnums=(0, 1))

    def full(sh, sw, th, tw, m):
        tl = jnp.einsum("td,dv->tv", th, tw, preferred_element_type=jnp.float32)
        sl = jnp.einsum("td,dv->tv", sh, sw, preferred_element_type=jnp.float32)
        return losses.forward_kl(tl, sl, m)[0]

    rows: list[tuple[str, int, float]] = []
    b, s = _temp_bytes(grad_of(full), hid, head, hid, head, mask)
    rows.append(("forward_kl (full logits)", b, s))
    for c in args.chunks:

        def chunked(sh, sw, th, tw, m, c=c):
            return losses.chunked_forward_kl(th, tw, sh, sw, m, chunk_size=c)[0]

        b, s = _temp_bytes(grad_of(chunked), hid, head, hid, head, mask)
        rows.append((f"chunked_forward_kl chunk={c}", b, s))

    def topk_full(sh, sw, tl, ti, m):
        sl = jnp.einsum("td,dv->tv", sh, sw, preferred_element_type=jnp.float32)
        return losses.topk_kl(tl, ti, sl, m)[0]

    b, s = _temp_bytes(grad_of(topk_full), hid, head, t_lp, t_id, mask)
    rows.append((f"topk_kl k={k} (full student logits)", b, s))

    def topk_chunked(sh, sw, tl, ti, m):
        return losses.chunked_topk_kl(tl, ti, sh, sw, m, chunk_size=1024)[0]

    b, s = _temp_bytes(grad_of(topk_chunked), hid, head, t_lp, t_id, mask)
    rows.append((f"chunked_topk_kl k={k} chunk=1024", b, s))

    one_logits = n * v * 4
    print(f"backend={jax.default_backend()} tokens={n} d={d} vocab={v} dtype={args.dtype}")
    print(f"one fp32 [tokens x vocab] logits array = {one_logits / 2**30:.2f} GiB\n")
    hdr = "loss + grad (student hidden, head)"
    print(f"| {hdr:<40} | {'temp GiB':>9} | {'x logits':>8} | {'compile s':>9} |")
    print(f"|{'-' * 42}|{'-' * 11}|{'-' * 10}|{'-' * 11}|")
    for name, b, s in rows:
        print(f"| {name:<40} | {b / 2**30:9.3f} | {b / one_logits:8.2f} | {s:9.1f} |")


if __name__ == "__main__":
    main()
