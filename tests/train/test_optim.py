"""The optimiser: the clip rule is optax's, and the update the train step runs (under the non-finite
guard's lax.cond, state donated) needs no full-size temporary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from farskip_jax.config import TrainConfig
from farskip_jax.train.optim import clip_by_global_norm, decay_mask, lr_schedule, make_optimizer


def _tree(scale: float) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {"stack": jnp.asarray(rng.normal(size=(8, 32, 48)) * scale, jnp.float32),
            "norm": jnp.asarray(rng.normal(size=(48,)) * scale, jnp.float32)}


@pytest.mark.parametrize("scale", [1e-3, 10.0], ids=["under the max", "over the max"])
@pytest.mark.parametrize("given", [False, True], ids=["norm computed", "norm given"])
def test_clip_is_optax_rule(scale: float, given: bool):
    grads = _tree(scale)
    ref, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    extra = {"global_norm": optax.tree.norm(grads)} if given else {}
    ours, state = clip_by_global_norm(1.0).update(grads, optax.EmptyState(), None, **extra)
    assert state == optax.EmptyState()
    for k in grads:
        np.testing.assert_allclose(ours[k], ref[k], rtol=2e-7, atol=0)
    if scale > 1:
        assert float(optax.tree.norm(ours)) == pytest.approx(1.0, rel=1e-6)


def test_state_layout_is_optax_chain():
    """Checkpoints written with optax.clip_by_global_norm in the chain restore into this one."""
    params = _tree(1.0)
    tc = TrainConfig()
    ref = optax.chain(optax.clip_by_global_norm(tc.grad_clip_norm),
                      optax.adamw(lr_schedule(tc), b1=tc.adam_b1, b2=tc.adam_b2, eps=1e-8,
                                  weight_decay=tc.weight_decay, mask=decay_mask(params)))
    ours = make_optimizer(tc, params)
    assert jax.tree.structure(ours.init(params)) == jax.tree.structure(ref.init(params))


def test_guarded_update_has_no_full_size_temporary():
    """The train step's update: norm outside, the update under a lax.cond on donated params and
    moments. Every buffer of it can be updated in place; optax's own clip made XLA keep a clipped
    copy of each gradient (3 x the largest leaf here)."""
    params = {"a": jnp.zeros((16, 64, 256)), "b": jnp.zeros((16, 256, 64)), "c": jnp.zeros((256,))}
    grads = jax.tree.map(jnp.ones_like, params)
    tx = make_optimizer(TrainConfig(), params)

    def update(p, opt_state, g):
        gnorm = optax.tree.norm(g)

        def apply(p, o):
            u, o = tx.update(g, o, p, global_norm=gnorm)
            return optax.apply_updates(p, u), o

        return jax.lax.cond(jnp.isfinite(gnorm), apply, lambda p, o: (p, o), p, opt_state)

    compiled = jax.jit(update, donate_argnums=(0, 1)).lower(params, tx.init(params), grads).compile()
    largest = max(x.nbytes for x in jax.tree.leaves(params))
    assert compiled.memory_analysis().temp_size_in_bytes < largest / 4
