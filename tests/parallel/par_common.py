"""Shared helpers for the parallelism tests: tiny configs, fast CPU compiles, error records."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from farskip_jax.config import ExecutionConfig, ModelConfig, load_config
from farskip_jax.model.transformer import build_model, with_farskip

# The tests check numerics and graph structure, not speed: XLA's CPU backend optimisation level
# 0 halves compile time (measured: 8.5 s instead of 30 s for a tiny forward+backward).
FAST = {"xla_backend_optimization_level": 0}

# (test, case, quantity, max abs err) rows printed by conftest's terminal summary.
RESULTS: list[tuple[str, str, str, float]] = []


# configs/tiny.yaml's execution.moe_buffer_factor, for tiny models built from HF config dicts (which
# carry none): a 16-token shard's per-rank load swings far more than a real batch's, and at the
# production 2x the sharded tests would mostly run the overflow fallback instead of the bounded
# program they check.
TINY_BUFFER_FACTOR = 4.0
TINY_EXE = ExecutionConfig(moe_buffer_factor=TINY_BUFFER_FACTOR)


def tiny(farskip: bool, **overrides: Any) -> ModelConfig:
    """configs/tiny.yaml's model with dotted `model.*` overrides (`num_heads=8`)."""
    cfg = load_config("tiny", {f"model.{k}": v for k, v in overrides.items()}).model
    return with_farskip(cfg, enabled=farskip)


def tiny_exe(**overrides: Any) -> ExecutionConfig:
    """configs/tiny.yaml's execution section with dotted `execution.*` overrides (`remat="full"`)."""
    return load_config("tiny", {f"execution.{k}": v for k, v in overrides.items()}).execution


def ids_and_weights(cfg: ModelConfig, b: int, t: int) -> tuple[jax.Array, jax.Array]:
    """Random token ids [b, t] and per-logit loss weights [b, t, vocab] (fixed keys 1 and 2)."""
    ids = jax.random.randint(jax.random.key(1), (b, t), 0, cfg.vocab_size)
    return ids, jax.random.normal(jax.random.key(2), (b, t, cfg.vocab_size))


def split(cfg: ModelConfig, seed: int = 0, exe: ExecutionConfig = TINY_EXE) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of `cfg` run as `exe` (default: as configs/tiny.yaml runs its model)."""
    return nnx.split(build_model(cfg, seed=seed, exe=exe), nnx.Param)


def run_fast(fn: Any, *args: Any) -> Any:
    """jit + compile at CPU optimisation level 0, then run."""
    return jax.jit(fn).lower(*args).compile(FAST)(*args)


def max_abs_err(a: Any, b: Any) -> float:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    # numpy: the operands may live on different device sets (sharded vs one device)
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(la, lb, strict=True))


def record(test: str, case: str, quantity: str, err: float) -> None:
    RESULTS.append((test, case, quantity, err))
    print(f"PARALLEL_ERR test={test} case={case} {quantity} max_abs_err={err:.3e}")


def emulated_ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                               send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array, *,
                               axis_name: str, axis_index_groups: Any = None) -> jax.Array:
    """`jax.lax.ragged_all_to_all` as its docstring defines it, from plain all_to_alls (XLA:CPU has
    no ragged-all-to-all), for any number of slices per peer (peer-major) of the whole axis or of
    each of `axis_index_groups`: checks the offsets and sizes a caller passes.

    The real op types its result like `output`: an `output` that does not vary over the exchange's
    axis would make the result mesh-invariant, and JAX would psum its cotangent in the backward
    pass; the emulation (whose result varies either way) refuses such a buffer."""
    manual = getattr(jax.typeof(output), "manual_axis_type", None)  # absent outside shard_map
    assert manual is None or axis_name in manual.varying, f"output buffer invariant over {axis_name!r}"
    groups = None if axis_index_groups is None else [list(g) for g in axis_index_groups]
    assert groups is None or len({len(g) for g in groups}) == 1
    peers = jax.lax.axis_size(axis_name) if groups is None else len(groups[0])
    n, m = input_offsets.shape[0], operand.shape[0]
    slices = n // peers
    assert slices * peers == n, (n, peers)  # the op's contract: a whole number of slices per peer
    padded = jnp.concatenate([operand, jnp.zeros_like(operand)])  # any slice of <= m rows fits
    chunks = jax.vmap(lambda off: jax.lax.dynamic_slice_in_dim(padded, off, m))(input_offsets)
    rows = jnp.arange(m)
    chunks = jnp.where((rows[None, :] < send_sizes[:, None])[..., None], chunks, 0)
    # [peers, slices, m, ...]: each source's slices for this rank
    received = jax.lax.all_to_all(chunks.reshape(peers, slices, *chunks.shape[1:]), axis_name, 0, 0,
                                  axis_index_groups=groups)
    # Where each source's slice j lands here (entry s*slices + j): its output_offsets entry for this rank.
    landing = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True, axis_index_groups=groups)
    out_rows = jnp.arange(output.shape[0])
    result = output
    for i in range(n):
        inside = (out_rows >= landing[i]) & (out_rows < landing[i] + recv_sizes[i])
        src = jnp.clip(out_rows - landing[i], 0, m - 1)
        result = jnp.where(inside[:, None], received[i // slices, i % slices][src], result)
    return result


def nan_scratch_rows(rows: int, like: jax.Array, dep: jax.Array) -> jax.Array:
    """`schedule.scratch_rows` with every row NaN (on a GPU its rows are whatever memory held): a
    test swaps it in to show that no row an exchange leaves unwritten reaches a result."""
    nan = jnp.where(jnp.ravel(dep)[0] < 0, 0.0, jnp.nan).astype(like.dtype)
    return jnp.broadcast_to(nan, (rows, like.shape[-1]))


def emulated_swiglu_call(body, name: str, rows_1: jax.Array, operands: tuple, results: tuple
                         ) -> tuple[jax.Array, ...]:
    """`model.swiglu_rows._call` in jnp, for a shard_map on CPU: Pallas' interpreter cannot run
    inside one (its block slices index varying arrays with invariant program ids, which the shard_map
    type check refuses). The kernels' math (fp32, rounded once) on the blocks of rows the kernel
    writes (those starting before the row count), NaN in the rest (the kernel leaves them as memory
    held them). The kernels themselves are checked against XLA in tests/model/test_swiglu_rows.py."""
    from farskip_jax.model import swiglu_rows

    first = operands[0]  # every operand is [R, F]
    block_r, _ = swiglu_rows._blocks(*first.shape)
    if name == swiglu_rows.KERNEL_NAMES[2]:  # the rows transposed: [R, D] -> [D, R]
        outs = (first,)
    else:
        gate, up, *rest = operands
        g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
        s = jax.nn.sigmoid(g)
        if name == swiglu_rows.KERNEL_NAMES[0]:
            outs = (g * s * u,)
        else:
            dh = rest[0].astype(jnp.float32)
            dgate, dup = dh * u * s * (1.0 + g * (1.0 - s)), dh * g * s
            outs = ((jnp.concatenate([dgate, dup], -1),) if results[0] == "r2f" else (dgate, dup))
            outs += (g * s * u,) if "fr" in results else ()
    first_r = jnp.arange(first.shape[0], dtype=jnp.int32) // block_r * block_r
    written = (first_r < rows_1[0])[:, None]
    outs = tuple(jnp.where(written, o, jnp.nan).astype(first.dtype) for o in outs)
    return tuple(o.T if lay == "fr" else o for o, lay in zip(outs, results, strict=True))


def count_ops(hlo_text: str, opcode: str) -> int:
    """Instructions of `opcode` (or its async `-start`) in HLO text."""
    pattern = re.compile(rf"^\s*(ROOT )?%\S+ = .*?\s{re.escape(opcode)}(-start)?\(")
    return sum(1 for line in hlo_text.splitlines() if pattern.match(line))
