"""Target specs shipped with farskip_jax, and readers for them.

``h200.txtpb`` / ``mi300x.txtpb`` are XLA ``GpuTargetConfig`` text protos: a deviceless compile
takes its cost model and code generation from them, and the inspector reads the HBM size for its
memory section.

This module imports nothing from JAX on purpose: it is read before JAX discovers its plugins (the
ROCm stand-ins must be in place by then), and it must not pull ``jax`` in to do so.
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

# deviceless target name -> (PJRT platform, spec file)
PLATFORMS = {"h200": "cuda", "mi300x": "rocm"}
SPEC_FILES = {"h200": "h200.txtpb", "mi300x": "mi300x.txtpb"}


def load_target_file(filename: str) -> str:
    """Text of a file shipped in farskip_jax/targets/."""
    try:
        return importlib.resources.files(__name__).joinpath(filename).read_text()
    except (ModuleNotFoundError, FileNotFoundError, TypeError):
        # a source tree without package metadata: read the file next to this module
        return (Path(__file__).resolve().parent / filename).read_text()


def spec_text(target: str) -> str:
    """The GpuTargetConfig text of a deviceless target ('h200' or 'mi300x')."""
    if target not in SPEC_FILES:
        raise ValueError(f"no target spec for {target!r}; known: {sorted(SPEC_FILES)}")
    return load_target_file(SPEC_FILES[target])


def _spec_number(target: str, field: str) -> float | None:
    m = re.search(rf"^\s*{field}:\s*([0-9.eE+]+)\s*$", spec_text(target), re.MULTILINE)
    return float(m.group(1)) if m else None


def device_memory_size(target: str) -> int | None:
    """HBM bytes per device from the spec's ``gpu_device_info.device_memory_size`` (None if absent)."""
    v = _spec_number(target, "device_memory_size")
    return int(v) if v is not None else None


def memory_bandwidth(target: str) -> float | None:
    """HBM bandwidth in bytes/s from the spec's ``gpu_device_info.memory_bandwidth`` (None if absent)."""
    return _spec_number(target, "memory_bandwidth")
