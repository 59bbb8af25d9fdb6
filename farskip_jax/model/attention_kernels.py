"""Fused (single-kernel) causal attention over packed documents, through tokamax's flash kernels.

Why: `model/flash.py` is flash attention written in XLA ops. On a GPU each block pair is several
fusions with an fp32 [B, H, bq, bk] score block in HBM between them; a fused kernel keeps the
scores in registers / shared memory and reads q, k, v once per block. Measured deviceless (one
layer's attention, B=4, T=4096, 16 heads, MLA head dims 192/128, bf16, forward + backward, XLA's
temporary memory): H200 blockwise 843 MiB, Mosaic GPU kernel 67 MiB; MI300X blockwise 918 MiB,
Pallas-Triton kernel 131 MiB (module tests and the report in tests/model/test_attention_kernels.py).

The mask. Packed documents are contiguous runs of equal segment ids within a row (the data
pipeline's packer writes documents one after another and its padding, id 0, as one run at the
end), so "same document and causal" is exactly "key index in [start of the query's run, query]".
tokamax's `base.Mask(k_start=..., is_causal=True)` says that per query with one int32 per token
instead of a [T, T] mask; the kernels skip key blocks wholly before `min(k_start)` of a query
block and above the diagonal. `document_starts` computes the starts. CONTRACT: a segment id that
appears in two separate runs of a row is two documents here (`reference_attention` would join
them); padding rows (id 0) attend causally among themselves, as in the reference.

Kernels, chosen per target by `fused_kernel` (what `ExecutionConfig.attention: auto` uses):

- "mosaic_gpu" (Hopper, sm_90: H100 / H200): tokamax's Pallas Mosaic GPU flash attention and its
  own backward kernels (one custom call `mosaic_gpu_v2` forward, two backward: dq and dk/dv). It
  takes k_start natively in both directions, a v head dim different from q/k (MLA: no padding),
  and grouped key/value heads (query head h reads key/value head h // (H / G), HF's repeat_kv
  order). bf16 / fp16 only: its backward refuses fp32 ("Only f16 and bf16 supported").
- "pallas_triton" (gfx942: MI300X): tokamax's Pallas-Triton flash attention, lowered by JAX's
  Pallas Triton backend to XLA's built-in Triton (`__gpu$xla.gpu.triton`; no triton or jax-triton
  package involved). Forward masks by k_start in the kernel; tokamax's backward turns any mask
  but plain causal into a dense boolean [B, 1, T, T] array (64 MiB at B=4, T=4096, shared by all
  heads), so the backward reads that mask. Kernel configs are given explicitly, as tokamax's
  heuristics and device checks parse `compute_capability` as a number, which a ROCm device's is
  not ("gfx942"); they are tokamax's heuristic sizes with `num_stages=1` (Pallas' ROCm default),
  untuned (no MI300X was available).
- "xla": tokamax's reference implementation (dense [T, T] scores, plain autodiff), the same API and
  `Mask` object: what CPU tests run to check everything in this module but the GPU kernel itself.

Sharding: XLA's SPMD partitioner does not know how to split a kernel's custom call, and a
batch-sharded input (expert-parallel training shards tokens over (data, expert)) would be
all-gathered and every device would compute the whole batch. Forward and backward are therefore
each a `custom_partitioning` op that runs the kernel on each device's rows (batch axis sharded as
the input is; sequence, heads and head dims whole). Inside a fully manual `shard_map` (the
tensor-parallel forward) and on one device JAX inlines them, so there the kernel sees the local
arrays directly.

Shape legend: B batch, T tokens, H query heads, G key/value heads (G divides H), K q/k head dim,
V v head dim.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax.platforms import device_family

Kernel = Literal["mosaic_gpu", "pallas_triton", "xla"]
KERNELS: tuple[str, ...] = ("mosaic_gpu", "pallas_triton", "xla")
FUSED_DTYPES = (jnp.bfloat16, jnp.float16)


class _FirstAutotuneMiss(logging.Filter):
    """tokamax logs "Autotuning cache miss" (absl, WARNING) for every kernel call it traces without
    a tuned config: thousands of identical lines in one full-size compile. Keep the first of each
    kernel class, drop the repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if not msg.startswith("Autotuning cache miss"):
            return True
        key = msg.split("(", 1)[0]  # "Autotuning cache miss for <kernel class>"
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


logging.getLogger("absl").addFilter(_FirstAutotuneMiss())

# Device kinds that are gfx942 but whose compile-only (deviceless) devices do not say so: the
# MI300X target spec's devices report kind "MI300X" and no compute capability. A real MI300X reports
# compute_capability "gfx942", which the Pallas Triton lowering reads by itself.
_GFX942_KINDS = {"MI300X": "gfx942"}


def document_starts(segment_ids_bt: jax.Array) -> jax.Array:
    """[B, T] int32: index of the first token of the run of equal segment ids that token t is in.

    With contiguous documents (module docstring) and a causal mask, the keys a query may see are
    exactly [document_starts[b, t], t].
    """
    t = segment_ids_bt.shape[1]
    idx = jnp.arange(t, dtype=jnp.int32)[None, :]
    first = jnp.concatenate([jnp.ones_like(segment_ids_bt[:, :1], dtype=bool),
                             segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
    return jax.lax.cummax(jnp.where(first, idx, 0), axis=1)


def _rocm_arch(device: Any) -> str | None:
    cc = str(getattr(device, "compute_capability", ""))
    return cc if cc.startswith("gfx") else _GFX942_KINDS.get(str(getattr(device, "device_kind", "")))


def fused_kernel(device: Any, dtype: Any) -> Kernel | None:
    """The fused kernel that was checked for `device` and `dtype`, or None (use blockwise).

    mosaic_gpu on compute capability 9.x (Hopper), pallas_triton on gfx942, both for bf16 / fp16
    only; None on CPU, on other GPUs (not compiled or checked here) and for fp32.
    """
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in FUSED_DTYPES]:
        return None
    family = device_family(device)
    if family == "cuda":
        try:
            major = float(getattr(device, "compute_capability", "0"))
        except ValueError:
            return None
        return "mosaic_gpu" if 9.0 <= major < 10.0 else None
    if family == "rocm":
        return "pallas_triton" if gfx942_triton_ready(device) else None
    return None


def gfx942_triton_ready(device: Any) -> bool:
    """`device` is a gfx942 (MI300X) whose Pallas Triton lowering can find its architecture."""
    return _rocm_arch(device) == "gfx942" and _triton_ready(device)


def _triton_ready(device: Any) -> bool:
    """Whether the Pallas Triton lowering can find `device`'s architecture; for a compile-only gfx942
    device it is told (JAX's `gpu_info.registry`, keyed by device kind)."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        return False
    kind = str(getattr(device, "device_kind", ""))
    cc = str(getattr(device, "compute_capability", ""))
    if cc.startswith("gfx") or kind in gpu_info.registry:
        return True
    arch = _GFX942_KINDS.get(kind)
    if arch is None or not hasattr(gpu_info, "GpuInfo"):
        return False
    gpu_info.registry[kind] = lambda: gpu_info.GpuInfo(gpu_version=None, arch_name=arch, compute_capability=0)
    return True


@functools.cache
def _op(kernel: Kernel, seq_len: int) -> Any:
    """The tokamax attention op of `kernel` (built once per kernel and, for Triton, block size)."""
    if kernel == "xla":
        from tokamax._src.ops.attention import base

        return base.DotProductAttention()
    if kernel == "mosaic_gpu":
        from tokamax._src.ops.attention import pallas_mosaic_gpu

        return pallas_mosaic_gpu.PallasMosaicGpuFlashAttention()
    if kernel == "pallas_triton":
        from tokamax._src.ops.attention import pallas_triton, pallas_triton_vjp

        # tokamax's heuristic block sizes (a power of two in [16, 64]); explicit because its
        # heuristics and device checks parse the ROCm compute capability as a float.
        block = min(max(1 << max(seq_len - 1, 1).bit_length(), 16), 64)
        bwd = pallas_triton_vjp.PallasTritonFlashAttentionVjp(
            bypass_device_check=True,
            config=pallas_triton_vjp.Config(block_m1=min(32, block), block_n1=block, block_m2=block,
                                            block_n2=min(32, block), num_warps=4, num_stages=1))
        return pallas_triton.PallasTritonFlashAttention(
            bypass_device_check=True, vjp=bwd,
            config=pallas_triton.Config(block_q=block, block_k=block, num_warps=4, num_stages=1))
    raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {KERNELS}")


@contextlib.contextmanager
def _on(device: Any) -> Iterator[None]:
    """`device` as JAX's default device: tokamax reads the default device to pick and configure its
    kernels, and the per-device halves below are traced while XLA compiles, outside the caller's
    context."""
    if device is None or getattr(device, "platform", "cpu") == "cpu":
        yield
        return
    with jax.default_device(device):
        yield


def _mask(k_start_bt: jax.Array) -> Any:
    from tokamax._src.ops.attention import base

    return base.Mask(k_start=k_start_bt[:, None, :], is_causal=True)  # [B, 1 (every head), T]


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, k_start: jax.Array, scale: float, kernel: Kernel,
             device: Any, residuals: bool) -> tuple[jax.Array, ...]:
    """(out [B, T, H, V],) or (out, row max [B, H, T], softmax denominator [B, H, T])."""
    with _on(device):
        op = _op(kernel, q.shape[1])
        got = op(q, k, v, mask=_mask(k_start), logits_scale=scale, return_residuals=residuals)
    if not residuals:
        return (got,)
    out, (row_max, denom) = got
    return out, row_max, denom


def _backward(q: jax.Array, k: jax.Array, v: jax.Array, k_start: jax.Array, out: jax.Array,
              row_max: jax.Array, denom: jax.Array, d_out: jax.Array, scale: float, kernel: Kernel,
              device: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) from the forward's output and softmax statistics, by the kernel's own backward
    (tokamax's `vjp` op); tokamax's "xla" op has none and is differentiated by JAX instead."""
    with _on(device):
        op = _op(kernel, q.shape[1])
        mask = _mask(k_start)
        if op.vjp is None:
            _, pullback = jax.vjp(lambda q, k, v: op(q, k, v, mask=mask, logits_scale=scale), q, k, v)
            return pullback(d_out)
        # The forward's canonical keyword arguments (precision, logits dtype, ...), as tokamax's own
        # custom_vjp hands them to its backward op.
        kwargs = dict(op.bind(q, k, v, mask=mask, logits_scale=scale).kwargs)
        kwargs.pop("return_residuals", None)
        grads = op.vjp((row_max, denom), out, d_out, q, k, v, **kwargs)
    return grads["q"], grads["k"], grads["v"]


_TRITON_CALL = "__gpu$xla.gpu.triton"


def _embedded(fn: Any, arrays: tuple[jax.Array, ...], static: tuple[Any, ...]) -> Any:
    """`fn(*arrays, *static)` for one device's rows, as the partitioner traces it during compilation.

    The Pallas Triton lowering looks up the GPU from JAX's default device when it lowers, and XLA
    lowers this per-device function after the partition callback returns, outside any context set
    here: deviceless, the default device is then the host CPU and the lowering fails ("No supported
    GPU devices found"). So for that kernel the function is lowered here, with the target as the
    default device, through `jax.export`, and embedded as the exported module, which needs no
    further lowering. Mosaic GPU's lowering needs no device and is traced directly.
    """
    _, kernel, device = static
    if kernel != "pallas_triton":
        return fn(*arrays, *static)
    from jax import export

    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    with _on(device):
        exported = export.export(jax.jit(lambda *a: fn(*a, *static)), platforms=[device_family(device)],
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call(_TRITON_CALL)])(*shapes)
    return exported.call(*arrays)


def _batch_axes(sharding: Any) -> Any:
    """The mesh axes dimension 0 is split over in `sharding` (None: not split / unknown)."""
    spec = getattr(sharding, "spec", None)
    return spec[0] if spec else None


def _per_batch(mesh: Any, axes: Any, ranks: tuple[int, ...]) -> tuple[NamedSharding, ...]:
    return tuple(NamedSharding(mesh, P(axes, *([None] * (r - 1)))) for r in ranks)


def _partitioned(fn: Any, n_static: int, in_ranks: tuple[int, ...], out_ranks: tuple[int, ...],
                 rule: str) -> Any:
    """`fn` as a custom_partitioning op split over the batch axis only (module docstring).

    `fn(*arrays, *static)`: `n_static` trailing static arguments; dimension 0 of every array is the
    batch. The partition takes the batch sharding of the first operand (q) and
    asks the partitioner to bring every operand and result to it, whole along every other axis.
    """
    n_arrays = len(in_ranks)
    static = tuple(range(n_arrays, n_arrays + n_static))
    op = custom_partitioning(fn, static_argnums=static)

    def partition(*args: Any) -> Any:
        *static_vals, mesh, arg_shapes, result_shape = args
        axes = _batch_axes(arg_shapes[0].sharding)
        single = not isinstance(result_shape, (tuple, list))
        out_shardings = _per_batch(mesh, axes, out_ranks)

        def lower_fn(*arrays: jax.Array) -> Any:
            return _embedded(fn, arrays, tuple(static_vals))

        return (mesh, lower_fn, out_shardings[0] if single else out_shardings,
                _per_batch(mesh, axes, in_ranks))

    def infer(*args: Any) -> Any:
        *_, mesh, arg_shapes, result_shape = args
        out = _per_batch(mesh, _batch_axes(arg_shapes[0].sharding), out_ranks)
        return out[0] if not isinstance(result_shape, (tuple, list)) else out

    # Shardy: only the batch factor may be sharded; everything else must stay whole (listed in the
    # order the factors first appear in the rule, which is how Shardy numbers them).
    names = rule.replace(",", " ").replace("->", " ").split()
    whole = tuple(f for i, f in enumerate(names) if f != "b" and f not in names[:i])
    op.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=whole)
    return op


def _fwd_out(q, k, v, k_start, scale, kernel, device):  # noqa: ANN001, ANN202 - traced by custom_partitioning
    return _forward(q, k, v, k_start, scale, kernel, device, residuals=False)[0]


def _fwd_res(q, k, v, k_start, scale, kernel, device):  # noqa: ANN001, ANN202
    return _forward(q, k, v, k_start, scale, kernel, device, residuals=True)


def _bwd(q, k, v, k_start, out, row_max, denom, d_out, scale, kernel, device):  # noqa: ANN001, ANN202
    return _backward(q, k, v, k_start, out, row_max, denom, d_out, scale, kernel, device)


_FWD_RULE = "b t h k, b s g k, b s g v, b t"
_fwd_out_p = _partitioned(_fwd_out, 3, (4, 4, 4, 2), (4,), f"{_FWD_RULE} -> b t h v")
_fwd_res_p = _partitioned(_fwd_res, 3, (4, 4, 4, 2), (4, 3, 3),
                          f"{_FWD_RULE} -> b t h v, b h t, b h t")
_bwd_p = _partitioned(_bwd, 3, (4, 4, 4, 2, 4, 3, 3, 4), (4, 4, 4),
                      f"{_FWD_RULE}, b t h v, b h t, b h t, b t h v -> b t h k, b s g k, b s g v")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attend(q: jax.Array, k: jax.Array, v: jax.Array, k_start: jax.Array, scale: float, kernel: Kernel,
            device: Any) -> jax.Array:
    return _fwd_out_p(q, k, v, k_start, scale, kernel, device)


def _attend_fwd(q: jax.Array, k: jax.Array, v: jax.Array, k_start: jax.Array, scale: float, kernel: Kernel,
                device: Any) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, row_max, denom = _fwd_res_p(q, k, v, k_start, scale, kernel, device)
    return out, (q, k, v, k_start, out, row_max, denom)


def _attend_bwd(scale: float, kernel: Kernel, device: Any, res: tuple[jax.Array, ...], d_out: jax.Array
                ) -> tuple[jax.Array | None, ...]:
    dq, dk, dv = _bwd_p(*res, d_out.astype(res[4].dtype), scale, kernel, device)
    return dq, dk, dv, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def kernel_attention(q_bthk: jax.Array, k_bsgk: jax.Array, v_bsgv: jax.Array, segment_ids_bt: jax.Array,
                     scale: float, kernel: Kernel, device: Any = None) -> jax.Array:
    """Causal attention within packed documents by a tokamax kernel: [B, T, H, V] in q's dtype.

    k/v may have fewer heads than q (G divides H; query head h reads key/value head h // (H / G)).
    `device`: the device the kernel is built for (platforms.target_device() of the caller); it is
    JAX's default device while tokamax is traced, including the per-device halves that XLA's
    partitioner traces during compilation. Differentiable w.r.t. q, k, v (the kernel's backward).
    """
    b, t, h, _ = q_bthk.shape
    g = k_bsgk.shape[2]
    if k_bsgk.shape[1] != t or h % g or v_bsgv.shape[:3] != k_bsgk.shape[:3]:
        raise ValueError(f"kernel_attention: q {q_bthk.shape}, k {k_bsgk.shape}, v {v_bsgv.shape}: self-"
                         "attention with key/value heads dividing the query heads expected")
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {KERNELS}")
    k_start = document_starts(segment_ids_bt)
    return _attend(q_bthk, k_bsgk, v_bsgv, k_start, float(scale), kernel, device)
