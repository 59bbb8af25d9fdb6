"""The train step compiled with the inspector's synthetic PGLE profile (`train.pgle`).

On MI300X (gfx942) XLA's latency-hiding scheduler has no cost model and prices every async
collective at the same fixed units, so left alone it hides much less all-to-all time than the
program allows (BENCHMARKS.md F). `farskip_jax.xla.pgle` gives it per-instruction costs from the
inspector's roofline and link model; here the trainer does the same for the step it runs: compile
once to read the module the scheduler receives, price it, and compile again with that profile. The
inspector's `--target mi300x` reports are of this schedule. Replacing it with a profile measured on
the machine: `train.pgle=off` plus JAX's automatic PGLE (docs/xla-flags.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from farskip_jax.config import Config
from farskip_jax.errors import UserError
from farskip_jax.xla.flags import detect_local_target

log = logging.getLogger(__name__)


def profile_target(cfg: Config) -> str | None:
    """The GPU family whose costs price the profile, or None when the step compiles as usual.
    `auto`: MI300X hosts only (H200 has XLA's own speed-of-light estimator)."""
    choice = cfg.train.pgle
    gpu = detect_local_target()
    if choice == "off" or (choice == "auto" and gpu != "mi300x"):
        return None
    if gpu == "local":
        raise UserError("train.pgle=synthetic needs a GPU (it prices XLA's GPU schedule); this host has "
                        "none: set train.pgle=auto or off")
    return gpu


def balanced_fill(cfg: Config, seqs_per_device: int, seq_len: int) -> float:
    """The share of their static rows the train step's grouped GEMMs fill under balanced routing,
    what the inspector prices them at (`model.dispatch.balanced_grouped_fill`) for `cfg`'s mesh."""
    from farskip_jax.model.dispatch import balanced_grouped_fill

    mesh = {"data": cfg.mesh.data, "expert": cfg.mesh.expert, "tensor": cfg.mesh.tensor}
    return balanced_grouped_fill(cfg.model, cfg.execution, mesh, True, seqs_per_device * seq_len, seq_len)


def compile_with_profile(step: Any, args: tuple, gpu: str, profile_dir: Path, cfg: Config,
                         seqs_per_device: int) -> Callable[..., Any]:
    """`step` (a jitted train step) compiled for these arguments with a synthetic PGLE profile of
    itself; returns the executable, called like `step`."""
    from farskip_jax.xla import pgle
    from farskip_jax.xla.flags import compiler_options_for

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), args)
    fill = balanced_fill(cfg, seqs_per_device, args[2]["input_ids"].shape[-1])
    log.info("train.pgle: compiling the step twice for a synthetic %s profile (-> %s)", gpu, profile_dir)
    res = pgle.compile_with_synthetic_pgle(step, *abstract, target="local", cost_target=gpu,
                                           compiler_options=compiler_options_for(gpu),
                                           profile_dir=profile_dir, grouped_fill=fill, keep_executable=True)
    log.info("train.pgle: %d instruction costs in %s (checker: %s)", res.num_costs, res.profile_path,
             res.checker)
    return res.artifacts.executable


def scheduled_train_step(step: Any, args: tuple, gpu: str, profile_dir: Path, cfg: Config,
                         seqs_per_device: int) -> Callable[..., Any]:
    """`compile_with_profile`, except that under `train.pgle: auto` a failure of the profile compile
    (an XLA that rejects the profile, a dump it does not write) costs the overlap, not the run: the
    plain step is returned with a warning naming the error. `synthetic` (asked for) raises it."""
    try:
        return compile_with_profile(step, args, gpu, profile_dir, cfg, seqs_per_device)
    except Exception as e:  # noqa: BLE001 - any failure of this optional optimisation
        if cfg.train.pgle == "synthetic":
            raise
        log.warning("train.pgle=auto: the synthetic PGLE compile failed (%s: %.300s); training with "
                    "XLA's own schedule. Set train.pgle=off to skip the attempt.", type(e).__name__, e)
        return step

