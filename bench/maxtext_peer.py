"""A peer in the same run: MaxText's train step for its `deepseek2-16b` config (DeepSeek-V2-Lite's
shape), compiled deviceless for 8 x H200 or 8 x MI300X and read by our inspector.

MaxText (0.2.5, an optional extra: `make maxtext-peer` installs it with `--no-deps` into
.maxtext-site/ with the few modules its train step imports that the venv lacks) builds the step
exactly as its `train_compile.py` does: `pyconfig.initialize` on its base.yml with
`model_name=deepseek2-16b`, `get_shaped_inputs` (abstract NNX train state + AdamW, the synthetic
batch), the ZeRO-1/params shardings and `get_functional_train_with_signature(train.train_step)`,
jitted with its in/out shardings and the state donated, under `jax.set_mesh` and its logical axis
rules. What differs from `train_compile.py`, and why:

- the devices: `train_compile.get_topology_mesh` takes `jax.devices()` for a GPU target (with
  `mock_num_gpu_processes`, i.e. a real GPU host); here the compile-only devices of our target
  spec (`farskip_jax.xla.aot.make_target_mesh`) go to MaxText's own `create_device_mesh`.
  `compile_topology=a3` (MaxText's only GPU topology: one host of 8 GPUs) with
  `compile_topology_num_slices=1` tells its config there are 8 target devices (global batch,
  mesh fill) and skips `jax.distributed` initialisation; it names no chip kind, the spec does.
- the compile: our `aot.compile_scheduled_hlo` (MI300X: `pgle.compile_with_synthetic_pgle`, as
  `inspect` does there) with our target's compiler options, the same ones our rows use, so that
  the two programs are scheduled under the same flags. MaxText's `compile_xla_flags` is empty.

Nothing in MaxText is patched. The MoE path is MaxText's sparse matmul (`sparse_matmul=true`:
sort, `ragged_all_to_all` over the expert axis, grouped GEMMs) with, by default, per target:
h200 -> `use_tokamax_gmm=true`, tokamax's `ragged_dot(implementation="mosaic")` (its Mosaic GPU
kernel, sm_90); mi300x -> `megablox=false use_tokamax_gmm=false`, `jax.lax.ragged_dot` (XLA's
grouped GEMM, hipBLASLt): tokamax's Mosaic GPU kernel does not exist for gfx942, and MaxText's
forked megablox is a TPU Pallas kernel (on a non-TPU target it would run in interpret mode).
`--gmm` overrides. Attention: `attention=autoselected`, which on a GPU target is tokamax's
Pallas-Triton flash attention (layers/attention_op.py). Everything else is MaxText's default for
the config (scan over layers, `remat_policy=full`, fp32 weights, bf16 compute, AdamW), unless
`--set` says otherwise.

Useful FLOPs: ours for the same step, `flops.step_flops` of configs/dsv2lite (regular) in mode
"train" (the `lm` step: student forward + backward, no teacher), on the same mesh and tokens, so
est. MFU and static dot FLOPs / useful are on one scale with `inspect --mode train`. Grouped GEMMs
are priced at the fill of MaxText's own receive buffer under balanced routing
(`RoutedMoE.get_ragged_buffer_size`: dropless worst case, EP x the balanced rows), as
`inspect --moe-load balanced` prices ours.

    PYTHONPATH=.maxtext-site JAX_PLATFORMS=cpu .venv/bin/python bench/maxtext_peer.py \\
        --target h200 --out bench/results/maxtext_peer/h200
    ... --layers 3 --seq-len 1024 --out /tmp/mt_small     # a reduced run (minutes)
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SITE = REPO / ".maxtext-site"
MAXTEXT_MODEL = "deepseek2-16b"
OUR_CONFIG = "dsv2lite"  # the same shape, regular connectivity (MaxText's model has no FarSkip)
GMM_CHOICES = ("tokamax", "ragged_dot", "megablox")
DEFAULT_GMM = {"h200": "tokamax", "mi300x": "ragged_dot"}


def gmm_overrides(gmm: str) -> list[str]:
    """MaxText config keys that select its grouped GEMM inside the sparse-matmul MoE path."""
    return {"tokamax": ["sparse_matmul=true", "megablox=false", "use_tokamax_gmm=true"],
            "ragged_dot": ["sparse_matmul=true", "megablox=false", "use_tokamax_gmm=false"],
            "megablox": ["sparse_matmul=true", "megablox=true", "use_tokamax_gmm=false"]}[gmm]


def maxtext_argv(args: argparse.Namespace, base_yml: Path) -> list[str]:
    argv = ["maxtext_peer", str(base_yml), f"model_name={MAXTEXT_MODEL}", "hardware=gpu",
            "compile_topology=a3", "compile_topology_num_slices=1",
            f"per_device_batch_size={args.seqs_per_device}", f"max_target_length={args.seq_len}",
            "ici_expert_parallelism=8", "ici_fsdp_parallelism=1", "dcn_data_parallelism=1",
            "dtype=bfloat16", "dataset_type=synthetic", "enable_checkpointing=false",
            "run_name=maxtext_peer", f"base_output_directory={args.out / 'maxtext_run'}",
            *gmm_overrides(args.gmm)]
    if args.layers is not None:
        # a model config's keys can only be overridden with override_model_config=true
        argv += ["override_model_config=true", f"base_num_decoder_layers={args.layers}"]
    return argv + list(args.set)


class InMesh:
    """A jitted MaxText step whose `lower` runs under `jax.set_mesh(mesh)` and MaxText's logical
    axis rules, as `train_compile.jit_and_compile` lowers it; our aot calls `.lower(*specs)`."""

    def __init__(self, jitted: Any, mesh: Any, rules: Any):
        self.jitted, self.mesh, self.rules = jitted, mesh, rules

    def lower(self, *specs: Any) -> Any:
        import jax
        from flax.core.spmd import logical_axis_rules

        with jax.set_mesh(self.mesh), logical_axis_rules(self.rules):
            return self.jitted.lower(*specs)


def build_maxtext_step(args: argparse.Namespace) -> tuple[Any, tuple[Any, ...], Any, dict[str, Any]]:
    """(jitted step, arg specs, MaxText config, facts for the report) on our compile-only mesh."""
    import jax
    from jax.sharding import AxisType, Mesh

    from farskip_jax.xla import aot

    # compile-only devices of the target spec (the mesh's shape is MaxText's to choose)
    devices = list(aot.make_target_mesh(args.target, {"expert": 8}).devices.flat)

    import maxtext
    from maxtext.common.common_types import ShardMode
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    base_yml = Path(maxtext.__file__).parent / "configs" / "base.yml"
    config = pyconfig.initialize(maxtext_argv(args, base_yml))
    # train_compile.get_topology_mesh with our devices in place of jax.devices()
    jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
    axis_type = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
    mesh = Mesh(maxtext_utils.create_device_mesh(config, devices), config.mesh_axes,
                axis_types=(axis_type,) * len(config.mesh_axes))
    # train_compile.main from here on, up to the jit
    shaped_args, shaped_kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    if shaped_kwargs:
        raise RuntimeError(f"unexpected train-step kwargs {sorted(shaped_kwargs)}")
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings)
    input_state_shardings = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings,
                                                                            params_shardings)
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    fn, in_shard, out_shard, static_argnums, donate_argnums = (
        maxtext_utils.get_functional_train_with_signature(train.train_step, data_sharding,
                                                          input_state_shardings, model, config,
                                                          params_shardings))
    with jax.set_mesh(mesh):
        jitted = jax.jit(fn, in_shardings=in_shard, out_shardings=out_shard, static_argnums=static_argnums,
                         donate_argnums=donate_argnums)
    # arg specs carrying their shardings (our aot reads the devices off them)
    specs = tuple(shaped_args)  # ShapeDtypeStructs that carry their NamedShardings already
    if any(getattr(x, "sharding", None) is None for x in jax.tree.leaves(specs)):
        raise RuntimeError("MaxText's shaped train-step inputs carry no sharding")
    mesh_shape = {k: v for k, v in mesh.shape.items() if v > 1}
    with contextlib.redirect_stdout(sys.stderr):
        mt_tflops = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
    facts = {"maxtext_version": getattr(maxtext, "__version__", None) or _dist_version("maxtext"),
             "model_name": MAXTEXT_MODEL, "mesh": mesh_shape, "gmm": args.gmm,
             "moe_keys": {k: getattr(config, k) for k in ("sparse_matmul", "megablox", "use_tokamax_gmm",
                                                          "use_gmm_v2", "capacity_factor",
                                                          "ragged_buffer_factor", "use_ring_of_experts")},
             "attention": config.attention, "remat_policy": config.remat_policy,
             "scan_layers": config.scan_layers, "dtype": str(config.dtype),
             "weight_dtype": str(config.weight_dtype), "opt_type": str(config.opt_type),
             "num_decoder_layers": config.num_decoder_layers,
             "per_device_batch_size": config.per_device_batch_size,
             "max_target_length": config.max_target_length,
             "global_batch_size_to_train_on": config.global_batch_size_to_train_on,
             "maxtext_tflops_per_device": _tflops_facts(mt_tflops)}
    return InMesh(jitted, mesh, config.logical_axis_rules), specs, config, facts


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _tflops_facts(res: Any) -> Any:
    """MaxText's own count (`calculate_tflops_training_per_device`), kept beside ours in the report."""
    if isinstance(res, tuple):
        keys = ("total", "learnable_weight", "attention")
        return {k: float(v) for k, v in zip(keys, res, strict=False)}
    return float(res)


def our_useful_flops(args: argparse.Namespace, layers: int) -> dict[str, Any]:
    """Our useful FLOPs of the same LM step (inspect --mode train), for the report's accounting."""
    from farskip_jax.config import load_config, parse_overrides
    from farskip_jax.inspect import flops

    sets = [f"model.num_layers={layers}"]
    cfg = load_config(OUR_CONFIG, parse_overrides(sets))
    return flops.step_flops(cfg, "train", devices=8, seq_len=args.seq_len,
                            seqs_per_device=args.seqs_per_device, batch_devices=8)


def grouped_fill(config: Any, args: argparse.Namespace) -> float:
    """Balanced rows / static rows of MaxText's receive buffer (its own sizing rule)."""
    from maxtext.layers.moe import RoutedMoE

    ep = 8
    local_rows = args.seqs_per_device * args.seq_len * config.num_experts_per_tok
    buf = RoutedMoE.get_ragged_buffer_size(local_rows, ep, config.num_experts, config.num_experts_per_tok,
                                           config.ragged_buffer_factor)
    return min(1.0, local_rows / buf)


VARIANTS: dict[str, list[str]] = {
    # MaxText's config as it is: attention=autoselected (tokamax Pallas-Triton flash on a GPU target),
    # dropless receive buffers (ragged_buffer_factor=-1: EP x the balanced rows)
    "default": [],
    # a GSPMD-partitioned attention: XLA einsums over the full [T, T] scores (cudnn_flash_jax, the
    # other GPU choice without TransformerEngine, takes head dims <= 128; MLA's q.k has 192)
    "dot_product": ["attention=dot_product"],
    # and receive buffers bounded at 2x the balanced rows, our execution.moe_buffer_factor (MaxText drops
    # the rows past it; ours re-runs the step dropless, a separate program)
    "bounded": ["attention=dot_product", "ragged_buffer_factor=2.0"],
}

# Failures understood, said beside the error text in ERROR.txt.
KNOWN_FAILURES = {
    "compute-capability": (
        "MaxText's GPU flash attention (attention=autoselected/flash on a non-TPU target) is tokamax's "
        "PallasTritonFlashAttention with config=None; tokamax 0.0.17's supported_on() -> "
        "gpu_utils.has_triton_support() returns float(device.compute_capability) >= 8.0, which raises for "
        "a ROCm device: a compile-only MI300X reports '<unknown compute-capability>', a real one 'gfx942'. "
        "Not MaxText's to fix by a config key; the dot_product variants run on MI300X."),
    "head dim must be <= 128": (
        "attention=cudnn_flash_jax (JAX's cuDNN fused attention) takes head dims <= 128; MLA's q.k has "
        "qk_nope + qk_rope = 192."),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/maxtext_peer.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=("h200", "mi300x"), default="h200", help="deviceless target (8 GPUs)")
    p.add_argument("--out", type=Path, required=True,
                   help="one sub-directory per variant (report_maxtext.{json,md}, .trace.json.gz, scheduled "
                        "HLO, summary.json/.txt; ERROR.txt when it failed) and summary.md over them")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, from: {', '.join(VARIANTS)} (each one process, one at a time; "
                        "resumable: a variant with a summary.json or ERROR.txt is skipped unless --force)")
    p.add_argument("--force", action="store_true", help="recompile variants that have results already")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the config's 27, one dense + 26 MoE); fewer for a "
                        "reduced run")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (max_target_length)")
    p.add_argument("--seqs-per-device", type=int, default=4, help="sequences per GPU (per_device_batch_size)")
    p.add_argument("--gmm", choices=GMM_CHOICES, default=None,
                   help="MaxText's grouped GEMM in the sparse-matmul MoE: tokamax (use_tokamax_gmm, tokamax "
                        "Mosaic GPU kernel; Hopper only), ragged_dot (jax.lax.ragged_dot), megablox (its TPU "
                        "Pallas kernel). Default: tokamax on h200, ragged_dot on mi300x")
    p.add_argument("--pgle", choices=("auto", "synthetic", "off"), default="auto",
                   help="synthetic PGLE profile from our cost model (auto: on for mi300x, as `inspect`)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra MaxText config override for every variant (repeatable), e.g. "
                        "remat_policy=minimal")
    p.add_argument("--ours", type=Path, default=None,
                   help="an `inspect --mode train` output directory of ours (report_<mode>.json) to "
                        "tabulate beside MaxText's rows in summary.md")
    p.add_argument("--maxtext-site", type=Path, default=DEFAULT_SITE,
                   help="where MaxText was installed (pip --target; `make maxtext-peer`)")
    p.add_argument("--save-hlo", action=argparse.BooleanOptionalAction, default=True,
                   help="write the scheduled HLO (scheduled_maxtext.hlo.txt.gz)")
    p.add_argument("--one-variant", default=None, help=argparse.SUPPRESS)  # the per-variant child process
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.one_variant is not None:
        return run_variant(p, args, args.one_variant)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    child_argv = list(argv if argv is not None else sys.argv[1:])
    failed = []
    for v in variants:
        out = args.out / v
        if not args.force and ((out / "summary.json").exists() or (out / "ERROR.txt").exists()):
            print(f"{v}: done already ({out})", flush=True)
            continue
        for stale in ("summary.json", "ERROR.txt"):
            (out / stale).unlink(missing_ok=True)
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, __file__, *child_argv, "--one-variant", v])
        print(f"{v}: exit {res.returncode} after {time.perf_counter() - t0:.0f} s", flush=True)
        if res.returncode:
            failed.append(v)
    table = summary_markdown(args, variants)
    (args.out / "summary.md").write_text(table)
    print(table)
    if failed:
        print(f"maxtext_peer: failed: {', '.join(failed)} (see {args.out}/<variant>/ERROR.txt)")
    return 1 if failed and len(failed) == len(variants) else 0


def run_variant(p: argparse.ArgumentParser, args: argparse.Namespace, variant: str) -> int:
    """Build, compile, analyse and report one variant in this process; ERROR.txt on failure."""
    args.gmm = args.gmm or DEFAULT_GMM[args.target]
    args.set = VARIANTS[variant] + list(args.set)
    args.out = args.out / variant
    args.out.mkdir(parents=True, exist_ok=True)

    from farskip_jax.xla import aot

    aot.prepare_deviceless(args.target)  # before anything initialises a JAX backend
    if args.maxtext_site.is_dir():
        sys.path.insert(0, str(args.maxtext_site))
    try:
        import maxtext  # noqa: F401
    except ImportError as e:
        p.error(f"MaxText is not importable ({e}); `make maxtext-peer` installs it into {DEFAULT_SITE}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        return _run_variant(args, variant)
    except Exception as e:
        # said precisely, not hidden: the variant's directory keeps the error and where it came from
        tb = traceback.extract_tb(e.__traceback__)
        where = "\n".join(f"  {f.filename}:{f.lineno} in {f.name}" for f in tb[-8:])
        msg = (f"{variant} on {args.target} failed: {type(e).__name__}: {str(e).strip()[:2000]}\n"
               f"MaxText overrides: {' '.join(args.set) or '(none)'}\nlast frames:\n{where}\n")
        for needle, why in KNOWN_FAILURES.items():
            if needle in str(e):
                msg += f"why: {why}\n"
        (args.out / "ERROR.txt").write_text(msg)
        print(f"maxtext_peer: {msg}", file=sys.stderr)
        return 2


def _run_variant(args: argparse.Namespace, variant: str) -> int:
    from farskip_jax.inspect import cli, hlo, report

    t0 = time.perf_counter()
    fn, specs, config, facts = build_maxtext_step(args)
    fill = grouped_fill(config, args)
    useful = our_useful_flops(args, config.num_decoder_layers)
    print(f"maxtext_peer [{variant}]: MaxText {facts['maxtext_version']} {MAXTEXT_MODEL} on {args.target}, "
          f"mesh {facts['mesh']}, {args.seqs_per_device} x {args.seq_len} tokens per device, "
          f"{config.num_decoder_layers} layers, gmm {args.gmm}, attention {config.attention}, remat "
          f"{config.remat_policy}, ragged_buffer_factor {config.ragged_buffer_factor}; grouped GEMMs "
          f"priced at {fill:.4g} of their rows (built in {time.perf_counter() - t0:.0f}s)", flush=True)
    ns = argparse.Namespace(target=args.target, pgle=args.pgle, compiler_option=[], no_default_options=False,
                            lhs_dump=False, grouped_fill=fill)
    with cli._ticker(f"[{variant}] compiling for {args.target}"):
        art, extra = cli._compile(fn, specs, ns, args.out / "pgle_maxtext")
    analysis = hlo.analyze(art.hlo_text, args.target, art.lhs_schedule_text, fill)
    meta = {"mode": f"maxtext_{variant}", "peer": {**facts, "variant": variant, "overrides": args.set},
            "grouped_gemm_fill": fill, **art.summary()}
    baseline = extra.pop("_baseline", None)
    meta.update(extra)
    without_pgle = None
    if baseline is not None:
        base = hlo.analyze(baseline.hlo_text, args.target, grouped_fill=fill).totals
        without_pgle = base["all"]["hidden_frac"]
        meta["pgle"]["without_profile"] = {"all": without_pgle,
                                           **{k: a["hidden_frac"] for k, a in base["by_kind"].items()}}
        meta["pgle"]["without_profile_totals"] = {k: v for k, v in base.items() if k != "by_role"}
        meta["pgle"]["baseline_compile_seconds"] = baseline.compile_seconds
    paths = report.write_reports(analysis, args.out, name="report_maxtext", meta=meta, memory=art.memory,
                                 useful=useful)
    trace = Path(paths["trace"])
    if trace.exists():  # ~2 MB of JSON; ui.perfetto.dev opens the .gz as it is
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb", compresslevel=6) as dst:
            dst.write(src.read())
        trace.unlink()
    if args.save_hlo:
        with gzip.open(args.out / "scheduled_maxtext.hlo.txt.gz", "wt", compresslevel=6) as f:
            f.write(art.hlo_text)
    rep = report.build_report(analysis, meta, art.memory, useful)
    acc, tot, mem = rep["accounting"], analysis.totals["all"], art.memory or {}
    summary = {
        "variant": variant, "target": args.target, "maxtext": facts["maxtext_version"], "gmm": args.gmm,
        "overrides": args.set, "attention": config.attention,
        "ragged_buffer_factor": config.ragged_buffer_factor, "layers": config.num_decoder_layers,
        "tokens_per_device": args.seqs_per_device * args.seq_len,
        "est_step_ms": acc.get("est_step_us", 0) / 1000, "est_mfu": acc.get("est_mfu"),
        "static_dot_over_useful": acc.get("static_over_useful"),
        "peak_bytes_per_device": mem.get("peak_bytes_per_device"),
        "peak_fraction_of_hbm": mem.get("fraction"), "collectives": tot["count"],
        "hidden_frac": tot["hidden_frac"], "hidden_frac_without_pgle": without_pgle,
        "compile_s": art.compile_seconds, "lower_s": art.lower_seconds,
        "baseline_compile_s": baseline.compile_seconds if baseline is not None else None,
        "pgle": baseline is not None}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    line = summary_line(summary) + f" -> {paths['md']}"
    (args.out / "summary.txt").write_text(line + "\n")
    print(f"[{variant}] {cli._accounting_line(acc)}")
    print(line)
    return 0 if math.isfinite(summary["est_step_ms"]) else 1


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def summary_line(s: dict[str, Any]) -> str:
    ratio = s.get("static_dot_over_useful")
    pgle = (f" (without PGLE {_pct(s['hidden_frac_without_pgle'])})"
            if s.get("hidden_frac_without_pgle") is not None else "")
    return (f"maxtext_peer {s['target']} [{s['variant']}]: est. step {s['est_step_ms']:.2f} ms, est. MFU "
            f"{_pct(s['est_mfu'])}, static dots / useful " + (f"{ratio:.2f}x" if ratio else "-")
            + f", peak {_gib(s['peak_bytes_per_device'])} ({_pct(s['peak_fraction_of_hbm'])} of HBM), "
            f"collectives {s['collectives']} hidden {_pct(s['hidden_frac'])}{pgle}, compile "
            f"{s['compile_s']:.0f}s")


def _ours_rows(ours: Path | None) -> list[dict[str, Any]]:
    """Our `inspect --mode train` reports, in the summary's columns."""
    rows: list[dict[str, Any]] = []
    paths = sorted(ours.glob("report_*.json")) if ours is not None and ours.is_dir() else []
    for path in (p for p in paths if not p.name.endswith(".trace.json")):  # the Perfetto trace
        rep = json.loads(path.read_text())
        acc, mem, tot = rep.get("accounting", {}), rep.get("memory") or {}, rep["totals"]["all"]
        pgle = (rep.get("meta", {}).get("pgle") or {}).get("without_profile") or {}
        rows.append({"name": f"ours: {path.stem.removeprefix('report_')} (`inspect --mode train`)",
                     "est_step_ms": acc.get("est_step_us", 0) / 1000, "est_mfu": acc.get("est_mfu"),
                     "static_dot_over_useful": acc.get("static_over_useful"),
                     "peak_bytes_per_device": mem.get("peak_bytes_per_device"),
                     "peak_fraction_of_hbm": mem.get("fraction"), "collectives": tot["count"],
                     "hidden_frac": tot["hidden_frac"], "hidden_frac_without_pgle": pgle.get("all"),
                     "compile_s": rep.get("meta", {}).get("compile_seconds")})
    return rows


def summary_markdown(args: argparse.Namespace, variants: list[str]) -> str:
    rows: list[dict[str, Any]] = []
    for v in variants:
        d = args.out / v
        if (d / "summary.json").exists():
            s = json.loads((d / "summary.json").read_text())
            rows.append({"name": f"MaxText {s['maxtext']}: {v} ({s['gmm']}, {s['attention']}, "
                                 f"ragged_buffer_factor {s['ragged_buffer_factor']:g})", **s})
        elif (d / "ERROR.txt").exists():
            first = (d / "ERROR.txt").read_text().splitlines()[0]
            rows.append({"name": f"MaxText: {v}", "error": first})
    rows += _ours_rows(args.ours)
    head = ("| step | est. step ms | est. MFU | static dots / useful | peak / device | collectives | "
            "hidden | hidden without PGLE | compile s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [f"## DeepSeek-V2-Lite LM train step on 8 x {args.target} (deviceless, estimated)", "",
             f"{args.seqs_per_device} x {args.seq_len} tokens per GPU, expert parallelism 8, bf16 compute; "
             "useful FLOPs (est. MFU, static / useful) from our `flops.step_flops` for the same step.", "",
             head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | | | |")
            continue
        ratio = r.get("static_dot_over_useful")
        comp = r.get("compile_s")
        lines.append(f"| {r['name']} | {r['est_step_ms']:.1f} | {_pct(r['est_mfu'])} | "
                     + (f"{ratio:.2f}x" if ratio else "-") + f" | {_gib(r['peak_bytes_per_device'])} "
                     f"({_pct(r['peak_fraction_of_hbm'])}) | {r['collectives']} | {_pct(r['hidden_frac'])} | "
                     f"{_pct(r.get('hidden_frac_without_pgle'))} | "
                     + ("-" if comp is None else f"{comp:.0f}") + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
