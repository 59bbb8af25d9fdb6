"""The cost model of compiled XLA programs: per-instruction time by roofline, collectives by link model.

Shared by the inspector's overlap analysis (``farskip_jax.inspect.hlo``) and the synthetic PGLE
profiles the scheduler and the trainer compile with (``farskip_jax.xla.pgle``), so that what the
scheduler is told an op costs and what the report charges for it are one number.

All times are estimates in microseconds: matrix FLOPs at the bf16 dense peak or HBM bytes at
bandwidth, whichever is slower; collectives are priced by the link model (``farskip_jax.xla.links``)
from the interconnect table here. They are meant for comparing schedules (FarSkip vs regular), not
for predicting wall-clock step time.
"""

from __future__ import annotations

import math
import re
from typing import Any

from farskip_jax.xla.hlo_parse import Computation, HloModule, Instr, dtype_bytes, shape_arrays, shape_bytes
from farskip_jax.xla.links import collective_kind

# ---------------------------------------------------------------------------------------------
# Hardware table. Sources: NVIDIA H200 datasheet (989 TFLOP/s bf16 dense = 1979 with sparsity / 2;
# 4.8 TB/s HBM3e; NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction per GPU, all 8 GPUs
# behind NVSwitch). AMD Instinct MI300X datasheet (1307.4 TFLOP/s bf16 dense, 5.3 TB/s HBM3; 7
# Infinity Fabric (xGMI) links x 128 GB/s bidirectional = 64 GB/s per direction per link, 8 GPUs
# fully connected peer to peer, 448 GB/s aggregate per direction). Inter-node: one 400 Gb/s NIC per
# GPU (ConnectX-7 on DGX H200; typical MI300X nodes) = 50 GB/s. latency_us is a per-collective
# launch/synchronisation floor (our assumption, order of NCCL/RCCL small-message latency).
# hbm_bw equals memory_bandwidth in farskip_jax/targets/<target>.txtpb (the spec XLA compiles with;
# the MI300X one was corrected from 6.81e12 to the datasheet's 5.3e12), checked by a test.
# ---------------------------------------------------------------------------------------------
HARDWARE: dict[str, dict[str, Any]] = {
    "h200": {
        "peak_flops": 989e12, "hbm_bw": 4.8e12, "link": "nvswitch", "gpus_per_node": 8,
        "p2p_bw": 450e9, "links": 1, "nic_bw": 50e9, "latency_us": 5.0,
        "source": "NVIDIA H200 datasheet; NVLink 4 via NVSwitch",
    },
    "mi300x": {
        "peak_flops": 1307.4e12, "hbm_bw": 5.3e12, "link": "full_mesh", "gpus_per_node": 8,
        "p2p_bw": 64e9, "links": 7, "nic_bw": 50e9, "latency_us": 5.0,
        "source": "AMD Instinct MI300X datasheet; xGMI fully connected, 7 links per GPU",
    },
}
HARDWARE["local"] = dict(HARDWARE["h200"], source="local: H200 numbers (our GPU machine is an H200)")

# Ops that launch no kernel (or run on the collective stream) and so add no compute time.
_FREE_OPS = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
    "replica-id", "opt-barrier", "add-dependency", "copy-start", "copy-done", "send", "recv",
    "send-done", "recv-done", "domain", "iota", "async-update",
}

# ------------------------------------------------------------------ roofline -----------------

def _dims(comp: Computation, name: str) -> list[int]:
    ins = comp.by_name.get(name)
    arrs = shape_arrays(ins.shape) if ins else []
    return arrs[0][1] if arrs else []


def _int_list(attrs: str, key: str) -> list[int]:
    m = re.search(re.escape(key) + r"=\{([0-9,]*)\}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _json_ints(attrs: str, key: str) -> list[int] | None:
    """The first ``"key":["1","2"]`` list of a backend config (None when absent)."""
    m = re.search(r'"' + re.escape(key) + r'":\[([^\]]*)\]', attrs)
    return [int(x.strip('" ')) for x in m.group(1).split(",") if x.strip('" ')] if m else None


# Kinds of matrix work, as ``dot_flops_by_kind`` splits them.
DOT_KINDS = ("dot", "convolution", "gemm", "grouped_gemm", "attention_kernel")
_EXACT_GROUPED = "grouped_gemm_exact_rows"  # the part of grouped_gemm with `EXACT_ROWS_ATTR` (not a kind)


def tokamax_op(ins: Instr) -> str:
    """The tokamax op class a GPU kernel custom call carries in its metadata payload (tokamax writes
    ``metadata_payload="tokamax:{"op":{"__type":"tokamax._src.ops.<op>...."``), or ''."""
    m = re.search(r'__type\\?":\\?"([\w.]+)', ins.attrs) if "tokamax:" in ins.attrs else None
    return m.group(1) if m else ""


# Pallas kernel custom calls: Mosaic GPU (H200) and Triton (MI300X, and CUDA's Triton path).
_PALLAS_TARGETS = ("mosaic_gpu_v2", "mosaic_gpu", "__gpu$xla.gpu.triton", "triton_kernel_call")


def _kernel_from_op_name(op_name: str) -> str | None:
    """A Pallas kernel's kind from its jax name path: tokamax's ragged_dot kernels (forward, input
    gradient, the ragged-contracting weight gradient) or the fused attention of
    ``attention_kernels.py`` (under ``attention/core``), tokamax's flash attention and the MLA decode
    kernel of ``model/mla_decode.py``."""
    if re.search(r"ragged_(?:contracting_dim_)?dot", op_name):
        return "grouped_gemm"
    if "attention/core" in op_name or "flash_attention" in op_name or "mla_decode" in op_name:
        return "attention_kernel"
    return None


def kernel_kind(ins: Instr) -> str | None:
    """What matrix work a custom call does: 'grouped_gemm' (hipBLASLt/cuBLASLt grouped matmul,
    tokamax's ragged_dot kernels), 'attention_kernel' (tokamax's flash attention and its VJP),
    'gemm' (cuBLAS / hipBLASLt GEMMs), or None (no matmul we can price from shapes)."""
    if ins.opcode != "custom-call":
        return None
    target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
    target_s = target.group(1) if target else ""
    op = tokamax_op(ins)
    if "groupedMatmul" in target_s or "ragged_dot" in op:
        return "grouped_gemm"
    if ".attention." in op:
        return "attention_kernel"
    if target_s in _PALLAS_TARGETS:
        # In a real program the payload is often gone (custom_partitioning and our own VJP of the
        # ragged dot drop it); the kernel's jax name path still says what it is.
        kernel = _kernel_from_op_name(ins.op_name)
        if kernel is not None:
            return kernel
    if any(w in target_s.lower() for w in ("gemm", "matmul")) or '"gemm_backend_config"' in ins.attrs:
        return "gemm"
    return None


def _float_operands(comp: Computation, ins: Instr) -> list[list[int]]:
    """Dims of the floating-point array operands (group sizes and kernel metadata are integers)."""
    out = []
    for o in ins.operands:
        src = comp.by_name.get(o)
        arrs = shape_arrays(src.shape) if src is not None else []
        if arrs and arrs[0][0][0] in "fb":  # f16/f32/f8*/bf16
            out.append(arrs[0][1])
    return out


def _grouped_gemm_flops(comp: Computation, ins: Instr) -> float:
    """A grouped GEMM over M sorted rows: every row meets one group's [K, N] matrix, 2 M K N FLOPs
    at its static row count M (the fill is the cost model's business, ``CostModel``).

    Forms: rows [M, K] x groups [G, K, N] -> [M, N] (forward and the input gradient) and the weight
    gradient [M, K] x [M, N] -> [G, K, N] (ragged contracting dimension). Both are the dense-GEMM
    identity M K N = sqrt(|A| |B| |C|) once the group axis (dim 0 of the one 3-D array, as
    ``ragged_dot``'s ``rhs_group_dimensions`` puts it) is dropped, whatever the transpositions."""
    outs = shape_arrays(ins.shape)
    if not outs:
        return 0.0
    arrays = [*_float_operands(comp, ins)[:2], outs[0][1]]
    if len(arrays) != 3 or sorted(len(a) for a in arrays) != [2, 2, 3]:
        return 0.0
    sizes = [math.prod(a[1:]) if len(a) == 3 else math.prod(a) for a in arrays]
    return 2.0 * math.sqrt(math.prod(sizes))


def _mla_decode_flops(comp: Computation, ins: Instr) -> float:
    """``model/mla_decode.py``'s kernel (q_lat [B, M, C], q_rope [B, M, R], latent [B, S, C], rope
    [B, S, R]): scores over every slot, then p . latent, at its static (padded) rows and slots."""
    ops = _float_operands(comp, ins)
    if len(ops) != 4 or any(len(a) != 3 for a in ops):
        return 0.0
    (b, m, c), (_, _, r), (_, s, _) = ops[0], ops[1], ops[2]
    return 2.0 * b * m * s * (c + r) + 2.0 * b * m * s * c


def _attention_flops(comp: Computation, ins: Instr) -> float:
    """tokamax flash attention (q [B, T, H, D], k [B, S, Hk, D], v [B, S, Hk, Dv]): the forward
    runs q.k and p.v over every visible (query, key) pair; a causal mask leaves T (T + 1) / 2 of the
    T x S pairs when S == T. The VJP recomputes q.k and, per output: dq alone = q.k, dO.v, dS.k
    (2 q.k + 1 v); dk and dv = q.k, dO.v, p.dO, dS.q (2 q.k + 2 v); all three: 3 q.k + 2 v."""
    if "mla_decode" in ins.op_name:
        return _mla_decode_flops(comp, ins)
    ops = _float_operands(comp, ins)
    # per-device kernels of a custom-partitioned call see one sequence: [T, H, D], no batch dim
    rank = len(ops[0]) if ops else 0
    if len(ops) < 3 or rank not in (3, 4) or any(len(a) != rank for a in ops[:3]):
        return 0.0
    q, k, v = ([1, *a] if rank == 3 else a for a in ops[:3])
    (b, t, h, d), (_, s, _, _), (_, _, _, dv) = q, k, v
    op = tokamax_op(ins)
    # Without tokamax's payload (a custom-partitioned kernel) the kernel is ours
    # (``attention_kernels.py``): always causal; a VJP kernel reads more than q, k, v (the output's
    # cotangent and the forward's residuals), a forward one (also one rematerialised in the backward
    # program) reads q, k, v and integer masks only.
    causal = re.search(r'causal_mask\\?":\{', ins.attrs) is not None if op else True
    vjp = op.endswith("Vjp") if op else len(ops) > 3
    pairs = b * h * ((t * (s - t) + t * (t + 1) / 2) if causal and s >= t else t * s)
    qk, pv = 2.0 * pairs * d, 2.0 * pairs * dv
    if not vjp:
        return qk + pv
    n_out = len([a for a in shape_arrays(ins.shape) if len(a[1]) == rank])
    return {1: 2 * qk + pv, 2: 2 * qk + 2 * pv}.get(n_out, 3 * qk + 2 * pv)


def dot_flops_by_kind(mod: HloModule, comp: Computation, ins: Instr, _depth: int = 0) -> dict[str, float]:
    """FLOPs of the matrix work of one instruction by ``DOT_KINDS``: dot, convolution, GEMM custom
    calls, grouped GEMMs (``ragged-dot``, grouped-matmul custom calls, tokamax ragged_dot kernels, at
    their static rows), tokamax attention kernels; a fusion's are those of the ops inside it (a
    hipBLASLt ``dynamic_slice_fusion`` holds its GEMM custom call). Loops and calls are not entered
    here (``program_dot_flops`` weights them)."""
    out = shape_arrays(ins.shape)
    out_elems = math.prod(out[0][1]) if out else 0
    if ins.opcode == "dot" and ins.operands:
        lhs = _dims(comp, ins.operands[0])
        k = math.prod(lhs[d] for d in _int_list(ins.attrs, "lhs_contracting_dims") if d < len(lhs))
        return {"dot": 2.0 * out_elems * k}
    if ins.opcode == "ragged-dot":
        return {"grouped_gemm": _grouped_gemm_flops(comp, ins)}
    if ins.opcode == "convolution" and len(ins.operands) > 1:
        rhs = _dims(comp, ins.operands[1])
        m = re.search(r"dim_labels=[^_]*_([0-9a-z]+)->", ins.attrs)
        o = m.group(1).find("o") if m else -1
        per_out = math.prod(rhs) / rhs[o] if rhs and 0 <= o < len(rhs) else 1
        return {"convolution": 2.0 * out_elems * per_out}
    kind = kernel_kind(ins)
    if kind == "grouped_gemm":
        ragged = _json_ints(ins.attrs, "lhs_ragged_dimensions")
        contracting = _json_ints(ins.attrs, "lhs_contracting_dimensions") or []
        if ragged is not None and not set(ragged) & set(contracting) and ins.operands:
            # rows ragged, contraction over K: 2 M N K from the result and the rows' K (exact)
            lhs = _dims(comp, ins.operands[0])
            return {kind: 2.0 * out_elems * math.prod(lhs[d] for d in contracting if d < len(lhs))}
        return {kind: _grouped_gemm_flops(comp, ins)}
    if kind == "attention_kernel":
        return {kind: _attention_flops(comp, ins)}
    if kind == "gemm" and ins.operands:
        lhs = _dims(comp, ins.operands[0])
        cd = _json_ints(ins.attrs, "lhs_contracting_dimensions") or []
        return {kind: 2.0 * out_elems * math.prod(lhs[d] for d in cd if d < len(lhs))}
    if ins.opcode == "fusion" and _depth < 8:
        sub = mod.computations.get(ins.attr("calls") or "")
        if sub:
            acc: dict[str, float] = {}
            for i in sub.instrs:
                for k, v in dot_flops_by_kind(mod, sub, i, _depth + 1).items():
                    acc[k] = acc.get(k, 0.0) + v
            return acc
    return {}


def instr_flops(mod: HloModule, comp: Computation, ins: Instr, _depth: int = 0) -> float:
    """FLOPs of matrix ops: dot, convolution, GEMM and kernel custom calls, and those inside fusions."""
    return sum(dot_flops_by_kind(mod, comp, ins, _depth).values())


# Frontend attribute (`jax.experimental.xla_metadata.set_xla_metadata(exact_rows=1)`) of the ops of a
# grouped GEMM whose static rows all hold tokens: the one-device routed experts sort exactly the N*K
# assignments (`model.moe.local_routed`). `CostModel` prices those in full, whatever the module's
# `grouped_fill` (the balanced share of the bounded expert-parallel receive buffers), so a program
# that holds both (an FCSD teacher with `mesh.teacher_experts: local` beside an expert-parallel
# student) is priced as it computes.
EXACT_ROWS_ATTR = "exact_rows"


def has_exact_rows(ins: Instr, mod: HloModule | None = None) -> bool:
    """`ins` (or, for a fusion, its root) was traced under `EXACT_ROWS_ATTR`."""
    if f'{EXACT_ROWS_ATTR}="1"' in ins.attrs:
        return True
    if ins.opcode == "fusion" and mod is not None:
        sub = mod.computations.get(ins.attr("calls") or "")
        root = _through_bitcasts(sub, sub.root) if sub is not None and sub.root is not None else None
        return root is not None and root is not ins and f'{EXACT_ROWS_ATTR}="1"' in root.attrs
    return False


# The names (`pallas_call(name=...)`, in each kernel's op_name) of the kernels `is_row_kernel` knows.
ROW_KERNEL_NAMES = ("swiglu_rows_fwd", "swiglu_rows_bwd", "rows_transpose")


def is_row_kernel(ins: Instr) -> bool:
    """A Pallas kernel that computes only the rows in the groups of a grouped GEMM's buffer (the
    routed experts' activation, the transpose of the receive buffer's rows: model/swiglu_rows.py):
    priced like the grouped GEMMs around it, at ``CostModel``'s ``grouped_fill`` of its static rows."""
    if ins.opcode != "custom-call":
        return False
    target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
    return (target is not None and target.group(1) in _PALLAS_TARGETS
            and any(re.search(rf"[/(]{name}[/)]", ins.op_name) for name in ROW_KERNEL_NAMES))


def is_grouped_gemm(ins: Instr, mod: HloModule | None = None) -> bool:
    """A grouped GEMM over sorted rows (``jax.lax.ragged_dot``): XLA's ``ragged-dot`` op, the
    hipBLASLt/cuBLASLt grouped-matmul custom call it lowers to, a tokamax ragged_dot kernel, or (with
    ``mod``) a fusion whose root is one of those. Its static row count is the worst case; only the
    rows in its groups are computed (see ``CostModel``'s ``grouped_fill``)."""
    if ins.opcode == "ragged-dot" or kernel_kind(ins) == "grouped_gemm":
        return True
    if ins.opcode == "fusion" and mod is not None:
        sub = mod.computations.get(ins.attr("calls") or "")
        root = _through_bitcasts(sub, sub.root) if sub is not None and sub.root is not None else None
        return root is not None and root is not ins and is_grouped_gemm(root)
    return False


_IN_PLACE_OPS = ("scatter", "dynamic-update-slice")
# A fusion, and jaxlib 0.12's async one: `fusion-start` runs the fused computation (on another
# stream), its `fusion-done` only waits for it.
_FUSIONS = ("fusion", "fusion-start")
_SLICES = ("slice", "dynamic-slice")


def _through_bitcasts(comp: Computation | None, ins: Instr | None) -> Instr | None:
    """``ins`` or, for a bitcast (a view: no data moves), the op it views, transitively."""
    while comp is not None and ins is not None and ins.opcode == "bitcast" and ins.operands:
        ins = comp.by_name.get(ins.operands[0])
    return ins


def is_allocation(ins: Instr) -> bool:
    """An uninitialised buffer (`jax.lax.empty` on GPUs: XLA's AllocateBuffer custom call): no
    kernel runs, nothing is read or written."""
    return ins.opcode == "custom-call" and 'custom_call_target="AllocateBuffer"' in ins.attrs


def _updates_in_place(mod: HloModule | None, comp: Computation, ins: Instr) -> str | None:
    """The operand that `ins` updates in place, or None: a scatter or dynamic-update-slice (or a
    fusion rooted in one) of a buffer of the result's shape that XLA writes into where it lies: an
    entry parameter (a donated buffer such as a decode step's KV cache) or an uninitialised buffer
    allocated for it (`is_allocation`)."""
    root, result = ins.opcode, ins.shape
    if ins.opcode in _FUSIONS and mod is not None:
        called = mod.computations.get(ins.attr("calls") or "")
        root = called.root.opcode if called is not None and called.root is not None else ""
        result = called.root.shape if root else result
    if root not in _IN_PLACE_OPS:
        return None
    for o in ins.operands:
        src = comp.by_name.get(o)
        if src is None or src.shape != result:
            continue
        if (src.opcode == "parameter" and comp.is_entry) or is_allocation(src):
            return o
    return None


def _result_bytes(ins: Instr, kernel: Instr | None = None) -> float:
    """Bytes an op writes: its result, less a GEMM custom call's scratch workspace (the trailing
    s8/u8 vector of its result tuple: 76 MiB per hipBLASLt GEMM on jaxlib 0.12, never written in
    full). ``kernel``: the custom call that produces ``ins``'s result (a fusion's root)."""
    arrays = shape_arrays(ins.shape)
    k = kernel if kernel is not None else ins
    if kernel_kind(k) is not None and len(arrays) > 1 and arrays[-1][0] in ("s8", "u8") \
            and len(arrays[-1][1]) == 1:
        arrays = arrays[:-1]
    return sum(dtype_bytes(dt) * math.prod(dims) for dt, dims in arrays)


def _users_in(comp: Computation) -> dict[str, list[Instr]]:
    users: dict[str, list[Instr]] = {}
    for i in comp.instrs:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    return users


def _uses(users: dict[str, list[Instr]], name: str) -> list[tuple[Instr, int]]:
    """(user, operand position) of every use of ``name``, looking through bitcasts (views)."""
    out = []
    for u in users.get(name, ()):
        if u.opcode == "bitcast":
            out += _uses(users, u.name)
        else:
            out += [(u, k) for k, o in enumerate(u.operands) if o == name]
    return out


def _fusion_bytes(mod: HloModule, comp: Computation, ins: Instr, sub: Computation, in_loop: bool) -> float:
    """HBM traffic of a fusion from what its fused computation touches.

    Reads: an operand used inside only as the source of slices (``slice``, ``dynamic-slice``, through
    bitcasts) is read as those slices, not whole: a loop body that takes one block of a big buffer,
    a hipBLASLt ``dynamic_slice_fusion`` that reads one layer's or one block's rows. Writes: the
    result (less a GEMM's workspace); inside a loop body an output that is a dynamic-update-slice of
    an operand buffer is written in place, so it costs the update and the buffer is not read (XLA
    keeps loop-carried buffers in place; copy insertion adds an explicit copy where it cannot)."""
    users = _users_in(sub)
    params = {i.param_index: i for i in sub.instrs if i.opcode == "parameter"}
    root = sub.root
    outputs = ([sub.by_name[o] for o in root.operands if o in sub.by_name] if root.opcode == "tuple"
               else [root])
    in_place: set[str] = set()
    write = 0.0
    for out in outputs:
        op = _through_bitcasts(sub, out)
        if in_loop and op is not None and op.opcode == "dynamic-update-slice" and len(op.operands) > 1:
            buf = _through_bitcasts(sub, sub.by_name.get(op.operands[0]))
            if buf is not None and buf.opcode == "parameter" and all(
                    u is op and k == 0 for u, k in _uses(users, buf.name)):
                in_place.add(buf.name)
                write += shape_bytes(sub.by_name[op.operands[1]].shape)
                continue
        write += _result_bytes(out, op if op is not None and op.opcode == "custom-call" else None)
    read = 0.0
    for k, o in enumerate(ins.operands):
        src = comp.by_name.get(o)
        full = shape_bytes(src.shape) if src is not None else 0.0
        p = params.get(k)
        if p is None:
            read += full
            continue
        if p.name in in_place:
            continue
        uses = _uses(users, p.name)
        if uses and all(u.opcode in _SLICES and pos == 0 for u, pos in uses):
            read += min(full, sum(shape_bytes(u.shape) for u, _ in uses))
        else:
            read += full
    return read + write


def instr_bytes(comp: Computation, ins: Instr, mod: HloModule | None = None, in_loop: bool = False) -> float:
    """HBM traffic estimate: what an op reads plus what it writes.

    By default its operands and its result. A slice (``slice``, ``dynamic-slice``) reads only the
    slice it returns; inside a loop body (``in_loop``) a ``dynamic-update-slice`` writes its update
    into the loop-carried buffer where it lies (reads and writes the update only); a fusion is priced
    by what its fused computation touches (``_fusion_bytes``); a GEMM custom call's scratch workspace
    is not traffic. An in-place update of a donated buffer (`_updates_in_place`) moves only what it
    writes: its other operands, read and written once."""
    in_place = _updates_in_place(mod, comp, ins)
    sub = (mod.computations.get(ins.attr("calls") or "") if ins.opcode in _FUSIONS and mod is not None
           else None)
    if in_place and sub is not None and sub.root is not None and \
            _through_bitcasts(sub, sub.root).opcode == "dynamic-update-slice":
        # what the fused computation touches, its buffer updated where it lies (slices of the
        # other operands read as slices)
        return _fusion_bytes(mod, comp, ins, sub, in_loop=True)
    if in_place:
        return 2 * sum(shape_bytes(comp.by_name[o].shape) for o in ins.operands
                       if o in comp.by_name and o != in_place)
    operand_bytes = [shape_bytes(comp.by_name[o].shape) if o in comp.by_name else 0.0 for o in ins.operands]
    if ins.opcode in _SLICES:
        return 2 * shape_bytes(ins.shape) + sum(operand_bytes[1:])
    if ins.opcode == "dynamic-update-slice" and in_loop and len(operand_bytes) > 1:
        return 2 * operand_bytes[1] + sum(operand_bytes[2:])
    if sub is not None and sub.root is not None:
        return _fusion_bytes(mod, comp, ins, sub, in_loop)
    return _result_bytes(ins) + sum(operand_bytes)


def trip_count(ins: Instr) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    return int(m.group(1)) if m else 1


class CostModel:
    """The per-op cost model of one module: roofline compute, loops as trips x body.

    ``declared_rows``: ragged exchanges that declare their balanced rows are charged those
    (``collective_bytes``). ``grouped_fill``: the fraction of a grouped GEMM's static rows that hold
    tokens. A dropless
    expert-parallel receive buffer is sized for every peer sending all its rows to one rank (8x the
    rows balanced routing delivers on DSV2-Lite at EP=8), and the grouped GEMM computes only the
    rows its groups hold; 1.0 charges the static worst case. A grouped GEMM declared with
    ``EXACT_ROWS_ATTR`` is charged in full.
    """

    def __init__(self, mod: HloModule, hw: dict[str, Any], grouped_fill: float = 1.0,
                 declared_rows: bool = True):
        if not 0.0 < grouped_fill <= 1.0:
            raise ValueError(f"grouped_fill={grouped_fill}: expected a fraction in (0, 1]")
        self.mod, self.hw, self.grouped_fill = mod, hw, grouped_fill
        self.declared_rows = declared_rows  # as in `collective_bytes`
        self._cost: dict[tuple[str, str], float] = {}
        self._comp_cost: dict[str, float] = {}
        self._comp_flops: dict[str, dict[str, float]] = {}
        self._loop_comps: set[str] | None = None

    def op_time_us(self, comp: Computation, ins: Instr) -> float:
        key = (comp.name, ins.name)
        if key in self._cost:
            return self._cost[key]
        if (ins.opcode in _FREE_OPS or ins.opcode == "fusion-done" or is_allocation(ins)
                or collective_kind(self.mod, ins) is not None):
            t = 0.0
        elif ins.opcode == "while":
            n = trip_count(ins)
            t = n * sum(self.comp_time_us(c) for c in ins.called())
        elif ins.opcode == "call":
            t = sum(self.comp_time_us(c) for c in ins.called())
        elif ins.opcode == "conditional":
            t = max((self.comp_time_us(c) for c in ins.called()), default=0.0)
        else:
            # every op, kernel custom calls included: the slower of its matrix work at peak and its
            # HBM traffic at bandwidth
            flops = instr_flops(self.mod, comp, ins)
            nbytes = instr_bytes(comp, ins, self.mod, comp.name in self.loop_computations)
            t = max(flops / self.hw["peak_flops"], nbytes / self.hw["hbm_bw"]) * 1e6
            if (is_grouped_gemm(ins, self.mod) or is_row_kernel(ins)) and not has_exact_rows(ins, self.mod):
                t *= self.grouped_fill
        self._cost[key] = t
        return t

    @property
    def loop_computations(self) -> set[str]:
        """Computations that run inside a while loop (bodies, conditions, and what they call)."""
        if self._loop_comps is None:
            found: set[str] = set()

            def visit(name: str, in_loop: bool, depth: int) -> None:
                comp = self.mod.computations.get(name)
                if comp is None or depth > 32 or (in_loop and name in found):
                    return
                if in_loop:
                    found.add(name)
                for ins in comp.instrs:
                    if ins.opcode == "while":
                        for c in ins.called():
                            visit(c, True, depth + 1)
                    elif ins.opcode in ("call", "conditional"):
                        for c in ins.called():
                            visit(c, in_loop, depth + 1)

            visit(self.mod.entry, False, 0)
            self._loop_comps = found
        return self._loop_comps

    def comp_dot_flops(self, name: str) -> dict[str, float]:
        """Matrix FLOPs of one run of a computation by ``DOT_KINDS`` at static shapes: loops times
        their trip count, a conditional's costliest branch (as ``op_time_us`` prices it)."""
        if name in self._comp_flops:
            return self._comp_flops[name]
        self._comp_flops[name] = {}  # recursion guard
        comp = self.mod.computations.get(name)
        acc: dict[str, float] = {}

        def add(d: dict[str, float], scale: float = 1.0) -> None:
            for k, v in d.items():
                acc[k] = acc.get(k, 0.0) + scale * v

        for ins in comp.instrs if comp is not None else ():
            if ins.opcode == "while":
                for c in ins.called():
                    add(self.comp_dot_flops(c), trip_count(ins))
            elif ins.opcode == "call":
                for c in ins.called():
                    add(self.comp_dot_flops(c))
            elif ins.opcode == "conditional":
                branches = [self.comp_dot_flops(c) for c in ins.called()]
                add(max(branches, key=lambda d: sum(d.get(k, 0.0) for k in DOT_KINDS), default={}))
            elif collective_kind(self.mod, ins) is None:
                flops = dot_flops_by_kind(self.mod, comp, ins)
                add(flops)
                if "grouped_gemm" in flops and has_exact_rows(ins, self.mod):
                    add({_EXACT_GROUPED: flops["grouped_gemm"]})
        self._comp_flops[name] = acc
        return acc

    def dot_flops(self) -> dict[str, Any]:
        """The program's matrix FLOPs per device: ``static`` (every dot, convolution, GEMM and kernel
        custom call at its compiled shapes, grouped GEMMs at every static row, loops x trips),
        ``priced`` (grouped GEMMs at ``grouped_fill`` of their rows, as the cost model charges them)
        and ``by_kind``."""
        by_kind = self.comp_dot_flops(self.mod.entry)
        static = sum(by_kind.get(k, 0.0) for k in DOT_KINDS)
        bounded = by_kind.get("grouped_gemm", 0.0) - by_kind.get(_EXACT_GROUPED, 0.0)
        return {"static": static, "priced": static - (1.0 - self.grouped_fill) * bounded,
                "grouped_fill": self.grouped_fill, "by_kind": {k: by_kind.get(k, 0.0) for k in DOT_KINDS}}

    def comp_time_us(self, name: str) -> float:
        if name not in self._comp_cost:
            self._comp_cost[name] = 0.0  # recursion guard
            comp = self.mod.computations.get(name)
            self._comp_cost[name] = sum(self.op_time_us(comp, i) for i in comp.instrs) if comp else 0.0
        return self._comp_cost[name]

    def scheduled_computations(self) -> dict[str, int]:
        """Computations that run as instruction sequences, with their execution count."""
        weights: dict[str, int] = {}

        def visit(name: str, w: int, depth: int) -> None:
            comp = self.mod.computations.get(name)
            if comp is None or depth > 32:
                return
            weights[name] = weights.get(name, 0) + w
            for ins in comp.instrs:
                if ins.opcode == "while":
                    n = trip_count(ins)
                    for c in ins.called():
                        visit(c, w * n, depth + 1)
                elif ins.opcode in ("call", "conditional"):
                    for c in ins.called():
                        visit(c, w, depth + 1)

        visit(self.mod.entry, 1, 0)
        return weights
