"""Evaluation and the teacher top-k chunk the sequence axis, so under EP=8 each device computes the
LM head for its own rows only: the compiled HLO gathers no activation (hidden or vocab sized)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_count import dims, gathers_touching

from farskip_jax.config import load_config
from farskip_jax.parallel import make_mesh
from farskip_jax.train.chunking import chunked_map
from farskip_jax.train.program import build_program
from farskip_jax.train.step import greedy_ids, make_teacher_topk

# Hidden and vocab sizes that no other dimension of this program has (batch 8, sequence 24, chunk 8,
# 8 experts, tokens 192), so a gather of activations is recognisable by its shape.
D, V, B, T, CHUNK = 40, 136, 8, 24, 8


@pytest.fixture(scope="module")
def program():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (host) devices")
    cfg = load_config("tiny_farskip", {"mesh.expert": 8, "model.hidden_size": D, "model.vocab_size": V,
                                       "train.kl_chunk_tokens": CHUNK})
    return build_program(cfg, make_mesh(cfg.mesh))


def _batch(prog):
    f = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=prog.eval_batch_sharding)
    return dict.fromkeys(("input_ids", "targets", "loss_mask", "segment_ids", "positions"), f)


def test_eval_step_gathers_no_activations(program):
    params = program.abstract_state()["params"]
    hlo = program.eval_step().lower(params, program.abstract_teacher(), _batch(program)).compile().as_text()
    # ZeRO-1 keeps the non-expert weights split between steps; the eval step gathers those whole
    # (a result shaped like a parameter). Anything else hidden- or vocab-sized is an activation.
    param_shapes = {tuple(x.shape) for x in jax.tree.leaves(params)}
    touching = gathers_touching(hlo, {D, V})
    def of_params(gather: str) -> bool:  # every array of the (maybe tuple) result is parameter-shaped
        arrays = re.findall(r"\[[\d,]*\]", gather.split(" = ", 1)[1])
        return all(tuple(dims(a)) in param_shapes for a in arrays)

    found = [g for g in touching if not of_params(g)]
    print(f"eval step: {len(found)} all-gathers of activations (hidden {D} / vocab {V}) "
          f"(flattened-token chunking before: 2); {len(touching) - len(found)} of ZeRO-1-split weights",
          found[:3])
    assert found == []
    assert 0 < len(touching) - len(found) <= len(param_shapes) * 4


def test_teacher_topk_gathers_no_activations(program):
    topk = make_teacher_topk(program.teacher_graph, 4, 1.0, CHUNK, program.parallel, program.mesh)
    teacher = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                           program.teacher_abstract, program.teacher_shardings)
    hlo = topk.lower(teacher, _batch(program)).compile().as_text()
    found = gathers_touching(hlo, {D, V})
    print(f"teacher top-k step: {len(found)} all-gathers of activations (before: 1)", found[:3])
    assert found == []


def test_chunked_map_and_greedy_ids_match_unchunked():
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(3, 13, 8)), jnp.float32)  # 13 positions: a padded last chunk
    w = jnp.asarray(rng.normal(size=(8, 21)), jnp.float32)
    full = jnp.einsum("btd,dv->btv", h, w)
    np.testing.assert_array_equal(np.asarray(greedy_ids(h, w, 4)), np.asarray(jnp.argmax(full, -1)))
    vals, ids = chunked_map(lambda x: jax.lax.top_k(x @ w, 3), (h,), 5, 2)
    ref_v, ref_i = jax.lax.top_k(full, 3)
    assert vals.shape == (3, 13, 3)
    np.testing.assert_allclose(np.asarray(vals), np.asarray(ref_v), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_i))
