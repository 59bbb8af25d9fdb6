"""`layer_loop="scan"` (consecutive equal layers under one lax.scan) equals the unrolled model.

tiny: layer 0 dense, layers 1..3 MoE -> scan groups [0], [1, 2, 3]; with FarSkip from layer 2
on, [0], [1], [2, 3]: a FarSkip scan entered after a regular layer (y := x inside the carry).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from par_common import max_abs_err, record, run_fast, split, tiny

from farskip_jax.model.transformer import _layer_groups, with_farskip

TOL = 1e-5


@pytest.fixture(scope="module")
def ids():
    return jax.random.randint(jax.random.key(5), (2, 16), 0, 128)


@pytest.mark.parametrize("variant", ["regular", "farskip", "farskip_from_2"])
def test_scan_equals_unrolled(ids, variant):
    cfg = tiny(variant != "regular")
    if variant == "farskip_from_2":
        cfg = with_farskip(cfg, enabled=True, start_idx=2)
    model = nnx.merge(*split(cfg))
    expected_groups = {"regular": [[0], [1, 2, 3]], "farskip": [[0], [1, 2, 3]],
                       "farskip_from_2": [[0], [1], [2, 3]]}[variant]
    assert _layer_groups(cfg, model.connectivity()) == expected_groups
    graphdef, state = nnx.split(model, nnx.Param)

    def both(s, ids):
        m = nnx.merge(graphdef, s)
        a, b = m(ids), m(ids, layer_loop="scan")
        return a.logits, b.logits, a.layer_outputs, b.layer_outputs, a.aux, b.aux

    jaxpr = jax.make_jaxpr(lambda s, i: nnx.merge(graphdef, s)(i, layer_loop="scan").logits)(state, ids)
    assert "scan" in str(jaxpr)
    la, lb, xa, xb, aux_a, aux_b = run_fast(both, state, ids)
    err = max_abs_err(la, lb)
    record("layer_loop", variant, "logits_scan_vs_unrolled", err)
    assert err <= TOL
    assert len(xa) == len(xb) == cfg.num_layers and max_abs_err(xa, xb) <= TOL
    assert set(aux_a) == set(aux_b) and max_abs_err(aux_a, aux_b) <= 1e-6
    assert float(jnp.max(jnp.abs(la))) > 0
