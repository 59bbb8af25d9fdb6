"""How many rows does a rank's routed-expert buffer need? Routing statistics of DeepSeek-V2-Lite-shaped
routers (64 experts, top-6, hidden 2048), to choose `execution.moe_buffer_factor`.

A rank's bounded buffer holds `moe_buffer_factor` x the rows balanced routing gives it (EP: N*K of
its N tokens' assignments arrive from the 8 sources; TP: N*K / ranks); a step whose busiest rank
needs more is re-run with the worst-case program, so the factor trades memory and wasted rows
against re-runs. What decides it is the busiest rank's load / the balanced load, per step.

No trained DeepSeek-V2-Lite router is on this machine, so the routers are synthetic, with a knob
for how unequal the experts are: logits = x W + b, x ~ N(0, I) (a normed hidden state), W ~ N(0,
1/D) (random-init scale; a router trained with a balance loss sees similar per-token spread), and
a per-expert popularity bias b ~ N(0, sigma) that is fixed for the step (the experts a trained
model prefers). The table reports, per sigma, the expert-level imbalance (the busiest expert's
load / mean, MaxVio + 1, the figure load-balancing papers report) and the rank-level ratio at EP8
(8 experts per rank, expert ids in order, as parallel/mesh.py splits them), over many steps of
4 x 4096 tokens per device, and the share of steps that would overflow each candidate factor.

    python bench/routing_stats.py [--steps 200] [--out bench/results/routing_stats.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

E, K, D = 64, 6, 2048
RANKS = 8
TOKENS = 8 * 4 * 4096  # 8 devices x 4 sequences x 4096 tokens: one EP8 step
SIGMAS = (0.0, 0.25, 0.5, 1.0, 1.5)
FACTORS = (1.25, 1.5, 2.0, 3.0)


def step_loads(rng: np.random.Generator, sigma: float, chunk: int = 32768) -> np.ndarray:
    """Assignments per expert in one step [E] (top-6 of the logits; softmax keeps the order).

    x W for x ~ N(0, I) is N(0, W^T W): the logits are drawn from that [E, E] covariance directly
    (exact, and 32x less work than forming the hidden states)."""
    w = rng.normal(0.0, 1.0 / np.sqrt(D), (D, E))
    chol = np.linalg.cholesky(w.T @ w).astype(np.float32)
    b = rng.normal(0.0, sigma, E).astype(np.float32)
    counts = np.zeros(E, np.int64)
    for start in range(0, TOKENS, chunk):
        z = rng.standard_normal((min(chunk, TOKENS - start), E), dtype=np.float32)
        top = np.argpartition(-(z @ chol.T + b), K - 1, axis=1)[:, :K]
        counts += np.bincount(top.ravel(), minlength=E)
    return counts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="router draws (steps) per sigma")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    lines = [f"Synthetic DSV2-Lite-shaped routers, {args.steps} steps of {TOKENS} tokens (EP8, 4 x 4096 per "
             "device) per row; loads relative to balanced (mean).", "",
             "| popularity sigma | busiest expert (median / max) | "
             "busiest rank at EP8 (median / p99 / max) | "
             + " | ".join(f"steps over {f}x" for f in FACTORS) + " |",
             "|---:|---:|---:|" + "---:|" * len(FACTORS)]
    for sigma in SIGMAS:
        expert, rank = [], []
        for _ in range(args.steps):
            loads = step_loads(rng, sigma)
            mean = loads.sum() / E
            expert.append(loads.max() / mean)
            rank.append(loads.reshape(RANKS, E // RANKS).sum(1).max() / (mean * E / RANKS))
        expert_a, rank_a = np.array(expert), np.array(rank)
        over = " | ".join(f"{np.mean(rank_a > f):.1%}" for f in FACTORS)
        lines.append(f"| {sigma:g} | {np.median(expert_a):.2f} / {expert_a.max():.2f} | "
                     f"{np.median(rank_a):.3f} / {np.quantile(rank_a, 0.99):.3f} / "
                     f"{rank_a.max():.3f} | {over} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
