"""farskip_jax/platforms.py: JAX platforms from the hardware present, and no ROCm plugin traceback on
machines without AMD GPUs, for every program that imports farskip_jax."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from farskip_jax import platforms

ROOT = Path(__file__).resolve().parents[2]


def _record(module: str, exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord("jax._src.xla_bridge", logging.ERROR, __file__, 1,
                             "Jax plugin configuration error: Exception when calling %s.initialize()",
                             (module,), info)


def test_filter_drops_only_the_absent_amd_gpu_error(monkeypatch: pytest.MonkeyPatch) -> None:
    f = platforms._DropAbsentRocmPlugin()
    monkeypatch.setattr(platforms, "current", lambda: "cpu")
    no_gpu = ValueError("No AMD GPUs were found, skipping ROCm plugin initialization")
    assert not f.filter(_record("jax_plugins.xla_rocm7", no_gpu))
    # anything else the ROCm plugin raises, and every other plugin's error, still shows
    assert f.filter(_record("jax_plugins.xla_rocm7", RuntimeError("librocprofiler-sdk.so.1: cannot open")))
    assert f.filter(_record("jax_plugins.xla_cuda13", RuntimeError("Unable to load cuDNN. Is it installed?")))
    # rocm asked for explicitly: the user must see why it failed
    monkeypatch.setattr(platforms, "current", lambda: "rocm,cpu")
    assert f.filter(_record("jax_plugins.xla_rocm7", no_gpu))


@pytest.mark.skipif(bool(platforms.hardware_platforms()), reason="this machine has GPU device nodes")
def test_clean_process_on_a_cpu_host_is_quiet_and_uses_cpu() -> None:
    code = ("import farskip_jax, jax; from farskip_jax import platforms; "
            "print(platforms.current(), jax.devices()[0].platform, jax.numpy.ones(3).sum())")
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["cpu", "cpu", "3.0"]
    assert res.stderr == "", res.stderr[-2000:]  # no "Jax plugin configuration error" tracebacks
    # an explicit JAX_PLATFORMS wins and stays quiet too (make test / make demo set cpu)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(env, JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stderr == "", res.stderr[-2000:]
