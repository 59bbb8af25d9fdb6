"""Jitted train / eval / teacher-cache steps for FCSD, SFT and LM training.

The student is held as (graphdef, nnx.State of Params) so the step is a pure function of arrays;
the teacher's params are a separate argument that is never differentiated, so it gets no
gradients, no optimizer state, and no backward compute.

Batch layout for the train step: every field is [A, B, T] with A = gradient-accumulation
micro-batches, scanned over; the loss of each micro-batch is divided by the valid-token count of
the whole step so the update is the mean over every valid token, whatever micro-batch it is in.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from farskip_jax.config import TrainConfig
from farskip_jax.model.transformer import run_streams
from farskip_jax.parallel.grad_sync import batch_mesh
from farskip_jax.parallel.mesh import BATCH_AXES
from farskip_jax.train import losses
from farskip_jax.train.chunking import chunked_map, lm_logits

Batch = dict[str, jax.Array]
State = dict[str, Any]
AUX_KEYS = ("expert_balance_loss", "device_balance_loss")
# Metric sums accumulated over micro-batches (divided by the token count on the host).
# The dropped-fraction entries are per micro-batch means of the models' aux "dropped_fraction"
# (0.0 when dropless); the train step divides their sum by the number of micro-batches.
_SUM_KEYS = ("kl_sum", "l2_sum", "ce_sum", "aux", "teacher_topk_mass_sum", "student_dropped_fraction",
             "teacher_dropped_fraction", "moe_overflow")
_MEAN_KEYS = ("student_dropped_fraction", "teacher_dropped_fraction")


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """The static part of the loss (one compiled step per distinct spec)."""

    mode: str
    temperature: float
    hidden_l2_weight: float
    chunk_tokens: int
    aux_loss: bool
    cached_teacher: bool
    teacher_lockstep: bool = False

    @classmethod
    def from_train(cls, tc: TrainConfig, cached_teacher: bool, teacher_lockstep: bool = False) -> LossSpec:
        """`teacher_lockstep`: `train.teacher_lockstep` resolved (`program.resolve_teacher_lockstep`)."""
        return cls(tc.mode, tc.kl_temperature, tc.hidden_l2_weight, tc.kl_chunk_tokens, tc.aux_loss,
                   cached_teacher, teacher_lockstep)

    @property
    def needs_teacher_model(self) -> bool:
        return self.mode == "fcsd" and not self.cached_teacher


def token_mask(spec: LossSpec, batch: Batch) -> jax.Array:
    """The tokens the loss counts: assistant (loss-masked) tokens, or every real token in `lm`."""
    if spec.mode == "lm":
        return losses.ce_mask("lm", batch["loss_mask"], batch["segment_ids"])
    return batch["loss_mask"]


def teacher_parallel(parallel: Any) -> Any:
    """The `parallel=` object the frozen teacher runs with (`ExpertParallel.for_teacher`: its experts
    may live inside each node); None or a parallelism without that view: the student's."""
    return parallel.for_teacher() if hasattr(parallel, "for_teacher") else parallel


def _forward(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, parallel: Any):
    model = nnx.merge(graphdef, params)
    out = model(batch["input_ids"], batch["positions"], batch["segment_ids"], parallel=parallel,
                compute_logits=False)
    return out, model.head_weights()


def _forward_lockstep(s_graph: nnx.GraphDef, s_params: nnx.State, t_graph: nnx.GraphDef,
                      t_params: nnx.State, batch: Batch, parallel: Any):
    """Student and teacher forwards layer by layer (`transformer.run_streams`): the same values as
    two `_forward`s, scheduled so that the teacher's collectives can run under the student's layer."""
    s_model, t_model = nnx.merge(s_graph, s_params), nnx.merge(t_graph, t_params)
    args = (batch["input_ids"], batch["positions"], batch["segment_ids"])
    streams = [s_model.stream(*args, parallel=parallel, compute_logits=False),
               t_model.stream(*args, parallel=teacher_parallel(parallel), compute_logits=False)]
    s_out, t_out = run_streams(streams, scopes=[None, "teacher"])
    return s_out, s_model.head_weights(), t_out, t_model.head_weights()


def _dropped(out: Any) -> jax.Array:
    return jnp.asarray(out.aux.get("dropped_fraction", 0.0), jnp.float32)


def _overflow(*outs: Any) -> jax.Array:
    """1.0 when a bounded routed-expert buffer overflowed in any of the forwards (the values are void)."""
    flags = [jnp.asarray(o.aux.get("moe_overflow", 0), jnp.float32) for o in outs if o is not None]
    return functools.reduce(jnp.maximum, flags, jnp.zeros((), jnp.float32))


class _Forwards(NamedTuple):
    student: Any
    student_head: jax.Array
    teacher: Any
    teacher_head: jax.Array | None


def _micro(spec: LossSpec, s_graph: nnx.GraphDef, s_params: nnx.State, t_graph: nnx.GraphDef | None,
           t_params: nnx.State | None, batch: Batch, normalizer: jax.Array, aux_scale: float,
           parallel: Any) -> tuple[jax.Array, dict[str, jax.Array], _Forwards]:
    mask = token_mask(spec, batch)
    mesh = batch_mesh(parallel)
    lockstep = spec.teacher_lockstep and spec.needs_teacher_model
    if lockstep:
        s_out, s_head, t_out, t_head = _forward_lockstep(s_graph, s_params, t_graph,
                                                         jax.lax.stop_gradient(t_params), batch, parallel)
    else:
        s_out, s_head = _forward(s_graph, s_params, batch, parallel)
        t_out = t_head = None
    zero = jnp.zeros((), jnp.float32)
    m = {k: zero for k in _SUM_KEYS}
    m["student_dropped_fraction"] = _dropped(s_out)
    if spec.mode == "fcsd":
        if spec.cached_teacher:
            loss, lm = losses.chunked_topk_kl(batch["teacher_topk_logp"], batch["teacher_topk_ids"],
                                              s_out.hidden, s_head, mask, spec.temperature, normalizer,
                                              spec.chunk_tokens, mesh)
            m["teacher_topk_mass_sum"] = lm["teacher_topk_mass"] * lm["num_tokens"]
        else:
            if not lockstep:
                # The scope lets the HLO inspector report the teacher's collectives apart.
                with jax.named_scope("teacher"):
                    t_out, t_head = _forward(t_graph, jax.lax.stop_gradient(t_params), batch,
                                             teacher_parallel(parallel))
            m["teacher_dropped_fraction"] = _dropped(t_out)
            loss, lm = losses.chunked_forward_kl(t_out.hidden, t_head, s_out.hidden, s_head, mask,
                                                 spec.temperature, normalizer, spec.chunk_tokens, mesh)
            if spec.hidden_l2_weight > 0:
                l2, l2m = losses.hidden_l2(jnp.stack(t_out.layer_outputs), jnp.stack(s_out.layer_outputs),
                                           mask, normalizer)
                loss = loss + spec.hidden_l2_weight * l2
                m["l2_sum"] = l2m["loss_sum"]
        m["kl_sum"] = lm["loss_sum"] / spec.temperature**2
    else:
        loss, lm = losses.chunked_cross_entropy(s_out.hidden, s_head, batch["targets"], mask, normalizer,
                                                spec.chunk_tokens, mesh)
        m["ce_sum"] = lm["loss_sum"]
    if spec.aux_loss:
        aux = sum((s_out.aux[k] for k in AUX_KEYS if k in s_out.aux), zero)
        # The balance losses are batch means already: weight each micro-batch equally.
        loss = loss + aux * aux_scale
        m["aux"] = aux * aux_scale
    m["moe_overflow"] = _overflow(s_out, t_out)
    return loss, m, _Forwards(s_out, s_head, t_out, t_head)


def micro_loss(spec: LossSpec, s_graph: nnx.GraphDef, s_params: nnx.State, t_graph: nnx.GraphDef | None,
               t_params: nnx.State | None, batch: Batch, normalizer: jax.Array, aux_scale: float,
               parallel: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss of one micro-batch, already divided by the step's global token count."""
    loss, m, _ = _micro(spec, s_graph, s_params, t_graph, t_params, batch, normalizer, aux_scale, parallel)
    return loss, m


@dataclasses.dataclass(frozen=True)
class StepShardings:
    """Where the train step keeps each tree (NamedSharding trees shaped like the trees they place).

    `compute`: the layout the model reads the parameters in (EP: experts split, the rest
    replicated); `grads`: the layout of gradients and of the update arithmetic, equal to `compute`
    without ZeRO-1 and split over the batch devices with it (`farskip_jax.train.zero1`); `params`:
    where the state keeps the parameters between steps, the update's layout (`grads`);
    `opt_state`: the optimizer state's layout, matching `grads`; `scalar`: replicated scalars;
    `gather`: the dtype each parameter travels in from `params` to `compute`, and `model`: the
    dtype the model receives it in (trees of dtypes; `farskip_jax.train.zero1.gather_dtypes`).
    """

    params: Any
    grads: Any
    opt_state: Any
    scalar: Any
    compute: Any
    gather: Any
    model: Any

    def to_compute(self, params: nnx.State) -> nnx.State:
        """The stored parameters in the layout the model computes in, each cast to its `gather`
        dtype in its stored (split) layout, all-gathered in it and cast to its `model` dtype. A
        leaf whose `model` dtype is narrower than stored is one the model casts to that dtype before
        every use, so it receives the values it would compute with anyway; the gradient is taken
        with respect to that copy, so XLA sums it over the devices once, in that dtype
        (`farskip_jax.train.zero1`)."""

        def one(x: jax.Array, travel: Any, model: Any, stored: Any, compute: Any) -> jax.Array:
            if travel != x.dtype:
                x = jax.lax.with_sharding_constraint(x.astype(travel), stored)
            return jax.lax.with_sharding_constraint(x, compute).astype(model)

        return jax.tree.map(one, params, self.gather, self.model, self.params, self.compute)

    @property
    def state(self) -> State:
        return {"params": self.params, "opt_state": self.opt_state, "step": self.scalar,
                "skipped": self.scalar}


def make_train_step(spec: LossSpec, s_graph: nnx.GraphDef, t_graph: nnx.GraphDef | None,
                    tx: optax.GradientTransformation, schedule: optax.Schedule, parallel: Any = None,
                    shardings: StepShardings | None = None
                    ) -> Callable[..., tuple[State, dict[str, jax.Array]]]:
    """`step(state, teacher_params, batch, loss_scale, after_void) -> (state, metrics)`, jitted, state
    donated.

    state = {"params", "opt_state", "step", "skipped"}. A non-finite loss or gradient norm leaves
    params and optimizer state untouched (a lax.cond around the whole update) and increments "skipped".
    An overflow of a bounded routed-expert buffer (metrics["moe_overflow"] > 0; `parallel.bounded`)
    makes the step void: the whole state is left untouched, counters included, and the caller runs
    the same batch again with the worst-case step (`parallel.worst_case()`), which then counts as the
    step. `metrics["void"]` is 1.0 for a void step; passed as the next step's `after_void`, it makes
    that step void too. That is what lets the caller dispatch step i+1 before it reads step i's
    metrics (the device never waits for the host) and still apply the batches in order: when step i
    overflowed, i+1 changed nothing either, and both are run again (i with the worst-case buffers).
    `after_void` is 0.0 for the first step and for every re-run.
    `loss_scale` is 1.0 except in fault-injection tests (NaN poisons the gradient).

    With `shardings`, the step reads the parameters in `shardings.compute` and constrains every
    micro-batch's gradient to `shardings.grads`. Under ZeRO-1 that layout is split over the batch
    devices: XLA reduces the data-parallel gradient sum with a reduce-scatter instead of an
    all-reduce, the AdamW arithmetic runs on 1/N of every replicated weight per device, and the
    state keeps the new parameters split (`shardings.params`); the next step all-gathers them at its
    start, where the forward pass can run under the all-gathers (a weight is needed only when its
    layer comes), instead of at the end of this one, where nothing is left to run under them.
    """
    tx = optax.with_extra_args_support(tx)  # the update is given the gradients' norm (train/optim.py)
    if shardings is None:
        to_grad = to_param = to_compute = lambda tree: tree
    else:
        to_grad = lambda tree: jax.lax.with_sharding_constraint(tree, shardings.grads)
        to_param = lambda tree: jax.lax.with_sharding_constraint(tree, shardings.params)
        to_compute = shardings.to_compute

    def step(state: State, t_params: nnx.State | None, batch: Batch, loss_scale: jax.Array,
             after_void: jax.Array):
        params = to_compute(state["params"])
        num_micro = batch["input_ids"].shape[0]
        normalizer = jnp.maximum(jnp.sum(token_mask(spec, batch).astype(jnp.float32)), 1.0)

        def grad_fn(p, mb):
            # The scale multiplies the loss, so it reaches the gradients through the backward pass's
            # seed: scaling the gradients afterwards made XLA keep a scaled copy of each for its
            # several readers (a full-size temporary per weight, BENCHMARKS A).
            def scaled_loss(q):
                loss, m = micro_loss(spec, s_graph, q, t_graph, t_params, mb, normalizer, 1.0 / num_micro,
                                     parallel)
                return loss * loss_scale, m

            return jax.value_and_grad(scaled_loss, has_aux=True)(p)

        def body(carry, mb):
            g_acc, loss_acc, m_acc = carry
            (loss, m), g = grad_fn(params, mb)
            g_acc = to_grad(jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, to_grad(g)))
            m_acc = {k: m_acc[k] + m[k] for k in m_acc}
            return (g_acc, loss_acc + loss, m_acc), None

        zeros = to_grad(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
        m0 = {k: jnp.zeros((), jnp.float32) for k in _SUM_KEYS}
        (grads, loss, msum), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32), m0), batch)
        msum = {k: v / num_micro if k in _MEAN_KEYS else v for k, v in msum.items()}
        gnorm = optax.tree.norm(grads)
        void = (msum["moe_overflow"] > 0) | (after_void > 0)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        ok = finite & ~void

        # The update runs in the gradients' layout: each device updates its slice of every weight.
        def apply(p: nnx.State, opt_state: Any) -> tuple[nnx.State, Any]:
            local = to_grad(p)
            updates, new_opt = tx.update(to_grad(grads), opt_state, local, global_norm=gnorm)
            return to_grad(optax.apply_updates(local, updates)), new_opt

        def keep(p: nnx.State, opt_state: Any) -> tuple[nnx.State, Any]:
            return to_grad(p), opt_state

        # A cond, not jnp.where(ok, new, old) per leaf: a select needs both the new and the old values
        # alive, so XLA copied the donated moments and materialised both branches (full-size temporaries
        # of every expert stack); under the cond only the taken branch runs, updating in place.
        new_params, new_opt = jax.lax.cond(ok, apply, keep, state["params"], state["opt_state"])
        applied = jnp.asarray(state["step"] - state["skipped"], jnp.int32)
        counted = (~void).astype(jnp.int32)  # a void step is not a step: it is run again
        new_state = {"params": to_param(new_params), "opt_state": new_opt,
                     "step": state["step"] + counted,
                     "skipped": state["skipped"] + (~finite & ~void).astype(jnp.int32)}
        metrics = {"loss": loss, "grad_norm": gnorm, "ok": finite, "num_tokens": normalizer,
                   "lr": schedule(applied), "void": void.astype(jnp.float32), **msum}
        return new_state, metrics

    kw: dict[str, Any] = {"donate_argnums": (0,)}
    if shardings is not None:
        kw["out_shardings"] = (shardings.state, None)
    return jax.jit(step, **kw)


def greedy_ids(hidden: jax.Array, head: jax.Array, chunk: int) -> jax.Array:
    """argmax over the vocabulary of hidden @ head for hidden [B, T, D], `chunk` positions at a time."""
    return chunked_map(lambda h: jnp.argmax(lm_logits(h, head), axis=-1).astype(jnp.int32), (hidden,),
                       chunk, hidden.ndim - 1)


def make_eval_step(spec: LossSpec, s_graph: nnx.GraphDef, t_graph: nnx.GraphDef | None,
                   parallel: Any = None, shardings: StepShardings | None = None
                   ) -> Callable[..., dict[str, jax.Array]]:
    """`eval(params, teacher_params, batch[B, T]) -> sums`: loss sums, greedy next-token exact matches
    against the data (`correct`) and, with a teacher, against the teacher's greedy token (`agree`).

    `shardings`: the train step's; the stored parameters (ZeRO-1: split) are all-gathered into the
    layout the model computes in first, as the train step does (`StepShardings.to_compute`)."""

    def ev(params: nnx.State, t_params: nnx.State | None, batch: Batch):
        if shardings is not None:
            params = shardings.to_compute(params)
        mask = token_mask(spec, batch).astype(jnp.float32)
        ntok = jnp.sum(mask)
        _, m, fw = _micro(spec, s_graph, params, t_graph, t_params, batch, jnp.float32(1.0), 1.0, parallel)
        s_ids = greedy_ids(fw.student.hidden, fw.student_head, spec.chunk_tokens)
        out = {**m, "num_tokens": ntok, "correct": jnp.sum((s_ids == batch["targets"]) * mask)}
        if t_graph is not None and t_params is not None:
            t_out, t_head = (fw.teacher, fw.teacher_head) if fw.teacher is not None else \
                _forward(t_graph, t_params, batch, teacher_parallel(parallel))
            t_ids = greedy_ids(t_out.hidden, t_head, spec.chunk_tokens)
            out["agree"] = jnp.sum((s_ids == t_ids) * mask)
        elif spec.cached_teacher:
            out["agree"] = jnp.sum((s_ids == batch["teacher_topk_ids"][..., 0]) * mask)
        return out

    return jax.jit(ev)


def make_teacher_topk(t_graph: nnx.GraphDef, k: int, temperature: float, chunk: int,
                      parallel: Any = None, mesh: Mesh | None = None
                      ) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
    """`topk(teacher_params, batch[B, T]) -> (log-probs [B, T, k] at temperature, ids [B, T, k],
    overflow)`; overflow > 0: a bounded routed-expert buffer overflowed and the values are void.

    With `mesh`, each chunk's top-k runs under a shard_map over the batch devices: XLA's SPMD
    partitioner does not split top_k along a sharded batch axis, it all-gathers the [B, chunk, V]
    log-probs first, so every device would rank every row's vocabulary.
    """

    def one(h: jax.Array, head: jax.Array) -> tuple[jax.Array, jax.Array]:
        logp = jax.nn.log_softmax(lm_logits(h, head) / temperature, axis=-1)
        vals, ids = jax.lax.top_k(logp, k)
        return vals, ids.astype(jnp.int32)

    if mesh is not None and math.prod(dict(mesh.shape).get(a, 1) for a in BATCH_AXES) > 1:
        rows = P(BATCH_AXES)
        one = jax.shard_map(one, mesh=mesh, in_specs=(rows, P()), out_specs=(rows, rows))

    def run(t_params: nnx.State, batch: Batch):
        with jax.named_scope("teacher"):
            out, head = _forward(t_graph, t_params, batch, teacher_parallel(parallel))
        vals, ids = chunked_map(lambda h: one(h, head), (out.hidden,), chunk, out.hidden.ndim - 1)
        return vals, ids, _overflow(out)

    return jax.jit(run)
