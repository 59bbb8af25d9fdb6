"""Host-memory and throughput check of convert_torch_ckpt.py on a multi-GB synthetic checkpoint.

Builds a DeepSeek-V2-Lite-shaped HF checkpoint with fewer layers (random bf16, sharded
safetensors written tensor by tensor, legacy `rope_scaling` config), converts it HF -> Orbax and
back in subprocesses, and prints GB/s and each child's peak RSS against the bound the converter is
designed for: the import baseline (python + jax + orbax, measured) + 4 x the largest group (two
groups in flight: the one being written, with TensorStore's write buffers, and the next one being
read) + 512 MiB slack.

The disk's own sequential write speed (64 MiB blocks, fdatasync) is measured in the same run, before
and after the conversions, on the same file system; each conversion's time includes an fdatasync of
every file it wrote (the converter syncs its own files; this makes the comparison fair regardless),
so both GB/s are rates to stable storage. The input is read from the page cache (the bench just
wrote it), as on a machine whose RAM holds the shard being read.
Not a test:  python bench/convert_rss.py [--layers 3] [--workdir /tmp] [--keep] [--compress]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from farskip_jax import hf_config  # noqa: E402
from farskip_jax.checkpoint.convert import group_specs  # noqa: E402
from farskip_jax.checkpoint.hf_io import np_dtype  # noqa: E402
from farskip_jax.checkpoint.hf_keys import param_specs  # noqa: E402
from farskip_jax.checkpoint.to_hf import ShardWriter, plan_shards  # noqa: E402
from farskip_jax.config import ModelConfig  # noqa: E402

MiB = 2**20


def dsv2_lite_config(layers: int) -> dict:
    return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
            "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
            "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 16,
            "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1,
            "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False, "rms_norm_eps": 1e-6,
            "rope_theta": 10000, "max_position_embeddings": 163840, "hidden_act": "silu",
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def write_synthetic(d: Path, layers: int) -> tuple[ModelConfig, int]:
    hf = dsv2_lite_config(layers)
    cfg = hf_config.model_config(hf)
    specs = param_specs(cfg)
    entries = [(k, s.hf_shape, "bfloat16") for s in specs for k in s.hf_keys]
    shards = plan_shards(entries, 1_000_000_000)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    # Random values from a 32 Mi-element pool at varying offsets: real entropy for the compressor,
    # without paying for a fresh normal draw per element.
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(32 * MiB, np.float32) * 0.02).astype(np_dtype("bfloat16"))
    total, off = 0, 0
    for name, shard in zip(names, shards, strict=True):
        w = ShardWriter(d / name, shard)
        for key, shape, _ in shard:
            n = int(np.prod(shape))
            w.write(key, np.resize(pool[off:], n).reshape(shape))  # cyclic, n elements allocated
            off = (off + 7919 * 13) % (pool.size // 2)
            total += n * 2
        w.close()
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for i, sh in enumerate(shards)
                                                                for k, *_ in sh}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text(json.dumps(hf, indent=1))
    return cfg, total


def disk_write_speed(d: Path, nbytes: int) -> float:
    """Sequential write of `nbytes` in 64 MiB blocks + fdatasync, in GB/s (the file is removed)."""
    block = np.random.default_rng(1).integers(0, 256, 64 * MiB, dtype=np.uint8).tobytes()
    f = d / "disk_speed.bin"
    t0 = time.perf_counter()
    with open(f, "wb") as fh:
        written = 0
        while written < nbytes:
            fh.write(block)
            written += len(block)
        fh.flush()
        os.fdatasync(fh.fileno())
    dt = time.perf_counter() - t0
    f.unlink()
    return written / dt / 1e9


def sync_tree(d: Path) -> None:
    for f in d.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)


def run_child(args: list[str]) -> tuple[float, float, int]:
    """(seconds, peak RSS MiB, return code) of one child, its own rusage from os.wait4."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - t0, usage.ru_maxrss / 1024, proc.returncode  # ru_maxrss is KiB on Linux


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3, help="decoder layers (1 dense + N-1 MoE); 3 -> ~3.3 GB")
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    ap.add_argument("--keep", action="store_true", help="keep the generated directories")
    ap.add_argument("--compress", action="store_true", help="convert with --compress (zstd)")
    ap.add_argument("--generate", metavar="DIR", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.generate:
        write_synthetic(Path(a.generate), a.layers)
        return 0
    work = Path(tempfile.mkdtemp(prefix="farskip_convert_bench_", dir=a.workdir))
    try:
        src = work / "hf"
        src.mkdir()
        t0 = time.perf_counter()
        # Generated in a child: with vfork + exec, a child's ru_maxrss starts at the parent's
        # high-water mark, so the parent must never hold the big arrays itself.
        subprocess.run([sys.executable, __file__, "--generate", str(src), "--layers", str(a.layers)],
                       check=True)
        cfg = hf_config.model_config(json.loads((src / "config.json").read_text()))
        total = json.loads((src / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        n_files = len(list(src.glob("*.safetensors")))
        print(f"synthetic HF checkpoint: {total / 1e9:.2f} GB, {n_files} shards, "
              f"written in {time.perf_counter() - t0:.1f} s")
        groups = group_specs(param_specs(cfg))
        largest = max(sum(int(np.prod(s.shape)) for s in g.specs) * 2 for g in groups)
        # Baseline: a child that imports what the converter imports, and nothing else.
        base_s, base_rss, _ = run_child(["-c", "import convert_torch_ckpt, orbax.checkpoint, jax, "
                                         "farskip_jax.checkpoint.to_hf; jax.devices()"])
        bound = base_rss + 4 * largest / MiB + 512
        print(f"import baseline RSS {base_rss:.0f} MiB; largest group {largest / MiB:.0f} MiB; "
              f"bound = baseline + 4 x largest group + 512 MiB = {bound:.0f} MiB")
        subprocess.run(["sync"], check=False)  # the generated input: flushed before timing anything
        # This disk's speed drifts by 3x within a minute (shared, burst-credited), so it is measured
        # right before and right after each direction, and each direction is compared with the mean.
        disk_bytes = min(total, 2 * 10**9)
        disk = [disk_write_speed(work, disk_bytes)]
        print(f"disk sequential write (fdatasync): {disk[-1]:.3f} GB/s")
        extra = ["--compress"] if a.compress else []
        results = []
        for label, out, cmd in (("HF -> Orbax", work / "orbax",
                                 ["convert_torch_ckpt.py", "--input", str(src), "--output",
                                  str(work / "orbax"), "--no-progress", *extra]),
                                ("Orbax -> HF", work / "hf_back",
                                 ["convert_torch_ckpt.py", "--to-hf", "--input", str(work / "orbax"),
                                  "--output", str(work / "hf_back"), "--no-progress"])):
            t0 = time.perf_counter()
            _, rss, rc = run_child(cmd)
            sync_tree(out)
            dt = time.perf_counter() - t0
            if rc:
                print(f"{label}: FAILED rc={rc}")
                return 1
            disk.append(disk_write_speed(work, disk_bytes))
            results.append((label, dt, rss, disk[-2], disk[-1]))
            print(f"disk sequential write (fdatasync): {disk[-1]:.3f} GB/s")
            print(f"{label}: {total / 1e9:.2f} GB in {dt:.1f} s (incl. ~{base_s:.0f} s start-up) = "
                  f"{total / dt / 1e9:.3f} GB/s; peak RSS {rss:.0f} MiB vs bound {bound:.0f} MiB -> "
                  f"{'OK' if rss <= bound else 'ABOVE BOUND'}")
        du = sum(f.stat().st_size for f in (work / "orbax").rglob("*") if f.is_file())
        print(f"Orbax directory: {du / 1e9:.2f} GB on disk ({'zstd' if a.compress else 'uncompressed'})")
        print("\n| direction | disk write (fdatasync) before / after | time | GB/s | % of disk (mean) | "
              "peak RSS | bound |\n|---|---|---:|---:|---:|---:|---:|")
        for label, dt, rss, d0, d1 in results:
            gbs = total / dt / 1e9
            print(f"| {label} | {d0:.3f} / {d1:.3f} GB/s | {dt:.1f} s | {gbs:.3f} | "
                  f"{200 * gbs / (d0 + d1):.0f}% | {rss:.0f} MiB | {bound:.0f} MiB |")
        return 0 if all(r[2] <= bound for r in results) else 1
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
