"""Reports from an ``hlo.Analysis``: report.json, a Markdown table, a Perfetto/Chrome trace, and a
side-by-side comparison of two reports (e.g. FarSkip vs regular connectivity)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from farskip_jax.inspect.hlo import Analysis

_LANES = {"compute": 1, "comm": 2}


MFU_NOTE = ("est. MFU = useful FLOPs / (estimated step x bf16 dense peak), with the inspector's estimated "
            "step time (roofline compute, link-model transfers), not a measured one")


def accounting(totals: dict[str, Any], useful: dict[str, Any] | None, peak_flops: float) -> dict[str, Any]:
    """FLOP accounting of one step per device: the useful FLOPs counted from the config's shapes
    (``flops.step_flops``; None when the caller has no config), the compiled program's static dot
    FLOPs (``totals["dot_flops"]``) and their ratio, the roofline of the useful work at the bf16
    dense peak, and the estimated MFU (useful FLOPs over estimated step time x peak)."""
    dots = totals.get("dot_flops") or {}
    step_us = totals.get("est_step_us") or 0.0
    out: dict[str, Any] = {
        "peak_flops": peak_flops,
        "static_dot_flops_per_device": dots.get("static"),
        "priced_dot_flops_per_device": dots.get("priced"),
        "dot_flops_by_kind": dots.get("by_kind"),
        "est_step_us": step_us,
        "useful_flops_per_device": None, "static_over_useful": None, "useful_roofline_us": None,
        "est_mfu": None, "note": MFU_NOTE,
    }
    if useful:
        u = useful["per_device"]
        out.update(useful_flops_per_device=u, useful=useful, useful_roofline_us=u / peak_flops * 1e6,
                   static_over_useful=dots["static"] / u if dots.get("static") is not None and u else None,
                   est_mfu=u / (step_us * 1e-6 * peak_flops) if step_us > 0 else None)
    return out


# A weight's all-gather or gradient reduction moves at least this much; the expert exchange's
# row-count gathers and the step's metric sums (loss, norms) move bytes to kilobytes.
_WEIGHT_MIN_BYTES = 2**20


def weight_sync(collectives: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A train step's weight traffic (ZeRO-1; `farskip_jax.train.zero1`): the weights' all-gathers
    (forward) and the gradients' reductions (backward reduce-scatters and all-reduces), each of at
    least 1 MiB, whatever role XLA's combiner left them (a weight gather combined with a layer's
    row-count gather carries the Dispatch's name); each group's transfer and exposed time, the
    gather left most exposed (a weight read before there is compute to run under its gather: the
    embedding's, or one XLA issued late) and the last gradient reduction, which by construction has
    only the update after it. None for a program without them (inference)."""

    def group(cs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"count": sum(c["weight"] for c in cs),
                "transfer_us": sum(c["transfer_us"] * c["weight"] for c in cs),
                "exposed_us": sum(c["sim_exposed_us"] * c["weight"] for c in cs)}

    def one(c: dict[str, Any]) -> dict[str, Any]:
        return {"name": c["name"], "transfer_us": c["transfer_us"], "exposed_us": c["sim_exposed_us"]}

    gathers = [c for c in collectives if c["kind"] == "all-gather" and c["direction"] == "fwd"
               and c["bytes"] >= _WEIGHT_MIN_BYTES]
    grads = [c for c in collectives if c["kind"] in ("reduce-scatter", "all-reduce")
             and c["direction"] == "bwd" and c["bytes"] >= _WEIGHT_MIN_BYTES]
    if not gathers and not grads:
        return None
    order = lambda c: c["start_index"]  # noqa: E731
    exposed = lambda c: c["sim_exposed_us"]  # noqa: E731
    return {"gathers": group(gathers),
            "most_exposed_gather": one(max(gathers, key=exposed)) if gathers else None,
            "reductions": group(grads), "last_reduction": one(max(grads, key=order)) if grads else None}


def weight_sync_markdown(ws: dict[str, Any] | None) -> list[str]:
    """The weight-sync sentence of a report (`weight_sync`)."""
    if not ws:
        return []

    def part(g: dict[str, Any], what: str, edge: dict[str, Any] | None, where: str) -> str:
        text = (f"{g['count']} {what}, {g['transfer_us'] / 1e3:.2f} ms of transfer, "
                f"{g['exposed_us'] / 1e3:.2f} ms exposed")
        return text + (f" (of which the {where}, {edge['name']}: {edge['exposed_us'] / 1e3:.2f} ms of "
                       f"{edge['transfer_us'] / 1e3:.2f} ms)" if edge else "")

    gathers = part(ws["gathers"], "weight all-gathers", ws["most_exposed_gather"], "most exposed")
    grads = part(ws["reductions"], "gradient reductions", ws["last_reduction"],
                 "last, with only the update after it")
    return [f"Weight sync (ZeRO-1): {gathers}; {grads}.", ""]


def build_report(analysis: Analysis, meta: dict[str, Any] | None = None,
                 memory: dict[str, Any] | None = None, useful: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """JSON-serialisable report: totals, per-collective records, XLA's LHS statistics, metadata,
    ``memory`` (``aot.memory_section`` of the compiled step; None when not compiled here) and
    ``accounting`` (``accounting``; ``useful``: ``flops.step_flops`` of the step)."""
    from farskip_jax.xla.costs import HARDWARE

    rep = analysis.to_dict()
    rep["meta"] = meta or {}
    rep["memory"] = memory
    rep["accounting"] = accounting(analysis.totals, useful, HARDWARE[analysis.target]["peak_flops"])
    rep["weight_sync"] = weight_sync(rep["collectives"])
    return rep


def _flop(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e12:.2f} TFLOP" if x >= 1e11 else f"{x / 1e9:.2f} GFLOP"


def accounting_markdown(acc: dict[str, Any] | None) -> list[str]:
    """The accounting section's lines (per device)."""
    if not acc:
        return []
    ratio = acc.get("static_over_useful")
    kinds = ", ".join(f"{k} {_flop(v)}" for k, v in (acc.get("dot_flops_by_kind") or {}).items() if v)
    lines = [f"FLOPs per device: useful {_flop(acc.get('useful_flops_per_device'))} (from the config's shapes"
             + (f": {'; '.join(acc['useful']['assumptions'])}" if acc.get("useful") else "") + "); "
             f"static dot FLOPs of the compiled program {_flop(acc.get('static_dot_flops_per_device'))}"
             + (f" ({kinds})" if kinds else "")
             + (f", {ratio:.2f}x the useful" if ratio else "") + "; priced by the cost model "
             f"{_flop(acc.get('priced_dot_flops_per_device'))} (grouped GEMMs at their fill)."]
    if acc.get("useful_roofline_us") is not None:
        mfu = acc.get("est_mfu")
        lines.append(f"Roofline of the useful work at {acc['peak_flops'] / 1e12:.1f} TFLOP/s: "
                     f"{acc['useful_roofline_us'] / 1000:.2f} ms; est. MFU {_pct(mfu)} ({MFU_NOTE}).")
    return lines


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


def _remat_auto_markdown(auto: dict[str, Any] | None) -> list[str]:
    """What `execution.remat: auto` compiled and kept (train/remat.py), when it chose."""
    if not auto:
        return []
    tried = ", ".join(f"{p} {size_str(b)}" for p, b in auto["peaks"].items())
    compared = ", ".join(f"{p} {us / 1e3:.1f} ms" for p, us in (auto.get("est_step_us") or {}).items())
    why = (f"; compared by estimated step (the first a local-teacher candidate, or a schedule XLA left "
           f"largely synchronous or exposed): {compared}" if compared else "")
    return [f"execution.remat=auto: {auto['policy']} (peak per device of each policy compiled: {tried}; "
            f"budget {size_str(auto['budget_bytes'])}{why}).", ""]


def bound_markdown(bound: dict[str, Any] | None, replay_hidden: float | None) -> list[str]:
    """The dependency floor's sentence (`inspect.bound`): what any order of the compiled ops could
    hide, what a list order of them hides, against XLA's order (`replay_hidden`)."""
    if not bound or not bound.get("transfer_us"):
        return []
    ms = lambda key: f"{bound[key] / 1e3:.2f} ms"  # noqa: E731
    line = (f"Dependency floor (any order of these ops at the same costs, one compute and one link lane, "
            f"the backward after the forward, loops as compiled): step >= {ms('step_us')} (longest "
            f"dependency chain {ms('path_us')}, compute {ms('compute_us')}, transfer {ms('transfer_us')}), "
            f"so at most {_pct(bound['max_hidden_frac'])} of the collective time can be hidden")
    if bound.get("list_step_us") is not None:
        line += (f"; a list order of the same ops (longest chain first, memory not modelled) runs "
                 f"{bound['list_step_us'] / 1e3:.2f} ms and hides {_pct(bound['list_hidden_frac'])}")
    return [line + f"; XLA's order hides {_pct(replay_hidden)}.", ""]


def markdown(report: dict[str, Any], max_rows: int = 200) -> str:
    """Markdown summary: totals per kind and direction, then one row per collective."""
    t = report["totals"]
    lines = [f"## {report['module']} on {report['target']} (estimated)", "",
             f"Estimated step {t['est_step_us']:.1f} us, compute {t['est_compute_us']:.1f} us.", "",
             *bound_markdown(report.get("dependency_bound"), t["all"]["sim_hidden_frac"]),
             *[x for line in accounting_markdown(report.get("accounting")) for x in (line, "")],
             *memory_markdown(report.get("memory")), "",
             *_remat_auto_markdown(report.get("meta", {}).get("remat_auto")),
             *weight_sync_markdown(report.get("weight_sync")),
             "Direction: backward = reads a value computed from the loss's cotangent (data flow over the "
             "scheduled HLO), so XLA's nameless gradient all-reduces count as backward; "
             "'bwd*' = a forward collective recomputed by jax.checkpoint inside the backward.", "",
             "| group | count | sync | transfer us | NIC MiB | hidden (between) | hidden (timeline) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    by_model = t.get("by_model", {})
    teacher = "teacher" in by_model
    groups = [("all", t["all"])] + list(t["by_kind"].items()) + list(t["by_direction"].items()) \
        + list(t["by_kind_direction"].items())
    if teacher:  # FCSD: the student's overlap is the one FarSkip changes; the teacher is regular
        groups += list(by_model.items()) + list(t.get("by_model_kind", {}).items())
    for name, g in groups:
        if g["count"]:
            lines.append(f"| {name} | {g['count']} | {g['sync']} | {g['transfer_us']:.1f} | "
                         f"{g.get('nic_bytes', 0.0) / 2**20:.0f} | "
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
                                      "sim_exposed_us", "nic_bytes")}

    keys = ["all"] + sorted(set(ta["by_kind"]) | set(tb["by_kind"])) + ["fwd", "bwd"]

    def group(t: dict[str, Any], k: str) -> dict[str, Any] | None:
        return t["all"] if k == "all" else t["by_kind"].get(k) or t["by_direction"].get(k)

    rows = {k: {label_a: pick(group(ta, k)), label_b: pick(group(tb, k))} for k in keys}
    for m in ("student", "teacher"):
        if m in ta.get("by_model", {}) and "teacher" in ta["by_model"]:
            rows[m] = {label_a: pick(ta["by_model"].get(m)), label_b: pick(tb.get("by_model", {}).get(m))}
    peak = lambda r: (r.get("memory") or {}).get("peak_bytes_per_device")
    acc = lambda r: {k: (r.get("accounting") or {}).get(k) for k in ACCOUNTING_KEYS}
    return {"labels": [label_a, label_b], "targets": [a["target"], b["target"]],
            "est_step_us": {label_a: ta["est_step_us"], label_b: tb["est_step_us"]},
            "speedup_est": tb["est_step_us"] / ta["est_step_us"] if ta["est_step_us"] else None,
            "peak_bytes_per_device": {label_a: peak(a), label_b: peak(b)},
            "accounting": {label_a: acc(a), label_b: acc(b)},
            "groups": rows}


ACCOUNTING_KEYS = ("useful_flops_per_device", "static_dot_flops_per_device", "static_over_useful",
                   "useful_roofline_us", "est_mfu")


def _accounting_lines(accs: dict[str, dict[str, Any]]) -> list[str]:
    """One line per label of a comparison's FLOP accounting."""
    lines = []
    for label, a in accs.items():
        if not a or a.get("static_dot_flops_per_device") is None:
            continue
        ratio = a.get("static_over_useful")
        roof = a.get("useful_roofline_us")
        lines.append(f"- {label}: useful {_flop(a.get('useful_flops_per_device'))}/device, static dots "
                     f"{_flop(a['static_dot_flops_per_device'])}" + (f" ({ratio:.2f}x)" if ratio else "")
                     + (f", useful roofline {roof / 1000:.2f} ms" if roof is not None else "")
                     + f", est. MFU {_pct(a.get('est_mfu'))}")
    return [f"FLOPs per device ({MFU_NOTE}):", *lines, ""] if lines else []


def compare_markdown(cmp: dict[str, Any]) -> str:
    la, lb = cmp["labels"]
    lines = [f"## {la} vs {lb} ({cmp['targets'][0]}, estimated)", "",
             f"Estimated step: {la} {cmp['est_step_us'][la]:.1f} us, {lb} {cmp['est_step_us'][lb]:.1f} us"
             + (f" (x{cmp['speedup_est']:.3f})" if cmp["speedup_est"] else ""), "",
             f"Peak memory per device: {la} {size_str(cmp['peak_bytes_per_device'][la])}, "
             f"{lb} {size_str(cmp['peak_bytes_per_device'][lb])}", "",
             *_accounting_lines(cmp.get("accounting") or {}),
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
                  meta: dict[str, Any] | None = None, memory: dict[str, Any] | None = None,
                  useful: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write <name>.json, <name>.md and <name>.trace.json into out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rep = build_report(analysis, meta, memory, useful)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md", "trace": out / f"{name}.trace.json"}
    paths["json"].write_text(json.dumps(rep, indent=1))
    paths["md"].write_text(markdown(rep))
    paths["trace"].write_text(json.dumps(to_chrome_trace(analysis, name)))
    return paths


# ------------------------------------------------------------------ four-row comparison ------

A2A_KINDS = ("all-to-all", "ragged-all-to-all")
GRAD_KINDS = ("reduce-scatter", "all-gather", "all-reduce")
FOUR_LABELS = {"regular_bs1": "regular, one stream (paper's baseline)", "farskip_bs1": "FarSkip"}


def four_label(mode: str) -> str:
    """Row label of a ``--compare four`` mode ('regular_bs2' -> 'regular + batch split 2')."""
    if mode in FOUR_LABELS:
        return FOUR_LABELS[mode]
    conn, _, split = mode.partition("_bs")
    return f"{'FarSkip' if conn == 'farskip' else 'regular'} + batch split {split}" if split else mode


def hidden_share(by_kind: dict[str, Any], kinds: tuple[str, ...]) -> dict[str, float | None]:
    """Share of the transfer time of ``kinds`` with compute under it in the timeline replay."""
    rows = [by_kind[k] for k in kinds if k in by_kind]
    transfer = sum(r["transfer_us"] for r in rows)
    exposed = sum(r["sim_exposed_us"] for r in rows)
    return {"hidden": 1.0 - exposed / transfer if transfer > 0 else None, "exposed_us": exposed,
            "transfer_us": transfer}


def four_way(reports: dict[str, dict[str, Any]], baseline: str = "regular_bs1",
             totals_of: Any = None) -> dict[str, Any]:
    """One row per mode (in ``reports``' order): estimated step, all-to-all and gradient-sync overlap,
    est. MFU, peak memory, and the gain against ``baseline`` (the paper's: regular connectivity, one
    stream) and against the strongest other row (> 1: this row is the fastest by that factor; < 1:
    the best other row is faster). ``totals_of(report)`` picks the totals (default
    ``report["totals"]``; ``bench/overlap_tables.py --without-profile`` passes the replay of the
    program XLA's own estimator scheduled)."""
    pick = totals_of or (lambda r: r["totals"])
    rows: dict[str, dict[str, Any]] = {}
    for mode, rep in reports.items():
        t = pick(rep)
        acc = rep.get("accounting") or {}
        useful, peak = acc.get("useful_flops_per_device"), acc.get("peak_flops")
        step = t["est_step_us"]
        rows[mode] = {"label": four_label(mode), "est_step_us": step,
                      "a2a": hidden_share(t["by_kind"], A2A_KINDS),
                      "grad_sync": hidden_share(t["by_kind"], GRAD_KINDS),
                      "est_mfu": useful / (step * 1e-6 * peak) if useful and peak and step else None,
                      "peak_bytes_per_device": (rep.get("memory") or {}).get("peak_bytes_per_device")}
    base = rows.get(baseline, {}).get("est_step_us")
    for mode, row in rows.items():
        step = row["est_step_us"]
        others = [r["est_step_us"] for m, r in rows.items() if m != mode and r["est_step_us"]]
        row["gain_vs_baseline"] = base / step if base and step else None
        row["gain_vs_best_other"] = min(others) / step if others and step else None
    target = next(iter(reports.values()))["target"] if reports else ""
    return {"target": target, "baseline": baseline, "rows": rows, "note": MFU_NOTE}


def four_way_markdown(four: dict[str, Any], title: str = "") -> str:
    def share(x: dict[str, Any]) -> str:
        return "-" if x["hidden"] is None else f"{_pct(x['hidden'])} ({x['exposed_us'] / 1000:.2f} ms)"

    def gain(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}x"

    lines = [f"## {title or 'Four variants'} ({four['target']}, estimated)", "",
             f"Gain = the other row's estimated step / this row's: against the paper's baseline "
             f"({four_label(four['baseline'])}) and against the fastest other row (> 1: this row is the "
             f"fastest). {MFU_NOTE}.", "",
             "| variant | mode | est. ms | gain vs baseline | gain vs best other | a2a hidden (exposed) "
             "| grad sync hidden (exposed) | est. MFU | peak GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, row in four["rows"].items():
        peak = row["peak_bytes_per_device"]
        lines.append(f"| {row['label']} | {mode} | {row['est_step_us'] / 1000:.2f} | "
                     f"{gain(row['gain_vs_baseline'])} | {gain(row['gain_vs_best_other'])} | "
                     f"{share(row['a2a'])} | {share(row['grad_sync'])} | "
                     f"{_pct(row['est_mfu'])} | {'-' if peak is None else f'{peak / 2**30:.1f}'} |")
    return "\n".join(lines) + "\n"
