#!/usr/bin/env python
"""FCSD self-distillation / SFT / LM training for farskip-jax.

  python train.py --config tiny_farskip --set data.paths=[d.jsonl] --set data.tokenizer=tok.json
  python train.py --config tiny_farskip --resume
  python train.py --config tiny_farskip --precompute-teacher cache/   # then --set train.teacher_cache=cache/
  python train.py --config tiny_farskip --help                        # also lists every config key
  python -m farskip_jax.launch --processes 2 --cpu-devices 4 -- train.py --config tiny_farskip ...
                                                     # multi-process (docs/gpus-and-multi-node.md)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from farskip_jax import distributed
from farskip_jax.config import ConfigError, load_config, parse_overrides, to_dict
from farskip_jax.errors import cli_main


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out += _flatten(v, key + ".")
        else:
            out.append((key, v))
    return out


def _config_listing(name: str, overrides: list[str]) -> str:
    try:
        cfg = load_config(name, parse_overrides(overrides))
    except ConfigError as e:
        return f"\n(config {name!r} could not be loaded: {e})"
    lines = [f"\nconfig {cfg.name!r}: keys and current values (change with --set KEY=VALUE):"]
    lines += [f"  {k} = {json.dumps(v)}" for k, v in _flatten(to_dict(cfg)) if k != "name"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py", formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False,
        description="Train a FarSkip student by self-distillation from its original model (FCSD), "
                    "or by SFT/LM.",
        epilog=(
            "Modes (train.mode): fcsd = forward KL(teacher || student) on loss-masked tokens (+ "
            "train.hidden_l2_weight x L2 on layer outputs); sft = cross-entropy on the same tokens; lm = "
            "next-token on every token, no teacher.\nTeacher = train.init_checkpoint (HF dir, Orbax dir, or "
            "random init from train.seed when null) with regular connectivity, frozen, in "
            "train.teacher_dtype; student = the same weights with the config's model.farskip.\n"
            "Outputs under train.output_dir: "
            "checkpoints/ (Orbax: params, opt_state, meta), metrics.jsonl, tb/ (TensorBoard), summary.json."))
    p.add_argument("-h", "--help", action="store_true", help="show this help (with --config: also its keys)")
    p.add_argument("--config", help="config name in configs/ (e.g. tiny_farskip) or a YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a dotted config key, YAML value syntax (repeatable): "
                        "--set train.total_steps=100")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest readable checkpoint in train.output_dir/checkpoints "
                        "(unreadable/truncated ones are skipped with a warning)")
    p.add_argument("--precompute-teacher", metavar="DIR",
                   help="write the teacher's top-k (train.teacher_topk) log-probs for train.total_steps "
                        "steps and the eval batches to DIR, print the top-k vs full-teacher KL gap, and "
                        "exit; train with --set train.teacher_cache=DIR afterwards")
    p.add_argument("--xla-flags", choices=("auto", "h200", "mi300x", "none"), default="auto",
                   help="append farskip_jax.xla.flags' defaults for this GPU family to XLA_FLAGS before "
                        "the first compile (auto: from /dev/kfd or /dev/nvidia*); flags already in "
                        "XLA_FLAGS win")
    p.add_argument("--log-level", default="WARNING", help="Python logging level (default WARNING)")
    distributed.add_distributed_args(p)
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    """User errors (bad config, mesh larger than the machine, missing data, tokenizer or checkpoint)
    end as one `error: ...` line naming the fix, exit status 2 (`cli_main`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.help or not args.config:
        parser.print_help()
        if args.config:
            print(_config_listing(args.config, args.overrides))
        return 0 if args.help else 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, parse_overrides(args.overrides))
    if args.xla_flags != "none":
        from farskip_jax.xla.flags import apply_default_xla_flags, detect_local_target

        target = detect_local_target() if args.xla_flags == "auto" else args.xla_flags
        added = apply_default_xla_flags(target)
        logging.info("XLA flags added for %s: %s", target, " ".join(added) or "none")
    if distributed.initialize(args) is not None:  # multi-process runs only; before the first JAX computation
        distributed.quiet_other_processes()
    if cfg.demo:  # a config with a `demo:` section (configs/tiny_demo.yaml) runs the embedded demo
        from farskip_jax.demo import run_demo

        run_demo(cfg, cfg_path=args.config)
        return 0
    from farskip_jax.train import trainer

    if args.precompute_teacher:
        from farskip_jax.train.teacher_precompute import precompute_teacher

        gap = precompute_teacher(cfg, args.precompute_teacher)
        if not distributed.is_main_process():
            return 0
        print("teacher cache written to", args.precompute_teacher)
        print(f"initial-student KL on eval batches: full teacher {gap['kl_full']:.6g}, top-{gap['k']} + tail "
              f"{gap['kl_topk_tail']:.6g}, |diff| {gap['abs_diff']:.3g} ({gap['rel_diff']:.2%})")
        return 0
    try:
        summary = trainer.train(cfg, resume=args.resume)
    except trainer.NonFiniteError as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    if distributed.is_main_process():
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
