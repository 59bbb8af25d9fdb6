"""PNG plots for the demo and reproduce.py (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen before pyplot is imported

Metrics = list[dict[str, Any]]


def _series(metrics: Metrics, kind: str, key: str) -> tuple[list[int], list[float]]:
    rows = [m for m in metrics if m.get("kind") == kind and key in m]
    return [m["step"] for m in rows], [m[key] for m in rows]


def training_curves(lm_runs: Mapping[str, Metrics], kl_runs: Mapping[str, Metrics], path: Path) -> Path:
    """Left: cross-entropy of the LM/SFT runs; right: KL(teacher || student) of the distillation runs
    (train = lines, eval = markers)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, runs, key, title in ((axes[0], lm_runs, "loss", "teacher training (cross-entropy)"),
                                 (axes[1], kl_runs, "kl", "FCSD: KL(teacher || FarSkip student)")):
        for label, metrics in runs.items():
            x, y = _series(metrics, "train", key)
            (line,) = ax.plot(x, y, label=f"{label} train")
            ex, ey = _series(metrics, "eval", key)
            if ex:
                ax.plot(ex, ey, "o--", color=line.get_color(), label=f"{label} eval")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accuracy_bars(labels: Sequence[str], values: Sequence[float], title: str, path: Path,
                  errors: Sequence[float] | None = None, ylabel: str = "exact match") -> Path:
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 2, 3.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bars = ax.bar(range(len(values)), values, yerr=errors, capsize=4,
                  color=[colors[i % len(colors)] for i in range(len(values))])
    for b, v in zip(bars, values, strict=True):
        ax.text(b.get_x() + b.get_width() / 2, v + 0.01, f"{v:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(0, max(1.05, max(values) + 0.1))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def lines(xs: Sequence[float], series: Mapping[str, tuple[Sequence[float], Sequence[float] | None]],
          title: str, xlabel: str, ylabel: str, path: Path, log_y: bool = False) -> Path:
    """Mean lines with a shaded +-spread band: series = {label: (means, spreads or None)}."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (mean, spread) in series.items():
        (ln,) = ax.plot(xs[: len(mean)], mean, "o-" if len(mean) < 30 else "-", label=label)
        if spread is not None:
            lo = [m - s for m, s in zip(mean, spread, strict=True)]
            hi = [m + s for m, s in zip(mean, spread, strict=True)]
            ax.fill_between(xs[: len(mean)], lo, hi, color=ln.get_color(), alpha=0.2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
