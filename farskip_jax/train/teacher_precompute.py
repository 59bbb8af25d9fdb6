"""`train.py --precompute-teacher DIR`: the frozen teacher's top-k log-probs for every training step
and eval batch written once (`teacher_cache`), and how far the cached top-k + tail KL of the initial
student is from the full-teacher KL on the eval batches. Apart from the training loop
(`trainer.py`): it builds the same program and models but runs no optimiser step.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from farskip_jax.config import Config
from farskip_jax.train import batches, setup
from farskip_jax.train.program import TrainProgram, build_program
from farskip_jax.train.teacher_cache import TeacherCache
from farskip_jax.train.trainer import check_init_checkpoint


def precompute_teacher(cfg: Config, out_dir: str) -> dict[str, float]:
    """Writes the teacher's top-k log-probs for the first `total_steps` training steps and the eval batches,
    then measures, on those eval batches (or the first steps), how far the top-k + tail KL of the initial
    student is from the full-teacher KL."""
    from tqdm.auto import tqdm

    from farskip_jax.train import teacher_cache as tcache
    from farskip_jax.train.step import make_teacher_topk

    tc = cfg.train
    mesh = setup.training_mesh(cfg)
    batches.check_data_files(cfg)
    check_init_checkpoint(cfg)
    program = build_program(cfg, mesh)
    data = batches.BatchStream(cfg, program.batch_sharding, tc.grad_accum_steps)
    evals = batches.eval_batches(cfg, program.eval_batch_sharding) or []
    models = setup.build_models(cfg, program, need_teacher=True)
    topk = make_teacher_topk(models.teacher_graph, tc.teacher_topk, tc.kl_temperature, tc.kl_chunk_tokens,
                             program.parallel, program.mesh)
    tcache.write_meta(out_dir, {"k": tc.teacher_topk, "temperature": tc.kl_temperature,
                                "steps": tc.total_steps, "grad_accum_steps": tc.grad_accum_steps,
                                "config": cfg.name})

    worst: list[Any] = []  # the worst-case top-k step, built when a batch first overflows

    def run(host: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        batch = batches.to_device(host, program.eval_batch_sharding)
        logp, ids, overflow = topk(models.teacher_params, batch)
        if float(overflow) > 0:  # bounded buffers overflowed: the same batch with the worst case
            if not worst:
                worst.append(make_teacher_topk(models.teacher_graph, tc.teacher_topk, tc.kl_temperature,
                                               tc.kl_chunk_tokens, program.worst_parallel, program.mesh))
            logp, ids, _ = worst[0](models.teacher_params, batch)
        return batches.local_rows(logp), batches.local_rows(ids)

    for step in tqdm(range(tc.total_steps), desc="teacher top-k", disable=jax.process_index() != 0):
        host = data.next_host()
        outs = [run({k: v[a] for k, v in host.items()}) for a in range(tc.grad_accum_steps)]
        tcache.write_entry(out_dir, f"train_{step:08d}", np.stack([o[0] for o in outs]),
                           np.stack([o[1] for o in outs]), host["input_ids"])
    for i, host in enumerate(evals):
        logp, ids = run(host)
        tcache.write_entry(out_dir, f"eval_{i:04d}", logp, ids, host["input_ids"])
    return measure_topk_gap(program, models, out_dir, evals)


def measure_topk_gap(program: TrainProgram, models: setup.Models, cache_dir: str,
                     evals: list) -> dict[str, float]:
    """Full-teacher KL vs cached top-k + tail KL of the *initial* student on the eval batches."""
    tc = program.cfg.train
    full = program.eval_step(with_teacher=True, cached_teacher=False)
    cached = program.eval_step(with_teacher=False, cached_teacher=True)
    cache = TeacherCache(cache_dir, tc.teacher_topk, tc.kl_temperature)
    dev = lambda h: batches.to_device(h, program.eval_batch_sharding)
    kl_full = kl_topk = ntok = 0.0

    worst_steps: dict[tuple[bool, bool], Any] = {}  # built (and compiled) once, on first overflow

    def checked(step: Any, worst_kw: dict[str, bool], *args: Any) -> dict[str, Any]:
        out = jax.device_get(step(*args))
        if out.get("moe_overflow", 0) > 0:  # run again with the worst-case buffers
            key = (worst_kw["with_teacher"], worst_kw["cached_teacher"])
            if key not in worst_steps:
                worst_steps[key] = program.eval_step(**worst_kw, bounded=False)
            out = jax.device_get(worst_steps[key](*args))
        return out

    for i, host in enumerate(evals):
        a = checked(full, {"with_teacher": True, "cached_teacher": False}, models.student_params,
                    models.teacher_params, dev(host))
        b = checked(cached, {"with_teacher": False, "cached_teacher": True}, models.student_params, None,
                    dev({**host, **cache.load(f"eval_{i:04d}", host["input_ids"])}))
        kl_full += float(a["kl_sum"])
        kl_topk += float(b["kl_sum"])
        ntok += float(a["num_tokens"])
    n = max(ntok, 1.0)
    return {"kl_full": kl_full / n, "kl_topk_tail": kl_topk / n, "abs_diff": abs(kl_full - kl_topk) / n,
            "rel_diff": abs(kl_full - kl_topk) / max(kl_full, 1e-12), "tokens": ntok, "k": tc.teacher_topk}
