"""The link model of compiled XLA programs: what a collective is, which devices it spans, how many
bytes it moves over the node's links and over the NIC, and how long that takes.

The other half of the cost model (``farskip_jax.xla.costs``: compute by roofline): the inspector's
overlap analysis and the synthetic PGLE profile both price collectives here, so the scheduler and
the report agree on what a transfer costs. Link bandwidths come from ``costs.HARDWARE`` (passed in
as ``hw``); times are estimates in microseconds.
"""

from __future__ import annotations

import math
import re
from typing import Any

from farskip_jax.xla.hlo_parse import Computation, HloModule, Instr, shape_arrays, shape_bytes

COLLECTIVE_KINDS = (
    "all-to-all", "ragged-all-to-all", "all-reduce", "reduce-scatter", "all-gather",
    "collective-permute", "collective-broadcast",
)


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
    """Devices in each of a collective's groups (``group_members``' notations; a collective-permute's
    source-target pairs: 2), or ``default`` where the op names no groups."""
    members = group_members(ins, default)
    if members:
        return len(members)
    return 2 if re.search(r"source_target_pairs=\{([^}]*)\}", ins.attrs) else default


# A ragged all-to-all's frontend attribute: the rows it moves per device under balanced routing,
# declared by programs whose send and receive buffers are both bounds (parallel/node_aware.py).
BALANCED_ROWS_ATTR = "balanced_rows"


def collective_bytes(comp: Computation, ins: Instr, done: Instr | None, kind: str,
                     declared_rows: bool = True) -> float:
    """Per-device result bytes of a collective (``ins``; ``done``: its done op if async).

    A start op returns a tuple, so the result is the done's shape. For a ragged all-to-all what
    moves is known only at run time (send sizes): one side of an EP exchange is sized for the worst
    case (a Dispatch's receive buffer: every peer sending all its rows here, EP x the input), the
    other holds the rows a device owns, so the smaller of the send (operand 0) and receive buffers
    is what moves. Where neither side is exact (the node-aware exchange's stages: both are bounds),
    the program declares the rows balanced routing moves (``BALANCED_ROWS_ATTR``), and with
    ``declared_rows`` (the inspector's ``--moe-load balanced``, which prices grouped GEMMs at their
    balanced rows too) those are charged, at most the buffers.
    """
    nbytes = shape_bytes(done.shape if done is not None else ins.shape)
    if kind == "ragged-all-to-all" and ins.operands and ins.operands[0] in comp.by_name:
        operand = comp.by_name[ins.operands[0]].shape
        nbytes = min(nbytes, shape_bytes(operand))
        declared = re.search(BALANCED_ROWS_ATTR + r'="(\d+)"', ins.attrs) if declared_rows else None
        arrays = shape_arrays(operand)
        if declared and arrays and arrays[0][1] and arrays[0][1][0] > 0:
            nbytes = min(nbytes, int(declared.group(1)) * shape_bytes(operand) / arrays[0][1][0])
    return nbytes


def group_members(ins: Instr, num_partitions: int) -> list[int] | None:
    """Partition ids of the replica group that holds partition 0, from any of XLA's notations
    (named mesh axes: partitions numbered row-major over the mesh; iota; explicit lists); None when
    the op names no groups (all partitions) or a notation this does not read."""
    m = _MESH_GROUPS.search(ins.attrs)
    if m:
        sizes = [(k.strip(" '\""), int(v)) for k, v in re.findall(r"([^,=]+)=(\d+)", m.group(1))]
        axes = {a.strip(" '\"") for a in m.group(2).split(",") if a.strip(" '\"")}
        if not axes or not axes <= {k for k, _ in sizes}:
            return None
        members = [0]
        stride = 1
        for name, size in reversed(sizes):  # row-major: the last axis varies fastest
            if name in axes:
                members = [b + i * stride for i in range(size) for b in members]
            stride *= size
        return sorted(members)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", ins.attrs)
    if m:
        groups, size = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        ids = list(range(math.prod(dims)))
        if m.group(4):  # the iota reshaped to dims, transposed by perm, then read row-major
            perm = [int(x) for x in m.group(4).split(",")]
            tdims = [dims[p] for p in perm]
            strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
            ids = []
            for flat in range(math.prod(tdims)):
                idx, rem = [], flat
                for d in reversed(tdims):
                    idx.append(rem % d)
                    rem //= d
                idx.reverse()
                ids.append(sum(idx[j] * strides[perm[j]] for j in range(len(perm))))
        rows = [ids[g * size:(g + 1) * size] for g in range(groups)]
        return next((sorted(r) for r in rows if 0 in r), None)
    m = re.search(r"replica_groups=\{(\{[0-9,{}]*\})\}", ins.attrs)
    if m:
        for grp in re.findall(r"\{([0-9,]*)\}", m.group(1)):
            ids = [int(x) for x in grp.split(",") if x]
            if 0 in ids:
                return sorted(ids)
    return None


def same_node_members(ins: Instr, num_partitions: int, gpus_per_node: int) -> int | None:
    """Members of a collective's replica group on one node (partition p on node p // gpus_per_node:
    devices are laid out process by process, one process per node, `parallel.make_mesh` and the
    deviceless topologies alike); None when the groups are not readable (the link model then takes
    a group as contiguous partitions). A node-aware exchange's inter-node group (one rank per node)
    has 1, its in-node group all of its members, a flat group of 32 ranks 8."""
    members = group_members(ins, num_partitions)
    if not members:
        return None
    return sum(1 for p in members if p // gpus_per_node == members[0] // gpus_per_node)


def link_bytes(kind: str, nbytes: float, n: int, hw: dict[str, Any], same_node: int | None = None
               ) -> tuple[float, float]:
    """(bytes each device moves over the node's links, bytes over its NIC) for a collective over n
    devices of which `same_node` share a node (default: contiguous partitions, min(n, gpus_per_node)).

    all-to-all: one 1/n slice per peer, the remote peers' slices over the NIC: (m - 1)/n and
    (n - m)/n of the buffer (m = same_node). all-reduce: ring, 2(n-1)/n of the buffer per device;
    all-gather / reduce-scatter: (n-1)/n of the full (gathered / unscattered) buffer; beyond one node
    their (n - m)/n share goes over the NIC. collective-permute: the whole buffer over one peer link.
    """
    if n <= 1:
        return 0.0, 0.0
    local = min(n, hw["gpus_per_node"]) if same_node is None else max(1, min(same_node, n))
    if kind in ("all-to-all", "ragged-all-to-all"):
        return nbytes * (local - 1) / n, nbytes * (n - local) / n
    if kind == "all-reduce":
        vol = 2.0 * nbytes * (n - 1) / n
    elif kind in ("all-gather", "collective-broadcast"):
        vol = nbytes * (n - 1) / n
    elif kind == "reduce-scatter":
        vol = nbytes * (n - 1)  # result is 1/n of the input
    else:
        return (nbytes, 0.0) if local > 1 else (0.0, nbytes)
    remote_frac = (n - local) / n
    return vol * (1 - remote_frac), vol * remote_frac


def transfer_time_us(kind: str, nbytes: float, n: int, hw: dict[str, Any], same_node: int | None = None
                     ) -> float:
    """Estimated collective time. nbytes is the per-device result size; `same_node` as in
    `link_bytes`, which splits the bytes between the node's links and the NIC.

    Node's links: NVSwitch, one 450 GB/s port; full mesh (MI300X): one slice per peer, each over its
    own link, so min(local peers, links) links in parallel. NIC: 50 GB/s per device. Both sides run
    at once and the slower sets the time.
    """
    if n <= 1:
        return 0.0
    on_node, nic = link_bytes(kind, nbytes, n, hw, same_node)
    local = min(n, hw["gpus_per_node"]) if same_node is None else max(1, min(same_node, n))
    if hw["link"] == "full_mesh" and kind != "collective-permute":
        bw = hw["p2p_bw"] * max(1, min(local - 1, hw["links"]))
    else:
        bw = hw["p2p_bw"]
    return max(on_node / bw, nic / hw["nic_bw"]) * 1e6 + hw["latency_us"]
