"""Throughput against the disk, and host memory, of convert_torch_ckpt.py on a multi-GB checkpoint.

Builds a DeepSeek-V2-Lite-shaped HF checkpoint with fewer layers (random bf16, sharded safetensors,
legacy `rope_scaling` config), then converts it HF -> Orbax and back (`--max-shard-size 1GB`; back
twice: with the export's default direct I/O and with `--buffered-writes`), each direction `--rounds`
times in child processes, after one untimed conversion that gives the output's file layout. Around
and between a direction's rounds the disk is measured on the same file system, so that every
conversion has measurements on both sides:

  disk    the disk's sequential write: the very files the converter wrote (the same number, the same
          sizes: HF -> Orbax's OCDBT data files and metadata, Orbax -> HF's shards and JSON), written
          one after another, each `write` + fdatasync, as the converter syncs each of its files;
  device  the same files, one after another, through O_DIRECT (past the page cache): what the
          device takes. On a VM whose page cache is slow to grow (BENCHMARKS.md 5) the two differ
          by an order of magnitude;
  plain   the same files written by as many threads as the converter writes with (Orbax -> HF:
          `--workers` writer threads; HF -> Orbax: one, as Orbax saves one group at a time), each
          fdatasync'd: what plain writes of the very same bytes reach, written the same way.

Each conversion's time includes an fdatasync of every file it wrote, so every rate is to stable
storage. The converter's rate is reported end to end (process start, imports and validation
included: ~2-6 s here, negligible for a 671B model) and in-process (its own summary: from the first
read to the last byte synced), each as a % of the median disk measurement of its direction and of
the plain writes. The input is read from the page cache (the bench just wrote it).

Memory: each child's peak RSS (ru_maxrss) and its peak anonymous RSS (RssAnon, sampled every 5 ms;
shared-library pages, which JAX's plugins add to RSS on first use, left out) against
`convert.memory_bound` on top of the baseline of a child that imports what the converter imports.

Not a test:  python bench/convert_rss.py [--layers 3] [--rounds 2] [--workers 2] [--workdir /tmp]
             [--keep] [--compress] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from farskip_jax import hf_config  # noqa: E402
from farskip_jax.checkpoint.convert import (  # noqa: E402
    DEFAULT_WORKERS,
    group_specs,
    largest_group_bytes,
    memory_bound,
)
from farskip_jax.checkpoint.hf_io import np_dtype  # noqa: E402
from farskip_jax.checkpoint.hf_keys import param_specs  # noqa: E402
from farskip_jax.checkpoint.safetensors_shards import (  # noqa: E402
    ShardWriter,
    plan_shards,
)
from farskip_jax.config import ModelConfig  # noqa: E402

MiB = 2**20
SHARD_SIZE = "1GB"


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


# --------------------------------------------------------------------------------------------
# The disk, measured with the converter's file sizes


class PlainWriter:
    """Writes files of given sizes from a random buffer (no page of zeros, nothing a virtual disk
    could deduplicate within a file), each `write` + fdatasync, by `threads` threads; `direct`:
    through O_DIRECT, past the page cache, each size rounded up to a 4 KiB block (what the device
    takes, whatever the guest's memory is doing)."""

    def __init__(self, d: Path):
        self.dir = d
        # page-aligned (O_DIRECT needs aligned buffers), touched once here
        self.buf = np.frombuffer(mmap.mmap(-1, 256 * MiB), np.uint8)
        self.buf[:] = np.random.default_rng(1).integers(0, 256, self.buf.size, dtype=np.uint8)

    def _one(self, i: int, size: int, direct: bool = False) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(self.dir / f"plain_{i}.bin", flags, 0o644)
        try:
            left, off = -(-size // 4096) * 4096 if direct else size, (i * 7919 * 4096) % (128 * MiB)
            while left:
                n = min(left, self.buf.size - off)
                left, off = left - os.write(fd, self.buf[off:off + n].data), 0
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def run(self, sizes: list[int], threads: int, direct: bool = False) -> tuple[float, float]:
        """(GB/s, CPU seconds) of writing and syncing files of `sizes` (removed afterwards)."""
        cpu0, t0 = _cpu(resource.RUSAGE_SELF), time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(functools.partial(self._one, direct=direct), range(len(sizes)), sizes))
        dt, cpu = time.perf_counter() - t0, _cpu(resource.RUSAGE_SELF) - cpu0
        for i in range(len(sizes)):
            (self.dir / f"plain_{i}.bin").unlink()
        return sum(sizes) / dt / 1e9, cpu


def _cpu(who: int) -> float:
    u = resource.getrusage(who)
    return u.ru_utime + u.ru_stime


def sync_tree(d: Path) -> None:
    for f in d.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)


# --------------------------------------------------------------------------------------------
# Children: time, peak RSS, peak anonymous RSS


def _rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_child(args: list[str]) -> dict:
    """Runs `python ARGS`: seconds, peak RSS (ru_maxrss) and sampled peak RssAnon in MiB, CPU
    seconds (user + system, all threads), return code, stdout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                            stdout=subprocess.PIPE, text=True)
    peak_anon = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _rss_anon(proc.pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.stdout.read()
    # wait4 reaps the child and gives its own rusage (ru_maxrss in KiB on Linux).
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"seconds": time.perf_counter() - t0, "rss": usage.ru_maxrss / 1024, "anon": peak_anon[0] / MiB,
            "cpu": usage.ru_utime + usage.ru_stime, "rc": proc.returncode, "stdout": out}


def in_process_seconds(stdout: str) -> float | None:
    """The converter's own time from its summary line ('... GB in 12.3 s (...)')."""
    m = re.search(r"GB in ([0-9.]+) s \(", stdout)
    return float(m.group(1)) if m else None


# --------------------------------------------------------------------------------------------


def output_sizes(d: Path) -> list[int]:
    """The sizes of every file the converter wrote (largest first: the plain writers start with the
    big ones, as the converter's large groups and shards dominate)."""
    return sorted((f.stat().st_size for f in d.rglob("*") if f.is_file()), reverse=True)


def measure_disk(plain: PlainWriter, sizes: list[int], disk: list[float], cpus: list[float],
                 device: list[float]) -> None:
    rate, cpu = plain.run(sizes, 1)
    disk.append(rate)
    cpus.append(cpu)
    print(f"  disk (sequential, the same {len(sizes)} files, each + fdatasync): {rate:.3f} GB/s, "
          f"{cpu:.1f} CPU s; load average {os.getloadavg()[0]:.1f}", flush=True)
    rate, cpu = plain.run(sizes, 1, direct=True)
    device.append(rate)
    print(f"  device (the same, O_DIRECT): {rate:.3f} GB/s, {cpu:.1f} CPU s", flush=True)


def summarize(xs: list[float]) -> str:
    return f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3, help="decoder layers (1 dense + N-1 MoE); 3 -> ~3.3 GB")
    ap.add_argument("--rounds", type=int, default=2, help="conversions per direction (disk measured around "
                                                          "and between them)")
    ap.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="the converter's --workers")
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    ap.add_argument("--keep", action="store_true", help="keep the generated directories")
    ap.add_argument("--compress", action="store_true", help="convert with --compress (zstd)")
    ap.add_argument("--json", metavar="OUT", help="also write every measurement to OUT")
    ap.add_argument("--generate", metavar="DIR", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.generate:
        write_synthetic(Path(a.generate), a.layers)
        return 0
    work = Path(tempfile.mkdtemp(prefix="farskip_convert_bench_", dir=a.workdir))
    try:
        return _bench(a, work)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def _bench(a: argparse.Namespace, work: Path) -> int:
    src = work / "hf"
    src.mkdir()
    t0 = time.perf_counter()
    # Generated in a child: with vfork + exec, a child's ru_maxrss starts at the parent's high-water
    # mark, so the parent must never hold the big arrays itself.
    subprocess.run([sys.executable, __file__, "--generate", str(src), "--layers", str(a.layers)], check=True)
    cfg = hf_config.model_config(json.loads((src / "config.json").read_text()))
    total = json.loads((src / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    print(f"synthetic HF checkpoint: {total / 1e9:.2f} GB, {len(list(src.glob('*.safetensors')))} shards, "
          f"written in {time.perf_counter() - t0:.1f} s; load average {os.getloadavg()[0]:.1f}")
    largest = largest_group_bytes(group_specs(param_specs(cfg)), 2)
    base = run_child(["-c", "import convert_torch_ckpt, orbax.checkpoint, jax, farskip_jax.checkpoint.to_hf; "
                            "jax.devices()"])
    print(f"import baseline: RSS {base['rss']:.0f} MiB, RssAnon {base['anon']:.0f} MiB; largest group "
          f"{largest / MiB:.0f} MiB; --workers {a.workers}")
    subprocess.run(["sync"], check=False)  # the generated input: flushed before timing anything
    plain = PlainWriter(work)
    orbax, back = work / "orbax", work / "hf_back"
    commands = {
        "to_orbax": ["convert_torch_ckpt.py", "--input", str(src), "--output", str(orbax), "--no-progress",
                     "--workers", str(a.workers), *(["--compress"] if a.compress else [])],
        "to_hf": ["convert_torch_ckpt.py", "--to-hf", "--input", str(orbax), "--output", str(back),
                  "--no-progress", "--workers", str(a.workers),
                  "--max-shard-size", SHARD_SIZE],
    }
    # The export again through the page cache (its default is direct I/O where the file system
    # takes it): both ways in the same run.
    commands["to_hf_buffered"] = [*commands["to_hf"], "--buffered-writes"]
    labels = {"to_orbax": "HF -> Orbax", "to_hf": "Orbax -> HF", "to_hf_buffered": "Orbax -> HF, buffered"}
    report: dict = {"total_bytes": total, "largest_group": largest, "workers": a.workers,
                    "baseline": {k: base[k] for k in ("rss", "anon")}, "directions": {}}
    failed = False
    for d in commands:
        out = orbax if d == "to_orbax" else back
        # Orbax saves one group at a time (one data file written at once); the export writes with
        # --workers threads.
        threads = 1 if d == "to_orbax" else a.workers
        disk, par, runs, cpus, device = [], [], [], [], []
        print(f"{labels[d]}: load average {os.getloadavg()[0]:.1f}")
        # A first, untimed conversion: the output's file layout for the disk measurements, and every
        # timed round starts from the same state (code and input in the page cache).
        shutil.rmtree(out, ignore_errors=True)  # the export's output of the row before
        if (warm := run_child(commands[d]))["rc"]:
            print(f"  {labels[d]}: FAILED rc={warm['rc']}\n{warm['stdout']}")
            return 1
        sizes = output_sizes(out)
        print(f"  output: {len(sizes)} files, {sum(sizes) / 1e9:.2f} GB, largest {sizes[0] / MiB:.0f} MiB; "
              f"{threads} writer thread(s)")

        measure_disk(plain, sizes, disk, cpus, device)
        for r in range(a.rounds):
            # Removed first (untimed): the page cache then has the same room for the conversion's
            # writes as for the plain writes, whose files are removed after each measurement.
            shutil.rmtree(out)
            t0 = time.perf_counter()
            child = run_child(commands[d])
            sync_tree(out)
            dt = time.perf_counter() - t0
            if child["rc"]:
                print(f"  {labels[d]}: FAILED rc={child['rc']}\n{child['stdout']}")
                return 1
            inproc = in_process_seconds(child["stdout"])
            runs.append({"seconds": dt, "in_process": inproc, "rss": child["rss"], "anon": child["anon"],
                         "cpu": child["cpu"], "load": os.getloadavg()[0]})
            print(f"  convert round {r + 1}: {dt:.1f} s end to end ({total / dt / 1e9:.3f} GB/s), in-process "
                  f"{inproc:.1f} s ({total / inproc / 1e9:.3f} GB/s), {child['cpu']:.1f} CPU s; peak RSS "
                  f"{child['rss']:.0f} MiB, RssAnon {child['anon']:.0f} MiB; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            measure_disk(plain, sizes, disk, cpus, device)
            if threads > 1:
                rate, cpu = plain.run(sizes, threads)
                par.append(rate)
                print(f"  plain ({threads} threads, the same files): {rate:.3f} GB/s, {cpu:.1f} CPU s",
                      flush=True)
        bound = memory_bound(d.removesuffix("_buffered"), largest, a.workers) / MiB
        report["directions"][d] = {"disk": disk, "disk_cpu": cpus, "device": device, "plain_parallel": par,
                                   "runs": runs,
                                   "bound": bound, "files": len(sizes), "threads": threads}
    du = sum(f.stat().st_size for f in orbax.rglob("*") if f.is_file())
    print(f"Orbax directory: {du / 1e9:.2f} GB on disk ({'zstd' if a.compress else 'uncompressed'})")
    print("\n| direction | disk sequential GB/s min / median / max (n) | device (O_DIRECT) | plain, same "
          "files, converter's threads | converter end to end | in-process | % of disk median (end to end / "
          "in-process) | % of device median (in-process) | % of plain | CPU s per GB: converter / disk write "
          "| peak RSS / bound | peak RssAnon / bound |\n"
          "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d, r in report["directions"].items():
        med = statistics.median(r["disk"])
        plain_rate = statistics.median(r["plain_parallel"]) if r["plain_parallel"] else med
        e2e = statistics.median(total / x["seconds"] / 1e9 for x in r["runs"])
        inp = statistics.median(total / x["in_process"] / 1e9 for x in r["runs"])
        rss, anon = max(x["rss"] for x in r["runs"]), max(x["anon"] for x in r["runs"])
        rss_bound, anon_bound = base["rss"] + r["bound"], base["anon"] + r["bound"]
        over = rss > rss_bound or anon > anon_bound
        failed |= over
        r.update(disk_median=med, plain=plain_rate, e2e=e2e, in_process=inp, rss_bound=rss_bound,
                 anon_bound=anon_bound)
        par = (f"{summarize(r['plain_parallel'])} ({r['threads']} threads)" if r["plain_parallel"]
               else "= disk (1 thread)")
        dev = statistics.median(r["device"])
        r.update(device_median=dev)
        print(f"| {labels[d]} | {summarize(r['disk'])} ({len(r['disk'])}) | {summarize(r['device'])} | "
              f"{par} | {e2e:.3f} | {inp:.3f} | {100 * e2e / med:.0f}% / {100 * inp / med:.0f}% | "
              f"{100 * inp / dev:.0f}% | {100 * inp / plain_rate:.0f}% | "
              f"{statistics.median(x['cpu'] for x in r['runs']) / total * 1e9:.1f} / "
              f"{statistics.median(r['disk_cpu']) / total * 1e9:.1f} | {rss:.0f} / {rss_bound:.0f} MiB | "
              f"{anon:.0f} / {anon_bound:.0f} MiB{' ABOVE BOUND' if over else ''} |")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
