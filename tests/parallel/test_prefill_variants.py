"""Tensor-parallel prefill variants (execution.tp_microbatches, execution.tp_reduce,
execution.tp_order_barriers) and the experimental model.farskip.stale_blocks=2 under every parallel
layout.

The TP variants change only how the sums are formed and scheduled, so their logits must equal the
plain TP forward's (one chunk, psum, barriers on) to <= 1e-6 and the single-device model's to
<= 1e-5 (fp32, dropless, TP=8). The compiled CPU programs must contain the collectives each
variant is made of, and the dependencies that let XLA overlap them. Model: tiny with 8 heads and
16 routed experts (TP=8 splits both evenly), 4 layers: dense, then MoE 1..3 (under FarSkip layer
1 is a parallel block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from par_common import FAST, count_ops, max_abs_err, record, run_fast, split, tiny, tiny_exe

from farskip_jax.config import ConfigError, ExecutionConfig, MeshConfig, ModelConfig, override
from farskip_jax.inspect.deps import build_graph, scope_regex
from farskip_jax.parallel import ExpertParallel, batch_sharding, make_mesh, param_shardings, place, tp_forward

B, T = 2, 16
PLAIN_TOL = 1e-6  # against the plain TP forward
SINGLE_TOL = 1e-5  # against the single-device model
CONNECTIVITY = {"regular": {}, "farskip": {"farskip.enabled": True},
                "stale2": {"farskip.enabled": True, "farskip.stale_blocks": 2}}
VARIANTS = {
    "microbatches_2": {"tp_microbatches": 2},
    "microbatches_4": {"tp_microbatches": 4},
    "reduce_scatter": {"tp_reduce": "reduce_scatter"},
    "microbatches_2_reduce_scatter": {"tp_microbatches": 2, "tp_reduce": "reduce_scatter"},
    "no_order_barriers": {"tp_order_barriers": False},
}
NO_CPU_COMBINER = dict(FAST, xla_disable_hlo_passes="cpu-all-reduce-combiner")


Run = tuple[ModelConfig, ExecutionConfig]


def _cfg(connectivity: str, **variant) -> Run:
    """(the model of `connectivity`, configs/tiny.yaml's execution (dropless) with the `variant`)."""
    cfg = override(tiny(False, num_layers=4, num_heads=8, n_routed_experts=16), CONNECTIVITY[connectivity],
                   "model")
    return cfg, tiny_exe(capacity_factor=0.0, **variant)


def _split(run: Run):
    return split(run[0], exe=run[1])


@pytest.fixture(scope="module")
def ids():
    return jax.random.randint(jax.random.key(1), (B, T), 0, _cfg("regular")[0].vocab_size)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(tensor=8))


def _tp_logits(run: Run, state, mesh, ids):
    graphdef, _ = _split(run)
    fwd = tp_forward(graphdef, state, mesh)
    return run_fast(lambda s, i: fwd(s, i)[0], place(state, mesh, "tp"), ids)


@pytest.fixture(scope="module", params=list(CONNECTIVITY))
def reference(request, mesh, ids):
    """(connectivity, parameters, single-device logits, plain TP logits); parameters are shared."""
    run = _cfg(request.param)
    graphdef, state = _split(run)
    single = run_fast(lambda s, i: nnx.merge(graphdef, s)(i).logits, state, ids)
    return request.param, state, single, _tp_logits(run, state, mesh, ids)


def test_plain_tp_equals_single_device(reference):
    connectivity, _, single, plain = reference
    err = max_abs_err(plain, single)
    record("prefill_variants", connectivity, "plain_tp_vs_single", err)
    assert err <= SINGLE_TOL
    assert float(jnp.max(jnp.abs(single))) > 0.1  # logits of order one: the bar means something


# Four micro-batches and micro-batches with reduce-scatter are `slow` (CI time budget): each of their
# two ingredients has its own default case. So are stale2's micro-batches: the split is checked with
# both other connectivities, and stale2 itself in its plain TP case.
SLOW_VARIANTS = {"microbatches_4", "microbatches_2_reduce_scatter"}
SLOW_CASES = {"stale2-microbatches_2"}


@pytest.mark.parametrize("variant", [pytest.param(v, marks=[pytest.mark.slow] if v in SLOW_VARIANTS else [])
                                     for v in VARIANTS])
def test_variant_equals_plain_tp(reference, variant, mesh, ids):
    connectivity, state, single, plain = reference
    logits = _tp_logits(_cfg(connectivity, **VARIANTS[variant]), state, mesh, ids)
    err_plain, err_single = max_abs_err(logits, plain), max_abs_err(logits, single)
    record("prefill_variants", f"{connectivity}/{variant}", "vs_plain_tp", err_plain)
    record("prefill_variants", f"{connectivity}/{variant}", "vs_single", err_single)
    assert err_plain <= PLAIN_TOL and err_single <= SINGLE_TOL


def test_stale2_differs_from_farskip(mesh, ids):
    """The experimental model is another model: same parameters, logits moved by > 1e-2."""
    graphdef, state = _split(_cfg("farskip"))
    farskip = run_fast(lambda s, i: nnx.merge(graphdef, s)(i).logits, state, ids)
    stale2 = _tp_logits(_cfg("stale2"), state, mesh, ids)
    assert max_abs_err(stale2, farskip) > 1e-2


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(expert=8), MeshConfig(data=2, expert=4)],
                         ids=["ep8", "dp2xep4"])
def test_stale2_expert_parallel_equals_single_device(mesh_cfg):
    """stale_blocks=2 in the training layout: the same recurrence, R from the all-to-alls."""
    run = _cfg("stale2")
    graphdef, state = _split(run)
    ids = jax.random.randint(jax.random.key(2), (8, T), 0, run[0].vocab_size)  # one sequence per device
    single = run_fast(lambda s, i: nnx.merge(graphdef, s)(i).logits, state, ids)
    ep_mesh = make_mesh(mesh_cfg)
    par = ExpertParallel(ep_mesh)

    def forward(s, i):
        return nnx.merge(graphdef, s)(i, parallel=par).logits

    logits = run_fast(forward, place(state, ep_mesh, "ep"), jax.device_put(ids, batch_sharding(ep_mesh)))
    err = max_abs_err(logits, single)
    record("prefill_variants", "stale2/ep", "vs_single", err)
    assert err <= SINGLE_TOL


def test_stale2_scan_equals_unrolled(ids):
    """The scan carry holds the Ladder (w = v = x for a parallel block)."""
    graphdef, state = _split(_cfg("stale2"))
    unrolled = run_fast(lambda s, i: nnx.merge(graphdef, s)(i).logits, state, ids)
    scan = run_fast(lambda s, i: nnx.merge(graphdef, s)(i, layer_loop="scan").logits, state, ids)
    assert max_abs_err(scan, unrolled) <= PLAIN_TOL


# --------------------------------------------------------------------------------------------
# What the compiled programs are made of


def _hlo(run: Run, mesh, options=NO_CPU_COMBINER) -> str:
    graphdef, state = _split(run)
    fwd = tp_forward(graphdef, state, mesh)
    args = (jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                         param_shardings(state, mesh, "tp")),
            jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=jax.sharding.NamedSharding(mesh, jax.P())))
    return jax.jit(lambda s, i: fwd(s, i)[0]).lower(*args).compile(options).as_text()


def test_collectives_of_each_variant(mesh):
    """FarSkip: per layer one psum (the dense parallel block) or two (MoE layers): 1 + 2 * 3 = 7.
    Two chunks double them; reduce_scatter turns each into a reduce-scatter and an all-gather."""
    plain = _hlo(_cfg("farskip"), mesh)
    chunks = _hlo(_cfg("farskip", tp_microbatches=2), mesh)
    no_combiners = "cpu-all-reduce-combiner,reduce-scatter-combiner,all-gather-combiner"
    scatter = _hlo(_cfg("farskip", tp_reduce="reduce_scatter"), mesh,
                   dict(NO_CPU_COMBINER, xla_disable_hlo_passes=no_combiners))
    counts = {name: {op: count_ops(text, op) for op in ("all-reduce", "reduce-scatter", "all-gather")}
              for name, text in (("plain", plain), ("chunks", chunks), ("scatter", scatter))}
    print(f"PREFILL_VARIANTS collectives {counts}")
    assert counts["plain"] == {"all-reduce": 7, "reduce-scatter": 0, "all-gather": 0}
    assert counts["chunks"] == {"all-reduce": 14, "reduce-scatter": 0, "all-gather": 0}
    assert counts["scatter"]["all-reduce"] == 0
    assert counts["scatter"]["reduce-scatter"] == counts["scatter"]["all-gather"] == 7


def _reads(g, producer: str, consumer: str) -> int:
    """How many `consumer` ops depend on the all-reduces of `producer` (scope regexes)."""
    src = g.select(producer, opcode="all-reduce")
    dst = g.select(consumer)
    assert src and dst, (producer, consumer)
    return len(g.reachable(src, dst))


def test_chunks_wait_only_for_their_own_psums(mesh):
    """Two FarSkip chunks: layer k's chunk-0 experts do not read chunk 1's layer k-1 routed psum
    (it may run under them), and layer k's attention reads no routed psum of layer k-1."""
    g = build_graph(_hlo(_cfg("farskip", tp_microbatches=2), mesh))
    for k in (2, 3):
        experts = scope_regex(k, "chunk_0", "experts")
        other = _reads(g, scope_regex(k - 1, "chunk_1", "tp_psum_routed"), experts)
        own = _reads(g, scope_regex(k - 1, "chunk_0", "tp_psum_routed"), experts)
        core = _reads(g, scope_regex(k - 1, "tp_psum_routed"), scope_regex(k, "attention", "core"))
        print(f"PREFILL_VARIANTS chunks layer={k} chunk-0 experts reading chunk-1 psum {other}, own {own}; "
              f"attention core reading routed psums {core}")
        assert other == 0 and core == 0
        assert own > 0  # the check can see a dependency where there is one


def test_stale2_psums_have_two_sub_blocks(mesh):
    """stale_blocks=2 under TP: layer k's attention reads neither psum of layer k-1, and layer k's
    experts do not read layer k-1's FFN psum (they do read its attention psum)."""
    g = build_graph(_hlo(_cfg("stale2"), mesh))
    for k in (2, 3):
        attn_reads = {p: _reads(g, scope_regex(k - 1, p), scope_regex(k, "attention", "core"))
                      for p in ("tp_psum_attn", "tp_psum_ffn")}
        experts_ffn = _reads(g, scope_regex(k - 1, "tp_psum_ffn"), scope_regex(k, "experts"))
        experts_attn = _reads(g, scope_regex(k - 1, "tp_psum_attn"), scope_regex(k, "experts"))
        print(f"PREFILL_VARIANTS stale2 layer={k} attention core reads {attn_reads}; experts read ffn psum "
              f"{experts_ffn}, attn psum {experts_attn}")
        assert attn_reads == {"tp_psum_attn": 0, "tp_psum_ffn": 0}
        assert experts_ffn == 0 and experts_attn > 0


# --------------------------------------------------------------------------------------------
# Config validation


@pytest.mark.parametrize("section, overrides, message", [
    ("execution", {"tp_microbatches": 2, "capacity_factor": 1.25}, "dropless"),
    ("execution", {"tp_microbatches": 2, "layer_loop": "scan"}, "unrolled"),
    ("execution", {"tp_microbatches": 0}, "tp_microbatches"),
    ("model", {"farskip.stale_blocks": 3}, "1 or 2"),
    ("model", {"farskip.stale_blocks": 2, "farskip.attn_only": True}, "attn_only"),
    ("execution", {"tp_reduce": "ring"}, "tp_reduce"),
])
def test_invalid_options_are_rejected(section, overrides, message):
    model, exe = _cfg("farskip")
    with pytest.raises(ConfigError, match=message):
        override(model if section == "model" else exe, overrides, section)


def test_chunks_must_divide_the_tokens(mesh):
    graphdef, state = _split(_cfg("farskip", tp_microbatches=3))
    fwd = tp_forward(graphdef, state, mesh)
    with pytest.raises(ValueError, match="does not divide"):
        jax.eval_shape(lambda s, i: fwd(s, i)[0], state, jnp.zeros((B, T), jnp.int32))


def test_order_barriers_only_where_asked(mesh, ids):
    """tp_order_barriers adds one join per FarSkip MoE layer with a stale stream (layers 2, 3) to
    the TP program, none without the option, and none to the single-device model."""
    def barriers(run: Run, tp: bool) -> int:
        graphdef, state = _split(run)
        if tp:
            fwd = tp_forward(graphdef, state, mesh)
            text = jax.jit(lambda s, i: fwd(s, i)[0]).lower(state, ids).as_text()
        else:
            text = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i).logits).lower(state, ids).as_text()
        return text.count("stablehlo.optimization_barrier")

    assert barriers(_cfg("farskip"), tp=True) == 2
    assert barriers(_cfg("farskip", tp_order_barriers=False), tp=True) == 0
    assert barriers(_cfg("farskip"), tp=False) == 0
