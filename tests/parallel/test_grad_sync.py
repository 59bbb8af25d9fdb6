"""`parallel.grad_sync.per_batch_shard` on 8 host devices (mesh data=2 x expert=4): the chunked
losses and the embedding computed per batch shard give the one-device values and gradients, and
the weights' gradient crosses the devices once, in the dtype asked for, not once per chunk."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax.parallel.grad_sync import batch_mesh, per_batch_shard
from farskip_jax.parallel.mesh import BATCH_AXES
from farskip_jax.train import losses

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")
B, T, D, V, CHUNK = 8, 24, 16, 40, 8  # 3 chunks per sequence


def _mesh() -> jax.sharding.Mesh:
    devices = np.asarray(jax.devices()[:8], dtype=object).reshape(2, 4, 1)
    return jax.sharding.Mesh(devices, ("data", "expert", "tensor"))


def _inputs(dtype=jnp.float32) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(0), 6)
    return {"t_hidden": jax.random.normal(keys[0], (B, T, D), dtype),
            "s_hidden": jax.random.normal(keys[1], (B, T, D), dtype),
            "t_head": 0.3 * jax.random.normal(keys[2], (D, V), jnp.float32),
            "s_head": 0.3 * jax.random.normal(keys[3], (D, V), jnp.float32),
            "mask": (jax.random.uniform(keys[4], (B, T)) > 0.2).astype(jnp.float32),
            "targets": jax.random.randint(keys[5], (B, T), 0, V)}


def _kl(x: dict, mesh) -> jax.Array:
    loss, _ = losses.chunked_forward_kl(x["t_hidden"], x["t_head"], x["s_hidden"], x["s_head"], x["mask"],
                                        2.0, 100.0, CHUNK, mesh)
    return loss


def _ce(x: dict, mesh) -> jax.Array:
    loss, _ = losses.chunked_cross_entropy(x["s_hidden"], x["s_head"], x["targets"], x["mask"], 100.0, CHUNK,
                                           mesh)
    return loss


def _topk(x: dict, mesh) -> jax.Array:
    t_logp, t_ids = jax.lax.top_k(jax.nn.log_softmax(x["t_hidden"] @ x["t_head"]), 4)
    loss, _ = losses.chunked_topk_kl(t_logp, t_ids, x["s_hidden"], x["s_head"], x["mask"], 2.0, 100.0, CHUNK,
                                     mesh)
    return loss


def _place(x: dict, mesh) -> dict:
    tokens, whole = NamedSharding(mesh, P(BATCH_AXES)), NamedSharding(mesh, P())
    return {k: jax.device_put(v, whole if k.endswith("head") else tokens) for k, v in x.items()}


@pytest.mark.parametrize("loss_fn", [_kl, _ce, _topk], ids=["forward_kl", "cross_entropy", "topk_kl"])
def test_chunked_losses_per_batch_shard_equal_one_device(loss_fn) -> None:
    """Value and gradients (LM head and hidden states) of each chunked loss on the 8-device mesh
    against the same loss without a mesh, fp32."""
    mesh, x = _mesh(), _inputs()
    wrt = ("s_head", "s_hidden")
    grad = jax.value_and_grad(lambda w, x, mesh: loss_fn({**x, **w}, mesh))
    run = lambda x, mesh: grad({k: x[k] for k in wrt}, x, mesh)  # noqa: E731
    ref_loss, ref_g = jax.jit(lambda x: run(x, None))(x)
    loss, g = jax.jit(lambda x: run(x, mesh))(_place(x, mesh))
    assert float(ref_loss) > 0
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for k in wrt:
        assert float(jnp.max(jnp.abs(ref_g[k]))) > 0, k
        np.testing.assert_allclose(np.asarray(g[k]), np.asarray(ref_g[k]), rtol=1e-5, atol=1e-6, err_msg=k)


def test_embedding_lookup_per_batch_shard_equals_one_device() -> None:
    """The model's lookup (`jnp.take` of the fp32 table, cast to the compute dtype) per batch shard:
    the same activations, and the table's gradient equals the one-device scatter-add."""
    mesh = _mesh()
    table = jax.random.normal(jax.random.key(1), (V, D), jnp.float32)
    ids = jax.random.randint(jax.random.key(2), (B, T), 0, V)
    cot = jax.random.normal(jax.random.key(3), (B, T, D), jnp.float32)

    def f(table, ids, mesh):
        x = per_batch_shard(lambda w, t: jnp.take(w[0], t[0], axis=0), mesh, (table,), (ids,),
                            sum_outputs=False, grad_dtype=jnp.float32)
        return jnp.sum(x * cot), x

    ref = jax.jit(lambda t, i: jax.value_and_grad(f, has_aux=True)(t, i, None))(table, ids)
    placed = (jax.device_put(table, NamedSharding(mesh, P())),
              jax.device_put(ids, NamedSharding(mesh, P(BATCH_AXES))))
    out = jax.jit(lambda t, i: jax.value_and_grad(f, has_aux=True)(t, i, mesh))(*placed)
    (_, x_ref), g_ref = ref
    (_, x), g = out
    np.testing.assert_array_equal(np.asarray(x), np.asarray(x_ref))
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-6, atol=1e-6)


def _reductions_by_computation(hlo: str, shape: str) -> list[tuple[str, str, bool]]:
    """(result type, computation, whether that computation is a while loop's body) of every
    all-reduce / reduce-scatter whose result has `shape` (e.g. "[16,40]")."""
    bodies = set(re.findall(r"\bbody=(%[\w.-]+)", hlo))
    op = re.compile(r"=\s*(\S+)\s+(?:all-reduce|reduce-scatter)(?:-start)?\(")
    out, comp = [], None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?(%[\w.-]+)\s.*\{\s*$", line)
        if head:
            comp = head.group(1)
            continue
        m = op.search(line)
        if m and shape in m.group(1):
            out.append((m.group(1), comp, comp in bodies))
    return out


def test_head_gradient_crosses_devices_once_not_per_chunk() -> None:
    """The compiled gradient of a chunked loss (3 chunks) with respect to its head: per batch shard,
    one cross-device sum after the chunk loop; under jit's own partitioning (no mesh) the sum sits
    in the loop body, once per chunk, where each chunk's dot is (the behaviour this replaces, checked
    so that the test notices if XLA stops doing it). Which dtype the sum travels in is checked on
    the H200 target (tests/inspect/test_model_overlap.py): XLA:CPU widens bf16 all-reduces to fp32."""
    mesh, x = _mesh(), _inputs(jnp.bfloat16)
    placed = _place(x, mesh)

    def compiled(mesh) -> str:
        grad = jax.grad(lambda head, x: _ce({**x, "s_head": head}, mesh))
        return jax.jit(grad).lower(placed["s_head"], placed).compile().as_text()

    # XLA:CPU writes a reduce-scatter as an all-reduce and a per-device slice; the GSPMD one is
    # laid out transposed.
    gspmd = _reductions_by_computation(compiled(None), f"[{V},{D}]")
    local = _reductions_by_computation(compiled(mesh), f"[{D},{V}]")
    assert len(gspmd) == 1 and gspmd[0][2], gspmd
    assert len(local) == 1 and not local[0][2], local


def test_batch_mesh_is_none_without_a_batch_split() -> None:
    class _EP:  # an expert-parallel object holds its mesh
        def __init__(self, mesh):
            self.mesh = mesh

    one = jax.sharding.Mesh(np.asarray(jax.devices()[:1], dtype=object).reshape(1, 1, 1),
                            ("data", "expert", "tensor"))
    assert batch_mesh(None) is None
    assert batch_mesh(_EP(one)) is None
    assert batch_mesh(_EP(_mesh())) is not None
    assert batch_mesh(object()) is None  # a tensor-parallel object: the batch is replicated
