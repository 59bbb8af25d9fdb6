"""The routed experts' SwiGLU activation, silu(gate) * up, over the rows a bounded buffer holds.

Why: an expert-parallel receive buffer is sized for twice the rows balanced routing delivers
(`execution.moe_buffer_factor`, model/dispatch.py `moe_buffer`), and the grouped GEMMs around the
activation compute only the rows in their groups. XLA's elementwise fusion between them cannot know
the dynamic row count, so it reads and writes every static row, in the forward, the backward and the
teacher's forward: 30 ms of the 8-MI300X FCSD step's 390 ms of serial compute (est.,
BENCHMARKS.md K29), half of it over rows that hold nothing. This Pallas kernel is given the number
of rows in use and skips every block of rows past it, in both directions: 15 ms less there.

CONTRACT: rows at or past `rows` of the result (and of both gradients) are unspecified: the kernel
does not write them. Every consumer in the expert paths reads only the rows inside the groups (the
grouped GEMMs, their gradients, the weighted sum: BENCHMARKS.md K27 has the same contract for the
exchanges' buffers). Rows before `rows` hold silu(gate) * up computed in fp32 and rounded once to
the input dtype (XLA's plain path rounds bf16 after each op: the kernel is at least as accurate).

Kernels (`resolve_swiglu`, what `execution.expert_swiglu: auto` uses):

- "pallas_triton": JAX's Pallas Triton backend, lowered to XLA's built-in Triton (the
  `__gpu$xla.gpu.triton` custom call; no triton package), on gfx942 (MI300X: the same device
  description as the fused attention, model/attention_kernels.py) and Hopper. On Hopper the
  activation and tokamax's down projection are one op (`swiglu_down`): tokamax's weight-gradient
  kernel reads its rows transposed, and with the two apart XLA transposed the activation over the
  whole buffer (6.0 ms per 8-H200 step, which ate the kernel's gain: K29); the backward kernel
  writes the activation transposed instead, over the rows in use. On CPU the kernel runs in Pallas'
  interpreter, which leaves the unwritten rows NaN: how the tests check that no consumer reads them.
- "xla": `jax.nn.silu(gate) * up`, every row (CPU, the padded and blocked grouped matmuls, which
  compute every row or give 0 past the groups).

JAX 0.12 marks its Pallas Triton backend deprecated in favour of Mosaic GPU, which has no ROCm
lowering: on gfx942 it is the one Pallas path (tokamax's attention kernel there uses it too); a
Mosaic GPU version for Hopper would replace it there when it goes.

Block sizes are powers of two (Triton's tile shapes) that divide the array: up to 128 rows x 128
columns (DSV2-Lite's 1408-wide experts: 11 column blocks). Untuned: no GPU was available.

Shape legend: R rows of the expert buffer, F the experts' intermediate width.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from farskip_jax.model.grouped_matmul import RAGGED_DW, RAGGED_DX, tokamax_ragged_dot, typed_like, vary_alike
from farskip_jax.platforms import device_family, target_device

# The pallas_call names: the inspector prices these kernels at the buffer's fill.
from farskip_jax.xla.costs import ROW_KERNEL_NAMES as KERNEL_NAMES

SwigluKernel = Literal["pallas_triton", "xla"]
SWIGLU_MODES: tuple[str, ...] = ("auto", "pallas_triton", "xla")
_MAX_BLOCK = 128


def resolve_swiglu(mode: str, device: Any, matmul: str) -> SwigluKernel:
    """`execution.expert_swiglu` for the grouped matmul `matmul`. The kernel only runs between the
    grouped GEMMs that compute the rows in their groups (ragged, tokamax): "xla" with the others,
    whatever the setting. There, "auto" is the kernel on Hopper with tokamax's grouped GEMMs (the
    bf16 / fp16 default; fp32 gets XLA's ragged_dot, a masked dense dot there, not compiled here
    with the kernel) and on gfx942 (MI300X, where its Triton lowering finds the architecture), else
    "xla"; an explicit "pallas_triton" runs anywhere (Pallas' interpreter on CPU)."""
    if mode not in SWIGLU_MODES:
        raise ValueError(f"expert_swiglu={mode!r}: expected one of {SWIGLU_MODES}")
    if matmul not in ("ragged", "tokamax"):
        return "xla"
    if mode != "auto":
        return mode  # type: ignore[return-value]
    family = device_family(device)
    if family == "cuda":
        try:
            hopper = 9.0 <= float(getattr(device, "compute_capability", "0")) < 10.0
        except ValueError:
            hopper = False
        return "pallas_triton" if hopper and matmul == "tokamax" else "xla"
    if family == "rocm":
        from farskip_jax.model.attention_kernels import gfx942_triton_ready

        return "pallas_triton" if gfx942_triton_ready(device) else "xla"
    return "xla"


def swiglu_rows(gate_rf: jax.Array, up_rf: jax.Array, rows: jax.Array, kernel: SwigluKernel) -> jax.Array:
    """silu(gate) * up: [R, F]. "xla" computes every row; "pallas_triton" the first `rows` (int32 [])
    only, leaving the rest unspecified (module docstring), with its own VJP that does the same."""
    if kernel == "xla":
        return jax.nn.silu(gate_rf) * up_rf
    if kernel != "pallas_triton":
        raise ValueError(f"swiglu kernel {kernel!r}: expected 'pallas_triton' or 'xla'")
    gate_rf, up_rf, rows_1 = vary_alike(gate_rf, up_rf, jnp.asarray(rows, jnp.int32).reshape(1))
    return _swiglu(gate_rf, up_rf, rows_1)


def _blocks(rows: int, cols: int) -> tuple[int, int]:
    def largest(n: int) -> int:
        return min(n & -n, _MAX_BLOCK)  # the largest power of two dividing n, capped

    return largest(rows), largest(cols)


def _call(body: Any, name: str, inputs: tuple[jax.Array, ...], transposed: tuple[bool, ...]
          ) -> tuple[jax.Array, ...]:
    """`body` over (row block, column block) programs; inputs[0] is the row count, the rest [R, F].
    One output per entry of `transposed`: [R, F], or [F, R] where True."""
    r, f = inputs[1].shape
    block_r, block_f = _blocks(r, f)
    tile = pl.BlockSpec((block_r, block_f), lambda i, j: (i, j))
    tile_t = pl.BlockSpec((block_f, block_r), lambda i, j: (j, i))
    interpret = device_family(target_device()) == "cpu"  # Pallas' interpreter: the CPU tests
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        params["compiler_params"] = pl_triton.CompilerParams(num_warps=4, num_stages=1)
    # inside a shard_map the results vary over the mesh axes the (alike-cast) inputs vary over
    mat = jax.typeof(inputs[1]).manual_axis_type
    out = pl.pallas_call(
        partial(body, block_r=block_r), name=name, grid=(r // block_r, f // block_f),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,))] + [tile] * (len(inputs) - 1),
        out_specs=[tile_t if t else tile for t in transposed], interpret=interpret, **params,
        out_shape=[jax.ShapeDtypeStruct((f, r) if t else (r, f), inputs[1].dtype, manual_axis_type=mat)
                   for t in transposed],
    )(*inputs)
    return tuple(out)


def _forward_body(rows_ref: Any, gate_ref: Any, up_ref: Any, h_ref: Any, *, block_r: int) -> None:
    @pl.when(pl.program_id(0) * block_r < rows_ref[0])
    def _() -> None:
        g = gate_ref[...].astype(jnp.float32)
        h_ref[...] = (g * jax.nn.sigmoid(g) * up_ref[...].astype(jnp.float32)).astype(h_ref.dtype)


def _backward_body(rows_ref: Any, gate_ref: Any, up_ref: Any, dh_ref: Any, dgate_ref: Any, dup_ref: Any,
                   *h_t_ref: Any, block_r: int) -> None:
    """d gate and d up; with a third output, also the activation again, transposed ([F, R] tiles),
    bit for bit the forward's (the same fp32 ops in the same order)."""
    @pl.when(pl.program_id(0) * block_r < rows_ref[0])
    def _() -> None:
        g = gate_ref[...].astype(jnp.float32)
        u = up_ref[...].astype(jnp.float32)
        dh = dh_ref[...].astype(jnp.float32)
        s = jax.nn.sigmoid(g)
        silu = g * s
        # d silu / dg = s + g s (1 - s) = s (1 + g (1 - s))
        dgate_ref[...] = (dh * u * s * (1.0 + g * (1.0 - s))).astype(dgate_ref.dtype)
        dup_ref[...] = (dh * silu).astype(dup_ref.dtype)
        if h_t_ref:
            h_t_ref[0][...] = (silu * u).astype(h_t_ref[0].dtype).T


@jax.custom_vjp
def _swiglu(gate_rf: jax.Array, up_rf: jax.Array, rows_1: jax.Array) -> jax.Array:
    return _call(_forward_body, KERNEL_NAMES[0], (rows_1, gate_rf, up_rf), (False,))[0]


def _swiglu_fwd(gate_rf: jax.Array, up_rf: jax.Array, rows_1: jax.Array
                ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    return _swiglu(gate_rf, up_rf, rows_1), (gate_rf, up_rf, rows_1)


def _swiglu_bwd(res: tuple[jax.Array, jax.Array, jax.Array], dh_rf: jax.Array
                ) -> tuple[jax.Array, jax.Array, np.ndarray]:
    gate_rf, up_rf, rows_1 = res
    dh_rf = dh_rf.astype(gate_rf.dtype)
    dgate, dup = _call(_backward_body, KERNEL_NAMES[1], (rows_1, gate_rf, up_rf, dh_rf), (False, False))
    return dgate, dup, np.zeros(rows_1.shape, jax.dtypes.float0)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


# ---------------------------------------------------------------------------------------------------
# The activation and tokamax's down projection as one op (Hopper)


def swiglu_down(gate_rf: jax.Array, up_rf: jax.Array, w_down_gfd: jax.Array, sizes_g: jax.Array,
                implementation: str = "mosaic") -> jax.Array:
    """[R, D]: silu(gate) * up (the kernel, rows in the groups) times each group's down projection,
    tokamax's grouped GEMM. Rows past the groups are unspecified.

    Why one op: tokamax's weight-gradient kernel reads its rows transposed ([F, R]), and with the
    activation and the GEMM apart, the backward pass (or the forward's saved activation) fed it
    through a transpose of the whole buffer. Here the forward keeps gate and up only (which the
    activation's gradient needs anyway: the [R, F] activation is not saved), and the backward's one
    kernel writes d gate, d up and the activation again, transposed, over the rows in use. The input
    gradient of the GEMM is not masked past the groups: only the kernel reads it.
    `implementation`: tokamax's ("xla" runs anywhere: the CPU tests)."""
    gate_rf, up_rf, w_down_gfd, sizes_g, rows_1 = vary_alike(
        gate_rf, up_rf, w_down_gfd, jnp.asarray(sizes_g, jnp.int32),
        jnp.sum(sizes_g, dtype=jnp.int32).reshape(1))
    return _swiglu_down(gate_rf, up_rf, w_down_gfd, sizes_g, rows_1, implementation)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _swiglu_down(gate_rf: jax.Array, up_rf: jax.Array, w_down_gfd: jax.Array, sizes_g: jax.Array,
                 rows_1: jax.Array, implementation: str) -> jax.Array:
    # the two ops' own forwards (their VJPs are not used: this op's backward is below)
    return tokamax_ragged_dot(_swiglu(gate_rf, up_rf, rows_1), w_down_gfd, sizes_g, implementation)


def _swiglu_down_fwd(gate_rf: jax.Array, up_rf: jax.Array, w_down_gfd: jax.Array, sizes_g: jax.Array,
                     rows_1: jax.Array, implementation: str) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    y = _swiglu_down(gate_rf, up_rf, w_down_gfd, sizes_g, rows_1, implementation)
    return y, (gate_rf, up_rf, w_down_gfd, sizes_g, rows_1)


def _swiglu_down_bwd(implementation: str, res: tuple[jax.Array, ...], dy_rd: jax.Array
                     ) -> tuple[jax.Array | np.ndarray, ...]:
    import tokamax

    gate_rf, up_rf, w_down_gfd, sizes_g, rows_1 = res
    dh_rf = tokamax.ragged_dot_general(dy_rd, w_down_gfd, sizes_g, RAGGED_DX, implementation=implementation,
                                       preferred_element_type=gate_rf.dtype)
    dh_rf = typed_like(dh_rf, gate_rf)
    dgate, dup, h_fr = _call(_backward_body, KERNEL_NAMES[1], (rows_1, gate_rf, up_rf, dh_rf),
                             (False, False, True))
    # tokamax transposes its weight gradient's rows to [F, R] first: the transpose of a transpose
    # is no op for XLA, so the kernel's [F, R] output is read as it lies.
    dw = tokamax.ragged_dot_general(h_fr.T, dy_rd, sizes_g, RAGGED_DW, implementation=implementation,
                                    preferred_element_type=w_down_gfd.dtype)
    return (dgate, dup, typed_like(dw, w_down_gfd), np.zeros(sizes_g.shape, jax.dtypes.float0),
            np.zeros(rows_1.shape, jax.dtypes.float0))


_swiglu_down.defvjp(_swiglu_down_fwd, _swiglu_down_bwd)
