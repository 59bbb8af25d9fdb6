"""The `train:` section of a config: `TrainConfig` (optimisation, losses, checkpoints, evaluation,
the trainer's guards) and its `gen_eval` subsection. Self-contained, as `farskip_jax.execution` is
for `execution:`; `farskip_jax.config` assembles the sections into `Config` and re-exports both.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from farskip_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class GenEvalConfig:
    """Evaluation by generation (`farskip_jax.train.gen_eval`): greedy completions of the prompts in
    `path`, a JSONL of {"prompt", "answer"} records (scored by exact match, `exact_match`) or of
    {"prompt", "tests"} records (each program run against its tests in a sandboxed subprocess,
    `pass_at_1`). Prompts are wrapped in `data.template`'s user and assistant turn."""

    path: str | None = None
    max_new_tokens: int = 256
    limit: int | None = None  # the first N records only
    batch_size: int = 16  # prompts generated together
    timeout_s: float = 10.0  # wall clock per program
    cpu_s: int = 10  # CPU seconds per program
    memory_mb: int = 1024  # address space per program
    workers: int = 4  # programs run at once

    def validate(self) -> None:
        for name in ("max_new_tokens", "batch_size", "cpu_s", "memory_mb", "workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.gen_eval.{name} must be >= 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"train.gen_eval.limit must be null or >= 1, got {self.limit}")
        if self.timeout_s <= 0:
            raise ConfigError(f"train.gen_eval.timeout_s must be > 0, got {self.timeout_s}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and loss settings for `train.py`."""

    mode: Literal["fcsd", "sft", "lm"] = "fcsd"
    kl_temperature: float = 1.0
    hidden_l2_weight: float = 0.0
    kl_chunk_tokens: int = 1024
    aux_loss: bool = False
    teacher_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    teacher_cache: str | None = None
    teacher_topk: int = 64
    # FCSD: run the frozen teacher's forward layer by layer beside the student's (an optimization
    # barrier joins their next attention inputs after every layer), so that XLA schedules the
    # teacher's layer under the student's all-to-alls. Scheduling only: the values are unchanged.
    # auto: on where the student's expert exchange spans nodes (node-aware), off on one node
    # (neutral there); BENCHMARKS.md K22.
    teacher_lockstep: bool | Literal["auto"] = "auto"
    learning_rate: float = 1e-5
    min_lr_ratio: float = 0.1
    warmup_steps: int = 1000
    total_steps: int = 10000
    weight_decay: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    grad_clip_norm: float = 1.0
    grad_accum_steps: int = 1
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    # The most GB of a checkpoint held in a process's host memory at once while it is saved (Orbax's
    # device-to-host copies, made in the background in batches of this size while training goes on;
    # checkpoint/manager.py). Costs one device-side copy of the state per GPU for the save's duration.
    # null: the whole state is copied to host memory inside save() (no device copy). BENCHMARKS.md K7.
    checkpoint_staging_gb: float | None = 8.0
    eval_every: int = 1000
    eval_batches: int = 4
    patience: int = 20
    drop_threshold: float = 0.02
    # Early-stopping / best-checkpoint metric (higher is better): greedy next-token exact match on the
    # held-out loss-masked tokens, agreement with the teacher's greedy token, the negated eval loss,
    # or, by free-running generation (`gen_eval`), answer exact match or pass@1 of programs.
    eval_metric: Literal["next_token_acc", "teacher_agreement", "neg_loss", "exact_match",
                         "pass_at_1"] = "next_token_acc"
    gen_eval: GenEvalConfig = dataclasses.field(default_factory=GenEvalConfig)
    max_nonfinite_in_row: int = 5
    spike_factor: float = 3.0
    output_dir: str = "runs/default"
    init_checkpoint: str | None = None
    # Schedule the step with a synthetic PGLE profile of its own (train/scheduled_step.py): auto = on
    # MI300X hosts, whose XLA scheduler otherwise prices every collective alike; synthetic = on any
    # GPU; off = XLA's own costs (or JAX's measured automatic PGLE).
    pgle: Literal["auto", "synthetic", "off"] = "auto"
    # ZeRO-1: optimizer state of the replicated (non-expert) weights sharded over (data, expert);
    # gradients reduce-scattered, updated parameters all-gathered.
    zero1: bool = True
    # What those all-gathers move: "compute" = each weight rounded to model.dtype (what the model
    # casts it to before use; bf16: half the bytes), except the router, read in float32; "param" =
    # the master weights as stored (param_dtype), cast after the gather. Either way the model gets
    # the model.dtype copy and its gradient crosses back once, in that dtype (train/zero1.py). Both
    # train bitwise alike (tests/train/test_zero1_gather.py).
    zero1_gather: Literal["compute", "param"] = "compute"

    def validate(self) -> None:
        for name in ("warmup_steps", "kl_chunk_tokens", "grad_accum_steps", "log_every",
                     "checkpoint_every", "keep_checkpoints", "eval_every", "patience",
                     "max_nonfinite_in_row", "teacher_topk"):
            if getattr(self, name) < (0 if name == "warmup_steps" else 1):
                raise ConfigError(f"train.{name} must be positive, got {getattr(self, name)}")
        if self.total_steps < 1:
            raise ConfigError(f"train.total_steps must be >= 1, got {self.total_steps}")
        if self.kl_temperature <= 0:
            raise ConfigError(f"train.kl_temperature must be > 0, got {self.kl_temperature}")
        if not 0 <= self.drop_threshold < 1:
            raise ConfigError(f"train.drop_threshold must be in [0, 1), got {self.drop_threshold}")
        if self.checkpoint_staging_gb is not None and self.checkpoint_staging_gb <= 0:
            raise ConfigError("train.checkpoint_staging_gb must be null (no bound) or > 0, got "
                              f"{self.checkpoint_staging_gb}")
        self.gen_eval.validate()
        if self.eval_metric in ("exact_match", "pass_at_1") and self.gen_eval.path is None:
            raise ConfigError(f"train.eval_metric={self.eval_metric} is measured by generation: set "
                              "train.gen_eval.path to a JSONL of prompts with answers (exact_match) or "
                              "tests (pass_at_1)")
