"""Overlap tables from `inspect` output directories: one row pair per `--compare-regular` directory,
or the four-row table of a `--compare four` directory.

A `--compare-regular` directory holds `report_farskip.json` and `report_regular.json` of one step
(the FCSD train step under EP, or a TP prefill). Per directory and connectivity it prints the share
of collective transfer time hidden under compute in the inspector's timeline replay, grouped as:

- a2a: the MoE exchanges (all-to-all + ragged-all-to-all), all of them, the student's, the teacher's;
- grad sync: ZeRO-1's gradient reduce-scatters and parameter all-gathers (plus any all-reduce);
- psum: the TP reductions (all-reduce, or reduce-scatter + all-gather) of a prefill;

the estimated step, FarSkip's gain over regular (regular est. / FarSkip est.), and est. MFU (useful
FLOPs from the config's shapes over estimated step x bf16 dense peak: an estimate, not a
measurement). A `--compare four` directory (report_regular_bs1.json, ...) gives one table of the
four variants: regular with one stream (the paper's baseline), regular + batch split, FarSkip,
FarSkip + batch split, with each row's gain against the baseline and against the fastest other row.

`--without-profile`: the same tables from the replay of the program XLA's own estimator scheduled
(`meta.pgle.without_profile_totals`, carried by every report compiled with the synthetic PGLE
profile, i.e. MI300X by default); reports compiled without a profile are shown as they are.

    python bench/overlap_tables.py --label "EP8, 4x4096/GPU" /tmp/final/fcsd_h200 \\
        --label EP32 /tmp/final/fcsd_h200_ep32
    python bench/overlap_tables.py --without-profile bench/results/main_rows_012/fcsd_ep8_mi300x
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from farskip_jax.inspect.report import four_way, four_way_markdown  # noqa: E402

A2A = ("all-to-all", "ragged-all-to-all")
GRAD = ("reduce-scatter", "all-gather", "all-reduce")
FOUR = ("regular_bs1", "farskip_bs1")  # the one-stream rows every four-way directory has


def totals(report: dict[str, Any], without_profile: bool) -> dict[str, Any]:
    """The report's replay totals, or (``without_profile``) those of XLA's own schedule when the report
    was compiled with a profile and carries them."""
    if without_profile:
        base = ((report.get("meta") or {}).get("pgle") or {}).get("without_profile_totals")
        if base is not None:
            return base
    return report["totals"]


def hidden(groups: dict[str, Any], kinds: tuple[str, ...], prefix: str = "") -> tuple[float | None, float]:
    """(hidden share, exposed us) over `kinds` (keys `prefix + kind`), from the timeline replay."""
    rows = [groups[prefix + k] for k in kinds if prefix + k in groups]
    transfer = sum(r["transfer_us"] for r in rows)
    exposed = sum(r["sim_exposed_us"] for r in rows)
    return (1.0 - exposed / transfer if transfer > 0 else None), exposed


def est_mfu(report: dict[str, Any], step_us: float) -> float | None:
    """Useful FLOPs per device over (estimated step x peak); None for reports without accounting."""
    acc = report.get("accounting") or {}
    useful, peak = acc.get("useful_flops_per_device"), acc.get("peak_flops")
    return useful / (step_us * 1e-6 * peak) if useful and peak and step_us else None


def summarize(report: dict[str, Any], prefill: bool, without_profile: bool = False) -> dict[str, Any]:
    t = totals(report, without_profile)
    out = {"est_ms": t["est_step_us"] / 1000, "peak_gib": (report.get("memory") or {}).get(
        "peak_bytes_per_device", 0) / 2**30, "mfu": est_mfu(report, t["est_step_us"])}
    if prefill:
        out["psum"] = hidden(t["by_kind"], GRAD)
        return out
    out["a2a"] = hidden(t["by_kind"], A2A)
    out["a2a_student"] = hidden(t.get("by_model_kind", {}), A2A, "student/")
    out["a2a_teacher"] = hidden(t.get("by_model_kind", {}), A2A, "teacher/")
    out["grad"] = hidden(t["by_kind"], GRAD)
    return out


def pct(x: tuple[float | None, float]) -> str:
    share, exposed = x
    return "-" if share is None else f"{100 * share:.1f}% ({exposed / 1000:.2f} ms)"


def mfu_str(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(runs: list[tuple[str, Path]], without_profile: bool = False) -> str:
    lines = ["| step | connectivity | a2a hidden (exposed) | student a2a | teacher a2a | grad sync hidden "
             "| TP psum hidden | est. ms | FarSkip gain | est. MFU | peak GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, d in runs:
        reps = {m: json.loads((d / f"report_{m}.json").read_text()) for m in ("farskip", "regular")}
        prefill = reps["farskip"]["meta"]["mesh"].get("tensor", 1) > 1
        sums = {m: summarize(r, prefill, without_profile) for m, r in reps.items()}
        gain = sums["regular"]["est_ms"] / sums["farskip"]["est_ms"]
        for m, s in sums.items():
            none = (None, 0.0)
            lines.append(f"| {label} | {m} | {pct(s.get('a2a', none))} | {pct(s.get('a2a_student', none))} | "
                         f"{pct(s.get('a2a_teacher', none))} | {pct(s.get('grad', none))} | "
                         f"{pct(s.get('psum', none))} | {s['est_ms']:.1f} | "
                         f"{f'{gain:.3f}x' if m == 'farskip' else ''} | {mfu_str(s['mfu'])} | "
                         f"{s['peak_gib']:.1f} |")
    return "\n".join(lines)


def four_modes_in(d: Path) -> list[str] | None:
    """The four `--compare four` modes of a directory, in table order, or None if it is not one."""
    if not all((d / f"report_{m}.json").exists() for m in FOUR):
        return None
    split = sorted(p.name[len("report_regular_bs"):-len(".json")] for p in d.glob("report_regular_bs*.json"))
    n = next((s for s in split if s.isdigit() and s != "1"), None)
    if n is None or not (d / f"report_farskip_bs{n}.json").exists():
        return None
    return ["regular_bs1", f"regular_bs{n}", "farskip_bs1", f"farskip_bs{n}"]


def four_table(label: str, d: Path, modes: list[str], without_profile: bool = False) -> str:
    reps = {m: json.loads((d / f"report_{m}.json").read_text()) for m in modes}
    four = four_way(reps, baseline=modes[0], totals_of=lambda r: totals(r, without_profile))
    title = label + (", XLA's own schedule (no profile)" if without_profile else "")
    return four_way_markdown(four, title=title)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path,
                   help="inspect --compare-regular or --compare four output directories")
    p.add_argument("--label", action="append", default=[], help="one per directory, in order")
    p.add_argument("--without-profile", action="store_true",
                   help="replay of the schedule XLA's own estimator made (meta.pgle.without_profile_totals)")
    args = p.parse_intermixed_args(argv)
    labels = args.label + [d.name for d in args.dirs[len(args.label):]]
    pairs = []
    for label, d in zip(labels, args.dirs, strict=True):
        modes = four_modes_in(d)
        if modes is not None:
            print(four_table(label, d, modes, args.without_profile))
        else:
            pairs.append((label, d))
    if pairs:
        print(table(pairs, args.without_profile))


if __name__ == "__main__":
    main()
