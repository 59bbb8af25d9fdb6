"""convert_torch_ckpt.py: HF <-> Orbax round trips, logits, EP restore, validation, interruption."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from convert_torch_ckpt import main as cli  # noqa: E402
from farskip_jax import from_pretrained  # noqa: E402
from farskip_jax.checkpoint.hf_io import CheckpointError, TensorSource  # noqa: E402
from farskip_jax.checkpoint.orbax_io import MARKER, load_model_config  # noqa: E402
from farskip_jax.checkpoint.output_dir import TEST_PAUSE_ENV  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
E = 8
IDS = np.array([[3, 17, 5, 60, 22, 9, 41, 2, 33, 12, 7, 50]], dtype=np.int64)


def _hf_config(**kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=E,
                n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                max_position_embeddings=64)
    base.update(kw)
    return transformers.DeepseekV2Config(**base)


def _random_hf_model(seed: int):
    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(_hf_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Small-magnitude weights keep fp32 logits comparable to 1e-4; norms stay near 1.
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(IDS)).logits.float().numpy()


@nnx.jit
def _forward(model, ids):
    return model(ids).logits


def _our_logits(model) -> np.ndarray:
    return np.asarray(_forward(model, jnp.asarray(IDS, jnp.int32)))


def _tensors(d: Path) -> dict[str, np.ndarray]:
    src = TensorSource(d)
    return {k: src.read(k) for k in src.keys()}


def _same_tensors(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """Tiny random DeepseekV2 written by transformers, sharded into several safetensors files."""
    d = tmp_path_factory.mktemp("hf")
    model = _random_hf_model(0)
    model.save_pretrained(d, max_shard_size="40KB")
    assert len(list(d.glob("*.safetensors"))) > 3
    np.save(d.parent / "hf_logits.npy", _hf_logits(model))
    return d


@pytest.fixture(scope="module")
def hf_logits(hf_dir):
    return np.load(hf_dir.parent / "hf_logits.npy")


@pytest.fixture(scope="module")
def bin_dir(hf_dir, tmp_path_factory):
    """The same weights as pytorch_model.bin (torch.save of the state dict) + a legacy yarn config."""
    d = tmp_path_factory.mktemp("hfbin")
    sd = {k: torch.from_numpy(v.copy()) for k, v in _tensors(hf_dir).items()}
    torch.save(sd, d / "pytorch_model.bin")
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = 10000.0
    cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                           "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def orbax_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "ckpt"
    assert cli(["--input", str(hf_dir), "--output", str(out), "--mesh", "expert=8", "--no-progress"]) == 0
    return out


def test_layout_and_config(orbax_dir, hf_dir):
    assert (orbax_dir / MARKER).is_file() and (orbax_dir / "params" / "_METADATA").is_file()
    original = json.loads((hf_dir / "config.json").read_text())
    assert json.loads((orbax_dir / "config.json").read_text()) == original
    cfg = load_model_config(orbax_dir)
    assert cfg.param_dtype == "float32" and cfg.n_routed_experts == E and not cfg.farskip.enabled
    assert not list(orbax_dir.parent.glob(".ckpt.farskip-tmp-*"))


def test_logits_match_hf(orbax_dir, hf_logits):
    logits = _our_logits(from_pretrained(orbax_dir))
    assert np.abs(logits - hf_logits).max() <= 1e-4


def test_roundtrip_bitwise_and_hf_loads(orbax_dir, hf_dir, hf_logits, tmp_path):
    out = tmp_path / "hf_back"
    assert cli(["--to-hf", "--input", str(orbax_dir), "--output", str(out), "--max-shard-size", "30KB",
                "--no-progress"]) == 0
    assert len(list(out.glob("*.safetensors"))) > 3 and (out / "model.safetensors.index.json").is_file()
    _same_tensors(_tensors(hf_dir), _tensors(out))
    model, info = transformers.DeepseekV2ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    np.testing.assert_array_equal(_hf_logits(model.eval()), hf_logits)


def test_bin_and_legacy_rope_config(bin_dir, tmp_path):
    out = tmp_path / "o"
    assert cli(["--input", str(bin_dir), "--output", str(out), "--no-progress"]) == 0
    cfg = load_model_config(out)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 4.0
    # Same parameters as loading the .bin directly (logits vs HF are covered by test_logits_match_hf).
    ours, direct = (nnx.to_pure_dict(nnx.state(from_pretrained(d), nnx.Param)) for d in (out, bin_dir))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), ours, direct)
    back = tmp_path / "back"
    assert cli(["--to-hf", "--input", str(out), "--output", str(back), "--no-progress"]) == 0
    _same_tensors(_tensors(bin_dir), _tensors(back))
    hf_cfg = json.loads((back / "config.json").read_text())
    assert hf_cfg["rope_parameters"]["rope_type"] == "yarn" and hf_cfg["rope_parameters"]["factor"] == 4.0


def test_restore_into_ep8_mesh(orbax_dir):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("expert",))
    model = from_pretrained(orbax_dir, mesh=mesh)
    w = model.layers[1].moe.experts.w_gate[...]
    assert w.shape == (E, 32, 16)
    for shard in w.addressable_shards:
        assert shard.data.shape == (1, 32, 16)
        assert shard.index[0] == slice(shard.device.id, shard.device.id + 1)
    ref = np.asarray(from_pretrained(orbax_dir).layers[1].moe.experts.w_gate[...])
    for shard in w.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index])
    q = model.layers[1].attn.q_proj[...]
    assert all(s.data.shape == q.shape for s in q.addressable_shards)  # replicated


def test_bf16_farskip_and_dry_run(hf_dir, tmp_path, capsys):
    out = tmp_path / "bf"
    args = ["--input", str(hf_dir), "--output", str(out), "--dtype", "bf16", "--farskip", "on",
            "--farskip-range", "1:2", "--no-progress"]
    assert cli(args + ["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "model.layers.1.mlp.experts.{0..7}.gate_proj.weight" in text
    assert "layers/1/moe/experts/w_gate" in text
    assert "bytes" in text and not out.exists()
    assert cli(args) == 0
    cfg = load_model_config(out)
    assert cfg.param_dtype == "bfloat16" and cfg.farskip.enabled and cfg.farskip.start_idx == 1
    model = from_pretrained(out)
    assert model.embed[...].dtype == jnp.bfloat16
    ref = TensorSource(hf_dir).read("model.embed_tokens.weight").astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(model.embed[...]), ref)
    back = tmp_path / "bfhf"
    assert cli(["--to-hf", "--input", str(out), "--output", str(back), "--no-progress"]) == 0
    hf_cfg = json.loads((back / "config.json").read_text())
    assert hf_cfg["farskip"] is True and hf_cfg["farskip_start_idx"] == 1 and hf_cfg["farskip_end_idx"] == 2
    assert TensorSource(back).dtype_name("lm_head.weight") == "bfloat16"


def test_training_checkpoint_to_hf(orbax_dir, hf_dir, tmp_path):
    """Assumed trainer layout: CheckpointManager items params (pure dict), opt_state, meta (JSON)."""
    import orbax.checkpoint as ocp

    from farskip_jax.checkpoint.orbax_io import restore_params
    from farskip_jax.config import to_dict

    cfg = load_model_config(orbax_dir)
    params = jax.tree.map(np.asarray, restore_params(orbax_dir, cfg))
    mngr = ocp.CheckpointManager(tmp_path / "run" / "checkpoints")
    mngr.save(7, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                         opt_state=ocp.args.StandardSave({"count": np.zeros((), np.int32)}),
                                         meta=ocp.args.JsonSave({"step": 7, "model_config": to_dict(cfg)})))
    mngr.wait_until_finished()
    out = tmp_path / "hf"
    assert cli(["--to-hf", "--input", str(tmp_path / "run" / "checkpoints" / "7"), "--output", str(out),
                "--no-progress"]) == 0
    _same_tensors(_tensors(hf_dir), _tensors(out))


FARSKIP_EXPORTS = {
    # Layer 0 is dense: "all" puts a dense layer in the range, "1:1" a regular layer after a FarSkip one.
    "all": {"farskip.enabled": True},
    "range_1_1": {"farskip.enabled": True, "farskip.start_idx": 1, "farskip.end_idx": 1},
    "attn_only": {"farskip.enabled": True, "farskip.attn_only": True},
    "mlp_only": {"farskip.enabled": True, "farskip.mlp_only": True},
}


SLOW_EXPORTS = ("range_1_1", "mlp_only")  # the other two cover both streams; these run with -m slow


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_EXPORTS else [])
                                  for n in sorted(FARSKIP_EXPORTS)])
def test_farskip_export_runs_farskip_in_transformers(name, orbax_dir, hf_logits, tmp_path, monkeypatch):
    """An exported FarSkip model carries its modeling file: transformers with trust_remote_code runs
    FarSkip (logits equal ours), while the stock class on the same directory runs the regular model."""
    from farskip_jax.checkpoint.to_hf import convert_orbax_to_hf

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    out = tmp_path / "hf"
    lines: list[str] = []
    convert_orbax_to_hf(orbax_dir, out, overrides=FARSKIP_EXPORTS[name], progress=False, log=lines.append)
    assert any("trust_remote_code=True" in ln for ln in lines), lines
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"].startswith("modeling_farskip_deepseek_v2.")
    assert (out / "modeling_farskip_deepseek_v2.py").is_file()

    ours = _our_logits(from_pretrained(out))  # reads the FarSkip keys of the exported config.json
    remote = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(remote).__name__ == "FarSkipDeepseekV2ForCausalLM"
    theirs = _hf_logits(remote)
    err = float(np.max(np.abs(theirs - ours)))
    print(f"{name}: max |HF remote code - ours| = {err:.2e}; FarSkip vs regular "
          f"{float(np.max(np.abs(theirs - hf_logits))):.2e}")
    assert err <= 1e-4  # fp32; the regular model's HF parity bound in this module
    assert np.max(np.abs(theirs - hf_logits)) > 1e-2  # FarSkip really is another function

    stock = transformers.DeepseekV2ForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(_hf_logits(stock), hf_logits, atol=1e-5)  # the trap the note warns of


def test_regular_export_has_no_remote_code(orbax_dir, tmp_path):
    out = tmp_path / "hf"
    assert cli(["--to-hf", "--input", str(orbax_dir), "--output", str(out), "--no-progress"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"] and "auto_map" not in cfg
    assert not (out / "modeling_farskip_deepseek_v2.py").exists()


# --------------------------------------------------------------------------------------------
# Validation: each error names the file and the tensor


def _variant(hf_dir: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    from safetensors.torch import save_file

    dst.mkdir()
    tensors = {k: torch.from_numpy(v.copy()) for k, v in _tensors(hf_dir).items()}
    cfg = json.loads((hf_dir / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(cfg)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


EMB = "model.embed_tokens.weight"
Q1 = "model.layers.1.self_attn.q_proj.weight"
CASES = {
    "missing": (lambda t: t.pop(Q1), None, [f"missing tensor '{Q1}'", "layers/1/attn/q_proj"]),
    "unexpected": (lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}), None,
                   ["model.safetensors: unexpected tensor 'model.layers.0.self_attn.extra.weight'"]),
    "shape": (lambda t: t.update({Q1: torch.zeros(47, 32)}), None,
              [f"model.safetensors: tensor '{Q1}' has shape [47, 32], expected [48, 32]"]),
    "dtype": (lambda t: t.update({Q1: torch.zeros(48, 32, dtype=torch.int64)}), None,
              [f"model.safetensors: tensor '{Q1}' has dtype int64"]),
    "experts": (None, lambda c: c.update(n_routed_experts=4, num_experts_per_tok=2),
                ["config.json n_routed_experts=4 but layer 1 has 8 routed experts",
                 "model.safetensors: tensor 'model.layers.1.mlp.experts.7."]),
    "hidden": (None, lambda c: c.update(hidden_size=48),
               [f"model.safetensors: tensor '{EMB}' has shape [64, 32] but config.json says vocab_size=64, "
                "hidden_size=48"]),
    "layers": (None, lambda c: c.update(num_hidden_layers=2),
               ["config.json num_hidden_layers=2 but the checkpoint has tensors for 3 layers"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validation_errors(case, hf_dir, tmp_path, capsys):
    edit_t, edit_c, expected = CASES[case]
    src = _variant(hf_dir, tmp_path / "src", edit_t, edit_c)
    out = tmp_path / "out"
    assert cli(["--input", str(src), "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, err
    assert not out.exists()


def test_mixed_dtype_needs_flag_and_output_dir_checks(hf_dir, tmp_path, capsys):
    src = _variant(hf_dir, tmp_path / "src", lambda t: t.update({EMB: t[EMB].half()}))
    out = tmp_path / "out"
    assert cli(["--input", str(src), "--output", str(out), "--no-progress"]) == 2
    assert "pass --dtype bf16 or fp32" in capsys.readouterr().err
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert cli(["--input", str(src), "--output", str(out), "--dtype", "fp32", "--no-progress"]) == 2
    assert "output directory exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").exists()
    assert cli(["--input", str(src), "--output", str(out), "--dtype", "fp32", "--overwrite",
                "--no-progress"]) == 0
    assert not (out / "keep.txt").exists() and (out / MARKER).exists()


def _kill_after_first_group(src: Path, out: Path, *extra: str) -> Path:
    """Runs the converter until its first group (with --to-hf: shard) is on disk, SIGKILLs it,
    returns its temp dir. With --to-hf the pause holds only the writer thread that finished the
    first shard: the other writers and the restores go on until the kill, mid-write."""
    env = {**os.environ, TEST_PAUSE_ENV: "120", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, str(REPO / "convert_torch_ckpt.py"), "--input", str(src),
                             "--output", str(out), "--no-progress", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, cwd=REPO, text=True)
    try:
        for line in proc.stdout:
            if "test pause" in line:
                break
        tmp = list(out.parent.glob(f".{out.name}.farskip-tmp-*"))
        # Really stopped mid-write: an Orbax partial save, or some finished shards of several.
        shards_done = tmp[0] / "shards_done.txt" if tmp else None
        assert tmp and (list(tmp[0].glob("*.partial_save")) or
                        0 < len(shards_done.read_text().split()) < 6)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    return tmp[0]


def test_interrupted_conversion_leaves_nothing_loadable(hf_dir, tmp_path):
    out = tmp_path / "killed"
    _kill_after_first_group(hf_dir, out)
    assert not out.exists()
    with pytest.raises(CheckpointError):
        from_pretrained(out)
    # The next conversion to the same name removes the dead run's temp dir and succeeds.
    assert cli(["--input", str(hf_dir), "--output", str(out), "--no-progress"]) == 0
    assert not list(tmp_path.glob(".killed.farskip-tmp-*")) and (out / MARKER).exists()
    shutil.rmtree(out)


def _saved_bits(directory: Path) -> dict:
    import orbax.checkpoint as ocp

    tree = ocp.StandardCheckpointer().restore((directory / "params").absolute())
    return {jax.tree_util.keystr(k): np.asarray(v).view(np.uint8)
            for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_resume_continues_a_killed_conversion_bitwise(hf_dir, orbax_dir, tmp_path, capsys):
    out = tmp_path / "resumed"
    tmp = _kill_after_first_group(hf_dir, out, "--mesh", "expert=8")
    # Other settings than the killed run's: refused, and the temp dir is kept.
    assert cli(["--input", str(hf_dir), "--output", str(out), "--mesh", "expert=8", "--dtype", "bf16",
                "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "interrupted conversion of something else (dtype was 'float32', now 'bfloat16')" in err
    assert tmp.is_dir()
    assert cli(["--input", str(hf_dir), "--output", str(out), "--mesh", "expert=8", "--resume",
                "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"resuming {out}: 1 of " in printed and "groups" in printed
    assert not list(tmp_path.glob(".resumed.farskip-tmp-*"))
    # Bitwise the uninterrupted conversion (orbax_dir: the same input and settings).
    ref, got = _saved_bits(orbax_dir), _saved_bits(out)
    assert sorted(got) == sorted(ref)
    assert all(np.array_equal(got[k], ref[k]) for k in ref)
    assert json.loads((out / MARKER).read_text()) == json.loads((orbax_dir / MARKER).read_text())
    assert (out / "model_config.json").read_text() == (orbax_dir / "model_config.json").read_text()
    assert not (out / "convert_plan.json").exists()
    # Nothing to resume: starts from the beginning, with a message.
    again = tmp_path / "fresh"
    assert cli(["--input", str(hf_dir), "--output", str(again), "--mesh", "expert=8", "--resume",
                "--no-progress"]) == 0
    assert "no interrupted conversion" in capsys.readouterr().out
    assert _saved_bits(again).keys() == ref.keys()


def test_to_hf_resume_continues_a_killed_export_bitwise(orbax_dir, tmp_path, capsys):
    """--to-hf --resume: killed mid-write with 3 writer threads after its first of six shards was
    listed, refused with another shard size, then continued with 1 worker: the listed shards are kept
    as they are, the others written again; every file equals an uninterrupted export's, byte for byte."""
    shard = ["--max-shard-size", "40KB"]
    ref = tmp_path / "ref"
    assert cli(["--to-hf", "--input", str(orbax_dir), "--output", str(ref), *shard, "--no-progress"]) == 0
    assert len(list(ref.glob("*.safetensors"))) == 6
    capsys.readouterr()
    out = tmp_path / "resumed"
    tmp = _kill_after_first_group(orbax_dir, out, "--to-hf", *shard, "--workers", "3")
    listed = (tmp / "shards_done.txt").read_text().split()
    # What a kill mid-write leaves of a shard not listed: written partly, or all of it but not synced.
    unlisted = [f"model-{i:05d}-of-00006.safetensors" for i in range(1, 7)
                if f"model-{i:05d}-of-00006.safetensors" not in listed]
    (tmp / unlisted[0]).write_bytes((ref / unlisted[0]).read_bytes()[:-7] + b"garbage")
    assert cli(["--to-hf", "--input", str(orbax_dir), "--output", str(out), "--max-shard-size", "30KB",
                "--resume", "--no-progress"]) == 2
    assert "(max_shard_size was '40KB', now '30KB')" in capsys.readouterr().err
    kept = {n: (tmp / n).stat().st_mtime_ns for n in listed}
    assert cli(["--to-hf", "--input", str(orbax_dir), "--output", str(out), *shard, "--resume",
                "--workers", "1", "--no-progress"]) == 0
    assert f"resuming {out}: {len(listed)} of 6 shards" in capsys.readouterr().out
    assert {n: (out / n).stat().st_mtime_ns for n in listed} == kept  # not written again
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in ref.iterdir())


def test_to_hf_resume_keeps_shards_finished_out_of_order(orbax_dir, tmp_path, capsys):
    """Shards are written at once and may finish in any order: a resumed export keeps every listed
    shard (here the 4th, without the 1st to 3rd: copied from an uninterrupted export) and writes the
    rest; a listed shard whose file is short is written again."""
    from farskip_jax.checkpoint.output_dir import PLAN_FILE, SHARDS_DONE
    from farskip_jax.checkpoint.to_hf import export_plan

    shard = ["--max-shard-size", "40KB"]
    ref = tmp_path / "ref"
    assert cli(["--to-hf", "--input", str(orbax_dir), "--output", str(ref), *shard, "--no-progress"]) == 0
    out = tmp_path / "out"
    # An interrupted export's temp dir as a dead process (pid 999999999) leaves it (the naming of
    # atomic_output_dir): its plan, one shard listed out of order, one listed but cut short.
    plan = export_plan(orbax_dir, "float32", {}, "40KB", None)
    tmp = out.parent / f".{out.name}.farskip-tmp-999999999"
    tmp.mkdir()
    (tmp / PLAN_FILE).write_text(json.dumps(plan))
    fourth, fifth = "model-00004-of-00006.safetensors", "model-00005-of-00006.safetensors"
    shutil.copyfile(ref / fourth, tmp / fourth)
    (tmp / fifth).write_bytes((ref / fifth).read_bytes()[:100])
    (tmp / SHARDS_DONE).write_text(f"{fourth}\n{fifth}\n")
    kept = (tmp / fourth).stat().st_mtime_ns
    assert cli(["--to-hf", "--input", str(orbax_dir), "--output", str(out), *shard, "--resume",
                "--no-progress"]) == 0
    assert f"resuming {out}: 1 of 6 shards" in capsys.readouterr().out
    assert (out / fourth).stat().st_mtime_ns == kept
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in ref.iterdir())


def test_workers_and_row_blocks_do_not_change_the_output(hf_dir, orbax_dir, tmp_path, monkeypatch, capsys):
    """1 or 3 workers, with 512-byte row blocks (every tensor larger than that read, cast and
    written in several blocks, several shards in flight): the parameters of the default run
    (2 workers, 64 MiB blocks) and byte-equal exports, in the stored fp32 and cast to bf16; and
    with `--buffered-writes`."""
    import convert_torch_ckpt
    from farskip_jax.checkpoint import common, convert

    assert convert_torch_ckpt.DEFAULT_WORKERS == convert.DEFAULT_WORKERS
    shard = ["--max-shard-size", "30KB", "--no-progress"]
    refs = {}
    for dtype in ("fp32", "bf16"):
        refs[dtype] = tmp_path / f"ref_{dtype}"
        assert cli(["--to-hf", "--input", str(orbax_dir), "--output", str(refs[dtype]), "--dtype", dtype,
                    *shard]) == 0
    monkeypatch.setattr(common, "BLOCK_BYTES", 512)
    ref_bits = _saved_bits(orbax_dir)
    for workers in ("1", "3"):
        conv = tmp_path / f"orbax_w{workers}"
        assert cli(["--input", str(hf_dir), "--output", str(conv), "--mesh", "expert=8", "--workers", workers,
                    "--no-progress"]) == 0
        got = _saved_bits(conv)
        assert sorted(got) == sorted(ref_bits) and all(np.array_equal(got[k], ref_bits[k]) for k in ref_bits)
        for dtype, ref in refs.items():
            out = tmp_path / f"hf_w{workers}_{dtype}"
            assert cli(["--to-hf", "--input", str(orbax_dir), "--output", str(out), "--dtype", dtype,
                        "--workers", workers, *shard]) == 0
            assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
            assert all((out / p.name).read_bytes() == p.read_bytes() for p in ref.iterdir()), (workers, dtype)
    capsys.readouterr()
    assert cli(["--input", str(hf_dir), "--output", str(tmp_path / "w0"), "--workers", "0"]) == 2
    assert "--workers 0: expected an integer >= 1" in capsys.readouterr().err
    # Through the page cache: the same files (the default writes with O_DIRECT where it can).
    out = tmp_path / "hf_buffered"
    assert cli(["--to-hf", "--input", str(orbax_dir), "--output", str(out), "--dtype", "bf16",
                "--buffered-writes", *shard]) == 0
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in refs["bf16"].iterdir())
    capsys.readouterr()
    assert cli(["--input", str(hf_dir), "--output", str(tmp_path / "b"), "--buffered-writes"]) == 2
    assert "--buffered-writes applies to --to-hf only" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The output is one standard Orbax checkpoint; version-1 directories (one checkpoint per group) load


def _str_keys(tree):
    return {str(k): _str_keys(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def test_plain_orbax_restores_the_whole_tree(orbax_dir):
    """No farskip code: v0 StandardCheckpointer on OUT/params, v1 load on OUT, and a
    CheckpointManager-style Composite restore of item "params" each give our loader's params."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint.experimental import v1

    from farskip_jax.checkpoint.orbax_io import restore_params

    ours = _str_keys(jax.tree.map(np.asarray, restore_params(orbax_dir, load_model_config(orbax_dir))))
    std = ocp.StandardCheckpointer().restore((orbax_dir / "params").absolute())
    loaded = v1.load(orbax_dir)
    composite = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
        orbax_dir.absolute(), args=ocp.args.Composite(params=ocp.args.StandardRestore(
            jax.tree.map(ocp.utils.to_shape_dtype_struct, ours))))["params"]
    for tree in (std, loaded, composite):
        assert jax.tree.structure(tree) == jax.tree.structure(ours)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), tree, ours)


def _write_version1(src: Path, dst: Path) -> None:
    """`src` (a version-2 directory) rewritten in the version-1 layout: params/<group>/ + index."""
    import orbax.checkpoint as ocp

    from farskip_jax.checkpoint.common import nest_get, nest_set
    from farskip_jax.checkpoint.convert import group_specs
    from farskip_jax.checkpoint.hf_keys import param_specs
    from farskip_jax.checkpoint.orbax_io import restore_params

    cfg = load_model_config(src)
    params = jax.tree.map(np.asarray, restore_params(src, cfg))
    dst.mkdir()
    for f in ("config.json", "model_config.json"):
        shutil.copyfile(src / f, dst / f)
    marker = json.loads((src / MARKER).read_text())
    groups = []
    ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())  # what version 1 wrote with
    for g in group_specs(param_specs(cfg)):
        tree: dict = {}
        for s in g.specs:
            nest_set(tree, s.path, nest_get(params, s.path))
        ckptr.save((dst / "params" / g.name).absolute(), args=ocp.args.StandardSave(tree))
        groups.append({"name": g.name, "dir": f"params/{g.name}",
                       "params": [{"path": list(s.path), "shape": list(s.shape)} for s in g.specs]})
    marker.update(version=1, groups=groups)
    del marker["params"]
    (dst / MARKER).write_text(json.dumps(marker))


def test_version1_layout_still_loads(orbax_dir, hf_dir, hf_logits, tmp_path):
    old = tmp_path / "v1"
    _write_version1(orbax_dir, old)
    assert (old / "params" / "embed" / "_METADATA").is_file()
    assert np.abs(_our_logits(from_pretrained(old)) - hf_logits).max() <= 1e-4
    back = tmp_path / "hf"
    assert cli(["--to-hf", "--input", str(old), "--output", str(back), "--no-progress"]) == 0
    _same_tensors(_tensors(hf_dir), _tensors(back))



# `python -c _LIMITED_CLI SCRIPT BYTES ARGS...`: SCRIPT with ARGS in a child whose files may not
# grow past BYTES (set in the child itself: a preexec_fn would fork this multithreaded process).
_LIMITED_CLI = """
import resource, runpy, signal, sys
script, limit = sys.argv[1], int(sys.argv[2])
sys.argv = [script, *sys.argv[3:]]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
runpy.run_path(script, run_name="__main__")
"""


def test_a_refused_write_ends_in_one_error_line_and_resumes(hf_dir, orbax_dir, tmp_path, capsys):
    """HF -> Orbax where the storage refuses a write (a 16 KiB file size limit: the first groups'
    data files pass, a later one does not; a full disk or a quota fail the same way): an `error:`
    line naming the file TensorStore was writing, exit status 2, the committed groups kept, and once
    the limit is lifted `--resume` completes it bitwise equal to an uninterrupted run."""
    out = tmp_path / "out"
    cmd = ["--input", str(hf_dir), "--mesh", "expert=8", "--output", str(out), "--no-progress"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _LIMITED_CLI, str(REPO / "convert_torch_ckpt.py"), "16384",
                           *cmd], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # Orbax logs its own traceback too, from its threads, before or after ours.
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1, proc.stderr[-3000:]
    assert ours[0].startswith("error: writing the Orbax checkpoint in ") and "/ocdbt.process_0/d/" in ours[0]
    assert "File too large" in ours[0]
    assert "rerun the same command with --resume" in proc.stdout
    assert cli([*cmd, "--resume"]) == 0
    assert "resuming" in capsys.readouterr().out
    ref, got = _saved_bits(orbax_dir), _saved_bits(out)
    assert sorted(got) == sorted(ref) and all(np.array_equal(got[k], ref[k]) for k in ref)


def test_a_refused_write_of_the_export_is_one_error_line(orbax_dir, tmp_path, capsys, file_size_limit):
    """Orbax -> HF with a 4 KiB file size limit (its first write, the temp dir's plan, is larger):
    `error: writing <output>: File too large`, exit status 2, nothing else on stderr."""
    out = tmp_path / "out"
    with file_size_limit(4096):
        rc = cli(["--to-hf", "--input", str(orbax_dir), "--output", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"error: writing {out}: File too large\n", err
