"""FarSkip's overlap, as data dependencies in the compiled HLO (farskip_jax.inspect.deps).

Expert parallelism (training forward, EP=8): in a FarSkip layer k the attention core reads
neither layer k's Dispatch all-to-all nor layer k-1's Combine all-to-all, so XLA may run it
under them; in a regular layer k it reads layer k-1's Combine. Tensor parallelism (prefill,
TP=4): in a FarSkip layer k the attention does not read layer k-1's `tp_psum_routed`.
A deliberately wrong recurrence (attention reads x instead of y) must be flagged.

Finding: with its default passes XLA's CPU all-reduce combiner merges a FarSkip layer's
`tp_psum_attn_shared` and `tp_psum_routed` into one all-reduce, so the next layer's attention
waits for the routed psum after all; the checker sees this (the GPU combiner does the same below
its size threshold, FARSKIP.md section 5). The model-level checks disable that CPU pass.

Graph: the CPU-compiled HLO (`compile().as_text()`); its metadata op_names keep the scope
paths (`layer_2/shard_map/dispatch/all_to_all`, `layer_3/attention/core/...`). The model is
tiny (4 layers: dense, then MoE 1..3; under FarSkip layer 1 is a parallel block).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from par_common import FAST, split, tiny

import farskip_jax.model.transformer as transformer
from farskip_jax.config import MeshConfig
from farskip_jax.inspect.deps import DepGraph, build_graph, scope_regex
from farskip_jax.model.farskip import residual_step
from farskip_jax.parallel import batch_sharding, ep_forward, make_mesh, param_shardings, tp_forward
from farskip_jax.xla.hlo_parse import parse_hlo

B, T = 8, 16
MOE_LAYERS = (1, 2, 3)


def _abstract(state, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def ep_graph(farskip: bool) -> DepGraph:
    mesh = make_mesh(MeshConfig(expert=8))
    graphdef, state = split(tiny(farskip))
    f = ep_forward(graphdef, mesh)
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch_sharding(mesh))
    args = (_abstract(state, param_shardings(state, mesh, "ep")), ids)
    return build_graph(jax.jit(lambda s, i: f(s, i).logits).lower(*args).compile(FAST).as_text())


def tp_graph(farskip: bool, combiner: bool = False) -> DepGraph:
    """TP prefill graph. XLA's CPU all-reduce combiner merges a layer's two FarSkip psums into
    one all-reduce (see `test_tp_all_reduce_combiner_merges_the_psums`); it is off by default here
    so that the graph shows the model's own dependencies."""
    opts = FAST if combiner else dict(FAST, xla_disable_hlo_passes="cpu-all-reduce-combiner")
    mesh = make_mesh(MeshConfig(tensor=4))
    graphdef, state = split(tiny(farskip))
    f = tp_forward(graphdef, state, mesh)
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=jax.sharding.NamedSharding(mesh, jax.P()))
    args = (_abstract(state, param_shardings(state, mesh, "tp")), ids)
    return build_graph(jax.jit(lambda s, i: f(s, i)[0]).lower(*args).compile(opts).as_text())


def attention_reads(g: DepGraph, k: int) -> dict[str, int]:
    """How many of layer k's attention-core ops depend on each EP collective that FarSkip avoids."""
    core = g.select(scope_regex(k, "attention", "core"))
    dispatch = g.select(scope_regex(k, "dispatch"), opcode="all-to-all")
    combine = g.select(scope_regex(k - 1, "combine"), opcode="all-to-all")
    assert core and dispatch, f"scopes of layer {k} not found in the HLO"
    assert combine or k == MOE_LAYERS[0]  # the first MoE layer has no Combine before it
    return {"core": len(core), "dispatch_k": len(g.reachable(dispatch, core)),
            "combine_k-1": len(g.reachable(combine, core)) if combine else 0}


def tp_attention_reads_routed_psum(g: DepGraph, k: int) -> int:
    core = g.select(scope_regex(k, "attention", "core"))
    psum = g.select(scope_regex(k - 1, "tp_psum_routed"), opcode="all-reduce")
    assert core and psum, f"layer {k} attention or layer {k - 1} routed psum not found"
    return len(g.reachable(psum, core))


def _wrong_residual_step(x, y, conn, is_moe, attn, ffn, reduce=None):
    """A FarSkip recurrence with a bug: attention reads the full stream x, not y."""
    return residual_step(x, None, conn, is_moe, attn, ffn, reduce)


@pytest.fixture(scope="module")
def ep_graphs():
    return {fs: ep_graph(fs) for fs in (True, False)}


def test_ep_farskip_attention_independent_of_all_to_alls(ep_graphs):
    g = ep_graphs[True]
    for k in MOE_LAYERS:
        reads = attention_reads(g, k)
        print(f"PARALLEL_DEPS ep farskip layer={k} {reads}")
        assert reads["dispatch_k"] == 0 and reads["combine_k-1"] == 0, (k, reads)


def test_ep_regular_attention_waits_for_previous_combine(ep_graphs):
    g = ep_graphs[False]
    for k in MOE_LAYERS[1:]:
        reads = attention_reads(g, k)
        print(f"PARALLEL_DEPS ep regular layer={k} {reads}")
        assert reads["combine_k-1"] == reads["core"] > 0 and reads["dispatch_k"] == 0, (k, reads)


def test_ep_checker_flags_wrong_wiring(monkeypatch):
    monkeypatch.setattr(transformer, "residual_step", _wrong_residual_step)
    g = ep_graph(True)
    for k in MOE_LAYERS[1:]:
        assert attention_reads(g, k)["combine_k-1"] > 0, k


def test_tp_farskip_attention_independent_of_routed_psum():
    g = tp_graph(True)
    for k in MOE_LAYERS[1:]:
        n = tp_attention_reads_routed_psum(g, k)
        print(f"PARALLEL_DEPS tp farskip layer={k} core ops reading layer {k - 1} tp_psum_routed: {n}")
        assert n == 0


def test_tp_checker_flags_wrong_wiring(monkeypatch):
    monkeypatch.setattr(transformer, "residual_step", _wrong_residual_step)
    g = tp_graph(True)
    for k in MOE_LAYERS[1:]:
        assert tp_attention_reads_routed_psum(g, k) > 0, k


def test_tp_all_reduce_combiner_merges_the_psums():
    """Documents XLA's behaviour: the combined all-reduce re-creates the dependency FarSkip removed.
    If this starts failing, XLA no longer merges small psums on CPU."""
    g = tp_graph(True, combiner=True)
    merged = [n for n in g.select(scope_regex(2, "tp_psum_routed"), opcode="all-reduce")
              if g.select(scope_regex(2, "tp_psum_attn_shared"), opcode="all-reduce") >= {n}]
    print(f"PARALLEL_DEPS tp farskip default CPU passes: layer 2 psums merged into {merged}")
    assert merged and tp_attention_reads_routed_psum(g, 3) > 0


def test_ep_combine_waits_for_the_shared_experts() -> None:
    """The Combine's output buffer allocated from the shared experts' output
    (`model.schedule.scratch_rows`): in every MoE layer of a tiny FarSkip
    model's EP=8 forward (deviceless H200: ragged exchange), the Combine's ragged all-to-all depends
    on the shared experts' output, so they cannot be scheduled under it, while the Dispatch's does
    not (the shared experts are what runs under the Dispatch). The ragged all-to-alls carry no
    op_name; the inspector's analysis names them from their neighbours (`hlo._nameless_role`)."""
    from farskip_jax.inspect import hlo
    from farskip_jax.xla import aot

    pytest.importorskip("jax_plugins.xla_cuda13", reason="jax-cuda13-pjrt not installed")
    mesh = aot.make_target_mesh("h200", {"data": 1, "expert": 8, "tensor": 1})
    graphdef, state = split(tiny(True))
    f = ep_forward(graphdef, mesh)
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch_sharding(mesh))
    args = (_abstract(state, param_shardings(state, mesh, "ep")), ids)
    art = aot.compile_scheduled_hlo(jax.jit(lambda s, i: f(s, i).logits), *args, target="h200")
    g = build_graph(art.hlo_text)
    exchanges = [r for r in hlo.analyze(art.hlo_text, "h200").collectives if r.kind == "ragged-all-to-all"]
    # The shared experts by each instruction's own op_name: a fusion's called computation may be
    # shared with an identical fusion elsewhere (XLA deduplicates them), so its inner names are not
    # necessarily this instruction's.
    entry = parse_hlo(art.hlo_text)
    entry = entry.computations[entry.entry].instrs
    for k in MOE_LAYERS:
        combine = {r.name for r in exchanges if r.layer == k and r.role == "combine"}
        dispatch = {r.name for r in exchanges if r.layer == k and r.role == "dispatch"}
        shared = {i.name for i in entry if re.search(scope_regex(k, "shared"), i.op_name)}
        # its output: the shared ops no other shared op reads (XLA's dot merger may compute the
        # first shared GEMM together with the router's, which the Dispatch does read)
        shared = {n for n in shared if not g.reachable({n}, shared)}
        assert combine and shared, f"layer {k}: combine or shared experts not found"
        assert g.reachable(shared, combine), f"layer {k}: the Combine does not wait for the shared experts"
        assert dispatch and not g.reachable(shared, dispatch), f"layer {k}: the Dispatch waits for them"
