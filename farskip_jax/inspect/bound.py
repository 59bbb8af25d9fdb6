"""What any order of a compiled program's ops could hide: a floor under its step time.

The replay (`hlo._Simulator`) runs the order XLA chose: compute ops back to back on one lane, the
collectives on one link lane, each async collective with the compute between its start and done
under it. No other order of the same ops, priced by the same cost model, can beat three floors:

* all the compute (one lane);
* all the transfer time (one link lane);
* the longest chain of data dependencies, a collective costing its transfer and a while loop its
  trips times its body's own floor.

So whatever a scheduler or a scheduling hint does with this program, its exposed collective time is
at least `floor - compute`, and the share of collective time it can hide at most
`1 - (floor - compute) / transfer`. Where that share is under a target, the target needs another
program (other dependencies, other loop bodies), not another schedule.

The floor need not be reachable (two lanes with dependencies between them). The list order
(`_ListOrder`) gives the other side: an order the program admits, built greedily (the ready op with
the longest chain after it first, on each lane), so what it hides can be hidden by some order of
these ops. It models no memory: an order that issues exchanges earlier keeps their buffers alive
longer, which XLA's scheduler weighs and this does not. Between the two lies what a better schedule
of the same program could gain; what XLA's order leaves beyond the list order is the scheduler's,
not FarSkip's.

Both keep the backward after the forward: an op the inspector calls backward (`hlo.Phases`: it reads
the loss's cotangent, or JAX named it `transpose(...)`, as it names what `jax.checkpoint` recomputes)
starts only once every forward op of its computation has finished. The program alone would let a
scheduler hoist that recomputation into the forward, which is what remat exists to prevent (its
activations would live through the forward); the final HLO no longer shows JAX's optimization
barriers, so the rule stands in for them. Other barriers of ours (FCSD's teacher and student kept
layer by layer, `transformer.run_streams`) are not seen: an order may run the frozen teacher ahead of
the student, whose only cost is the teacher's hidden states.

Loops are taken as compiled: XLA runs a while loop's iterations one after the other and schedules
each body apart, so nothing overlaps across iterations (a scan over layers is one body per layer).
A conditional is priced by its costliest branch, as the replay prices it. Control dependencies are
left out (they only add order), so the floor stays a floor.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from farskip_jax.xla.costs import CostModel, trip_count
from farskip_jax.xla.hlo_parse import Computation, Instr
from farskip_jax.xla.links import collective_kind


@dataclass(frozen=True)
class Floors:
    """The three floors of one run of a computation, microseconds."""

    compute_us: float
    transfer_us: float
    path_us: float  # the longest dependency chain

    @property
    def step_us(self) -> float:
        return max(self.compute_us, self.transfer_us, self.path_us)


@dataclass(frozen=True)
class LoopFloor:
    """A while loop's body: its floors per trip, and how many trips it runs per step."""

    body: str
    trips: int
    runs: int  # times the loop itself runs per step (1 unless it sits in another loop)
    compute_us: float
    transfer_us: float
    path_us: float
    step_us: float

    @property
    def min_exposed_us(self) -> float:
        return self.step_us - self.compute_us


@dataclass
class DependencyBound:
    """The step's floors (`Floors` of the entry) and what they leave of the collective time."""

    step_us: float
    path_us: float
    compute_us: float
    transfer_us: float
    loops: list[LoopFloor] = field(default_factory=list)
    list_step_us: float | None = None  # the step of `list_order`'s order (an order the program admits)

    @property
    def min_exposed_us(self) -> float:
        return max(0.0, self.step_us - self.compute_us)

    @property
    def max_hidden_frac(self) -> float | None:
        if not self.transfer_us:
            return None
        return max(0.0, 1.0 - self.min_exposed_us / self.transfer_us)

    @property
    def list_hidden_frac(self) -> float | None:
        if not self.transfer_us or self.list_step_us is None:
            return None
        return max(0.0, 1.0 - max(0.0, self.list_step_us - self.compute_us) / self.transfer_us)

    def to_dict(self) -> dict[str, Any]:
        return {"step_us": self.step_us, "path_us": self.path_us, "compute_us": self.compute_us,
                "transfer_us": self.transfer_us, "min_exposed_us": self.min_exposed_us,
                "max_hidden_frac": self.max_hidden_frac, "list_step_us": self.list_step_us,
                "list_hidden_frac": self.list_hidden_frac,
                "loops": [{**asdict(lp), "min_exposed_us": lp.min_exposed_us} for lp in self.loops]}


def _runs_of(costs: CostModel, ins: Instr) -> tuple[int, list[str]]:
    """(trips, computations run per trip) of a while, call or conditional, as the replay runs them: a
    while loop's condition and body, a conditional's costliest branch."""
    called = ins.called()
    if ins.opcode == "conditional":
        called = [max(called, key=costs.comp_time_us)] if called else []
    return (trip_count(ins) if ins.opcode == "while" else 1), called


IsBwd = Callable[[str, str], bool]  # (computation, instruction) -> backward (`hlo.Phases.is_bwd`)


class _Floors:
    def __init__(self, costs: CostModel, transfer_us: dict[tuple[str, str], float], is_bwd: IsBwd):
        self.costs, self.mod, self.is_bwd = costs, costs.mod, is_bwd
        self.transfer_us = transfer_us  # per run of each collective, keyed (computation, start op)
        self.memo: dict[str, Floors] = {}
        self.loops: dict[str, tuple[int, Floors]] = {}  # body -> (trips, floors per trip)

    def of(self, name: str, depth: int = 0) -> Floors:
        if name in self.memo:
            return self.memo[name]
        comp = self.mod.computations.get(name)
        if comp is None or depth > 32:
            return Floors(0.0, 0.0, 0.0)
        bwd = {ins.name for ins in comp.instrs if self.is_bwd(name, ins.name)}
        fwd = _pure_forward(comp.instrs, bwd)
        gate = self._pass(name, comp, depth, fwd, 0.0, set())[2] if bwd and fwd else 0.0
        compute, transfer, path = self._pass(name, comp, depth, comp.instrs, gate, bwd)
        floors = Floors(compute, transfer, path)
        self.memo[name] = floors
        return floors

    def _pass(self, name: str, comp: Computation, depth: int, instrs: list[Instr], gate: float,
              bwd: set[str]) -> tuple[float, float, float]:
        """(compute, transfer, longest chain) over `instrs`, a backward op starting after `gate`."""
        finish: dict[str, float] = {}
        compute = transfer = 0.0
        for ins in instrs:
            ready = max((finish.get(o, 0.0) for o in ins.operands), default=0.0)
            if ins.name in bwd:
                ready = max(ready, gate)
            ck = collective_kind(self.mod, ins)
            if ck is not None:
                # a done adds nothing: its operand, the start, already finishes after the transfer
                t = 0.0 if ck[1] == "done" else self.transfer_us.get((name, ins.name), 0.0)
                transfer += t
                finish[ins.name] = ready + t
                continue
            if ins.opcode in ("while", "call", "conditional"):
                trips, called = _runs_of(self.costs, ins)
                subs = [self.of(c, depth + 1) for c in called]
                if ins.opcode == "while":
                    body = ins.attr("body") or ""
                    self.loops[body] = (trips, self.of(body, depth + 1))
                dur = trips * sum(s.step_us for s in subs)
                compute += trips * sum(s.compute_us for s in subs)
                transfer += trips * sum(s.transfer_us for s in subs)
            else:
                dur = self.costs.op_time_us(comp, ins)
                compute += dur
            finish[ins.name] = ready + dur
        return compute, transfer, max(finish.values(), default=0.0)


_FREE, _COMPUTE, _START, _DONE, _BLOCK = range(5)


class _ListOrder:
    """`list_order` per computation; a loop or call is one block that holds both lanes for its
    trips times its body's list-order step (nothing overlaps it, so the order stays admissible)."""

    def __init__(self, costs: CostModel, transfer_us: dict[tuple[str, str], float], is_bwd: IsBwd):
        self.costs, self.mod, self.transfer_us, self.is_bwd = costs, costs.mod, transfer_us, is_bwd
        self.memo: dict[str, float] = {}

    def step_us(self, name: str, depth: int = 0) -> float:
        if name in self.memo:
            return self.memo[name]
        comp = self.mod.computations.get(name)
        if comp is None or depth > 32:
            return 0.0
        index = {ins.name: i for i, ins in enumerate(comp.instrs)}
        n = len(comp.instrs)
        kind, dur = [_FREE] * n, [0.0] * n
        preds: list[list[int]] = [[] for _ in range(n)]
        for i, ins in enumerate(comp.instrs):
            preds[i] = sorted({index[o] for o in ins.operands if o in index})
            ck = collective_kind(self.mod, ins)
            if ck is not None:  # a synchronous collective is ordered as an async one would be
                kind[i] = _DONE if ck[1] == "done" else _START  # a sync one: its own start and done
                dur[i] = 0.0 if ck[1] == "done" else self.transfer_us.get((name, ins.name), 0.0)
            elif ins.opcode in ("while", "call", "conditional"):
                trips, called = _runs_of(self.costs, ins)
                kind[i], dur[i] = _BLOCK, trips * sum(self.step_us(c, depth + 1) for c in called)
            else:
                d = self.costs.op_time_us(comp, ins)
                kind[i], dur[i] = (_COMPUTE, d) if d > 0 else (_FREE, 0.0)
        bwd_names = {ins.name for ins in comp.instrs if self.is_bwd(name, ins.name)}
        fwd = {ins.name for ins in _pure_forward(comp.instrs, bwd_names)}
        if bwd_names and fwd:  # a free gate op: every forward op before every backward one
            kind.append(_FREE)
            dur.append(0.0)
            preds.append([i for i, ins in enumerate(comp.instrs) if ins.name in fwd])
            for i, ins in enumerate(comp.instrs):
                if ins.name in bwd_names:
                    preds[i].append(n)
            n += 1
        succs: list[list[int]] = [[] for _ in range(n)]
        for i in range(n):
            for p in preds[i]:
                succs[p].append(i)
        chain = [0.0] * n  # longest chain from an op's start to the end, its own time included
        for i in reversed(_topological(preds, succs)):
            chain[i] = dur[i] + max((chain[s] for s in succs[i]), default=0.0)
        self.memo[name] = _greedy(kind, dur, preds, succs, chain)
        return self.memo[name]


def _pure_forward(instrs: list[Instr], bwd: set[str]) -> list[Instr]:
    """The forward ops that read nothing backward, however far back (`hlo.Phases` names some ops
    forward that read a backward value, after XLA's CSE merged the two): the ones the backward
    waits for. Instructions come in a valid order, operands first."""
    names = {ins.name for ins in instrs}
    pure: set[str] = set()
    for ins in instrs:
        if ins.name not in bwd and all(o in pure or o not in names for o in ins.operands):
            pure.add(ins.name)
    return [ins for ins in instrs if ins.name in pure]


def _topological(preds: list[list[int]], succs: list[list[int]]) -> list[int]:
    waiting = [len(p) for p in preds]
    order = [i for i in range(len(preds)) if not waiting[i]]
    for i in order:  # grows while it is read
        for s in succs[i]:
            waiting[s] -= 1
            if not waiting[s]:
                order.append(s)
    return order


def _greedy(kind: list[int], dur: list[float], preds: list[list[int]], succs: list[list[int]],
            chain: list[float]) -> float:
    """Event-driven two-lane list scheduling; returns the time the last op finishes."""
    n = len(kind)
    waiting = [len(p) for p in preds]
    ready_at = [0.0] * n
    xfer_end = [0.0] * n  # a collective: when its transfer ends (its readers start no earlier)
    compute_q: list[tuple[float, int]] = []  # (-chain, op): ready compute ops and blocks
    comm_q: list[tuple[float, int]] = []  # ready collective starts
    events: list[tuple[float, int]] = []  # (time, op): an op finishes
    waking: list[tuple[float, int]] = []  # (time, op): an op whose inputs arrive later (a transfer)
    now = t_compute = t_comm = last = 0.0
    done = 0

    def make_ready(i: int) -> None:
        if kind[i] in (_FREE, _DONE):  # takes no lane: finishes when its inputs are there
            heapq.heappush(events, (ready_at[i], i))
        elif ready_at[i] > now:
            heapq.heappush(waking, (ready_at[i], i))
        else:
            heapq.heappush(comm_q if kind[i] == _START else compute_q, (-chain[i], i))

    for i in range(n):
        if not preds[i]:
            make_ready(i)
    while done < n:
        if compute_q and t_compute <= now:
            _, i = heapq.heappop(compute_q)
            start = max(now, t_comm) if kind[i] == _BLOCK else now  # a block holds both lanes
            t_compute = start + dur[i]
            if kind[i] == _BLOCK:
                t_comm = t_compute
            heapq.heappush(events, (t_compute, i))
            continue
        if comm_q and t_comm <= now:
            _, i = heapq.heappop(comm_q)
            t_comm = xfer_end[i] = now + dur[i]
            last = max(last, t_comm)  # the computation ends after its transfers, read or not
            heapq.heappush(events, (now, i))  # issued now; its readers wait for xfer_end
            continue
        later = [t for t, busy in ((t_compute, compute_q), (t_comm, comm_q)) if busy and t > now]
        later += [q[0][0] for q in (events, waking) if q]
        if not later:
            break  # nothing can run: a malformed computation (a cycle)
        now = max(now, min(later))
        while waking and waking[0][0] <= now:
            make_ready(heapq.heappop(waking)[1])
        while events and events[0][0] <= now:
            t, j = heapq.heappop(events)
            done += 1
            last = max(last, t)
            for s in succs[j]:
                # what reads a collective (its done, or a synchronous one's users) waits for the transfer
                ready_at[s] = max(ready_at[s], xfer_end[j] if kind[j] == _START else t)
                waiting[s] -= 1
                if waiting[s] == 0:
                    make_ready(s)
    return last


def dependency_bound(costs: CostModel, transfer_us: dict[tuple[str, str], float],
                     runs: dict[str, int], is_bwd: IsBwd) -> DependencyBound:
    """The floors of `costs.mod`'s entry computation; `transfer_us` gives each collective's transfer
    per run, keyed by (computation, start or sync op), as the replay prices it; `runs` how many times
    each computation runs per step (for the loops' table); `is_bwd` says which ops are backward
    (they start after the forward, module docstring)."""
    walk = _Floors(costs, transfer_us, is_bwd)
    top = walk.of(costs.mod.entry)
    loops = [LoopFloor(body, trips, runs.get(body, trips) // max(trips, 1), f.compute_us, f.transfer_us,
                       f.path_us, f.step_us)
             for body, (trips, f) in walk.loops.items()]
    loops.sort(key=lambda lp: -lp.trips * lp.runs * lp.step_us)
    listed = _ListOrder(costs, transfer_us, is_bwd).step_us(costs.mod.entry)
    return DependencyBound(top.step_us, top.path_us, top.compute_us, top.transfer_us, loops, listed)
