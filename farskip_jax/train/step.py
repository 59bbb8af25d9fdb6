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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from farskip_jax.config import TrainConfig
from farskip_jax.train import losses

Batch = dict[str, jax.Array]
State = dict[str, Any]
AUX_KEYS = ("expert_balance_loss", "device_balance_loss")
# Metric sums accumulated over micro-batches (divided by the token count on the host).
_SUM_KEYS = ("kl_sum", "l2_sum", "ce_sum", "aux", "teacher_topk_mass_sum")


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """The static part of the loss (one compiled step per distinct spec)."""

    mode: str
    temperature: float
    hidden_l2_weight: float
    chunk_tokens: int
    aux_loss: bool
    cached_teacher: bool

    @classmethod
    def from_train(cls, tc: TrainConfig, cached_teacher: bool) -> LossSpec:
        return cls(tc.mode, tc.kl_temperature, tc.hidden_l2_weight, tc.kl_chunk_tokens, tc.aux_loss,
                   cached_teacher)

    @property
    def needs_teacher_model(self) -> bool:
        return self.mode == "fcsd" and not self.cached_teacher


def token_mask(spec: LossSpec, batch: Batch) -> jax.Array:
    """The tokens the loss counts: assistant (loss-masked) tokens, or every real token in `lm`."""
    if spec.mode == "lm":
        return losses.ce_mask("lm", batch["loss_mask"], batch["segment_ids"])
    return batch["loss_mask"]


def _forward(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, parallel: Any):
    model = nnx.merge(graphdef, params)
    out = model(batch["input_ids"], batch["positions"], batch["segment_ids"], parallel=parallel,
                compute_logits=False)
    return out, model.head_weights()


def micro_loss(spec: LossSpec, s_graph: nnx.GraphDef, s_params: nnx.State, t_graph: nnx.GraphDef | None,
               t_params: nnx.State | None, batch: Batch, normalizer: jax.Array, aux_scale: float,
               parallel: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss of one micro-batch, already divided by the step's global token count."""
    mask = token_mask(spec, batch)
    s_out, s_head = _forward(s_graph, s_params, batch, parallel)
    zero = jnp.zeros((), jnp.float32)
    m = {k: zero for k in _SUM_KEYS}
    if spec.mode == "fcsd":
        if spec.cached_teacher:
            loss, lm = losses.chunked_topk_kl(batch["teacher_topk_logp"], batch["teacher_topk_ids"],
                                              s_out.hidden, s_head, mask, spec.temperature, normalizer,
                                              spec.chunk_tokens)
            m["teacher_topk_mass_sum"] = lm["teacher_topk_mass"] * lm["num_tokens"]
        else:
            t_out, t_head = _forward(t_graph, jax.lax.stop_gradient(t_params), batch, parallel)
            loss, lm = losses.chunked_forward_kl(t_out.hidden, t_head, s_out.hidden, s_head, mask,
                                                 spec.temperature, normalizer, spec.chunk_tokens)
            if spec.hidden_l2_weight > 0:
                l2, l2m = losses.hidden_l2(jnp.stack(t_out.layer_outputs), jnp.stack(s_out.layer_outputs),
                                           mask, normalizer)
                loss = loss + spec.hidden_l2_weight * l2
                m["l2_sum"] = l2m["loss_sum"]
        m["kl_sum"] = lm["loss_sum"] / spec.temperature**2
    else:
        loss, lm = losses.chunked_cross_entropy(s_out.hidden, s_head, batch["targets"], mask, normalizer,
                                                spec.chunk_tokens)
        m["ce_sum"] = lm["loss_sum"]
    if spec.aux_loss:
        aux = sum((s_out.aux[k] for k in AUX_KEYS if k in s_out.aux), zero)
        # The balance losses are batch means already: weight each micro-batch equally.
        loss = loss + aux * aux_scale
        m["aux"] = aux * aux_scale
    return loss, m


def make_train_step(spec: LossSpec, s_graph: nnx.GraphDef, t_graph: nnx.GraphDef | None,
                    tx: optax.GradientTransformation, schedule: optax.Schedule, parallel: Any = None,
                    state_shardings: Any = None) -> Callable[..., tuple[State, dict[str, jax.Array]]]:
    """`step(state, teacher_params, batch, loss_scale) -> (state, metrics)`, jitted, state donated.

    state = {"params", "opt_state", "skipped"}. A non-finite loss or gradient norm leaves params and
    optimizer state untouched (jnp.where over the whole update) and increments "skipped".
    `loss_scale` is 1.0 except in fault-injection tests (NaN poisons the gradient).
    """

    def step(state: State, t_params: nnx.State | None, batch: Batch, loss_scale: jax.Array):
        params = state["params"]
        num_micro = batch["input_ids"].shape[0]
        normalizer = jnp.maximum(jnp.sum(token_mask(spec, batch).astype(jnp.float32)), 1.0)

        def grad_fn(p, mb):
            return jax.value_and_grad(
                lambda q: micro_loss(spec, s_graph, q, t_graph, t_params, mb, normalizer, 1.0 / num_micro,
                                     parallel), has_aux=True)(p)

        def body(carry, mb):
            g_acc, loss_acc, m_acc = carry
            (loss, m), g = grad_fn(params, mb)
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
            m_acc = {k: m_acc[k] + m[k] for k in m_acc}
            return (g_acc, loss_acc + loss, m_acc), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        m0 = {k: jnp.zeros((), jnp.float32) for k in _SUM_KEYS}
        (grads, loss, msum), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32), m0), batch)
        loss = loss * loss_scale
        grads = jax.tree.map(lambda g: g * loss_scale, grads)
        gnorm = optax.global_norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        # Zeroed grads keep Adam's update arithmetic finite; the result is discarded anyway when !ok.
        safe = jax.tree.map(lambda g: jnp.where(ok, g, 0.0).astype(g.dtype), grads)
        updates, new_opt = tx.update(safe, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        applied = jnp.asarray(state["step"] - state["skipped"], jnp.int32)
        new_state = {"params": keep(new_params, params), "opt_state": keep(new_opt, state["opt_state"]),
                     "step": state["step"] + 1, "skipped": state["skipped"] + (~ok).astype(jnp.int32)}
        metrics = {"loss": loss, "grad_norm": gnorm, "ok": ok, "num_tokens": normalizer,
                   "lr": schedule(applied), **msum}
        return new_state, metrics

    kw: dict[str, Any] = {"donate_argnums": (0,)}
    if state_shardings is not None:
        kw["out_shardings"] = (state_shardings, None)
    return jax.jit(step, **kw)


def _chunked_argmax(hidden: jax.Array, head: jax.Array, chunk: int) -> jax.Array:
    """argmax over the vocabulary of hidden @ head, [chunk, V] logits at a time."""
    shape = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    n = h.shape[0]
    c = max(1, min(chunk, n))
    pad = (-n) % c
    h = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, c, h.shape[-1])
    ids = jax.lax.map(lambda x: jnp.argmax(losses._logits(x, head), axis=-1).astype(jnp.int32), h)
    return ids.reshape(-1)[:n].reshape(shape)


def make_eval_step(spec: LossSpec, s_graph: nnx.GraphDef, t_graph: nnx.GraphDef | None,
                   parallel: Any = None) -> Callable[..., dict[str, jax.Array]]:
    """`eval(params, teacher_params, batch[B, T]) -> sums`: loss sums, greedy next-token exact matches
    against the data (`correct`) and, with a teacher, against the teacher's greedy token (`agree`)."""

    def ev(params: nnx.State, t_params: nnx.State | None, batch: Batch):
        mask = token_mask(spec, batch).astype(jnp.float32)
        ntok = jnp.sum(mask)
        _, m = micro_loss(spec, s_graph, params, t_graph, t_params, batch, jnp.float32(1.0), 1.0, parallel)
        s_out, s_head = _forward(s_graph, params, batch, parallel)
        s_ids = _chunked_argmax(s_out.hidden, s_head, spec.chunk_tokens)
        out = {**m, "num_tokens": ntok, "correct": jnp.sum((s_ids == batch["targets"]) * mask)}
        if t_graph is not None and t_params is not None:
            t_out, t_head = _forward(t_graph, t_params, batch, parallel)
            t_ids = _chunked_argmax(t_out.hidden, t_head, spec.chunk_tokens)
            out["agree"] = jnp.sum((s_ids == t_ids) * mask)
        elif spec.cached_teacher:
            out["agree"] = jnp.sum((s_ids == batch["teacher_topk_ids"][..., 0]) * mask)
        return out

    return jax.jit(ev)


def make_teacher_topk(t_graph: nnx.GraphDef, k: int, temperature: float, chunk: int,
                      parallel: Any = None) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """`topk(teacher_params, batch[B, T]) -> (log-probs [B, T, k] at temperature, ids [B, T, k])`."""

    def run(t_params: nnx.State, batch: Batch):
        out, head = _forward(t_graph, t_params, batch, parallel)
        h = out.hidden.reshape(-1, out.hidden.shape[-1])
        n = h.shape[0]
        c = max(1, min(chunk, n))
        pad = (-n) % c
        hc = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, c, h.shape[-1])

        def one(x):
            logp = jax.nn.log_softmax(losses._logits(x, head) / temperature, axis=-1)
            return jax.lax.top_k(logp, k)

        vals, ids = jax.lax.map(one, hc)
        shape = out.hidden.shape[:-1] + (k,)
        return vals.reshape(-1, k)[:n].reshape(shape), ids.reshape(-1, k)[:n].reshape(shape).astype(jnp.int32)

    return jax.jit(run)
