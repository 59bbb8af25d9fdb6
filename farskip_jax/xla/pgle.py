"""Synthetic PGLE profiles: give XLA's latency-hiding scheduler the inspector's own costs.

Why: on gfx942 (MI300X) XLA has no speed-of-light model, so its latency-hiding scheduler (LHS)
falls back to fixed "T-shirt" costs: any async collective 5000 units, a GEMM 1000, most other ops
1 (shared/XLA_SCHEDULING.md section 1). It therefore believes ~5 GEMMs cover any all-to-all and
stops filling the window, whatever the real sizes are. A profile-guided latency estimator (PGLE)
profile replaces those units with microseconds per instruction. XLA reads it from disk inside the
scheduling pass, so it works in a deviceless compile; this module writes one from the same
roofline + link model the inspector measures with (``costs.CostModel.op_time_us`` for compute,
``links.transfer_time_us`` for collectives), so the scheduler and the report agree on what an op costs.

How (``compile_with_synthetic_pgle``):

1. Compile once with a dump of the module as the scheduler receives it: ``xla_dump_to`` plus
   ``xla_dump_hlo_pass_re=legalize-scheduling-annotations`` writes
   ``*.after_legalize-scheduling-annotations.before_latency-hiding-scheduler.txt``. That pass is the
   first of XLA's "latency-hiding-scheduler" pipeline; the accuracy checker and the scheduler run on
   its output, so its names are the scheduler's names (post-scheduling passes rename some, e.g.
   copies, so the final scheduled HLO is not a safe source). This compile is otherwise an ordinary
   one with the same options, so it doubles as the baseline.
2. Cost every instruction of every computation the scheduler orders (entry, while bodies and
   conditions, called computations): compute ops by roofline; a collective's transfer time as the
   cost of its ``*-start`` (PGLE falls back from start->done latency to the start op's cost; the
   ``latencies`` entries of the proto are dropped by XLA's fingerprint filter); ``*-done`` left out
   (PGLE gives start/done ops a fixed cost and never looks them up); bookkeeping ops 0; a while loop
   its trip count times its body. Uncovered instructions would fall back to the T-shirt units read
   as microseconds (a GEMM would become 1000 us), hence step 3's strict checker.
3. Write ``<dir>/<fingerprint_before_lhs>.pbtxt`` (text ``ProfiledInstructionsProto``; the file must
   end in ``.pbtxt`` or ``.pb`` or XLA silently ignores it), one ``costs`` entry per instruction
   under its plain name. (jaxlib 0.10.2 also matched ``<fingerprint>::<name>`` entries; 0.12 finds
   none of them, measured: "Found 0 instructions from the profile".) What keeps a profile from
   applying to another module is step 4's checker: a module whose instructions the profile does not
   name fails the compile.
4. Recompile with ``xla_gpu_pgle_profile_file_or_directory_path=<file>`` and
   ``xla_gpu_pgle_accuracy_checker=PGLE_STRICTNESS_LEVEL_ERROR``: a single instruction without a
   cost fails the compile ("Found N missing instructions. Discarding the profile.") instead of
   silently scheduling it with T-shirt units. A valid profile also switches LHS on by itself.
   The ERROR level also turns on a verifier, run after each later pass, that every instruction
   keeps its scheduling name. Passes after the scheduler rename some: on 0.12 the
   async-to-sync converter renames every start/done pair it makes synchronous ("Was
   'all-to-all-start' is 'all_to_all.21.2'. Failed after async-to-sync-converter"), and HLO
   rematerialization renames its clones when the step exceeds the memory limit
   (openxla/xla#23989). The coverage check has passed by then, so the profile is applied again at
   WARN level, and the result says so (``PgleCompile.checker``).

Caveats: the profile and the inspector's overlap measurement use the same roofline, so "PGLE hides
more" means "the scheduler now agrees with the inspector", not a measured speed-up. Kernel launch
overheads and elementwise FLOPs are not in the model (costs.py), so small ops cost ~0 us. Any change
of flags, code, target spec or jax version renames fusions and changes the fingerprint: regenerate
the profile for every compile (this module does; it never reuses one).

Replacing the synthetic profile with a measured one (real MI300X):

* Automatic PGLE: ``jax.config.update("jax_enable_pgle", True)`` and
  ``jax.config.update("jax_pgle_profiling_runs", N)`` (optionally ``jax_pgle_aggregation_percentile``):
  JAX profiles the first N executions of each jitted function and recompiles it with the collected
  costs passed as the compile's ``fdo_profile`` (JAX docs, gpu_performance_tips.md "Auto and manual
  PGLE"). Nothing here is needed then; set ``xla_gpu_pgle_accuracy_checker=PGLE_STRICTNESS_LEVEL_WARN``
  in XLA_FLAGS to see which instructions the measured profile missed.
* Manual: run a few steps under ``jax.profiler.trace(logdir)``, then
  ``jax.experimental.profiler.get_profiled_instructions_proto(<logdir>/plugin/profile/<run>/)``
  returns the *binary* proto: write it as ``<dir>/<fingerprint_before_lhs>.pb`` (fingerprint from a
  dump of the same compile, as in step 1; ``module_fingerprint`` reads it) or as one ``*.pb`` file,
  and pass that as ``xla_gpu_pgle_profile_file_or_directory_path`` together with
  ``STRICT_OPTIONS``. Compile with exactly the options of the profiled run, or names won't match.
* ROCm caveats (shared/XLA_SCHEDULING.md section 2): JAX documents the converter as non-empty "only
  when running on Nvidia GPU", and profile *collection* was broken on ROCm through jaxlib 0.9.x
  (ROCm/jax#791, #788, #790: the XPlane trace lacks the annotations that
  ``ConvertXplaneToProfiledInstructionsProto`` needs, so the proto comes out empty or partial).
  Check a measured ROCm profile with the strict checker before trusting it; an empty one makes the
  estimator fall back to T-shirt units everywhere. Until collection works on the installed
  ROCm/jaxlib, this synthetic profile is the usable route; numbers from real-MI300X GEMM and RCCL
  all-to-all microbenchmarks can replace the datasheet figures in ``costs.HARDWARE["mi300x"]``.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farskip_jax.xla import aot, costs, links
from farskip_jax.xla.hlo_parse import Computation, HloModule, Instr, parse_hlo, shape_bytes

# The first pass of XLA:GPU's "latency-hiding-scheduler" pipeline; its output is what the PGLE
# accuracy checker and the scheduler see (xla/service/gpu/gpu_hlo_schedule.cc,
# RunLatencyHidingSchedulerPasses).
SCHEDULER_ENTRY_PASS = "legalize-scheduling-annotations"
STRICT_OPTIONS = {"xla_gpu_pgle_accuracy_checker": "PGLE_STRICTNESS_LEVEL_ERROR"}
WARN_OPTIONS = {"xla_gpu_pgle_accuracy_checker": "PGLE_STRICTNESS_LEVEL_WARN"}
_NAME_VERIFIER = "Expected instruction name to remain the same"
PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
_FINGERPRINT_RE = re.compile(r'fingerprint_before_lhs="([0-9a-f]+)"')


class PgleError(RuntimeError):
    """The synthetic-profile compile could not be set up or XLA rejected the profile."""


def module_fingerprint(hlo_text: str) -> str:
    """XLA's ``fingerprint_before_lhs`` frontend attribute of a module dumped at scheduler entry."""
    header = hlo_text[: hlo_text.find("\n")] if "\n" in hlo_text else hlo_text
    m = _FINGERPRINT_RE.search(header) or _FINGERPRINT_RE.search(hlo_text)
    if m is None:
        raise PgleError("no fingerprint_before_lhs in the module: dump it at or after scheduler entry "
                        f"(xla_dump_hlo_pass_re={SCHEDULER_ENTRY_PASS})")
    return m.group(1)


def _done_of(comp: Computation, mod: HloModule) -> dict[str, Instr]:
    """start name -> its done instruction (the done's shape is the collective's result)."""
    out = {}
    for ins in comp.instrs:
        ck = links.collective_kind(mod, ins)
        if ck is not None and ck[1] == "done" and ins.operands:
            out[ins.operands[0]] = ins
    return out


def _wrapped(mod: HloModule, ins: Instr) -> Instr | None:
    """The op an ``async-start`` wraps (its root), or None."""
    sub = mod.computations.get(ins.attr("calls") or "")
    return sub.root if sub is not None else None


def instruction_cost_us(an: Any, comp: Computation, ins: Instr, done: Instr | None) -> float | None:
    """The PGLE cost of one scheduled instruction in microseconds; None = leave it out.

    ``an`` is the inspector's cost model (``costs.CostModel``) for the module.
    """
    mod, hw = an.mod, an.hw
    ck = links.collective_kind(mod, ins)
    if ck is not None:
        kind, form = ck
        if form == "done":
            start = comp.by_name.get(ins.operands[0]) if ins.operands else None
            if kind == "async" and (start is None or links.collective_kind(mod, start) is None):
                # the end of compute made async: jaxlib 0.12 makes small dynamic slices in loops
                # async fusions, and XLA's PGLE looks their done up; the start carries the work
                return 0.0
            return None  # PGLE costs a collective's start/done at a fixed 1 unit, never looks them up
        carrier = _wrapped(mod, ins) if ins.opcode == "async-start" else ins
        carrier = carrier or ins
        # operands looked up on `ins`: a wrapped op's operands live in its async computation
        nbytes = links.collective_bytes(comp, ins, done, kind, an.declared_rows)
        n = links.group_size(carrier, mod.num_partitions)
        same_node = links.same_node_members(carrier, mod.num_partitions, hw["gpus_per_node"])
        return links.transfer_time_us(kind, nbytes, n, hw, same_node)
    if ins.opcode == "async-start":  # compute moved to another stream: its wrapped computation
        return sum(an.comp_time_us(c) for c in ins.called())
    if ins.opcode == "copy-start":  # async copy (memory spaces): read + write at HBM bandwidth
        return costs.instr_bytes(comp, ins) / hw["hbm_bw"] * 1e6
    if ins.opcode in ("send", "recv"):  # one peer link, like a collective-permute
        return links.transfer_time_us("collective-permute", shape_bytes(ins.shape), 2, hw)
    if ins.opcode in ("async-done", "copy-done", "send-done", "recv-done"):
        return None
    return an.op_time_us(comp, ins)


def profile_costs(hlo_text: str, target: str, grouped_fill: float = 1.0,
                  declared_rows: bool = True) -> dict[str, float]:
    """Cost in microseconds of every instruction the scheduler orders in ``hlo_text``.

    ``hlo_text`` is the module at scheduler entry (see ``scheduler_entry_hlo``); ``target`` keys
    ``costs.HARDWARE``. Computations: entry, while bodies/conditions, called and branch computations
    (``costs.CostModel.scheduled_computations``, the inspector's own walk).
    """
    if target not in costs.HARDWARE:
        raise ValueError(f"unknown target {target!r}; known: {sorted(costs.HARDWARE)}")
    mod = parse_hlo(hlo_text)
    # costs.CostModel is the inspector's per-op cost model (roofline per op, while = trips x body);
    # used as is so that the scheduler and the overlap report price every op identically.
    an = costs.CostModel(mod, costs.HARDWARE[target], grouped_fill, declared_rows)
    us_by_instr: dict[str, float] = {}
    for cname in an.scheduled_computations():
        comp = mod.computations[cname]
        dones = _done_of(comp, mod)
        for ins in comp.instrs:
            c = instruction_cost_us(an, comp, ins, dones.get(ins.name))
            if c is not None:
                us_by_instr[ins.name] = c
    return us_by_instr


def profile_text(costs: dict[str, float], comment: str = "") -> str:
    """Text-format ``tensorflow.profiler.ProfiledInstructionsProto`` with one ``costs`` entry per op."""
    lines = [f"# {line}" for line in comment.splitlines()]
    for name, us in costs.items():
        lines.append(f'costs {{ name: "{name}" cost_us: {us:.6g} }}')
    return "\n".join(lines) + "\n"


def write_profile(hlo_text: str, target: str, directory: str | Path,
                  grouped_fill: float = 1.0, declared_rows: bool = True) -> str:
    """Cost ``hlo_text`` (module at scheduler entry) for ``target`` and write
    ``<directory>/<fingerprint>.pbtxt``; returns that path. The caller owns ``directory`` (the
    profile is an input of the next compile and worth keeping beside its report)."""
    fingerprint = module_fingerprint(hlo_text)
    costs = profile_costs(hlo_text, target, grouped_fill, declared_rows)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    name = parse_hlo(hlo_text).name
    comment = (f"synthetic PGLE profile (farskip_jax.xla.pgle), target {target}, module {name}\n"
               f"fingerprint_before_lhs {fingerprint}, {len(costs)} instructions, roofline + link model, "
               f"grouped GEMMs at {grouped_fill:.4g} of their static rows")
    path = d / f"{fingerprint}.pbtxt"
    path.write_text(profile_text(costs, comment))
    return str(path)


def scheduler_entry_hlo(jitted_fn: Any, *arg_specs: Any, target: str,
                        compiler_options: dict[str, Any] | None = None, default_options: bool = True,
                        dump_lhs_schedule: bool = False) -> tuple[aot.CompiledArtifacts, str]:
    """Compile ``jitted_fn`` once (an ordinary compile: same options, same schedule) and return it
    with the module text as the latency-hiding scheduler received it."""
    with tempfile.TemporaryDirectory(prefix="farskip_pgle_dump_") as dump:
        opts = dict(compiler_options or {})
        opts.update({"xla_dump_to": dump, "xla_dump_hlo_pass_re": SCHEDULER_ENTRY_PASS})
        art = aot.compile_scheduled_hlo(jitted_fn, *arg_specs, target=target, compiler_options=opts,
                                        default_options=default_options,
                                        dump_lhs_schedule=dump_lhs_schedule, dump_dir=dump)
        files = glob.glob(os.path.join(dump, f"*after_{SCHEDULER_ENTRY_PASS}*.txt"))
        if not files:
            raise PgleError(f"XLA wrote no dump after {SCHEDULER_ENTRY_PASS} (is the latency-hiding "
                            "scheduler enabled? it runs only with xla_gpu_enable_latency_hiding_scheduler"
                            "=true on ROCm); dump dir had: " + ", ".join(sorted(os.listdir(dump))[:20]))
        # one file per scheduled module; the step is the largest (any helper module is tiny)
        text = Path(max(files, key=os.path.getsize)).read_text()
    art.compiler_options.pop("xla_dump_hlo_pass_re", None)
    return art, text


@dataclass
class PgleCompile:
    """Result of ``compile_with_synthetic_pgle``."""

    artifacts: aot.CompiledArtifacts  # the compile that used the profile
    profile_path: str
    baseline: aot.CompiledArtifacts  # the dump compile: same options without the profile
    fingerprint: str
    num_costs: int
    checker: str = "error"  # how XLA's accuracy checker ran on the profile compile


def compile_with_synthetic_pgle(jitted_fn: Any, *arg_specs: Any, target: str, profile_dir: str | Path,
                                compiler_options: dict[str, Any] | None = None,
                                default_options: bool = True,
                                dump_lhs_schedule: bool = False,
                                cost_target: str | None = None, grouped_fill: float = 1.0,
                                keep_executable: bool = False, declared_rows: bool = True) -> PgleCompile:
    """Compile ``jitted_fn`` for ``target`` twice: once to dump the scheduler's input (kept as the
    baseline), then with a synthetic PGLE profile of it and the strict accuracy checker.

    Options are those of ``aot.compile_scheduled_hlo`` (``default_options`` adds the target's flag
    table; ``compiler_options`` wins). The profile is written to ``profile_dir`` (the caller's: a
    report's folder, a test's tmp_path). ``cost_target`` names the ``costs.HARDWARE`` entry that prices
    the profile (default: ``target``), ``grouped_fill`` its grouped GEMMs and ``declared_rows`` its
    bounded ragged exchanges (``costs.CostModel``);
    with ``target="local"`` on a real GPU host it must be given
    (e.g. "mi300x"), and so must ``compiler_options=xla_flags.compiler_options_for("mi300x")`` or
    equivalent XLA_FLAGS, since the dump compile needs the latency-hiding scheduler on (not
    exercised here: this project's CI has no GPU). Raises ``PgleError`` when XLA rejects the
    profile (a missing instruction under the strict checker): that means the second compile's
    module differs from the first, which the caller must not paper over. When a pass after the
    scheduler renames instructions (the async-to-sync converter, rematerialization), the name
    verifier that only the ERROR level enables fails the compile; the profile is then applied at WARN
    level after the ERROR level's coverage check passed (``checker`` says so).
    """
    cost_target = cost_target or target
    if target not in ("h200", "mi300x", "local") or cost_target not in ("h200", "mi300x"):
        raise ValueError(f"synthetic PGLE compiles for a GPU ('h200', 'mi300x', or 'local' with "
                         f"cost_target='h200'/'mi300x'); got target={target!r}, cost_target={cost_target!r}")
    base_opts = dict(compiler_options or {})
    baseline, entry_text = scheduler_entry_hlo(jitted_fn, *arg_specs, target=target,
                                               compiler_options=base_opts, default_options=default_options,
                                               dump_lhs_schedule=dump_lhs_schedule)
    path = write_profile(entry_text, cost_target, profile_dir, grouped_fill, declared_rows)
    checker = "error"
    try:
        art = _compile_with_profile(jitted_fn, arg_specs, target, base_opts, path, STRICT_OPTIONS,
                                    default_options, dump_lhs_schedule, keep_executable)
    except PgleError as e:
        if _NAME_VERIFIER not in str(e):
            raise
        # The accuracy checker runs before the scheduler, so reaching the post-scheduling name
        # verifier means the profile covered every instruction; apply it again at WARN level,
        # which keeps the check's log output but not the verifier (module docstring, step 4).
        renamer = re.search(r"Failed after ([\w-]+)", str(e))
        art = _compile_with_profile(jitted_fn, arg_specs, target, base_opts, path, WARN_OPTIONS,
                                    default_options, dump_lhs_schedule, keep_executable)
        checker = (f"error before scheduling; warn after ({renamer.group(1) if renamer else 'a later pass'} "
                   "renamed instructions)")
    return PgleCompile(art, path, baseline, module_fingerprint(entry_text),
                       sum(1 for ln in Path(path).read_text().splitlines() if ln.startswith("costs")),
                       checker)


def _compile_with_profile(jitted_fn: Any, arg_specs: tuple[Any, ...], target: str,
                          base_opts: dict[str, Any], path: str, checker_opts: dict[str, str],
                          default_options: bool, dump_lhs_schedule: bool,
                          keep_executable: bool = False) -> aot.CompiledArtifacts:
    opts = dict(base_opts, **checker_opts)
    opts[PROFILE_OPTION] = path
    try:
        return aot.compile_scheduled_hlo(jitted_fn, *arg_specs, target=target, compiler_options=opts,
                                         default_options=default_options,
                                         dump_lhs_schedule=dump_lhs_schedule, keep_executable=keep_executable)
    except Exception as e:  # XlaRuntimeError or JaxRuntimeError, depending on the jaxlib version
        if "missing instructions" in str(e) or _NAME_VERIFIER in str(e):
            raise PgleError(f"XLA rejected the synthetic PGLE profile {path}: {e}") from e
        raise
