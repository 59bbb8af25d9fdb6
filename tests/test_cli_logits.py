"""`python -m farskip_jax logits` on a tiny saved HF checkpoint: HF parity, FarSkip flags, errors,
and the sharded forward (`--mesh`: expert and tensor parallel on 8 host devices)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "model"))
from hf_tiny import build_hf, hf_logits, max_abs_err, random_ids, record, save_hf, tiny_hf_config  # noqa: E402

from farskip_jax import cli_logits  # noqa: E402
from farskip_jax.config import MeshConfig  # noqa: E402
from farskip_jax.errors import UserError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# fp32: a sharded run against the single-device CLI, and either against HF's torch model.
SHARDED_TOL, HF_TOL = 1e-5, 1e-4
# --mesh -> (ids set, batch after padding): batch 2 is padded for data x expert = 8, batch 8 is not.
MESH_RUNS = {"expert=8": ("ids", 8), "data=2,expert=4": ("ids8", 8), "tensor=8": ("ids", 2)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # 8 heads (and 8 experts, MLP widths 48 and 16) so that --mesh tensor=8 splits every layer evenly.
    cfg = tiny_hf_config(q_lora_rank=12, routed_scaling_factor=1.5, num_attention_heads=8)
    hf = build_hf(cfg, seed=11)
    d = save_hf(hf, tmp_path_factory.mktemp("cli_ckpt"))
    out = dict(dir=d, vocab=cfg.vocab_size)
    for name, batch in (("ids", 2), ("ids8", 8)):
        ids = random_ids(cfg.vocab_size, batch=batch, seq=17, seed=5 + batch)
        np.save(d.parent / f"{name}.npy", ids)
        out.update({name: ids, f"{name}_file": d.parent / f"{name}.npy", f"{name}_ref": hf_logits(hf, ids)})
    out["ref"] = out["ids_ref"]
    return out


def clean_env() -> dict[str, str]:
    """The caller's environment without any JAX platform or device-count setting (conftest sets
    both for this process): the CLI must find the CPU and make its 8 host devices itself."""
    drop = ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_NUM_CPU_DEVICES")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(JAX_COMPILATION_CACHE_DIR=str(REPO / ".jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    return env


@pytest.fixture(scope="module")
def mesh_procs(ckpt, tmp_path_factory, request):
    """Starts the selected sharded CLI runs at once (interpreter start-up and imports dominate a run,
    and overlap), each in a clean environment; tests wait for their own."""
    out_dir = tmp_path_factory.mktemp("mesh_out")
    selected = {item.callspec.params["mesh"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_cli_mesh_subprocess_equals_single_device"}
    procs = {}
    for mesh, (ids_name, _) in MESH_RUNS.items():
        if mesh not in selected:
            continue
        out = out_dir / f"{mesh.replace(',', '_').replace('=', '')}.npy"
        cmd = [sys.executable, "-m", "farskip_jax", "logits", "--checkpoint", str(ckpt["dir"]),
               "--input-ids", str(ckpt[f"{ids_name}_file"]), "--out", str(out), "--mesh", mesh]
        procs[mesh] = (subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True), out)
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def single(ckpt, tmp_path_factory):
    """Single-device CLI logits (in process) for both id sets: what every --mesh run must equal."""
    d = tmp_path_factory.mktemp("single")
    out = {}
    for name in ("ids", "ids8"):
        assert cli_logits.main(["--checkpoint", str(ckpt["dir"]), "--input-ids", str(ckpt[f"{name}_file"]),
                                "--out", str(d / f"{name}.npy")]) == 0
        out[name] = np.load(d / f"{name}.npy")
    return out


def test_cli_subprocess_matches_hf(ckpt, tmp_path):
    out = tmp_path / "sub" / "logits.npy"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(REPO / ".jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    proc = subprocess.run([sys.executable, "-m", "farskip_jax", "logits", "--checkpoint", str(ckpt["dir"]),
                           "--input-ids", str(ckpt["ids_file"]), "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    logits = np.load(out)
    assert logits.dtype == np.float32 and logits.shape == (2, 17, ckpt["vocab"])
    err = max_abs_err(logits, ckpt["ref"])
    record("cli_logits", "subprocess_farskip_off", err)
    assert err <= 1e-4
    assert "farskip off" in proc.stderr


def test_cli_farskip_flags_change_logits(ckpt, tmp_path):
    """In process (the subprocess test covers the entry point): --farskip on and a range."""
    on = tmp_path / "on.npy"
    assert cli_logits.main(["--checkpoint", str(ckpt["dir"]), "--input-ids", str(ckpt["ids_file"]),
                            "--out", str(on), "--farskip", "on"]) == 0
    assert max_abs_err(np.load(on), ckpt["ref"]) > 0.1
    ranged = tmp_path / "range.npy"
    assert cli_logits.main(["--checkpoint", str(ckpt["dir"]), "--input-ids", str(ckpt["ids_file"]),
                            "--out", str(ranged), "--farskip-range", "2:2"]) == 0
    assert max_abs_err(np.load(ranged), ckpt["ref"]) > 1e-3
    assert max_abs_err(np.load(ranged), np.load(on)) > 1e-3


def test_farskip_overrides_from_flags():
    parse = cli_logits.build_parser().parse_args
    common = ["--checkpoint", "d", "--input-ids", "i.npy", "--out", "o.npy"]
    assert cli_logits.farskip_overrides(parse(common)) == {}
    assert cli_logits.farskip_overrides(parse(common + ["--farskip", "off"])) == {"farskip.enabled": False}
    assert cli_logits.farskip_overrides(parse(common + ["--farskip-range", "1:"])) == {
        "farskip.enabled": True, "farskip.start_idx": 1, "farskip.end_idx": None}
    mode = ["--farskip", "on", "--farskip-mode", "attn_only"]
    assert cli_logits.farskip_overrides(parse(common + mode)) == {
        "farskip.enabled": True, "farskip.attn_only": True, "farskip.mlp_only": False}
    for bad in ("3", "a:b", "5:2", "-1:2"):
        with pytest.raises(cli_logits.CliError, match="--farskip-range"):
            cli_logits.farskip_overrides(parse(common + [f"--farskip-range={bad}"]))
    with pytest.raises(cli_logits.CliError, match="--farskip off"):
        cli_logits.farskip_overrides(parse(common + ["--farskip", "off", "--farskip-range", "0:1"]))


@pytest.mark.parametrize("kind,needle", [
    ("missing", "no such file"), ("garbage", "not a readable .npy"), ("float", "not an integer type"),
    ("rank1", "expected rank 2"), ("vocab", "outside the vocabulary [0, 96)"), ("negative", "token id -1"),
])
def test_cli_input_errors(ckpt, tmp_path, capsys, kind, needle):
    f = tmp_path / "ids.npy"
    if kind == "garbage":
        f.write_bytes(b"not numpy")
    elif kind == "float":
        np.save(f, ckpt["ids"].astype(np.float32))
    elif kind == "rank1":
        np.save(f, ckpt["ids"][0])
    elif kind == "vocab":
        np.save(f, np.full((1, 4), ckpt["vocab"], np.int32))
    elif kind == "negative":
        np.save(f, np.array([[1, -1]], np.int64))
    rc = cli_logits.main(["--checkpoint", str(ckpt["dir"]), "--input-ids", str(f), "--out",
                          str(tmp_path / "o.npy")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --input-ids") and needle in err
    assert not (tmp_path / "o.npy").exists()


def test_cli_bad_checkpoint_and_range(ckpt, tmp_path, capsys):
    out = str(tmp_path / "o.npy")
    ids = str(ckpt["ids_file"])
    assert cli_logits.main(["--checkpoint", str(tmp_path), "--input-ids", ids, "--out", out]) == 2
    assert "config.json" in capsys.readouterr().err
    assert cli_logits.main(["--checkpoint", str(ckpt["dir"]), "--input-ids", ids, "--out", out,
                            "--farskip-range", "0:7"]) == 2
    assert "model.farskip.end_idx" in capsys.readouterr().err


def test_main_dispatch_and_help(capsys):
    from farskip_jax.__main__ import main

    assert main([]) == 2 and "logits" in capsys.readouterr().out
    assert main(["nope"]) == 2 and "unknown subcommand" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["logits", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for word in ("--checkpoint", "--input-ids", "--out", "--farskip", "--farskip-range", "--dtype",
                 "farskip_start_idx", "attn_only_farskip", "float32 [batch, seq, vocab_size]", "--mesh",
                 "data=2,expert=4", "tensor=8", "xla_force_host_platform_device_count"):
        assert word in text, word


# The data x expert and tensor runs in a fresh process are `slow` (CI time budget): the clean-process
# path is the same for every mesh, and both meshes run in process below (FarSkip) and at the model
# level for both connectivities (tests/parallel/test_exactness.py).
@pytest.mark.parametrize("mesh", [m if m == "expert=8" else pytest.param(m, marks=pytest.mark.slow)
                                  for m in MESH_RUNS])
def test_cli_mesh_subprocess_equals_single_device(ckpt, mesh_procs, single, mesh):
    """`--mesh` in a fresh process with no JAX_PLATFORMS / XLA_FLAGS: 8 host devices made by the
    CLI, the same file as the single-device run (fp32, [batch, T, vocab]) to 1e-5, HF to 1e-4."""
    ids_name, padded = MESH_RUNS[mesh]
    proc, out = mesh_procs[mesh]
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    batch = ckpt[ids_name].shape[0]
    kind = "tensor parallel" if mesh.startswith("tensor") else "expert parallel"
    pad_note = f", batch padded {batch} -> {padded} and stripped)" if padded != batch else ")"
    assert f"farskip off; dtype float32; mesh {mesh} ({kind}, 8 devices{pad_note}" in stderr, stderr
    logits = np.load(out)
    assert logits.dtype == np.float32 and logits.shape == (batch, 17, ckpt["vocab"])
    err_single = max_abs_err(logits, single[ids_name])
    err_hf = max_abs_err(logits, ckpt[f"{ids_name}_ref"])
    record("cli_logits_mesh", f"{mesh}/vs_single_device", err_single)
    record("cli_logits_mesh", f"{mesh}/vs_hf", err_hf)
    assert err_single <= SHARDED_TOL and err_hf <= HF_TOL


@pytest.mark.parametrize("mesh", ["data=2,expert=4", "tensor=8"])
def test_cli_mesh_farskip_equals_single_device(ckpt, tmp_path, mesh):
    """FarSkip connectivity (two residual streams) under EP and TP, in process (conftest's 8 host
    devices): the sharded recurrence equals the single-device one."""
    common = ["--checkpoint", str(ckpt["dir"]), "--input-ids", str(ckpt["ids_file"]),
              "--farskip-range", "1:2"]
    assert cli_logits.main(common + ["--out", str(tmp_path / "one.npy")]) == 0
    assert cli_logits.main(common + ["--out", str(tmp_path / "mesh.npy"), "--mesh", mesh]) == 0
    one, sharded = np.load(tmp_path / "one.npy"), np.load(tmp_path / "mesh.npy")
    err = max_abs_err(sharded, one)
    record("cli_logits_mesh", f"{mesh}/farskip_1:2_vs_single_device", err)
    assert err <= SHARDED_TOL
    assert max_abs_err(sharded, ckpt["ref"]) > 1e-3  # FarSkip was on: not the regular model


def test_parse_mesh():
    assert cli_logits.parse_mesh("expert=8") == MeshConfig(expert=8)
    assert cli_logits.parse_mesh(" data = 2 , expert=4") == MeshConfig(data=2, expert=4)
    assert cli_logits.parse_mesh("tensor=8") == MeshConfig(tensor=8)
    for bad, needle in [("", "expected AXIS=N"), ("expert", "expected AXIS=N"),
                        ("gpu=8", "unknown axis 'gpu'"), ("expert=8,expert=2", "given twice"),
                        ("expert=x", "must be an integer"),
                        ("expert=0", ">= 1"), ("tensor=2,expert=4", "tensor cannot be combined"),
                        ("data=2,tensor=4", "use --mesh tensor=4")]:
        with pytest.raises(UserError, match="--mesh") as e:
            cli_logits.parse_mesh(bad)
        assert needle in str(e.value), (bad, str(e.value))


def test_host_device_flags():
    """XLA_FLAGS gets the host device count only for a CPU run whose user chose no count."""
    flags = cli_logits.host_device_flags
    force = "--xla_force_host_platform_device_count=8"
    assert flags(8, "", "cpu", False, -1) == force
    assert flags(8, "--xla_cpu_foo=1 ", "cpu", False, -1) == f"--xla_cpu_foo=1 {force}"
    assert flags(8, "", None, False, -1) == force  # platform unset, no accelerator node: JAX picks the CPU
    assert flags(8, "", "cpu,cuda", True, -1) == force
    assert flags(8, "", None, True, -1) is None  # an accelerator will be used: leave the host alone
    assert flags(8, "", "cuda", False, -1) is None
    assert flags(1, "", "cpu", False, -1) is None  # one device exists anyway
    assert flags(8, "--xla_force_host_platform_device_count=4", "cpu", False, -1) is None  # the user's
    assert flags(8, "", "cpu", False, 2) is None  # JAX_NUM_CPU_DEVICES is the user's choice too


@pytest.mark.parametrize("mesh,needle", [
    ("expert=8,tensor=2", "tensor cannot be combined with expert or data"),
    ("expert:8", "expected AXIS=N"),
    ("data=2,expert=8", "needs 16 devices, 8 cpu device(s) available"),
    ("expert=3", "expert=3 does not divide the checkpoint's 8 routed experts"),
    ("tensor=3", "tensor=3 does not split the checkpoint's attention heads (8), routed experts (8), "
     "shared-expert width (16); tensor sizes that do, up to 5: 1, 2, 4"),
])
def test_cli_mesh_errors(ckpt, tmp_path, capsys, mesh, needle):
    out = tmp_path / "o.npy"
    rc = cli_logits.main(["--checkpoint", str(ckpt["dir"]), "--input-ids", str(ckpt["ids_file"]),
                          "--out", str(out), "--mesh", mesh])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --mesh") and needle in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_cli_missing_checkpoint_is_user_error(ckpt, tmp_path, capsys):
    rc = cli_logits.main(["--checkpoint", str(tmp_path / "nope"), "--input-ids", str(ckpt["ids_file"]),
                          "--out", str(tmp_path / "o.npy"), "--mesh", "expert=8"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == (f"error: --checkpoint {tmp_path / 'nope'}: no such directory "
                                               "(expected an HF checkpoint with config.json and weights)")
