"""Checkpoint saves at real size, measured on a reduced model and projected (issue #25 item 5).

The trainer saves through `checkpoint/manager.py` (Orbax, asynchronous) while training goes on. This
runs exactly that on a reduced DeepSeek-V2-Lite-width model: the trainer's own program, initial state
(fp32 masters + AdamW) and donating LM train step on one CPU device, saving every so often while the
step keeps running, once per staging bound given (`--bounds`; "none" = Orbax's default, the whole state
copied to host memory inside `save()`). Each bound runs in a fresh process, so that one's allocations
do not flatter the next. Per save it records: how long `save()` blocked the loop, how long the first
step after it took (on a GPU the bounded save's device-side copy of the state runs before it), the
time until the save was written, how many steps ran meanwhile and at what pace, and the host memory
the save added: peak RSS during the save above the peak of the same steps without a save (sampled
every 10 ms; the RSS over time goes to `--out`). Then both are projected to the full DeepSeek-V2-Lite
FCSD state (15.7B parameters: fp32 params and two fp32 Adam moments, ~189 GB per node of 8 GPUs).

What a CPU run stands for: Orbax copies each array to the `pinned_host` memory kind here as it does on
a GPU (`--no-pinned`: CPU's default, where a "device" array already is host memory and Orbax's copy is
a zero-copy view), so the staging copies are real. The bounded save's device-side copy of the state is
device memory on a GPU but host memory on a CPU: its bytes are reported apart and subtracted from the
host figure. Steps share the 2 cores with Orbax's writer threads here; on a GPU they do not. The
disk's own sequential write is measured around each run (64 MiB blocks, fdatasync).

    JAX_PLATFORMS=cpu .venv/bin/python bench/ckpt_save.py --bounds none,0.05,0.2,0.8 --saves 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# This checkout's package, not whichever one the environment has installed (the children inherit it).
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FULL_PARAMS = 15.71e9  # DeepSeek-V2-Lite (`python -m farskip_jax describe --config dsv2lite_farskip`)
BYTES_PER_PARAM = 12  # fp32 master + two fp32 AdamW moments (the teacher is not saved)
GPUS_PER_NODE = 8
DEFAULT_BOUND_GB = 8.0  # train.checkpoint_staging_gb's default


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssTrace:
    """RSS sampled every 10 ms in a thread, with the time of each sample."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, _rss()))
            time.sleep(0.01)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def peak(self, start: float, end: float) -> int:
        return max((r for t, r in self.samples if start <= t <= end), default=_rss())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _Written(threading.Event):
    at: float = 0.0


def _when_written(mngr: Any, trace: RssTrace) -> _Written:
    """An event set (with the time, on `trace`'s clock) when `mngr`'s save in flight is written."""
    done = _Written()

    def watch() -> None:
        while mngr.saving():
            time.sleep(0.01)
        done.at = trace.now()
        done.set()

    threading.Thread(target=watch, daemon=True).start()
    return done


def disk_write_gbps(directory: Path, gb: float = 1.0) -> float:
    """Sequential write of `gb` GB in 64 MiB blocks with an fdatasync, GB/s."""
    block = os.urandom(64 << 20)
    path = directory / "disk_probe.bin"
    n = max(1, int(gb * 1e9) // len(block))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fdatasync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return n * len(block) / dt / 1e9


def run_one(args: argparse.Namespace, bound: float | None) -> dict[str, Any]:
    """One staging bound in this process: baseline steps, then `args.saves` saves with steps running."""
    import jax
    import numpy as np
    from flax import nnx

    from farskip_jax.checkpoint.manager import CheckpointManager, device_copy
    from farskip_jax.config import load_config, parse_overrides
    from farskip_jax.parallel import make_mesh
    from farskip_jax.train import batches, setup
    from farskip_jax.train.program import BATCH_FIELDS, build_program

    cfg = load_config("dsv2lite_farskip", parse_overrides([
        f"model.num_layers={args.layers}", f"model.n_routed_experts={args.experts}",
        f"model.vocab_size={args.vocab}", f"model.intermediate_size={args.dense_intermediate}",
        "model.num_experts_per_tok=2", "model.n_group=1",
        "model.topk_group=1", "train.mode=lm", "train.init_checkpoint=", "mesh.data=1", "mesh.expert=1",
        "mesh.tensor=1"]))
    prog = build_program(cfg, make_mesh(cfg.mesh))
    state = prog.init_state(setup.build_models(cfg, prog).student_params)
    saved = sum(x.nbytes for x in jax.tree.leaves((state["params"], state["opt_state"])))
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    rng = np.random.default_rng(0)
    shape = (1, args.batch, args.seq_len)
    host = dict.fromkeys(BATCH_FIELDS, np.ones(shape, np.int32))
    host["input_ids"] = rng.integers(0, args.vocab, shape, dtype=np.int32)
    host["targets"] = rng.integers(0, args.vocab, shape, dtype=np.int32)
    host["positions"] = np.broadcast_to(np.arange(args.seq_len, dtype=np.int32), shape).copy()
    batch = batches.to_device(host, prog.batch_sharding)
    one = jax.device_put(np.float32(1.0), prog.shardings.scalar)
    zero = jax.device_put(np.float32(0.0), prog.shardings.scalar)

    def step() -> float:
        """One donating train step, waited for as the trainer's loop waits for its metrics."""
        nonlocal state
        t = time.perf_counter()
        state, m = prog.train_step(state, None, batch, one, zero)
        float(m["loss"])
        return time.perf_counter() - t

    t0 = time.perf_counter()
    step()
    compile_s = time.perf_counter() - t0
    step()
    trace = RssTrace()
    start = trace.now()
    base_steps = [step() for _ in range(args.base_steps)]
    base_peak = trace.peak(start, trace.now())
    out: dict[str, Any] = {"bound_gb": bound, "params": n_params, "state_bytes": saved,
                           "compile_s": compile_s, "base_step_s": float(np.median(base_steps)),
                           "base_peak_rss": base_peak, "saves": []}
    if bound is not None:
        # What the bounded save adds before the next step: a device-side copy of the state.
        pure = (nnx.to_pure_dict(state["params"]), state["opt_state"])
        jax.block_until_ready(device_copy(pure))
        t = time.perf_counter()
        jax.block_until_ready(device_copy(pure))
        out["copy_s"] = time.perf_counter() - t
        del pure
    with tempfile.TemporaryDirectory(prefix="farskip_ckpt_save_", dir=args.dir) as d:
        root = Path(d)
        out["disk_gbps_before"] = disk_write_gbps(root)
        mngr = CheckpointManager(root / "ckpt", keep=2, staging_gb=bound, pinned_host_transfer=args.pinned)
        for i in range(args.saves):
            t_start = trace.now()
            t = time.perf_counter()
            mngr.save(i + 1, nnx.to_pure_dict(state["params"]), state["opt_state"], {"step": i + 1})
            blocked = time.perf_counter() - t
            written = _when_written(mngr, trace)
            during = []
            while not written.is_set():
                during.append(step())
            mngr.wait()  # raises what the save's background thread raised
            row = {"blocked_s": blocked, "first_step_s": during[0] if during else None,
                   "save_s": written.at - t_start, "steps_during": len(during),
                   "step_s_during": float(np.median(during)) if during else None,
                   "peak_rss": trace.peak(t_start, written.at), "start": t_start, "end": written.at}
            out["saves"].append(row)
            for _ in range(args.steps_between):
                step()
        mngr.close()
        out["disk_gbps_after"] = disk_write_gbps(root)
    trace.stop()
    # Device-side copy of the state that the bounded save holds until written (device memory on a GPU).
    out["device_copy_bytes"] = saved if bound is not None else 0
    out["rss_trace"] = [(round(t, 2), r) for t, r in trace.samples[::10]]  # every 0.1 s
    return out


def report(results: list[dict[str, Any]]) -> None:
    import numpy as np

    gib = 2**30
    r0 = results[0]
    state = r0["state_bytes"]
    full = FULL_PARAMS * BYTES_PER_PARAM
    print(f"\nreduced model: {r0['params'] / 1e6:.1f}M parameters, saved state {state / 1e9:.2f} GB; "
          f"step {r0['base_step_s']:.2f} s without saves")
    print("| bound (GB/process) | save | save() blocked | 1st step after | written after | steps during "
          "(median s) | host RSS added | of it the device copy | host staging / state |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        name = "none (whole state in save())" if r["bound_gb"] is None else f"{r['bound_gb']:g}"
        for i, s in enumerate(r["saves"]):
            added = s["peak_rss"] - r["base_peak_rss"]
            staging = added - r["device_copy_bytes"]
            first = "-" if s["first_step_s"] is None else f"{s['first_step_s']:.2f} s"
            pace = "" if s["step_s_during"] is None else f" ({s['step_s_during']:.2f})"
            print(f"| {name} | {i + 1} | {s['blocked_s']:.2f} s | {first} | {s['save_s']:.1f} s | "
                  f"{s['steps_during']}{pace} | {added / gib:+.2f} GiB | "
                  f"{r['device_copy_bytes'] / gib:.2f} GiB | {staging / state:.2f} x |")
        print(f"  disk before/after: {r['disk_gbps_before']:.3f} / {r['disk_gbps_after']:.3f} GB/s; "
              f"compile {r['compile_s']:.0f} s")
    print(f"\nprojected to DeepSeek-V2-Lite FCSD ({full / 1e9:.0f} GB per node of {GPUS_PER_NODE} GPUs, "
          f"x{full / state:.0f}; one process per node):")
    staged = {r["bound_gb"]: max(s["peak_rss"] for s in r["saves"]) - r["base_peak_rss"]
              - r["device_copy_bytes"] for r in results}
    if None in staged:
        ratio = staged[None] / state
        print(f"  no bound: {ratio:.2f} x the state staged -> ~{ratio * full / 1e9:.0f} GB of host memory "
              "per node")
    # With a bound, what is staged does not grow with the state: a fixed part plus a multiple of the
    # bound (a least-squares line over the bounds below the state's size).
    pts = sorted((b * 1e9, v) for b, v in staged.items() if b is not None and b * 1e9 < state)
    if len(pts) >= 2:
        x, y = (np.array(v, float) for v in zip(*pts, strict=True))
        k, a = np.polyfit(x, y, 1)
        at_default = (a + k * DEFAULT_BOUND_GB * 1e9) / 1e9
        print(f"  bounded: staged ~ {a / 1e9:.2f} GB + {k:.2f} x the bound (fit over {len(pts)} bounds) "
              f"-> at the default {DEFAULT_BOUND_GB:g} GB: ~{at_default:.0f} GB per node, plus a device-side "
              f"copy of {full / GPUS_PER_NODE / 1e9:.1f} GB per GPU during the save")
    copies = [r["copy_s"] for r in results if "copy_s" in r]
    if copies:
        print(f"  the device-side copy of {state / 1e9:.2f} GB took {min(copies):.2f}-{max(copies):.2f} s "
              "on this CPU")
    print(f"  write per save at 2 GB/s per node: {full / 2e9 / 60:.1f} min")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--bounds", default="none,0.05,0.2,0.8",
                    help="staging bounds to run, GB per process, comma-separated ('none': no bound)")
    ap.add_argument("--layers", type=int, default=2, help="model.num_layers (the first is dense)")
    ap.add_argument("--experts", type=int, default=2, help="model.n_routed_experts (DSV2-Lite: 64)")
    ap.add_argument("--vocab", type=int, default=4000, help="model.vocab_size (DSV2-Lite: 102400)")
    ap.add_argument("--dense-intermediate", type=int, default=1408,
                    help="model.intermediate_size of the dense first layer (DSV2-Lite: 10944)")
    ap.add_argument("--batch", type=int, default=2,
                    help="sequences per step (a multiple of the config's execution.batch_split)")
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--saves", type=int, default=3, help="saves per bound, steps running during each")
    ap.add_argument("--base-steps", type=int, default=5, help="steps without a save (the RSS baseline)")
    ap.add_argument("--steps-between", type=int, default=2, help="steps after a save before the next")
    ap.add_argument("--no-pinned", dest="pinned", action="store_false",
                    help="CPU's default device-to-host path (zero-copy) instead of a copy to pinned_host")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write every run's numbers and RSS trace here (JSON)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one bound, in a fresh process
    args = ap.parse_args()

    if args.child is not None:
        bound = None if args.child == "none" else float(args.child)
        print("RESULT " + json.dumps(run_one(args, bound)), flush=True)
        return
    results = []
    for b in args.bounds.split(","):
        cmd = [sys.executable, __file__, "--child", b] + [a for a in sys.argv[1:]]
        print(f"== bound {b}", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"bound {b} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
        r = results[-1]
        print(f"   {len(r['saves'])} saves, {[round(s['save_s'], 1) for s in r['saves']]} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results))
    report(results)


if __name__ == "__main__":
    main()
