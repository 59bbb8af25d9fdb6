"""Section (e) of the CPU reproduction's RESULTS.md (`python -m farskip_jax.reproduce
--sparsity-sweep`): sparsity against FarSkip's speed-up, read from the points bench/sparsity_sweep.py
compiled deviceless for H200 and MI300X, with the paragraphs that explain them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The three bench/sparsity_sweep.py runs behind section (e): the grid (fixed active
# parameters, prefill and train), fixed total parameters (prefill), and both at 8 prompts.
SWEEP_RUNS = [[], ["--axes", "total", "--modes", "prefill"],
              ["--axes", "active,total", "--modes", "prefill", "--batch", "8"]]
SWEEP_CMD = "; ".join(" ".join(["python bench/sparsity_sweep.py", *a]) for a in SWEEP_RUNS)


def run_sparsity_sweep(out: Path) -> None:
    """bench/sparsity_sweep.py into out/sparsity_sweep.{json,md,png}; points already compiled under
    its runs/sparsity_sweep are kept (the sweep is resumable), so this reuses the bench's own runs."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    for extra in SWEEP_RUNS:
        subprocess.run([sys.executable, str(root / "bench" / "sparsity_sweep.py"), *extra,
                        "--out", str(out / "sparsity_sweep")], check=True, cwd=root)


def _trend(rows: list[dict[str, Any]]) -> str:
    """'grows', 'falls' or 'flat' (within 1%) from the lowest to the highest sparsity, and monotone or not."""
    rows = sorted(rows, key=lambda w: w["sparsity"])
    ys = [w["speedup"] for w in rows]
    ratio = ys[-1] / ys[0]
    steps = [b - a for a, b in zip(ys, ys[1:], strict=False)]
    shape = "" if all(d > 0 for d in steps) or all(d < 0 for d in steps) else ", not monotone"
    return ("flat" if abs(ratio - 1) < 0.01 else "grows" if ratio > 1 else "falls") + shape


def sparsity_section(out: Path) -> list[str]:
    """Section (e) from out/sparsity_sweep.json (bench/sparsity_sweep.py), or nothing if absent."""
    path = out / "sparsity_sweep.json"
    md = ["## (e) Sparsity vs speed-up from compiled schedules", ""]
    if not path.exists():
        return md + [f"Not run: `{SWEEP_CMD}` (or `make reproduce REPRODUCE_FLAGS=--sparsity-sweep`) "
                     "writes `sparsity_sweep.json`.", ""]
    data = json.loads(path.read_text())
    pts = data["points"]
    table = (out / "sparsity_sweep.md").read_text().strip() if (out / "sparsity_sweep.md").exists() else ""
    groups: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for w in pts:
        groups.setdefault((w["axis"], w["target"], w["mode"], w.get("batch", 1)), []).append(w)
    trends = {k: _trend(v) for k, v in groups.items() if len(v) > 1}
    pre = {k: t for k, t in trends.items() if k[0] == "active" and k[2] == "prefill" and k[3] == 1}
    if pre and all(t.startswith("grows") for t in pre.values()):
        verdict = "agrees"
    elif pre and all(t.startswith(("falls", "flat")) for t in pre.values()):
        verdict = "disagrees"
    else:
        verdict = "not resolved"
    by = {(w["axis"], w["target"], w["mode"], w["sparsity"]): w for w in pts if w.get("batch", 1) == 1}

    def su(axis: str, target: str, mode: str, s: int, key: str = "speedup") -> str:
        w = by.get((axis, target, mode, s))
        return "-" if w is None else f"{w[key]:.3f}x"

    md += [
        "Question (paper, talk summary): its analytical model gives a prefill speed-up that grows with MoE "
        "sparsity, ~1.5x at DeepSeek-V3's ~32x and ~1.65x at 64x (context 2048). The formula and its "
        "inputs are not in our sources (the paper text we have does not state it), so only these two "
        "quoted points are plotted; they are not reproduced here.",
        "",
        "Setup: DeepSeek-V3 widths (hidden 7168, MLA 128 heads, 1 shared expert, expert width 2048), "
        "compiled deviceless for 8x H200 and 8x MI300X by `python -m farskip_jax inspect "
        "--compare-regular`; speed-up = regular's estimated step / FarSkip's (the inspector's timeline "
        "replay of XLA's schedule with roofline costs). Fixed *active* parameters: top-8, experts = 8 x "
        "sparsity (64..512; the issue's grid). Fixed *total* parameters: 256 experts, top-k = 256 / "
        "sparsity (32..4). Prefill: TP=8, 4 MoE layers (no dense layers: sparsity does not touch them), "
        "one 2048-token prompt, bf16 weights. Train: the trainer's `lm` step (forward + backward + AdamW,"
        " fp32 master weights) under EP=8, 2 MoE layers, 4096 tokens per GPU (with four layers at 512 "
        "experts the weights and moments alone exceed an H200: a probe compile peaked at 303 GiB and XLA "
        "left every collective synchronous). Both: balanced expert capacity (`capacity_factor=1.0`, each "
        "expert computes ceil(T k / E) rows, i.e. the active FLOPs), since the dropless padded buffer "
        "computes every worst-case row and would make compute grow with E by construction. MI300X uses "
        "the inspector's synthetic PGLE profile (its default there), H200 XLA's own estimator. 'layers "
        "only' = the step minus compute outside the layers (embedding, the LM head over all 2048 "
        "positions, loss, optimizer), which four layers over-weight against DeepSeek-V3's 58; 'limit' = "
        "regular's step over its compute time, the speed-up if every exposed collective were hidden.",
        "",
        f"Reproduce: `{SWEEP_CMD}` (each resumable; `--report-only` redraws from runs/sparsity_sweep), "
        "or all of it through `make reproduce REPRODUCE_FLAGS=--sparsity-sweep`.",
        "",
        table,
        "",
        "![sparsity sweep](sparsity_sweep.png)",
        "",
        "Trend from 8x to 64x, per curve: " + "; ".join(
            f"fixed {a} params, {t} {m}" + (f" ({b} prompts)" if b != 1 else "") + f": {tr}"
            for (a, t, m, b), tr in sorted(trends.items())) + ".",
        "",
        f"**Verdict: {verdict}** (fixed active parameters, prefill, the issue's grid). From 32x to 64x "
        "the compiled prefill speed-up goes " + ", ".join(
            f"{t.upper()} {su('active', t, 'prefill', 32)} -> {su('active', t, 'prefill', 64)} "
            f"(layers only {su('active', t, 'prefill', 32, 'speedup_layers')} -> "
            f"{su('active', t, 'prefill', 64, 'speedup_layers')})" for t in ("h200", "mi300x"))
        + ", where the paper's analytical model gives ~1.5x -> ~1.65x.",
        "",
        *_sparsity_why(pts),
        "",
    ]
    return md


def groups_by_curve(pts: list[dict[str, Any]]) -> dict[tuple[str, str, str, int], list[dict[str, Any]]]:
    """Sweep points by (axis, target, mode, batch), each list sorted by sparsity."""
    out: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for w in pts:
        out.setdefault((w["axis"], w["target"], w["mode"], w.get("batch", 1)), []).append(w)
    return {k: sorted(v, key=lambda w: w["sparsity"]) for k, v in sorted(out.items())}


def _sparsity_why(pts: list[dict[str, Any]]) -> list[str]:
    """The explanation paragraphs of section (e), every figure read from the sweep's points."""
    by = {(w["axis"], w["target"], w["mode"], w.get("batch", 1), w["sparsity"]): w for w in pts}

    def curve(axis: str, target: str, mode: str, batch: int = 1, key: str = "speedup") -> str | None:
        ws = sorted((w for k, w in by.items() if k[:4] == (axis, target, mode, batch)),
                    key=lambda w: w["sparsity"])
        if len(ws) < 2:
            return None
        return " -> ".join(f"{w[key]:.3f}x" for w in ws) + f" ({ws[0]['sparsity']}x..{ws[-1]['sparsity']}x)"

    def role(axis: str, target: str, mode: str, s: int, name: str, batch: int = 1) -> str:
        w = by.get((axis, target, mode, batch, s))
        v = None if w is None else (w.get("layer1_regular_us") or {}).get(name)
        return "-" if v is None else f"{v:.0f}"

    out = []
    h = [t for t in ("h200", "mi300x") if curve("active", t, "prefill")]
    if h:
        out += ["Why, from the same compiles (regular connectivity, one middle layer, estimated us): at "
                "fixed active parameters the psum volume per layer is fixed (T x hidden) and so are the "
                "active FLOPs, but a 2048-token prompt leaves the routed-expert GEMMs weight-read-bound: "
                "each GPU reads all of its E/8 experts, so their time grows with E. " + "; ".join(
                    f"{t.upper()}: routed experts {role('active', t, 'prefill', 8, 'experts')} -> "
                    f"{role('active', t, 'prefill', 64, 'experts')} us per layer from 8x to 64x, attention "
                    f"{role('active', t, 'prefill', 8, 'attention')} us, the two psums "
                    f"{role('active', t, 'prefill', 8, 'comm')} us" for t in h)
                + ". More compute against the same communication leaves less to win: regular's own limit "
                "(its step with every exposed collective removed, layers only) falls " + "; ".join(
                    f"{t.upper()} {curve('active', t, 'prefill', key='limit_layers')}" for t in h)
                + ". FarSkip's hidden share of psum time is " + "; ".join(
                    f"{t.upper()} " + ", ".join(f"{100 * w['farskip']['hidden']:.1f}%" for w in sorted(
                        (w for k, w in by.items() if k[:4] == ("active", t, "prefill", 1)),
                        key=lambda w: w["sparsity"])) for t in h)
                + " (8x..64x; the last layer's routed psum has nothing after it), so its speed-up follows "
                "that limit.", ""]
    extra = []
    for t in ("h200", "mi300x"):
        c = curve("total", t, "prefill")
        if c:
            extra.append(f"fixed *total* parameters (256 experts, top-k 32 -> 4), {t.upper()} prefill: {c}")
    for axis in ("active", "total"):
        for t in ("h200", "mi300x"):
            for b in sorted({k[3] for k in by if k[3] != 1}):
                c = curve(axis, t, "prefill", b)
                if c:
                    extra.append(f"fixed {axis} parameters, {b} prompts (compute-bound experts), "
                                 f"{t.upper()} prefill: {c}")
    for t in ("h200", "mi300x"):
        c = curve("active", t, "train")
        if c:
            extra.append(f"train step (EP=8, fixed active), {t.upper()}: {c}, layers only "
                         f"{curve('active', t, 'train', key='speedup_layers')}")
    if extra:
        out += ["Other axes (whole-step speed-ups): " + "; ".join(extra) + ".", ""]
    over = [w for w in pts if max(w[c].get("peak_hbm_frac") or 0 for c in ("farskip", "regular")) > 1]
    if over:
        out += ["Over the target's memory (XLA's buffer assignment; the scheduler may then trade overlap "
                "for memory): " + ", ".join(
                    f"{w['target']} {w['mode']} {w['sparsity']}x ({w['axis']}) peak "
                    f"{max(w[c]['peak_gib'] for c in ('farskip', 'regular')):.0f} GiB" for w in over)
                + ".", ""]
    ratios = []
    for t in ("h200", "mi300x"):
        w = by.get(("active", t, "prefill", 1, 32))
        roles = (w or {}).get("layer1_regular_us") or {}
        if roles.get("comm"):
            compute = sum(v for k, v in roles.items() if k != "comm")
            ratios.append(f"{t.upper()} {roles['comm']:.0f} us against {compute:.0f} us "
                          f"({100 * roles['comm'] / compute:.0f}%)")
    if ratios:
        out += ["The level: with every collective hidden the speed-up is at most (C + M) / C, so the "
                "paper's ~1.5x at 32x needs the exposed communication M to be half the compute C. In these "
                "compiles a DeepSeek-V3 prefill layer at 32x has psums of " + ", ".join(ratios)
                + " of compute: the roofline costs leave far less communication to hide than the paper's "
                "model assumes.", ""]
    grows = [(k, w) for k, w in groups_by_curve(pts).items() if k[0] == "total" and len(w) > 1
             and w[-1]["speedup_layers"] > w[0]["speedup_layers"] * 1.01]
    if grows:
        out += ["Where the speed-up does grow with sparsity, active compute per token falls as sparsity "
                "rises (fixed total parameters, top-k shrinking), layers only: " + "; ".join(
                    f"{t.upper()} {a} {m}" + (f" ({b} prompts)" if b != 1 else "") + ": "
                    + " -> ".join(f"{x['speedup_layers']:.3f}x" for x in ws)
                    for (a, t, m, b), ws in grows) + " (8x..64x).", ""]
    reg = {m: [w["regular"]["hidden"] for w in pts if w["mode"] == m and w["regular"]["hidden"] is not None]
           for m in ("prefill", "train")}
    overlap = "; ".join(
        f"in {m} regular connectivity hides {max(0.0, 100 * min(v)):.0f}-{100 * max(v):.0f}% "
        f"of its {'psum' if m == 'prefill' else 'all-to-all'} time" for m, v in reg.items() if v)
    out += ["Why the numbers may differ from the paper's model: these are XLA schedules priced by the "
            "inspector's roofline and timeline replay, not measurements; XLA overlaps part of the regular "
            f"model's collectives ({overlap}), which an analytical model that charges regular all of its "
            "communication does not; the paper's formula, its hardware numbers, "
            "batch and what it holds fixed when sparsity grows are not in our sources; four (prefill) and "
            "two (train) layers over-weight the LM head and optimizer against DeepSeek-V3's 58 MoE layers "
            "(the 'layers only' column removes them); in the train step the blockwise attention's "
            "dynamic-slice/update-slice loop is priced as full-buffer copies and dominates the layer, "
            "which dilutes the all-to-all share; balanced capacity assumes perfect routing balance.", ""]
    return out
