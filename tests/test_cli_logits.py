"""`python -m farskip_jax logits` on a tiny saved HF checkpoint: HF parity, FarSkip flags, errors."""

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

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = tiny_hf_config(q_lora_rank=12, routed_scaling_factor=1.5)
    hf = build_hf(cfg, seed=11)
    d = save_hf(hf, tmp_path_factory.mktemp("cli_ckpt"))
    ids = random_ids(cfg.vocab_size, batch=2, seq=17, seed=5)
    ids_file = d.parent / "ids.npy"
    np.save(ids_file, ids)
    return dict(dir=d, ids=ids, ids_file=ids_file, ref=hf_logits(hf, ids), vocab=cfg.vocab_size)


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
                 "farskip_start_idx", "attn_only_farskip", "float32 [batch, seq, vocab_size]"):
        assert word in text, word
