"""Def-use (data dependency) graph of an HLO module, queried by `jax.named_scope` paths.

FarSkip's overlap exists only as the *absence* of data dependencies: layer k's attention must
not read anything produced by layer k-1's Combine (nor by layer k's Dispatch), so that XLA may
run it while those all-to-alls are in flight. This module turns HLO text into a graph and
answers "which ops of scope A are downstream of ops of scope B".

Usage::

    g = build_graph(jax.jit(f).lower(*args).compile().as_text())  # or lowered.as_text("hlo")
    combine = g.select(scope_regex(2, "combine"), opcode="all-to-all")
    core = g.select(scope_regex(3, "attention", "core"))
    assert not g.reachable(combine, core)

Nodes are the instructions of the ENTRY computation. An instruction that calls other
computations (a fusion, a while loop of a `scan`, a call) is one node whose scope names are its
own `op_name` plus those of every instruction inside the called computations, so a fused
attention kernel still answers to `layer_3/attention/core`. Edges run operand -> user, plus
control predecessors. Inside a `scan` the layers share one loop body: select the while node and
reason about the loop as a whole.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from farskip_jax.xla.hlo_parse import Computation, HloModule, parse_hlo


@dataclass
class DepGraph:
    """Instructions of one computation with their scope names and consumers."""

    opcodes: dict[str, str] = field(default_factory=dict)
    scopes: dict[str, set[str]] = field(default_factory=dict)  # node -> op_names (own + fused)
    users: dict[str, list[str]] = field(default_factory=dict)

    def select(self, pattern: str | re.Pattern[str], opcode: str | None = None) -> set[str]:
        """Nodes with an op_name matching `pattern` (re.search), optionally of one opcode."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        return {n for n, names in self.scopes.items()
                if (opcode is None or self.opcodes[n] == opcode) and any(rx.search(s) for s in names)}

    def downstream(self, sources: Iterable[str]) -> set[str]:
        """Every node that (transitively) reads a value produced by one of `sources`."""
        seen: set[str] = set()
        todo = deque(sources)
        while todo:
            for user in self.users.get(todo.popleft(), ()):
                if user not in seen:
                    seen.add(user)
                    todo.append(user)
        return seen

    def reachable(self, sources: Iterable[str], targets: Iterable[str]) -> set[str]:
        """The `targets` that depend on any of `sources` (empty: no dependency)."""
        return self.downstream(sources) & set(targets)


def scope_regex(layer: int | None, *scopes: str) -> str:
    """Regex for an op_name inside `layer_<layer>/.../<scopes[0]>/.../<scopes[-1]>`.

    Scope names may be wrapped by transformations (`jvp(layer_3)`, `transpose(...)`) or have
    other scopes (`shard_map`) in between; `layer_3` never matches `layer_31`. A combined
    collective's op_name lists its parts as `layer_2/(tp_psum_a/psum:tp_psum_b/psum)`: each part
    matches.
    """
    parts = [rf"(?:^|[/(:])layer_{layer}(?=[/):])"] if layer is not None else []
    parts += [rf"(?:^|[/(:]){re.escape(s)}(?=[/):]|$)" for s in scopes]
    return ".*".join(parts)


def _scope_names(mod: HloModule, comp: Computation, cache: dict[str, set[str]]) -> set[str]:
    if comp.name in cache:
        return cache[comp.name]
    cache[comp.name] = set()  # guards against cycles
    names: set[str] = set()
    for ins in comp.instrs:
        if ins.op_name:
            names.add(ins.op_name)
        for callee in ins.called():
            if callee in mod.computations:
                names |= _scope_names(mod, mod.computations[callee], cache)
    cache[comp.name] = names
    return names


def build_graph(hlo_text: str, computation: str | None = None) -> DepGraph:
    """The def-use graph of ENTRY (or of `computation`) of an HLO module's text."""
    mod = parse_hlo(hlo_text)
    comp = mod.computations[computation or mod.entry]
    cache: dict[str, set[str]] = {}
    g = DepGraph()
    for ins in comp.instrs:
        names = {ins.op_name} if ins.op_name else set()
        for callee in ins.called():
            if callee in mod.computations:
                names |= _scope_names(mod, mod.computations[callee], cache)
        g.opcodes[ins.name] = ins.opcode
        g.scopes[ins.name] = names
        g.users.setdefault(ins.name, [])
    for ins in comp.instrs:
        preds = list(ins.operands)
        m = re.search(r"control-predecessors=\{([^}]*)\}", ins.attrs)
        if m:
            preds += re.findall(r"%?([\w.\-]+)", m.group(1))
        for p in preds:
            if p in g.users:
                g.users[p].append(ins.name)
    return g
