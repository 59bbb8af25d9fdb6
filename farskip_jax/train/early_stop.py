"""Early stopping on a higher-is-better eval metric (FARSKIP.md section 3: patience 20, 2% drop).

Rules, checked after every evaluation:
* a value above the best so far is an improvement: it becomes the best and resets the counter;
* otherwise the counter grows; after `patience` evaluations in a row without improvement: stop
  (a plateau);
* a value more than `drop_threshold` (relative) below the best stops at once: that is the late
  KL instability the paper guards against, and waiting would only train a degrading student.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class EarlyStopper:
    patience: int
    drop_threshold: float
    best: float | None = None
    best_step: int | None = None
    bad_evals: int = 0
    reason: str | None = None

    def update(self, step: int, value: float) -> bool:
        """Records one evaluation; returns True when training should stop (see `reason`)."""
        if self.best is None or value > self.best:
            self.best, self.best_step, self.bad_evals = value, step, 0
            return False
        self.bad_evals += 1
        floor = self.best - abs(self.best) * self.drop_threshold
        if value < floor:
            self.reason = (f"eval metric {value:.6g} at step {step} dropped more than "
                           f"{self.drop_threshold:.1%} below the best {self.best:.6g} "
                           f"(step {self.best_step})")
            return True
        if self.bad_evals >= self.patience:
            self.reason = (f"no improvement over the best {self.best:.6g} (step {self.best_step}) in "
                           f"{self.bad_evals} evaluations (patience {self.patience})")
            return True
        return False

    def is_best(self, step: int) -> bool:
        return self.best_step == step

    def state(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad_evals": self.bad_evals}

    def load(self, state: dict[str, Any]) -> None:
        self.best, self.best_step, self.bad_evals = state["best"], state["best_step"], state["bad_evals"]
