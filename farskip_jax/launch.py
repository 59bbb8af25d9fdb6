"""Local launcher: N processes of one command on this machine, joined as one multi-process JAX run.

    python -m farskip_jax.launch --processes 2 --cpu-devices 4 -- train.py --config tiny_farskip
    python -m farskip_jax.launch --processes 2 --gpus-per-process 4 -- train.py --config dsv2lite_farskip

Each process gets JAX_COORDINATOR_ADDRESS (127.0.0.1 and a free port), JAX_NUM_PROCESSES and
JAX_PROCESS_ID, which `farskip_jax.distributed.initialize` reads; with `--cpu-devices K` it also
runs on K host CPU devices (gloo collectives between the processes), with `--gpus-per-process K`
on its own K GPUs (JAX_LOCAL_DEVICE_IDS). Process 0's output passes through; the others' lines
are prefixed with `[process I]`.

The job ends when every process has ended. As soon as one process fails (non-zero exit or a
signal), the others are stopped (SIGTERM, then SIGKILL after --grace seconds) and the launcher
exits with the failed process's status, so a crash never leaves the rest waiting in a collective.
For a multi-node job use SLURM instead (scripts/*.sbatch); this launcher is for testing on one
machine.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: dict[str, str], index: int, args: argparse.Namespace, port: int) -> dict[str, str]:
    env = dict(base)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(args.processes),
               JAX_PROCESS_ID=str(index))
    if args.cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
    if args.gpus_per_process:
        k = args.gpus_per_process
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(i) for i in range(index * k, (index + 1) * k))
    return env


def _command(argv: list[str]) -> list[str]:
    """A Python script or `-m module` runs under this interpreter; anything else as given."""
    if argv[0] == "-m" or argv[0].endswith(".py"):
        return [sys.executable, *argv]
    return argv


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.buffer.write(prefix.encode() + line)
        out.buffer.flush()


def _status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def run(args: argparse.Namespace) -> int:
    if not args.command:
        raise SystemExit("error: no command to launch; put it after --, e.g. "
                         "-- train.py --config tiny_farskip")
    port = args.port or free_port()
    cmd = _command(args.command)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for i in range(args.processes):
        pipe = None if i == 0 else subprocess.PIPE
        p = subprocess.Popen(cmd, env=process_env(dict(os.environ), i, args, port), stdout=pipe, stderr=pipe)
        procs.append(p)
        if i:
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, f"[process {i}] ", out), daemon=True)
                t.start()
                pumps.append(t)

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    failed: tuple[int, int] | None = None
    while any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            code = p.poll()
            if code not in (None, 0) and failed is None:
                failed = (i, code)
                print(f"launch: process {i} ended with {_status(code)}; stopping the other processes",
                      file=sys.stderr, flush=True)
                _stop([q for q in procs if q.poll() is None], args.grace)
        time.sleep(0.1)
    for t in pumps:
        t.join(timeout=5)
    if failed is None:
        codes = [p.returncode for p in procs]
        failed = next(((i, c) for i, c in enumerate(codes) if c), None)
    if failed is None:
        return 0
    i, code = failed
    print(f"launch: job failed: process {i} ended with {_status(code)}", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m farskip_jax.launch", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start N processes of a command on this machine as one multi-process JAX run "
                    "(for testing multi-node code paths; use SLURM across nodes).",
        epilog="Example: python -m farskip_jax.launch --processes 2 --cpu-devices 4 -- train.py "
               "--config tiny_farskip --set mesh.expert=8")
    p.add_argument("--processes", type=int, required=True, metavar="N", help="number of processes")
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--cpu-devices", type=int, metavar="K",
                     help="run each process on K host CPU devices (JAX_PLATFORMS=cpu)")
    dev.add_argument("--gpus-per-process", type=int, metavar="K",
                     help="give process i the GPUs i*K .. i*K+K-1 (JAX_LOCAL_DEVICE_IDS)")
    p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping the other processes (default 10)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="after --: the command, e.g. train.py ARGS or -m farskip_jax generate ARGS")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    for name in ("processes", "cpu_devices", "gpus_per_process"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1, got {value}", file=sys.stderr)
            return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
