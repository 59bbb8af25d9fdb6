"""convert_torch_ckpt.py: validation errors, interrupted and resumed conversions (both directions),
parallel workers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from convert_env import (  # noqa: E402
    REPO,
    read_tensors,
    saved_bits,
    torch,
)

from convert_torch_ckpt import main as cli  # noqa: E402
from farskip_jax import from_pretrained  # noqa: E402
from farskip_jax.checkpoint.hf_io import CheckpointError  # noqa: E402
from farskip_jax.checkpoint.orbax_io import MARKER  # noqa: E402
from farskip_jax.checkpoint.output_dir import TEST_PAUSE_ENV  # noqa: E402

# --------------------------------------------------------------------------------------------
# Validation: each error names the file and the tensor


def _variant(hf_dir: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    from safetensors.torch import save_file

    dst.mkdir()
    tensors = {k: torch.from_numpy(v.copy()) for k, v in read_tensors(hf_dir).items()}
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
    ref, got = saved_bits(orbax_dir), saved_bits(out)
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
    assert saved_bits(again).keys() == ref.keys()


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
    ref_bits = saved_bits(orbax_dir)
    for workers in ("1", "3"):
        conv = tmp_path / f"orbax_w{workers}"
        assert cli(["--input", str(hf_dir), "--output", str(conv), "--mesh", "expert=8", "--workers", workers,
                    "--no-progress"]) == 0
        got = saved_bits(conv)
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
