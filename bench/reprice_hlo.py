"""Re-price saved scheduled HLO with this checkout's cost model, and say where two programs differ.

`inspect` and bench/main_rows.py keep each program's scheduled HLO (`scheduled_<mode>.hlo.txt.gz`),
so a question such as "does this program cost more because the compiler changed or because the
cost model changed?" is answered without compiling again: price both programs with one cost model,
then with the other (check the cost model's commit out in a worktree and put it first on the path).

    python bench/reprice_hlo.py --target mi300x --fill 0.125 A.hlo.txt.gz B.hlo.txt.gz
    git worktree add /tmp/cm b8a67e7^ && PYTHONPATH=/tmp/cm python bench/reprice_hlo.py ...

Per program: the inspector's replay (estimated step, serial compute, share of collective time
hidden); then the serial compute by op category (opcode; custom calls by target; fusions by kind
and the ops inside), side by side, largest differences first. `--fill` is the grouped GEMMs'
priced fraction of their rows, as `inspect --moe-load balanced` chose it for that program (its
report's `meta.grouped_gemm_fill`; 1/8 at EP8 with worst-case buffers).
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import farskip_jax
from farskip_jax.inspect import hlo

PACKAGE = Path(farskip_jax.__file__).parent
if (PACKAGE / "xla" / "costs.py").exists():
    from farskip_jax.xla.costs import HARDWARE, CostModel
    from farskip_jax.xla.hlo_parse import HloModule, Instr, parse_hlo
else:  # a checkout from before b8a67e7's successors moved the cost model to xla/ (49faefc)
    HARDWARE, CostModel, parse_hlo = hlo.HARDWARE, hlo._Analyzer, hlo.parse_hlo
    HloModule = Instr = Any
try:
    from farskip_jax.xla.costs import is_row_kernel
except ImportError:  # a checkout from before the experts' activation kernel (K29)
    def is_row_kernel(ins: Any) -> bool:
        return False

_MARKED = ("dot", "custom-call", "dynamic-slice", "dynamic-update-slice", "scatter", "gather", "reduce",
           "sort")


def category(mod: HloModule, ins: Instr) -> str:  # type: ignore[valid-type]
    """opcode; custom calls by target; fusions by kind and which notable ops they contain."""
    if is_row_kernel(ins):
        return "custom-call swiglu_rows kernels (Triton, rows in use)"
    if ins.opcode == "custom-call":
        m = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
        return f"custom-call {m.group(1) if m else '?'}"
    if ins.opcode != "fusion":
        return ins.opcode
    sub = mod.computations.get(ins.attr("calls") or "")
    inside = {i.opcode for i in sub.instrs} if sub is not None else set()
    marked = "+".join(op for op in _MARKED if op in inside) or "elementwise"
    return f"fusion {ins.attr('kind') or '?'} [{marked}]"


def coarse(cat: str) -> str:
    """A category's group in BENCHMARKS.md K25's table: kernels, dense matmuls, data movement."""
    if "groupedMatmul" in cat or "mosaic_gpu" in cat:
        return "kernels: grouped GEMMs (MI300X hipBLASLt; H200 tokamax Mosaic, attention too)"
    if "swiglu_rows" in cat:
        return "experts' row kernels: activation, transpose (Triton, rows in use)"
    if "triton" in cat:
        return "attention kernel (Triton)"
    if "matmul" in cat or "[dot]" in cat:
        return "dense matmuls"
    for group in ("scatter", "gather", "reduce", "elementwise"):
        if group in cat:
            return {"reduce": "reductions", "elementwise": "elementwise fusions"}.get(group, group + "s")
    return "other"


def compute_by_category(mod: HloModule, cost: Any) -> Counter[str]:  # type: ignore[valid-type]
    """Serial compute (us) by category over every scheduled computation, loops x trips."""
    acc: Counter[str] = Counter()
    for name, weight in cost.scheduled_computations().items():
        comp = mod.computations[name]
        for ins in comp.instrs:
            if ins.opcode not in ("while", "call", "conditional"):
                acc[category(mod, ins)] += cost.op_time_us(comp, ins) * weight
    return acc


def _read(path: Path) -> str:
    return gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hlo", type=Path, nargs="+", help="scheduled HLO text (.gz or plain); two to compare")
    p.add_argument("--target", choices=sorted(HARDWARE), required=True)
    p.add_argument("--fill", type=float, default=1.0, help="grouped GEMM fill (default 1.0: every row)")
    p.add_argument("--top", type=int, default=12, help="categories to list")
    p.add_argument("--coarse", action="store_true", help="group the categories as K25's table does")
    args = p.parse_args(argv)
    if len(args.hlo) > 2:
        p.error("one program, or two to compare")
    print(f"cost model: {PACKAGE}")
    cats = []
    for path in args.hlo:
        text = _read(path)
        tot = hlo.analyze(text, args.target, None, args.fill).totals
        mod = parse_hlo(text)
        cat = compute_by_category(mod, CostModel(mod, HARDWARE[args.target], args.fill))
        if args.coarse:
            grouped: Counter[str] = Counter()
            for name, us in cat.items():
                grouped[coarse(name)] += us
            cat = grouped
        cats.append(cat)
        print(f"{path}: est. step {tot['est_step_us'] / 1e3:.2f} ms, serial compute "
              f"{tot['est_compute_us'] / 1e3:.2f} ms, collective time hidden "
              f"{100 * tot['all']['hidden_frac']:.1f}%")
    a = cats[0]
    b = cats[1] if len(cats) > 1 else Counter()
    keys = sorted(set(a) | set(b), key=lambda k: -abs(b[k] - a[k]) if len(cats) > 1 else -a[k])
    head = "| category | " + " | ".join(f"program {i + 1} ms" for i in range(len(cats))) + " |"
    print("\n" + head + "\n|---|" + "---:|" * len(cats))
    print("| all (serial compute) | " + " | ".join(f"{sum(c.values()) / 1e3:.2f}" for c in cats) + " |")
    for k in keys[:args.top]:
        print(f"| {k} | " + " | ".join(f"{c[k] / 1e3:.2f}" for c in cats) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
