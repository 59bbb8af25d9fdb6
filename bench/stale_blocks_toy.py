"""What the experimental `model.farskip.stale_blocks: 2` costs in accuracy, on the demo's toy task.

The demo pipeline's stages, run once per staleness with the same teacher: a tiny regular MoE
learns to reverse strings (lm), is converted to FarSkip on every layer with staleness 1 (the
paper's FarSkip) and 2 (each sub-block reads a stream two sub-blocks old, model/farskip.py), and
each conversion is distilled back from the regular teacher with FCSD for the same number of
steps. Exact match and token accuracy are on held-out prompts (farskip_jax.demo.pipeline.accuracy).

    JAX_PLATFORMS=cpu python bench/stale_blocks_toy.py --out /tmp/stale_toy [--seeds 0 1]
        [--teacher-steps 250] [--fcsd-steps 150]

Writes <out>/stale_blocks_toy.json and prints one table per seed. CPU, minutes per seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from farskip_jax.config import load_config
from farskip_jax.demo import pipeline, task


def run_seed(seed: int, out: Path, teacher_steps: int, fcsd_steps: int) -> dict[str, Any]:
    cfg = pipeline.derive(load_config("tiny_demo"), {
        "demo.seed": seed, "demo.trainer_eval": False, "train.output_dir": str(out),
        "demo.teacher.train.total_steps": teacher_steps, "demo.fcsd.train.total_steps": fcsd_steps})
    paths = task.prepare(out / "data", cfg.demo, seed)
    pipeline.check_vocab(cfg, paths)
    test = next(iter(paths["tests"].values()))
    teacher = pipeline.run_stage("teacher (regular, lm)", pipeline.teacher_config(cfg, paths, out, seed))
    regular, exe = pipeline.with_farskip(teacher.cfg.model, **pipeline.FARSKIP_OFF), teacher.cfg.execution
    res: dict[str, Any] = {"seed": seed, "teacher_steps": teacher_steps, "fcsd_steps": fcsd_steps,
                           "teacher": pipeline.accuracy(regular, teacher.params, test, exe)}
    for stale in (1, 2):
        model = pipeline.converted(regular, stale_blocks=stale)
        student = pipeline.run_stage(
            f"FCSD student (stale_blocks={stale})",
            pipeline.student_config(cfg, paths, out, Path(teacher.cfg.train.output_dir), f"fcsd_stale{stale}",
                                    seed, {"model.farskip.stale_blocks": stale}))
        kl = [m["kl"] for m in student.metrics if "kl" in m]
        res[f"stale{stale}"] = {"converted": pipeline.accuracy(model, teacher.params, test, exe),
                                "fcsd": pipeline.accuracy(model, student.params, test, exe),
                                "final_kl": kl[-1] if kl else None, "wall_s": student.wall_s}
    return res


def table(res: dict[str, Any]) -> str:
    rows = [("teacher (regular)", res["teacher"])]
    for stale in (1, 2):
        r = res[f"stale{stale}"]
        rows += [(f"stale {stale}: converted", r["converted"]),
                 (f"stale {stale}: FCSD {res['fcsd_steps']} steps", r["fcsd"])]
    lines = [f"seed {res['seed']}  {'model':<28} {'exact match':>11} {'token acc':>9}"]
    lines += [f"        {n:<28} {a['exact_match']:>11.3f} {a['token_acc']:>9.3f}" for n, a in rows]
    kls = ", ".join(f"stale {s} {res[f'stale{s}']['final_kl']}" for s in (1, 2))
    lines.append(f"        final FCSD KL: {kls}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--teacher-steps", type=int, default=250)
    p.add_argument("--fcsd-steps", type=int, default=150)
    args = p.parse_args()
    results = []
    for seed in args.seeds:
        results.append(run_seed(seed, args.out / f"seed{seed}", args.teacher_steps, args.fcsd_steps))
        print(table(results[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stale_blocks_toy.json").write_text(json.dumps(results, indent=1))
    print(f"-> {args.out / 'stale_blocks_toy.json'}")


if __name__ == "__main__":
    main()
