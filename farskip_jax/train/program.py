"""The training program: one place that turns a Config and a mesh into the jitted steps and the
layouts of everything they take.

The trainer runs `build_program(cfg, mesh).train_step` on real arrays; `abstract_train_step`
returns that same jitted step with abstract arguments (`jax.ShapeDtypeStruct` carrying their
NamedShardings), so the HLO inspector compiles for a GPU topology, without devices, exactly the
program `train.py` runs: same LossSpec, optimizer, ZeRO-1 layouts, teacher and parallel object.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax.config import Config, ExecutionConfig, ModelConfig, TeacherExperts, TrainConfig
from farskip_jax.errors import UserError
from farskip_jax.model.transformer import Transformer, with_farskip
from farskip_jax.parallel import (
    BATCH_AXES,
    ExpertParallel,
    expert_ranks_per_node,
    param_shardings,
    param_specs_tree,
    tile_per_node,
)
from farskip_jax.train import remat
from farskip_jax.train.optim import lr_schedule, make_optimizer
from farskip_jax.train.step import LossSpec, StepShardings, make_eval_step, make_train_step, teacher_parallel
from farskip_jax.train.zero1 import batch_devices, step_shardings

BATCH_FIELDS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")

log = logging.getLogger(__name__)


def student_config(cfg: Config) -> ModelConfig:
    """The student: the config's model (FarSkip settings, `param_dtype` master weights, default
    fp32, `dtype` compute)."""
    return cfg.model


def student_execution(cfg: Config) -> ExecutionConfig:
    """How the student runs: the config's execution section as it is."""
    return cfg.execution


def teacher_config(cfg: Config) -> ModelConfig:
    """The teacher: the same model with regular connectivity, weights in `train.teacher_dtype`."""
    return dataclasses.replace(with_farskip(cfg.model, enabled=False), param_dtype=cfg.train.teacher_dtype)


def teacher_execution(cfg: Config) -> ExecutionConfig:
    """How the teacher runs: as the student, but always dropless (capacity_factor 0): its
    distribution is the target, and a capacity limit would make that target depend on which other
    tokens share the batch."""
    return cfg.execution.dropless()


def uses_teacher_cache(tc: TrainConfig) -> bool:
    return tc.mode == "fcsd" and tc.teacher_cache is not None


def parallel_for(mesh: Mesh, expert_per_node: int | Literal["auto"] = 0) -> ExpertParallel | None:
    """The model's `parallel=` object for the training mesh (None: plain local routing);
    `expert_per_node` as `mesh.expert_per_node` (auto: `resolve_expert_per_node`)."""
    if dict(mesh.shape).get("tensor", 1) != 1:
        raise UserError("training uses the expert-parallel layout: set --set mesh.tensor=1 (tensor "
                        "parallelism is for inference) and split devices with mesh.expert / mesh.data")
    expert = dict(mesh.shape).get("expert", 1)
    if expert == 1:
        return None
    per_node = resolve_expert_per_node(mesh, expert_per_node)
    if 0 < per_node < expert and expert % per_node:
        raise UserError(f"mesh.expert_per_node={per_node} does not divide mesh.expert={expert}: "
                        "the expert axis must be whole nodes of that many ranks (or set it to 0)")
    return ExpertParallel(mesh, expert_per_node=per_node)


# `mesh.teacher_experts: auto` copies the frozen teacher's routed experts on every node where that
# adds at most this much per device: DeepSeek-V2-Lite's bf16 experts add 1.7 / 2.5 / 2.9 GiB on 2 /
# 4 / 8 nodes of 8 GPUs; Qwen3-30B-A3B's 5.1 GiB on 4 nodes and DeepSeek-V3's 133 GiB on 8 stay over
# the whole expert axis.
TEACHER_COPY_LIMIT = 4 * 2**30


def teacher_copy_share(setting: TeacherExperts, routed_bytes: float, expert: int, per_node: int) -> float:
    """`mesh.teacher_experts`' rule: the share of the teacher's routed bytes (`routed_bytes` in all)
    each device holds beyond routed / expert: all of them with `local` (1 - 1 / expert); inside each
    node of `per_node` expert ranks with `node`, or `auto` where that adds at most
    TEACHER_COPY_LIMIT bytes (1 / per_node - 1 / expert); else 0 (one node, the flat exchange,
    `expert`)."""
    if setting == "local":
        return 1 - 1 / expert
    if not 0 < per_node < expert or setting == "expert":
        return 0.0
    share = 1 / per_node - 1 / expert
    return 0.0 if setting == "auto" and routed_bytes * share > TEACHER_COPY_LIMIT else share


def teacher_routed_bytes(teacher_abstract: nnx.State) -> int:
    """Bytes of the teacher's routed expert stacks (the leaves split over the expert axis)."""
    specs = jax.tree.leaves(param_specs_tree(teacher_abstract, "ep"), is_leaf=lambda x: isinstance(x, P))
    leaves = jax.tree.leaves(teacher_abstract)
    return sum(x.size * x.dtype.itemsize for x, spec in zip(leaves, specs, strict=True) if "expert" in spec)


def teacher_copy_bytes(teacher_abstract: nnx.State, parallel: ExpertParallel,
                       setting: Literal["local", "node"] = "node") -> float:
    """Bytes per device the teacher's routed experts add over the whole expert axis' share: split
    over a node's expert ranks (`node`, 0 on one node) or all on every device (`local`)."""
    return teacher_routed_bytes(teacher_abstract) * teacher_copy_share(
        setting, 0, parallel.mesh.shape["expert"], parallel.expert_per_node)


def teacher_copies(parallel: ExpertParallel | None) -> int:
    """Copies of the teacher's routed experts the mesh holds (`tile_per_node`): one per node where
    they live inside each node, one per expert rank where every device holds them all, else 1."""
    t = teacher_parallel(parallel)
    return t.nodes if t is not None and t.experts_in_node else 1


def with_teacher_layout(parallel: ExpertParallel | None, setting: TeacherExperts,
                        teacher_abstract: nnx.State) -> ExpertParallel | None:
    """`parallel` with the teacher's experts placed as `mesh.teacher_experts` says
    (`ExpertParallel.for_teacher`, `teacher_copy_share`'s rule)."""
    if parallel is None or setting == "expert":
        return parallel
    if setting == "local":
        log.info("FCSD teacher: all of its routed experts on every device (mesh.teacher_experts=local), "
                 "+%.2f GiB per device; it exchanges nothing",
                 teacher_copy_bytes(teacher_abstract, parallel, "local") / 2**30)
        return dataclasses.replace(parallel, teacher_experts="local")
    if parallel.nodes == 1:
        return parallel
    routed = teacher_routed_bytes(teacher_abstract)
    expert, per_node = parallel.mesh.shape["expert"], parallel.expert_per_node
    extra_gib = routed * teacher_copy_share("node", routed, expert, per_node) / 2**30
    if not teacher_copy_share(setting, routed, expert, per_node):
        log.info("mesh.teacher_experts=auto: the teacher's routed experts stay over the expert axis (inside "
                 "each node they would add %.1f GiB per device)", extra_gib)
        return parallel
    log.info("FCSD teacher: routed experts inside each node of %d ranks (mesh.teacher_experts=%s), +%.2f GiB "
             "per device; its exchanges stay off the NICs", per_node, setting, extra_gib)
    return dataclasses.replace(parallel, teacher_experts="node")


def searches_teacher_layout(cfg: Config, expert_parallel: bool) -> bool:
    """Whether `execution.remat`'s search (train/remat.py) also decides the FCSD teacher's layout:
    with `mesh.teacher_experts: auto` on an expert-parallel step that runs the teacher model, each
    policy is compiled first with all of the teacher's routed experts on every device (`local`:
    est. 1.4-7% faster, BENCHMARKS.md K23), and runs so where that program fits the budget."""
    tc = cfg.train
    return (expert_parallel and tc.mode == "fcsd" and not uses_teacher_cache(tc)
            and cfg.mesh.teacher_experts == "auto")


def resolve_teacher_lockstep(setting: bool | Literal["auto"], parallel: ExpertParallel | None) -> bool:
    """`train.teacher_lockstep` as the FCSD step runs it: auto is on where the student's expert
    exchange spans nodes, or where the teacher's routed experts are on every device
    (`mesh.teacher_experts: local`). Across nodes the student's NIC exchanges are the longest
    collectives of the step and the teacher's layer is the compute XLA leaves out from under them
    (EP32 FCSD, est. 1103.0 -> 1039.6 ms on H200, 887.3 -> 839.8 ms on MI300X); a local teacher's
    layer is all compute, and beside the student's it hides more on one node too (8-MI300X FCSD,
    est. 506.0 -> 498.2 ms), where with the spread teacher it moved a 5-layer slice by 0.1%
    (BENCHMARKS.md K22, K23). `parallel`: with the teacher's layout applied (`with_teacher_layout`)."""
    if setting != "auto":
        return setting
    return parallel is not None and (parallel.nodes > 1 or parallel.teacher_experts == "local")


def resolve_expert_per_node(mesh: Mesh, setting: int | Literal["auto"]) -> int:
    """`mesh.expert_per_node` as the exchange uses it: an integer as given; auto from the nodes of
    the mesh's devices (`parallel.mesh.expert_ranks_per_node`), the flat exchange (0) where the
    expert axis stays on one node or does not span nodes in whole blocks of ranks (with a warning)."""
    if setting != "auto":
        return setting
    per_node = expert_ranks_per_node(mesh)
    if per_node is None:
        log.warning("mesh.expert_per_node=auto: the expert axis spans nodes, but not in whole blocks of "
                    "consecutive ranks (start one process per node, or processes of a node with "
                    "consecutive ranks); using the flat exchange. Set mesh.expert_per_node to override.")
        return 0
    return per_node


def abstract_params(mcfg: ModelConfig, exe: ExecutionConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, Param state of ShapeDtypeStructs) of the model `mcfg` run as `exe`; nothing is
    allocated."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, nnx.Rngs(0), exe)), nnx.Param)


def with_shardings(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree`'s leaves carrying the matching sharding of `shardings`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


@dataclasses.dataclass
class TrainProgram:
    """Models, optimizer, layouts and the jitted train step for one Config on one mesh."""

    cfg: Config
    mesh: Mesh
    parallel: ExpertParallel | None
    spec: LossSpec
    student_cfg: ModelConfig
    teacher_cfg: ModelConfig
    student_exe: ExecutionConfig
    teacher_exe: ExecutionConfig
    student_graph: nnx.GraphDef
    teacher_graph: nnx.GraphDef
    student_abstract: nnx.State  # ShapeDtypeStructs, no shardings
    teacher_abstract: nnx.State
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    shardings: StepShardings
    teacher_shardings: Any
    train_step: Any  # jitted: step(state, teacher_params, batch, loss_scale, after_void) -> (state, metrics)

    @property
    def needs_teacher(self) -> bool:
        return self.spec.needs_teacher_model

    @property
    def batch_sharding(self) -> NamedSharding:
        """[A, B, T] step batches: micro-batch axis whole, batch over (data, expert)."""
        return NamedSharding(self.mesh, P(None, BATCH_AXES))

    @property
    def eval_batch_sharding(self) -> NamedSharding:
        """[B, T] batches of the eval and teacher top-k steps."""
        return NamedSharding(self.mesh, P(BATCH_AXES))

    @property
    def worst_parallel(self) -> ExpertParallel | None:
        """The parallel strategy of the worst-case programs (buffers that cannot overflow)."""
        return None if self.parallel is None else self.parallel.worst_case()

    @functools.cached_property
    def worst_case_train_step(self) -> Any:
        """The train step with worst-case routed-expert buffers: what a step whose bounded buffers
        overflowed (metrics["moe_overflow"] > 0, state untouched) is run again with. Built (and
        compiled, at its first call) only when a step first needs it."""
        if self.parallel is None:
            return self.train_step  # one device: the rows are exact, nothing can overflow
        return make_train_step(self.spec, self.student_graph,
                               self.teacher_graph if self.spec.needs_teacher_model else None, self.tx,
                               self.schedule, self.worst_parallel, self.shardings)

    def eval_step(self, with_teacher: bool | None = None, cached_teacher: bool | None = None,
                  bounded: bool = True) -> Any:
        """The jitted eval step; by default with the teacher exactly when the train step has one.
        `bounded` False: the worst-case buffers (what an eval batch whose sums report
        "moe_overflow" > 0 is run again with)."""
        spec = self.spec if cached_teacher is None else dataclasses.replace(self.spec,
                                                                            cached_teacher=cached_teacher)
        teacher = spec.needs_teacher_model if with_teacher is None else with_teacher
        return make_eval_step(spec, self.student_graph, self.teacher_graph if teacher else None,
                              self.parallel if bounded else self.worst_parallel, self.shardings)

    def init_state(self, params: nnx.State) -> dict[str, Any]:
        """The train state around placed student params: optimizer state created in its (ZeRO-1)
        layout, and two separate step-counter buffers (the step donates its state, and one buffer
        cannot be donated twice)."""
        opt_state = jax.jit(self.tx.init, out_shardings=self.shardings.opt_state)(params)
        zero = lambda: jax.device_put(np.zeros((), np.int32), self.shardings.scalar)
        return {"params": params, "opt_state": opt_state, "step": zero(), "skipped": zero()}

    def abstract_state(self) -> dict[str, Any]:
        opt = jax.eval_shape(self.tx.init, self.student_abstract)
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.shardings.scalar)
        return {"params": with_shardings(self.student_abstract, self.shardings.params),
                "opt_state": with_shardings(opt, self.shardings.opt_state), "step": scalar, "skipped": scalar}

    def abstract_teacher(self) -> nnx.State | None:
        if not self.needs_teacher:
            return None
        return with_shardings(self.teacher_abstract, self.teacher_shardings)

    def abstract_batch(self, batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
        """A step batch [A, B, T] (A = train.grad_accum_steps), plus the cached teacher's top-k."""
        a, sh = self.cfg.train.grad_accum_steps, self.batch_sharding
        field = jax.ShapeDtypeStruct((a, batch_size, seq_len), jnp.int32, sharding=sh)
        batch = dict.fromkeys(BATCH_FIELDS, field)
        if self.spec.cached_teacher:
            k = self.cfg.train.teacher_topk
            batch["teacher_topk_logp"] = jax.ShapeDtypeStruct((a, batch_size, seq_len, k), jnp.float32,
                                                              sharding=sh)
            batch["teacher_topk_ids"] = jax.ShapeDtypeStruct((a, batch_size, seq_len, k), jnp.int32,
                                                             sharding=sh)
        return batch


def build_program(cfg: Config, mesh: Mesh) -> TrainProgram:
    """Everything the train step is made of, for `cfg` on `mesh` (real or deviceless).
    `execution.remat: auto` builds the first policy it tries (`remat.candidates`); the trainer and
    the inspector compile the others where that one does not fit (`train/remat.py`)."""
    parallel = parallel_for(mesh, cfg.mesh.expert_per_node)
    if cfg.execution.remat == "auto":
        cfg = remat.with_remat(cfg, remat.candidates("auto", parallel is not None)[0])
    tc = cfg.train
    s_cfg, t_cfg = student_config(cfg), teacher_config(cfg)
    s_exe, t_exe = student_execution(cfg), teacher_execution(cfg)
    s_graph, s_abs = abstract_params(s_cfg, s_exe)
    t_graph, t_abs = abstract_params(t_cfg, t_exe)
    if tc.mode == "fcsd":
        parallel = with_teacher_layout(parallel, cfg.mesh.teacher_experts, t_abs)
    lockstep = resolve_teacher_lockstep(tc.teacher_lockstep, parallel)
    spec = LossSpec.from_train(tc, cached_teacher=uses_teacher_cache(tc), teacher_lockstep=lockstep)
    if lockstep and tc.teacher_lockstep == "auto" and spec.needs_teacher_model:
        log.info("train.teacher_lockstep=auto: the expert exchange spans nodes or the teacher exchanges "
                 "nothing, so the FCSD teacher's forward runs layer by layer beside the student's "
                 "(scheduling only)")
    schedule = lr_schedule(tc)
    tx = make_optimizer(tc, s_abs)
    shardings = step_shardings(s_abs, tx, mesh, tc.zero1,
                               s_cfg.dtype if tc.zero1_gather == "compute" else None, s_cfg.dtype)
    step = make_train_step(spec, s_graph, t_graph if spec.needs_teacher_model else None, tx, schedule,
                           parallel, shardings)
    t_abs = tile_per_node(t_abs, teacher_copies(parallel))
    return TrainProgram(cfg=cfg, mesh=mesh, parallel=parallel, spec=spec, student_cfg=s_cfg,
                        teacher_cfg=t_cfg, student_exe=s_exe, teacher_exe=t_exe, student_graph=s_graph,
                        teacher_graph=t_graph,
                        student_abstract=s_abs, teacher_abstract=t_abs, tx=tx, schedule=schedule,
                        shardings=shardings, teacher_shardings=param_shardings(t_abs, mesh, "ep"),
                        train_step=step)


def abstract_train_step(cfg: Config, mesh: Mesh, seqs_per_device: int, seq_len: int) -> tuple[Any, tuple]:
    """(the jitted train step `train.py` runs, its abstract arguments) for `cfg` on `mesh`.

    Arguments: (state with ZeRO-1 optimizer-state shardings, teacher params in `train.teacher_dtype`
    or None when the loss needs no teacher, batch [A, B, T] with B = seqs_per_device x data x expert,
    loss_scale, after_void). `step.lower(*args).compile()` builds the trainer's program without any
    device.
    """
    prog = build_program(cfg, mesh)
    batch = prog.abstract_batch(seqs_per_device * batch_devices(mesh), seq_len)
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=prog.shardings.scalar)
    return prog.train_step, (prog.abstract_state(), prog.abstract_teacher(), batch, scalar, scalar)
