"""`python -m farskip_jax describe` against numbers counted independently: parameter totals from the
HF model itself (torch), active parameters and bytes per device from its named parameters."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hf_tiny import build_hf, build_qwen3, save_hf, tiny_hf_config, tiny_qwen3_config

ROOT = Path(__file__).resolve().parents[2]


def _describe(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "farskip_jax", "describe", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env)


def _hf_counts(model, experts: int, top_k: int, ep: int) -> dict[str, float]:
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    embed = named["model.embed_tokens.weight"].numel()
    routed = sum(p.numel() for n, p in named.items() if ".mlp.experts." in n)
    return {"total": total, "active": total - embed - routed + routed * top_k // experts,
            "per_device_fp32": 4 * (total - routed + routed / ep)}


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe"])
def test_describe_counts_what_the_hf_model_holds(family: str, tmp_path: Path) -> None:
    if family == "deepseek_v2":
        cfg = tiny_hf_config()
        model, experts, top_k = build_hf(cfg), cfg.n_routed_experts, cfg.num_experts_per_tok
    else:
        cfg = tiny_qwen3_config()
        model, experts, top_k = build_qwen3(cfg), cfg.num_experts, cfg.num_experts_per_tok
    directory = save_hf(model, tmp_path / "hf")
    res = _describe("--checkpoint", str(directory), "--mesh", "expert=2", "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    want = _hf_counts(model, experts, top_k, ep=2)
    assert d["parameters"]["total"] == want["total"]
    assert d["parameters"]["active_per_token"] == want["active"]
    assert d["weights_bytes_per_device"]["param_dtype"] == pytest.approx(want["per_device_fp32"])
    assert d["hf_architecture"] == type(model).__name__
    assert d["hf_model_type"] == family
    moe = [i for i in range(cfg.num_hidden_layers) if ".mlp.experts." in " ".join(
        n for n, _ in model.named_parameters() if n.startswith(f"model.layers.{i}."))]
    assert [r for r in d["layers"] if r["ffn"].startswith("MoE")][0]["layers"].startswith(str(moe[0]))


def test_describe_a_config_and_its_errors() -> None:
    res = _describe("--config", "dsv2lite_farskip")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    # DeepSeek-V2-Lite: 15.7B total, 2.4B activated (its model card); layer 0 dense, 1-26 MoE
    assert "15.706 B total, 2.451 B active per token" in out, out
    assert "dense MLP; MLA; FarSkip: layers 0\n" in out and "FarSkip: layers 1-26\n" in out, out
    assert "FarSkipDeepseekV2ForCausalLM (trust_remote_code; stock: DeepseekV2ForCausalLM)" in out
    assert "expert=8, ep layout" in out and "training state per device" in out
    bad = _describe("--config", "dsv2lite", "--mesh", "expert=3")
    assert bad.returncode == 2 and "64 routed experts do not split" in bad.stderr, bad.stderr
    assert _describe("--checkpoint", "/nonexistent").returncode == 2


@pytest.mark.parametrize(("per_node", "teacher"), [(0, "auto"), (4, "auto"), (0, "local")],
                         ids=["one_node", "two_nodes", "teacher_local"])
def test_training_state_is_what_the_trainer_holds_per_device(per_node: int, teacher: str) -> None:
    """describe's training state per device == the bytes of one device's shards of the trainer's own
    state and teacher (ZeRO-1 keeps the replicated weights' masters and moments split; on 2 nodes of
    4 the teacher's routed experts are copied on each node, `mesh.teacher_experts: auto`, and with
    `local` all of them on every device)."""
    import jax

    from farskip_jax.config import load_config
    from farskip_jax.parallel.mesh import make_mesh
    from farskip_jax.train.program import build_program

    res = _describe("--config", "tiny", "--mesh", "expert=8", "--set", f"mesh.expert_per_node={per_node}",
                    "--set", f"mesh.teacher_experts={teacher}", "--json")
    assert res.returncode == 0, res.stderr
    described = json.loads(res.stdout)
    cfg = load_config("tiny", {"mesh.expert": 8, "mesh.expert_per_node": per_node,
                               "mesh.teacher_experts": teacher})

    def held(cfg) -> int:
        prog = build_program(cfg, make_mesh(cfg.mesh, jax.devices()[:8]))
        state = prog.abstract_state()
        trees = (state["params"], state["opt_state"], prog.abstract_teacher())
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                   for x in jax.tree.leaves(trees) if x.ndim > 0)

    assert cfg.train.zero1 and cfg.train.mode == "fcsd"
    assert described["training_state_bytes_per_device"] == pytest.approx(held(cfg), rel=1e-9)
    # auto: what the memory search's local-teacher candidate would hold (train/remat.py)
    local = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, teacher_experts="local"))
    assert described.get("teacher_local_bytes_per_device") == (
        pytest.approx(held(local), rel=1e-9) if teacher == "auto" else None)
    assert ("in each node of 4 ranks" in described["training_state_parts"]) == (per_node == 4)
    assert ("all of its routed experts on every device" in described["training_state_parts"]) == (
        teacher == "local")
