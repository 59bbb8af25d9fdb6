"""Sort-based MoE dispatch: ragged_dot vs padded grouped GEMM, on CPU and in deviceless GPU compiles.

Part 1, CPU wall time of one MoE layer (router, routed experts, shared expert), forward +
backward, one device, fp32, at --tokens/--d/--f/--experts/--top-k: median of --reps runs after
a warm-up, and XLA's memory_analysis temp bytes. Rows: expert_matmul ragged and padded, dropless
and with capacity_factor 1.25, and the deleted first-come-first-served path (a one-hot
[N*K, E] cumsum for the slots, a scatter into an [E, N, D] dropless buffer) for reference.
Part 2, deviceless compile of one EP=8 MoE layer at DSV2-Lite widths (d=2048, F=1408, 64
experts top-6, 2 shared, 4096 tokens per device, bf16), forward + backward (parameter and input
gradients), for H200 and MI300X: dot TFLOPs per device in the scheduled HLO, the inspector's
roofline compute estimate (farskip_jax.inspect.hlo.analyze: `est_compute_us`, dots at peak
FLOP/s, other ops at HBM bandwidth), bytes of the all-to-alls (a ragged one counts its whole
receive buffer) and memory_analysis temp bytes. Each compile runs in a fresh subprocess: the
ROCm plugin must be enabled before JAX starts. MI300X ragged is also compiled with
xla_gpu_experimental_use_ragged_dot_grouped_gemm=true, to see whether XLA emits a grouped-GEMM
custom call instead of dense dots.

Not a test:  python bench/dispatch_bench.py [--skip-cpu] [--skip-device] [--targets h200,mi300x]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

GROUPED_GEMM_FLAG = "xla_gpu_experimental_use_ragged_dot_grouped_gemm"
GiB = 2**30


def fcfs_routed(x_nd, routing, experts, cfg, exe):
    """The deleted path, for reference: first-come-first-served slots from a one-hot cumsum."""
    import jax
    import jax.numpy as jnp

    n, k = routing.experts_nk.shape
    e, d = cfg.n_routed_experts, x_nd.shape[-1]
    ids = routing.experts_nk
    onehot = jax.nn.one_hot(ids.reshape(-1), e, dtype=jnp.int32)  # [N*K, E]
    slot = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, ids.reshape(-1, 1), axis=1).reshape(n, k)
    buf = jnp.zeros((e, n, d), x_nd.dtype).at[ids, slot].set(jnp.broadcast_to(x_nd[:, None], (n, k, d)))
    w = experts
    gate, up = jnp.einsum("ecd,edf->ecf", buf, w.w_gate[...]), jnp.einsum("ecd,edf->ecf", buf, w.w_up[...])
    h = jax.nn.silu(gate) * up
    out = jnp.einsum("ecf,efd->ecd", h, w.w_down[...])
    return jnp.einsum("nkd,nk->nd", out[ids, slot], routing.weights_nk), jnp.zeros(())


def cpu_rows(args: argparse.Namespace) -> list[dict]:

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from farskip_jax.config import ExecutionConfig, ModelConfig
    from farskip_jax.model.moe import MoE, local_routed

    base = ModelConfig(hidden_size=args.d, moe_intermediate_size=args.f, n_routed_experts=args.experts,
                       num_experts_per_tok=args.top_k, n_shared_experts=1)
    x = jax.random.normal(jax.random.key(0), (1, args.tokens, args.d))
    variants = [("ragged", 0.0, local_routed), ("padded", 0.0, local_routed), ("ragged", 1.25, local_routed),
                ("padded", 1.25, local_routed), ("old FCFS one-hot", 0.0, fcfs_routed)]
    wanted = args.cpu_variants.split(",") if args.cpu_variants else None
    rows = []
    for name, cf, routed_fn in variants:
        if wanted and name.split()[0] not in wanted:
            continue
        exe = ExecutionConfig(capacity_factor=cf, expert_matmul="padded" if "old" in name else name)
        graphdef, state = nnx.split(MoE(base, nnx.Rngs(0), exe=exe))

        def loss(s, x, graphdef=graphdef, routed_fn=routed_fn):
            shared, routed, _ = nnx.merge(graphdef, s)(x, routed_fn)
            return jnp.mean((shared + routed) ** 2)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile()
        jax.block_until_ready(compiled(state, x))
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(state, x))
            times.append(time.perf_counter() - t0)
        rows.append({"variant": name, "capacity_factor": cf, "ms": 1e3 * float(np.median(times)),
                     "temp_GiB": compiled.memory_analysis().temp_size_in_bytes / GiB})
        print(f"  cpu {name} cf={cf}: {rows[-1]['ms']:.0f} ms", file=sys.stderr, flush=True)
    return rows


def device_worker(target: str, matmul: str, grouped_gemm: bool, tokens: int) -> dict:
    """One deviceless compile (run in a fresh process); returns its numbers as a dict."""
    if target == "mi300x":
        from farskip_jax.xla import rocm_standins

        rocm_standins.enable()
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from farskip_jax.config import ExecutionConfig, ModelConfig
    from farskip_jax.inspect import hlo
    from farskip_jax.model.moe import MoE
    from farskip_jax.parallel import ExpertParallel, resolve_exchange
    from farskip_jax.parallel.mesh import BATCH_AXES
    from farskip_jax.xla import aot, costs, hlo_parse
    from farskip_jax.xla import flags as xla_flags

    mesh = aot.make_target_mesh(target, {"data": 1, "expert": 8, "tensor": 1})
    cfg = ModelConfig(dtype="bfloat16", param_dtype="bfloat16")  # DSV2-Lite widths
    exe = ExecutionConfig(expert_matmul=matmul)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, nnx.Rngs(0), exe=exe)))

    def abstract(path, leaf):
        spec = P("expert") if "experts" in jax.tree_util.keystr(path) else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    state = jax.tree_util.tree_map_with_path(abstract, state)
    x = jax.ShapeDtypeStruct((8, tokens, cfg.hidden_size), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(BATCH_AXES)))  # one sequence per device
    par = ExpertParallel(mesh)

    def loss(s, x):
        shared, routed, _ = nnx.merge(graphdef, s)(x, par.routed_fn)
        return jnp.mean((shared + routed).astype(jnp.float32) ** 2)

    opts = dict(xla_flags.compiler_options_for(target))
    if grouped_gemm:
        opts[GROUPED_GEMM_FLAG] = True
    t0 = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile(compiler_options=opts)
    seconds = time.perf_counter() - t0
    text = compiled.as_text()
    analysis = hlo.analyze(text, target)
    mod = hlo_parse.parse_hlo(text)
    custom_calls: Counter[str] = Counter()
    dots = 0
    for comp in mod.computations.values():
        for ins in comp.instrs:
            target_match = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
            if ins.opcode == "custom-call" and target_match:
                custom_calls[target_match.group(1)] += 1
            dots += ins.opcode == "dot"
    entry = mod.computations[mod.entry]
    flops = sum(costs.instr_flops(mod, entry, ins) for ins in entry.instrs)
    a2a = [c for c in analysis.collectives if "all-to-all" in c.kind]
    return {"target": target, "matmul": matmul, "exchange": resolve_exchange(exe.ep_exchange, mesh),
            "grouped_gemm_flag": grouped_gemm, "compile_s": seconds, "dot_tflops": flops / 1e12,
            "est_compute_ms": analysis.totals["est_compute_us"] / 1e3,
            "a2a_GiB": sum(c.bytes for c in a2a) / GiB, "a2a_kinds": sorted({c.kind for c in a2a}),
            "temp_GiB": compiled.memory_analysis().temp_size_in_bytes / GiB, "dots": dots,
            "custom_calls": [f"{name} x{n}" for name, n in sorted(custom_calls.items())]}


def device_rows(args: argparse.Namespace) -> list[dict]:
    cases = [(t, m, False) for t in args.targets.split(",") for m in ("ragged", "padded")]
    if "mi300x" in args.targets:
        cases.append(("mi300x", "ragged", True))
    rows = []
    for target, matmul, gg in cases:
        cmd = [sys.executable, __file__, "--worker", target, matmul,
               "--device-tokens", str(args.device_tokens)]
        if gg:
            cmd.append("--grouped-gemm")
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            err = (proc.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"target": target, "matmul": matmul, "grouped_gemm_flag": gg, "error": err[:200]})
        else:
            rows.append(json.loads(lines[-1]))
        print(f"  {target} {matmul} gg={gg}: {rows[-1].get('error', 'ok')}", file=sys.stderr, flush=True)
    return rows


def print_tables(cpu: list[dict], dev: list[dict], args: argparse.Namespace) -> None:
    if cpu:
        print(f"\nCPU, one MoE layer forward+backward, {args.tokens} tokens, d={args.d}, F={args.f}, "
              f"{args.experts} experts top-{args.top_k}, fp32 (median of {args.reps})\n")
        print("| variant | capacity_factor | ms | temp GiB |\n|---|---|---|---|")
        for r in cpu:
            print(f"| {r['variant']} | {r['capacity_factor']} | {r['ms']:.0f} | {r['temp_GiB']:.3f} |")
    if dev:
        print(f"\nDeviceless EP=8 MoE layer forward+backward, DSV2-Lite widths, {args.device_tokens} tokens "
              "per device, bf16 (per device)\n")
        print("| target | expert_matmul | exchange | grouped-GEMM flag | dot TFLOP | est. compute ms | "
              "all-to-all GiB | temp GiB | dot ops | custom calls |\n" + "|---" * 10 + "|")
        for r in dev:
            if "error" in r:
                print(f"| {r['target']} | {r['matmul']} | | {r['grouped_gemm_flag']} | error: {r['error']} |"
                      " | | | | |")
                continue
            print(f"| {r['target']} | {r['matmul']} | {r['exchange']} | {r['grouped_gemm_flag']} | "
                  f"{r['dot_tflops']:.2f} | {r['est_compute_ms']:.2f} | {r['a2a_GiB']:.2f} | "
                  f"{r['temp_GiB']:.2f} | "
                  f"{r['dots']} | {', '.join(r['custom_calls']) or '-'} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--f", type=int, default=128)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--cpu-variants", default="", help="comma list of ragged, padded, old (default: all)")
    p.add_argument("--device-tokens", type=int, default=4096)
    p.add_argument("--targets", default="h200,mi300x")
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--skip-device", action="store_true")
    p.add_argument("--worker", nargs=2, metavar=("TARGET", "MATMUL"), help=argparse.SUPPRESS)
    p.add_argument("--grouped-gemm", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(device_worker(*args.worker, args.grouped_gemm, args.device_tokens)))
        return
    cpu = [] if args.skip_cpu else cpu_rows(args)
    dev = [] if args.skip_device else device_rows(args)
    print_tables(cpu, dev, args)


if __name__ == "__main__":
    main()
