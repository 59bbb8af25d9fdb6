"""How to run a model: `ExecutionConfig`, the `execution:` section of a config (YAML, `--set
execution.remat=full`), beside `ModelConfig` (`model:`), which says what the model computes.

The rule for which section a field belongs to: a field is an execution field when the same weights,
the same `ModelConfig` and the same inputs give the same results whatever its value (up to
floating-point reassociation: a kernel, a blocking, a split or a recomputation orders the sums
differently), so that it is a choice of the run, not of the model: kernels (grouped expert GEMM,
attention core and its blocks), the expert-parallel exchange, recomputation in the backward pass,
the layer loop, batch and token splits, routed-expert buffer sizes, and schedule hints. One field
is here although it changes the results: `capacity_factor`, the student's optional training-time
capacity drop. It is a property of a training run (the FCSD teacher, evaluation of the teacher and
inference always run the same weights dropless), it is not in an HF config.json, and issue #26
lists it with the knobs. `dtype` and `param_dtype` stay in `ModelConfig`: the parameter dtype is the
parameter tree's own (checkpoints, converters, the teacher's `train.teacher_dtype` copy), and the
compute dtype changes every result by design (bf16 rounding), not by reassociation.

A comparison of two runs states what it changes: `dataclasses.replace(cfg, model=...)` for a
different model (e.g. regular connectivity), `dataclasses.replace(cfg, execution=...)` for another
way of running it (e.g. no batch split); the inspector's baselines do exactly one of the two
(`farskip_jax.inspect.steps.config_for`).

Every field here was a `ModelConfig` field before the split: `--set model.remat=...` and a YAML
`model:` section holding one of them are refused with the new key (`ModelConfig.MOVED_KEYS`);
configs stored by earlier versions (training checkpoints, converted checkpoints) are migrated on
load (`farskip_jax.config.migrate_stored_config`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from farskip_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How a model runs (see the module docstring for the rule); the defaults run anywhere."""

    # <= 0: dropless (the default; the FCSD teacher and inference are always dropless). > 0: an
    # optional student capacity of ceil(capacity_factor * seq_len * top_k / experts) assignments per
    # expert per sequence; the lowest-router-weight assignments are dropped first, so one device and
    # any expert-parallel mesh drop the same ones.
    capacity_factor: float = 0.0
    # Optimistic dropless: under expert or tensor parallelism each rank's routed-expert buffers hold
    # this many times the rows balanced routing gives it (rounded up to 8 rows, at most the worst
    # case: every token's assignments on one rank). A forward whose busiest rank needs more reports
    # `moe_overflow`, and every entry point (trainer, eval, teacher cache, generation, logits) re-runs
    # it with the worst-case program, so results stay exactly dropless. 0 = always the worst case.
    # 2.0 from bench/routing_stats.py (DSV2-Lite-shaped routers at EP8: no step over 2x until the
    # busiest expert carries ~4x its share; BENCHMARKS.md K).
    moe_buffer_factor: float = 2.0
    # Grouped expert GEMM over the expert-sorted tokens: jax.lax.ragged_dot (hipBLASLt's grouped
    # GEMM on ROCm, a dense masked dot on CUDA), tokamax's ragged_dot kernel (Pallas Mosaic GPU,
    # Hopper; real rows only, forward and both gradients), a padded per-expert buffer with a batched
    # einsum, blocks of real rows in a loop (model/grouped_matmul.py), or auto = ragged on ROCm,
    # tokamax on CUDA, blocked on CPU (model/dispatch.py:resolve_matmul).
    expert_matmul: Literal["auto", "ragged", "tokamax", "padded", "blocked"] = "auto"
    # The routed experts' activation silu(gate) * up between the ragged / tokamax grouped GEMMs: a
    # Pallas Triton kernel that skips the buffer's rows past the groups (forward and backward;
    # Pallas' interpreter on CPU, for tests), XLA's elementwise fusion over every row, or auto = the
    # kernel on Hopper and MI300X, xla elsewhere. The blocked and padded grouped matmuls always get
    # xla (model/swiglu_rows.py).
    expert_swiglu: Literal["auto", "pallas_triton", "xla"] = "auto"
    # Expert-parallel token exchange: ragged_all_to_all (GPU), per-destination buffers with a plain
    # all_to_all (works everywhere, XLA:CPU included), or auto = ragged on GPU meshes, padded elsewhere.
    ep_exchange: Literal["auto", "ragged", "padded"] = "auto"
    # Attention core: blockwise (flash-style online softmax in XLA ops, O(T) memory; the CPU path),
    # the [T, T] reference, or tokamax's fused flash kernel (Mosaic GPU on Hopper, Pallas-Triton on
    # MI300X; bf16/fp16, masked by per-query document starts: model/attention_kernels.py). auto = the
    # fused kernel where it was compiled and checked for the target device and dtype, blockwise
    # elsewhere (model/attention.py:resolve_attention). cudnn is refused: jax.nn's cuDNN path rejects
    # MLA's head dims (192 / 128) and takes no segment ids.
    attention: Literal["auto", "blockwise", "reference", "tokamax", "cudnn"] = "auto"
    attention_block_q: int = 512
    attention_block_kv: int = 512
    # save_a2a: recompute each layer in the backward pass except the expert-parallel all-to-all
    # outputs, so Dispatch and Combine are not run again; save_dots: except the plain matmuls'
    # outputs; save_a2a_dots: both. auto: the trainer (and the inspector) compile the train step with
    # none, save_a2a_dots, save_a2a, save_dots, full in that order (most kept first) and run the
    # first whose peak fits the budget below (farskip_jax/train/remat.py).
    remat: Literal["auto", "none", "full", "save_dots", "save_a2a", "save_a2a_dots"] = "none"
    # remat=auto's budget per device: this share of the device's HBM (0.8: XLA's GPU scheduler
    # plans with 80% of device memory itself, and a step past it lost its overlap: BENCHMARKS K4),
    # never above what JAX's allocator may hand out (XLA_PYTHON_CLIENT_MEM_FRACTION). The overflow
    # re-run's worst-case program recomputes more than the bounded step where that does not fit.
    remat_hbm_fraction: float = 0.8
    # > 0: the budget in GiB instead (a GPU whose HBM farskip_jax does not know, room kept for
    # something else, or a CPU run, where no budget is known and auto means none).
    remat_budget_gib: float = 0.0
    # Unrolled layers (default) leave XLA free to overlap layer k's Combine with layer k+1's
    # attention; "scan" runs equal consecutive layers in one lax.scan (a measurement option: it
    # stacks their weights every step, see model/transformer.py:_scan_layers).
    layer_loop: Literal["unrolled", "scan"] = "unrolled"
    # Tensor-parallel inference only (ignored by the expert-parallel trainer). tp_microbatches > 1
    # splits each sequence's tokens into that many equal chunks whose FFNs and psums run separately
    # (attention, the only op that mixes tokens, still runs once over all of them), so one chunk's
    # psums can hide under another chunk's compute; lossless (dropless routing required: capacity is
    # per sequence). tp_reduce "reduce_scatter": each psum becomes a reduce-scatter over the token
    # axis followed by an all-gather, which XLA may schedule later, where the sum is read.
    tp_microbatches: int = 1
    tp_reduce: Literal["psum", "reduce_scatter"] = "psum"
    # Tensor-parallel inference: optimization barriers that fix the order of the sub-blocks (and
    # chain the token chunks' FFNs) so that XLA schedules under each psum the compute that the
    # wiring lets it overlap (`model/schedule.py` join). Scheduling only: the numbers are unchanged.
    tp_order_barriers: bool = True
    # Single-device and expert-parallel paths (ignored under tensor parallelism): split each device's
    # sequences into this many equal chunks that run through every layer as separate streams, so
    # one chunk's all-to-alls can hide under another chunk's compute (MaxText's "batch split").
    # Lossless: sequences are independent, and capacity is counted per sequence. 1 (one stream) is
    # the fastest setting measured for the DeepSeek-V2-Lite FCSD step on every target and mesh since
    # `remat: save_a2a_dots` (est., BENCHMARKS K18): the split's smaller GEMMs cost more compute than
    # the overlap it adds, and with a data axis it runs each expert gradient's all-reduce per chunk.
    # The student-only `lm` step on one node of H200 is the exception measured: 2 est. 1.4% faster.
    batch_split: int = 1
    # Stagger the batch chunks with optimization barriers (model/farskip.py residual_step_chunks):
    # chunk 1's attention beside chunk 0's MoE. Off (default): the chunks are independent and XLA
    # orders them, which hid more of FarSkip's all-to-alls; on hid more under regular connectivity
    # and lowered peak memory (bench/results/batch_split.md).
    batch_split_stagger: bool = False

    def validate(self) -> None:
        for name in ("attention_block_q", "attention_block_kv", "tp_microbatches", "batch_split"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"execution.{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.remat_hbm_fraction <= 1:
            raise ConfigError(f"execution.remat_hbm_fraction must be in (0, 1], got "
                              f"{self.remat_hbm_fraction}")
        if self.remat_budget_gib < 0:
            raise ConfigError(f"execution.remat_budget_gib must be >= 0 (0: from the device), got "
                              f"{self.remat_budget_gib}")
        if self.moe_buffer_factor != 0 and self.moe_buffer_factor < 1:
            raise ConfigError(f"execution.moe_buffer_factor must be 0 (always the worst case) or >= 1 "
                              f"(times the balanced rows), got {self.moe_buffer_factor}")
        if self.tp_microbatches > 1 and self.capacity_factor > 0:
            raise ConfigError("execution.tp_microbatches > 1 needs dropless routing "
                              "(execution.capacity_factor <= 0): capacity is counted per sequence, so "
                              "chunks would drop other tokens")
        if self.tp_microbatches > 1 and self.layer_loop == "scan":
            raise ConfigError("execution.tp_microbatches > 1 needs execution.layer_loop=unrolled (the chunks "
                              "of one layer interleave with those of the next)")
        if self.batch_split != 1 and self.layer_loop == "scan":
            raise ConfigError(f"execution.batch_split={self.batch_split} needs execution.layer_loop=unrolled "
                              "(the chunks of one layer interleave with those of the next)")

    def dropless(self) -> ExecutionConfig:
        """The same way of running without a capacity drop: what the FCSD teacher and inference run."""
        return dataclasses.replace(self, capacity_factor=0.0)
