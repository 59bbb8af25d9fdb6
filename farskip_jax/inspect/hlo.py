"""Parser and overlap analysis for XLA's scheduled HLO text (``compiled.as_text()``).

The scheduled module prints every computation's instructions in schedule order. A collective is
hidden only when compute is scheduled between its ``*-start`` and ``*-done``; XLA rewrites pairs
with nothing between them to ``"is_sync":true``. This module finds every collective in every
computation that runs (ENTRY, while bodies/conditions, called/branch computations), estimates its
transfer time from an interconnect table and the time of the ops between start and done by roofline
(fusions count as one op; their FLOPs come from the dots inside the fused computation), and then
replays the schedule on a two-lane timeline (compute, communication) to get the exposed time.

All times are estimates in microseconds. They are meant for comparing schedules (FarSkip vs
regular), not for predicting wall-clock step time.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from farskip_jax.inspect.hlo_parse import (  # noqa: F401 - re-exported for callers of hlo
    Computation,
    HloModule,
    Instr,
    dtype_bytes,
    parse_hlo,
    shape_arrays,
    shape_bytes,
)

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

COLLECTIVE_KINDS = (
    "all-to-all", "ragged-all-to-all", "all-reduce", "reduce-scatter", "all-gather",
    "collective-permute", "collective-broadcast",
)
# Ops that launch no kernel (or run on the collective stream) and so add no compute time.
_FREE_OPS = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
    "replica-id", "opt-barrier", "add-dependency", "copy-start", "copy-done", "send", "recv",
    "send-done", "recv-done", "domain", "iota", "async-update",
}
_LAYER_RE = re.compile(r"layer_(\d+)")
# JAX names every op of a reverse-mode pass `transpose(<forward name stack>)`; the primitive
# `transpose` (jnp.transpose) prints without the parenthesis.
_BWD_MARK = "transpose("
_FWD_MARK = "jvp("  # the forward of a differentiated function (without _BWD_MARK)
_RECOMPUTE_MARK = "rematted_computation"  # forward ops that jax.checkpoint recomputes in the backward
_TEACHER_RE = re.compile(r"(?:^|[/(])teacher(?=[/)]|$)")
_COMM_ROLES = ("dispatch", "combine")
KNOWN_ROLES = ("dispatch", "combine", "attention", "shared", "router", "experts", "mlp", "lm_head",
               "tp_psum_attn_shared", "tp_psum_routed", "tp_psum_attn", "tp_psum_shared", "tp_psum_ffn",
               "tp_psum_block")


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
    ``attention_kernels.py`` (under ``attention/core``) and tokamax's flash attention."""
    if re.search(r"ragged_(?:contracting_dim_)?dot", op_name):
        return "grouped_gemm"
    if "attention/core" in op_name or "flash_attention" in op_name:
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
    at its static row count M (the fill is the cost model's business, ``_Analyzer``).

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


def _attention_flops(comp: Computation, ins: Instr) -> float:
    """tokamax flash attention (q [B, T, H, D], k [B, S, Hk, D], v [B, S, Hk, Dv]): the forward
    runs q.k and p.v over every visible (query, key) pair; a causal mask leaves T (T + 1) / 2 of the
    T x S pairs when S == T. The VJP recomputes q.k and, per output: dq alone = q.k, dO.v, dS.k
    (2 q.k + 1 v); dk and dv = q.k, dO.v, p.dO, dS.q (2 q.k + 2 v); all three: 3 q.k + 2 v."""
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


def is_grouped_gemm(ins: Instr, mod: HloModule | None = None) -> bool:
    """A grouped GEMM over sorted rows (``jax.lax.ragged_dot``): XLA's ``ragged-dot`` op, the
    hipBLASLt/cuBLASLt grouped-matmul custom call it lowers to, a tokamax ragged_dot kernel, or (with
    ``mod``) a fusion whose root is one of those. Its static row count is the worst case; only the
    rows in its groups are computed (see ``_Analyzer``'s ``grouped_fill``)."""
    if ins.opcode == "ragged-dot" or kernel_kind(ins) == "grouped_gemm":
        return True
    if ins.opcode == "fusion" and mod is not None:
        sub = mod.computations.get(ins.attr("calls") or "")
        root = _through_bitcasts(sub, sub.root) if sub is not None and sub.root is not None else None
        return root is not None and root is not ins and is_grouped_gemm(root)
    return False


_IN_PLACE_OPS = ("scatter", "dynamic-update-slice")
_SLICES = ("slice", "dynamic-slice")


def _through_bitcasts(comp: Computation | None, ins: Instr | None) -> Instr | None:
    """``ins`` or, for a bitcast (a view: no data moves), the op it views, transitively."""
    while comp is not None and ins is not None and ins.opcode == "bitcast" and ins.operands:
        ins = comp.by_name.get(ins.operands[0])
    return ins


def _updates_in_place(mod: HloModule | None, comp: Computation, ins: Instr) -> str | None:
    """The operand that `ins` updates in place, or None: a scatter or dynamic-update-slice (or a
    fusion rooted in one) of an entry parameter of the result's shape, i.e. a donated buffer such
    as a decode step's KV cache, which XLA writes into where it lies."""
    root = ins.opcode
    if ins.opcode == "fusion" and mod is not None:
        called = mod.computations.get(ins.attr("calls") or "")
        root = called.root.opcode if called is not None and called.root is not None else ""
    if root not in _IN_PLACE_OPS or not comp.is_entry:
        return None
    for o in ins.operands:
        src = comp.by_name.get(o)
        if src is not None and src.opcode == "parameter" and src.shape == ins.shape:
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
    if in_place:
        return 2 * sum(shape_bytes(comp.by_name[o].shape) for o in ins.operands
                       if o in comp.by_name and o != in_place)
    operand_bytes = [shape_bytes(comp.by_name[o].shape) if o in comp.by_name else 0.0 for o in ins.operands]
    if ins.opcode in _SLICES:
        return 2 * shape_bytes(ins.shape) + sum(operand_bytes[1:])
    if ins.opcode == "dynamic-update-slice" and in_loop and len(operand_bytes) > 1:
        return 2 * operand_bytes[1] + sum(operand_bytes[2:])
    if ins.opcode == "fusion" and mod is not None:
        sub = mod.computations.get(ins.attr("calls") or "")
        if sub is not None and sub.root is not None:
            return _fusion_bytes(mod, comp, ins, sub, in_loop)
    return _result_bytes(ins) + sum(operand_bytes)


def trip_count(ins: Instr) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    return int(m.group(1)) if m else 1


# ------------------------------------------------------------------ collectives --------------

def collective_kind(mod: HloModule, ins: Instr) -> tuple[str, str] | None:
    """(kind, form) with form in sync/start/done, or None. Handles async-start/-done wrappers."""
    op = ins.opcode
    if op in COLLECTIVE_KINDS:
        return op, "sync"
    for suffix, form in (("-start", "start"), ("-done", "done")):
        if op.endswith(suffix) and op[: -len(suffix)] in COLLECTIVE_KINDS:
            return op[: -len(suffix)], form
    if op == "async-done" and ins.attr("calls") is None:
        return "async", "done"  # paired with its async-start by operand
    if op in ("async-start", "async-done"):
        wrapped = mod.computations.get(ins.attr("calls") or "")
        if wrapped is not None:
            kinds = [i.opcode for i in wrapped.instrs if i.opcode in COLLECTIVE_KINDS]
            if kinds:
                return kinds[0], "start" if op == "async-start" else "done"
    return None


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def group_size(ins: Instr, default: int) -> int:
    """Devices in each of a collective's groups, from any of XLA's replica-group notations:
    named mesh axes (jaxlib 0.12: ``mesh['data'=2,'expert'=4] {'expert'}``, the product of the listed
    axes' sizes), iota (``[groups,size]<=[..]``) or explicit lists (``{{0,1,..}}``)."""
    m = _MESH_GROUPS.search(ins.attrs)
    if m:
        sizes = {k.strip(" '\""): int(v) for k, v in re.findall(r"([^,=]+)=(\d+)", m.group(1))}
        axes = [a.strip(" '\"") for a in m.group(2).split(",") if a.strip(" '\"")]
        return math.prod(sizes[a] for a in axes) if axes and all(a in sizes for a in axes) else default
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", ins.attrs)  # iota form [groups,size]<=[..]
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", ins.attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x]) or default
    m = re.search(r"source_target_pairs=\{([^}]*)\}", ins.attrs)
    if m:
        return 2
    return default


def collective_bytes(comp: Computation, ins: Instr, done: Instr | None, kind: str) -> float:
    """Per-device result bytes of a collective (``ins``; ``done``: its done op if async).

    A start op returns a tuple, so the result is the done's shape. For a ragged all-to-all what
    moves is known only at run time (send sizes): one side of an EP exchange is sized for the worst
    case (a Dispatch's receive buffer: every peer sending all its rows here, EP x the input), the
    other holds the rows a device owns, so the smaller of the send (operand 0) and receive buffers
    is what moves.
    """
    nbytes = shape_bytes(done.shape if done is not None else ins.shape)
    if kind == "ragged-all-to-all" and ins.operands and ins.operands[0] in comp.by_name:
        nbytes = min(nbytes, shape_bytes(comp.by_name[ins.operands[0]].shape))
    return nbytes


def transfer_time_us(kind: str, nbytes: float, n: int, hw: dict[str, Any]) -> float:
    """Estimated collective time. nbytes is the per-device result size.

    all-to-all: each device sends (n-1)/n of its buffer. NVSwitch: over one 450 GB/s port; full mesh
    (MI300X): one slice per peer, each over its own link, so min(n-1, links) links in parallel.
    all-reduce: ring, 2(n-1)/n of the buffer per device. all-gather / reduce-scatter: (n-1)/n of the
    full (gathered / unscattered) buffer. collective-permute: the whole buffer over one peer link.
    Beyond one node the inter-node share (n - gpus_per_node)/n goes over the NIC instead.
    """
    if n <= 1:
        return 0.0
    if kind in ("all-to-all", "ragged-all-to-all"):
        vol = nbytes * (n - 1) / n
    elif kind == "all-reduce":
        vol = 2.0 * nbytes * (n - 1) / n
    elif kind in ("all-gather", "collective-broadcast"):
        vol = nbytes * (n - 1) / n
    elif kind == "reduce-scatter":
        vol = nbytes * (n - 1)  # result is 1/n of the input
    else:
        vol = nbytes
    local = min(n, hw["gpus_per_node"])
    if hw["link"] == "full_mesh" and kind != "collective-permute":
        bw = hw["p2p_bw"] * min(local - 1, hw["links"])
    else:
        bw = hw["p2p_bw"]
    if n > local:
        remote_frac = (n - local) / n
        t = max(vol * (1 - remote_frac) / bw, vol * remote_frac / hw["nic_bw"])
    else:
        t = vol / bw
    return t * 1e6 + hw["latency_us"]


def infer_role(op_name: str) -> tuple[int | None, str | None, str]:
    """(layer, role, direction by name) from a jax.named_scope path in metadata op_name.

    Transformations wrap scope names (`jvp(layer_3)/shard_map/dispatch`,
    `transpose(jvp(layer_3))/...`), so the layer is the last `layer_N` anywhere in the path and
    the role the innermost known scope after it. The direction here is the name's alone; the
    analysis decides it by data flow (``Phases``), which also catches nameless collectives.
    """
    direction = "bwd" if _BWD_MARK in op_name else "fwd"
    layers = _LAYER_RE.findall(op_name)
    layer = int(layers[-1]) if layers else None
    parts = re.split(r"[/()]", op_name)
    role = next((p for p in reversed(parts) if p in KNOWN_ROLES), None)
    return layer, role, direction


def model_of(op_name: str) -> str:
    """'teacher' for ops traced inside ``jax.named_scope("teacher")``, else 'student'."""
    return "teacher" if _TEACHER_RE.search(op_name) else "student"


@dataclass
class BetweenOp:
    name: str
    opcode: str
    est_us: float
    op_name: str


@dataclass
class CollectiveRecord:
    name: str
    kind: str
    computation: str
    start_index: int
    done_index: int
    flagged_sync: bool
    is_async: bool
    bytes: float
    group_size: int
    transfer_us: float
    compute_between_us: float
    hidden_frac: float
    weight: int
    op_name: str
    layer: int | None
    role: str | None
    direction: str
    ops_between: list[BetweenOp]
    sim_exposed_us: float = 0.0
    model: str = "student"  # "teacher" inside jax.named_scope("teacher") (FCSD's frozen teacher)
    recompute: bool = False  # a forward collective that jax.checkpoint re-runs in the backward
    inferred: bool = False  # nameless in the HLO: layer/role/model read from its neighbours

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Analysis:
    module: str
    target: str
    collectives: list[CollectiveRecord]
    totals: dict[str, Any]
    timeline: list[dict[str, Any]]
    lhs_stats: dict[str, Any] | None = None

    def to_dict(self, with_timeline: bool = False) -> dict[str, Any]:
        d = {"module": self.module, "target": self.target, "totals": self.totals,
             "collectives": [c.to_dict() for c in self.collectives], "lhs_stats": self.lhs_stats}
        if with_timeline:
            d["timeline"] = self.timeline
        return d


Flag = bool | tuple  # one flag per value; a tuple-shaped value has one (nested) flag per element


def _any(f: Flag) -> bool:
    return any(_any(x) for x in f) if isinstance(f, tuple) else bool(f)


def _merge(a: Flag, b: Flag) -> Flag:
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_merge(x, y) for x, y in zip(a, b, strict=True))
    if a is b or (not isinstance(a, tuple) and not isinstance(b, tuple) and a == b):
        return a
    return _any(a) or _any(b)


class Phases:
    """Forward or backward for every instruction of a module: JAX's names first, then data flow.

    The rule, per instruction:

    1. An ``op_name`` that JAX marked decides: ``transpose(`` (its reverse-mode pass) means
       backward, ``jvp(`` without ``transpose(`` means forward.
    2. Anything without such a mark decides by data flow: backward when any operand is backward,
       else forward. That covers what XLA creates or merges itself, with an empty ``op_name``: the
       SPMD partitioner's all-reduces of replicated weights' gradients, the all-reduce combiner's
       merged ones, the ragged all-to-alls of the dispatch, and the optimizer's ops (named
       ``jit(step)/...`` outside the differentiated function), such as the global-norm all-reduce
       of the expert gradients. A collective merged from forward and backward parts is backward.
    3. A fusion (or async-start wrapper) is decided by the same rules applied to the instructions
       inside it, one flag per output: XLA's multi-output fusions put a forward and a backward
       sibling together (the mean loss's partial sum next to its gradient, under the gradient's
       name). Tuples, ``get-tuple-element``, called computations' parameters and while-loop carries
       are followed element by element (the carry to a fixed point), so a gradient accumulator in
       a micro-batch loop does not make the loop's forward collectives backward.

    Why names first: XLA's CSE merges identical forward and backward ops (a norm weight's
    broadcast, computed once for the forward and once for its gradient) and keeps one of the two
    names. Seeding pure data flow from such a mislabelled op turned every later forward collective
    of a FarSkip train step backward. A forward op cannot read a backward value, so a forward name
    ends the chain. Schedule position is not used either: XLA may schedule a forward-only collective
    late (the loss's scalar all-reduce, which nothing in the backward reads, lands after backward
    all-to-alls in tests/inspect/toy_programs.ep_step), so "after the first backward op" would call
    it backward. Forward ops that ``jax.checkpoint`` recomputes run inside the backward and JAX
    names them ``transpose(...)/.../rematted_computation``, so a recomputed Dispatch is backward
    here; ``CollectiveRecord.recompute`` marks it.
    """

    def __init__(self, mod: HloModule):
        self.mod = mod
        self.bwd: dict[tuple[str, str], bool] = {}
        self._named: dict[str, bool] = {}
        self.run(mod.entry, [])

    def is_bwd(self, computation: str, instr: str) -> bool:
        return self.bwd.get((computation, instr), False)

    def _has_names(self, cname: str) -> bool:
        """Whether any instruction of a computation carries an op_name to decide by."""
        if cname not in self._named:
            comp = self.mod.computations.get(cname)
            self._named[cname] = comp is not None and any(i.op_name for i in comp.instrs)
        return self._named[cname]

    def run(self, cname: str, params: list[Flag], depth: int = 0) -> Flag:
        """Flags of computation ``cname`` given its parameters' flags; returns the root's flag."""
        comp = self.mod.computations.get(cname)
        if comp is None or depth > 32:
            return any(_any(p) for p in params)
        vals: dict[str, Flag] = {}
        for ins in comp.instrs:
            ops = [vals.get(o, False) for o in ins.operands]
            op = ins.opcode
            if op == "parameter":
                k = ins.param_index
                f = params[k] if k is not None and k < len(params) else False
            elif op == "get-tuple-element":
                src = ops[0] if ops else False
                m = re.search(r"\bindex=(\d+)", ins.attrs)
                k = int(m.group(1)) if m else -1
                f = src[k] if isinstance(src, tuple) and 0 <= k < len(src) else _any(src)
            elif op == "tuple":
                f = tuple(ops)
            elif op == "while":
                state = ops[0] if ops else False
                body, cond = ins.attr("body"), ins.attr("condition")
                for _ in range(16):  # monotone: converges in at most a few passes
                    new = _merge(state, self.run(body, [state], depth + 1)) if body else state
                    if new == state:
                        break
                    state = new
                if cond:
                    self.run(cond, [state], depth + 1)
                f = state
            elif op == "call":
                called = ins.called()
                f = self.run(called[0], ops, depth + 1) if called else any(_any(o) for o in ops)
            elif op == "conditional":
                # operand 0 selects the branch, operand i + 1 is branch i's argument
                outs = [self.run(b, ops[i + 1:i + 2], depth + 1) for i, b in enumerate(ins.called())]
                f = functools.reduce(_merge, outs) if outs else False
                if ops and _any(ops[0]):
                    f = True
            elif (inner := _inner_call(ins)) and self._has_names(inner):
                # A fusion (or async wrapper) is decided by the instructions inside it, per output:
                # XLA's multi-output fusions put forward and backward siblings together (the mean
                # loss's partial sum next to its gradient, under the gradient's op_name).
                f = self.run(inner, ops, depth + 1)
            elif (named := name_phase(ins.op_name)) is not None:
                f = named
            else:
                f = any(_any(o) for o in ops)
            vals[ins.name] = f
            key = (cname, ins.name)
            self.bwd[key] = self.bwd.get(key, False) or _any(f)
        root = comp.root
        return vals.get(root.name, False) if root is not None else False


def name_phase(op_name: str) -> bool | None:
    """True (backward) / False (forward) when JAX's name stack says so, None when it does not."""
    if _BWD_MARK in op_name:
        return True
    if _FWD_MARK in op_name:
        return False
    return None


def _inner_call(ins: Instr) -> str | None:
    """The computation whose instructions make up ``ins`` itself: a fusion's or async-start's body.

    Not ``to_apply`` reducers: XLA shares one ``add`` region among many all-reduces and reduces,
    forward and backward alike, so its names say nothing about the caller.
    """
    return ins.attr("calls") if ins.opcode in ("fusion", "async-start") else None


class _Analyzer:
    """The per-op cost model: roofline compute, link-model collectives.

    ``grouped_fill``: the fraction of a grouped GEMM's static rows that hold tokens. A dropless
    expert-parallel receive buffer is sized for every peer sending all its rows to one rank (8x the
    rows balanced routing delivers on DSV2-Lite at EP=8), and the grouped GEMM computes only the
    rows its groups hold; 1.0 charges the static worst case.
    """

    def __init__(self, mod: HloModule, hw: dict[str, Any], grouped_fill: float = 1.0):
        if not 0.0 < grouped_fill <= 1.0:
            raise ValueError(f"grouped_fill={grouped_fill}: expected a fraction in (0, 1]")
        self.mod, self.hw, self.grouped_fill = mod, hw, grouped_fill
        self._cost: dict[tuple[str, str], float] = {}
        self._comp_cost: dict[str, float] = {}
        self._comp_flops: dict[str, dict[str, float]] = {}
        self._loop_comps: set[str] | None = None
        self._phases: Phases | None = None
        self._users_cache: dict[str, dict[str, list[str]]] = {}

    @property
    def phases(self) -> Phases:
        if self._phases is None:
            self._phases = Phases(self.mod)
        return self._phases

    def op_time_us(self, comp: Computation, ins: Instr) -> float:
        key = (comp.name, ins.name)
        if key in self._cost:
            return self._cost[key]
        if ins.opcode in _FREE_OPS or collective_kind(self.mod, ins) is not None:
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
            if is_grouped_gemm(ins, self.mod):
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
                add(max(branches, key=lambda d: sum(d.values()), default={}))
            elif collective_kind(self.mod, ins) is None:
                add(dot_flops_by_kind(self.mod, comp, ins))
        self._comp_flops[name] = acc
        return acc

    def dot_flops(self) -> dict[str, Any]:
        """The program's matrix FLOPs per device: ``static`` (every dot, convolution, GEMM and kernel
        custom call at its compiled shapes, grouped GEMMs at every static row, loops x trips),
        ``priced`` (grouped GEMMs at ``grouped_fill`` of their rows, as the cost model charges them)
        and ``by_kind``."""
        by_kind = self.comp_dot_flops(self.mod.entry)
        static = sum(by_kind.values())
        grouped = by_kind.get("grouped_gemm", 0.0)
        return {"static": static, "priced": static - (1.0 - self.grouped_fill) * grouped,
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

    def collectives(self, weights: dict[str, int]) -> list[CollectiveRecord]:
        recs = []
        for cname, w in weights.items():
            comp = self.mod.computations[cname]
            for k, ins in enumerate(comp.instrs):
                ck = collective_kind(self.mod, ins)
                if ck is None or ck[1] == "done":
                    continue
                kind, form = ck
                done_k = k
                if form == "start":
                    done_k = next((j for j in range(k + 1, len(comp.instrs))
                                   if comp.instrs[j].operands[:1] == [ins.name]
                                   and (collective_kind(self.mod, comp.instrs[j]) or ("", ""))[1] == "done"),
                                  k)
                done = comp.instrs[done_k]
                nbytes = collective_bytes(comp, ins, done if form == "start" else None, kind)
                n = group_size(ins, self.mod.num_partitions)
                between = []
                for j in range(k + 1, done_k):
                    b = comp.instrs[j]
                    t = self.op_time_us(comp, b)
                    if t > 0:
                        between.append(BetweenOp(b.name, b.opcode, t, b.op_name))
                flagged = '"is_sync":true' in ins.attrs
                is_async = form == "start" and not flagged and bool(between)
                transfer = transfer_time_us(kind, nbytes, n, self.hw)
                compute = sum(b.est_us for b in between) if is_async else 0.0
                layer, role, _ = infer_role(ins.op_name)
                direction = "bwd" if self.phases.is_bwd(cname, ins.name) else "fwd"
                inferred = not ins.op_name
                model = model_of(ins.op_name)
                if inferred:
                    layer, role, model = self._nameless_role(comp, ins, done, kind, direction)
                recs.append(CollectiveRecord(
                    ins.name, kind, cname, k, done_k, flagged, is_async, nbytes, n, transfer, compute,
                    min(compute, transfer) / transfer if transfer > 0 else 1.0, w, ins.op_name, layer,
                    role, direction, between, model=model, recompute=_RECOMPUTE_MARK in ins.op_name,
                    inferred=inferred))
        return recs


    def _nameless_role(self, comp: Computation, ins: Instr, done: Instr, kind: str, direction: str
                       ) -> tuple[int | None, str | None, str]:
        """(layer, role, model) of a collective without an op_name, from its neighbours' names.

        XLA leaves some collectives nameless: jax.lax.ragged_all_to_all lowers without a location
        (the EP row exchange), and the combiner's merged all-reduces lose theirs. Layer and model
        come from the nearest named producer of the first operand (else the nearest named
        consumer). The role is a communication scope (dispatch, combine, tp_psum_*) if either side
        is in one; otherwise, for an all-to-all next to the routed experts, the data flow says which
        exchange it is: forward, the Dispatch feeds the experts and the Combine reads them; the
        backward runs the transposes, so there the Combine's transpose feeds the experts' backward
        and the Dispatch's transpose reads it. No role found: no layer either.
        """
        producer = self._named_producer(comp, ins.operands[0]) if ins.operands else ""
        consumers = self._named_consumers(comp, done.name)
        names = [n for n in [producer, *consumers] if n]
        if not names:
            return None, None, "student"
        p_layer, p_role, _ = infer_role(producer)
        c_roles = [infer_role(c)[1] for c in consumers]
        layer = p_layer if p_layer is not None else next(
            (infer_role(n)[0] for n in names if infer_role(n)[0] is not None), None)
        comm = [r for r in [p_role, *c_roles] if r in _COMM_ROLES or (r or "").startswith("tp_psum")]
        role = comm[0] if comm else None
        if role is None and kind in ("all-to-all", "ragged-all-to-all"):
            feeds, reads = "experts" in c_roles, p_role == "experts"
            if feeds != reads:
                role = ("dispatch" if feeds else "combine") if direction == "fwd" else \
                    ("combine" if feeds else "dispatch")
        # Without a role the neighbours say little: a merged gradient all-reduce reads many layers.
        return (layer if role else None), role, model_of(names[0])

    def _users(self, comp: Computation) -> dict[str, list[str]]:
        if comp.name not in self._users_cache:
            users: dict[str, list[str]] = {}
            for i in comp.instrs:
                for o in i.operands:
                    users.setdefault(o, []).append(i.name)
            self._users_cache[comp.name] = users
        return self._users_cache[comp.name]

    def _named_producer(self, comp: Computation, name: str, depth: int = 0) -> str:
        """op_name of the nearest named instruction up the first-operand chain ('' if none)."""
        ins = comp.by_name.get(name)
        while ins is not None and depth < 32:
            if ins.op_name:
                return ins.op_name
            ins = comp.by_name.get(ins.operands[0]) if ins.operands else None
            depth += 1
        return ""

    def _named_consumers(self, comp: Computation, name: str) -> list[str]:
        """op_names of the nearest named users (breadth first, a few levels), in schedule order."""
        users = self._users(comp)
        out: list[str] = []
        frontier, seen = [name], {name}
        for _ in range(6):
            nxt = []
            for n in frontier:
                for u in users.get(n, ()):
                    if u in seen:
                        continue
                    seen.add(u)
                    ui = comp.by_name[u]
                    (out if ui.op_name else nxt).append(ui.op_name or u)
            if out or not nxt:
                break
            frontier = nxt
        return out


class _Simulator:
    """Two-lane replay: compute ops run back to back, collectives on one communication lane."""

    def __init__(self, an: _Analyzer, recs: list[CollectiveRecord], max_events: int = 200_000):
        self.an, self.mod = an, an.mod
        self.by_key = {(r.computation, r.name): r for r in recs}
        self.t = 0.0
        self.comm_free = 0.0
        self.events: list[dict[str, Any]] = []
        self.max_events = max_events
        self.compute_us = 0.0

    def _emit(self, lane: str, name: str, ts: float, dur: float, **args: Any) -> None:
        if len(self.events) < self.max_events and dur > 0:
            self.events.append({"lane": lane, "name": name, "ts": ts, "dur": dur, "args": args})

    def run(self, name: str, depth: int = 0) -> None:
        comp = self.mod.computations.get(name)
        if comp is None or depth > 32:
            return
        pending: dict[str, tuple[float, CollectiveRecord]] = {}
        for ins in comp.instrs:
            ck = collective_kind(self.mod, ins)
            if ck is not None:
                kind, form = ck
                if form == "done":
                    src = ins.operands[0] if ins.operands else ""
                    if src in pending:
                        end, rec = pending.pop(src)
                        wait = max(0.0, end - self.t)
                        rec.sim_exposed_us += wait
                        self._emit("compute", f"wait {rec.kind}", self.t, wait, collective=rec.name)
                        self.t += wait
                    continue
                rec = self.by_key.get((name, ins.name))
                if rec is None:
                    continue
                start = max(self.t, self.comm_free)
                end = start + rec.transfer_us
                self.comm_free = end
                self._emit("comm", rec.kind, start, rec.transfer_us, collective=rec.name,
                           role=rec.role, layer=rec.layer, direction=rec.direction, bytes=rec.bytes,
                           is_async=rec.is_async)
                if rec.is_async:
                    pending[ins.name] = (end, rec)
                else:
                    wait = end - self.t
                    rec.sim_exposed_us += wait
                    self._emit("compute", f"wait {rec.kind} (sync)", self.t, wait, collective=rec.name)
                    self.t = end
            elif ins.opcode == "while":
                for _ in range(trip_count(ins)):
                    for c in ins.called()[::-1]:  # condition, then body
                        self.run(c, depth + 1)
            elif ins.opcode == "call":
                for c in ins.called():
                    self.run(c, depth + 1)
            elif ins.opcode == "conditional":
                branches = ins.called()
                if branches:
                    self.run(max(branches, key=self.an.comp_time_us), depth + 1)
            else:
                dur = self.an.op_time_us(comp, ins)
                if dur > 0:
                    layer, role, _ = infer_role(ins.op_name)
                    self._emit("compute", ins.name, self.t, dur, opcode=ins.opcode, op_name=ins.op_name,
                               layer=layer, role=role,
                               direction="bwd" if self.an.phases.is_bwd(name, ins.name) else "fwd")
                    self.t += dur
                    self.compute_us += dur


def _totals(recs: list[CollectiveRecord], sim: _Simulator) -> dict[str, Any]:
    def agg(rs: list[CollectiveRecord]) -> dict[str, Any]:
        transfer = sum(r.transfer_us * r.weight for r in rs)
        hidden = sum(min(r.compute_between_us, r.transfer_us) * r.weight for r in rs)
        exposed = sum(r.sim_exposed_us for r in rs)
        return {
            "count": sum(r.weight for r in rs), "sync": sum(r.weight for r in rs if not r.is_async),
            "async": sum(r.weight for r in rs if r.is_async), "transfer_us": transfer,
            "hidden_us": hidden, "hidden_frac": hidden / transfer if transfer else None,
            "sim_exposed_us": exposed,
            "sim_hidden_frac": round(max(0.0, 1 - exposed / transfer), 9) if transfer else None,
        }

    kinds = sorted({r.kind for r in recs})
    return {
        "all": agg(recs),
        "by_kind": {k: agg([r for r in recs if r.kind == k]) for k in kinds},
        "by_direction": {d: agg([r for r in recs if r.direction == d]) for d in ("fwd", "bwd")},
        "by_kind_direction": {f"{k}/{d}": agg([r for r in recs if r.kind == k and r.direction == d])
                              for k in kinds for d in ("fwd", "bwd")
                              if any(r.kind == k and r.direction == d for r in recs)},
        "by_role": _by_role(recs, agg),
        # FCSD: the frozen teacher's forward (jax.named_scope("teacher")) apart from the student's
        "by_model": {m: agg([r for r in recs if r.model == m]) for m in ("student", "teacher")
                     if any(r.model == m for r in recs)},
        "by_model_kind": {f"{m}/{k}": agg([r for r in recs if r.model == m and r.kind == k])
                          for m in ("student", "teacher") for k in kinds
                          if any(r.model == m and r.kind == k for r in recs)},
        "est_step_us": sim.t,
        "est_compute_us": sim.compute_us,
        "dot_flops": sim.an.dot_flops(),
    }


def _by_role(recs: list[CollectiveRecord], agg: Any) -> dict[str, Any]:
    roles: dict[str, list[CollectiveRecord]] = {}
    for r in recs:
        roles.setdefault(f"{r.role}/{r.direction}", []).append(r)
    return {k: agg(v) for k, v in sorted(roles.items())}


def analyze(text: str, target: str, lhs_schedule_text: str | None = None, grouped_fill: float = 1.0
            ) -> Analysis:
    """Parse scheduled HLO text and estimate collective overlap for ``target`` (see HARDWARE);
    ``grouped_fill`` as in ``_Analyzer``."""
    if target not in HARDWARE:
        raise ValueError(f"unknown target {target!r}; known: {sorted(HARDWARE)}")
    mod = parse_hlo(text)
    an = _Analyzer(mod, HARDWARE[target], grouped_fill)
    recs = an.collectives(an.scheduled_computations())
    sim = _Simulator(an, recs)
    sim.run(mod.entry)
    lhs = parse_lhs_schedule(lhs_schedule_text) if lhs_schedule_text else None
    return Analysis(mod.name, target, recs, _totals(recs, sim), sim.events, lhs)


# ---------------------------------------------------------- latency-hiding-schedule dump -----

def parse_lhs_schedule(text: str) -> dict[str, Any]:
    """Parse ``<module>.schedule.txt`` written with xla_dump_latency_hiding_schedule.

    It is a text proto: ``hlo_module { computations { name id ... } }`` and per scheduled
    computation ``computation_schedules { computation_id ... scheduler_statistics { ... } }``.
    Returns per computation name the statistics (``*_wasted_cycles``, ``total_cycles``, ...) and
    their sum. XLA's cost model may treat all-to-all as free (see FARSKIP.md section 5), so these
    numbers are XLA's view, not ours.
    """
    names: dict[str, str] = {}
    for m in re.finditer(r'\n  computations \{\n    name: "([^"]+)"', text):
        # the computation's own id is the last 4-space-indented "id:" before its closing brace
        end = text.find("\n  }\n", m.end())
        ids = re.findall(r"\n    id: (\d+)", text[m.end():end])
        if ids:
            names[ids[-1]] = m.group(1)
    per: dict[str, dict[str, float]] = {}
    for m in re.finditer(r"computation_schedules \{\n\s*computation_id: (\d+)", text):
        s = text.find("scheduler_statistics {", m.end())
        nxt = text.find("computation_schedules {", m.end())
        if s < 0 or (0 <= nxt < s):
            continue
        body = text[s:text.find("}", s)]
        stats = {k: float(v) for k, v in re.findall(r"(\w+): ([0-9.eE+\-]+)", body)}
        per[names.get(m.group(1), m.group(1))] = stats
    total: dict[str, float] = {}
    for stats in per.values():
        for k, v in stats.items():
            total[k] = total.get(k, 0.0) + v
    return {"computations": per, "total": total}
