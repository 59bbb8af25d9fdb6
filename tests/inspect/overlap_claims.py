"""FarSkip's claim on the production-path train step, as both targets' tests assert it."""

from __future__ import annotations


def assert_farskip_exposes_less(far: dict, reg: dict, chunks: int) -> None:
    """`far`/`reg`: the reports' totals of the reduced DSV2-Lite step (2 MoE layers, `chunks` = its
    batch split), FarSkip and regular with the same execution. Less exposed ragged all-to-all time
    (bar 0.85x), no synchronous exchange, more of all collective time hidden."""
    f_x, r_x = far["by_kind"]["ragged-all-to-all"], reg["by_kind"]["ragged-all-to-all"]
    assert f_x["count"] == r_x["count"] == 8 * chunks, "2 MoE layers x chunks x (Dispatch, Combine) x 2"
    assert f_x["sim_exposed_us"] < 0.85 * r_x["sim_exposed_us"]
    assert f_x["sync"] == 0
    assert far["all"]["sim_hidden_frac"] > reg["all"]["sim_hidden_frac"]
