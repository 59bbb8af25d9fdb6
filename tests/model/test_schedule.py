"""The contracts of `farskip_jax.model.schedule`, checked on XLA's compiled programs.

Each hint promises one dependency ("the consumers of the result run after `dep` exists") and
unchanged values. The dependency is checked in the def-use graph of the module XLA's
latency-hiding scheduler receives in a deviceless H200 compile (after XLA:GPU's fusion; XLA
removes optimization barriers only after scheduling, so the final HLO no longer shows them),
between two GEMMs that share no data: with the hint the second is downstream of the first,
without it (the control) it is not, so each test can fail. The production use of `scratch_rows`'s
dependency (the expert-parallel Combine waits for the shared experts) is checked on a tiny model's EP=8
forward in tests/parallel/test_dependencies.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from farskip_jax.inspect.deps import DepGraph, build_graph, scope_regex
from farskip_jax.model import schedule
from farskip_jax.xla import aot, pgle
from farskip_jax.xla.hlo_parse import parse_hlo

pytest.importorskip("jax_plugins.xla_cuda13", reason="jax-cuda13-pjrt not installed")

D = 256


def _scheduler_input(fn, *shapes: tuple[int, ...]) -> str:
    """The HLO text XLA's latency-hiding scheduler receives for `fn` (deviceless H200, bf16 args)."""
    mesh = aot.make_target_mesh("h200", {"x": 1})
    rep = jax.sharding.NamedSharding(mesh, jax.P())
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=rep) for s in shapes]
    return pgle.scheduler_entry_hlo(jax.jit(fn), *specs, target="h200")[1]


def _graph(fn, *shapes: tuple[int, ...]) -> DepGraph:
    return build_graph(_scheduler_input(fn, *shapes))


def _gemm(name: str, x: jax.Array, w: jax.Array) -> jax.Array:
    with jax.named_scope(name):
        return jnp.dot(x, w)


def _depends(g: DepGraph, src: str, dst: str) -> bool:
    sources, targets = g.select(scope_regex(None, src)), g.select(scope_regex(None, dst))
    assert sources and targets, f"scopes {src!r} / {dst!r} not in the compiled HLO"
    assert not sources & targets, "producer and consumer were fused into one op: the test says nothing"
    return bool(g.reachable(sources, targets))


def _two_gemms(hint):
    """`use` reads `b` (through `hint`, if any), never `dep`'s value. Separate weights: XLA merges
    two dots that share an operand into one GEMM."""
    def f(a, b, w_a, w_b):
        dep = _gemm("dep", a, w_a)
        b = b if hint is None else hint(b, dep)
        return dep, _gemm("use", b, w_b)
    return f


@pytest.mark.parametrize("hint", ["join", "after", "scratch_rows"])
def test_hint_orders_the_consumer_after_dep(hint: str) -> None:
    hints = {
        "join": lambda b, dep: schedule.join(b, dep)[0],
        "after": schedule.after,
        "scratch_rows": lambda b, dep: schedule.scratch_rows(b.shape[0], b, dep),
    }
    shapes = ((512, D), (512, D), (D, D), (D, D))
    assert not _depends(_graph(_two_gemms(None), *shapes), "dep", "use")  # the control
    assert _depends(_graph(_two_gemms(hints[hint]), *shapes), "dep", "use")


def test_hints_leave_values_unchanged() -> None:
    rng = np.random.default_rng(0)
    b = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    dep = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    np.testing.assert_array_equal(schedule.after(b, dep), b)
    np.testing.assert_array_equal(schedule.join(b, dep)[0], b)
    np.testing.assert_array_equal(schedule.join(b, dep)[1], dep)
    # scratch_rows on XLA:CPU: zeros, whatever dep holds (integer or float, NaN included)
    for d in (dep, jnp.full((3,), jnp.nan), jnp.arange(3, dtype=jnp.int32)):
        np.testing.assert_array_equal(schedule.scratch_rows(5, b, d), np.zeros((5, 4), np.float32))


def test_fresh_zeros_follow_their_data_and_are_not_one_constant() -> None:
    """Zeros read from data: computed after it, and two buffers from different data stay two
    instructions (a literal zero would be one constant XLA materialises for every user)."""
    dep_a, dep_b = jnp.arange(3, dtype=jnp.int32), jnp.arange(1, 4, dtype=jnp.int32)
    like = jnp.ones((1, 4), jnp.bfloat16)

    def two(a, b):
        return schedule.fresh_zeros(8, like, a).at[0].set(1), schedule.fresh_zeros(8, like, b).at[1].set(2)

    za, zb = jax.jit(two)(dep_a, dep_b)
    assert za.dtype == jnp.bfloat16 and float(jnp.abs(za).sum()) == 4.0 and float(jnp.abs(zb).sum()) == 8.0
    jaxpr = jax.make_jaxpr(lambda a: schedule.fresh_zeros(8, like, a))(dep_a).jaxpr
    bcast = [eq for eq in jaxpr.eqns if eq.primitive.name == "broadcast_in_dim"]
    assert bcast and all(type(v).__name__ != "Literal" for eq in bcast for v in eq.invars)

    # compiled: the buffer is made from `dep`'s data; a literal zero buffer (the control) is an
    # operand-less instruction that XLA may compute at any time (and merges with its twin)
    def fill(zeros):
        def f(a, w_a, x, w_x):
            ids = jnp.argmax(_gemm("dep", a, w_a), axis=-1).astype(jnp.int32)  # never negative
            return zeros(ids).at[ids].add(x), zeros(ids + 1).at[ids].add(2 * x)
        return f

    shapes = ((512, D), (D, D), (512, D), (D, D))
    for zeros, expect in ((lambda ids: schedule.fresh_zeros(1024, jnp.ones((1, D), jnp.bfloat16), ids), 0),
                          (lambda ids: jnp.zeros((1024, D), jnp.bfloat16), 1)):
        mod = parse_hlo(_scheduler_input(fill(zeros), *shapes))
        made_from_nothing = [i for i in mod.computations[mod.entry].instrs
                             if not i.operands and i.opcode not in ("parameter", "constant")
                             and "[1024,256]" in i.shape]
        assert len(made_from_nothing) == expect, [i.name for i in made_from_nothing]
