"""Measured train-step time on the local accelerator against the inspector's roofline estimate.

Runs the trainer's own jitted step (forward + backward + AdamW, `lm` loss) on one device for a
config (usually DSV2-Lite with fewer layers so it fits one GPU), prints tokens/s, peak memory,
and the estimate that `farskip_jax.inspect.hlo` makes from the same compiled HLO, so the
estimate model can be checked against a real clock.

    python bench/gpu_step.py --config dsv2lite_farskip --set model.num_layers=4 --batch 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from farskip_jax.config import load_config, parse_overrides
from farskip_jax.inspect import hlo
from farskip_jax.inspect.steps import config_for
from farskip_jax.model.transformer import Transformer
from farskip_jax.train import remat
from farskip_jax.train.optim import lr_schedule, make_optimizer
from farskip_jax.train.program import BATCH_FIELDS
from farskip_jax.train.step import LossSpec, make_train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="dsv2lite_farskip")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--modes", default="farskip,regular")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--target", default="h200", help="hardware table for the estimate")
    p.add_argument("--out", default=None, help="write results as JSON here")
    args = p.parse_args()
    # --batch sequences on one GPU: split only when asked (configs/dsv2lite.yaml splits 4 in two)
    cfg = load_config(args.config, parse_overrides(["execution.batch_split=1", *args.overrides]))
    tc = dataclasses.replace(cfg.train, mode="lm")
    results = []
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    for mode in args.modes.split(","):
        run = config_for(cfg, mode)
        mcfg, exe = run.model, run.execution

        def model(mcfg=mcfg, exe=exe):
            return Transformer(mcfg, nnx.Rngs(0), exe)

        params = jax.jit(lambda model=model: nnx.split(model(), nnx.Param)[1])()
        tx = make_optimizer(tc, params)
        state = {"params": params, "opt_state": jax.jit(tx.init)(params), "step": jnp.zeros((), jnp.int32),
                 "skipped": jnp.zeros((), jnp.int32)}

        def step_for(policy: str, mcfg=mcfg, exe=exe, tx=tx):
            graphdef, _ = nnx.split(nnx.eval_shape(
                lambda: Transformer(mcfg, nnx.Rngs(0), dataclasses.replace(exe, remat=policy))), nnx.Param)
            return make_train_step(LossSpec.from_train(tc, False), graphdef, None, tx, lr_schedule(tc))

        key = jax.random.key(0)
        ids = jax.random.randint(key, (1, args.batch, args.seq_len), 0, mcfg.vocab_size, jnp.int32)
        batch = {k: ids for k in BATCH_FIELDS}
        batch["loss_mask"] = jnp.ones_like(ids)
        batch["segment_ids"] = jnp.ones_like(ids)
        batch["positions"] = jnp.broadcast_to(jnp.arange(args.seq_len, dtype=jnp.int32), ids.shape)
        one, zero = jnp.ones((), jnp.float32), jnp.zeros((), jnp.float32)
        t0 = time.perf_counter()

        def compile_peak(policy: str, step_for=step_for, step_args=(state, None, batch, one, zero)):
            exe_ = step_for(policy).lower(*step_args).compile()
            return exe_, remat.compiled_peak(exe_)

        # execution.remat as train.py settles it (auto: the first policy that fits, train/remat.py)
        choice = remat.choose(remat.candidates(exe.remat, expert_parallel=False), compile_peak,
                              remat.device_budget(exe))
        compiled = choice.compiled if choice.compiled is not None else compile_peak(choice.policy)[0]
        compile_s = time.perf_counter() - t0
        print(f"{mode}: execution.remat={exe.remat}: {choice.describe()}")
        est = hlo.analyze(compiled.as_text(), args.target)
        state, m = compiled(state, None, batch, one, zero)
        jax.block_until_ready(m["loss"])
        t0 = time.perf_counter()
        for _ in range(args.steps):
            state, m = compiled(state, None, batch, one, zero)
        jax.block_until_ready(m["loss"])
        dt = (time.perf_counter() - t0) / args.steps
        stats = jax.devices()[0].memory_stats() or {}
        tokens = args.batch * args.seq_len
        row = {"mode": mode, "remat": choice.policy, "step_ms": 1e3 * dt, "tokens_per_s": tokens / dt,
               "estimated_step_ms": est.totals["est_step_us"] / 1e3,
               "estimated_compute_ms": est.totals["est_compute_us"] / 1e3,
               "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
               "compile_s": compile_s, "loss": float(m["loss"])}
        results.append(row)
        print(json.dumps(row))
        del state, compiled
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": cfg.name, "overrides": args.overrides, "batch": args.batch,
                       "seq_len": args.seq_len, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
