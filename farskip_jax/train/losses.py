"""Distillation and language-modelling losses for the FCSD trainer (pure functions).

Conventions shared by every loss here:

* ``mask`` marks the tokens that count (1) and those that do not (0); it has the shape of the token axes.
* Normalisation: ``loss = sum over masked tokens of the per-token loss / normalizer``. By default the
  normalizer is the number of masked tokens in the call (clamped to >= 1 so an all-masked batch gives 0,
  not NaN). Under gradient accumulation or data parallelism pass ``normalizer=`` the *global* count of
  valid tokens, so every token weighs the same whatever micro-batch it lands in (huggingface/trl#6526).
* KL losses are forward KL(teacher || student) on next-token distributions at temperature ``T`` (both
  logit sets divided by ``T``), multiplied by ``T**2`` as is customary (Hinton et al.) so that gradient
  magnitudes do not shrink as ``T`` grows. ``metrics["kl"]`` is the mean KL *without* the ``T**2``.
* The teacher is a fixed target: its inputs pass through ``stop_gradient``, so no gradient (and no
  backward compute) flows into it.
* Every function returns ``(loss, metrics)``; ``metrics`` always has ``num_tokens`` and ``loss_sum`` (the
  un-normalised sum), so a trainer can re-normalise across micro-batches or devices.

The ``chunked_*`` variants take final hidden states ``[..., d]`` and LM-head matrices ``[d, vocab]``
instead of logits. They scan over chunks of the sequence axis (``farskip_jax.train.chunking``), taking
each chunk's gradient in the forward pass right after its value, so no pass ever holds more than
``[rows, chunk, vocab]`` logits per model and none rebuilds them: at vocab 102400 a 4096-token
sequence would otherwise need 1.6 GiB of fp32 logits per model, plus as much for gradients. Logits
come from ``chunking.lm_logits`` (the compute dtype of the hidden states, fp32 accumulation) for the
student and the teacher alike.
``mesh``: the batch is split over its batch axes; each device then sums the loss of its own rows and
the LM head's gradient crosses the devices once per call (``chunking.chunked_sum``).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from farskip_jax.train.chunking import chunked_sum, lm_logits

Array = jax.Array
Metrics = dict[str, Array]

# Clamp for the student's tail probability: a student that puts (numerically) all its mass on the teacher's
# top-k ids would otherwise give log(0) = -inf in the tail term.
_TAIL_EPS = 1e-12


def _normalise(total: Array, num_tokens: Array, normalizer: float | Array | None) -> Array:
    denom = jnp.maximum(num_tokens, 1.0) if normalizer is None else jnp.asarray(normalizer, jnp.float32)
    return total / denom


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _token_kl(t_logits: Array, s_logits: Array, temperature: float) -> Array:
    """Per-token KL(softmax(t/T) || softmax(s/T)) over the last axis, in fp32.

    Computed as sum_i p_i (d_i + expm1(-d_i)) with d = log p - log q, which equals sum_i p_i d_i
    because sum_i p_i exp(-d_i) = sum_i q_i = 1, but has no cancellation: every term is >= 0
    (~p d^2 / 2). The plain sum_i p_i d_i adds terms ~1e-3 that cancel to a KL that can be ~1e-6
    (a student close to its teacher), and d taken from two log-softmaxes of size ~log(vocab)
    carries their rounding (~5e-7 each at vocab 128, more at 102400): measured 1.4% apart between
    two XLA CPU instruction sets on the tiny FCSD run. Here d is the logit difference minus the
    difference of log-normalizers; an error c in the latter shifts every d_i of a token alike and
    moves the KL only by ~c * KL.

    Gradient (`_token_kl_bwd`): (q - p) / T with respect to the student's logits, one pass over
    them; the teacher's get none (it is the fixed target). Autodiff through the form above made
    five passes over the [tokens, vocab] fp32 logits where this makes one (BENCHMARKS K28)."""
    return _token_kl_fwd(t_logits, s_logits, temperature)[0]


def _shift_and_norm(x: Array) -> tuple[Array, Array]:
    """(m, z) with softmax(x) = exp(x - m) / z over the last axis (keepdims): m the finite max."""
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return m, jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)


def _softmax(x: Array, m: Array, z: Array) -> Array:
    """softmax(x) from `_shift_and_norm`'s (m, z), as the custom VJPs below take it: exp(x - m) / z
    rather than exp(x - lse), whose rounding of lse (~1 ulp of m + log z) would be a relative error
    of every probability (1.2e-6 of the largest KL gradient off float64, against 1.0-3.3e-7 this
    way: tests/train/test_losses.py)."""
    return jnp.exp(x - m) / z


def _token_kl_fwd(t_logits: Array, s_logits: Array, temperature: float) -> tuple[Array, tuple[Array, ...]]:
    t = t_logits.astype(jnp.float32) / temperature
    s = s_logits.astype(jnp.float32) / temperature
    (t_m, t_z), (s_m, s_z) = _shift_and_norm(t), _shift_and_norm(s)
    t_lse, s_lse = t_m + jnp.log(t_z), s_m + jnp.log(s_z)
    kl = jnp.sum(_kl_terms(t - t_lse, s - s_lse, (t - s) - (t_lse - s_lse)), axis=-1)
    return kl, (t_logits, s_logits, t_m, t_z, s_m, s_z)


def _token_kl_bwd(temperature: float, residuals: tuple[Array, ...], ct: Array) -> tuple[None, Array]:
    t_logits, s_logits, t_m, t_z, s_m, s_z = residuals
    p = _softmax(t_logits.astype(jnp.float32) / temperature, t_m, t_z)
    q = _softmax(s_logits.astype(jnp.float32) / temperature, s_m, s_z)
    return None, ((ct[..., None] / temperature) * (q - p)).astype(s_logits.dtype)


_token_kl.defvjp(_token_kl_fwd, _token_kl_bwd)


def _kl_terms(t_logp: Array, s_logp: Array, d: Array) -> Array:
    """The non-negative terms p (d + expm1(-d)) of a KL whose bins' p and q each sum to one, given
    both log-probabilities and d = log p - log q (computed by the caller with the least rounding).

    Where p is exactly 0 (a teacher log-prob of -inf) the term's limit is q, not 0: sum_i q_i = 1
    holds only with those bins' q included. d is replaced there first, because 0 * (d + expm1(-d))
    with d = -inf is NaN in the value and in the gradient (the unselected branch of a `where` must
    stay finite)."""
    t_p = jnp.exp(t_logp)
    d = jnp.where(t_p > 0, d, 0.0)
    return jnp.where(t_p > 0, t_p * (d + jnp.expm1(-d)), jnp.exp(s_logp))


def _kl_result(
    kl_sum: Array, num_tokens: Array, temperature: float, normalizer: float | Array | None
) -> tuple[Array, Metrics]:
    scale = temperature**2
    loss = scale * _normalise(kl_sum, num_tokens, normalizer)
    metrics = {
        "num_tokens": num_tokens,
        "loss_sum": scale * kl_sum,
        "kl": kl_sum / jnp.maximum(num_tokens, 1.0),
    }
    return loss, metrics


def forward_kl(
    teacher_logits: Array,
    student_logits: Array,
    mask: Array,
    temperature: float = 1.0,
    normalizer: float | Array | None = None,
) -> tuple[Array, Metrics]:
    """Forward KL(teacher || student) on full logits ``[..., vocab]``, averaged over masked tokens.

    ``loss = T**2 * sum_{masked} KL_t / normalizer`` (normalizer defaults to the masked-token count).
    """
    teacher_logits = jax.lax.stop_gradient(teacher_logits)
    m = mask.astype(jnp.float32)
    kl = _token_kl(teacher_logits, student_logits, temperature)
    return _kl_result(jnp.sum(kl * m), jnp.sum(m), temperature, normalizer)


def chunked_forward_kl(
    teacher_hidden: Array,
    teacher_head: Array,
    student_hidden: Array,
    student_head: Array,
    mask: Array,
    temperature: float = 1.0,
    normalizer: float | Array | None = None,
    chunk_size: int = 1024,
    mesh: Mesh | None = None,
) -> tuple[Array, Metrics]:
    """``forward_kl`` from hidden states ``[..., d]`` and LM heads ``[d, vocab]``, chunked along the sequence.

    Equal to ``forward_kl(teacher_hidden @ teacher_head, student_hidden @ student_head, ...)`` up to fp32
    summation order; peak memory is O(rows * chunk_size * vocab) logits (``chunk_size`` positions of every
    sequence) instead of O(tokens * vocab).
    """
    teacher_hidden = jax.lax.stop_gradient(teacher_hidden)
    teacher_head = jax.lax.stop_gradient(teacher_head)
    m = mask.astype(jnp.float32)

    def body(heads: tuple[Array, Array], th: Array, sh: Array, mc: Array) -> Array:
        t_head, s_head = heads
        kl = _token_kl(lm_logits(th, t_head), lm_logits(sh, s_head), temperature)
        return jnp.sum(kl * mc)

    kl_sum = chunked_sum(body, (teacher_head, student_head), (teacher_hidden, student_hidden, m), chunk_size,
                         m.ndim, mesh, student_hidden.dtype, wrt_weights=(1,), wrt_tokens=(1,))
    return _kl_result(kl_sum, jnp.sum(m), temperature, normalizer)


# ----------------------------------------------------------------------------------------------------------
# Top-k cached teacher.


def _log1mexp(x: Array) -> Array:
    """log(1 - exp(x)) for x <= 0, stable on both ends (Maechler 2012)."""
    x = jnp.minimum(x, -_TAIL_EPS)
    return jnp.where(x > -0.6931471805599453, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def _token_topk_kl(
    t_topk_logp: Array, t_ids: Array, s_logits: Array, temperature: float
) -> tuple[Array, Array]:
    """Per-token KL over the k teacher ids plus one tail bin; also returns the teacher top-k mass.

    The teacher's top-k log-probs are taken as given (they must have been computed at ``temperature``);
    the student is tempered here. Bins: the k ids, and "everything else" with teacher mass
    ``1 - sum p_topk`` and student mass ``1 - sum q_topk``. Coarse-graining can only lower a KL
    (data-processing inequality), so this is <= the full KL, and equal to it when k == vocab.

    Summed as the non-negative terms of `_kl_terms`, like the full KL. The student's tail is the
    log-sum-exp of its logits outside the k ids, not 1 - sum q_topk: it is then exact to its own
    relative precision instead of to ~1e-7 absolute, which the tail term would carry whole.
    """
    t_logp = t_topk_logp.astype(jnp.float32)
    s = s_logits.astype(jnp.float32) / temperature
    s_lse = jax.nn.logsumexp(s, axis=-1, keepdims=True)
    ids = t_ids.astype(jnp.int32)
    s_logp = jnp.take_along_axis(s, ids, axis=-1) - s_lse
    head = jnp.sum(_kl_terms(t_logp, s_logp, t_logp - s_logp), axis=-1)
    t_mass = jnp.sum(jnp.exp(t_logp), axis=-1)
    if ids.shape[-1] == s.shape[-1]:
        # Every id is in the top-k: no tail bin. Its teacher mass, 1 - t_mass, would be the cached
        # log-probs' rounding (~1e-7 per token, the size of a close student's whole KL).
        return head, t_mass
    in_topk = jnp.put_along_axis(jnp.zeros(s.shape, bool), ids, True, axis=-1, inplace=False)
    s_tail_logp = jax.nn.logsumexp(jnp.where(in_topk, -jnp.inf, s), axis=-1) - s_lse[..., 0]
    t_tail = jnp.clip(1.0 - t_mass, 0.0, 1.0)
    d = _log1mexp(jax.nn.logsumexp(t_logp, axis=-1)) - jnp.maximum(s_tail_logp, jnp.log(_TAIL_EPS))
    # A teacher tail below the clamp counts as that mass with its p log(p / q) taken as 0: the term
    # p d + q - p becomes q - p (the identity sum p = sum q = 1 needs the -p).
    d = jnp.where(t_tail > _TAIL_EPS, d, 0.0)
    tail = jnp.where(t_tail > _TAIL_EPS, t_tail * (d + jnp.expm1(-d)), jnp.exp(s_tail_logp) - t_tail)
    return head + tail, t_mass


def _topk_result(
    kl_sum: Array, mass_sum: Array, num_tokens: Array, temperature: float, normalizer: float | Array | None
) -> tuple[Array, Metrics]:
    loss, metrics = _kl_result(kl_sum, num_tokens, temperature, normalizer)
    metrics["teacher_topk_mass"] = mass_sum / jnp.maximum(num_tokens, 1.0)
    return loss, metrics


def topk_kl(
    teacher_topk_logprobs: Array,
    teacher_topk_ids: Array,
    student_logits: Array,
    mask: Array,
    temperature: float = 1.0,
    normalizer: float | Array | None = None,
) -> tuple[Array, Metrics]:
    """Forward KL against a cached top-k teacher (``[..., k]`` log-probs and int ids) plus a tail bin.

    ``metrics["teacher_topk_mass"]`` is the mean (over masked tokens) teacher probability covered by the
    k ids; when it is far below 1 the cached k is too small for this data.
    """
    teacher_topk_logprobs = jax.lax.stop_gradient(teacher_topk_logprobs)
    m = mask.astype(jnp.float32)
    kl, mass = _token_topk_kl(teacher_topk_logprobs, teacher_topk_ids, student_logits, temperature)
    return _topk_result(jnp.sum(kl * m), jnp.sum(mass * m), jnp.sum(m), temperature, normalizer)


def chunked_topk_kl(
    teacher_topk_logprobs: Array,
    teacher_topk_ids: Array,
    student_hidden: Array,
    student_head: Array,
    mask: Array,
    temperature: float = 1.0,
    normalizer: float | Array | None = None,
    chunk_size: int = 1024,
    mesh: Mesh | None = None,
) -> tuple[Array, Metrics]:
    """``topk_kl`` from student hidden states ``[..., d]`` and head ``[d, vocab]``, chunked along the
    sequence."""
    t_logp = jax.lax.stop_gradient(teacher_topk_logprobs).astype(jnp.float32)
    t_ids = teacher_topk_ids.astype(jnp.int32)
    m = mask.astype(jnp.float32)

    def kl_body(heads: tuple[Array], tl: Array, ti: Array, sh: Array, mc: Array) -> Array:
        kl, _ = _token_topk_kl(tl, ti, lm_logits(sh, heads[0]), temperature)
        return jnp.sum(kl * mc)

    kl_sum = chunked_sum(kl_body, (student_head,), (t_logp, t_ids, student_hidden, m), chunk_size, m.ndim,
                         mesh, student_hidden.dtype, wrt_weights=(0,), wrt_tokens=(2,))
    # The covered mass depends only on the teacher, so it needs no chunking.
    mass_sum = jnp.sum(jnp.sum(jnp.exp(t_logp), axis=-1) * m)
    return _topk_result(kl_sum, mass_sum, jnp.sum(m), temperature, normalizer)


# ----------------------------------------------------------------------------------------------------------
# Cross-entropy (SFT baseline / LM) and hidden-state matching.


def ce_mask(mode: Literal["sft", "lm"], loss_mask: Array, segment_ids: Array) -> Array:
    """Which tokens a cross-entropy counts: ``sft`` = the data's loss mask (assistant tokens only),
    ``lm`` = every non-padding token (``segment_ids > 0``)."""
    if mode == "sft":
        return loss_mask
    if mode == "lm":
        return (segment_ids > 0).astype(loss_mask.dtype)
    raise ValueError(f"mode must be one of 'sft', 'lm'; got {mode!r}")


@jax.custom_vjp
def _token_ce(logits: Array, targets: Array) -> Array:
    """Per-token -log softmax(logits)[target], in fp32. Gradient: softmax - one_hot(target) in one
    pass over the logits (`_token_ce_bwd`; autodiff scattered the target into a zero-filled
    [tokens, vocab] array and made two more passes)."""
    return _token_ce_fwd(logits, targets)[0]


def _token_ce_fwd(logits: Array, targets: Array) -> tuple[Array, tuple[Array, ...]]:
    x = logits.astype(jnp.float32)
    m, z = _shift_and_norm(x)
    target_logit = jnp.take_along_axis(x, targets[..., None].astype(jnp.int32), axis=-1)
    return (m + jnp.log(z) - target_logit)[..., 0], (logits, targets, m, z)


def _token_ce_bwd(residuals: tuple[Array, ...], ct: Array) -> tuple[Array, None]:
    logits, targets, m, z = residuals
    q = _softmax(logits.astype(jnp.float32), m, z)
    is_target = jnp.arange(logits.shape[-1], dtype=jnp.int32) == targets[..., None].astype(jnp.int32)
    return (ct[..., None] * (q - is_target)).astype(logits.dtype), None


_token_ce.defvjp(_token_ce_fwd, _token_ce_bwd)


def _ce_result(ce_sum: Array, num_tokens: Array, normalizer: float | Array | None) -> tuple[Array, Metrics]:
    loss = _normalise(ce_sum, num_tokens, normalizer)
    return loss, {"num_tokens": num_tokens, "loss_sum": ce_sum, "ce": ce_sum / jnp.maximum(num_tokens, 1.0)}


def cross_entropy(
    logits: Array, targets: Array, mask: Array, normalizer: float | Array | None = None
) -> tuple[Array, Metrics]:
    """Next-token cross-entropy on ``[..., vocab]`` logits against int ``targets``, over masked tokens."""
    m = mask.astype(jnp.float32)
    return _ce_result(jnp.sum(_token_ce(logits, targets) * m), jnp.sum(m), normalizer)


def chunked_cross_entropy(
    hidden: Array,
    head: Array,
    targets: Array,
    mask: Array,
    normalizer: float | Array | None = None,
    chunk_size: int = 1024,
    mesh: Mesh | None = None,
) -> tuple[Array, Metrics]:
    """``cross_entropy`` from hidden states ``[..., d]`` and head ``[d, vocab]``, chunked along the
    sequence."""
    tg = targets.astype(jnp.int32)
    m = mask.astype(jnp.float32)

    def body(heads: tuple[Array], h: Array, t: Array, mc: Array) -> Array:
        return jnp.sum(_token_ce(lm_logits(h, heads[0]), t) * mc)

    ce_sum = chunked_sum(body, (head,), (hidden, tg, m), chunk_size, m.ndim, mesh, hidden.dtype,
                         wrt_weights=(0,), wrt_tokens=(0,))
    return _ce_result(ce_sum, jnp.sum(m), normalizer)


def hidden_l2(
    teacher_hidden: Array, student_hidden: Array, mask: Array, normalizer: float | Array | None = None
) -> tuple[Array, Metrics]:
    """Mean squared error between matched hidden states, over masked tokens.

    Shapes ``[..., tokens..., d]`` where ``mask`` has the token shape; extra leading axes (e.g. a stack of
    matched layers ``[L, B, S, d]``) are averaged. Per token the error is the mean over ``d`` (so the scale
    does not grow with width), summed over masked tokens and divided by ``normalizer`` (default: masked
    token count) and by the number of leading layers.
    """
    teacher_hidden = jax.lax.stop_gradient(teacher_hidden)
    m = mask.astype(jnp.float32)
    diff = student_hidden.astype(jnp.float32) - teacher_hidden.astype(jnp.float32)
    per_token = jnp.mean(diff * diff, axis=-1)
    extra = per_token.ndim - m.ndim
    if extra < 0 or per_token.shape[extra:] != m.shape:
        raise ValueError(f"mask shape {m.shape} does not match hidden token shape {per_token.shape}")
    n_layers = 1
    for s in per_token.shape[:extra]:
        n_layers *= s
    l2_sum = jnp.sum(per_token * m) / n_layers
    num_tokens = jnp.sum(m)
    loss = _normalise(l2_sum, num_tokens, normalizer)
    return loss, {
        "num_tokens": num_tokens,
        "loss_sum": l2_sum,
        "hidden_l2": l2_sum / jnp.maximum(num_tokens, 1.0),
    }
