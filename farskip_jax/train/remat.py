"""`execution.remat: auto`: the train step keeps the most activations that fit the device's memory.

Recomputation trades memory for time, and which trade pays depends on the device: the DeepSeek-V2-
Lite FCSD step at 4 x 4096 tokens per GPU (BENCHMARKS.md K4, est.) peaks at 120.6 / 70.3 / 55.4 /
43.0 GiB per H200 under none / save_a2a / save_dots / full, and on MI300X `none` (151.9 GiB of 192)
is the fastest policy by 13%, while on H200 (85.5% of its HBM) it is 6% slower than save_a2a: so
close to the device's memory XLA's scheduler holds collectives back to stay under its own limit,
which it plans as 80% of device memory (gpu_hlo_schedule.cc GetSchedulerMemoryLimit).

So `auto` compiles the step with each policy, most kept first, and runs the first whose compiled
peak (arguments + outputs - aliased + temporaries, `xla.aot.memory_section`) fits the budget:
`execution.remat_hbm_fraction` (0.8) of the device's HBM, and never more than JAX's allocator may
hand out, or `execution.remat_budget_gib`. Where no budget is known (CPU) it is `none` without
compiling anything extra. Each rejected policy costs one compile; the log names the peaks, and
`--set execution.remat=<policy>` pins the choice.

The overflow re-run's worst-case program (`execution.moe_buffer_factor`) holds more than the bounded
step, so it is chosen the same way among the policies that recompute at least as much as the
bounded step's: a named policy is kept for the bounded step as asked, and the re-run, compiled when
a step first overflows, recomputes more only where that policy would not fit.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from farskip_jax import targets
from farskip_jax.config import Config

log = logging.getLogger(__name__)

# Most kept first: each later policy recomputes more and holds less.
REMAT_BY_MEMORY = ("none", "save_a2a", "save_dots", "full")
GIB = 2**30


def with_remat(cfg: Config, policy: str) -> Config:
    """`cfg` whose step recomputes as `policy` says (nothing else changes)."""
    return dataclasses.replace(cfg, execution=dataclasses.replace(cfg.execution, remat=policy))


def candidates(configured: str, expert_parallel: bool, at_least: str | None = None) -> tuple[str, ...]:
    """The policies to try in order: every one for auto, else the configured one alone; `at_least`
    (the worst-case re-run): only those recomputing at least as much as that one. Without expert
    parallelism save_a2a keeps what full keeps (there is no all-to-all), so it is not tried."""
    if configured != "auto" and at_least is None:
        return (configured,)
    order = REMAT_BY_MEMORY if expert_parallel else tuple(p for p in REMAT_BY_MEMORY if p != "save_a2a")
    if at_least is None:
        return order
    if at_least not in order:  # save_a2a without expert parallelism: as full
        at_least = "full"
    return order[order.index(at_least):]


def budget_bytes(exe: Any, hbm_bytes: int | None, allocator_limit: int | None = None) -> int | None:
    """remat=auto's budget per device (`ExecutionConfig.remat_hbm_fraction` / `remat_budget_gib`),
    or None where nothing is known about the device's memory."""
    if exe.remat_budget_gib > 0:
        return int(exe.remat_budget_gib * GIB)
    if hbm_bytes is None:
        return None
    budget = int(exe.remat_hbm_fraction * hbm_bytes)
    return min(budget, allocator_limit) if allocator_limit else budget


def local_memory() -> tuple[int | None, int | None]:
    """(HBM bytes, allocator limit bytes) of this process's first device; None where unknown. HBM
    comes from the shipped target spec when the device is one (H200, MI300X), else it is the
    allocator's limit (the runtime reports no total)."""
    device = jax.local_devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats raise instead of returning None
        stats = {}
    limit = stats.get("bytes_limit")
    kind = device.device_kind.lower().replace(" ", "")
    hbm = next((targets.device_memory_size(t) for t in targets.SPEC_FILES if t in kind), None)
    return (hbm or limit), limit


def device_budget(exe: Any) -> int | None:
    """`budget_bytes` for this process's device (`local_memory`)."""
    hbm, allocator_limit = local_memory()
    budget = budget_bytes(exe, hbm, allocator_limit)
    if budget is not None and budget == allocator_limit and hbm != allocator_limit:
        log.info("execution.remat: the budget is JAX's allocator limit, %.1f GiB of %.1f GiB HBM "
                 "(XLA_PYTHON_CLIENT_MEM_FRACTION; scripts/train_*.sbatch set 0.95)", budget / GIB, hbm / GIB)
    return budget


def compiled_peak(compiled: Any) -> int | None:
    """Peak bytes per device of a compiled step (`xla.aot.memory_section`), None where the backend
    gives no memory analysis."""
    from farskip_jax.xla import aot  # not at import time: the trainer needs it only for a choice

    return (aot.memory_section(compiled.memory_analysis(), None) or {}).get("peak_bytes_per_device")


def _all_processes(fits: bool) -> bool:
    """Every process decides alike (each compiled the same SPMD program; a host whose allocator
    limit is lower must not run another program than the rest)."""
    if jax.process_count() == 1:
        return fits
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(fits))))


@dataclasses.dataclass
class Choice:
    """What remat=auto ran: the policy, what its compile returned, and the peaks it saw."""

    policy: str
    compiled: Any
    budget: int | None
    peaks: dict[str, int | None]  # policy -> compiled peak bytes per device, in the order tried

    @property
    def fits(self) -> bool:
        peak = self.peaks.get(self.policy)
        return self.budget is None or peak is None or peak <= self.budget

    def describe(self) -> str:
        tried = ", ".join(f"{p} {_gib(b)}" for p, b in self.peaks.items()) or "nothing compiled"
        budget = "no budget known" if self.budget is None else f"budget {_gib(self.budget)}"
        return f"{self.policy} (peaks per device: {tried}; {budget})"


def _gib(b: int | None) -> str:
    if b is None:
        return "?"
    return f"{b / GIB:.1f} GiB" if b >= GIB else f"{b / 2**20:.1f} MiB"


def choose(policies: tuple[str, ...], compile_peak: Callable[[str], tuple[Any, int | None]],
           budget: int | None, agree: Callable[[bool], bool] = _all_processes) -> Choice:
    """The first of `policies` whose compile fits `budget`. `compile_peak(policy)` -> (what the
    compile returned, peak bytes per device or None when the backend reports none). With no budget
    the first policy is taken uncompiled (compiled None: the caller compiles it as usual). When none
    fits, the last (the one holding least) is returned with a warning: XLA may still fit it by its
    own rematerialization, or the run fails with its out-of-memory error."""
    if budget is None or len(policies) == 1:
        return Choice(policies[0], None, budget, {})
    peaks: dict[str, int | None] = {}
    for policy in policies:
        compiled, peak = compile_peak(policy)
        peaks[policy] = peak
        choice = Choice(policy, compiled, budget, peaks)
        if agree(choice.fits):
            return choice
    log.warning("execution.remat=auto: no policy fits: %s; running %s. Fewer tokens per device "
                "(data.batch_size, data.seq_len) or a larger budget (execution.remat_hbm_fraction, "
                "execution.remat_budget_gib).", choice.describe(), policy)
    return choice


def settle(cfg: Config, program: Any, args: tuple, worst_case: bool = False) -> tuple[Any, Choice]:
    """The trainer's step for `cfg` on `program`'s mesh with execution.remat settled, compiled for
    `args` where a choice was made: (program, compiled step or None, i.e. the jitted one as usual)
    and the `Choice`. `worst_case`: the overflow re-run's, among the policies recomputing at least
    as much as `program`'s (the bounded step's)."""
    from farskip_jax.train.program import build_program  # program.py imports this module

    exe, current = cfg.execution, program.student_exe.remat
    policies = candidates(exe.remat, program.parallel is not None, at_least=current if worst_case else None)

    def compile_peak(policy: str) -> tuple[Any, int | None]:
        prog = program if policy == current else build_program(with_remat(cfg, policy), program.mesh)
        step = prog.worst_case_train_step if worst_case else prog.train_step
        t0 = time.perf_counter()
        compiled = step.lower(*args).compile()
        peak = compiled_peak(compiled)
        log.info("execution.remat: %s%s compiled in %.0f s, peak %s per device", policy,
                 " (worst-case buffers)" if worst_case else "", time.perf_counter() - t0, _gib(peak))
        return (prog, compiled), peak

    choice = choose(policies, compile_peak, device_budget(exe) if len(policies) > 1 else None)
    return choice.compiled or (program, None), choice


@dataclasses.dataclass
class Search:
    """A train step to compile under each of `policies` in turn until one fits: what the
    inspector's build callback returns for remat=auto (`inspect.steps.build_fcsd_step`), so that
    its report is of the program train.py would run on the target."""

    policies: tuple[str, ...]
    build: Callable[[str], tuple[Any, Any]]  # policy -> (jitted step, abstract arguments)
    exe: Any  # the ExecutionConfig, for its budget
