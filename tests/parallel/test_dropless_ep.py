"""Dropless expert/tensor parallelism under the worst routing: every token to ONE rank's experts.

Checkpoint: a tiny HF DeepseekV2 (8 heads, 16 routed experts, top-2, random weights) made
adversarial. Hidden dimension 0 of the embedding is a constant 5 that no layer writes to (row 0
of every o_proj / down_proj / expert down_proj is zero), and the router rows of experts 0 and 1
read that dimension with weight 20 and 19. After the post-attention norm dimension 0 is large and
positive for every token, so every token picks experts 0 and 1 (checked). They are rank 0's
experts under EP=8 (2 local experts), DP=2 x EP=4 (4 local) and TP=8: rank 0 receives every
row of every source, which fills the dropless receive buffer exactly (B = tokens * min(K, L)).

Checks: logits of one device vs HF transformers (<= 1e-4); EP=8, DP=2 x EP=4, TP=8 logits vs one
device (<= 1e-5) and HF (<= 1e-4), gradients vs one device (<= 1e-5), EP=8 also with
remat="save_a2a" and "save_a2a_dots" and with expert_matmul="padded", and the node-aware two-stage
exchange (`expert_per_node`: EP=8 as 2 nodes x 4 and 4 x 2, DP=2 x EP=4 as 2 x 2; both target
experts on node 0); the ragged exchange (ep_exchange="ragged") on CPU with ragged_all_to_all
emulated from its documented semantics, flat and node-aware; the all-to-all and dot counts of remat
"full", "save_a2a" and "save_a2a_dots"; and a deviceless H200 compile whose scheduled HLO
carries ragged-all-to-all and runs the shared experts before the Combine starts.
"""

from __future__ import annotations

import re
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from par_common import (
    FAST,
    TINY_EXE,
    count_ops,
    emulated_ragged_all_to_all,
    emulated_swiglu_call,
    max_abs_err,
    nan_scratch_rows,
    record,
    run_fast,
    split,
    tiny,
    tiny_exe,
)

import farskip_jax
from farskip_jax.config import ExecutionConfig, MeshConfig
from farskip_jax.model import swiglu_rows
from farskip_jax.model.moe import MoE, route
from farskip_jax.model.swiglu_rows import KERNEL_NAMES
from farskip_jax.parallel import (
    ExpertParallel,
    batch_sharding,
    make_mesh,
    param_shardings,
    place,
    resolve_exchange,
    tp_forward,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from hf_tiny import build_hf, hf_logits, random_ids, tiny_hf_config  # noqa: E402

B, T = 8, 16
TOL, HF_TOL = 1e-5, 1e-4
MESHES = {"ep8": MeshConfig(expert=8), "dp2xep4": MeshConfig(data=2, expert=4), "tp8": MeshConfig(tensor=8)}
TARGET_EXPERTS = (0, 1)


def one_rank_hf(seed: int = 3) -> torch.nn.Module:
    cfg = tiny_hf_config(num_attention_heads=8, n_routed_experts=16, num_experts_per_tok=2)
    hf = build_hf(cfg, seed=seed)
    with torch.no_grad():
        hf.model.embed_tokens.weight[:, 0] = 5.0
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                mlp.experts.down_proj[:, 0, :] = 0.0
                mlp.shared_experts.down_proj.weight[0, :] = 0.0
                for e, w in zip(TARGET_EXPERTS, (20.0, 19.0), strict=True):
                    mlp.gate.weight[e, 0] = w
            else:
                mlp.down_proj.weight[0, :] = 0.0
    return hf


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    hf = one_rank_hf()
    directory = tmp_path_factory.mktemp("one_rank")
    hf.save_pretrained(directory)
    ids = random_ids(hf.config.vocab_size, B, T, seed=5)
    moe_inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda mod, args, i=i: moe_inputs.__setitem__(i, args[0].detach().clone()))
        for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    hf_ref = hf_logits(hf, ids)
    for h in hooks:
        h.remove()
    model = farskip_jax.from_pretrained(directory)
    graphdef, state = nnx.split(model, nnx.Param)
    w = jax.random.normal(jax.random.key(2), (B, T, hf.config.vocab_size))
    return dict(dir=directory, ids=jnp.asarray(ids), hf=hf_ref, moe_inputs=moe_inputs, model=model,
                graphdef=graphdef, state=state, w=w)


def _loss_fn(forward):
    def loss(s, ids, w):
        logits = forward(s, ids)
        return jnp.mean(logits * w), logits

    return jax.value_and_grad(loss, has_aux=True)


@pytest.fixture(scope="module")
def one_device(ckpt):
    graphdef = ckpt["graphdef"]
    (_, logits), grads = run_fast(_loss_fn(lambda s, i: nnx.merge(graphdef, s)(i).logits),
                                  ckpt["state"], ckpt["ids"], ckpt["w"])
    return logits, grads


def test_router_sends_every_token_to_one_rank(ckpt):
    cfg = ckpt["model"].cfg
    assert ckpt["moe_inputs"], "no MoE layer"
    for i, x in ckpt["moe_inputs"].items():
        x_nd = x.reshape(-1, cfg.hidden_size).numpy()
        r = jax.jit(route, static_argnums=(2, 3))(x_nd, ckpt["model"].layers[i].moe.router[...], cfg, T)
        chosen = np.sort(np.asarray(r.experts_nk), axis=1)
        assert (chosen == np.array(TARGET_EXPERTS)).all(), i


def test_one_device_matches_hf(ckpt, one_device):
    err = max_abs_err(one_device[0], ckpt["hf"])
    record("dropless_one_rank", "one_device", "logits_vs_hf", err)
    assert err <= HF_TOL
    assert float(jnp.std(one_device[0])) > 0.1  # logits of order 1: the bar means something


# case -> (mesh, ExecutionConfig overrides, expert ranks per node: 0 = the flat exchange)
CASES = {"ep8": ("ep8", {}, 0), "ep8_save_a2a": ("ep8", {"remat": "save_a2a"}, 0),
         "ep8_save_a2a_dots": ("ep8", {"remat": "save_a2a_dots"}, 0),
         "ep8_padded_matmul": ("ep8", {"expert_matmul": "padded"}, 0), "dp2xep4": ("dp2xep4", {}, 0),
         "tp8": ("tp8", {}, 0),
         # the node-aware two-stage exchange (parallel/node_aware.py): every token on one node
         "ep8_nodes2x4": ("ep8", {}, 4), "ep8_nodes4x2_save_a2a": ("ep8", {"remat": "save_a2a"}, 2),
         "dp2xep4_nodes2x2": ("dp2xep4", {}, 2)}
# `slow` (CI time budget): the default suite keeps the flat EP8 and TP8 exchanges, `save_a2a_dots`
# (what remat=auto runs on H200) and the two node-aware cases, which also cover `save_a2a` and the
# data axis; the padded expert matmul is checked against the blocked one in
# tests/model/test_grouped_matmul.py.
SLOW_CASES = {"ep8_save_a2a", "ep8_nodes2x4", "dp2xep4", "ep8_padded_matmul"}


def _sharded_forward(ckpt, case: str, bounded: bool):
    """(forward(state, ids) -> (logits, overflow), placed state, placed ids) for one case."""
    mesh_name, overrides, per_node = CASES[case]
    mesh = make_mesh(MESHES[mesh_name])
    state, ids = ckpt["state"], ckpt["ids"]
    if mesh_name == "tp8":
        fwd = tp_forward(ckpt["graphdef"], state, mesh, bounded=bounded)

        def forward(s, i):
            logits, _, overflow = fwd(s, i)
            return logits, overflow

        return forward, place(state, mesh, "tp"), ids
    graphdef = ckpt["graphdef"]
    if overrides:
        graphdef, _ = nnx.split(farskip_jax.from_pretrained(ckpt["dir"], exe=ExecutionConfig(**overrides)),
                                nnx.Param)
    par = ExpertParallel(mesh, bounded=bounded, expert_per_node=per_node)

    def forward(s, i):
        out = nnx.merge(graphdef, s)(i, parallel=par)
        return out.logits, out.aux["moe_overflow"]

    return forward, place(state, mesh, "ep"), jax.device_put(ids, batch_sharding(mesh))


def _loss_overflow_fn(forward):
    def loss(s, ids, w):
        logits, overflow = forward(s, ids)
        return jnp.mean(logits * w), (logits, overflow)

    return jax.value_and_grad(loss, has_aux=True)


def _lowered_ep_step(graphdef, mesh, args, bounded: bool, per_node: int):
    """The EP loss-and-gradient step (logits and overflow as aux) lowered for `args`."""
    par = ExpertParallel(mesh, bounded=bounded, expert_per_node=per_node)

    def forward(s, i):
        out = nnx.merge(graphdef, s)(i, parallel=par)
        return out.logits, out.aux["moe_overflow"]

    return jax.jit(_loss_overflow_fn(forward)).lower(*args)


@pytest.mark.parametrize("case", list(CASES))
def test_bounded_overflows_and_worst_case_matches_one_device_and_hf(ckpt, one_device, case):
    """The fallback the trainer takes: the bounded program says it overflowed, the worst-case
    program is exact."""
    ref_logits, ref_grads = one_device
    forward, sharded, ids = _sharded_forward(ckpt, case, bounded=True)
    logits_b, overflow = jax.jit(forward)(sharded, ids)
    assert int(overflow) == 1, "one-rank routing must overflow the bounded buffers"
    assert bool(jnp.all(jnp.isfinite(logits_b)))  # a void step is thrown away, but must not poison
    forward, sharded, ids = _sharded_forward(ckpt, case, bounded=False)
    (_, (logits, overflow)), grads = run_fast(_loss_overflow_fn(forward), sharded, ids, ckpt["w"])
    assert int(overflow) == 0
    errs = {"logits": max_abs_err(logits, ref_logits), "logits_vs_hf": max_abs_err(logits, ckpt["hf"]),
            "grads": max_abs_err(grads, ref_grads)}
    for quantity, err in errs.items():
        record("dropless_one_rank", case, quantity, err)
    assert errs["logits"] <= TOL and errs["grads"] <= TOL and errs["logits_vs_hf"] <= HF_TOL
    expert_grads = np.abs(np.asarray(ref_grads["layers"][1]["moe"]["experts"]["w_down"][...]))
    assert float(expert_grads[:2].max()) > 1e-4  # the two busy experts learn ...
    assert float(expert_grads[2:].max()) == 0.0  # ... and no token reached the others


# Both `slow` (CI time): test_ragged_exchange_never_reads_unwritten_rows runs the same emulated
# exchange against one device, bounded and worst case, flat and node-aware, with NaN in the buffers'
# unwritten rows (a stricter check); tests/parallel/test_node_aware.py has the node-aware ragged cases.
@pytest.mark.parametrize("per_node", [pytest.param(0, id="flat", marks=pytest.mark.slow),
                                      pytest.param(4, id="nodes2x4", marks=pytest.mark.slow)])
def test_ragged_exchange_emulated(ckpt, one_device, monkeypatch, per_node):
    """ep_exchange="ragged" on CPU: the offsets and sizes we pass, under the documented semantics;
    bounded (reports the overflow) and worst case (exact); the flat exchange and the node-aware one."""
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    model = farskip_jax.from_pretrained(ckpt["dir"], exe=ExecutionConfig(ep_exchange="ragged"))
    graphdef, _ = nnx.split(model, nnx.Param)
    mesh = make_mesh(MESHES["ep8"])
    assert resolve_exchange("auto", mesh) == "padded"  # XLA:CPU
    assert resolve_exchange(model.exe.ep_exchange, mesh) == "ragged"
    args = (place(ckpt["state"], mesh, "ep"), jax.device_put(ckpt["ids"], batch_sharding(mesh)), ckpt["w"])
    for bounded in (True, False):
        lowered = _lowered_ep_step(graphdef, mesh, args, bounded, per_node)
        assert "ragged_all_to_all" not in lowered.as_text()  # the emulation ran, not the real op
        (_, (logits, overflow)), grads = lowered.compile(FAST)(*args)
        assert int(overflow) == int(bounded)
    err_logits, err_grads = max_abs_err(logits, one_device[0]), max_abs_err(grads, one_device[1])
    case = "ep8_ragged_emulated" + ("" if per_node == 0 else f"_nodes{8 // per_node}x{per_node}")
    record("dropless_one_rank", case, "logits", err_logits)
    record("dropless_one_rank", case, "grads", err_grads)
    assert err_logits <= TOL and err_grads <= TOL


@pytest.mark.parametrize("matmul,per_node,swiglu", [
    ("blocked", 0, "xla"), ("ragged", 0, "xla"), ("padded", 0, "xla"), ("blocked", 4, "xla"),
    ("ragged", 0, "pallas_triton"), pytest.param("ragged", 4, "pallas_triton", marks=pytest.mark.slow),
    ("tokamax", 0, "pallas_triton")])
def test_ragged_exchange_never_reads_unwritten_rows(ckpt, one_device, monkeypatch, matmul, per_node, swiglu):
    """The exchanges' output buffers that need no zeros (`schedule.scratch_rows`: uninitialised on
    GPUs) filled with NaN instead: the step still equals one device, logits and gradients, bounded
    (overflowing: the void result stays finite) and worst case. The rows past the experts' groups
    in the receive buffer, the Combine's dropped rows and the backward Combine's cotangent rows
    past the groups are never read, by any expert matmul that runs here (blocked, XLA's ragged_dot,
    padded; tokamax's: tests/model/test_grouped_matmul.py), flat or node-aware. With the activation
    kernel (model/swiglu_rows.py; its math in jnp here, `emulated_swiglu_call`) the rows past the
    groups' blocks of its result and of both its gradients are NaN too: nothing reads them either.
    With tokamax's grouped GEMMs (Hopper's one op, `swiglu_ffn`, tokamax's XLA implementation here)
    so are the kernels' rows past the groups of d gate and d up side by side, of the activation and
    the rows transposed, and the unmasked input gradient's rows."""
    from farskip_jax.model import dispatch, schedule

    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    uses, kernel_calls = [], []
    monkeypatch.setattr(schedule, "scratch_rows", lambda *a: uses.append(a[0]) or nan_scratch_rows(*a))
    monkeypatch.setattr(swiglu_rows, "_call",
                        lambda *a: kernel_calls.append(a[1]) or emulated_swiglu_call(*a))
    if matmul == "tokamax":  # Hopper's op, tokamax's CPU implementation (Mosaic GPU needs a GPU)
        monkeypatch.setattr(dispatch, "swiglu_ffn", partial(swiglu_rows.swiglu_ffn, implementation="xla"))
    model = farskip_jax.from_pretrained(ckpt["dir"], exe=ExecutionConfig(ep_exchange="ragged",
                                                                         expert_matmul=matmul,
                                                                         expert_swiglu=swiglu))
    graphdef, _ = nnx.split(model, nnx.Param)
    mesh = make_mesh(MESHES["ep8"])
    args = (place(ckpt["state"], mesh, "ep"), jax.device_put(ckpt["ids"], batch_sharding(mesh)), ckpt["w"])
    for bounded in (True, False):
        uses.clear()
        lowered = _lowered_ep_step(graphdef, mesh, args, bounded, per_node)
        # per MoE layer: the receive buffer, the Combine's output, the backward Combine's output;
        # node-aware: each stage's receive buffer and Combine output
        moe_layers = sum(1 for i in range(model.cfg.num_layers) if model.cfg.is_moe_layer(i))
        assert len(uses) == (3 if per_node == 0 else 4) * moe_layers, len(uses)
        want = [] if swiglu == "xla" else sorted(KERNEL_NAMES if matmul == "tokamax" else KERNEL_NAMES[:2])
        assert sorted(set(kernel_calls)) == want  # both ways
        (_, (logits, overflow)), grads = lowered.compile(FAST)(*args)
        assert int(overflow) == int(bounded)
        assert bool(jnp.all(jnp.isfinite(logits)))
    err_logits, err_grads = max_abs_err(logits, one_device[0]), max_abs_err(grads, one_device[1])
    case = (f"ep8_ragged_nan_scratch_{matmul}" + ("" if swiglu == "xla" else f"_{swiglu}")
            + ("" if per_node == 0 else f"_nodes{8 // per_node}x{per_node}"))
    record("dropless_one_rank", case, "logits", err_logits)
    record("dropless_one_rank", case, "grads", err_grads)
    assert err_logits <= TOL and err_grads <= TOL


def _abstract(state, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def test_save_a2a_backward_runs_no_extra_all_to_all():
    """Compiled EP=8 step of a tiny 3-layer model (2 MoE layers): all-to-all, all-gather and dot
    instructions under each remat policy (the forward-only program does not depend on it: compiled
    once)."""
    mesh = make_mesh(MeshConfig(expert=8))
    par = ExpertParallel(mesh)
    counts = {}
    policies = ("full", "save_a2a", "save_a2a_dots")
    for remat in policies:
        graphdef, state = split(tiny(True, num_layers=3), exe=tiny_exe(remat=remat))
        args = (_abstract(state, param_shardings(state, mesh, "ep")),
                jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch_sharding(mesh)))

        def loss(s, i, graphdef=graphdef):
            return jnp.mean(nnx.merge(graphdef, s)(i, parallel=par).logits ** 2)

        programs = ((("fwd", loss),) if remat == "full" else ()) + (("fwd+bwd", jax.grad(loss)),)
        for name, fn in programs:
            text = jax.jit(fn).lower(*args).compile(FAST).as_text()
            counts[remat, name, "all-to-all"] = count_ops(text, "all-to-all")
            counts[remat, name, "dot"] = count_ops(text, "dot")
            # the row-count exchange: [G, G, L] int32 (every rank's counts per destination and expert)
            counts[remat, name, "counts all-gather"] = len(re.findall(
                r"\n\s*(?:ROOT )?%\S+ = s32\[8,8,\d+\]\S* all-gather(?:-start)?\(", text))
    print(f"PARALLEL_A2A_COUNTS {counts}")
    fwd = counts["full", "fwd", "all-to-all"]
    assert fwd == 2 * 2  # per MoE layer: Dispatch, Combine
    # the row counts are all-gathered (every rank sees every pair's counts: overflow is detected
    # from them), once per MoE layer, and never again in the backward pass
    assert counts["full", "fwd", "counts all-gather"] == 2
    for remat in policies:
        assert counts[remat, "fwd+bwd", "counts all-gather"] == 2
    for remat in ("save_a2a", "save_a2a_dots"):
        assert counts[remat, "fwd+bwd", "all-to-all"] == fwd + 2 * 2  # backward: the two transposes
    # full reruns the forward's Dispatch and Combine in the backward pass
    assert counts["full", "fwd+bwd", "all-to-all"] == counts["save_a2a", "fwd+bwd", "all-to-all"] + 2 * 2
    # save_a2a_dots also keeps the plain matmuls' outputs, so the backward pass recomputes fewer
    # dots than under save_a2a (measured: remat none 135, save_a2a_dots 149, save_a2a 169, full 173)
    dots = {remat: counts[remat, "fwd+bwd", "dot"] for remat in policies}
    assert dots["save_a2a_dots"] < dots["save_a2a"] <= dots["full"], dots


def test_ragged_exchange_compiles_for_h200():
    """Deviceless H200 compile of one tiny EP=8 MoE layer, forward + backward: auto picks ragged."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="jax-cuda13-pjrt not installed")
    from farskip_jax.xla import aot

    mesh = aot.make_target_mesh("h200", {"data": 1, "expert": 8, "tensor": 1})
    assert resolve_exchange("auto", mesh) == "ragged"
    cfg = tiny(False, n_routed_experts=16, dtype="bfloat16")
    graphdef, state = nnx.split(MoE(cfg, nnx.Rngs(0), exe=TINY_EXE), nnx.Param)
    par = ExpertParallel(mesh)
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, P("expert") if "experts" in jax.tree_util.keystr(path) else P()),
        state)
    x = jax.ShapeDtypeStruct((16, T, cfg.hidden_size), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(("data", "expert"))))

    def loss(s, x):
        shared, routed, _ = nnx.merge(graphdef, s)(x, par.routed_fn)
        return jnp.mean((shared + routed).astype(jnp.float32) ** 2)

    art = aot.compile_scheduled_hlo(jax.jit(jax.grad(loss, argnums=(0, 1))), _abstract(state, shardings), x,
                                    target="h200")
    ragged = count_ops(art.hlo_text, "ragged-all-to-all")
    plain = count_ops(art.hlo_text, "all-to-all")
    print(f"PARALLEL_H200_RAGGED ragged-all-to-all={ragged} all-to-all={plain}")
    assert "is_scheduled=true" in art.hlo_text
    assert ragged == 4  # Dispatch and Combine, forward and backward (their transposes)
    # The receive buffers vary over the mesh: no psum of their cotangents (a mesh-invariant
    # `output` buffer made the backward all-reduce the whole receive buffer, and sum gradients).
    assert "psum_invariant" not in art.hlo_text
    # The Combine waits for the shared experts (ExpertParallel.routed_with_shared) through a data
    # dependency that XLA kept: the forward Combine (the second ragged all-to-all in schedule order,
    # as ENTRY prints) reads, through its operands, a forward shared-expert matmul.
    entry = art.hlo_text[art.hlo_text.index("\nENTRY "):]
    defs = dict(re.findall(r"\n\s*(?:ROOT )?%(\S+) = ([^\n]*)", entry[:entry.index("\n}")]))
    starts = [name for name, rhs in defs.items() if re.match(r".*?\sragged-all-to-all(-start)?\(", rhs)]
    shared_re = re.compile(r'op_name="[^"]*[/(]shared[/)][^"]*dot_general')
    seen, todo = set(), [starts[1]]
    while todo:
        name = todo.pop()
        if name not in seen and name in defs:
            seen.add(name)
            todo += re.findall(r"%([\w.\-]+)", defs[name].split(", metadata=")[0])
    assert len(starts) == 4
    assert any(shared_re.search(defs[n]) and "transpose(" not in defs[n] for n in seen), starts[1]
    # The Dispatch lands rows expert-major (one slice per destination and local expert), so the
    # grouped GEMM reads the receive buffer [R, D] as it is: no gather or scatter of R rows, forward
    # or backward (source-major rows were regrouped by two such gathers each way).
    recv_rows = max(int(m) for m in
                    re.findall(r"= \(?bf16\[(\d+),\d+\][^\n]*? ragged-all-to-all", art.hlo_text))
    moved = re.findall(rf"= bf16\[{recv_rows},[\d,]+\]\S* (gather|scatter)\(", art.hlo_text)
    print(f"PARALLEL_H200_RECEIVE_ROWS {recv_rows} gathers/scatters of them: {len(moved)}")
    assert not moved
    # The exchanges' buffers whose unwritten rows nobody reads are not zero-filled
    # (schedule.scratch_rows: XLA's AllocateBuffer): the receive buffer, the Combine's output and the
    # backward Combine's output. The backward Dispatch's keeps its zeros: rows that were not sent
    # (dropped assignments) get a zero cotangent. Each allocation reads an operand, so that XLA
    # cannot place it at the start of the step (an operand-less one it did, all alive together).
    allocated = re.findall(r"= (bf16\[\d+),\d+\]\S* custom-call\(%[\w.\-]+\), "
                           r"custom_call_target=\"AllocateBuffer\"", art.hlo_text)
    fills = re.findall(rf"= bf16\[{recv_rows},\d+\]\S* (?:broadcast|fusion)\([^\n]*", art.hlo_text)
    zero_fills = [ln for ln in fills if re.search(r'op_name="[^"]*/(dispatch|combine)/[^"]*broadcast', ln)]
    print(f"PARALLEL_H200_SCRATCH allocated={allocated} zero-filled receive buffers={len(zero_fills)}")
    assignments = 16 * T * cfg.num_experts_per_tok // 8  # the Combine's output rows per rank
    assert sorted(allocated) == sorted([f"bf16[{recv_rows}"] * 2 + [f"bf16[{assignments}"])
    assert not zero_fills
