"""Deviceless (ahead-of-time) compile for a GPU target from a CPU-only host.

``make_target_mesh`` builds compile-only devices from a target spec (``farskip_jax/targets/*.txtpb``)
through the GPU PJRT plugin's topology API; ``compile_scheduled_hlo`` lowers and compiles a jitted
function against them and returns XLA's scheduled HLO. Nothing runs on a device.

Requirements: ``JAX_PLATFORMS=cpu`` (so JAX does not try to open real GPU clients), the
``jax-cuda13-plugin``/``-pjrt`` wheels for 'h200', and for 'mi300x' the ROCm wheels plus
``rocm_standins.enable()`` called before JAX initialises its backends (see rocm_standins.py).
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import topologies

from farskip_jax import platforms, targets
from farskip_jax.xla import flags as xla_flags

GPUS_PER_HOST = 8
# Compile-only: XLA's autotuner has no GPU to time its candidates on, yet it still compiles them.
# Level 0 takes the default configurations, and the scheduled HLO is the same (backend_config
# aside): measured on the production-path 3-layer DSV2-Lite step, H200 compile 35.3 -> 25.2 s,
# MI300X 16.8 -> 9.9 s. Deviceless targets only: on a device the trainer's compiles autotune.
DEVICELESS_OPTIONS: dict[str, Any] = {"xla_gpu_autotune_level": 0}


def topology_string(num_devices: int) -> str:
    """'<partitions>x<hosts>x<devices per host>': one host up to 8 GPUs, else 8 GPUs per host."""
    if num_devices <= GPUS_PER_HOST:
        return f"1x1x{num_devices}"
    if num_devices % GPUS_PER_HOST:
        raise ValueError(f"{num_devices} devices is not a multiple of {GPUS_PER_HOST} per host")
    return f"1x{num_devices // GPUS_PER_HOST}x{GPUS_PER_HOST}"


def get_target_topology(target: str, num_devices: int) -> Any:
    """Compile-only topology of ``num_devices`` GPUs of kind ``target``."""
    if target not in targets.PLATFORMS:
        raise ValueError(f"no deviceless topology for target {target!r}; "
                         f"use one of {sorted(targets.PLATFORMS)}")
    # Effective only before JAX discovers its plugins; afterwards it checks that what is in place
    # suffices (cpu platforms; for mi300x, the stand-ins) and says what to do if not.
    prepare_deviceless(target)
    try:
        return topologies.get_topology_desc(
            platform=targets.PLATFORMS[target], target_config=targets.spec_text(target),
            topology=topology_string(num_devices))
    except NotImplementedError as e:
        hint = ("install jax-cuda13-plugin/jax-cuda13-pjrt matching jaxlib (make test does)"
                if target == "h200" else
                "install jax-rocm7-plugin/-pjrt (make rocm-plugin) and call "
                "aot.prepare_deviceless('mi300x') before JAX initialises backends (in a fresh process)")
        raise RuntimeError(f"deviceless {target} topology unavailable ({e}); {hint}") from e


def prepare_deviceless(target: str) -> None:
    """Arrange what a deviceless compile for ``target`` needs; call before JAX initialises backends.

    Every non-local target needs JAX's platforms restricted to ``cpu``: otherwise JAX opens real GPU
    clients (and, with no GPU, the CUDA plugin's version check raises "Unable to load cuDNN" and the
    plugin never registers, so the H200 topology is "not implemented"). The plugins still load and
    provide the topologies. 'mi300x' also needs the ROCm stand-ins (rocm_standins.enable()).
    'local' compiles for the real devices and changes nothing.
    """
    if target == "local":
        return
    platforms.use_cpu_for_deviceless_compile()
    if target == "mi300x":
        from farskip_jax.xla import rocm_standins

        rocm_standins.enable()


def make_target_mesh(target: str, mesh_shape: dict[str, int]) -> jax.sharding.Mesh:
    """Mesh over compile-only ``target`` devices ('local' = the real ``jax.devices()``)."""
    names, sizes = tuple(mesh_shape), tuple(mesh_shape.values())
    n = math.prod(sizes)
    if target == "local":
        devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))  # as parallel.make_mesh
        if len(devs) < n:
            raise ValueError(f"mesh {mesh_shape} needs {n} devices, have {len(devs)}")
        # Mesh, not jax.make_mesh: the latter's axes are Explicit, which the model's layouts are not.
        return jax.sharding.Mesh(np.asarray(devs[:n], dtype=object).reshape(sizes), names)
    topo = get_target_topology(target, n)
    return topologies.make_mesh(topo, sizes, names)


@dataclass
class CompiledArtifacts:
    target: str
    hlo_text: str
    lower_seconds: float
    compile_seconds: float
    compiler_options: dict[str, Any] = field(default_factory=dict)
    lhs_schedule_text: str | None = None  # XLA's <module>.schedule.txt, when requested
    device_kind: str = ""
    num_devices: int = 0
    memory: dict[str, Any] | None = None  # memory_section() of the compiled executable
    executable: Any = None  # the jax Compiled itself, when asked for (`keep_executable`; local target)

    def summary(self) -> dict[str, Any]:
        return {"target": self.target, "lower_seconds": self.lower_seconds,
                "compile_seconds": self.compile_seconds, "compiler_options": self.compiler_options,
                "device_kind": self.device_kind, "num_devices": self.num_devices,
                "hlo_chars": len(self.hlo_text), "has_lhs_schedule": self.lhs_schedule_text is not None}


def memory_section(stats: Any, device_memory_size: int | None) -> dict[str, Any] | None:
    """Per-device memory of a compiled SPMD step, from ``Compiled.memory_analysis()``.

    The numbers are XLA's buffer assignment for one device's program (every device runs the same
    one): ``argument_bytes`` the inputs (donated ones included), ``output_bytes`` the results,
    ``alias_bytes`` the results that reuse a donated input's buffer (so they are counted in both),
    ``temp_bytes`` the arena for everything that lives only inside the step (activations kept for
    the backward, gradients, collective and GEMM workspaces): XLA packs those by simulating the
    schedule, so the arena is the peak of what is live together, not the sum of all temporaries.
    ``generated_code_bytes`` is the kernels' size (0 for a deviceless compile).

    ``peak_bytes_per_device``: what the runtime allocates for the step, argument + output - alias +
    temp (the temp arena is one allocation of ``temp_bytes``). ``xla_live_peak_bytes``: XLA's own
    ``peak_memory_in_bytes``, the largest set of buffers its heap simulation finds live at once.
    Under jaxlib 0.10.2 the two agreed up to alignment padding (16 bytes apart on a small check); under
    0.12 the simulated peak can be below the temp arena alone (1.94 vs 2.21 MB on a small train step,
    the arena's packing is not the live set's), so the allocation is the figure that decides whether
    a step fits. ``fraction`` = peak / ``device_memory_size``, the HBM in the target spec
    (``gpu_device_info.device_memory_size``), or the device's own ``bytes_limit`` for 'local'.
    Not included: the runtime's own reservations (CUDA/ROCm context, allocator fragmentation), so
    a fraction near 1 will not fit. Returns None when the backend offers no memory analysis.
    """
    if stats is None:
        return None
    get = lambda name: int(getattr(stats, name, 0) or 0)
    arg, out, alias = get("argument_size_in_bytes"), get("output_size_in_bytes"), get("alias_size_in_bytes")
    temp, code = get("temp_size_in_bytes"), get("generated_code_size_in_bytes")
    peak = arg + out - alias + temp
    return {"argument_bytes": arg, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp,
            "generated_code_bytes": code, "peak_bytes_per_device": peak,
            "xla_live_peak_bytes": get("peak_memory_in_bytes") or None,
            "device_memory_size": device_memory_size,
            "fraction": peak / device_memory_size if device_memory_size else None}


def _device_memory_size(target: str, devices: list[Any]) -> int | None:
    if target in targets.SPEC_FILES:
        return targets.device_memory_size(target)
    try:  # 'local': what the runtime reports for the real device (None on CPU)
        stats = devices[0].memory_stats() if devices else None
    except Exception:  # backends without memory stats raise rather than return None
        stats = None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def compile_scheduled_hlo(jitted_fn: Any, *arg_specs: Any, target: str,
                          compiler_options: dict[str, Any] | None = None,
                          default_options: bool = True, dump_lhs_schedule: bool = False,
                          dump_dir: str | None = None, keep_executable: bool = False) -> CompiledArtifacts:
    """Lower ``jitted_fn`` on ``arg_specs`` (ShapeDtypeStructs with NamedShardings on a target mesh)
    and compile; returns the scheduled HLO text and timings.

    ``default_options`` adds ``xla_flags.compiler_options_for(target)`` (and, for a deviceless
    target, ``DEVICELESS_OPTIONS``); ``compiler_options`` wins over those. ``dump_lhs_schedule``
    also asks XLA for its latency-hiding-scheduler dump. Both ``xla_dump_to`` and
    ``xla_dump_latency_hiding_schedule`` work as per-compile options (checked: the dump appears
    without touching XLA_FLAGS), so several compiles in one process are fine.
    """
    opts: dict[str, Any] = dict(xla_flags.compiler_options_for(target)) if default_options else {}
    if default_options and target != "local":
        opts.update(DEVICELESS_OPTIONS)
    opts.update(compiler_options or {})
    tmp = None
    if dump_lhs_schedule:
        if dump_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="farskip_lhs_")
            dump_dir = tmp.name
        opts.update({"xla_dump_to": dump_dir, "xla_dump_latency_hiding_schedule": True})
    # A compile-only executable cannot be read back from JAX's persistent cache ("PjRtCompiler must
    # be constructed with a Client"), so keep deviceless compiles out of it: raising the minimum
    # compile time stops the write (the cache-use decision itself is memoised per process).
    min_time_key = "jax_persistent_cache_min_compile_time_secs"
    old_min_time = getattr(jax.config, min_time_key)
    if target != "local":
        jax.config.update(min_time_key, 1e12)
    devices = _devices_of(arg_specs)
    try:
        t0 = time.perf_counter()
        # The target's device is the default device while tracing: whatever picks a kernel by the
        # device it will run on (tokamax's kernels, `expert_matmul: auto`, `attention: auto`, all
        # through `platforms.target_device()`) then picks the target's, not the host CPU's.
        with (jax.default_device(devices[0]) if devices and target != "local" else contextlib.nullcontext()):
            lowered = jitted_fn.lower(*arg_specs)
        t1 = time.perf_counter()
        compiled = lowered.compile(compiler_options=opts) if opts else lowered.compile()
        t2 = time.perf_counter()
        text = compiled.as_text()
        mem_stats = compiled.memory_analysis()
        sched = None
        if dump_lhs_schedule:
            files = sorted(glob.glob(os.path.join(dump_dir, "*.schedule.txt")), key=os.path.getmtime)
            if files:
                sched = Path(files[-1]).read_text()
    finally:
        jax.config.update(min_time_key, old_min_time)
        if tmp is not None:
            tmp.cleanup()
    return CompiledArtifacts(
        target=target, hlo_text=text, lower_seconds=t1 - t0, compile_seconds=t2 - t1,
        compiler_options={k: v for k, v in opts.items() if k != "xla_dump_to"}, lhs_schedule_text=sched,
        device_kind=devices[0].device_kind if devices else "", num_devices=len(devices),
        memory=memory_section(mem_stats, _device_memory_size(target, devices)),
        executable=compiled if keep_executable else None)


def _devices_of(arg_specs: Any) -> list[Any]:
    for leaf in jax.tree_util.tree_leaves(arg_specs):
        sh = getattr(leaf, "sharding", None)
        mesh = getattr(sh, "mesh", None)
        if mesh is not None:
            return list(mesh.devices.flat)
    return []
