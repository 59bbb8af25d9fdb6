"""Overlap analysis of XLA's scheduled HLO text (``compiled.as_text()``).

The scheduled module prints every computation's instructions in schedule order. A collective is
hidden only when compute is scheduled between its ``*-start`` and ``*-done``; XLA rewrites pairs
with nothing between them to ``"is_sync":true``. This module finds every collective in every
computation that runs (ENTRY, while bodies/conditions, called/branch computations), prices its
transfer and the ops between start and done with ``farskip_jax.xla.costs`` (fusions count as one
op; their FLOPs come from the dots inside the fused computation), names its layer, role and phase,
and then replays the schedule on a two-lane timeline (compute, communication) to get the exposed
time.

All times are estimates in microseconds. They are meant for comparing schedules (FarSkip vs
regular), not for predicting wall-clock step time.
"""


from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass
from typing import Any

from farskip_jax.inspect.bound import DependencyBound, dependency_bound
from farskip_jax.xla.costs import HARDWARE, CostModel, trip_count
from farskip_jax.xla.hlo_parse import Computation, HloModule, Instr, parse_hlo
from farskip_jax.xla.links import (
    collective_bytes,
    collective_kind,
    group_size,
    link_bytes,
    same_node_members,
    transfer_time_us,
)

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
    nic_bytes: float = 0.0  # of `bytes`, what leaves the node over this device's NIC (link model)

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
    bound: DependencyBound | None = None  # what any order of the same ops could hide (bound.py)

    def to_dict(self, with_timeline: bool = False) -> dict[str, Any]:
        d = {"module": self.module, "target": self.target, "totals": self.totals,
             "collectives": [c.to_dict() for c in self.collectives], "lhs_stats": self.lhs_stats,
             "dependency_bound": self.bound.to_dict() if self.bound is not None else None}
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

class _Analyzer(CostModel):
    """The cost model plus what the overlap report needs: every collective's window and role, and
    the forward/backward phase of each instruction."""

    def __init__(self, mod: HloModule, hw: dict[str, Any], grouped_fill: float = 1.0,
                 declared_rows: bool = True):
        super().__init__(mod, hw, grouped_fill, declared_rows)
        self._phases: Phases | None = None
        self._users_cache: dict[str, dict[str, list[str]]] = {}

    @property
    def phases(self) -> Phases:
        if self._phases is None:
            self._phases = Phases(self.mod)
        return self._phases

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
                nbytes = collective_bytes(comp, ins, done if form == "start" else None, kind,
                                          self.declared_rows)
                n = group_size(ins, self.mod.num_partitions)
                same_node = same_node_members(ins, self.mod.num_partitions, self.hw["gpus_per_node"])
                between = []
                for j in range(k + 1, done_k):
                    b = comp.instrs[j]
                    t = self.op_time_us(comp, b)
                    if t > 0:
                        between.append(BetweenOp(b.name, b.opcode, t, b.op_name))
                flagged = '"is_sync":true' in ins.attrs
                is_async = form == "start" and not flagged and bool(between)
                transfer = transfer_time_us(kind, nbytes, n, self.hw, same_node)
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
                    inferred=inferred, nic_bytes=link_bytes(kind, nbytes, n, self.hw, same_node)[1]))
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
            "sync_transfer_us": sum(r.transfer_us * r.weight for r in rs if not r.is_async),
            "hidden_us": hidden, "hidden_frac": hidden / transfer if transfer else None,
            "sim_exposed_us": exposed,
            "nic_bytes": sum(r.nic_bytes * r.weight for r in rs),  # per device, link model
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


def analyze(text: str, target: str, lhs_schedule_text: str | None = None, grouped_fill: float = 1.0,
            declared_rows: bool = True) -> Analysis:
    """Parse scheduled HLO text and estimate collective overlap for ``target`` (see HARDWARE);
    ``grouped_fill`` and ``declared_rows`` as in ``costs.CostModel``."""
    if target not in HARDWARE:
        raise ValueError(f"unknown target {target!r}; known: {sorted(HARDWARE)}")
    mod = parse_hlo(text)
    an = _Analyzer(mod, HARDWARE[target], grouped_fill, declared_rows)
    runs = an.scheduled_computations()
    recs = an.collectives(runs)
    sim = _Simulator(an, recs)
    sim.run(mod.entry)
    lhs = parse_lhs_schedule(lhs_schedule_text) if lhs_schedule_text else None
    floor = dependency_bound(an, {(r.computation, r.name): r.transfer_us for r in recs}, runs,
                             an.phases.is_bwd)
    return Analysis(mod.name, target, recs, _totals(recs, sim), sim.events, lhs, floor)


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
