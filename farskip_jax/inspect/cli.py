"""Command-line glue for the HLO schedule inspector.

The model side supplies ``build_step(mesh, mode) -> (jitted_fn, arg_specs)``; arg_specs are
ShapeDtypeStructs with NamedShardings on ``mesh``. ``run_inspect`` compiles each mode deviceless
for the target, analyses the scheduled HLO and writes per mode report_<mode>.json / .md /
.trace.json / .timeline.png and the scheduled HLO (scheduled_<mode>.hlo.txt.gz), plus a
comparison (compare.json / .md / .timeline.png) when two modes are given (first = FarSkip, second
= regular by convention).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from farskip_jax import distributed
from farskip_jax.errors import UserError, cli_main
from farskip_jax.xla.flags import PSUM_COMBINE_OFF

# Inference TP: FarSkip's psums stay apart (xla_flags.PSUM_COMBINE_OFF), as `generate` runs them.
PSUM_COMBINE_OPTION = (PSUM_COMBINE_OFF.name, int(PSUM_COMBINE_OFF.value))

BuildStep = Callable[[Any, str], tuple[Any, Sequence[Any]]]


def parse_mesh(text: str) -> dict[str, int]:
    """'expert=8' or 'data=2,expert=8' -> {'data': 2, 'expert': 8}."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep or not v.isdigit():
            raise argparse.ArgumentTypeError(f"bad mesh entry {part!r}; expected name=size")
        out[k] = int(v)
    if not out:
        raise argparse.ArgumentTypeError("empty mesh")
    return out


def _parse_option(text: str) -> tuple[str, Any]:
    k, sep, v = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"bad compiler option {text!r}; expected name=value")
    val: Any = v
    if v.lower() in ("true", "false"):
        val = v.lower() == "true"
    elif v.lstrip("-").isdigit():
        val = int(v)
    return k.lstrip("-"), val


def add_inspect_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("HLO schedule inspector")
    g.add_argument("--target", choices=("h200", "mi300x", "local"), default="h200",
                   help="compile-only target (deviceless) or 'local' for the real devices")
    g.add_argument("--mesh", type=parse_mesh, default={"expert": 8}, help="e.g. expert=8 or data=4,expert=8")
    g.add_argument("--modes", default="farskip,regular",
                   help="comma-separated modes passed to build_step; two modes are also compared")
    g.add_argument("--out", type=Path, default=Path("inspect_out"), help="output directory")
    g.add_argument("--lhs-dump", action="store_true",
                   help="also collect XLA's latency-hiding-scheduler statistics (slower: dumps the module)")
    g.add_argument("--compiler-option", type=_parse_option, action="append", default=[],
                   metavar="NAME=VALUE", help="extra per-compile XLA option (repeatable)")
    g.add_argument("--no-default-options", action="store_true",
                   help="do not add farskip_jax.xla.flags.compiler_options_for(target)")
    g.add_argument("--save-hlo", action=argparse.BooleanOptionalAction, default=True,
                   help="write the scheduled HLO per mode, gzip-compressed (scheduled_<mode>.hlo.txt.gz)")
    g.add_argument("--pgle", choices=("auto", "synthetic", "off"), default="auto",
                   help="schedule with a synthetic PGLE profile priced by the inspector's own cost model "
                        "(xla/pgle.py; two compiles per mode). auto = synthetic for mi300x, whose "
                        "scheduler otherwise uses fixed-cost units, off for h200 and local")
    g.add_argument("--timeline", action=argparse.BooleanOptionalAction, default=True,
                   help="draw the estimated timeline of two middle layers (report_<mode>.timeline.png)")
    return parser


def grouped_fill(args: argparse.Namespace) -> float:
    """The cost model's grouped-GEMM fill (``xla.costs.CostModel``); 1.0 unless the caller set one."""
    return getattr(args, "grouped_fill", 1.0)


def declared_rows(args: argparse.Namespace) -> bool:
    """Whether bounded ragged exchanges are charged the rows they declare (``links.collective_bytes``):
    with ``--moe-load balanced`` (the default), as grouped GEMMs are charged their balanced rows."""
    return getattr(args, "moe_load", "balanced") == "balanced"


def use_pgle(args: argparse.Namespace) -> bool:
    choice = getattr(args, "pgle", "off")
    return choice == "synthetic" or (choice == "auto" and args.target == "mi300x")


def _compile(fn: Any, specs: Sequence[Any], args: argparse.Namespace,
             profile_dir: Path) -> tuple[Any, dict[str, Any]]:
    """(compiled artifacts, extra report meta): with PGLE the meta names the profile and how the
    run without it (the baseline, the same compile XLA schedules with its default costs) did."""
    from farskip_jax.xla import aot, pgle

    try:
        if use_pgle(args):
            res = pgle.compile_with_synthetic_pgle(fn, *specs, target=args.target,
                                                   compiler_options=dict(args.compiler_option),
                                                   default_options=not args.no_default_options,
                                                   dump_lhs_schedule=args.lhs_dump,
                                                   profile_dir=profile_dir,
                                                   grouped_fill=grouped_fill(args),
                                                   declared_rows=declared_rows(args))
            return res.artifacts, {"pgle": {"profile": res.profile_path, "costs": res.num_costs,
                                            "checker": res.checker}, "_baseline": res.baseline}
        return aot.compile_scheduled_hlo(fn, *specs, target=args.target,
                                         compiler_options=dict(args.compiler_option),
                                         default_options=not args.no_default_options,
                                         dump_lhs_schedule=args.lhs_dump), {}
    except Exception as e:  # the runtime error type differs across jaxlib versions
        if "Couldn't find output tile sizes" not in str(e):
            raise
        # XLA's Triton GEMM emitter finds no tiling for some tiny matrices (e.g. 48 x 16 in a tiny
        # config's attention gradient); the real model's widths compile. Say how to get past it.
        first = str(e).strip().splitlines()[0][:200]
        raise UserError(f"XLA's Triton GEMM tiling failed on a small matmul ({first}); retry with "
                        "--compiler-option xla_gpu_enable_triton_gemm=false or use wider model dimensions"
                        ) from e


def _compile_mode(built: Any, mode: str, args: argparse.Namespace, out: Path) -> tuple[Any, dict[str, Any]]:
    """Compiles one mode's step; a `remat.Search` (execution.remat=auto) policy after policy until
    one fits the target's HBM budget, as the trainer does on the device (train/remat.py)."""
    from farskip_jax import targets
    from farskip_jax.train import remat

    def compile_one(fn: Any, specs: Any, label: str) -> tuple[Any, dict[str, Any]]:
        with _ticker(f"[{mode}] compiling for {args.target}{label}"):
            return _compile(fn, specs, args, out / f"pgle_{mode}")

    if not isinstance(built, remat.Search):
        return compile_one(*built, "")

    def compile_peak(policy: str) -> tuple[Any, int | None]:
        art, extra = compile_one(*built.build(policy), f" (execution.remat={policy})")
        return (art, extra), (art.memory or {}).get("peak_bytes_per_device")

    hbm = targets.device_memory_size(args.target) if args.target in targets.SPEC_FILES else None
    schedule = ((lambda compiled: remat.schedule_of(compiled[0].hlo_text, args.target, grouped_fill(args)))
                if args.target in targets.SPEC_FILES else None)
    budget = remat.budget_bytes(built.exe, hbm)
    choice = remat.choose(built.candidates(budget), compile_peak, budget, agree=lambda fits: fits,
                          schedule=schedule)
    if choice.compiled is None:  # no budget known: the first policy, as the trainer runs it
        return compile_one(*built.build(choice.policy), f" (execution.remat={choice.policy})")
    art, extra = choice.compiled
    extra["remat_auto"] = {"policy": choice.policy, "budget_bytes": choice.budget, "peaks": choice.peaks,
                           "est_step_us": choice.estimates}
    searched = "execution.remat=auto" if built.exe.remat == "auto" else "mesh.teacher_experts=auto"
    print(f"[{mode}] {searched}: {choice.describe()}")
    return art, extra


def _exchange_meta(args: argparse.Namespace, mesh: Any, teacher_setting: str | None = None) -> dict[str, Any]:
    """The expert exchange, the FCSD teacher's layout and its lockstep as the trainer resolves them
    for `args` (printed); `teacher_setting` in place of the config's `mesh.teacher_experts` (the
    layout `execution.remat: auto`'s search chose)."""
    meta: dict[str, Any] = {}
    if getattr(args, "expert_per_node", None) is None or args.mesh.get("expert", 1) == 1:
        return meta
    from farskip_jax.parallel import ExpertParallel
    from farskip_jax.train.program import resolve_expert_per_node

    per_node = resolve_expert_per_node(mesh, args.expert_per_node)
    meta["expert_per_node"] = per_node
    if args.expert_per_node == "auto" and teacher_setting is None:
        what = (f"node-aware exchange, {args.mesh['expert'] // per_node} nodes of {per_node} expert ranks"
                if per_node else "flat exchange")
        print(f"inspect: mesh.expert_per_node=auto: {per_node} on {args.target} ({what})")
    # the FCSD teacher's layout and lockstep (None outside fcsd) as the trainer resolves them
    lockstep = getattr(args, "teacher_lockstep", None)
    teacher_experts = getattr(args, "teacher_experts", None)
    par = ExpertParallel(mesh, expert_per_node=per_node) if lockstep is not None or teacher_experts else None
    if teacher_experts is not None:
        setting, t_abs = teacher_experts
        setting = teacher_setting or setting
    if teacher_experts is not None and (per_node or setting == "local"):
        from farskip_jax.train.program import teacher_copy_bytes, with_teacher_layout

        par = with_teacher_layout(par, setting, t_abs)  # the lockstep's rule below reads it
        layout = par.teacher_experts
        meta["teacher_experts"] = layout
        if layout == "expert":
            where = "over the whole expert axis"
        else:
            gib = teacher_copy_bytes(t_abs, par, layout) / 2**30
            where = (f"all on every device (+{gib:.2f} GiB per device), no exchange" if layout == "local"
                     else f"inside each node of {per_node} (+{gib:.2f} GiB per device), its "
                          "exchanges off the NICs")
        chosen = " (chosen by the memory search of train/remat.py: the step fits)" if teacher_setting else ""
        print(f"inspect: mesh.teacher_experts={setting}{chosen}: the FCSD teacher's routed experts {where}")
    if lockstep is not None:
        from farskip_jax.train.program import resolve_teacher_lockstep

        on = resolve_teacher_lockstep(lockstep, par)
        meta["teacher_lockstep"] = on
        print(f"inspect: train.teacher_lockstep={str(lockstep).lower()}: "
              + ("the teacher's forward layer by layer beside the student's" if on else "off"))
    return meta


def run_inspect(args: argparse.Namespace, build_step: BuildStep,
                useful_flops: Callable[[str], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Compile, analyse and report every mode in ``args.modes``; returns the reports by mode.

    ``useful_flops(mode)``: the step's useful FLOPs (``flops.step_flops``) for the report's
    accounting (static dot FLOPs / useful, roofline, est. MFU); None leaves the useful side out.
    ``args.compare == "four"`` (``--compare four``): the four modes of ``steps.four_modes`` are
    also tabulated together (compare_four.json / .md)."""
    from farskip_jax.xla import aot

    # Before anything touches a JAX backend: cpu platforms (and the ROCm stand-ins for mi300x).
    aot.prepare_deviceless(args.target)
    from farskip_jax.inspect import hlo, report
    from farskip_jax.train.remat import has_local_teacher

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mesh = aot.make_target_mesh(args.target, args.mesh)
    exchange_meta = _exchange_meta(args, mesh)
    reports: dict[str, Any] = {}
    analyses: dict[str, Any] = {}
    for mode in modes:
        art, extra = _compile_mode(build_step(mesh, mode), mode, args, out)
        if has_local_teacher(extra.get("remat_auto", {}).get("policy", "")):  # the search chose it
            extra.update(_exchange_meta(args, mesh, teacher_setting="local"))
        analysis = hlo.analyze(art.hlo_text, args.target, art.lhs_schedule_text, grouped_fill(args),
                               declared_rows(args))
        analyses[mode] = analysis
        meta = {"mode": mode, "mesh": args.mesh, **exchange_meta, "grouped_gemm_fill": grouped_fill(args),
                **art.summary()}
        baseline = extra.pop("_baseline", None)
        meta.update(extra)
        if baseline is not None:
            base = hlo.analyze(baseline.hlo_text, args.target, grouped_fill=grouped_fill(args),
                               declared_rows=declared_rows(args)).totals
            meta["pgle"]["without_profile"] = {
                "all": base["all"]["hidden_frac"],
                **{kind: agg["hidden_frac"] for kind, agg in base["by_kind"].items()}}
            # the whole replay of the same program as XLA's own estimator schedules it, so that one
            # run decides between the two cost sources (bench/overlap_tables.py --without-profile)
            meta["pgle"]["without_profile_totals"] = {k: v for k, v in base.items() if k != "by_role"}
            print(f"[{mode}] without PGLE: hidden {_fmt(base['all']['hidden_frac'])}")
        useful = useful_flops(mode) if useful_flops is not None else None
        paths = report.write_reports(analysis, out, name=f"report_{mode}", meta=meta, memory=art.memory,
                                     useful=useful)
        if getattr(args, "save_hlo", True):
            # compresses ~10x (a DSV2-Lite train step is ~100 MB of text); zcat or gzip.open to read
            with gzip.open(out / f"scheduled_{mode}.hlo.txt.gz", "wt", compresslevel=6) as f:
                f.write(art.hlo_text)
        if getattr(args, "timeline", True):
            _timeline(out / f"report_{mode}.timeline.png", [(mode, analysis)], args.target)
        reports[mode] = report.build_report(analysis, meta, art.memory, useful)
        t = analysis.totals["all"]
        mem = art.memory or {}
        print(f"[{mode}] compile {art.compile_seconds:.2f}s  collectives {t['count']} (sync {t['sync']})  "
              f"hidden {_fmt(t['hidden_frac'])} (timeline {_fmt(t['sim_hidden_frac'])})  "
              f"peak {report.size_str(mem.get('peak_bytes_per_device'))} "
              f"({_fmt(mem.get('fraction'))} of HBM)  "
              f"-> {paths['md']}")
        print(f"[{mode}] {_accounting_line(reports[mode]['accounting'])}")
        b = analysis.bound
        if b is not None and b.transfer_us:
            print(f"[{mode}] collective time hidden: XLA's order {_fmt(t['sim_hidden_frac'])}, a list order "
                  f"of the same ops {_fmt(b.list_hidden_frac)} (est. step "
                  f"{(b.list_step_us or 0) / 1e3:.2f} ms, memory not modelled), at most "
                  f"{_fmt(b.max_hidden_frac)} by the dependency floor ({b.step_us / 1e3:.2f} ms)")
    if getattr(args, "compare", None) == "four" and len(modes) == 4:
        four = report.four_way({m: reports[m] for m in modes}, baseline=modes[0])
        (out / "compare_four.json").write_text(json.dumps(four, indent=1))
        (out / "compare_four.md").write_text(report.four_way_markdown(four))
        reports["_four"] = four
        # and the pair --compare-regular gives at the split (first = FarSkip by convention)
        modes = [modes[3], modes[1]]
    if len(modes) == 2:
        cmp = report.compare(reports[modes[0]], reports[modes[1]], modes[0], modes[1])
        (out / "compare.json").write_text(json.dumps(cmp, indent=1))
        (out / "compare.md").write_text(report.compare_markdown(cmp))
        if getattr(args, "timeline", True):
            _timeline(out / "compare.timeline.png", [(m, analyses[m]) for m in modes], args.target)
        reports["_compare"] = cmp
    return reports


def _timeline(path: Path, runs: list[tuple[str, Any]], target: str) -> None:
    from farskip_jax.inspect import plot

    if plot.write_timeline_png(runs, path, f"estimated timeline on {target} (schedule order, roofline "
                               "compute, link-model transfers)") is None:
        print(f"timeline: no two consecutive named layers (layer_N scopes) to draw; {path.name} not written")


@contextlib.contextmanager
def _ticker(label: str, every_s: float = 15.0):
    """Prints `label ... Ns` every `every_s` seconds while a long compile runs (minutes on 2 cores)."""
    done = threading.Event()
    t0 = time.perf_counter()

    def tick() -> None:
        while not done.wait(every_s):
            print(f"{label} ... {time.perf_counter() - t0:.0f}s", flush=True)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _accounting_line(acc: dict[str, Any]) -> str:
    """The printed summary of a report's FLOP accounting (per device)."""
    def tf(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e12:.3g} TFLOP"

    ratio, roof = acc.get("static_over_useful"), acc.get("useful_roofline_us")
    return (f"useful {tf(acc.get('useful_flops_per_device'))}/device, static dots "
            f"{tf(acc.get('static_dot_flops_per_device'))}" + (f" ({ratio:.2f}x useful)" if ratio else "")
            + (f", useful roofline {roof / 1000:.2f} ms" if roof is not None else "")
            + f", est. step {acc.get('est_step_us', 0) / 1000:.2f} ms, est. MFU {_fmt(acc.get('est_mfu'))} "
            "(an estimate: estimated step time)")


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m farskip_jax inspect",
        description=(
            "Compile the real training step (forward + backward + AdamW, expert parallel) or the "
            "tensor-parallel prefill of a config for an 8-GPU H200 or MI300X target without any GPU "
            "(deviceless XLA compile), then measure from the scheduled HLO how much collective time "
            "has compute scheduled under it. Writes report_<mode>.json/.md (with per-device memory), "
            ".trace.json (open in ui.perfetto.dev), .timeline.png and scheduled_<mode>.hlo.txt.gz, and, "
            "with --compare-regular, compare.md and compare.timeline.png."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", required=True, help="config name in configs/ or a YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. model.num_layers=4 (repeatable)")
    p.add_argument("--mode", choices=("train", "fcsd", "prefill", "decode"), default="train",
                   help="train: the trainer's step with the `lm` loss (student only) under EP; fcsd: "
                        "exactly the step train.py runs for this config (FCSD: the frozen regular "
                        "teacher's forward too, reported apart); prefill: TP inference forward; "
                        "decode: one TP decode step, --batch sequences (default 256) each adding a token "
                        "against a --seq-len latent cache")
    p.add_argument("--compare-regular", action="store_true",
                   help="also compile the same model with regular connectivity and compare (both at the "
                        "config's execution.batch_split); the same as --compare regular")
    p.add_argument("--compare", choices=("regular", "four"), default=None,
                   help="regular: as --compare-regular; four (train/fcsd): compile regular with "
                        "execution.batch_split=1 (the paper's baseline), regular + batch split, FarSkip and "
                        "FarSkip + batch split (the config's split, else 2) and tabulate them "
                        "(compare_four.md / .json, plus compare.md of the two split rows)")
    p.add_argument("--doc-len", type=int, default=None,
                   help="useful FLOPs: tokens per packed document for the causal attention count "
                        "(default: one document per sequence)")
    p.add_argument("--seqs-per-device", type=int, default=None,
                   help="train/fcsd: sequences per device per micro-batch (default: as train.py runs the "
                        "config, data.batch_size over the mesh's data x expert devices)")
    p.add_argument("--batch", type=int, default=None,
                   help="prefill: sequences (default 1); decode: sequences decoding together (default 256); "
                        "replicated over the TP group")
    p.add_argument("--seq-len", type=int, default=4096,
                   help="tokens per sequence (decode: tokens already in the cache)")
    p.add_argument("--moe-load", choices=("balanced", "static"), default="balanced",
                   help="how the cost model prices grouped GEMMs (ragged_dot), whose row count is a "
                        "worst case fixed at compile time: balanced = the rows balanced routing gives "
                        "each device (a dropless EP=8 receive buffer holds 8x those), static = every "
                        "row; likewise the node-aware exchange's ragged stages (whose send and receive "
                        "buffers are both bounds) at the rows they declare for balanced routing, or "
                        "their buffers. Padded GEMMs and exchanges really move their whole buffers and "
                        "are priced in full either way")
    add_inspect_args(p)
    distributed.add_distributed_args(p)  # --target local only
    p.set_defaults(modes=None)
    return p


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """`python -m farskip_jax inspect --config dsv2lite_farskip --target h200 --mode train ...`."""
    args = _build_parser().parse_args(argv)
    joined = args.target == "local" and distributed.initialize(args) is not None
    if joined and not distributed.is_main_process():
        # Every process of a multi-process run compiles the same program (as it would to run it);
        # process 0 alone writes the reports and prints.
        args.out = tempfile.mkdtemp(prefix="farskip_inspect_")
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this process
    from farskip_jax.config import load_config, parse_overrides

    cfg = load_config(args.config, parse_overrides(args.overrides))
    if args.seqs_per_device is None:
        from farskip_jax.data.pipeline import DataConfig

        batch_devices = args.mesh.get("data", 1) * args.mesh.get("expert", 1)
        per_process = int(cfg.data.get("batch_size", DataConfig.batch_size))
        args.seqs_per_device = max(1, per_process // batch_devices)
    if args.batch is None:
        args.batch = 256 if args.mode == "decode" else 1
    if args.seqs_per_device < 1 or args.seq_len < 1 or args.batch < 1 or (args.doc_len or 1) < 1:
        raise UserError("--seqs-per-device, --seq-len, --batch and --doc-len must be positive")
    ep = args.mode in ("train", "fcsd")
    if args.compare_regular and args.compare is None:
        args.compare = "regular"
    from farskip_jax.inspect import steps
    from farskip_jax.model.dispatch import balanced_grouped_fill

    if args.compare == "four":
        if not ep:
            raise UserError("--compare four needs --mode train or fcsd: execution.batch_split splits the "
                            "expert-parallel step's sequences (tensor-parallel inference ignores it)")
        four = steps.four_modes(cfg)
        split = int(four[-1].rpartition("_bs")[2])
        if args.seqs_per_device % split:
            raise UserError(f"--compare four: batch split {split} does not divide --seqs-per-device "
                            f"{args.seqs_per_device}")
        args.modes = ",".join(four)
    elif args.modes in (None, "farskip,regular"):
        args.modes = "farskip,regular" if args.compare == "regular" else (
            "farskip" if cfg.model.farskip.enabled else "regular")
    mesh = {"data": 1, "expert": 1, "tensor": 1}
    default_mesh = {"expert": 8} if ep else {"tensor": 8}
    user_mesh = args.mesh if args.mesh != {"expert": 8} or ep else default_mesh
    mesh.update(user_mesh)
    args.mesh = mesh
    if not ep and not any(k == PSUM_COMBINE_OPTION[0] for k, _ in args.compiler_option):
        args.compiler_option.append(PSUM_COMBINE_OPTION)
    tokens = (args.seqs_per_device * args.seq_len if ep else args.batch if args.mode == "decode"
              else args.batch * args.seq_len)
    args.grouped_fill = (balanced_grouped_fill(cfg.model, cfg.execution, mesh, ep, tokens, args.seq_len)
                         if args.moe_load == "balanced" else 1.0)
    if args.mode == "train":
        build = steps.build_train_step(cfg, args.seqs_per_device, args.seq_len)
    elif args.mode == "fcsd":
        build = steps.build_fcsd_step(cfg, args.seqs_per_device, args.seq_len)
    elif args.mode == "prefill":
        build = steps.build_prefill_step(cfg, args.batch, args.seq_len)
    else:
        build = steps.build_decode_step(cfg, args.batch, args.seq_len)
    shape = (f"{args.batch} sequences x 1 new token against {args.seq_len} cached" if args.mode == "decode"
             else f"{args.seqs_per_device if ep else args.batch} x {args.seq_len} tokens per device")
    print(f"inspect: {cfg.name} {args.mode} on {args.target}, mesh {mesh}, modes {args.modes}, {shape}, "
          f"grouped GEMMs priced at {args.grouped_fill:.4g} of their rows "
          f"(--moe-load {args.moe_load})")
    args.expert_per_node = cfg.mesh.expert_per_node if ep else None
    args.teacher_experts = None
    args.teacher_lockstep = cfg.train.teacher_lockstep if ep and args.mode == "fcsd" else None
    if ep and args.mode == "fcsd":
        from farskip_jax.train.program import abstract_params, teacher_config, teacher_execution

        args.teacher_experts = (cfg.mesh.teacher_experts,
                                abstract_params(teacher_config(cfg), teacher_execution(cfg))[1])
    t0 = time.perf_counter()
    reports = run_inspect(args, build, _useful_flops(cfg, args, ep))
    print(f"inspect: done in {time.perf_counter() - t0:.1f}s -> {args.out}")
    cmp = reports.get("_compare")
    if cmp is not None:
        print((Path(args.out) / "compare.md").read_text())
    if reports.get("_four") is not None:
        print((Path(args.out) / "compare_four.md").read_text())
    return 0


def _useful_flops(cfg: Any, args: argparse.Namespace, ep: bool) -> Callable[[str], dict[str, Any]]:
    """mode -> the useful FLOPs of the step `main` compiles for it (``flops.step_flops``)."""
    import math

    from farskip_jax.inspect import flops, steps

    mesh = args.mesh

    def useful(mode: str) -> dict[str, Any]:
        return flops.step_flops(steps.config_for(cfg, mode), args.mode, devices=math.prod(mesh.values()),
                                seq_len=args.seq_len, seqs_per_device=args.seqs_per_device, batch=args.batch,
                                doc_len=args.doc_len,
                                batch_devices=mesh.get("data", 1) * mesh.get("expert", 1) if ep else None)

    return useful
