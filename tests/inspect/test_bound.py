"""The dependency floor and the list order (`farskip_jax.inspect.bound`) on scheduled-HLO texts of
tests/inspect/data: what any order of a program's ops could hide, against the order XLA chose."""

from __future__ import annotations

from pathlib import Path

import pytest

from farskip_jax.inspect import hlo

DATA = Path(__file__).parent / "data"
FILES = ["async_pair.hlo", "sync_pair.hlo", "nested_while.hlo", "phases.hlo", "loop_slices.hlo",
         "in_place.hlo", "kernels.hlo"]


def _late_start(text: str) -> str:
    """async_pair.hlo with its independent dot (and the parameters it reads) moved before the
    all-to-all's start: the same ops and dependencies, an order with nothing under the exchange."""
    lines = text.splitlines()
    entry = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    moved = ("%param.7 ", "%bitcast.2.0 ", "%param.6 ", "%bitcast.3.0 ", "%gemm_fusion_dot.1 ")
    picked = [line for line in lines[entry:] if line.strip().startswith(moved)]
    rest = [line for line in lines if line not in picked]
    at = next(i for i, line in enumerate(rest) if line.strip().startswith("%all-to-all-start "))
    return "\n".join(rest[:at] + picked + rest[at:]) + "\n"


@pytest.mark.parametrize("name", FILES)
def test_floor_is_under_every_order_and_prices_the_same_ops(name: str) -> None:
    a = hlo.analyze((DATA / name).read_text(), "h200")
    b, t = a.bound, a.totals
    assert b.compute_us == pytest.approx(t["est_compute_us"], rel=1e-9)  # the replay's own costs
    assert b.transfer_us == pytest.approx(t["all"]["transfer_us"], rel=1e-9)
    assert b.step_us <= t["est_step_us"] * (1 + 1e-9)  # XLA's order is one order
    assert b.step_us <= b.list_step_us * (1 + 1e-9)  # so is the list order
    assert b.step_us == pytest.approx(max(b.path_us, b.compute_us, b.transfer_us))


# A synchronous all-reduce read directly by compute (no bitcast or done between), beside an
# independent dot: the list order must not start the reader before the transfer ends.
_SYNC_READER = """HloModule jit_sync_reader, is_scheduled=true, num_partitions=8

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_dot (p0: f32[1024,1024], p1: f32[1024,1024]) -> f32[1024,1024] {
  %p0 = f32[1024,1024]{1,0} parameter(0)
  %p1 = f32[1024,1024]{1,0} parameter(1)
  ROOT %d = f32[1024,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[1024,1024], w: f32[1024,1024]) -> (f32[1024,1024], f32[1024,1024]) {
  %x = f32[1024,1024]{1,0} parameter(0)
  %w = f32[1024,1024]{1,0} parameter(1)
  %h = f32[1024,1024]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %ar = f32[1024,1024]{1,0} all-reduce(%h), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %y = f32[1024,1024]{1,0} fusion(%ar, %w), kind=kCustom, calls=%fused_dot
  %z = f32[1024,1024]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot
  ROOT %t = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0}) tuple(%y, %z)
}
"""


def test_a_synchronous_collective_is_waited_for_by_its_readers() -> None:
    a = hlo.analyze(_SYNC_READER, "h200")
    b, (c,) = a.bound, a.collectives
    dot = b.compute_us / 3
    assert not c.is_async and c.transfer_us > dot  # the independent dot cannot cover it all
    assert b.path_us == pytest.approx(2 * dot + c.transfer_us)
    assert b.list_step_us == pytest.approx(b.path_us)  # h, then z under the transfer, then y
    assert b.list_hidden_frac == pytest.approx(dot / c.transfer_us)


def test_a_chain_leaves_nothing_to_hide_whatever_the_order() -> None:
    """sync_pair.hlo: dot -> all-to-all -> dot, nothing beside the exchange."""
    b = hlo.analyze((DATA / "sync_pair.hlo").read_text(), "h200").bound
    assert b.max_hidden_frac == 0.0 and b.list_hidden_frac == 0.0
    assert b.path_us == pytest.approx(b.compute_us + b.transfer_us)


def test_the_floor_sees_what_an_order_leaves_exposed() -> None:
    """async_pair.hlo scheduled with the exchange's compute under it, then the same program with
    that compute moved before the start: the replay of the second hides nothing, while its floor and
    list order are those of the first, which XLA's order reached."""
    text = (DATA / "async_pair.hlo").read_text()
    good, late = hlo.analyze(text, "h200"), hlo.analyze(_late_start(text), "h200")
    assert good.totals["all"]["sim_hidden_frac"] > 0.3
    assert late.totals["all"]["sim_hidden_frac"] == 0.0
    for a in (good, late):
        assert a.bound.max_hidden_frac == pytest.approx(good.totals["all"]["sim_hidden_frac"], abs=1e-6)
        assert a.bound.list_step_us == pytest.approx(good.totals["est_step_us"])
    assert late.totals["est_step_us"] > late.bound.list_step_us + 1.0


def test_backward_work_is_not_hoisted_under_a_forward_exchange() -> None:
    """async_pair.hlo with its independent dot named as JAX names backward work (`transpose(...)`,
    as for what jax.checkpoint recomputes): the dot may not run before the forward, exchange
    included, has finished, so neither bound hides anything under the exchange."""
    text = (DATA / "async_pair.hlo").read_text()
    backward = text.replace("layer_0/attention/dot_general", "transpose(jvp(layer_0))/attention/dot_general")
    assert backward != text
    fwd, bwd = hlo.analyze(text, "h200").bound, hlo.analyze(backward, "h200").bound
    assert fwd.list_hidden_frac > 0.3 and fwd.max_hidden_frac > 0.3
    assert bwd.list_hidden_frac == 0.0 and bwd.max_hidden_frac == 0.0
    assert bwd.compute_us == pytest.approx(fwd.compute_us)


def test_a_loop_counts_its_trips_and_its_link_lane() -> None:
    """nested_while.hlo: 4 trips of a body whose three collectives (an all-reduce, a synchronous
    all-to-all after it, an async reduce-scatter) outlast its compute, so each trip takes at least
    its transfers, and the step at least 4 of those plus the entry's dot."""
    a = hlo.analyze((DATA / "nested_while.hlo").read_text(), "h200")
    (loop,) = a.bound.loops
    assert (loop.body, loop.trips, loop.runs) == ("body", 4, 1)
    assert loop.transfer_us > loop.compute_us and loop.step_us == pytest.approx(loop.transfer_us)
    body_colls = [c for c in a.collectives if c.computation == "body"]
    assert loop.transfer_us == pytest.approx(sum(c.transfer_us for c in body_colls))
    assert a.bound.step_us == pytest.approx(a.bound.compute_us - 4 * loop.compute_us + 4 * loop.step_us)
