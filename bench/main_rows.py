"""The main overlap rows of DeepSeek-V2-Lite, full size, deviceless, one `inspect` process per row.

Rows: the FCSD step `train.py --config dsv2lite_farskip` runs (EP8 on one node, EP16, EP32 and EP64
over two, four and eight: node-aware, as `mesh.expert_per_node: auto` runs them; `--set
mesh.expert_per_node=0` for the flat exchange),
the TP8 prefill of one 4096-token prompt and one TP8 decode step (256 sequences, 4096 cached
tokens), each with `--compare-regular`, for H200 (XLA's own estimator) and MI300X (the synthetic
PGLE profile, the inspector's default there; each MI300X report also carries the replay of the
same program scheduled by XLA's own estimator, `meta.pgle.without_profile_totals`).

Each row keeps its scheduled HLO (gzip), so that a changed cost model can re-read it.

Resumable: a row whose `compare.json` exists is skipped. Rows run one at a time (a full-size FCSD
compile takes minutes and most of the machine's memory bandwidth on 2 cores).

    python bench/main_rows.py --out bench/results/main_rows_012 [--rows fcsd_ep8_h200,...]
        [--set model.ep_buffer_factor=2 ...]
    python bench/overlap_tables.py bench/results/main_rows_012/fcsd_ep8_h200 ...
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROWS: dict[str, list[str]] = {}
for target in ("h200", "mi300x"):
    ROWS[f"fcsd_ep8_{target}"] = ["--mode", "fcsd", "--target", target]
    # 2, 4 and 8 nodes of 8 GPUs (node-aware by default; flat: --set mesh.expert_per_node=0)
    for ep in (16, 32, 64):
        ROWS[f"fcsd_ep{ep}_{target}"] = ["--mode", "fcsd", "--target", target, "--mesh", f"expert={ep}",
                                         "--seqs-per-device", "4"]
    ROWS[f"prefill_{target}"] = ["--mode", "prefill", "--target", target, "--mesh", "tensor=8"]
    ROWS[f"decode_{target}"] = ["--mode", "decode", "--target", target, "--mesh", "tensor=8"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="one sub-directory per row")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from: {', '.join(ROWS)}")
    p.add_argument("--config", default="dsv2lite_farskip")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--extra", action="append", default=[], help="extra inspect argument (repeatable)")
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {list(ROWS)}")
    for row in rows:
        out = args.out / row
        if (out / "compare.json").exists():
            print(f"{row}: done already ({out})", flush=True)
            continue
        cmd = [sys.executable, "-m", "farskip_jax", "inspect", "--config", args.config, *ROWS[row],
               "--compare-regular", "--out", str(out), *args.extra]
        for item in args.set:
            cmd += ["--set", item]
        t0 = time.perf_counter()
        print(f"{row}: {' '.join(cmd[1:])}", flush=True)
        res = subprocess.run(cmd)
        print(f"{row}: exit {res.returncode} after {time.perf_counter() - t0:.0f} s", flush=True)
        if res.returncode:
            return res.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
