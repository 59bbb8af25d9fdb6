"""XLA flags per hardware target, kept in one table.

XLA reads ``XLA_FLAGS`` once per process, at the first backend initialisation / compile; setting it
later has no effect (measured, shared/ROCM_DEVICELESS.md). So ``apply_default_xla_flags`` must run
before the first compile. For a single compile, ``compiler_options_for`` gives the same settings
as ``jit(...).lower(...).compile(compiler_options=...)`` options, which do apply per compile.

Every flag below was measured on a deviceless compile of a toy shard_map program (or is a runtime
workaround with a cited source); nothing is added on speculation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TARGETS = ("h200", "mi300x", "local")


@dataclass(frozen=True)
class Flag:
    name: str  # without the leading "--"
    value: str  # as written in XLA_FLAGS
    why: str
    per_compile: bool  # also valid as a compile-time compiler_options entry (scheduling flags)


_H200 = (
    # LHS: already on by default for sm_90 targets (H200 HLO identical with/without it, measured in
    # shared/ROCM_DEVICELESS.md), explicit so a future default change cannot silently drop overlap.
    Flag("xla_gpu_enable_latency_hiding_scheduler", "true",
         "overlap collectives with compute; default-on for sm_90, explicit for safety "
         "(ROCM_DEVICELESS.md flag table)", True),
)
_MI300X = (
    # LHS: without it the MI300X all-to-all stays synchronous (measured: ROCM_DEVICELESS.md table,
    # and tests/inspect/test_rocm.py); AMD's MaxText defaults set it too (ECOSYSTEM.md 1.2).
    Flag("xla_gpu_enable_latency_hiding_scheduler", "true",
         "MI300X all-to-all is sync without it (measured); AMD MaxText default", True),
    # Not the analytical latency estimator: XLA logs "Runtime estimate for all-to-all-start not
    # implemented" and treats the all-to-all as free, so it schedules less under it. Measured on the
    # DSV2-Lite EP=8 train step (deviceless MI300X): FarSkip all-to-all hidden 44.0% with it, 60.8%
    # with LHS alone (BENCHMARKS.md). Pass it with --compiler-option to compare.
    # Triton GEMM off: the deviceless gfx942 compile of the TP prefill picks a Triton tiling that
    # needs 80 KiB of LDS ("Shared memory size limit exceeded: requested 81920, available: 65536")
    # and fails; AMD's MaxText defaults turn Triton GEMMs off too (ECOSYSTEM.md 1.2), so matmuls go
    # to hipBLASLt/rocBLAS.
    Flag("xla_gpu_enable_triton_gemm", "false",
         "gfx942 Triton GEMM tiling exceeds LDS in deviceless compiles (measured); AMD MaxText default",
         True),
    # Command buffers (HIP graphs): recurring ROCm crash source; AMD's documented workaround
    # (ROCm 7.13 JAX install docs, openxla/xla#46952). Runtime-only, no effect on the schedule.
    Flag("xla_gpu_enable_command_buffer", "",
         "HIP-graph crashes on ROCm; AMD's documented workaround (ROCm JAX docs, xla#46952)", False),
    # hipCUB radix sort costs ~15 ms per router top_k sort on ROCm (AMD-AGI/Primus env_spec.py,
    # ECOSYSTEM.md 1.2). Affects the sort lowering, not collective scheduling.
    Flag("xla_gpu_enable_cub_radix_sort", "false",
         "hipCUB sort ~15 ms per router top_k on ROCm (AMD Primus MaxText env)", False),
)
_FLAGS: dict[str, tuple[Flag, ...]] = {"h200": _H200, "mi300x": _MI300X, "local": ()}
# Tensor-parallel inference (both GPU families): XLA's all-reduce combiner would merge FarSkip's
# independent psums (layer k's routed psum with layer k+1's attention + shared psum) into one that
# waits for both (FARSKIP.md 5: at decode sizes it did). Serving stacks issue each psum on its own.
PSUM_COMBINE_OFF = Flag("xla_gpu_all_reduce_combine_threshold_bytes", "0",
                        "keep FarSkip's TP psums apart: the combiner merged them at decode sizes", True)


def _check(target: str) -> None:
    if target not in _FLAGS:
        raise ValueError(f"unknown target {target!r}; expected one of {TARGETS}")


def flag_table(target: str) -> tuple[Flag, ...]:
    """The Flag records (with their reasons) for a target."""
    _check(target)
    return _FLAGS[target]


def flags_for(target: str) -> list[str]:
    """``--name=value`` strings for ``target`` ('h200', 'mi300x' or 'local' = none)."""
    return [f"--{f.name}={f.value}" for f in flag_table(target)]


def _flag_names(xla_flags: str) -> set[str]:
    return {tok[2:].split("=", 1)[0] for tok in xla_flags.split() if tok.startswith("--")}


def apply_default_xla_flags(target: str, environ: dict[str, str] | None = None,
                            tp_inference: bool = False) -> list[str]:
    """Append our defaults for ``target`` (with ``tp_inference``, and `PSUM_COMBINE_OFF` on a GPU)
    to XLA_FLAGS, skipping any flag the user already set.

    The user's own setting of a flag wins. Must run before JAX compiles anything in this process.
    Returns the flags that were added.
    """
    env = os.environ if environ is None else environ
    current = env.get("XLA_FLAGS", "")
    present = _flag_names(current)
    table = flag_table(target) + ((PSUM_COMBINE_OFF,) if tp_inference and target != "local" else ())
    added = [f"--{f.name}={f.value}" for f in table if f.name not in present]
    if added:
        env["XLA_FLAGS"] = " ".join([current.strip(), *added]).strip()
    return added


def detect_local_target() -> str:
    """The flag set for this machine's accelerators, read from device nodes (no JAX state touched).

    'mi300x' where the ROCm kernel driver (/dev/kfd) is present, 'h200' (the NVIDIA set) where an
    NVIDIA device node is, 'local' (no flags) on CPU-only hosts.
    """
    if os.path.exists("/dev/kfd"):
        return "mi300x"
    if os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0"):
        return "h200"
    return "local"


def _typed(value: str) -> bool | int | str:
    if value in ("true", "false"):
        return value == "true"
    if value.lstrip("-").isdigit():
        return int(value)
    return value


def compiler_options_for(target: str) -> dict[str, bool | int | str]:
    """Per-compile options for ``.compile(compiler_options=...)`` (scheduling-relevant flags only)."""
    return {f.name: _typed(f.value) for f in flag_table(target) if f.per_compile}
