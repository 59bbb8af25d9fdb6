"""TP prefill variants, deviceless: how much psum time each hides, FarSkip vs regular, and the
estimated time to first token.

Each variant is a set of config overrides (the same keys `inspect --set` takes) compiled for an
8-GPU target with the inspector (`farskip_jax.inspect.cli.run_inspect`: H200 SoL scheduler; MI300X
with the inspector's default synthetic PGLE profile). The program is a TTFT prefill: the TP
forward of `--batch` x `--seq-len` tokens and the logits of each sequence's last token only, as a
server computes them (`--program inspector` compiles the inspector's prefill instead, which
computes the logits of every token).

    JAX_PLATFORMS=cpu python bench/prefill_variants.py --target h200 --out /tmp/pv [--layers 27]
        [--seq-len 4096] [--variants head,ordered,microbatches2,reduce_scatter,stale2] [--set k=v ...]

Per variant it prints and writes (<out>/<target>/summary.md, .json, with the variants that earlier
runs left in the same directory): psum ("all-reduce", or
reduce-scatter + all-gather) hidden share by the compute scheduled between start and done and by
the two-lane timeline replay, the same for the layers between the first and the last (where no
edge of the model limits it), the estimated TTFT (the replay's end), and its ratio to regular
connectivity without any option (the serving baseline) and to regular with the same options.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# variant -> (config overrides, modes to compile). Regular connectivity is compiled where an option
# changes its program; the barriers and stale_blocks touch FarSkip layers only.
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "unordered": ({"execution.tp_order_barriers": False}, ("farskip", "regular")),
    "ordered": ({}, ("farskip",)),
    "microbatches2": ({"execution.tp_microbatches": 2}, ("farskip", "regular")),
    "reduce_scatter": ({"execution.tp_reduce": "reduce_scatter"}, ("farskip", "regular")),
    "stale2": ({"model.farskip.stale_blocks": 2}, ("farskip",)),
}
BASELINE = ("unordered", "regular")  # the serving baseline: regular connectivity, plain psums
# The inspector disables the all-reduce combiner for prefill (a merged psum waits for both parts);
# the reduce-scatter and all-gather combiners would merge the same way.
COMBINERS_OFF = [("xla_gpu_all_reduce_combine_threshold_bytes", 0),
                 ("xla_gpu_reduce_scatter_combine_threshold_bytes", 0),
                 ("xla_gpu_all_gather_combine_threshold_bytes", 0)]
PSUM_KINDS = ("all-reduce", "reduce-scatter", "all-gather")


def ttft_step(cfg: Any, batch: int, seq_len: int) -> Callable[[Any, str], tuple[Any, Sequence[Any]]]:
    """`build(mesh, mode)` for the inspector: TP prefill returning the last token's logits."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from farskip_jax.inspect.steps import config_for
    from farskip_jax.model.transformer import Transformer
    from farskip_jax.parallel import param_specs_tree, tp_forward

    def build(mesh: Any, mode: str):
        run = config_for(cfg, mode)
        model = nnx.eval_shape(lambda: Transformer(run.model, nnx.Rngs(0), run.execution))
        graphdef, params = nnx.split(model, nnx.Param)
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs_tree(params, "tp"),
                                 is_leaf=lambda x: isinstance(x, P))
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                                shardings)
        fwd = tp_forward(graphdef, params, mesh)

        def first_token_logits(state, ids):
            _, hidden = fwd(state, ids)  # XLA drops the all-token logits nobody reads
            return nnx.merge(graphdef, state).logits(hidden[:, -1:])

        ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=NamedSharding(mesh, P()))
        return jax.jit(first_token_logits), (abstract, ids)

    return build


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """psum hidden shares (all layers and the layers strictly between the first and the last) and
    the estimated time of one report."""
    colls = [c for c in report["collectives"] if c["kind"] in PSUM_KINDS]
    layers = [c["layer"] for c in colls if c["layer"] is not None]
    first, last = min(layers), max(layers)
    inner = [c for c in colls if c["layer"] is not None and first < c["layer"] < last]

    def shares(cs: list[dict[str, Any]]) -> dict[str, float]:
        transfer = sum(c["transfer_us"] * c["weight"] for c in cs)
        between = sum(min(c["compute_between_us"], c["transfer_us"]) * c["weight"] for c in cs)
        exposed = sum(c["sim_exposed_us"] for c in cs)
        return {"transfer_us": transfer, "hidden": between / transfer,
                "hidden_timeline": 1 - exposed / transfer, "exposed_us": exposed}

    totals = report["totals"]
    return {"collectives": len(colls), "sync": sum(not c["is_async"] for c in colls), "all": shares(colls),
            "inner": shares(inner), "est_us": totals["est_step_us"], "compute_us": totals["est_compute_us"],
            "pgle_without_profile": (report.get("meta", {}).get("pgle") or {}).get("without_profile")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from farskip_jax.config import load_config, parse_overrides
    from farskip_jax.inspect import cli, steps
    from farskip_jax.model.dispatch import balanced_grouped_fill

    out = Path(args.out) / args.target
    results: dict[str, dict[str, Any]] = {}
    for name in args.variants.split(","):
        overrides, modes = VARIANTS[name]
        sets = {"model.num_layers": args.layers, **parse_overrides(args.set), **overrides}
        cfg = load_config(args.config, sets)
        build = (ttft_step(cfg, args.batch, args.seq_len) if args.program == "ttft"
                 else steps.build_prefill_step(cfg, args.batch, args.seq_len))
        mesh = {"data": 1, "expert": 1, "tensor": args.tp}
        fill = (balanced_grouped_fill(cfg.model, cfg.execution, mesh, False, args.batch * args.seq_len,
                                      args.seq_len)
                if args.moe_load == "balanced" else 1.0)
        ns = argparse.Namespace(target=args.target, mesh=mesh, modes=",".join(modes), out=out / name,
                                lhs_dump=False, compiler_option=list(COMBINERS_OFF), no_default_options=False,
                                save_hlo=False, timeline=False, pgle="auto", grouped_fill=fill)
        reports = cli.run_inspect(ns, build)
        results[name] = {mode: summarize(reports[mode]) for mode in modes}
        (out / name / "variant.json").write_text(json.dumps(results[name], indent=1))
        print(row_lines(name, results[name]), flush=True)
    # Variants compiled by earlier runs into the same directory join the summary (one process per
    # variant keeps the memory of a 27-layer compile from piling up on a small machine).
    for name in VARIANTS:
        done = out / name / "variant.json"
        if name not in results and done.exists():
            results[name] = json.loads(done.read_text())
    results = {name: results[name] for name in VARIANTS if name in results}
    summary = {"target": args.target, "config": args.config, "layers": args.layers, "batch": args.batch,
               "seq_len": args.seq_len, "program": args.program, "set": args.set, "moe_load": args.moe_load,
               "variants": results}
    add_ratios(summary)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    return summary


def add_ratios(summary: dict[str, Any]) -> None:
    """TTFT speed-up of every compiled program against the serving baseline and against regular
    connectivity with the same options (where that was compiled)."""
    variants = summary["variants"]
    base = variants.get(BASELINE[0], {}).get(BASELINE[1])
    for modes in variants.values():
        for r in modes.values():
            if base is not None:
                r["speedup_vs_baseline"] = base["est_us"] / r["est_us"]
            same = modes.get("regular") or (variants.get(BASELINE[0], {}).get("regular"))
            if same is not None:
                r["speedup_vs_regular_same_options"] = same["est_us"] / r["est_us"]


def row_lines(name: str, modes: dict[str, Any]) -> str:
    return "\n".join(f"{name:15s} {mode:8s} psum hidden {100 * r['all']['hidden']:5.1f}% (timeline "
                     f"{100 * r['all']['hidden_timeline']:5.1f}%), "
                     f"inner layers {100 * r['inner']['hidden']:5.1f}%, "
                     f"{r['collectives']} collectives ({r['sync']} sync), est {r['est_us'] / 1000:.3f} ms"
                     for mode, r in modes.items())


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"## TP prefill variants, {summary['target']}: {summary['config']}, {summary['layers']} layers, "
             f"{summary['batch']} x {summary['seq_len']} tokens, program {summary['program']}"
             + (f", --set {' '.join(summary['set'])}" if summary["set"] else ""), "",
             "| variant | connectivity | psums (sync) | hidden | hidden (timeline) | hidden, inner layers | "
             "exposed us | est. TTFT ms | vs regular baseline | vs regular, same options |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, modes in summary["variants"].items():
        for mode, r in modes.items():
            lines.append(
                f"| {name} | {mode} | {r['collectives']} ({r['sync']}) | {100 * r['all']['hidden']:.1f}% | "
                f"{100 * r['all']['hidden_timeline']:.1f}% | {100 * r['inner']['hidden']:.1f}% | "
                f"{r['all']['exposed_us']:.0f} | {r['est_us'] / 1000:.3f} | "
                f"{r.get('speedup_vs_baseline', float('nan')):.3f}x | "
                f"{r.get('speedup_vs_regular_same_options', float('nan')):.3f}x |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", choices=("h200", "mi300x"), default="h200")
    p.add_argument("--config", default="dsv2lite_farskip")
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {list(VARIANTS)}")
    p.add_argument("--program", choices=("ttft", "inspector"), default="ttft")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    p.add_argument("--moe-load", choices=("balanced", "static"), default="balanced",
                   help="grouped GEMM pricing, as `inspect --moe-load` (balanced: each rank's 1/TP share)")
    p.add_argument("--out", type=Path, required=True)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
