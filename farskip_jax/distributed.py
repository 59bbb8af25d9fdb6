"""Multi-process start-up: one JAX process per node (or per GPU), joined by JAX's multi-controller runtime.

Every entry point (`train.py`, `inspect --target local`, `generate`) calls `initialize(args)` before
its first JAX computation. Where the process group comes from, first match wins:

  1. flags        --coordinator-address HOST:PORT --num-processes N --process-id I
  2. environment  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (the local launcher,
                  `python -m farskip_jax.launch`, and Kubernetes/plain scripts set these)
  3. SLURM        SLURM_NTASKS > 1 inside a job step (srun): JAX's own SLURM detection (coordinator =
                  first node of the step, port from the job id or JAX_COORDINATOR_PORT)

With none of these the run is single-process and nothing is initialised. `JAX_LOCAL_DEVICE_IDS`
(read by JAX) restricts a process to some of the node's GPUs; under SLURM JAX gives each task the
GPU of its SLURM_LOCALID unless that variable is set (the sbatch examples in `scripts/` set it when
they run one task per node with all of its GPUs).

On CPU the cross-process collectives are gloo's (JAX's default CPU collectives), so the whole
multi-process path runs on one machine for testing.

Failure handling: the coordinator declares a process dead after `--heartbeat-timeout` seconds
without a heartbeat and the others then stop with an error instead of waiting forever; the local
launcher and `srun --kill-on-bad-exit=1` end the job as soon as one process exits with an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from typing import Any

from farskip_jax.errors import UserError

log = logging.getLogger(__name__)

ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where this process sits in a multi-process run; `source` says which settings were used."""

    coordinator_address: str | None  # None: JAX derives it (SLURM)
    num_processes: int | None
    process_id: int | None
    source: str  # "flags", "environment" or "slurm"


def add_distributed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(
        "multi-process (one process per node; default: from SLURM or JAX_COORDINATOR_ADDRESS / "
        "JAX_NUM_PROCESSES / JAX_PROCESS_ID, else single-process)")
    g.add_argument("--coordinator-address", metavar="HOST:PORT",
                   help="address of process 0's coordinator, the same for every process")
    g.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1")
    g.add_argument("--heartbeat-timeout", type=int, default=100, metavar="S",
                   help="seconds without a heartbeat after which a process counts as dead and the others "
                        "stop with an error (default 100)")
    g.add_argument("--init-timeout", type=int, default=300, metavar="S",
                   help="seconds to wait for every process to join at start-up (default 300)")
    return parser


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"environment variable {name}={text!r} is not an integer") from None


def detect(args: argparse.Namespace | None = None) -> ProcessGroup | None:
    """The process group this process belongs to, or None for a single-process run."""
    flags = [getattr(args, k, None) for k in ("coordinator_address", "num_processes", "process_id")]
    if any(v is not None for v in flags):
        if any(v is None for v in flags):
            raise UserError("--coordinator-address, --num-processes and --process-id go together; "
                            "pass all three (or none, to read them from SLURM or the JAX_* variables)")
        group = ProcessGroup(*flags, source="flags")
    elif os.environ.get(ENV_ADDRESS) or os.environ.get(ENV_COUNT) or os.environ.get(ENV_ID):
        group = ProcessGroup(os.environ.get(ENV_ADDRESS) or None, _env_int(ENV_COUNT), _env_int(ENV_ID),
                             source="environment")
        missing = [n for n, v in zip((ENV_ADDRESS, ENV_COUNT, ENV_ID), dataclasses.astuple(group)[:3],
                                     strict=True) if v is None]
        if missing:
            raise UserError(f"multi-process environment is incomplete: {', '.join(missing)} not set "
                            f"(set {ENV_ADDRESS}, {ENV_COUNT} and {ENV_ID} together)")
    elif "SLURM_JOB_ID" in os.environ and (_env_int("SLURM_NTASKS") or 1) > 1:
        group = ProcessGroup(None, None, None, source="slurm")
    else:
        return None
    if group.num_processes is not None:
        if group.num_processes < 1:
            raise UserError(f"number of processes must be >= 1, got {group.num_processes} ({group.source})")
        if not 0 <= group.process_id < group.num_processes:
            raise UserError(f"process id {group.process_id} is outside 0..{group.num_processes - 1} "
                            f"({group.source})")
        if group.num_processes == 1:
            return None
    return group


def initialize(args: argparse.Namespace | None = None) -> ProcessGroup | None:
    """Joins the multi-process run described by `args` / the environment (see the module docstring);
    a no-op for a single-process run. Must run before the first JAX computation."""
    group = detect(args)
    if group is None:
        return None
    import jax

    if jax.distributed.is_initialized():
        return group
    kwargs = dict(initialization_timeout=getattr(args, "init_timeout", 300),
                  heartbeat_timeout_seconds=getattr(args, "heartbeat_timeout", 100))
    if group.source == "slurm":
        kwargs["cluster_detection_method"] = "slurm"
    else:
        kwargs.update(coordinator_address=group.coordinator_address, num_processes=group.num_processes,
                      process_id=group.process_id)
    jax.distributed.initialize(**kwargs)
    # No jax.process_index() here: it would start the backend before the caller's XLA flags are set.
    log.info("joined the multi-process run as process %s of %s (%s; coordinator %s)", group.process_id,
             group.num_processes, group.source, group.coordinator_address or "from SLURM")
    return group


def is_main_process() -> bool:
    """Process 0, the one that logs, shows progress and prints results (True when single-process)."""
    import jax

    return jax.process_index() == 0


def quiet_other_processes() -> None:
    """Logging from process 0 only: the other processes keep their errors (which name their
    process in the launcher's and SLURM's output) and drop everything below."""
    if not is_main_process():
        root = logging.getLogger()
        root.setLevel(max(root.level, logging.ERROR))


def allgather_json(value: Any) -> list[Any]:
    """Every process's `value` (JSON-able), in process order; `[value]` in a single-process run.
    A collective: every process must call it at the same point."""
    import jax

    if jax.process_count() == 1:
        return [value]
    import numpy as np
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray([data.size], np.int64))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[:int(n)]).decode()) for row, n in zip(rows, sizes.reshape(-1), strict=True)]
