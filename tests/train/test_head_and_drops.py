"""Student and teacher compute logits the same way (connectivity off + same weights -> KL exactly 0),
the teacher is always dropless, and both models' dropped fractions reach the step metrics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from farskip_jax.config import load_config
from farskip_jax.parallel import make_mesh
from farskip_jax.train import setup
from farskip_jax.train.program import build_program, teacher_execution

B, T = 4, 16


def _batch(vocab: int, accum: int | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    shape = (B, T) if accum is None else (accum, B, T)
    ids = rng.integers(0, vocab, shape, dtype=np.int32)
    return {"input_ids": ids, "targets": np.roll(ids, -1, axis=-1), "loss_mask": np.ones(shape, np.int32),
            "segment_ids": np.ones(shape, np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), shape).copy()}


def test_kl_is_zero_at_step_0_without_farskip():
    """bf16 compute, bf16 teacher, fp32 master student holding the bf16 checkpoint's values (a bf16
    checkpoint loads exactly so): every op sees the same numbers, including the LM head."""
    cfg = load_config("tiny", {"model.dtype": "bfloat16", "train.teacher_dtype": "bfloat16"})
    assert not cfg.model.farskip.enabled and cfg.model.param_dtype == "float32"
    prog = build_program(cfg, make_mesh(cfg.mesh))
    models = setup.build_models(cfg, prog)
    # Round the fp32 master weights to bf16 values, then derive the teacher as the trainer does.
    student = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), models.student_params)
    # A head 64x the init scale (exact in bf16) gives peaked distributions, where logit rounding shows.
    student = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 64.0 if "lm_head" in jax.tree_util.keystr(path) else x, student)
    teacher = setup.cast_params(student, jnp.bfloat16, prog.teacher_shardings)
    assert jax.tree.leaves(teacher)[0].dtype == jnp.bfloat16
    out = jax.device_get(prog.eval_step()(student, teacher, _batch(cfg.model.vocab_size)))
    kl = float(out["kl_sum"]) / float(out["num_tokens"])
    print(f"KL(teacher || student) at step 0, FarSkip off, bf16: {kl:.3g} (fp32 student head before: ~1e-9)")
    assert abs(kl) < 1e-6
    # Identical computations on identical numbers: not just small, exactly zero.
    assert kl == 0.0
    assert float(out["agree"]) == float(out["num_tokens"])


# slow (CI time budget): a capacity-limited student is not the production configuration (dropless
# student and teacher); drop reporting at the model level stays in tests/parallel/test_drops.py.
@pytest.mark.slow
def test_teacher_is_dropless_and_drops_are_reported():
    cfg = load_config("tiny_farskip", {"execution.capacity_factor": 0.25, "train.warmup_steps": 0})
    assert teacher_execution(cfg).capacity_factor == 0.0
    prog = build_program(cfg, make_mesh(cfg.mesh))
    models = setup.build_models(cfg, prog)
    # The teacher never aliases the student's buffers (the step donates the student's).
    s_ptrs = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(models.student_params)}
    assert not s_ptrs & {x.unsafe_buffer_pointer() for x in jax.tree.leaves(models.teacher_params)}
    state = prog.init_state(models.student_params)
    batch = {k: jnp.asarray(v) for k, v in _batch(cfg.model.vocab_size, accum=2).items()}
    _, m = prog.train_step(state, models.teacher_params, batch, jnp.float32(1.0), jnp.float32(0.0))
    student, teacher = float(m["student_dropped_fraction"]), float(m["teacher_dropped_fraction"])
    print(f"capacity 0.25: student dropped fraction {student:.3f}, teacher {teacher}")
    # 0.25 x the mean load leaves at most a quarter of the assignments in place.
    assert student >= 0.5
    assert teacher == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_init_checkpoint_loads_into_program_layout(tmp_path, monkeypatch, dtype):
    """A trainer checkpoint used as train.init_checkpoint comes back in the student's layout, also
    through a relative path (`make demo` passes runs/tiny_demo/teacher/checkpoints; Orbax reads no
    item metadata through a relative path)."""
    from farskip_jax.checkpoint.manager import CheckpointManager

    cfg = load_config("tiny_farskip", {"train.teacher_dtype": dtype})
    prog = build_program(cfg, make_mesh(cfg.mesh))
    models = setup.build_models(cfg, prog)
    mngr = CheckpointManager(tmp_path / "ckpt", keep=1, async_save=False)
    mngr.save(5, nnx.to_pure_dict(models.student_params), {"count": np.zeros((), np.int32)},
              {"step": 5})
    mngr.close()
    monkeypatch.chdir(tmp_path)
    cfg2 = load_config("tiny_farskip", {"train.teacher_dtype": dtype, "train.init_checkpoint": "ckpt"})
    again = setup.build_models(cfg2, prog)
    for a, b in zip(jax.tree.leaves(models.student_params), jax.tree.leaves(again.student_params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding == a.sharding and b.dtype == jnp.float32
    t = jax.tree.leaves(again.teacher_params)
    assert all(x.dtype == jnp.dtype(dtype) for x in t)
