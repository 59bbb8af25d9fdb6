"""Host time per training step: what a serial loop left the device idle, what the trainer leaves.

The trainer makes step i+1's batch (read, tokenize, pack, device_put) in a background thread while
the device runs step i (train/batches.Prefetcher), and dispatches step i+1 before it reads step i's
metrics, so its own work (dispatch, counters, logs, progress bar) runs while the device runs the
next step; only checkpoint and eval steps are read before anything follows them. A serial loop
(next batch, device_put, step, read the metrics) left the device idle for batch + loop per step.
This runs the demo's teacher stage (the real trainer, `configs/tiny_demo.yaml`, CPU) and prints the
per-step means: batch (made in the thread), wait (the loop waiting for it), loop (its own work),
read (blocked on a step's metrics: the device busy), with the step time for scale.

    JAX_PLATFORMS=cpu .venv/bin/python bench/host_gap.py [--steps 200 --batch-size 32]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()

    from farskip_jax.config import load_config, parse_overrides
    from farskip_jax.demo import pipeline, task
    from farskip_jax.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="farskip_host_gap_") as d:
        out = Path(d)
        cfg = load_config("tiny_demo")
        paths = task.prepare(out / "data", cfg.demo, 0)
        cfg = pipeline.teacher_config(cfg, paths, out, 0)
        cfg = pipeline.derive(cfg, parse_overrides([
            f"train.total_steps={args.steps}", f"data.batch_size={args.batch_size}",
            f"train.eval_every={10 * args.steps}", f"train.checkpoint_every={10 * args.steps}"]))
        summary = Trainer(cfg).run()
    step_ms = 1e3 * summary["wall_s"] / summary["steps"]
    print("| steps | tokens/step | wall per step (compile included) | batch (thread) | wait | loop | read |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {summary['steps']} | {args.batch_size * cfg.data['seq_len']} | {step_ms:.2f} ms | "
          + " | ".join(f"{summary[f'host_{k}_ms']:.2f} ms" for k in ("batch", "wait", "loop", "read")) + " |")


if __name__ == "__main__":
    main()
