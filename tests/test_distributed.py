"""Multi-process start-up (farskip_jax.distributed) and failure handling, without a trainer."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from farskip_jax import distributed
from farskip_jax.errors import UserError
from farskip_jax.launch import free_port

REPO = Path(__file__).resolve().parents[1]
JAX_VARS = (distributed.ENV_ADDRESS, distributed.ENV_COUNT, distributed.ENV_ID, "SLURM_JOB_ID",
            "SLURM_NTASKS")


def _args(*argv: str) -> argparse.Namespace:
    return distributed.add_distributed_args(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.fixture
def clean_env(monkeypatch):
    for name in JAX_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_detect_sources_in_order(clean_env):
    assert distributed.detect(_args()) is None  # single-process: nothing to initialise
    clean_env.setenv("SLURM_JOB_ID", "7")
    clean_env.setenv("SLURM_NTASKS", "1")
    assert distributed.detect(_args()) is None  # a one-task SLURM job is single-process too
    clean_env.setenv("SLURM_NTASKS", "4")
    assert distributed.detect(_args()).source == "slurm"
    clean_env.setenv(distributed.ENV_ADDRESS, "10.0.0.1:1234")
    clean_env.setenv(distributed.ENV_COUNT, "2")
    clean_env.setenv(distributed.ENV_ID, "1")
    assert distributed.detect(_args()) == distributed.ProcessGroup("10.0.0.1:1234", 2, 1, "environment")
    got = distributed.detect(_args("--coordinator-address", "h:1", "--num-processes", "3",
                                   "--process-id", "2"))
    assert got == distributed.ProcessGroup("h:1", 3, 2, "flags")


def test_detect_rejects_incomplete_or_inconsistent_settings(clean_env):
    with pytest.raises(UserError, match="go together"):
        distributed.detect(_args("--num-processes", "2"))
    with pytest.raises(UserError, match="outside 0..1"):
        distributed.detect(_args("--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "2"))
    clean_env.setenv(distributed.ENV_COUNT, "2")
    with pytest.raises(UserError, match="JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID not set"):
        distributed.detect(_args())
    clean_env.setenv(distributed.ENV_ID, "one")
    with pytest.raises(UserError, match="JAX_PROCESS_ID='one' is not an integer"):
        distributed.detect(_args())


WORKER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    from farskip_jax import distributed
    args = distributed.add_distributed_args(__import__("argparse").ArgumentParser()).parse_args(
        ["--heartbeat-timeout", "3"])
    distributed.initialize(args)
    import jax, jax.numpy as jnp
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("joined")
    # A file, not stdout: Gloo's own C++ threads write to the same stdout and can split a line.
    with open(os.path.join({out!r}, f"joined{{jax.process_index()}}"), "w") as f:
        f.write(f"joined {{jax.process_index()}} {{jax.process_count()}} {{jax.device_count()}}")
    if jax.process_index() == 1:
        os.kill(os.getpid(), 9)
    while True:  # process 0 keeps running collectives with a peer that is gone
        multihost_utils.process_allgather(jnp.ones(1))
        time.sleep(0.2)
""")


def test_a_dead_process_ends_the_others_instead_of_hanging(tmp_path):
    """Without a launcher to stop it, process 0 learns from the coordinator that process 1 died
    (no heartbeats for --heartbeat-timeout seconds) and exits with an error naming it."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=str(REPO), out=str(tmp_path)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           distributed.ENV_ADDRESS: f"127.0.0.1:{free_port()}", distributed.ENV_COUNT: "2"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, distributed.ENV_ID: str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    t0 = time.monotonic()
    out1, _ = procs[1].communicate(timeout=120)
    killed_at = time.monotonic()
    out0, err0 = procs[0].communicate(timeout=120)
    waited = time.monotonic() - killed_at
    print(f"process 0 ended {waited:.1f} s after process 1 was killed (heartbeat timeout 3 s), "
          f"{killed_at - t0:.1f} s to start")
    joined = {i: (tmp_path / f"joined{i}").read_text() if (tmp_path / f"joined{i}").exists() else ""
              for i in (0, 1)}
    assert joined == {0: "joined 0 2 4", 1: "joined 1 2 4"}, (joined, out0[-2000:], out1[-2000:])
    assert procs[1].returncode == -9
    assert procs[0].returncode != 0
    assert "unhealthy" in err0 or "heartbeat" in err0.lower(), err0[-2000:]
    assert waited < 60
