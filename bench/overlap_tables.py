"""One overlap table per target from `inspect --compare-regular` output directories.

Each directory holds `report_farskip.json` and `report_regular.json` of one step (the FCSD train
step under EP, or a TP prefill). Per directory and connectivity it prints the share of collective
transfer time hidden under compute in the inspector's timeline replay, grouped as:

- a2a: the MoE exchanges (all-to-all + ragged-all-to-all), all of them, the student's, the teacher's;
- grad sync: ZeRO-1's gradient reduce-scatters and parameter all-gathers (plus any all-reduce);
- psum: the TP reductions (all-reduce, or reduce-scatter + all-gather) of a prefill;

and the estimated step, with FarSkip's gain over regular (regular est. / FarSkip est.).

    python bench/overlap_tables.py --label "EP8, 4x4096/GPU" /tmp/final/fcsd_h200 \\
        --label EP32 /tmp/final/fcsd_h200_ep32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

A2A = ("all-to-all", "ragged-all-to-all")
GRAD = ("reduce-scatter", "all-gather", "all-reduce")


def hidden(groups: dict[str, Any], kinds: tuple[str, ...], prefix: str = "") -> tuple[float | None, float]:
    """(hidden share, exposed us) over `kinds` (keys `prefix + kind`), from the timeline replay."""
    rows = [groups[prefix + k] for k in kinds if prefix + k in groups]
    transfer = sum(r["transfer_us"] for r in rows)
    exposed = sum(r["sim_exposed_us"] for r in rows)
    return (1.0 - exposed / transfer if transfer > 0 else None), exposed


def summarize(report: dict[str, Any], prefill: bool) -> dict[str, Any]:
    t = report["totals"]
    out = {"est_ms": t["est_step_us"] / 1000, "peak_gib": (report.get("memory") or {}).get(
        "peak_bytes_per_device", 0) / 2**30}
    if prefill:
        out["psum"] = hidden(t["by_kind"], GRAD)
        return out
    out["a2a"] = hidden(t["by_kind"], A2A)
    out["a2a_student"] = hidden(t["by_model_kind"], A2A, "student/")
    out["a2a_teacher"] = hidden(t["by_model_kind"], A2A, "teacher/")
    out["grad"] = hidden(t["by_kind"], GRAD)
    return out


def pct(x: tuple[float | None, float]) -> str:
    share, exposed = x
    return "-" if share is None else f"{100 * share:.1f}% ({exposed / 1000:.2f} ms)"


def table(runs: list[tuple[str, Path]]) -> str:
    lines = ["| step | connectivity | a2a hidden (exposed) | student a2a | teacher a2a | grad sync hidden "
             "| TP psum hidden | est. ms | FarSkip gain | peak GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, d in runs:
        reps = {m: json.loads((d / f"report_{m}.json").read_text()) for m in ("farskip", "regular")}
        prefill = reps["farskip"]["meta"]["mesh"].get("tensor", 1) > 1
        sums = {m: summarize(r, prefill) for m, r in reps.items()}
        gain = sums["regular"]["est_ms"] / sums["farskip"]["est_ms"]
        for m, s in sums.items():
            none = (None, 0.0)
            lines.append(f"| {label} | {m} | {pct(s.get('a2a', none))} | {pct(s.get('a2a_student', none))} | "
                         f"{pct(s.get('a2a_teacher', none))} | {pct(s.get('grad', none))} | "
                         f"{pct(s.get('psum', none))} | {s['est_ms']:.1f} | "
                         f"{f'{gain:.3f}x' if m == 'farskip' else ''} | {s['peak_gib']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path, help="inspect --compare-regular output directories")
    p.add_argument("--label", action="append", default=[], help="one per directory, in order")
    args = p.parse_intermixed_args(argv)
    labels = args.label + [d.name for d in args.dirs[len(args.label):]]
    print(table(list(zip(labels, args.dirs, strict=True))))


if __name__ == "__main__":
    main()
