"""Every hint this project gives XLA's scheduler, each with its contract.

XLA orders a step by data dependencies and its own cost estimates; where those estimates put an op
in the wrong place (a collective with nothing under it, a buffer alive for the whole step), the
only lever a JAX program has is to add a dependency. Each function here adds exactly one, leaves
the numbers unchanged, and says what must run before what and why. `tests/model/test_schedule.py`
checks every contract on the compiled HLO, so a JAX or XLA change that drops one fails there.

Two kinds of dependency:

* `join`/`after`: an XLA optimization barrier. Free (no data moves); in the module the
  latency-hiding scheduler receives, the consumers of its outputs wait for all of its inputs (XLA
  removes the barrier after scheduling: the final HLO no longer shows the edge). The TP psum
  order, the TP token chunks and FCSD's teacher/student lockstep were measured with it.
* `fresh_zeros`, `scratch_rows`: a buffer made from data, a real data dependency that holds
  through every pass, not only at the scheduler's entry: buffers that must be neither merged nor
  hoisted, and the expert-parallel Combine waiting for the shared experts (its output buffer,
  whose zeros nobody reads, is allocated from their output).

Layering: this module imports only JAX. The model (`farskip.py`, `transformer.py`, `dispatch.py`)
and the expert-parallel dispatcher (`farskip_jax.parallel.expert`) use it, so it sits below both.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def join(*values: Any) -> tuple[Any, ...]:
    """`values`, each available only once all of them are computed (an XLA optimization barrier).

    Contract: every consumer of any output runs after every input exists. Values unchanged.
    Uses: the TP sub-block order (`model/farskip.py`: the collective in flight gets the other
    sub-block under it), the TP token chunks materialised apart (`model/transformer.py`), FCSD's
    teacher and student advanced layer by layer together (`transformer.run_streams`).
    """
    return tuple(jax.lax.optimization_barrier(values))


def after(value: Any, dep: Any) -> Any:
    """`value`, available only once `dep` is computed (`join`, keeping the first output).

    Contract: every consumer of the result runs after `dep` exists. Value unchanged. Use: the
    batch-split chunks staggered (`farskip.residual_step_chunks`: chunk c's FFN after chunk c-1's).
    """
    return join(value, dep)[0]


def fresh_zeros(rows: int, like: jax.Array, dep: jax.Array) -> jax.Array:
    """A zero [rows, D] buffer (D and dtype of `like`) that XLA computes where it is used.

    `dep` is any integer array whose first element is never negative; the buffer is a broadcast
    of a 0 read from it. Contract: the buffer is computed after `dep` and is its own instruction,
    never merged with another zero buffer. Why: the grouped GEMM's and the exchanges' buffers are
    filled in place (scatters, ragged all-to-alls), and XLA merged every constant zero buffer of a
    step into one, then materialised one copy per in-place user at the first use, all alive
    together (DSV2-Lite FCSD, 4 x 4096 tokens per H200: 12 x 4 GiB padded-GEMM and 18 x 3 GiB
    receive buffers, 102 of the 103 GiB of temporary memory).
    """
    zero = jnp.where(jnp.ravel(dep)[0] < 0, 1, 0).astype(like.dtype)
    return jnp.broadcast_to(zero, (rows, like.shape[-1]))


def scratch_rows(rows: int, like: jax.Array, dep: jax.Array) -> jax.Array:
    """An [rows, D] buffer (D and dtype of `like`) for an op that fills some of its rows in place
    (a ragged exchange), where no row left unwritten is ever read into a result: uninitialised on
    GPUs (XLA's AllocateBuffer custom call: no kernel runs), zeros on XLA:CPU.

    The allocation reads `dep`'s first element, so the buffer exists only once `dep` does (any
    array; an integer one is never negative at [0]): XLA allocates it where it is used, and
    whatever fills it starts only after `dep` (the Combine waits so for the shared experts;
    tests/model/test_schedule.py, tests/parallel/test_dependencies.py). `jax.lax.empty` takes no
    operand, and XLA's scheduler put every such buffer of a step at its start, all alive together
    (8 H200: +10 to +35 GiB per device; BENCHMARKS.md K27). Inside shard_map the buffer varies
    over the axes `dep` varies over (a ragged exchange's result is typed like its output buffer;
    an invariant one would make JAX psum its cotangent).

    Contract: the caller's unwritten rows are never read; tests fill them with NaN
    (tests/parallel/test_dropless_ep.py, tests/model/test_grouped_matmul.py). Why: zeroing these
    buffers was 15.8 ms of the est. 431 ms of serial compute of the FCSD step on 8 MI300X (K27)."""
    first = jnp.ravel(dep)[0]
    # A flag XLA cannot fold to a constant (it folds abs(x) < 0): an integer `dep` is never
    # negative at [0]; a float one is NaN there only if the step already is. Its value is unused.
    flag = (first < 0) if jnp.issubdtype(first.dtype, jnp.integer) else (first != first)
    first = flag.astype(jnp.int32)
    mat = jax.typeof(first).manual_axis_type
    axes = tuple(sorted(mat.varying)) if mat is not None else ()
    shape = (rows, like.shape[-1])

    def allocate(first: jax.Array) -> jax.Array:
        # the custom call `jax.lax.empty` lowers to on GPUs (same target and API version), plus
        # the operand
        out = jax.ffi.ffi_call("AllocateBuffer", jax.ShapeDtypeStruct(shape, like.dtype),
                               custom_call_api_version=1)(first)
        return jax.lax.pcast(out, axes, to="varying") if axes else out

    def zeros(first: jax.Array) -> jax.Array:
        return jnp.broadcast_to(first.astype(like.dtype) * 0, shape)

    return jax.lax.platform_dependent(first, cpu=zeros, default=allocate)
