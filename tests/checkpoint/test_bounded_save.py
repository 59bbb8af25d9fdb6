"""Bounded checkpoint staging (`CheckpointManager(staging_gb=...)`, `train.checkpoint_staging_gb`).

With a bound, Orbax copies the arrays off the devices in the save's background thread, while the next
steps run and donate the state's buffers. These tests save sharded states over the 8 fake CPU devices
with a bound far below one array (so every array is its own batch, copied after `save()` returned),
run donating steps during the save and compare what was written with the state at its step, bit for
bit. The trainer-level check (a real run, resumed) is in tests/train/test_trainer.py.
"""

from __future__ import annotations

import gc
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax.checkpoint.manager import CheckpointManager, device_copy
from farskip_jax.config import ConfigError, load_config

TINY_BOUND_GB = 2e-5  # 20 KB: below every array's 64 KB, so each is copied and written on its own


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "expert"))


def _state(mesh: jax.sharding.Mesh) -> tuple[dict, dict]:
    """A params dict and an optax-like state: sharded, replicated and scalar leaves."""
    keys = iter(jax.random.split(jax.random.key(0), 32))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    params = {f"layer{i}": {"w": put(jax.random.normal(next(keys), (64, 256)), P("expert", "data")),
                            "b": put(jax.random.normal(next(keys), (16384,)), P())} for i in range(3)}
    moment = lambda: jax.tree.map(  # noqa: E731
        lambda x: put(jax.random.normal(next(keys), x.shape), x.sharding.spec), params)
    opt = {"count": put(jnp.zeros((), jnp.int32), P()), "mu": moment(), "nu": moment()}
    return params, opt


def _update(p: dict, o: dict) -> tuple[dict, dict]:
    """Stands in for the train step: new values for every leaf."""
    o = {"count": o["count"] + 1, "mu": jax.tree.map(lambda m, w: 0.9 * m + w, o["mu"], p),
         "nu": jax.tree.map(lambda v, w: 0.9 * v + w * w, o["nu"], p)}
    return jax.tree.map(lambda w, m: w - 0.01 * m, p, o["mu"]), o


# As in train/step.py: the step reuses (donates) the state's buffers.
_donating_step = jax.jit(_update, donate_argnums=(0, 1))


def _host(tree: dict) -> dict:
    return jax.tree.map(np.array, tree)


def _assert_bitwise(got: dict, want: dict) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
        assert np.asarray(a).dtype == b.dtype


def test_bounded_save_is_the_state_at_its_step_while_donating_steps_run(tmp_path):
    mesh = _mesh()
    params, opt = _state(mesh)
    mngr = CheckpointManager(tmp_path / "ckpt", keep=5, staging_gb=TINY_BOUND_GB)
    want, during = {}, {}
    for step in range(1, 9):
        params, opt = _donating_step(params, opt)
        if step in (2, 5):
            want[step] = (_host(params), _host(opt))
            old = jax.tree.leaves((params, opt))
            mngr.save(step, params, opt, {"step": step})
            params, opt = _donating_step(params, opt)
            # The step really reused the buffers the save was handed; the save is still copying.
            assert all(x.is_deleted() for x in old)
            during[step] = mngr.saving()
    jax.block_until_ready((params, opt))
    mngr.wait()
    assert during == {2: True, 5: True}, "the saves finished before the next step ran: nothing tested"
    like_p, like_o = _state(mesh)
    for step, (wp, wo) in want.items():
        got = mngr.restore(like_p, like_o, step=step)
        assert got is not None and got[0] == step and got[3] == {"step": step}
        _assert_bitwise(got[1], wp)
        _assert_bitwise(got[2], wo)
        assert all(a.sharding == b.sharding
                   for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(like_p), strict=True))
    mngr.close()


def test_without_the_device_copy_the_donated_state_breaks_the_save(tmp_path):
    """Why the manager copies: Orbax's bounded save, handed the live state, fails once a step donates it."""
    mesh = _mesh()
    params, opt = _state(mesh)
    mngr = CheckpointManager(tmp_path / "ckpt", keep=1, staging_gb=TINY_BOUND_GB)
    mngr._mngr.save(1, args=ocp.args.Composite(  # the wrapper's save without its device_copy
        params=ocp.args.PyTreeSave(params), opt_state=ocp.args.PyTreeSave(opt),
        meta=ocp.args.JsonSave({"step": 1})))
    params, opt = _donating_step(params, opt)
    with pytest.raises(Exception, match="deleted"):
        mngr.wait()


def test_the_device_copy_is_fresh_buffers_on_the_same_shardings_and_freed_after_the_save(tmp_path):
    mesh = _mesh()
    params, opt = _state(mesh)
    copy = device_copy((params, opt))
    for a, b in zip(jax.tree.leaves((params, opt)), jax.tree.leaves(copy), strict=True):
        assert a.sharding == b.sharding
        assert {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}.isdisjoint(
            s.data.unsafe_buffer_pointer() for s in b.addressable_shards)
    del copy, a, b
    gc.collect()
    live = sum(x.nbytes for x in jax.live_arrays())
    mngr = CheckpointManager(tmp_path / "ckpt", keep=1, staging_gb=TINY_BOUND_GB)
    mngr.save(1, params, opt, {"step": 1})
    mngr.wait()
    gc.collect()
    # Nothing of the save's device copy is left once it is written.
    assert sum(x.nbytes for x in jax.live_arrays()) == live
    mngr.close()


def test_unbounded_and_bounded_checkpoints_are_the_same_files_and_read_by_either(tmp_path):
    """A checkpoint saved before the bound existed (StandardSave) resumes; the two modes write the
    same item layout, and the HF converter's reader (`StandardCheckpointer`) reads a bounded one."""
    mesh = _mesh()
    params, opt = _state(mesh)
    old = ocp.CheckpointManager(tmp_path / "old", item_names=("params", "opt_state", "meta"))
    old.save(3, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                        opt_state=ocp.args.StandardSave(opt),
                                        meta=ocp.args.JsonSave({"step": 3})))
    old.wait_until_finished()
    old.close()
    for staging in (None, TINY_BOUND_GB):
        got = CheckpointManager(tmp_path / "old", keep=1, staging_gb=staging).restore(params, opt)
        assert got is not None and got[0] == 3
        _assert_bitwise(got[1], _host(params))
        _assert_bitwise(got[2], _host(opt))
    files, metadata = {}, {}
    for staging in (None, TINY_BOUND_GB):
        d = tmp_path / f"new_{staging}"
        mngr = CheckpointManager(d, keep=1, staging_gb=staging)
        mngr.save(4, params, opt, {"step": 4})
        mngr.close()
        # The data files (d/) are named by content hash; the bounded save writes one per batch.
        files[staging] = sorted(p.relative_to(d).as_posix() for p in d.rglob("*")
                                if "/d/" not in p.as_posix())
        metadata[staging] = [json.loads((d / "4" / item / "_METADATA").read_text())
                             for item in ("params", "opt_state")]
        _assert_bitwise(ocp.StandardCheckpointer().restore(d / "4" / "params"), _host(params))
    assert files[None] == files[TINY_BOUND_GB]
    assert metadata[None] == metadata[TINY_BOUND_GB]


def test_staging_bound_config_is_validated():
    assert load_config("tiny", {"train.checkpoint_staging_gb": None}).train.checkpoint_staging_gb is None
    assert load_config("tiny", {"train.checkpoint_staging_gb": 2}).train.checkpoint_staging_gb == 2.0
    with pytest.raises(ConfigError, match="checkpoint_staging_gb"):
        load_config("tiny", {"train.checkpoint_staging_gb": 0})


def test_each_finished_save_hands_freed_host_memory_back(tmp_path, monkeypatch):
    """The writer threads' freed buffers stay in glibc's arenas unless trimmed (BENCHMARKS 5): the
    manager trims once per save, after the items are written, async or not."""
    from farskip_jax.checkpoint import manager

    if manager._MALLOC_TRIM is None:
        pytest.skip("no glibc malloc_trim here")
    calls: list[int] = []
    monkeypatch.setattr(manager, "_MALLOC_TRIM", lambda pad: calls.append(pad) or 1)
    params, opt = _state(_mesh())
    for async_save, staging in ((True, TINY_BOUND_GB), (True, None), (False, None)):
        calls.clear()
        mngr = CheckpointManager(tmp_path / f"ckpt_{async_save}_{staging}", keep=2, async_save=async_save,
                                 staging_gb=staging)
        mngr.save(1, params, opt, {"step": 1})
        mngr.save(2, params, opt, {"step": 2})
        mngr.wait()
        assert calls == [0, 0]
        mngr.close()


def test_a_bounded_save_prints_no_orbax_warning(tmp_path, caplog):
    """Every array's copy is made in the background by design; Orbax's warning about it is dropped
    (it was printed twice per checkpoint in `make demo`), and nothing else it logs is."""
    mesh = _mesh()
    params, opt = _state(mesh)
    mngr = CheckpointManager(tmp_path / "ckpt", keep=1, staging_gb=TINY_BOUND_GB)
    with caplog.at_level(logging.INFO, logger="absl"):
        mngr.save(1, params, opt, {"step": 1})
        mngr.wait()
        logging.getLogger("absl").warning("another warning")
    mngr.close()
    messages = [r.getMessage() for r in caplog.records]
    assert "another warning" in messages  # the records of that logger do reach caplog
    assert not any("No prioritized params" in m for m in messages)
