"""Which JAX platforms a farskip_jax process starts, decided before JAX initialises its backends.

Why: the venv carries GPU PJRT plugins that a machine may have no hardware for (the inspector needs
both the CUDA and the ROCm plugin to compile for H200 / MI300X on a CPU-only host). JAX imports and
initialises every installed plugin at its first backend use, and without the hardware:

* the CUDA plugin, when ``JAX_PLATFORMS`` is unset, runs its CUDA/cuDNN version check, which logs a
  "Jax plugin configuration error ... Unable to load cuDNN" traceback and leaves the plugin
  unregistered (so a deviceless H200 compile then fails with "topology not implemented for cuda");
* the ROCm plugin's ``initialize()`` raises "No AMD GPUs were found" whatever ``JAX_PLATFORMS`` says,
  which JAX logs as a "Jax plugin configuration error" traceback in every program (the converter,
  train.py, the demo).

``configure()`` runs once, from ``farskip_jax/__init__.py``, before any backend exists:

1. When ``JAX_PLATFORMS`` is unset (and nothing set ``jax_platforms``), it sets ``jax_platforms`` to
   the GPU platforms whose hardware is present and whose plugin is installed (``rocm`` for
   ``/dev/kfd``, ``cuda`` for ``/dev/nvidiactl`` or ``/dev/nvidia<N>``), then ``cpu``. A user's
   ``JAX_PLATFORMS`` always wins.
2. Without ``/dev/kfd``, and unless rocm was asked for explicitly, it drops exactly the ROCm plugin's
   "No AMD GPUs were found" record from JAX's plugin-discovery logger. Any other plugin failure is
   still reported.

A deviceless compile needs ``jax_platforms=cpu`` while the GPU plugins still load (they provide the
compile-only topologies): ``use_cpu_for_deviceless_compile()`` arranges that, and the ROCm plugin
registers once ``farskip_jax.xla.rocm_standins.enable()`` has run (it bypasses the GPU count, so
the filter above has nothing to drop).
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import pkgutil
from typing import Any, Literal

_PLUGIN_LOGGER = "jax._src.xla_bridge"  # logs "Jax plugin configuration error: ..." in discovery
_NO_AMD_GPU = "No AMD GPUs were found"
_configured = False


def hardware_platforms() -> list[str]:
    """GPU platforms whose kernel driver device nodes exist on this machine (no JAX state touched)."""
    found = []
    if os.path.exists("/dev/kfd"):
        found.append("rocm")
    if os.path.exists("/dev/nvidiactl") or glob.glob("/dev/nvidia[0-9]*"):
        found.append("cuda")
    return found


def installed_gpu_plugins() -> set[str]:
    """Platforms of the PJRT plugins under the ``jax_plugins`` namespace package (not imported)."""
    spec = importlib.util.find_spec("jax_plugins")
    if spec is None or not spec.submodule_search_locations:
        return set()
    names = {m.name for m in pkgutil.iter_modules(list(spec.submodule_search_locations))}
    return ({"cuda"} if any(n.startswith("xla_cuda") for n in names) else set()) | \
           ({"rocm"} if any(n.startswith("xla_rocm") for n in names) else set())


def current() -> str | None:
    """JAX's ``jax_platforms`` setting now (None: not set). Read the way the GPU plugins read it."""
    from jax._src import config as jax_config

    return jax_config.jax_platforms.value


def _requested() -> list[str]:
    """Platforms named in JAX_PLATFORMS / jax_platforms, with 'gpu' meaning both GPU kinds."""
    text = current() or os.environ.get("JAX_PLATFORMS", "")
    out: list[str] = []
    for p in filter(None, (s.strip().lower() for s in text.split(","))):
        out += ["cuda", "rocm"] if p == "gpu" else [p]
    return out


def _backends_started() -> bool:
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return started() if started is not None else bool(getattr(xla_bridge, "_backends", None))


def select_default_platforms() -> str | None:
    """Set ``jax_platforms`` to the platforms with hardware present when the user chose none.

    Returns the value set, or None when the user's ``JAX_PLATFORMS`` / ``jax_platforms`` is kept or
    backends already exist (then it is too late to choose).
    """
    import jax

    if os.environ.get("JAX_PLATFORMS") or current() or _backends_started():
        return None
    plugins = installed_gpu_plugins()
    chosen = ",".join([p for p in hardware_platforms() if p in plugins] + ["cpu"])
    jax.config.update("jax_platforms", chosen)
    return chosen


class _DropAbsentRocmPlugin(logging.Filter):
    """Drops the ROCm plugin's "No AMD GPUs were found" initialisation error (and nothing else)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        module = str(record.args[0]) if isinstance(record.args, tuple) and record.args else ""
        if module.startswith("jax_plugins.xla_rocm") and isinstance(exc, ValueError) \
                and _NO_AMD_GPU in str(exc):
            return "rocm" in _requested()  # asked for explicitly: the user should see why it failed
        return True


def quiet_absent_rocm_plugin() -> bool:
    """Install the filter when this machine has no AMD GPU; returns whether it is installed."""
    if "rocm" in hardware_platforms():
        return False
    log = logging.getLogger(_PLUGIN_LOGGER)
    if not any(isinstance(f, _DropAbsentRocmPlugin) for f in log.filters):
        log.addFilter(_DropAbsentRocmPlugin())
    return True


def configure() -> None:
    """Run once at ``import farskip_jax``: default platforms and the ROCm filter (see module doc)."""
    global _configured
    if _configured:
        return
    _configured = True
    select_default_platforms()
    quiet_absent_rocm_plugin()


def use_cpu_for_deviceless_compile() -> None:
    """Restrict JAX to its CPU backend for a compile-only GPU target, if backends do not exist yet.

    The GPU plugins still load and register (the CUDA plugin skips its version check when cuda is
    not requested), which is what the topology API needs. An explicit ``JAX_PLATFORMS`` is
    overridden here: the inspector compiles for a target spec, never for the local GPUs. Once
    backends exist nothing can change; the caller's topology lookup then reports what is missing.
    """
    import jax

    if _backends_started():
        return
    if current() != "cpu":
        jax.config.update("jax_platforms", "cpu")


def target_device():
    """The device the program being traced will run on: JAX's default device, which a deviceless
    compile sets to one of the target's compile-only devices while it traces (xla/aot.py).

    Kernel choices that depend on the hardware (`expert_matmul: auto`, `attention: auto`, and
    tokamax's own kernel selection) read it, so a CPU-hosted compile for an H200 picks the H200's
    kernels and a CPU test run picks the CPU's paths.
    """
    from jax.extend import backend

    return backend.get_default_device()


DeviceFamily = Literal["cpu", "cuda", "rocm"]


def device_family(device: Any) -> DeviceFamily:
    """cpu, cuda or rocm for a real or compile-only (deviceless) device: what kernel choices key on.

    Deviceless GPU devices and PJRT-plugin devices both report platform "gpu"; the vendor then
    comes from the client's platform version or the device kind (the MI300X target says "MI300X").
    """
    platform = getattr(device, "platform", "cpu")
    if platform in ("cpu", "cuda", "rocm"):
        return platform
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    kind = str(getattr(device, "device_kind", "")).lower()
    if "rocm" in version or "hip" in version or "amd" in kind or kind.startswith("mi") or "instinct" in kind:
        return "rocm"
    return "cuda"


# Importing this module (farskip_jax/__init__.py does, first) is what configures the process, so
# that no farskip_jax entry point can reach a JAX backend before the choice is made.
configure()
