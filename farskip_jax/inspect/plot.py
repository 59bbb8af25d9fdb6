"""A PNG of the estimated timeline around two consecutive middle layers (report_<mode>.timeline.png).

One row pair per compiled model (FarSkip above regular when both are compiled): the compute lane
(ops back to back, red where compute waits for a collective) and the collective lane. One column
per pass (forward; backward too for a train step). The times are the inspector's estimate
(``hlo._Simulator``: schedule order, roofline compute, link-model transfers), so the picture shows
how XLA's schedule interleaves the two layers' collectives with compute, not a measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from farskip_jax.inspect.hlo import Analysis

# compute lane colours by named scope; anything unscoped is grey
_COMPUTE_COLOURS = {"attention": "#4C72B0", "experts": "#DD8452", "shared": "#55A868", "mlp": "#55A868",
                    "router": "#8172B3", "lm_head": "#937860"}
_COMM_COLOURS = {"dispatch": "#17BECF", "combine": "#8C564B", "tp_psum": "#BCBD22"}
_WAIT = "#D62728"
_OTHER = "#B0B0B0"


def _comm_colour(role: str | None) -> str:
    if role and role.startswith("tp_psum"):
        return _COMM_COLOURS["tp_psum"]
    return _COMM_COLOURS.get(role or "", _OTHER)


MIN_WINDOW_OP_US = 0.05  # ops shorter than this do not place the layer window
WINDOW_TRIM = 0.05  # share of the two layers' compute time left out at either end of the window


def layer_window(events: list[dict[str, Any]], direction: str
                 ) -> tuple[float, float, tuple[int, int]] | None:
    """(start, end, (k, k+1)) of two consecutive middle layers in one pass, or None.

    Layers come from the student's ops' named scopes (``layer_N``; the teacher's, under
    ``teacher``, interleave with them in an FCSD step). The window spans the central 90% of the two
    layers' compute time in the pass: XLA hoists a layer's independent ops (weight casts, iotas)
    far ahead of the layer, and those would stretch the window over unrelated layers. The forward
    window closes where the backward starts (``phase_split``).
    """
    split = phase_split(events)
    tagged = [e for e in events if e["args"].get("layer") is not None
              and e["args"].get("direction") == direction and e["dur"] >= MIN_WINDOW_OP_US
              and "teacher" not in e["args"].get("op_name", "")
              and ((e["ts"] < split) if direction == "fwd" else (e["ts"] >= split))]
    layers = sorted({e["args"]["layer"] for e in tagged})
    pairs = [(a, b) for a, b in zip(layers, layers[1:], strict=False) if b == a + 1]
    if not pairs:
        return None
    k, k1 = pairs[len(pairs) // 2]  # of 3 layers (dense first): the two MoE layers
    ops = sorted((e for e in tagged if e["args"]["layer"] in (k, k1)), key=lambda e: e["ts"])
    total = sum(e["dur"] for e in ops)
    start = end = None
    done = 0.0
    for e in ops:
        done += e["dur"]
        if start is None and done >= WINDOW_TRIM * total:
            start = e["ts"]
        if start is not None:
            end = max(end or 0.0, e["ts"] + e["dur"])
        if done >= (1 - WINDOW_TRIM) * total:
            break
    return (start, end, (k, k1)) if start is not None and end > start else None


def phase_split(events: list[dict[str, Any]]) -> float:
    """The time where the backward pass starts: the split that agrees best with the compute ops'
    own directions, weighted by their duration.

    A single op's tag is not enough: XLA's CSE can give a forward op a backward name (a norm
    weight's broadcast shared by both passes), and forward ops that only the backward reads
    (residuals) are scheduled inside it; both are short next to the passes' GEMMs.
    """
    ops = sorted((e for e in events if e["lane"] == "compute" and e["args"].get("direction")),
                 key=lambda e: e["ts"])
    if not ops:
        return float("inf")
    # agreement(split before op i) = fwd time before i + bwd time from i on
    bwd_total = sum(e["dur"] for e in ops if e["args"]["direction"] == "bwd")
    best, best_ts, fwd_before, bwd_before = bwd_total, ops[0]["ts"], 0.0, 0.0
    for i, e in enumerate(ops):
        if e["args"]["direction"] == "fwd":
            fwd_before += e["dur"]
        else:
            bwd_before += e["dur"]
        score = fwd_before + (bwd_total - bwd_before)
        if score > best:
            best = score
            best_ts = ops[i + 1]["ts"] if i + 1 < len(ops) else float("inf")
    return best_ts


def _lane_bars(events: list[dict[str, Any]], lane: str, t0: float, t1: float
               ) -> list[tuple[float, float, str]]:
    bars = []
    for e in events:
        if e["lane"] != lane or e["ts"] + e["dur"] <= t0 or e["ts"] >= t1:
            continue
        a, b = max(e["ts"], t0), min(e["ts"] + e["dur"], t1)
        if lane == "comm":
            colour = _comm_colour(e["args"].get("role"))
        elif e["name"].startswith("wait"):
            colour = _WAIT
        else:
            colour = _COMPUTE_COLOURS.get(e["args"].get("role") or "", _OTHER)
        bars.append((a - t0, b - a, colour))
    return bars


def write_timeline_png(runs: Sequence[tuple[str, Analysis]], path: str | Path, title: str = ""
                       ) -> Path | None:
    """Draw the middle-layer timeline of each (label, analysis) into ``path``; None if no window.

    ``runs`` in drawing order, top first (the CLI passes FarSkip first, then regular).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a CPU build host
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    directions = [d for d in ("fwd", "bwd")
                  if any(layer_window(a.timeline, d) for _, a in runs)]
    if not directions:
        return None
    size = (7.5 * len(directions), 1.9 * len(runs) + 1.2)
    fig, axes = plt.subplots(len(runs), len(directions), figsize=size, squeeze=False, sharex="col")
    for col, d in enumerate(directions):
        span = 0.0
        for row, (label, a) in enumerate(runs):
            ax = axes[row][col]
            win = layer_window(a.timeline, d)
            if win is None:
                ax.set_axis_off()
                continue
            t0, t1, (k, k1) = win
            span = max(span, t1 - t0)
            comm = _lane_bars(a.timeline, "comm", t0, t1)
            compute = _lane_bars(a.timeline, "compute", t0, t1)
            for y, bars in ((1.0, compute), (0.0, comm)):
                if bars:
                    ax.broken_barh([(x, w) for x, w, _ in bars], (y + 0.1, 0.8),
                                   facecolors=[c for _, _, c in bars], edgecolor="none")
            waited = sum(w for x, w, c in compute if c == _WAIT)
            busy = sum(w for _, w, _ in comm)
            ax.set_yticks([0.5, 1.5], ["collectives", "compute"])
            ax.set_ylim(0, 2)
            pass_name = "forward" if d == "fwd" else "backward"
            ax.set_title(f"{label}: {pass_name}, layers {k}-{k1}: {t1 - t0:.0f} us, collectives "
                         f"{busy:.0f} us, compute waits {waited:.0f} us", fontsize=9, loc="left")
            ax.grid(axis="x", alpha=0.3)
        for row in range(len(runs)):
            axes[row][col].set_xlim(0, span * 1.02 if span else 1.0)
        axes[-1][col].set_xlabel("estimated time from the window start (us)")
    legend = [Patch(color=c, label=n) for n, c in _COMPUTE_COLOURS.items() if n != "mlp"]
    legend += [Patch(color=_OTHER, label="other compute / collective"),
               Patch(color=_WAIT, label="compute waits"),
               Patch(color=_COMM_COLOURS["dispatch"], label="dispatch"),
               Patch(color=_COMM_COLOURS["combine"], label="combine"),
               Patch(color=_COMM_COLOURS["tp_psum"], label="TP psum")]
    fig.legend(handles=legend, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.suptitle(title or "estimated timeline (inspector roofline + link model)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
