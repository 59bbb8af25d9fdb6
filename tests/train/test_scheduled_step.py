"""train.pgle: when the trainer compiles its step with a synthetic PGLE profile, and that the
compiled step it then runs is the one the profile compile returned. The profile compile itself
needs a GPU backend (tests/inspect/test_pgle.py covers it deviceless); here it is replaced by a
plain CPU compile of the same lowered step, which has the same values."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from farskip_jax.config import load_config
from farskip_jax.errors import UserError
from farskip_jax.train import scheduled_step
from farskip_jax.train import trainer as trainer_mod
from farskip_jax.xla import pgle

STEPS = {"train.total_steps": 4, "train.warmup_steps": 1, "train.eval_every": 100,
         "train.checkpoint_every": 100}


@pytest.mark.parametrize("choice, host, expected", [
    ("auto", "mi300x", "mi300x"), ("auto", "h200", None), ("auto", "local", None),
    ("synthetic", "h200", "h200"), ("off", "mi300x", None)])
def test_profile_target(choice, host, expected, tiny_data, overrides, tmp_path, monkeypatch):
    monkeypatch.setattr(scheduled_step, "detect_local_target", lambda: host)
    cfg = load_config("tiny_farskip", overrides(tiny_data, tmp_path, **{"train.pgle": choice}))
    assert scheduled_step.profile_target(cfg) == expected


def test_synthetic_needs_a_gpu(tiny_data, overrides, tmp_path, monkeypatch):
    monkeypatch.setattr(scheduled_step, "detect_local_target", lambda: "local")
    cfg = load_config("tiny_farskip", overrides(tiny_data, tmp_path, **{"train.pgle": "synthetic"}))
    with pytest.raises(UserError, match="train.pgle=synthetic needs a GPU"):
        scheduled_step.profile_target(cfg)


def _losses(out) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


# slow (CI time budget: two trainer runs): the default suite keeps the trainer's call into the
# profile compile (test_auto_falls_back_..., below) and the profile compile itself
# (tests/inspect/test_pgle.py).
@pytest.mark.slow
def test_trainer_runs_the_profile_compiled_step(tiny_data, overrides, tmp_path, monkeypatch):
    calls = []

    def fake_compile(step, *abstract, **kw):
        calls.append(kw)
        return SimpleNamespace(artifacts=SimpleNamespace(executable=step.lower(*abstract).compile()),
                               num_costs=0, profile_path="(none)", checker="-")

    monkeypatch.setattr(pgle, "compile_with_synthetic_pgle", fake_compile)
    monkeypatch.setattr(scheduled_step, "detect_local_target", lambda: "mi300x")
    cfg = load_config("tiny_farskip", overrides(tiny_data, tmp_path / "pgle", **STEPS))
    trainer_mod.Trainer(cfg).run()
    assert len(calls) == 1
    assert calls[0]["target"] == "local" and calls[0]["cost_target"] == "mi300x"
    assert calls[0]["keep_executable"] and 0 < calls[0]["grouped_fill"] <= 1
    assert calls[0]["compiler_options"]["xla_gpu_enable_latency_hiding_scheduler"] is True

    monkeypatch.setattr(scheduled_step, "detect_local_target", lambda: "local")
    cfg = load_config("tiny_farskip", overrides(tiny_data, tmp_path / "plain", **STEPS))
    trainer_mod.Trainer(cfg).run()
    assert len(_losses(tmp_path / "plain")) == 4
    assert _losses(tmp_path / "pgle") == _losses(tmp_path / "plain")  # the same program's values


def test_auto_falls_back_to_the_plain_step_when_the_profile_compile_fails(tiny_data, overrides, tmp_path,
                                                                          monkeypatch, caplog):
    def broken(*_args, **_kw):
        raise RuntimeError("XLA wrote no dump after legalize-scheduling-annotations")

    monkeypatch.setattr(pgle, "compile_with_synthetic_pgle", broken)
    monkeypatch.setattr(scheduled_step, "detect_local_target", lambda: "mi300x")
    cfg = load_config("tiny_farskip", overrides(tiny_data, tmp_path / "auto", **STEPS))
    with caplog.at_level("WARNING"):
        summary = trainer_mod.Trainer(cfg).run()
    assert summary["steps"] == 4 and "training with XLA's own schedule" in caplog.text
    asked = load_config("tiny_farskip", overrides(tiny_data, tmp_path, **{"train.pgle": "synthetic"}))
    with pytest.raises(RuntimeError, match="no dump"):  # asked for explicitly: no silent fallback
        batch = {"input_ids": jnp.zeros((1, 8, 16), jnp.int32)}
        scheduled_step.scheduled_train_step(None, (None, None, batch, None), "mi300x", tmp_path, asked, 1)

