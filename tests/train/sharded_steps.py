"""The set-up the sharded trainer-step tests share: a config's program, models and initial state on
its mesh, random packed-free batches, and a few steps of the trainer's own `train_step`."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from farskip_jax.config import Config
from farskip_jax.parallel import make_mesh
from farskip_jax.train import setup
from farskip_jax.train.program import build_program


def build(cfg: Config) -> tuple[Any, Any, Any]:
    """(program, models, initial state) of `cfg` on its mesh, as the trainer builds them."""
    prog = build_program(cfg, make_mesh(cfg.mesh))
    models = setup.build_models(cfg, prog)
    return prog, models, prog.init_state(models.student_params)


def random_batches(vocab: int, rows: int, steps: int, accum: int, tokens: int,
                   seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`steps` host batches of [accum, rows, tokens]: random ids, next-token targets, ~70% of the
    tokens in the loss, one document per row."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = rng.integers(0, vocab, (accum, rows, tokens), dtype=np.int32)
        out.append({"input_ids": ids, "targets": np.roll(ids, -1, axis=-1),
                    "loss_mask": (rng.random((accum, rows, tokens)) < 0.7).astype(np.int32),
                    "segment_ids": np.ones((accum, rows, tokens), np.int32),
                    "positions": np.broadcast_to(np.arange(tokens, dtype=np.int32),
                                                 (accum, rows, tokens)).copy()})
    return out


def run_steps(prog: Any, models: Any, state: Any, batches: list[dict[str, np.ndarray]]
              ) -> tuple[Any, list[float], dict[str, jax.Array]]:
    """(state after the steps, per-step losses, the last step's device batch) at KL scale 1."""
    losses = []
    batch: dict[str, jax.Array] = {}
    for host in batches:
        batch = {k: jax.device_put(v, prog.batch_sharding) for k, v in host.items()}
        state, m = prog.train_step(state, models.teacher_params, batch, np.float32(1.0), np.float32(0.0))
        losses.append(float(m["loss"]))
    return state, losses, batch
