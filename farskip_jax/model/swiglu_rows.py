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
  description as the fused attention, model/attention_kernels.py) and Hopper. On Hopper tokamax's
  three grouped GEMMs and the kernels are one op (`swiglu_ffn`), so that no XLA op passes over the
  whole buffer: tokamax's weight-gradient kernel reads its rows transposed, and XLA transposed the
  activation (6.0 ms per 8-H200 step, which ate the kernel's gain: K29) and the receive buffer over
  every row, and added the gate and up GEMMs' input gradients there. Its backward kernel writes the
  activation transposed and d gate, d up side by side (one GEMM's input for the input gradient),
  and a third kernel transposes the receive buffer's rows, all over the rows in use (K30). On CPU
  the kernels run in Pallas' interpreter, which leaves the unwritten rows NaN: how the tests check
  that no consumer reads them.
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


# How a kernel's results lie, tiled over (row block, column block) programs (its operands are [R, F]):
# "rf" [R, F]; "r2f" two [R, F] results side by side, [R, 2F] (a program writes one tile of each into
# its [rows, 2, columns] block of the [R, 2, F] view, a bitcast); "fr" [F, R], the tile transposed.
Layout = Literal["rf", "r2f", "fr"]


def _call(body: Any, name: str, rows_1: jax.Array, operands: tuple[jax.Array, ...],
          results: tuple[Layout, ...]) -> tuple[jax.Array, ...]:
    """`body(rows_ref, *operand_refs, *result_refs, block_r=...)` over the (row block, column block)
    programs of the operands' R x F (rows_1: the row count, int32 [1]). Results in the operands'
    dtype."""
    r, f = operands[0].shape
    block_r, block_f = _blocks(r, f)
    tile = pl.BlockSpec((block_r, block_f), lambda i, j: (i, j))
    specs = {"rf": tile, "r2f": pl.BlockSpec((block_r, 2, block_f), lambda i, j: (i, 0, j)),
             "fr": pl.BlockSpec((block_f, block_r), lambda i, j: (j, i))}
    shapes = {"rf": (r, f), "r2f": (r, 2, f), "fr": (f, r)}
    interpret = device_family(target_device()) == "cpu"  # Pallas' interpreter: the CPU tests
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        params["compiler_params"] = pl_triton.CompilerParams(num_warps=4, num_stages=1)
    # inside a shard_map the results vary over the mesh axes the (alike-cast) inputs vary over
    mat = jax.typeof(operands[0]).manual_axis_type
    out = pl.pallas_call(
        partial(body, block_r=block_r), name=name, grid=(r // block_r, f // block_f),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,))] + [tile] * len(operands),
        out_specs=[specs[lay] for lay in results], interpret=interpret, **params,
        out_shape=[jax.ShapeDtypeStruct(shapes[lay], operands[0].dtype, manual_axis_type=mat)
                   for lay in results],
    )(rows_1, *operands)
    return tuple(o.reshape(r, 2 * f) if lay == "r2f" else o for o, lay in zip(out, results, strict=True))


def _forward_body(rows_ref: Any, gate_ref: Any, up_ref: Any, h_ref: Any, *, block_r: int) -> None:
    @pl.when(pl.program_id(0) * block_r < rows_ref[0])
    def _() -> None:
        g = gate_ref[...].astype(jnp.float32)
        h_ref[...] = (g * jax.nn.sigmoid(g) * up_ref[...].astype(jnp.float32)).astype(h_ref.dtype)


def _backward_body(rows_ref: Any, gate_ref: Any, up_ref: Any, dh_ref: Any, *out_refs: Any, block_r: int,
                   side_by_side: bool, transposed: bool) -> None:
    """d gate and d up: two results, or one with the two side by side ("r2f"); with `transposed`,
    also the activation again as [F, R] tiles, bit for bit the forward's (the same fp32 ops in the
    same order)."""
    @pl.when(pl.program_id(0) * block_r < rows_ref[0])
    def _() -> None:
        g = gate_ref[...].astype(jnp.float32)
        u = up_ref[...].astype(jnp.float32)
        dh = dh_ref[...].astype(jnp.float32)
        s = jax.nn.sigmoid(g)
        silu = g * s
        # d silu / dg = s + g s (1 - s) = s (1 + g (1 - s))
        dgate, dup = dh * u * s * (1.0 + g * (1.0 - s)), dh * silu
        if side_by_side:
            d_ref, *rest = out_refs
            d_ref[:, 0, :] = dgate.astype(d_ref.dtype)
            d_ref[:, 1, :] = dup.astype(d_ref.dtype)
        else:
            dgate_ref, dup_ref, *rest = out_refs
            dgate_ref[...] = dgate.astype(dgate_ref.dtype)
            dup_ref[...] = dup.astype(dup_ref.dtype)
        if transposed:
            rest[0][...] = (silu * u).astype(rest[0].dtype).T


def _transpose_body(rows_ref: Any, x_ref: Any, xt_ref: Any, *, block_r: int) -> None:
    @pl.when(pl.program_id(0) * block_r < rows_ref[0])
    def _() -> None:
        xt_ref[...] = x_ref[...].T


@jax.custom_vjp
def _swiglu(gate_rf: jax.Array, up_rf: jax.Array, rows_1: jax.Array) -> jax.Array:
    return _call(_forward_body, KERNEL_NAMES[0], rows_1, (gate_rf, up_rf), ("rf",))[0]


def _swiglu_fwd(gate_rf: jax.Array, up_rf: jax.Array, rows_1: jax.Array
                ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    return _swiglu(gate_rf, up_rf, rows_1), (gate_rf, up_rf, rows_1)


def _swiglu_bwd(res: tuple[jax.Array, jax.Array, jax.Array], dh_rf: jax.Array
                ) -> tuple[jax.Array, jax.Array, np.ndarray]:
    gate_rf, up_rf, rows_1 = res
    dh_rf = dh_rf.astype(gate_rf.dtype)
    dgate, dup = _call(partial(_backward_body, side_by_side=False, transposed=False), KERNEL_NAMES[1],
                       rows_1, (gate_rf, up_rf, dh_rf), ("rf", "rf"))
    return dgate, dup, np.zeros(rows_1.shape, jax.dtypes.float0)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


# ---------------------------------------------------------------------------------------------------
# Hopper: tokamax's three grouped GEMMs and the kernels as one op that touches only the rows in use


def swiglu_ffn(x_rd: jax.Array, w_gate_gdf: jax.Array, w_up_gdf: jax.Array, w_down_gfd: jax.Array,
               sizes_g: jax.Array, implementation: str = "mosaic") -> jax.Array:
    """[R, D]: (silu(x Wg) * (x Wu)) Wd of each group's rows with that group's weights, tokamax's
    grouped GEMMs and the kernel between them; rows past the groups are unspecified.

    Why one op: tokamax's weight-gradient kernel reads its rows transposed, and with the GEMMs and
    the activation apart XLA transposed the activation (6.0 ms per 8-H200 step, K29) and the receive
    buffer over every row, added the gate and up GEMMs' input gradients over every row and masked
    them past the groups (the backward's passes over the whole [R, D] buffer, K30). Here:
    - the forward runs gate and up as two GEMMs (the frozen teacher, forward only, never joins the
      weights) and saves gate and up, not the activation (0.55 GB per layer at EP8);
    - the backward kernel writes d gate and d up side by side, [R, 2F], and the activation again,
      transposed ([F, R]), over the rows in use; the input gradient is one GEMM of that against the
      two weights side by side (joined in the backward only), not masked past the groups (only the
      exchange's reverse reads it, and only the rows it sent: K27); the rows are transposed for the
      weight gradient by a kernel that skips the blocks past the groups.
    `implementation`: tokamax's ("xla" runs anywhere: the CPU tests)."""
    sizes_g = jnp.asarray(sizes_g, jnp.int32)
    args = vary_alike(x_rd, w_gate_gdf, w_up_gdf, w_down_gfd, sizes_g,
                      jnp.sum(sizes_g, dtype=jnp.int32).reshape(1))
    return _swiglu_ffn(*args, implementation)


def _ffn_forward(x_rd: jax.Array, w_gate_gdf: jax.Array, w_up_gdf: jax.Array, w_down_gfd: jax.Array,
                 sizes_g: jax.Array, rows_1: jax.Array, implementation: str
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    # tokamax_ragged_dot's forwards (their VJPs are not used: this op's backward is below)
    gate = tokamax_ragged_dot(x_rd, w_gate_gdf, sizes_g, implementation)
    up = tokamax_ragged_dot(x_rd, w_up_gdf, sizes_g, implementation)
    h = _call(_forward_body, KERNEL_NAMES[0], rows_1, (gate, up), ("rf",))[0]
    return tokamax_ragged_dot(h, w_down_gfd, sizes_g, implementation), gate, up


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _swiglu_ffn(x_rd: jax.Array, w_gate_gdf: jax.Array, w_up_gdf: jax.Array, w_down_gfd: jax.Array,
                sizes_g: jax.Array, rows_1: jax.Array, implementation: str) -> jax.Array:
    return _ffn_forward(x_rd, w_gate_gdf, w_up_gdf, w_down_gfd, sizes_g, rows_1, implementation)[0]


def _swiglu_ffn_fwd(x_rd: jax.Array, w_gate_gdf: jax.Array, w_up_gdf: jax.Array, w_down_gfd: jax.Array,
                    sizes_g: jax.Array, rows_1: jax.Array, implementation: str
                    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    y, gate, up = _ffn_forward(x_rd, w_gate_gdf, w_up_gdf, w_down_gfd, sizes_g, rows_1, implementation)
    return y, (x_rd, gate, up, w_gate_gdf, w_up_gdf, w_down_gfd, sizes_g, rows_1)


def _swiglu_ffn_bwd(implementation: str, res: tuple[jax.Array, ...], dy_rd: jax.Array
                    ) -> tuple[jax.Array | np.ndarray, ...]:
    import tokamax

    x_rd, gate, up, w_gate_gdf, w_up_gdf, w_down_gfd, sizes_g, rows_1 = res
    f = gate.shape[1]

    def ragged(lhs: jax.Array, rhs: jax.Array, dims: Any, dtype: Any) -> jax.Array:
        return tokamax.ragged_dot_general(lhs, rhs, sizes_g, dims, implementation=implementation,
                                          preferred_element_type=dtype)

    dh = typed_like(ragged(dy_rd, w_down_gfd, RAGGED_DX, gate.dtype), gate)
    dgu, h_fr = _call(partial(_backward_body, side_by_side=True, transposed=True), KERNEL_NAMES[1], rows_1,
                      (gate, up, dh), ("r2f", "fr"))
    x_dr = _call(_transpose_body, KERNEL_NAMES[2], rows_1, (x_rd,), ("fr",))[0]
    # tokamax transposes its weight gradient's rows first ([F, R], [D, R]): the transpose of a
    # transpose is no op for XLA, so the kernels' transposed results are read as they lie.
    dw_down = ragged(h_fr.T, dy_rd, RAGGED_DW, w_down_gfd.dtype)
    dw_gu = ragged(x_dr.T, dgu, RAGGED_DW, w_gate_gdf.dtype)
    dx = ragged(dgu, jnp.concatenate([w_gate_gdf, w_up_gdf], axis=-1), RAGGED_DX, x_rd.dtype)
    return (typed_like(dx, x_rd), typed_like(dw_gu[..., :f], w_gate_gdf),
            typed_like(dw_gu[..., f:], w_up_gdf), typed_like(dw_down, w_down_gfd),
            np.zeros(sizes_g.shape, jax.dtypes.float0), np.zeros(rows_1.shape, jax.dtypes.float0))


_swiglu_ffn.defvjp(_swiglu_ffn_fwd, _swiglu_ffn_bwd)
