"""Counting collectives in compiled (optimised) HLO text, for the layout tests."""

from __future__ import annotations

import re

_OP = re.compile(r"^\s*(?:ROOT\s+)?(%\S+)\s*=\s*(.+?)\s+([a-z][a-z0-9-]*)\((.*)$")


def instructions(hlo: str) -> list[tuple[str, str, str, str]]:
    """(name, result shape text, opcode, rest of line) of every instruction."""
    out = []
    for line in hlo.splitlines():
        m = _OP.match(line)
        if m:
            out.append((m.group(1), m.group(2), m.group(3), m.group(4)))
    return out


def count_ops(hlo: str, opcode: str) -> int:
    """Instructions of `opcode` (its async `-start` form counted once)."""
    return sum(op in (opcode, f"{opcode}-start") for _, _, op, _ in instructions(hlo))


def dims(shape_text: str) -> list[int]:
    """Every dimension of every array in a (possibly tuple) result shape, layouts ignored."""
    return [int(d) for arr in re.findall(r"\[([\d,]*)\]", shape_text) for d in arr.split(",") if d]


def gathers_touching(hlo: str, sizes: set[int]) -> list[str]:
    """all-gather instructions whose result shape has a dimension in `sizes` (e.g. hidden, vocab)."""
    return [f"{name} = {shape}" for name, shape, op, _ in instructions(hlo)
            if op in ("all-gather", "all-gather-start") and sizes & set(dims(shape))]


def computations(hlo: str) -> dict[str, str]:
    """Computation name -> its body text."""
    out: dict[str, str] = {}
    name, body = None, []
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?(%\S+)\s.*\{\s*$", line)
        if m and name is None:
            name, body = m.group(1), []
        elif line.strip() == "}" and name is not None:
            out[name] = "\n".join(body)
            name = None
        elif name is not None:
            body.append(line)
    return out


def sliced_all_reduces(hlo: str) -> int:
    """Non-scalar all-reduce results (tuple elements counted one by one) whose users take this
    device's slice: a dynamic-slice, a fusion computing one, or a fusion reading partition-id. That
    is how XLA writes a reduce-scatter on backends without a native one (XLA:CPU); the GPU
    compiler turns the pattern into reduce-scatter."""
    ins = instructions(hlo)
    bodies = computations(hlo)
    sources: dict[str, bool] = {}  # value name -> non-scalar
    for name, shape, op, rest in ins:
        src = rest.split(")")[0]
        if op in ("all-reduce", "all-reduce-start"):
            sources[name] = bool(dims(shape)) and not shape.startswith("(")
        elif op in ("get-tuple-element", "all-reduce-done") and src in sources:
            sources[name] = bool(dims(shape))
    sliced = set()
    for _, _, op, rest in ins:
        operands = set(re.findall(r"%[\w.\-]+", rest.split("), ")[0] + ")"))
        hit = {v for v in operands if sources.get(v)}
        if not hit:
            continue
        called = re.search(r"calls=(%[\w.\-]+)", rest)
        body = bodies.get(called.group(1), "") if called else ""
        if op == "dynamic-slice" or " dynamic-slice(" in body or any("partition-id" in v for v in operands):
            sliced |= hit
    return len(sliced)
