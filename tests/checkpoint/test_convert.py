"""convert_torch_ckpt.py: HF <-> Orbax round trips, logits, EP restore, the on-disk layout (interruption,
resume and validation: test_convert_resume.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch")
pytest.importorskip("transformers")

from convert_env import (  # noqa: E402
    REPO,
    E,
    hf_logits_of,
    our_logits,
    read_tensors,
    same_tensors,
    saved_bits,
    torch,
    transformers,
)

from convert_torch_ckpt import main as cli  # noqa: E402
from farskip_jax import from_pretrained  # noqa: E402
from farskip_jax.checkpoint.hf_io import TensorSource  # noqa: E402
from farskip_jax.checkpoint.orbax_io import MARKER, load_model_config  # noqa: E402


@pytest.fixture(scope="module")
def bin_dir(hf_dir, tmp_path_factory):
    """The same weights as pytorch_model.bin (torch.save of the state dict) + a legacy yarn config."""
    d = tmp_path_factory.mktemp("hfbin")
    sd = {k: torch.from_numpy(v.copy()) for k, v in read_tensors(hf_dir).items()}
    torch.save(sd, d / "pytorch_model.bin")
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = 10000.0
    cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                           "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    (d / "config.json").write_text(json.dumps(cfg))
    return d



def test_layout_and_config(orbax_dir, hf_dir):
    assert (orbax_dir / MARKER).is_file() and (orbax_dir / "params" / "_METADATA").is_file()
    original = json.loads((hf_dir / "config.json").read_text())
    assert json.loads((orbax_dir / "config.json").read_text()) == original
    cfg = load_model_config(orbax_dir)
    assert cfg.param_dtype == "float32" and cfg.n_routed_experts == E and not cfg.farskip.enabled
    assert not list(orbax_dir.parent.glob(".ckpt.farskip-tmp-*"))


def test_logits_match_hf(orbax_dir, hf_logits):
    logits = our_logits(from_pretrained(orbax_dir))
    assert np.abs(logits - hf_logits).max() <= 1e-4


def test_roundtrip_bitwise_and_hf_loads(orbax_dir, hf_dir, hf_logits, tmp_path):
    out = tmp_path / "hf_back"
    assert cli(["--to-hf", "--input", str(orbax_dir), "--output", str(out), "--max-shard-size", "30KB",
                "--no-progress"]) == 0
    assert len(list(out.glob("*.safetensors"))) > 3 and (out / "model.safetensors.index.json").is_file()
    same_tensors(read_tensors(hf_dir), read_tensors(out))
    model, info = transformers.DeepseekV2ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    np.testing.assert_array_equal(hf_logits_of(model.eval()), hf_logits)


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
    same_tensors(read_tensors(bin_dir), read_tensors(back))
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
    same_tensors(read_tensors(hf_dir), read_tensors(out))


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

    ours = our_logits(from_pretrained(out))  # reads the FarSkip keys of the exported config.json
    remote = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(remote).__name__ == "FarSkipDeepseekV2ForCausalLM"
    theirs = hf_logits_of(remote)
    err = float(np.max(np.abs(theirs - ours)))
    print(f"{name}: max |HF remote code - ours| = {err:.2e}; FarSkip vs regular "
          f"{float(np.max(np.abs(theirs - hf_logits))):.2e}")
    assert err <= 1e-4  # fp32; the regular model's HF parity bound in this module
    assert np.max(np.abs(theirs - hf_logits)) > 1e-2  # FarSkip really is another function

    stock = transformers.DeepseekV2ForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(hf_logits_of(stock), hf_logits, atol=1e-5)  # the trap the note warns of


def test_regular_export_has_no_remote_code(orbax_dir, tmp_path):
    out = tmp_path / "hf"
    assert cli(["--to-hf", "--input", str(orbax_dir), "--output", str(out), "--no-progress"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"] and "auto_map" not in cfg
    assert not (out / "modeling_farskip_deepseek_v2.py").exists()



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
    assert np.abs(our_logits(from_pretrained(old)) - hf_logits).max() <= 1e-4
    back = tmp_path / "hf"
    assert cli(["--to-hf", "--input", str(old), "--output", str(back), "--no-progress"]) == 0
    same_tensors(read_tensors(hf_dir), read_tensors(back))



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
    ref, got = saved_bits(orbax_dir), saved_bits(out)
    assert sorted(got) == sorted(ref) and all(np.array_equal(got[k], ref[k]) for k in ref)


def test_a_refused_write_of_the_export_is_one_error_line(orbax_dir, tmp_path, capsys, file_size_limit):
    """Orbax -> HF with a 4 KiB file size limit (its first write, the temp dir's plan, is larger):
    `error: writing <output>: File too large`, exit status 2, nothing else on stderr."""
    out = tmp_path / "out"
    with file_size_limit(4096):
        rc = cli(["--to-hf", "--input", str(orbax_dir), "--output", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"error: writing {out}: File too large\n", err
