"""FCSD self-distillation (and SFT / LM) training: losses, optimiser, jitted steps, the loop.

Names are imported lazily so that `farskip_jax.train.losses` (pure functions) loads without the
trainer's heavier dependencies (orbax, grain, tensorboardX).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EarlyStopper": "early_stop", "decay_mask": "optim", "lr_schedule": "optim", "make_optimizer": "optim",
    "LossSpec": "step", "make_eval_step": "step", "make_teacher_topk": "step", "make_train_step": "step",
    "StepShardings": "step", "TrainProgram": "program", "abstract_train_step": "program",
    "build_program": "program", "NonFiniteError": "trainer", "Trainer": "trainer",
    "precompute_teacher": "teacher_precompute", "train": "trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'farskip_jax.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"farskip_jax.train.{_EXPORTS[name]}"), name)
