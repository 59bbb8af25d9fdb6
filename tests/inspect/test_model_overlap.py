"""End to end: the real train step and TP prefill of a reduced DeepSeek-V2-Lite, compiled deviceless
for an 8-GPU H200 target; FarSkip's collectives must be async with compute under them."""

from __future__ import annotations

import argparse

import pytest

from farskip_jax.config import load_config, parse_overrides
from farskip_jax.inspect import steps
from farskip_jax.inspect.cli import run_inspect

# DSV2-Lite's structure (MLA, 1 dense + MoE layers, shared experts, top-k routing) at a width that
# compiles in tens of seconds on 2 cores while compute still outweighs communication per layer.
REDUCED = [
    "model.num_layers=4", "model.hidden_size=1024", "model.num_heads=8", "model.kv_lora_rank=256",
    "model.qk_nope_head_dim=64", "model.qk_rope_head_dim=32", "model.v_head_dim=64",
    "model.n_routed_experts=16", "model.n_shared_experts=1", "model.num_experts_per_tok=2",
    "model.moe_intermediate_size=512", "model.intermediate_size=2048", "model.vocab_size=8192",
    "model.remat=none",
]
SEQ = 2048


def _inspect(tmp_path_factory, mode: str) -> dict:
    cfg = load_config("dsv2lite_farskip", parse_overrides(REDUCED))
    if mode == "train":
        build = steps.build_train_step(cfg, seqs_per_device=1, seq_len=SEQ)
        mesh = {"data": 1, "expert": 8, "tensor": 1}
    else:
        build = steps.build_prefill_step(cfg, batch=1, seq_len=SEQ)
        mesh = {"data": 1, "expert": 1, "tensor": 8}
    args = argparse.Namespace(target="h200", mesh=mesh, modes="farskip,regular",
                              out=tmp_path_factory.mktemp(f"overlap_{mode}"), lhs_dump=False,
                              compiler_option=[], no_default_options=False, save_hlo=False)
    return run_inspect(args, build)


@pytest.fixture(scope="module")
def train_reports(tmp_path_factory):
    return _inspect(tmp_path_factory, "train")


@pytest.fixture(scope="module")
def prefill_reports(tmp_path_factory):
    return _inspect(tmp_path_factory, "prefill")


def _kind(report: dict, kind: str) -> list[dict]:
    return [c for c in report["collectives"] if c["kind"] == kind]


def test_farskip_all_to_alls_are_async_with_compute_between(train_reports):
    a2a = _kind(train_reports["farskip"], "all-to-all")
    assert len(a2a) == 3 * 2 * 3, "3 MoE layers x (Dispatch, Combine) x (forward + 2 in backward)"
    fwd_dispatch = [c for c in a2a if c["direction"] == "fwd" and c["role"] == "dispatch"]
    bwd = [c for c in a2a if c["direction"] == "bwd"]
    # The physical limit: the first forward Dispatch and the last backward collective have nothing
    # of their own layer to hide behind.
    exempt = {min(fwd_dispatch, key=lambda c: c["start_index"])["name"],
              max(bwd, key=lambda c: c["start_index"])["name"]}
    for c in a2a:
        if c["name"] in exempt:
            continue
        assert c["is_async"] and c["compute_between_us"] > 0, c["name"]


def test_farskip_hides_more_all_to_all_time_than_regular(train_reports):
    far = train_reports["farskip"]["totals"]["by_kind"]["all-to-all"]["hidden_frac"]
    reg = train_reports["regular"]["totals"]["by_kind"]["all-to-all"]["hidden_frac"]
    print(f"OVERLAP train all-to-all hidden: farskip {far:.3f} regular {reg:.3f}")
    assert far > 0.90
    assert far > reg


def test_farskip_hides_more_psum_time_in_prefill(prefill_reports):
    far = prefill_reports["farskip"]["totals"]["by_kind"]["all-reduce"]
    reg = prefill_reports["regular"]["totals"]["by_kind"]["all-reduce"]
    print(f"OVERLAP prefill psum hidden: farskip {far['hidden_frac']:.3f} regular {reg['hidden_frac']:.3f}")
    assert far["hidden_frac"] > 0.90
    assert far["hidden_frac"] > reg["hidden_frac"]
