"""`execution.batch_split`: whole-sequence chunks through every layer equal the unsplit model (fp32).

Model: tiny with 3 layers (dense, first MoE = a parallel block under FarSkip, MoE with two
streams). Checks logits, the aux values (dropped fraction, sequence-wise balance losses: exact for
equal chunks of whole sequences) and the gradients of mean(logits * W) + balance losses, on one
device (both stagger variants, dropless and with a capacity), on EP=8 host devices (both
variants, and remat=save_a2a) and on DP=2 x EP=4; that splitting and joining the batch moves no
data between devices; and the config / batch-size errors.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from par_common import count_ops, ids_and_weights, max_abs_err, run_fast, split, tiny, tiny_exe  # noqa: E402

from farskip_jax.config import ConfigError, MeshConfig  # noqa: E402
from farskip_jax.model.transformer import _join_batch, _split_batch  # noqa: E402
from farskip_jax.parallel import ExpertParallel, batch_sharding, make_mesh, place  # noqa: E402

TOL = 1e-6
B, T = 16, 8  # EP=8: 2 sequences per device, one per chunk


def _cfg(farskip: bool):
    return tiny(farskip, num_layers=3)


def _exe(**overrides):
    """configs/tiny.yaml's execution (dropless) with `overrides`."""
    return tiny_exe(**{"capacity_factor": 0.0, **overrides})


@pytest.fixture(scope="module")
def data():
    return ids_and_weights(_cfg(False), B, T)


def _run(cfg, exe, state, ids, w, mesh=None):
    """(logits, aux, grads) of mean(logits * w) + balance losses of `cfg` run as `exe`; EP over `mesh`
    when given."""
    graphdef, _ = split(cfg, exe=exe)
    par = None
    if mesh is not None:
        par, state = ExpertParallel(mesh), place(state, mesh, "ep")
        ids = jax.device_put(ids, batch_sharding(mesh))

    def loss(s, ids, w):
        out = nnx.merge(graphdef, s)(ids, parallel=par)
        return jnp.mean(out.logits * w) + out.aux["expert_balance_loss"], (out.logits, out.aux)

    (_, (logits, aux)), grads = run_fast(jax.value_and_grad(loss, has_aux=True), state, ids, w)
    return logits, aux, grads


CASES = {"one_device": {}, "one_device_stagger": {"batch_split_stagger": True},
         "one_device_capacity": {"capacity_factor": 1.0}, "ep8": {},
         "ep8_stagger": {"batch_split_stagger": True}, "ep8_remat": {"remat": "save_a2a"},
         "dp2xep4": {}}
MESHES = {"ep8": MeshConfig(expert=8), "dp2xep4": MeshConfig(data=2, expert=4)}


# The default suite runs EP=8 with FarSkip's staggered split (the split is an option since the
# config runs one stream, BENCHMARKS.md K18); the rest is `slow` (CI time budget: the one-device
# layout is the EP=8 case without the exchange, plain EP=8 is the staggered case without the
# stagger, FarSkip on one device is the EP=8 staggered case on one device, capacity is not the
# production path (dropless), regular connectivity's EP=8 path has its own default test in
# tests/parallel/test_exactness.py, and so do save_a2a remat and the data x expert mesh, there and
# in tests/test_cli_logits.py).
DEFAULT_SUITE = {(True, "ep8_stagger")}


@pytest.mark.parametrize("farskip, case", [
    pytest.param(f, c, id=f"{'farskip' if f else 'regular'}-{c}",
                 marks=[] if (f, c) in DEFAULT_SUITE else [pytest.mark.slow])
    for c in CASES for f in (False, True)])
def test_batch_split_equals_unsplit(data, case, farskip):
    ids, w = data
    cfg, base = _cfg(farskip), _exe(**CASES[case])
    _, state = split(cfg, exe=base)
    mesh = make_mesh(MESHES[case.split("_")[0]]) if not case.startswith("one_device") else None
    ref = _run(cfg, base, state, ids, w, mesh)
    got = _run(cfg, dataclasses.replace(base, batch_split=2), state, ids, w, mesh)
    errs = [max_abs_err(a, b) for a, b in zip(got, ref, strict=True)]
    print(f"BATCH_SPLIT case={case} {'farskip' if farskip else 'regular'} logits={errs[0]:.3e} "
          f"aux={errs[1]:.3e} grads={errs[2]:.3e}")
    assert set(got[1]) == set(ref[1])
    assert max(errs) <= TOL
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref[2])) > 1e-4
    if case == "one_device_capacity":
        assert float(ref[1]["dropped_fraction"]) > 0  # the capacity really drops something


def test_split_moves_no_data_between_devices():
    """Each device's sequences are split and joined in place: no collective at all."""
    mesh = make_mesh(MeshConfig(expert=8))
    x = jax.device_put(jnp.arange(B * T * 3, dtype=jnp.float32).reshape(B, T, 3), batch_sharding(mesh))

    def roundtrip(x):
        chunks = _split_batch(x, 2, 8)
        return _join_batch([c * (i + 1) for i, c in enumerate(chunks)], 8), chunks

    hlo = jax.jit(roundtrip).lower(x).compile().as_text()
    assert not [op for op in ("all-gather", "collective-permute", "all-to-all", "all-reduce")
                if count_ops(hlo, op)], hlo
    joined, chunks = jax.jit(roundtrip)(x)
    # chunk c holds sequence c of each device's pair; chunk 1 was doubled
    assert jnp.array_equal(chunks[0], x[0::2]) and jnp.array_equal(chunks[1], x[1::2])
    assert jnp.array_equal(joined, x * jnp.array([1.0, 2.0] * (B // 2))[:, None, None])


def test_batch_not_divisible(data):
    ids, _ = data
    model = nnx.merge(*split(_cfg(False), exe=_exe(batch_split=3)))
    with pytest.raises(ValueError, match="batch_split=3 does not divide the 16 sequences per device"):
        model(ids)
    model = nnx.merge(*split(_cfg(False), exe=_exe(batch_split=4)))
    with pytest.raises(ValueError, match="batch_split=4 does not divide the 2 sequences per device"):
        jax.eval_shape(lambda i: model(i, parallel=ExpertParallel(make_mesh(MeshConfig(expert=8)))), ids)


@pytest.mark.parametrize("overrides, message", [
    ({"batch_split": 0}, "execution.batch_split must be > 0"),
    ({"batch_split": 2, "layer_loop": "scan"}, "batch_split=2 needs execution.layer_loop=unrolled"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(_exe(), **overrides).validate()
