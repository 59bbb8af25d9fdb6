"""train.teacher_lockstep: the frozen teacher's forward runs layer by layer beside the student's
(one optimization barrier per layer); the FCSD step's values must not change, on one device and
under EP=8 (8 host devices), and the barriers must really be in the compiled program."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from farskip_jax.config import load_config
from farskip_jax.parallel import make_mesh
from farskip_jax.train import setup
from farskip_jax.train.program import build_program
from farskip_jax.train.zero1 import batch_devices

T = 16


def _batch(vocab: int, b: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (1, b, T), dtype=np.int32)
    return {"input_ids": ids, "targets": np.roll(ids, -1, axis=-1),
            "loss_mask": (rng.random((1, b, T)) < 0.7).astype(np.int32),
            "segment_ids": np.ones((1, b, T), np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (1, b, T)).copy()}


def _step(lockstep: bool, expert: int) -> tuple[float, list[np.ndarray], str]:
    cfg = load_config("tiny_farskip", {"mesh.expert": expert, "train.teacher_lockstep": lockstep,
                                       "train.warmup_steps": 0, "train.learning_rate": 1e-3})
    mesh = make_mesh(cfg.mesh)
    prog = build_program(cfg, mesh)
    models = setup.build_models(cfg, prog)
    state = prog.init_state(models.student_params)
    batch = {k: jax.device_put(v, prog.batch_sharding)
             for k, v in _batch(cfg.model.vocab_size, 2 * batch_devices(mesh)).items()}
    args = (state, models.teacher_params, batch, np.float32(1.0), np.float32(0.0))
    hlo = prog.train_step.lower(*args).as_text()
    state, m = prog.train_step(*args)
    return float(m["loss"]), [np.asarray(x) for x in jax.tree.leaves(state["params"])], hlo


# The lockstep code is the same on one device; EP=8 is the case that has collectives to overlap.
# Both slow (the EP=8 case is ~40 s on the CI machine, over the default suite's budget with the
# production-path overlap test); tests/inspect/test_cli.py compiles the trainer's FCSD step, lockstep
# included, in the default suite.
@pytest.mark.parametrize("expert", [pytest.param(1, marks=pytest.mark.slow),
                                    pytest.param(8, marks=pytest.mark.slow)])
def test_lockstep_step_equals_sequential(expert):
    if jax.device_count() < expert:
        pytest.skip(f"needs {expert} (host) devices")
    (l0, p0, h0), (l1, p1, h1) = _step(False, expert), _step(True, expert)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(p0, p1, strict=True))
    print(f"LOCKSTEP expert={expert}: loss {l0:.6g} vs {l1:.6g}, max |param diff| after 1 step {diff:.3g}")
    assert l0 > 0 and abs(l0 - l1) <= 1e-6 and diff <= 1e-6
    # one barrier joining the two models per layer boundary (the model has 2+ layers)
    assert h1.count("optimization_barrier") > h0.count("optimization_barrier")
