"""Expert/tensor-parallel regression bench on 8 host (CPU) devices: step time, compile time, memory.

For each model (configs/tiny.yaml, and a DeepSeek-V2-Lite-shaped model reduced to run on a CPU:
fewer layers, shorter sequences, smaller vocabulary; widths, heads, experts, top-k, capacity
factor as in configs/dsv2lite.yaml) it prints:

- forward step time on one device vs EP=8 (expert parallelism over 8 host devices). CPU
  collectives are synchronous and the 8 "devices" share the host's cores: these numbers are for
  spotting regressions only, not for speed-up claims;
- compile time of the EP=8 forward+backward (`value_and_grad`), layers unrolled vs
  `layer_loop="scan"` (scan stacks the layer weights inside the step: a measurement option),
  on CPU and, when the CUDA plugin is installed, deviceless for 8 H200s;
- per-device memory of parameters and AdamW state (train.optim.make_optimizer: two fp32 moments
  per parameter) in the EP=8 layout, from the shardings (nothing allocated), also for the full
  27-layer DeepSeek-V2-Lite.

    .venv/bin/python bench/parallel_bench.py [--models tiny,dsv2lite] [--no-h200]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    _flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["XLA_FLAGS"] = _flags.strip()

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from farskip_jax.config import ExecutionConfig, MeshConfig, ModelConfig, TrainConfig, load_config  # noqa: E402
from farskip_jax.model.transformer import Transformer, build_model, with_farskip  # noqa: E402
from farskip_jax.parallel import ExpertParallel, batch_sharding, make_mesh, param_shardings, place  # noqa: E402
from farskip_jax.train.optim import make_optimizer  # noqa: E402

# DeepSeek-V2-Lite reduced for a CPU: 3 layers (1 dense + 2 MoE instead of 1 + 26), vocabulary
# 8192 (instead of 102400), fp32 compute; batch 8 x 128 tokens per step (1 sequence per device).
DSV2LITE_REDUCED = {"model.num_layers": 3, "model.vocab_size": 8192, "model.dtype": "float32",
                    "execution.remat": "none"}
SHAPES = {"tiny": (8, 32), "dsv2lite": (8, 128)}


def model_cfg(name: str) -> tuple[ModelConfig, ExecutionConfig]:
    """(the config's model with FarSkip on, how the config runs it)."""
    overrides = DSV2LITE_REDUCED if name == "dsv2lite" else {}
    cfg = load_config(name, overrides)
    return with_farskip(cfg.model, enabled=True), cfg.execution


def _gib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def per_device_bytes(tree: Any, shardings: Any) -> int:
    """Bytes one device holds for `tree` (abstract arrays) under `shardings` (the largest shard)."""
    total = 0
    for leaf, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        total += math.prod(sh.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    return total


def memory_row(cfg: ModelConfig, mesh: Any) -> tuple[int, int, int, int]:
    """(params total, params per device, AdamW state total, AdamW per device), EP layout."""
    params = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)
    p_sh = param_shardings(params, mesh, "ep")
    opt = jax.eval_shape(make_optimizer(TrainConfig(), params).init, params)
    by_shape = {tuple(x.shape): s for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(p_sh), strict=True)
                if s.spec != P()}
    o_sh = jax.tree.map(lambda x: by_shape.get(tuple(x.shape), NamedSharding(mesh, P())), opt)
    full = NamedSharding(mesh, P())
    return (per_device_bytes(params, jax.tree.map(lambda _: full, params)), per_device_bytes(params, p_sh),
            per_device_bytes(opt, jax.tree.map(lambda _: full, opt)), per_device_bytes(opt, o_sh))


def timed(fn: Any, *args: Any, reps: int = 3) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / reps


def step_times(cfg: ModelConfig, exe: ExecutionConfig, batch: int, seq: int) -> tuple[float, float]:
    """Forward time on one device and under EP=8 (same parameters, same tokens)."""
    mesh = make_mesh(MeshConfig(expert=8))
    graphdef, state = nnx.split(build_model(cfg, exe=exe), nnx.Param)
    ids = jax.random.randint(jax.random.key(0), (batch, seq), 0, cfg.vocab_size)
    single = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i).logits)
    t_single = timed(single, state, ids)
    par = ExpertParallel(mesh)
    placed = place(state, mesh, "ep")
    del state
    sharded = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i, parallel=par).logits)
    t_ep = timed(sharded, placed, jax.device_put(ids, batch_sharding(mesh)))
    return t_single, t_ep


def train_fn(graphdef: nnx.GraphDef, mesh: Any, layer_loop: str) -> Any:
    par = ExpertParallel(mesh)

    def loss(s, ids):
        out = nnx.merge(graphdef, s)(ids, parallel=par, layer_loop=layer_loop)
        return jnp.mean(out.logits.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss))


def compile_seconds(cfg: ModelConfig, exe: ExecutionConfig, mesh: Any, batch: int, seq: int,
                    layer_loop: str) -> float:
    """Lower + compile time of the EP forward+backward on abstract, sharded arguments."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), exe)), nnx.Param)
    sh = param_shardings(params, mesh, "ep")
    args = (jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, sh),
            jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=batch_sharding(mesh)))
    fn = train_fn(graphdef, mesh, layer_loop)
    if mesh.devices.flat[0].platform == "cpu":
        t0 = time.perf_counter()
        fn.lower(*args).compile()
        return time.perf_counter() - t0
    from farskip_jax.xla.aot import compile_scheduled_hlo

    try:
        art = compile_scheduled_hlo(fn, *args, target="h200")
    except jax.errors.JaxRuntimeError as e:
        # XLA 0.10.2's Triton GEMM tiler rejects some of tiny's dots ("Couldn't find output tile
        # sizes"); retry without Triton GEMMs and say so in the table (negative time).
        print(f"(H200 compile of {cfg.num_layers}L/{layer_loop} failed: {str(e).splitlines()[0][:90]}; "
              "retrying with xla_gpu_enable_triton_gemm=false)")
        art = compile_scheduled_hlo(fn, *args, target="h200",
                                    compiler_options={"xla_gpu_enable_triton_gemm": False})
        return -(art.lower_seconds + art.compile_seconds)
    return art.lower_seconds + art.compile_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,dsv2lite")
    ap.add_argument("--no-h200", action="store_true", help="skip the deviceless H200 compiles")
    args = ap.parse_args()
    cpu_mesh = make_mesh(MeshConfig(expert=8))
    h200_mesh = None
    if not args.no_h200:
        try:
            from farskip_jax.xla.aot import make_target_mesh

            h200_mesh = make_target_mesh("h200", {"data": 1, "expert": 8, "tensor": 1})
        except Exception as e:  # noqa: BLE001 - the plugin is optional
            print(f"(no deviceless H200 compile: {e})")
    rows = []
    for name in args.models.split(","):
        cfg, exe = model_cfg(name)
        batch, seq = SHAPES[name]
        t_single, t_ep = step_times(cfg, exe, batch, seq)
        c = {loop: compile_seconds(cfg, exe, cpu_mesh, batch, seq, loop) for loop in ("unrolled", "scan")}
        h = ({loop: compile_seconds(cfg, exe, h200_mesh, batch, seq, loop) for loop in ("unrolled", "scan")}
             if h200_mesh is not None else {})
        mem = memory_row(cfg, cpu_mesh)
        rows.append((f"{name} ({cfg.num_layers}L, {batch}x{seq} tok)", t_single, t_ep, c, h, mem))
        print(f"done {name}", flush=True)
    full = load_config("dsv2lite").model
    full_mem = memory_row(full, cpu_mesh)

    print("\nFarSkip connectivity, EP=8 on 8 host devices (CPU: for regressions only)\n")
    print("| model | fwd 1 dev | fwd EP=8 | compile fwd+bwd EP=8 CPU unrolled / scan | "
          "H200 deviceless unrolled / scan | params/dev (total) | AdamW/dev (total) |")
    print("|---|---|---|---|---|---|---|")
    for label, ts, te, c, h, (pt, pd, ot, od) in rows:
        hs = " / ".join(f"{abs(v):.1f} s" + ("*" if v < 0 else "") for v in h.values()) if h else "n/a"
        cs = f"{c['unrolled']:.1f} s / {c['scan']:.1f} s"
        print(f"| {label} | {ts * 1e3:.1f} ms | {te * 1e3:.1f} ms | {cs} | {hs} | "
              f"{_gib(pd)} ({_gib(pt)}) | {_gib(od)} ({_gib(ot)}) |")
    pt, pd, ot, od = full_mem
    print(f"| dsv2lite full (27L), memory only | | | | | {_gib(pd)} ({_gib(pt)}) | {_gib(od)} ({_gib(ot)}) |")
    print("(* = compiled with xla_gpu_enable_triton_gemm=false after the default compile failed)")


if __name__ == "__main__":
    main()
