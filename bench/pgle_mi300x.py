"""Synthetic PGLE on the DeepSeek-V2-Lite EP=8 train step, deviceless MI300X: does giving the gfx942
latency-hiding scheduler real costs hide more all-to-all time?

For FarSkip and regular connectivity it compiles the trainer's step (forward + backward + AdamW,
``inspect.steps.build_train_step``, 1 sequence of ``--seq-len`` tokens per device, EP=8) four ways:

  (a) default flags (farskip_jax.xla.flags for the target: LHS on, Triton GEMM off)
  (b) (a) + a synthetic PGLE profile from the inspector's cost model (xla/pgle.py)
  (c) (a) + xla_gpu_experimental_parallel_collective_overlap_limit=2
  (d) (c) + synthetic PGLE

(a) and (c) are the profile-dump compiles of (b) and (d), so each row pair costs two compiles. It
prints per row: all-to-all time hidden (by the inspector's `hidden = min(compute between, transfer)
/ transfer`, summed over all all-to-alls, padded and ragged), the same for all collectives, the
timeline-replay step estimate and the compile time; then the git commit the numbers come from. Estimates, not
measurements, and the profile uses the same roofline that measures it (see xla/pgle.py).

    .venv/bin/python bench/pgle_mi300x.py --layers 4            # reduced: minutes on 2 cores
    .venv/bin/python bench/pgle_mi300x.py                       # full 27 layers: tens of minutes
    .venv/bin/python bench/pgle_mi300x.py --target h200 --variants a,b
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

OVERLAP_OPTION = "xla_gpu_experimental_parallel_collective_overlap_limit"
VARIANTS = {  # name: (description, overlap limit or None, with PGLE)
    "a": ("defaults (LHS)", None, False),
    "b": ("+ synthetic PGLE", None, True),
    "c": ("+ overlap limit 2", 2, False),
    "d": ("PGLE + overlap limit 2", 2, True),
}


def git_commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" (+ uncommitted changes)" if dirty else "")


A2A_KINDS = ("all-to-all", "ragged-all-to-all")  # the padded and the ragged (dropless) exchange


def _hidden(groups: list[dict[str, Any]]) -> float | None:
    transfer = sum(g["transfer_us"] for g in groups)
    return sum(g["hidden_us"] for g in groups) / transfer if transfer else None


def row(variant: str, mode: str, art: Any, target: str) -> dict[str, Any]:
    from farskip_jax.inspect import hlo

    t = hlo.analyze(art.hlo_text, target).totals
    a2a = [t["by_kind"][k] for k in A2A_KINDS if k in t["by_kind"]]
    by_dir = {d: [t["by_kind_direction"][f"{k}/{d}"] for k in A2A_KINDS
                  if f"{k}/{d}" in t["by_kind_direction"]] for d in ("fwd", "bwd")}
    return {"variant": variant, "connectivity": mode, "a2a_hidden": _hidden(a2a),
            "a2a_fwd_hidden": _hidden(by_dir["fwd"]), "a2a_bwd_hidden": _hidden(by_dir["bwd"]),
            "a2a_count": sum(g["count"] for g in a2a), "a2a_sync": sum(g["sync"] for g in a2a),
            "a2a_transfer_us": sum(g["transfer_us"] for g in a2a), "all_hidden": t["all"]["hidden_frac"],
            "all_transfer_us": t["all"]["transfer_us"], "est_step_ms": t["est_step_us"] / 1e3,
            "compile_s": art.compile_seconds}


def run(args: argparse.Namespace, profile_dir: Path) -> list[dict[str, Any]]:
    if args.target == "mi300x":
        # the ROCm plugin must find its stand-ins before JAX discovers plugins
        from farskip_jax.xla import rocm_standins

        rocm_standins.enable()
    from farskip_jax.config import load_config, parse_overrides
    from farskip_jax.inspect import steps
    from farskip_jax.xla import aot, pgle

    # one sequence per device: no batch split (configs/dsv2lite.yaml splits 4 sequences in two)
    overrides = ["execution.batch_split=1"] + ([f"model.num_layers={args.layers}"] if args.layers else [])
    cfg = load_config(args.config, parse_overrides(overrides + args.overrides))
    build = steps.build_train_step(cfg, seqs_per_device=1, seq_len=args.seq_len)
    mesh = aot.make_target_mesh(args.target, {"data": 1, "expert": 8, "tensor": 1})
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    rows = []
    for mode in args.modes.split(","):
        fn, specs = build(mesh, mode)
        for limit in (None, 2):
            names = [v for v in wanted if VARIANTS[v][1] == limit]
            if not names:
                continue
            opts = {} if limit is None else {OVERLAP_OPTION: limit}
            t0 = time.perf_counter()
            if any(VARIANTS[v][2] for v in names):
                res = pgle.compile_with_synthetic_pgle(fn, *specs, target=args.target, compiler_options=opts,
                                                       profile_dir=profile_dir / f"{mode}_{limit}")
                by_pgle = {False: res.baseline, True: res.artifacts}
                extra = f", profile {res.num_costs} costs, accuracy checker: {res.checker}"
            else:
                by_pgle = {False: aot.compile_scheduled_hlo(fn, *specs, target=args.target,
                                                            compiler_options=opts)}
                extra = ""
            for v in names:
                rows.append(row(v, mode, by_pgle[VARIANTS[v][2]], args.target))
                print(_fmt_row(rows[-1]), flush=True)
            took = time.perf_counter() - t0
            print(f"  [{mode}, overlap limit {limit or 1}: {took:.0f}s{extra}]", flush=True)
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _fmt_row(r: dict[str, Any]) -> str:
    return (f"| ({r['variant']}) {VARIANTS[r['variant']][0]} | {r['connectivity']} | "
            f"{r['a2a_count']} ({r['a2a_sync']}) | {_pct(r['a2a_hidden'])} | {_pct(r['a2a_fwd_hidden'])} | "
            f"{_pct(r['a2a_bwd_hidden'])} | {r['a2a_transfer_us'] / 1e3:.2f} ms | {_pct(r['all_hidden'])} | "
            f"{r['all_transfer_us'] / 1e3:.2f} ms | {r['est_step_ms']:.2f} ms | "
            f"{r['compile_s']:.0f} s |")


HEADER = ("| variant | connectivity | all-to-alls (sync) | a2a hidden | a2a fwd | a2a bwd | a2a transfer | "
          "all collectives hidden | all transfer | est. step | compile |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="dsv2lite_farskip")
    p.add_argument("--layers", type=int, default=0, help="model.num_layers (0 = the config's, 27)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--target", choices=("mi300x", "h200"), default="mi300x")
    p.add_argument("--modes", default="farskip,regular")
    p.add_argument("--variants", default="a,b,c,d", help="subset of a,b,c,d")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override (repeatable)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--profile-dir", type=Path,
                   help="keep the synthetic PGLE profiles here (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    if bad := set(args.variants.split(",")) - set(VARIANTS):
        p.error(f"unknown variants {sorted(bad)}")
    commit = git_commit()
    print(f"pgle bench: {args.config}, layers {args.layers or 'config'}, target {args.target}, EP=8, "
          f"1 x {args.seq_len} tokens per device, commit {commit}", flush=True)
    print(HEADER, flush=True)
    t0 = time.perf_counter()
    if args.profile_dir is not None:
        rows = run(args, args.profile_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="farskip_pgle_") as tmp:
            rows = run(args, Path(tmp))
    print(f"\n{HEADER}")
    for r in sorted(rows, key=lambda r: (r["connectivity"] != "farskip", r["variant"])):
        print(_fmt_row(r))
    print(f"\ncommit {commit}; total {time.perf_counter() - t0:.0f}s; python {sys.version.split()[0]}")
    if args.json:
        args.json.write_text(json.dumps({"commit": commit, "args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
