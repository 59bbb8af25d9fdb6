"""Per-device memory of the full FCSD train step (what train.py runs) on 8 H200 / MI300X, deviceless.

Each row is one compile of `farskip_jax.train.program.abstract_train_step` (student forward +
backward + AdamW, the frozen teacher's forward, ZeRO-1 layouts) for an 8-GPU expert-parallel
target, through the inspector's deviceless compile (`farskip_jax.xla.aot`). The numbers are
XLA's buffer assignment for one device (`Compiled.memory_analysis()`): the peak, and temp = the
arena of everything that lives only inside the step. "fits" means peak <= --max-fraction of the
HBM in the target spec (farskip_jax/targets/*.txtpb: H200 141 GiB, MI300X 192 GiB); the runtime's
own reservations come on top, hence the margin.

Every compile runs in a fresh subprocess (a process can host one deviceless target; it also
returns the compile's host memory, several GB at 27 layers). Compiles are slow on a small CPU:
use --layers for quick runs.

    .venv/bin/python bench/fcsd_memory.py        # 4 x 4096 per device, both targets, full and save_a2a
    .venv/bin/python bench/fcsd_memory.py --layers 4 --targets h200
    .venv/bin/python bench/fcsd_memory.py --remat save_a2a --search-seq 4096,8192,12288,16384
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GIB = 2**30


@dataclass
class Row:
    target: str
    remat: str
    seqs: int
    seq_len: int
    layers: int
    peak_gib: float | None
    temp_gib: float | None
    args_gib: float | None
    hbm_gib: float | None
    fraction: float | None
    compile_s: float
    commit: str
    error: str = ""

    def fits(self, max_fraction: float) -> bool:
        return self.fraction is not None and self.fraction <= max_fraction


def _one(args: argparse.Namespace) -> dict[str, Any]:
    """Child process: compile one step for one target and return its memory section."""
    from farskip_jax.xla import aot

    aot.prepare_deviceless(args.target)  # before anything starts a JAX backend
    from farskip_jax.config import load_config, parse_overrides
    from farskip_jax.train.program import abstract_train_step

    overrides = [f"execution.remat={args.remat}", *args.set]
    if args.layers:
        overrides.append(f"model.num_layers={args.layers}")
    cfg = load_config(args.config, parse_overrides(overrides))
    mesh = aot.make_target_mesh(args.target, {"data": 1, "expert": 8, "tensor": 1})
    step, specs = abstract_train_step(cfg, mesh, args.seqs, args.seq_len)
    t0 = time.perf_counter()
    art = aot.compile_scheduled_hlo(step, *specs, target=args.target)
    return {"memory": art.memory, "compile_s": time.perf_counter() - t0, "layers": cfg.model.num_layers}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1], check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parents[1], check=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(args: argparse.Namespace, target: str, remat: str, seqs: int, seq_len: int) -> Row:
    """Runs one compile in a child process; a failed compile (e.g. out of host memory) is a row too."""
    cmd = [sys.executable, __file__, "--one", "--config", args.config, "--target", target, "--remat", remat,
           "--seqs", str(seqs), "--seq-len", str(seq_len), "--layers", str(args.layers or 0)]
    for s in args.set:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("FCSD_MEMORY "):
            result = json.loads(line[len("FCSD_MEMORY "):])
    if result is None or result["memory"] is None:
        err = (proc.stderr.strip().splitlines() or ["no result"])[-1][:200]
        return Row(target, remat, seqs, seq_len, args.layers or 0, None, None, None, None, None,
                   time.perf_counter() - t0, args.commit, error=err)
    mem = result["memory"]
    hbm = mem["device_memory_size"]
    return Row(target, remat, seqs, seq_len, result["layers"], mem["peak_bytes_per_device"] / GIB,
               mem["temp_bytes"] / GIB, mem["argument_bytes"] / GIB, hbm / GIB if hbm else None,
               mem["fraction"], result["compile_s"], args.commit)


def table(rows: list[Row], max_fraction: float) -> str:
    lines = [f"| target | remat | seqs x seq_len | layers | peak GiB | temp GiB | args GiB | HBM GiB "
             f"| fraction | fits (<= {max_fraction:.0%}) | compile s | commit |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.target} | {r.remat} | {r.seqs} x {r.seq_len} | {r.layers} "
                         f"| failed: {r.error} | | | | | | {r.compile_s:.0f} | {r.commit} |")
            continue
        lines.append(f"| {r.target} | {r.remat} | {r.seqs} x {r.seq_len} | {r.layers} | {r.peak_gib:.2f} | "
                     f"{r.temp_gib:.2f} | {r.args_gib:.2f} | {r.hbm_gib:.1f} | {r.fraction:.1%} | "
                     f"{'yes' if r.fits(max_fraction) else 'NO'} | {r.compile_s:.0f} | {r.commit} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default="dsv2lite_farskip")
    ap.add_argument("--targets", default="h200,mi300x")
    ap.add_argument("--remat", default="full,save_a2a", help="comma-separated remat policies")
    ap.add_argument("--seqs", type=int, default=4, help="sequences per device")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=0, help="model.num_layers (0: the config's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--max-fraction", type=float, default=0.9)
    ap.add_argument("--search-seq", default="",
                    help="comma-separated seq_len candidates, ascending: per target and remat, the longest "
                         "that fits is found by bisection (instead of the single --seq-len)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child: one compile
    ap.add_argument("--target", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print("FCSD_MEMORY " + json.dumps(_one(args)), flush=True)
        return 0
    args.commit = _commit()
    rows: list[Row] = []
    for target in args.targets.split(","):
        for remat in args.remat.split(","):
            if not args.search_seq:
                rows.append(measure(args, target, remat, args.seqs, args.seq_len))
                print(table(rows[-1:], args.max_fraction).splitlines()[-1], flush=True)
                continue
            cands = [int(s) for s in args.search_seq.split(",")]
            lo, hi = -1, len(cands)  # cands[lo] fits (or none), cands[hi] does not (or none)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                rows.append(measure(args, target, remat, args.seqs, cands[mid]))
                print(table(rows[-1:], args.max_fraction).splitlines()[-1], flush=True)
                lo, hi = (mid, hi) if rows[-1].fits(args.max_fraction) else (lo, mid)
            best = f"{args.seqs} x {cands[lo]}" if lo >= 0 else "none of the candidates"
            print(f"longest fitting: {target} remat={remat}: {best}", flush=True)
    print()
    print(table(rows, args.max_fraction))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
