"""Parsing XLA's scheduled HLO text into computations and instructions, in schedule order.

`hlo.py` builds the overlap analysis on top; `deps.py` builds a def-use graph from the same parse.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY_RE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def dtype_bytes(dtype: str) -> float:
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return 1.0 if dtype.startswith("f8") else 0.5
    return float(_DTYPE_BYTES.get(dtype, 0))


def shape_arrays(shape: str) -> list[tuple[str, list[int]]]:
    """All (dtype, dims) arrays in a (possibly tuple) shape string, in order."""
    out = []
    for dt, dims in _ARRAY_RE.findall(shape):
        if dt in _DTYPE_BYTES or dt.startswith("f8") or dt.startswith("f4") or dt.startswith("f6"):
            out.append((dt, [int(d) for d in dims.split(",") if d]))
    return out


def shape_bytes(shape: str) -> float:
    return sum(dtype_bytes(dt) * math.prod(dims) for dt, dims in shape_arrays(shape))


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    is_root: bool = False
    param_index: int | None = None  # N of parameter(N)

    def attr(self, key: str) -> str | None:
        m = re.search(r"\b" + re.escape(key) + r"=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', self.attrs)
        return m.group(1) if m else ""

    def called(self) -> list[str]:
        names = [v for k in ("calls", "to_apply", "body", "condition", "true_computation",
                             "false_computation") if (v := self.attr(k))]
        m = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
        if m:
            names += [s.strip().lstrip("%") for s in m.group(1).split(",") if s.strip()]
        return names


@dataclass
class Computation:
    name: str
    is_entry: bool
    instrs: list[Instr] = field(default_factory=list)
    by_name: dict[str, Instr] = field(default_factory=dict)

    @property
    def root(self) -> Instr | None:
        return next((i for i in self.instrs if i.is_root), self.instrs[-1] if self.instrs else None)


@dataclass
class HloModule:
    name: str
    computations: dict[str, Computation]
    entry: str
    is_scheduled: bool
    num_partitions: int


def _split_balanced(s: str, i: int) -> int:
    """Index just past the bracket group that opens at s[i]."""
    depth, pairs = 0, {"(": ")", "{": "}", "[": "]"}
    closing = set(pairs.values())
    in_str = False
    for j in range(i, len(s)):
        c = s[j]
        if c == '"' and s[j - 1] != "\\":
            in_str = not in_str
        elif in_str:
            continue
        elif c in pairs:
            depth += 1
        elif c in closing:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    if rest.startswith("("):
        end = _split_balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    om = re.match(r"([\w\-]+)\(", rest)
    if not om:
        return None
    opcode = om.group(1)
    end = _split_balanced(rest, om.end() - 1)
    operand_text, attrs = rest[om.end():end - 1], rest[end:]
    operands = re.findall(r"%([\w.\-]+)", operand_text)
    pidx = int(operand_text) if opcode == "parameter" and operand_text.strip().isdigit() else None
    return Instr(name, shape, opcode, operands, attrs, is_root, pidx)


def parse_hlo(text: str) -> HloModule:
    """Parse HLO module text (as printed by ``compiled.as_text()``) into computations."""
    header = next((ln for ln in text.splitlines() if ln.startswith("HloModule")), "")
    mname = header.split()[1].rstrip(",") if header else "module"
    nparts = re.search(r"num_partitions=(\d+)", header)
    comps: dict[str, Computation] = {}
    entry, cur = "", None
    for line in text.splitlines():
        if cur is None:
            m = _COMP_RE.match(line)
            if m:
                cur = Computation(m.group(2), bool(m.group(1)))
                if cur.is_entry:
                    entry = cur.name
            continue
        if line.strip() == "}":
            comps[cur.name] = cur
            cur = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            cur.instrs.append(ins)
            cur.by_name[ins.name] = ins
    if not entry and comps:
        entry = list(comps)[-1]
    return HloModule(mname, comps, entry, "is_scheduled=true" in header,
                     int(nparts.group(1)) if nparts else 1)
