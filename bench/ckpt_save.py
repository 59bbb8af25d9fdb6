"""Checkpoint saves at real size, measured on a reduced model and projected (issue #25 item 5).

The trainer saves through `checkpoint/manager.py` (Orbax, asynchronous): `save()` returns once the
state has been copied off the devices into host memory, then a background thread writes it. This
runs exactly that on a reduced DeepSeek-V2-Lite-width model (the trainer's own program and initial
state, fp32 masters + AdamW, one CPU device) and prints, per save: how long `save()` blocked the
training loop (the stall), how long the write took to finish, and the host memory the save added
(peak RSS above the level before it, sampled every 5 ms), against the bytes of the saved state.
Then it projects both to the full DeepSeek-V2-Lite FCSD state (15.7B parameters: fp32 params and
two fp32 Adam moments, ~189 GB per node of 8 GPUs, whose host is what stages its devices' shards).

On this CPU the "device" arrays already live in host memory, so the staging copy is a host-to-host
copy: the stall is a lower bound for a GPU's device-to-host copy (HBM -> pinned host at PCIe/NVLink-C2C
rates), the memory figure is what Orbax stages. The disk's own sequential write is measured in the
same run (64 MiB blocks, fdatasync) so the write time can be read as a share of it.

    JAX_PLATFORMS=cpu .venv/bin/python bench/ckpt_save.py [--layers 2 --experts 8 --vocab 32000]
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import threading
import time
from pathlib import Path

FULL_PARAMS = 15.71e9  # DeepSeek-V2-Lite (`python -m farskip_jax describe --config dsv2lite_farskip`)
BYTES_PER_PARAM = 12  # fp32 master + two fp32 AdamW moments (the teacher is not saved)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """Highest RSS seen while running (sampled every 5 ms in a thread)."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--layers", type=int, default=2, help="model.num_layers (the first is dense)")
    ap.add_argument("--experts", type=int, default=8, help="model.n_routed_experts (DSV2-Lite: 64)")
    ap.add_argument("--vocab", type=int, default=32000, help="model.vocab_size (DSV2-Lite: 102400)")
    ap.add_argument("--saves", type=int, default=3, help="saves to time (each at its own step)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()

    import jax
    import numpy as np
    from flax import nnx

    from farskip_jax.checkpoint.manager import CheckpointManager
    from farskip_jax.config import load_config, parse_overrides
    from farskip_jax.parallel import make_mesh
    from farskip_jax.train import setup
    from farskip_jax.train.program import build_program

    cfg = load_config("dsv2lite_farskip", parse_overrides([
        f"model.num_layers={args.layers}", f"model.n_routed_experts={args.experts}",
        f"model.vocab_size={args.vocab}", "model.num_experts_per_tok=2", "model.n_group=1",
        "model.topk_group=1", "train.mode=lm", "train.init_checkpoint=", "mesh.data=1", "mesh.expert=1",
        "mesh.tensor=1"]))
    prog = build_program(cfg, make_mesh(cfg.mesh))
    models = setup.build_models(cfg, prog)
    state = prog.init_state(models.student_params)
    params = nnx.to_pure_dict(state["params"])
    saved = sum(x.nbytes for x in jax.tree.leaves((params, state["opt_state"])))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    m = cfg.model
    print(f"reduced model: {n_params / 1e6:.1f}M parameters, saved state {saved / 1e9:.2f} GB "
          f"({m.num_layers} layers, {m.n_routed_experts} experts, vocab {m.vocab_size})")

    with tempfile.TemporaryDirectory(prefix="farskip_ckpt_save_", dir=args.dir) as d:
        root = Path(d)
        disk_before = disk_write_gbps(root)
        mngr = CheckpointManager(root / "ckpt", keep=2)
        rows = []
        before_saves = _rss()
        overall = _Peak().__enter__()
        for i in range(args.saves):
            base = _rss()
            with _Peak() as peak:
                t0 = time.perf_counter()
                mngr.save(i + 1, params, state["opt_state"], {"step": i + 1})
                t1 = time.perf_counter()
                mngr.wait()
                t2 = time.perf_counter()
            rows.append((t1 - t0, t2 - t0, peak.peak - base))
            print(f"save {i + 1}: save() blocked {t1 - t0:.2f} s, finished after {t2 - t0:.2f} s "
                  f"({saved / (t2 - t0) / 1e9:.3f} GB/s), host RSS +{(peak.peak - base) / 2**20:.0f} MiB "
                  f"({(peak.peak - base) / saved:.2f} x the state)")
        mngr.close()
        overall.__exit__()
        disk_after = disk_write_gbps(root)
    print(f"disk sequential write: {disk_before:.3f} GB/s before, {disk_after:.3f} GB/s after")
    print(f"process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB")

    blocked, total = (float(np.median([r[k] for r in rows])) for k in range(2))
    # Later saves reuse memory the first one allocated, so what staging costs is the peak over all
    # saves above the level before the first.
    extra = overall.peak - before_saves
    print(f"host RSS over all saves: +{extra / 2**20:.0f} MiB above the level before the first "
          f"({extra / saved:.2f} x the state)")
    full = FULL_PARAMS * BYTES_PER_PARAM
    scale = full / saved
    print(f"\nmedian of {len(rows)}: blocked {blocked:.2f} s, total {total:.2f} s")
    print(f"projected to DeepSeek-V2-Lite FCSD ({full / 1e9:.0f} GB per node of 8 GPUs, x{scale:.0f}): "
          f"host staging +{extra * scale / 1e9:.0f} GB per node, save() blocking {blocked * scale:.0f} s at "
          f"this machine's copy rate, write {total * scale / 60:.1f} min at {saved / total / 1e9:.3f} GB/s "
          f"({full / 2e9 / 60:.1f} min at 2 GB/s)")


if __name__ == "__main__":
    main()
