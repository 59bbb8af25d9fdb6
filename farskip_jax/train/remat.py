"""`execution.remat: auto`: the train step keeps the most activations that fit the device's memory.

Recomputation trades memory for time, and which trade pays depends on the device: the DeepSeek-V2-
Lite FCSD step at 4 x 4096 tokens per GPU (BENCHMARKS.md K4, K15, K17, est.) peaks per H200 at 79.8
GiB under save_a2a_dots and 68.4 under save_a2a (120.6 / 55.4 / 43.0 under none / save_dots / full,
compiled before K15's gradient change), and on MI300X `none` (151.9 GiB of 192) is the fastest
policy by 13%, while on H200 (85.5% of its HBM) it is 6% slower than save_a2a: so close to the
device's memory XLA's scheduler holds collectives back to stay under its own limit, which it plans
as 80% of device memory (gpu_hlo_schedule.cc GetSchedulerMemoryLimit). There save_a2a_dots, which
recomputes neither an exchange nor a plain matmul, is the fastest that fits (est. 761 against 784 ms
for save_a2a).

So `auto` compiles the step with each policy, most kept first, and runs the first whose compiled
peak (arguments + outputs - aliased + temporaries, `xla.aot.memory_section`) fits the budget:
`execution.remat_hbm_fraction` (0.8) of the device's HBM, and never more than JAX's allocator may
hand out, or `execution.remat_budget_gib`. Where no budget is known (CPU) it is `none` without
compiling anything extra. Each rejected policy costs one compile; the log names the peaks, and
`--set execution.remat=<policy>` pins the choice. On H200 / MI300X a policy that fits but whose
schedule XLA left largely synchronous (`MAX_SYNC_SHARE`) or largely exposed (`MAX_EXPOSED_SHARE`)
is compared with the next one that fits by the inspector's estimated step (`choose`).

The overflow re-run's worst-case program (`execution.moe_buffer_factor`) holds more than the bounded
step, so it is chosen the same way among the policies that recompute at least as much as the
bounded step's: a named policy is kept for the bounded step as asked, and the re-run, compiled when
a step first overflows, recomputes more only where that policy would not fit.

With `mesh.teacher_experts: auto` on an FCSD step (`program.searches_teacher_layout`) the same search
places the frozen teacher's routed experts: each policy is tried first with all of them on every
device (`local`: no exchange for the teacher; est. 4.6% faster on 8 H200, 2.6% slower on 8 MI300X,
BENCHMARKS.md K26), then as auto's in-node rule places them; a candidate's label says which
(`none+local_teacher`, `none`). A local-teacher candidate that fits is compared with the next that
fits by the estimated step, as a held-back schedule is (`choose`), and the faster runs. A candidate
whose arguments alone exceed the budget is not compiled. Where no budget is known the teacher stays
where the rule puts it.

A run remembers its choices in `<train.output_dir>/remat_auto.json`, keyed by everything the
compiled peaks depend on (`memo_key`): a restart of the same run starts its search at the policy
chosen before, so the policies rejected then are not compiled again. The remembered policy is still
compiled and checked against the budget.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from farskip_jax import targets
from farskip_jax.config import Config
from farskip_jax.distributed import allgather_json

log = logging.getLogger(__name__)

# Most kept first: each later policy recomputes more and holds less.
REMAT_BY_MEMORY = ("none", "save_a2a_dots", "save_a2a", "save_dots", "full")
# Without expert parallelism there is no all-to-all to keep: these policies keep what another does.
_SAME_WITHOUT_EP = {"save_a2a_dots": "save_dots", "save_a2a": "full"}
GIB = 2**30
# A fitting policy whose schedule leaves more of its collective transfer time synchronous than this
# is compared with the next one (`choose`). Measured (BENCHMARKS K14, deviceless): H200 EP32 `none`
# 28-31%; the other full-size steps with a complete report 0-0.6%.
MAX_SYNC_SHARE = 0.25
# The same for the collective transfer time XLA's order leaves exposed (nothing scheduled under it),
# synchronous or not. Measured (BENCHMARKS K29, deviceless): 8 H200 FCSD with the activation kernel,
# `none` (teacher split) fits at 110.0 GiB and leaves 38.6% exposed (est. 571.1 ms), where
# `save_a2a_dots` with the local teacher, the next that fits, leaves 10.9% (est. 555.9 ms).
MAX_EXPOSED_SHARE = 0.25
MEMO_NAME = "remat_auto.json"
LOCAL_TEACHER = "+local_teacher"  # a candidate label's suffix (`label`)
# train.* keys that set the schedule and the run's bookkeeping, not what the step holds in memory;
# every other config value is part of `memo_key` (a key that changes costs a search, never a fit)
_NOT_IN_MEMO_KEY = frozenset({
    "learning_rate", "min_lr_ratio", "warmup_steps", "total_steps", "weight_decay", "grad_clip_norm",
    "seed", "log_every", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_batches",
    "patience", "drop_threshold", "eval_metric", "gen_eval", "max_nonfinite_in_row", "spike_factor",
    "output_dir", "init_checkpoint"})


def label(policy: str, local_teacher: bool) -> str:
    """A candidate's name: the policy, and whether the teacher's routed experts are on every device."""
    return policy + LOCAL_TEACHER if local_teacher else policy


def policy_of(candidate: str) -> str:
    return candidate.removesuffix(LOCAL_TEACHER)


def has_local_teacher(candidate: str) -> bool:
    return candidate.endswith(LOCAL_TEACHER)


def with_remat(cfg: Config, candidate: str) -> Config:
    """`cfg` whose step recomputes as `candidate`'s policy says, with the teacher's routed experts on
    every device where the candidate says so (nothing else changes)."""
    cfg = dataclasses.replace(cfg, execution=dataclasses.replace(cfg.execution, remat=policy_of(candidate)))
    if has_local_teacher(candidate):
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, teacher_experts="local"))
    return cfg


def candidates(configured: str, expert_parallel: bool, at_least: str | None = None,
               local_teacher: bool = False) -> tuple[str, ...]:
    """The policies to try in order: every one for auto, else the configured one alone; `at_least`
    (the worst-case re-run): only those recomputing at least as much as that one. Without expert
    parallelism save_a2a keeps what full keeps and save_a2a_dots what save_dots keeps (there is no
    all-to-all), so they are not tried. `local_teacher`: each policy first with the teacher's routed
    experts on every device, then without."""
    if configured != "auto" and at_least is None:
        order: tuple[str, ...] = (configured,)
    else:
        order = tuple(p for p in REMAT_BY_MEMORY if expert_parallel or p not in _SAME_WITHOUT_EP)
    if at_least is not None:
        at_least = at_least if at_least in order else _SAME_WITHOUT_EP[at_least]
        order = order[order.index(at_least):]
    return with_local_teacher(order) if local_teacher else order


def with_local_teacher(policies: tuple[str, ...]) -> tuple[str, ...]:
    """Each of `policies` with the teacher's routed experts on every device, then without."""
    return tuple(c for p in policies for c in (label(p, True), p))


def within_budget(cands: tuple[str, ...], arguments: Callable[[str], Any], budget: int) -> tuple[str, ...]:
    """`cands` without the local-teacher ones whose arguments (`arguments(candidate)`, sharded)
    alone exceed `budget`: their peak would too, so they are not compiled (DeepSeek-V3's routed
    experts on every GPU take ~1.3 TB)."""
    over = {c for c in cands if has_local_teacher(c) and bytes_per_device(arguments(c)) > budget}
    if over:
        log.info("mesh.teacher_experts=auto: with the teacher's routed experts on every device the step's "
                 "arguments alone exceed the budget %s; not compiled (%s)", _gib(budget),
                 ", ".join(sorted(over)))
    return tuple(c for c in cands if c not in over)


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
    return all(allgather_json(bool(fits)))


@dataclasses.dataclass
class Choice:
    """What remat=auto ran: the policy, what its compile returned, and the peaks it saw."""

    policy: str
    compiled: Any
    budget: int | None
    peaks: dict[str, int | None]  # policy -> compiled peak bytes per device, in the order tried
    # policy -> est. step (us) of the policies `choose` compared by their schedules
    estimates: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        peak = self.peaks.get(self.policy)
        return self.budget is None or peak is None or peak <= self.budget

    def describe(self) -> str:
        tried = ", ".join(f"{p} {_gib(b)}" for p, b in self.peaks.items()) or "nothing compiled"
        budget = "no budget known" if self.budget is None else f"budget {_gib(self.budget)}"
        compared = "".join(f"; est. {p} {us / 1e3:.1f} ms" for p, us in self.estimates.items())
        return f"{self.policy} (peaks per device: {tried}; {budget}{compared})"


def _gib(b: int | None) -> str:
    if b is None:
        return "?"
    return f"{b / GIB:.1f} GiB" if b >= GIB else f"{b / 2**20:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What a compiled step's schedule says about a policy (`inspect.hlo.analyze` of its HLO)."""

    sync_share: float  # of the collective transfer time, the part XLA left synchronous
    est_step_us: float  # the inspector's estimated step
    # of the collective transfer time, the part XLA's order leaves with no compute under it
    exposed_share: float = 0.0


def schedule_of(hlo_text: str, target: str, grouped_fill: float = 1.0) -> Schedule:
    """`Schedule` of a compiled step's HLO text, priced for `target` (h200, mi300x)."""
    from farskip_jax.inspect import hlo  # not at import time: only GPU choices need it

    totals = hlo.analyze(hlo_text, target, grouped_fill=grouped_fill).totals
    transfer, sync = totals["all"]["transfer_us"], totals["all"]["sync_transfer_us"]
    if transfer <= 0:
        return Schedule(0.0, totals["est_step_us"])
    return Schedule(sync / transfer, totals["est_step_us"], totals["all"]["sim_exposed_us"] / transfer)


def choose(policies: tuple[str, ...], compile_peak: Callable[[str], tuple[Any, int | None]],
           budget: int | None, agree: Callable[[bool], bool] = _all_processes,
           schedule: Callable[[Any], Schedule | None] | None = None) -> Choice:
    """The first of `policies` whose compile fits `budget`. `compile_peak(policy)` -> (what the
    compile returned, peak bytes per device or None when the backend reports none). With no budget
    the first policy is taken uncompiled (compiled None: the caller compiles it as usual). When none
    fits, the last (the one holding least) is returned with a warning: XLA may still fit it by its
    own rematerialization, or the run fails with its out-of-memory error.

    `schedule(compiled)` (GPU targets): a policy that fits but whose schedule leaves more than
    `MAX_SYNC_SHARE` of the collective transfer time synchronous (XLA's scheduler holds collectives
    back near its own memory limit: H200 EP32 `none`, 30% of its collectives, BENCHMARKS K14), or
    more than `MAX_EXPOSED_SHARE` of it exposed (8 H200 `none`: 38.6%, K29), is compared with the
    next policy that fits, and the one with the shorter estimated step runs. So is
    a local-teacher candidate that fits (the next is the same policy with the teacher split): the
    copies pay on most layouts, not on all (64 MI300X as data=8 x expert=8: est. 539.1 against
    533.3 ms, BENCHMARKS K24)."""
    if budget is None or len(policies) == 1:
        return Choice(policies[0], None, budget, {})
    peaks: dict[str, int | None] = {}
    held: tuple[Choice, Schedule] | None = None
    for i, policy in enumerate(policies):
        compiled, peak = compile_peak(policy)
        peaks[policy] = peak
        choice = Choice(policy, compiled, budget, peaks)
        if not agree(choice.fits):
            continue
        last = i == len(policies) - 1
        # a schedule matters only beside a held-back one, or where a next policy could replace it
        sched = schedule(compiled) if schedule is not None and (held is not None or not last) else None
        if held is not None:
            first, first_sched = held
            keep_first = sched is None or first_sched.est_step_us <= sched.est_step_us
            log.info("execution.remat=auto: %s est. %.1f ms (%.0f%% of collective time synchronous, "
                     "%.0f%% exposed) against %s est. %s ms", first.policy, first_sched.est_step_us / 1e3,
                     100 * first_sched.sync_share, 100 * first_sched.exposed_share, policy,
                     "?" if sched is None else f"{sched.est_step_us / 1e3:.1f}")
            estimates = {first.policy: first_sched.est_step_us,
                         **({policy: sched.est_step_us} if sched is not None else {})}
            if agree(keep_first):
                return dataclasses.replace(first, peaks=peaks, estimates=estimates)
            return dataclasses.replace(choice, estimates=estimates)
        if sched is None or (sched.sync_share <= MAX_SYNC_SHARE and sched.exposed_share <= MAX_EXPOSED_SHARE
                             and not has_local_teacher(policy)):
            return choice
        held = (choice, sched)
    if held is not None:  # nothing after the held policy fits
        return dataclasses.replace(held[0], peaks=peaks)
    log.warning("execution.remat=auto: no policy fits: %s; running %s. Fewer tokens per device "
                "(data.batch_size, data.seq_len) or a larger budget (execution.remat_hbm_fraction, "
                "execution.remat_budget_gib).", choice.describe(), policy)
    return choice


def memo_key(cfg: Config, args: tuple, budget: int, policies: tuple[str, ...] = ()) -> str:
    """What a compiled peak depends on: the config (but `_NOT_IN_MEMO_KEY`), the step's argument
    shapes, dtypes and shardings, the devices, jax's version and the budget; with the candidates
    searched (a record is a place in their order); a hex digest."""
    from farskip_jax.config import to_dict

    conf = to_dict(cfg)
    conf["train"] = {k: v for k, v in conf["train"].items() if k not in _NOT_IN_MEMO_KEY}
    conf.pop("demo", None)
    arrays = [(tuple(a.shape), str(a.dtype), str(getattr(a, "sharding", ""))) for a in jax.tree.leaves(args)]
    devices = (jax.device_count(), jax.process_count(), jax.devices()[0].device_kind)
    blob = json.dumps([conf, arrays, devices, jax.__version__, budget, list(policies)], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def remembered(memo: Path, slot: str, key: str) -> dict | None:
    """The record `remember` left in `memo` for `slot` under `key`, else None (no file, another
    key, or a file that does not parse: then the search starts over)."""
    try:
        record = json.loads(memo.read_text()).get(slot)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as e:
        log.warning("execution.remat=auto: ignoring %s (%s); searching from the start", memo, e)
        return None
    return record if isinstance(record, dict) and record.get("key") == key else None


def remember(memo: Path, slot: str, key: str, choice: Choice, rejected: dict[str, int | None]) -> None:
    """Records `choice` for `slot` ('bounded' or 'worst_case') in `memo` (process 0 writes)."""
    if jax.process_index() != 0:
        return
    try:
        records = json.loads(memo.read_text()) if memo.exists() else {}
    except (OSError, ValueError):
        records = {}
    records[slot] = {"key": key, "policy": choice.policy, "budget": choice.budget,
                     "peaks": {**rejected, **choice.peaks}}
    tmp = memo.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1))
    tmp.replace(memo)


def _resume_from(policies: tuple[str, ...], record: dict | None) -> int:
    """Where the search starts: the remembered policy's place among `policies` (0 without one),
    the earliest any process would start at, so that every process compiles the same programs."""
    start = policies.index(record["policy"]) if record and record.get("policy") in policies else 0
    return min(allgather_json(start))


def settle(cfg: Config, program: Any, args: tuple, worst_case: bool = False,
           memo: Path | None = None) -> tuple[Any, Choice]:
    """The trainer's step for `cfg` on `program`'s mesh with execution.remat settled, compiled for
    `args` where a choice was made: (program, compiled step or None, i.e. the jitted one as usual)
    and the `Choice`. The program may place the teacher otherwise than `program` (a `local_teacher`
    candidate): then its teacher argument has another shape, and the caller lays the teacher out
    anew (`TrainProgram.teacher_shardings`, `teacher_copies`). `worst_case`: the overflow re-run's,
    among the policies recomputing at least as much as `program`'s (the bounded step's), with its
    teacher layout. `memo`: the run's remat_auto.json, read to skip the candidates this run
    rejected before and written with the choice."""
    from farskip_jax.train.program import build_program, searches_teacher_layout, teacher_copies

    exe, ep = cfg.execution, program.parallel is not None
    auto_local = ep and program.parallel.teacher_experts == "local" and cfg.mesh.teacher_experts == "auto"
    current = label(program.student_exe.remat, auto_local)
    search_teacher = not worst_case and searches_teacher_layout(cfg, ep)
    policies = candidates(exe.remat, ep, at_least=program.student_exe.remat if worst_case else None)
    budget = device_budget(exe) if len(policies) > 1 or search_teacher else None
    if worst_case:
        policies = tuple(label(p, auto_local) for p in policies)
    elif search_teacher and budget is not None:
        policies = candidates(exe.remat, ep, local_teacher=True)
    programs: dict[str, Any] = {current: program}

    def program_for(candidate: str) -> Any:
        if candidate not in programs:
            programs[candidate] = build_program(with_remat(cfg, candidate), program.mesh)
        return programs[candidate]

    def args_for(candidate: str) -> tuple:
        prog = program_for(candidate)
        if teacher_copies(prog.parallel) == teacher_copies(program.parallel):
            return args
        return (args[0], prog.abstract_teacher(), *args[2:])  # another teacher layout: its shapes

    if budget is not None and search_teacher:
        policies = within_budget(policies, args_for, budget)
    slot, key, rejected = "worst_case" if worst_case else "bounded", None, {}
    if memo is not None and budget is not None:
        key = memo_key(cfg, args, budget, policies)
        record = remembered(memo, slot, key)
        start = _resume_from(policies, record)
        if start:
            rejected = {p: (record or {}).get("peaks", {}).get(p) for p in policies[:start]}
            log.info("execution.remat=auto: starting at %s, as this run chose before (%s rejected: %s)",
                     policies[start], memo, ", ".join(f"{p} {_gib(b)}" for p, b in rejected.items()))
            policies = policies[start:]

    def compile_peak(candidate: str) -> tuple[Any, int | None]:
        prog = program_for(candidate)
        step = prog.worst_case_train_step if worst_case else prog.train_step
        t0 = time.perf_counter()
        compiled = step.lower(*args_for(candidate)).compile()
        peak = compiled_peak(compiled)
        log.info("execution.remat: %s%s compiled in %.0f s, peak %s per device", candidate,
                 " (worst-case buffers)" if worst_case else "", time.perf_counter() - t0, _gib(peak))
        return (prog, compiled), peak

    choice = choose(policies, compile_peak, budget, schedule=_device_schedule(cfg, program, args))
    if key is not None:
        remember(memo, slot, key, choice, rejected)
    # uncompiled (no budget, one candidate left): the jitted step of the candidate's own program
    return choice.compiled or (program_for(choice.policy), None), choice


def bytes_per_device(tree: Any) -> int:
    """Bytes the first device holds of `tree`'s arrays or sharded ShapeDtypeStructs (a program's
    arguments: a lower bound of its peak)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _device_schedule(cfg: Config, program: Any, args: tuple) -> Callable[[Any], Schedule] | None:
    """`choose`'s schedule check for the trainer's compiles on an H200- or MI300X-class GPU (priced
    by that target's cost model, the routed experts at the balanced fill); None elsewhere."""
    from farskip_jax.train.scheduled_step import balanced_fill
    from farskip_jax.xla.flags import detect_local_target

    target = detect_local_target()
    if target not in targets.SPEC_FILES:
        return None
    seqs, seq_len = args[2]["input_ids"].shape[-2:]  # the global batch [A, B, T]
    fill = balanced_fill(cfg, seqs // (cfg.mesh.data * cfg.mesh.expert), seq_len)
    return lambda compiled: schedule_of(compiled[1].as_text(), target, fill)


@dataclasses.dataclass
class Search:
    """A train step to compile under each of `policies` in turn until one fits: what the
    inspector's build callback returns for remat=auto or a searched teacher layout
    (`inspect.steps.build_fcsd_step`), so that its report is of the program train.py would run on
    the target."""

    policies: tuple[str, ...]
    build: Callable[[str], tuple[Any, Any]]  # candidate -> (jitted step, abstract arguments)
    exe: Any  # the ExecutionConfig, for its budget
    search_teacher: bool = False  # `program.searches_teacher_layout`

    def candidates(self, budget: int | None) -> tuple[str, ...]:
        """What to compile in order for `budget`, as `settle` does: with a known budget and a searched
        teacher layout each policy with the local teacher first (`within_budget`)."""
        if budget is None or not self.search_teacher:
            return self.policies
        return within_budget(with_local_teacher(self.policies), lambda c: self.build(c)[1], budget)
