"""The run's metrics as it goes: metrics.jsonl (one JSON object per logged step or evaluation) and
TensorBoard event files, written by process 0; on resume both are cut back to the checkpoint's step so
they read as one run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax


class MetricsLog:
    """metrics.jsonl + TensorBoard event files (process 0 only)."""

    def __init__(self, out: Path, resume_step: int):
        self.enabled = jax.process_index() == 0
        self.path = out / "metrics.jsonl"
        self.tb = None
        if self.enabled:
            out.mkdir(parents=True, exist_ok=True)
            if resume_step == 0 and self.path.exists():
                self.path.unlink()
            elif self.path.exists():
                # Drop lines logged after the checkpoint we resume from, so the file reads as one run.
                lines = [ln for ln in self.path.read_text().splitlines()
                         if ln and json.loads(ln).get("step", 0) <= resume_step]
                self.path.write_text("".join(ln + "\n" for ln in lines))
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"), purge_step=resume_step or None)

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        for k, v in values.items():
            if isinstance(v, int | float) and math.isfinite(v):
                self.tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
