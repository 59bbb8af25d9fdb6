"""The embedded demo: train a tiny regular MoE teacher, convert it to FarSkip, recover it with FCSD.

Every training stage is the real trainer (`farskip_jax.train.trainer.Trainer`) on a Config derived from the
demo config with dotted overrides, so the demo exercises exactly what `train.py` runs. The demo only adds
data generation, exact-match accuracy, plots and the HLO overlap report.

    python train.py --config tiny_demo      # dispatches here because the config has a `demo:` section
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from farskip_jax.config import Config, ExecutionConfig, ModelConfig, from_dict, to_dict
from farskip_jax.demo import task
from farskip_jax.generation import PAD, Generator
from farskip_jax.model import Transformer, with_farskip


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"total_steps": 5}} -> {"train.total_steps": 5} (nested YAML -> dotted overrides)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v and k != "template":
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def derive(cfg: Config, overrides: Mapping[str, Any]) -> Config:
    """A validated copy of `cfg` with dotted overrides applied (the same rules as `--set`)."""
    tree = to_dict(cfg)
    for dotted, value in overrides.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for p in parents:
            if node.get(p) is None:
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ValueError(f"override {dotted!r}: {p!r} is not a section")
        node[leaf] = value
    new = from_dict(Config, tree)
    new.validate()
    return new


def data_overrides(cfg: Config, paths: Mapping[str, Any]) -> dict[str, Any]:
    # demo.trainer_eval=false drops the trainer's periodic held-out loss (one compiled program fewer per
    # stage: the tests use it); accuracy is measured by the demo either way.
    evals = [paths["eval"]] if cfg.demo.get("trainer_eval", True) else []
    return {"data.paths": [paths["train"]], "data.eval_paths": evals,
            "data.tokenizer": paths["tokenizer"], "data.template": dict(task.TEMPLATE)}


# --------------------------------------------------------------------------------------------
# Exact-match accuracy

EOS_ID = task.SPECIALS.index("<eos>")  # the demo vocabulary starts with the special tokens


_GENERATORS: dict[tuple[ModelConfig, ExecutionConfig], Generator] = {}


def _graph(mcfg: ModelConfig, exe: ExecutionConfig) -> nnx.GraphDef:
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, nnx.Rngs(0), exe)), nnx.Param)
    return graphdef


def _generator(mcfg: ModelConfig, exe: ExecutionConfig, params: nnx.State) -> Generator:
    """One compiled Generator per connectivity (a new program only for a new graph), loaded with `params`."""
    if (mcfg, exe) not in _GENERATORS:
        _GENERATORS[(mcfg, exe)] = Generator(nnx.merge(_graph(mcfg, exe), params))
    gen = _GENERATORS[(mcfg, exe)]
    gen.load(params)
    return gen


def accuracy(mcfg: ModelConfig, params: nnx.State, test: dict[str, np.ndarray],
             exe: ExecutionConfig = ExecutionConfig()) -> dict[str, float]:
    """Greedy free-running decoding of the held-out prompts (`task.encode` rows) by the model `mcfg`
    run as `exe` (the stage's execution section): exact match of the answer through EOS, and the
    share of gold answer tokens produced at their place."""
    params = jax.tree.map(lambda x: jax.device_put(np.asarray(x, np.float32)), params)
    first_answer = np.argmax(test["loss_mask"], axis=1)  # the prompt ends where the loss starts
    lengths = test["segment_ids"].sum(axis=1)
    prompts = np.full(test["input_ids"].shape, PAD, np.int32)
    gold = []
    for i, (h, n) in enumerate(zip(first_answer + 1, lengths, strict=True)):
        prompts[i, :h] = test["input_ids"][i, :h]
        gold.append(test["targets"][i, h - 1 : n])  # the answer and its EOS
    width = max(map(len, gold))
    out = _generator(mcfg, exe, params).generate(prompts[:, : first_answer.max() + 1], width,
                                                 eos_ids=[EOS_ID])
    exact, hits = [], 0
    for i, g in enumerate(gold):
        new = out[i, first_answer[i] + 1 : first_answer[i] + 1 + width]
        exact.append(np.array_equal(new[: len(g)], g) and (len(g) == width or new[len(g)] == PAD))
        hits += int(np.sum(new[: len(g)] == g))
    return {"exact_match": float(np.mean(exact)), "token_acc": hits / sum(map(len, gold))}


def converted(mcfg: ModelConfig, **farskip: Any) -> ModelConfig:
    """`mcfg` with FarSkip connectivity set as given (everything else: same weights, same model)."""
    base = FARSKIP_OFF | {"enabled": True} | farskip
    return with_farskip(mcfg, **base)


FARSKIP_OFF = {"enabled": False, "start_idx": None, "end_idx": None, "first_n": None, "last_n": None,
               "attn_only": False, "mlp_only": False}


# --------------------------------------------------------------------------------------------
# Stages


@dataclasses.dataclass
class Stage:
    name: str
    cfg: Config
    params: nnx.State
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    wall_s: float


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    p = Path(out_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln] if p.exists() else []


def run_stage(name: str, cfg: Config, log: Callable[[str], None] = print) -> Stage:
    """One real trainer run; returns the final params (still on device) and what it logged."""
    from farskip_jax.train import trainer

    log(f"--- {name}: train.mode={cfg.train.mode}, {cfg.train.total_steps} steps, "
        f"farskip={'on' if cfg.model.farskip.enabled else 'off'} -> {cfg.train.output_dir}")
    t0 = time.perf_counter()
    # A stage always trains from scratch: what an earlier demo run left in its directory goes (the
    # trainer refuses to start a fresh run over existing checkpoints).
    shutil.rmtree(cfg.train.output_dir, ignore_errors=True)
    tr = trainer.Trainer(cfg)
    summary = tr.run()
    return Stage(name, cfg, tr.state["params"], summary, read_metrics(cfg.train.output_dir),
                 time.perf_counter() - t0)


def teacher_config(cfg: Config, paths: Mapping[str, Any], out: Path, seed: int) -> Config:
    over = {**data_overrides(cfg, paths), "model.farskip.enabled": False, "train.mode": "lm",
            "train.seed": seed, "data.shuffle_seed": seed, "train.output_dir": str(out / "teacher"),
            "train.init_checkpoint": None}
    return derive(cfg, {**over, **flatten(cfg.demo.get("teacher", {}))})


def student_config(cfg: Config, paths: Mapping[str, Any], out: Path, teacher_dir: Path, name: str,
                   seed: int, extra: Mapping[str, Any] | None = None) -> Config:
    """FCSD (or SFT) student: FarSkip on every layer unless `extra` says otherwise, initialised from the
    teacher's checkpoint; the trainer builds the frozen regular teacher from the same checkpoint."""
    over = {**data_overrides(cfg, paths), **{f"model.farskip.{k}": v for k, v in FARSKIP_OFF.items()},
            "model.farskip.enabled": True, "train.mode": "fcsd", "train.seed": seed,
            "data.shuffle_seed": seed + 1000, "train.init_checkpoint": str(teacher_dir / "checkpoints"),
            "train.teacher_dtype": "float32", "train.output_dir": str(out / name)}
    return derive(cfg, {**over, **flatten(cfg.demo.get("fcsd", {})), **(extra or {})})


def check_vocab(cfg: Config, paths: Mapping[str, Any]) -> None:
    if cfg.model.vocab_size < paths["vocab_used"]:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} < the task's {paths['vocab_used']} tokens")


# --------------------------------------------------------------------------------------------
# The demo


def inspect_overlap(cfg_path: str, out: Path, seq_len: int, log: Callable[[str], None] = print
                    ) -> dict[str, Any] | None:
    """The HLO inspector on the same tiny model: deviceless compile for 8 H200s, FarSkip vs regular."""
    from farskip_jax.inspect import cli

    argv = ["--config", cfg_path, "--target", "h200", "--mode", "train", "--compare-regular",
            "--seq-len", str(seq_len), "--out", str(out),
            # XLA's Triton GEMM tiler fails on the tiny model's very small dots.
            "--compiler-option", "xla_gpu_enable_triton_gemm=false"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = cli.main(argv)
    except Exception as e:  # noqa: BLE001 - the demo's training results stand without the report
        log(f"inspector failed ({type(e).__name__}: {e}); see {out}")
        return None
    finally:
        out.mkdir(parents=True, exist_ok=True)
        (out / "inspect.log").write_text(buf.getvalue())
    if rc:
        return None
    return json.loads((out / "compare.json").read_text())


def overlap_line(cmp: Mapping[str, Any]) -> str:
    # the token exchange: a ragged all-to-all on GPU targets (execution.ep_exchange auto), a dense one else
    kind = next((k for k in ("ragged-all-to-all", "all-to-all") if k in cmp["groups"]), None)
    if kind is None:
        return f"no all-to-all in the compiled step (groups: {sorted(cmp['groups'])})"
    a2a = cmp["groups"][kind]
    f, r = a2a["farskip"]["hidden_frac"], a2a["regular"]["hidden_frac"]
    return (f"all-to-all time hidden under compute: FarSkip {100 * f:.1f}% vs regular {100 * r:.1f}% "
            f"(estimated step {cmp['est_step_us']['farskip']:.0f} us vs "
            f"{cmp['est_step_us']['regular']:.0f} us, "
            f"x{cmp['speedup_est']:.3f})")


def run_demo(cfg: Config, cfg_path: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole demo; returns the results dict (also written to <output_dir>/demo_results.json)."""
    from farskip_jax.demo import plots

    t_start = time.perf_counter()
    demo = cfg.demo
    seed = int(demo.get("seed", 0))
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log(f"[demo] task {demo['tasks']}: {demo['n_train']} training chats -> {out / 'data'}")
    paths = task.prepare(out / "data", demo, seed)
    check_vocab(cfg, paths)
    op = list(paths["tests"])[0]
    test = paths["tests"][op]

    teacher = run_stage("teacher (regular, lm)", teacher_config(cfg, paths, out, seed), log)
    regular = with_farskip(teacher.cfg.model, **FARSKIP_OFF)
    farskip_all = converted(regular)
    exe = teacher.cfg.execution
    acc_teacher = accuracy(regular, teacher.params, test, exe)
    acc_conv = accuracy(farskip_all, teacher.params, test, exe)
    log(f"[demo] teacher exact match {acc_teacher['exact_match']:.3f}; converted to FarSkip on all "
        f"{regular.num_layers} layers (same weights): {acc_conv['exact_match']:.3f}")

    student_cfg = student_config(cfg, paths, out, Path(teacher.cfg.train.output_dir), "fcsd", seed)
    student = run_stage("FCSD student (FarSkip, KL)", student_cfg, log)
    acc_fcsd = accuracy(farskip_all, student.params, test, exe)
    drop = acc_teacher["exact_match"] - acc_conv["exact_match"]
    regained = acc_fcsd["exact_match"] - acc_conv["exact_match"]
    res: dict[str, Any] = {
        "seed": seed, "task": op, "teacher": acc_teacher, "converted": acc_conv, "fcsd": acc_fcsd,
        "recovered_fraction_of_drop": regained / drop if drop > 0 else None,
        "teacher_steps": teacher.cfg.train.total_steps, "fcsd_steps": student.cfg.train.total_steps,
        "stage_wall_s": {"teacher": teacher.wall_s, "fcsd": student.wall_s},
    }
    log("\n" + table(res))
    res["plots"] = [str(p) for p in (
        plots.training_curves({"teacher (lm CE)": teacher.metrics}, {"FCSD (KL)": student.metrics},
                              out / "demo_curves.png"),
        plots.accuracy_bars(["teacher\n(regular)", "converted\n(untrained)", "after FCSD"],
                            [acc_teacher["exact_match"], acc_conv["exact_match"], acc_fcsd["exact_match"]],
                            f"'{op}' exact match, held-out prompts (seed {seed})", out / "demo_accuracy.png"),
    )]
    log(f"[demo] plots: {', '.join(res['plots'])}")
    if demo.get("inspect", True) and cfg_path is not None:
        log("[demo] HLO inspector: deviceless compile of the same model's train step for 8x H200 (EP=8), "
            "FarSkip and regular ...")
        cmp = inspect_overlap(cfg_path, out / "inspect", int(demo.get("inspect_seq_len", 64)), log)
        if cmp is not None:
            res["overlap"] = {"line": overlap_line(cmp), "compare": str(out / "inspect" / "compare.md")}
            log(f"[demo] overlap: {res['overlap']['line']}  -> {out / 'inspect'}")
    res["wall_s"] = time.perf_counter() - t_start
    (out / "demo_results.json").write_text(json.dumps(res, indent=1))
    log(f"[demo] done in {res['wall_s']:.0f}s -> {out / 'demo_results.json'}")
    return res


def table(res: Mapping[str, Any]) -> str:
    rows = [("teacher, trained (lm)", "regular", res["teacher"]),
            ("converted, no training", "FarSkip, all layers", res["converted"]),
            (f"after FCSD ({res['fcsd_steps']} steps)", "FarSkip, all layers", res["fcsd"])]
    lines = [f"{'model':<28} {'connectivity':<21} {'exact match':>11} {'token acc':>9}"]
    lines += [f"{n:<28} {c:<21} {a['exact_match']:>11.3f} {a['token_acc']:>9.3f}" for n, c, a in rows]
    frac = res["recovered_fraction_of_drop"]
    lines.append(f"FCSD regained {'n/a' if frac is None else f'{100 * frac:.0f}%'} of the conversion drop "
                 f"(task '{res['task']}', seed {res['seed']})")
    return "\n".join(lines)
