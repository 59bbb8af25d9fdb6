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
* `after_by_data`, `fresh_zeros`: a real data dependency, one tiny op each, which holds through
  every pass, not only at the scheduler's entry: the expert-parallel Combine waiting for the shared
  experts, and buffers that must be neither merged nor hoisted.

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


def after_by_data(buffer_rd: jax.Array, dep_nd: jax.Array) -> jax.Array:
    """`buffer_rd` [R, D] with its first row replaced by `dep_nd`'s first row (cast to its dtype).

    Contract: anything reading the result (an exchange that fills it in place) starts only once
    `dep_nd` exists, whatever XLA does with barriers. The caller guarantees that row 0 of the result
    is overwritten before it is read, or never read: the values it produces do not depend on `dep`.
    Use: the ragged Combine's output buffer (`parallel.expert`), so that the shared experts run
    under the Dispatch and the Combine is left to the next layer's attention (FarSkip).
    """
    return buffer_rd.at[:1].set(dep_nd[:1].astype(buffer_rd.dtype))


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
