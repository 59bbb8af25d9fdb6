"""Reports from an ``hlo.Analysis``: report.json, a Markdown table, a Perfetto/Chrome trace, and a
side-by-side comparison of two reports (e.g. FarSkip vs regular connectivity)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from farskip_jax.inspect.hlo import Analysis

_LANES = {"compute": 1, "comm": 2}


def build_report(analysis: Analysis, meta: dict[str, Any] | None = None,
                 memory: dict[str, Any] | None = None) -> dict[str, Any]:
    """JSON-serialisable report: totals, per-collective records, XLA's LHS statistics, metadata,
    and ``memory`` (``aot.memory_section`` of the compiled step; None when not compiled here)."""
    rep = analysis.to_dict()
    rep["meta"] = meta or {}
    rep["memory"] = memory
    return rep


def to_chrome_trace(analysis: Analysis, label: str = "") -> dict[str, Any]:
    """Chrome trace JSON (opens in ui.perfetto.dev): one process, a compute and a comm lane.

    The timeline is estimated: schedule order plus roofline/interconnect times (hlo._Simulator).
    """
    pid = 1
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
         "args": {"name": f"{label or analysis.module} ({analysis.target}, estimated)"}},
    ]
    for lane, tid in _LANES.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                       "args": {"sort_index": tid}})
    for ev in analysis.timeline:
        events.append({"ph": "X", "name": ev["name"], "pid": pid, "tid": _LANES[ev["lane"]],
                       "ts": round(ev["ts"], 4), "dur": round(ev["dur"], 4),
                       "cat": ev["lane"], "args": {k: v for k, v in ev["args"].items() if v is not None}})
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def size_str(n: float | None) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (GiB, MiB, KiB, B)."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def memory_markdown(mem: dict[str, Any] | None) -> list[str]:
    """The memory section's lines (per device, from XLA's buffer assignment)."""
    if not mem:
        return ["Memory: not available (the backend gave no memory analysis)."]
    return [f"Memory per device (XLA buffer assignment): peak {size_str(mem['peak_bytes_per_device'])} "
            f"of {size_str(mem['device_memory_size'])} HBM ({_pct(mem['fraction'])}); arguments "
            f"{size_str(mem['argument_bytes'])}, outputs {size_str(mem['output_bytes'])} (aliased to donated "
            f"arguments {size_str(mem['alias_bytes'])}), temporaries {size_str(mem['temp_bytes'])}, code "
            f"{size_str(mem['generated_code_bytes'])}; peak = arguments + outputs - aliased + temporaries "
            f"(XLA's simulated live peak: {size_str(mem.get('xla_live_peak_bytes') or 0)})."]


def markdown(report: dict[str, Any], max_rows: int = 200) -> str:
    """Markdown summary: totals per kind and direction, then one row per collective."""
    t = report["totals"]
    lines = [f"## {report['module']} on {report['target']} (estimated)", "",
             f"Estimated step {t['est_step_us']:.1f} us, compute {t['est_compute_us']:.1f} us.", "",
             *memory_markdown(report.get("memory")), "",
             "Direction: backward = reads a value computed from the loss's cotangent (data flow over the "
             "scheduled HLO), so XLA's nameless gradient all-reduces count as backward; "
             "'bwd*' = a forward collective recomputed by jax.checkpoint inside the backward.", "",
             "| group | count | sync | transfer us | hidden (between) | hidden (timeline) |",
             "|---|---:|---:|---:|---:|---:|"]
    by_model = t.get("by_model", {})
    teacher = "teacher" in by_model
    groups = [("all", t["all"])] + list(t["by_kind"].items()) + list(t["by_direction"].items()) \
        + list(t["by_kind_direction"].items())
    if teacher:  # FCSD: the student's overlap is the one FarSkip changes; the teacher is regular
        groups += list(by_model.items()) + list(t.get("by_model_kind", {}).items())
    for name, g in groups:
        if g["count"]:
            lines.append(f"| {name} | {g['count']} | {g['sync']} | {g['transfer_us']:.1f} | "
                         f"{_pct(g['hidden_frac'])} | {_pct(g['sim_hidden_frac'])} |")
    lines += ["", "| collective | computation | x | kind | dir | layer/role | MiB | async | transfer us "
              "| compute between us | hidden | ops between |",
              "|---|---|---:|---|---|---|---:|---|---:|---:|---:|---:|"]
    for c in report["collectives"][:max_rows]:
        lr = f"{c['layer'] if c['layer'] is not None else '-'}/{c['role'] or '-'}"
        if c.get("model") == "teacher":
            lr = "teacher " + lr
        d = c["direction"] + ("*" if c.get("recompute") else "")
        lines.append(f"| {c['name']} | {c['computation']} | {c['weight']} | {c['kind']} | {d} "
                     f"| {lr} | {c['bytes'] / 2**20:.2f} | {'yes' if c['is_async'] else 'no'} | "
                     f"{c['transfer_us']:.1f} | {c['compute_between_us']:.1f} | {_pct(c['hidden_frac'])} | "
                     f"{len(c['ops_between'])} |")
    if len(report["collectives"]) > max_rows:
        lines.append(f"| ... {len(report['collectives']) - max_rows} more | | | | | | | | | | | |")
    lhs = report.get("lhs_stats")
    if lhs and lhs.get("total"):
        lines += ["", "XLA latency-hiding-scheduler statistics (XLA's own cost model; may treat "
                  "all-to-all as free): " + ", ".join(f"{k}={v:g}" for k, v in lhs["total"].items())]
    return "\n".join(lines) + "\n"


def compare(a: dict[str, Any], b: dict[str, Any], label_a: str = "farskip",
            label_b: str = "regular") -> dict[str, Any]:
    """Side-by-side numbers of two reports (same target expected)."""
    ta, tb = a["totals"], b["totals"]

    def pick(g: dict[str, Any] | None) -> dict[str, Any]:
        g = g or {}
        return {k: g.get(k) for k in ("count", "sync", "transfer_us", "hidden_frac", "sim_hidden_frac",
                                      "sim_exposed_us")}

    keys = ["all"] + sorted(set(ta["by_kind"]) | set(tb["by_kind"])) + ["fwd", "bwd"]

    def group(t: dict[str, Any], k: str) -> dict[str, Any] | None:
        return t["all"] if k == "all" else t["by_kind"].get(k) or t["by_direction"].get(k)

    rows = {k: {label_a: pick(group(ta, k)), label_b: pick(group(tb, k))} for k in keys}
    for m in ("student", "teacher"):
        if m in ta.get("by_model", {}) and "teacher" in ta["by_model"]:
            rows[m] = {label_a: pick(ta["by_model"].get(m)), label_b: pick(tb.get("by_model", {}).get(m))}
    peak = lambda r: (r.get("memory") or {}).get("peak_bytes_per_device")
    return {"labels": [label_a, label_b], "targets": [a["target"], b["target"]],
            "est_step_us": {label_a: ta["est_step_us"], label_b: tb["est_step_us"]},
            "speedup_est": tb["est_step_us"] / ta["est_step_us"] if ta["est_step_us"] else None,
            "peak_bytes_per_device": {label_a: peak(a), label_b: peak(b)},
            "groups": rows}


def compare_markdown(cmp: dict[str, Any]) -> str:
    la, lb = cmp["labels"]
    lines = [f"## {la} vs {lb} ({cmp['targets'][0]}, estimated)", "",
             f"Estimated step: {la} {cmp['est_step_us'][la]:.1f} us, {lb} {cmp['est_step_us'][lb]:.1f} us"
             + (f" (x{cmp['speedup_est']:.3f})" if cmp["speedup_est"] else ""), "",
             f"Peak memory per device: {la} {size_str(cmp['peak_bytes_per_device'][la])}, "
             f"{lb} {size_str(cmp['peak_bytes_per_device'][lb])}", "",
             f"| group | {la} count/sync | {la} hidden | {la} exposed us | {lb} count/sync | {lb} hidden "
             f"| {lb} exposed us |", "|---|---:|---:|---:|---:|---:|---:|"]
    for k, row in cmp["groups"].items():
        a, b = row[la], row[lb]
        if not (a["count"] or b["count"]):
            continue
        lines.append(f"| {k} | {a['count'] or 0}/{a['sync'] or 0} | {_pct(a['sim_hidden_frac'])} | "
                     f"{a['sim_exposed_us'] or 0:.1f} | {b['count'] or 0}/{b['sync'] or 0} | "
                     f"{_pct(b['sim_hidden_frac'])} | {b['sim_exposed_us'] or 0:.1f} |")
    return "\n".join(lines) + "\n"


def write_reports(analysis: Analysis, out_dir: str | Path, name: str = "report",
                  meta: dict[str, Any] | None = None, memory: dict[str, Any] | None = None
                  ) -> dict[str, Path]:
    """Write <name>.json, <name>.md and <name>.trace.json into out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rep = build_report(analysis, meta, memory)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md", "trace": out / f"{name}.trace.json"}
    paths["json"].write_text(json.dumps(rep, indent=1))
    paths["md"].write_text(markdown(rep))
    paths["trace"].write_text(json.dumps(to_chrome_trace(analysis, name)))
    return paths
