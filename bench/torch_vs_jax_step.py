"""Side-by-side CPU train step: HF transformers DeepseekV2ForCausalLM (PyTorch eager) vs ours.

Both sides train the same model on the same batch in one run, one after the other:

- torch: `transformers.DeepseekV2ForCausalLM` in eager mode (no torch.compile) with HF's default
  kernels (printed: attention and experts implementation), cross-entropy over every position,
  `clip_grad_norm_`, `torch.optim.AdamW(fused=True)` with weight decay on matrices only;
- ours: the trainer's jitted step (`farskip_jax.train.step.make_train_step`, `lm` mode) with the
  trainer's optax AdamW (`farskip_jax.train.optim.make_optimizer`: the same clip, betas, eps, decay
  mask), one device, fp32, regular connectivity, the model loaded from the torch model's weights
  with `farskip_jax.from_pretrained` (so both first-step losses must agree).

Model: DeepSeek-V2-Lite widths (configs/dsv2lite.yaml: hidden 2048, 16 heads, kv_lora 512,
qk_nope 128, qk_rope 64, v 128, 64 routed experts top-6, 2 shared, moe_intermediate 1408,
intermediate 10944, first_k_dense_replace 1) with 2 layers (1 dense + 1 MoE), fp32, and the
vocabulary reduced from 102400 to --vocab (default 8192, the same for both): at full size the
embedding and LM head would be 420M of the 1.1B parameters (6.7 GB with grads and AdamW moments
per framework on a 23 GB machine shared with other jobs), and their GEMMs are plain dense matmuls
that say nothing about either MoE implementation.

torch's intra-op threads are set to the cores this process may run on, which is also the size of
XLA's CPU thread pool. Warm-up steps (compile included) are excluded; the table gives the median
of the timed steps. The machine's load average is printed before and after: on a shared machine
the absolute numbers move, the ratio less so.

--profile adds, for ours, the XLA CPU thunk times of one traced step (jax.profiler) summed per
model part (the `jax.named_scope`s of the model: attention, router, routed experts, ...),
forward vs backward, next to the FLOPs XLA's cost analysis counts for the same parts.

    .venv/bin/python bench/torch_vs_jax_step.py [--batch 1] [--seq 256] [--steps 5] [--warmup 2] [--profile]
    ... --variant expert_matmul=ragged     one more row for ours with that ExecutionConfig override
    ... --only ours --set expert_matmul=padded --profile     ours alone, overridden
    ... --config tiny --vocab 128 --seq 32 --steps 1 --warmup 1     a smoke run (seconds)

User and system CPU seconds per step are printed next to the wall clock: on a machine shared with
other jobs the wall clock mostly measures the share of the cores each side got, CPU time the work.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import glob  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM  # noqa: E402

from farskip_jax import (
    from_pretrained,  # noqa: E402
    hf_config,
)
from farskip_jax.config import ExecutionConfig, ModelConfig, TrainConfig, load_config, override  # noqa: E402
from farskip_jax.train.optim import lr_schedule, make_optimizer  # noqa: E402
from farskip_jax.train.step import LossSpec, make_train_step  # noqa: E402

INIT_STD = 0.02  # DeepSeek-V2's initializer_range: router logits of order 1, so routing spreads


@dataclasses.dataclass
class Result:
    name: str
    step_s: list[float]  # timed steps only
    usage: dict[str, list[float]]  # per timed step: user / system CPU seconds, minor page faults
    first_s: float  # the first step (torch: allocator warm-up; ours: includes the compile)
    loss0: float  # loss of the first step, before any update
    loss_last: float  # loss of the last timed step: both sides apply the same updates
    tokens: int

    @property
    def median(self) -> float:
        return statistics.median(self.step_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median


def model_config(name: str, vocab: int, layers: int) -> ModelConfig:
    """configs/<name>.yaml (dsv2lite) with fewer layers and vocabulary, fp32, regular (ours runs it
    with `ExecutionConfig()`'s defaults, no remat, plus --set / --variant)."""
    cfg = load_config(name, {"model.num_layers": layers, "model.vocab_size": vocab,
                             "model.dtype": "float32", "model.param_dtype": "float32"}).model
    return dataclasses.replace(cfg, farskip=dataclasses.replace(cfg.farskip, enabled=False))


def build_torch_model(cfg: ModelConfig, seed: int) -> DeepseekV2ForCausalLM:
    """HF's model from our config's HF dict; every matrix N(0, 0.02^2) (router included), norms 1."""
    # No special tokens: DSV2's ids (100000, 100001) lie outside the reduced vocabulary, and
    # training on raw ids needs none.
    hf_cfg = DeepseekV2Config(**{**hf_config.hf_dict(cfg), "bos_token_id": None, "eos_token_id": None})
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(hf_cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * INIT_STD)
    return model.train()


def token_batch(vocab: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """[batch, seq + 1] ids: inputs are [:, :-1], next-token targets [:, 1:] (as the data pipeline)."""
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq + 1), dtype=np.int32)


def timed_loop(step: Callable[[], float], warmup: int, steps: int,
               label: str) -> tuple[list[float], float, list[float], dict[str, list[float]]]:
    """Runs warmup + steps calls of `step` (which returns the loss and waits for it); returns
    (losses, first step seconds, timed step seconds, rusage deltas of the timed steps).

    System CPU time and minor page faults per step are what fresh multi-GB buffers cost: every
    first touch of a page is a kernel fault (slow on a VM whose host backs memory lazily)."""
    times, losses = [], []
    usage: dict[str, list[float]] = collections.defaultdict(list)
    for i in range(warmup + steps):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        if i >= warmup:
            usage["user"].append(r1.ru_utime - r0.ru_utime)
            usage["sys"].append(r1.ru_stime - r0.ru_stime)
            usage["faults"].append(r1.ru_minflt - r0.ru_minflt)
        print(f"  {label} step {i}{' (warm-up)' if i < warmup else ''}: {times[-1]:.2f} s  "
              f"loss {losses[-1]:.5f}  user {r1.ru_utime - r0.ru_utime:.1f} s  "
              f"sys {r1.ru_stime - r0.ru_stime:.1f} s  {r1.ru_minflt - r0.ru_minflt} page faults", flush=True)
    return losses, times[0], times[warmup:], usage


def run_torch(model: DeepseekV2ForCausalLM, tc: TrainConfig, ids: np.ndarray, warmup: int,
              steps: int) -> Result:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=float(lr_schedule(tc)(0)), betas=(tc.adam_b1, tc.adam_b2), eps=1e-8,
                            fused=True)
    inputs = torch.as_tensor(ids[:, :-1], dtype=torch.long)
    targets = torch.as_tensor(ids[:, 1:], dtype=torch.long)
    params = list(model.parameters())

    phases: dict[str, list[float]] = collections.defaultdict(list)  # eager CPU torch: ops are synchronous

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 targets.reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, tc.grad_clip_norm)
        opt.step()
        t3 = time.perf_counter()
        for name, dt in (("forward", t1 - t0), ("backward", t2 - t1), ("clip + AdamW", t3 - t2)):
            phases[name].append(dt)
        return float(loss.detach())

    losses, first, times, usage = timed_loop(step, warmup, steps, "torch")
    print("  torch phases (median of the timed steps): " + ", ".join(
        f"{k} {statistics.median(v[warmup:]):.2f} s" for k, v in phases.items()), flush=True)
    return Result("torch", times, usage, first, losses[0], losses[-1], inputs.numel())


def jax_state_and_step(ckpt_dir: Path, tc: TrainConfig,
                       overrides: dict[str, Any]) -> tuple[Any, Any, ModelConfig, ExecutionConfig]:
    """Our model from the torch weights, run as the ExecutionConfig `overrides` say, the trainer's
    optimizer state and its jitted step."""
    model = from_pretrained(ckpt_dir, exe=override(ExecutionConfig(), overrides, "execution"))
    cfg, exe = model.cfg, model.exe
    graphdef, params = nnx.split(model, nnx.Param)
    del model
    tx = make_optimizer(tc, params)
    state = {"params": params, "opt_state": jax.jit(tx.init)(params), "step": jnp.zeros((), jnp.int32),
             "skipped": jnp.zeros((), jnp.int32)}
    step = make_train_step(LossSpec.from_train(tc, cached_teacher=False), graphdef, None, tx, lr_schedule(tc))
    return state, step, cfg, exe


def jax_batch(ids: np.ndarray) -> dict[str, jax.Array]:
    """The trainer's batch layout [A=1 micro-batch, B, T]; every token counts (lm mode)."""
    b, t = ids.shape[0], ids.shape[1] - 1
    inputs = jnp.asarray(ids[None, :, :-1])
    return {"input_ids": inputs, "targets": jnp.asarray(ids[None, :, 1:]),
            "loss_mask": jnp.ones((1, b, t), jnp.int32), "segment_ids": jnp.ones((1, b, t), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (1, b, t))}


def run_jax(state: Any, step_fn: Any, ids: np.ndarray, warmup: int,
            steps: int) -> tuple[Result, Any, Callable[[], float]]:
    """Compiles and times our step; returns the result, the compiled step and one more step."""
    batch = jax_batch(ids)
    one, zero = jnp.ones((), jnp.float32), jnp.zeros((), jnp.float32)
    box = {"state": state}
    t0 = time.perf_counter()
    compiled = step_fn.lower(box["state"], None, batch, one, zero).compile()
    compile_s = time.perf_counter() - t0
    print(f"  ours: compile {compile_s:.1f} s", flush=True)

    def step() -> float:
        box["state"], m = compiled(box["state"], None, batch, one, zero)
        return float(m["loss"])

    losses, first, times, usage = timed_loop(step, warmup, steps, "ours")
    tokens = int(np.prod(batch["input_ids"].shape))
    res = Result("ours", times, usage, first + compile_s, losses[0], losses[-1], tokens)
    return res, compiled, step


# --------------------------------------------------------------------------------------------
# Profile of our step: XLA CPU thunk time and XLA-counted FLOPs per model part

# First match wins; op_name paths look like jit(step)/while/body/.../layer_1/.../experts/dot_general.
PARTS = [("routed experts", "/experts"), ("router", "/router"), ("shared experts", "/shared"),
         ("dense MLP", "/mlp"), ("attention", "/attention")]
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")  # a computation's header line
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\(")  # name = type opcode(
# Thunks that only run other thunks (their time would be counted twice).
CONTROL_FLOW = {"while", "conditional", "call", "async-start", "async-done"}


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction -> jax op_name (its named-scope path). A fusion without metadata of its own
    takes the most common op_name inside its fused computation."""
    own: dict[str, str] = {}
    calls: dict[str, str] = {}
    inside: dict[str, list[str]] = collections.defaultdict(list)
    comp = ""
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            head = _COMP.match(line)
            comp = head.group(1) if head else comp
            continue
        name = m.group(1)
        c = re.search(r"calls=%?([\w.\-]+)", line)
        o = re.search(r'op_name="([^"]*)"', line)
        if c:
            calls[name] = c.group(1)
        if o:
            own[name] = o.group(1)
            inside[comp].append(o.group(1))
    out = dict(own)
    for name, callee in calls.items():
        if name not in out and inside.get(callee):
            out[name] = collections.Counter(inside[callee]).most_common(1)[0][0]
    return out


def part_of(op_name: str) -> tuple[str, str]:
    """(model part, 'fwd' | 'bwd') of an op_name; backward ops carry transpose(...) in their path."""
    direction = "bwd" if "transpose(" in op_name else "fwd"
    for part, key in PARTS:
        if key in op_name:
            return part, direction
    if "jvp(" in op_name or "transpose(" in op_name:
        return "embedding, norms, residuals, loss", direction
    if "/while/body/" in op_name:  # in the micro-batch scan, outside the differentiated loss: g_acc + g
        return "scan body outside the loss (grad accumulation)", "-"
    return "optimizer (clip, AdamW, update)", "-"


def opcodes(hlo_text: str) -> dict[str, str]:
    return {m.group(1): m.group(3) for m in map(_INSTR.match, hlo_text.splitlines()) if m}


def profile_step(compiled: Any, run_once: Callable[[], float],
                 out_dir: Path) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    """Seconds of XLA thunk execution per (part, direction) and per HLO op over one traced step."""
    with jax.profiler.trace(str(out_dir)):
        run_once()
    files = sorted(glob.glob(str(out_dir / "**" / "*.xplane.pb"), recursive=True))
    data = jax.profiler.ProfileData.from_file(files[-1])
    text = compiled.as_text()
    names, ops = op_names(text), opcodes(text)
    totals: dict[tuple[str, str], float] = collections.defaultdict(float)
    per_op: dict[str, float] = collections.defaultdict(float)
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                hlo_op = stats.get("hlo_op")
                if hlo_op is None or not str(stats.get("hlo_module", "")).startswith("jit_step"):
                    continue
                if ops.get(str(hlo_op)) in CONTROL_FLOW:
                    continue
                totals[part_of(names.get(str(hlo_op), ""))] += ev.duration_ns * 1e-9
                per_op[str(hlo_op)] += ev.duration_ns * 1e-9
    return totals, per_op


def print_top_ops(compiled: Any, per_op: dict[str, float], n: int) -> None:
    """The `n` HLO ops with the most thunk time: what exactly a part's time is spent on."""
    text = compiled.as_text()
    names = op_names(text)
    lines = {m.group(1): (m.group(3), m.group(2)) for m in map(_INSTR.match, text.splitlines()) if m}
    print(f"\nOurs, the {n} HLO ops with the most thunk time in that step\n")
    print("| s | HLO op | opcode | result | part | jax op_name (end) |")
    print("|---|---|---|---|---|---|")
    for op, sec in sorted(per_op.items(), key=lambda kv: -kv[1])[:n]:
        opcode, result = lines.get(op, ("?", "?"))
        part, direction = part_of(names.get(op, ""))
        print(f"| {sec:.2f} | {op} | {opcode} | {result[:40]} | {part} {direction} | "
              f"{names.get(op, '')[-70:]} |")


def flops_by_part(compiled: Any) -> dict[tuple[str, str], float]:
    """XLA's FLOP count of every dot/convolution in the optimized HLO, grouped like the profile."""
    text = compiled.as_text()
    names = op_names(text)
    shapes: dict[str, list[int]] = {}
    totals: dict[tuple[str, str], float] = collections.defaultdict(float)
    dims = lambda s: [int(x) for x in s.split(",") if x]
    for line in text.splitlines():
        m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*f32\[([\d,]*)\]", line)
        if not m:
            continue
        shapes[m.group(1)] = dims(m.group(2))
        d = re.search(r"\sdot\((.*?)\), .*lhs_contracting_dims=\{([\d,]*)\}", line)
        if not d:
            continue
        # The lhs operand is printed either with its type (f32[a,b]{1,0} %x) or by name only.
        typed = re.match(r"\s*f32\[([\d,]*)\]", d.group(1))
        lhs = dims(typed.group(1)) if typed else shapes.get(d.group(1).split(",")[0].strip().lstrip("%"))
        if lhs is None:
            continue
        contract = int(np.prod([lhs[int(i)] for i in d.group(2).split(",") if i]))
        totals[part_of(names.get(m.group(1), ""))] += 2.0 * float(np.prod(shapes[m.group(1)])) * contract
    return totals


def active_flops(cfg: ModelConfig, tokens: int, seq: int) -> dict[str, float]:
    """Matmul FLOPs of one train step that the model needs (forward x 3 for fwd + bwd), per part:
    routed experts counted for the top-k experts each token is sent to (what HF's loop runs)."""
    d, h = cfg.hidden_size, cfg.num_heads
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    attn_w = d * h * qk + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) \
        + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + v) + h * v * d
    attn_scores = seq * h * (qk + v) / 2  # causal half of QK^T and PV per token
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    dense_layers = cfg.num_layers - moe_layers
    per_token = {
        "attention": cfg.num_layers * (attn_w + attn_scores),
        "dense MLP": dense_layers * 3 * d * cfg.intermediate_size,
        "routed experts": moe_layers * cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size,
        "shared experts": moe_layers * 3 * d * cfg.moe_intermediate_size * cfg.n_shared_experts,
        "router": moe_layers * d * cfg.n_routed_experts,
        "embedding, norms, residuals, loss": d * cfg.vocab_size,  # the LM head
    }
    return {k: 6.0 * v * tokens for k, v in per_token.items()}


def print_profile(times: dict[tuple[str, str], float], flops: dict[tuple[str, str], float],
                  needed: dict[str, float], wall: float) -> None:
    print("\nOurs, one traced step: XLA CPU thunk time per model part (thunks may overlap, so the sum "
          f"can exceed the step's {wall:.2f} s wall time) and matmul GFLOPs\n")
    print("| part | fwd s | bwd s | total s | share | XLA GFLOP (fwd+bwd) | needed GFLOP | XLA / needed |")
    print("|---|---|---|---|---|---|---|---|")
    parts = [p for p, _ in PARTS] + ["embedding, norms, residuals, loss",
                                     "scan body outside the loss (grad accumulation)",
                                     "optimizer (clip, AdamW, update)"]
    grand = sum(times.values())
    for part in parts:
        f, b, o = (times.get((part, k), 0.0) for k in ("fwd", "bwd", "-"))
        tot = f + b + o
        xla = sum(v for (p, _), v in flops.items() if p == part) / 1e9
        need = needed.get(part, 0.0) / 1e9
        ratio = f"{xla / need:.1f}x" if need else ""
        print(f"| {part} | {f:.2f} | {b:.2f} | {tot:.2f} | {100 * tot / grand:.0f}% | {xla:.1f} | "
              f"{need:.1f} | {ratio} |")
    print(f"| all | | | {grand:.2f} | 100% | {sum(flops.values()) / 1e9:.1f} | "
          f"{sum(needed.values()) / 1e9:.1f} | |")


def parse_sets(items: list[str]) -> dict[str, Any]:
    """['expert_matmul=padded', 'capacity_factor=1.25'] -> typed dotted ExecutionConfig overrides."""
    return {k.strip(): yaml.safe_load(v) for k, _, v in (o.partition("=") for o in items)}


def load_line() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="dsv2lite", help="model widths (tiny: a seconds-long smoke run)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=5, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side (compile included)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="per-part time and FLOPs of our step")
    p.add_argument("--top", type=int, default=15, help="with --profile: list this many costliest HLO ops")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an ExecutionConfig override for ours only, e.g. expert_matmul=padded")
    p.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="one more row for ours with these overrides, e.g. expert_matmul=padded")
    p.add_argument("--only", choices=("torch", "ours"), default=None, help="run one side only")
    args = p.parse_args()

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    cfg = model_config(args.config, args.vocab, args.layers)
    # No warm-up ramp (it would start ours at lr 0): both sides update at the same ~constant rate,
    # so the last losses agree too.
    tc = dataclasses.replace(TrainConfig(), mode="lm", warmup_steps=0, total_steps=10**6)
    ids = token_batch(cfg.vocab_size, args.batch, args.seq, args.seed)
    print(f"before: {load_line()}")
    print(f"jax {jax.__version__} ({jax.devices()[0].platform}, XLA CPU pool = {threads} cores), "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads)")

    overrides = parse_sets(args.overrides)
    tmp = Path(tempfile.mkdtemp(prefix="torch_vs_jax_"))
    results: list[tuple[str, Result]] = []
    try:
        model = build_torch_model(cfg, args.seed)
        n_params = sum(p.numel() for p in model.parameters())
        impl = (f"attention={model.config._attn_implementation}, "
                f"experts={getattr(model.config, '_experts_implementation', 'n/a')}")
        print(f"model: configs/{args.config}.yaml widths, {cfg.num_layers} layers, vocab {cfg.vocab_size}, "
              f"{n_params / 1e6:.0f}M params, batch {args.batch} x {args.seq} tokens, fp32; HF {impl}")
        if args.only != "torch":
            model.save_pretrained(tmp / "ckpt")  # ours loads exactly these weights
        if args.only != "ours":
            print("torch (HF eager):", flush=True)
            results.append((f"HF torch eager ({impl}, fused AdamW)", run_torch(model, tc, ids, args.warmup,
                                                                                args.steps)))
        del model
        gc.collect()

        # Ours as configured (--set), then one row per --variant, one after the other (memory).
        variants = [overrides] + [{**overrides, **parse_sets(v.split(","))} for v in args.variant]
        for i, ov in enumerate(variants if args.only != "torch" else []):
            state, step_fn, jcfg, jexe = jax_state_and_step(tmp / "ckpt", tc, ov)
            knobs = (f"attention={jexe.attention}, expert_matmul={jexe.expert_matmul}, "
                     f"capacity_factor={jexe.capacity_factor}")
            print(f"ours: {knobs} (capacity 0 = dropless)", flush=True)
            jax_res, compiled, one_step = run_jax(state, step_fn, ids, args.warmup, args.steps)
            results.append((f"ours (jax.jit trainer step, optax AdamW; {knobs})", jax_res))
            if args.profile and i == 0:
                t0 = time.perf_counter()
                times, per_op = profile_step(compiled, one_step, tmp / "profile")
                wall = time.perf_counter() - t0
                needed = active_flops(jcfg, ids[:, :-1].size, args.seq)
                print_profile(times, flops_by_part(compiled), needed, wall)
                print_top_ops(compiled, per_op, args.top)
                print(f"\nafter profile: {load_line()}\n")
            del state, step_fn, compiled, one_step
            gc.collect()

        print(f"\nafter: {load_line()}\n")
        print(f"Train step, CPU, {threads} threads each, {args.config} widths x {cfg.num_layers} layers, "
              f"vocab {cfg.vocab_size}, {args.batch} x {args.seq} tokens, fp32, AdamW; "
              f"median of {args.steps} steps after {args.warmup} warm-up\n")
        print("| implementation | step (median) | min | max | tokens/s | user CPU | sys CPU | page faults | "
              "first step (ours: + compile) | loss step 0 | last loss |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for label, r in results:
            med = {k: statistics.median(v) for k, v in r.usage.items()}
            print(f"| {label} | {r.median:.2f} s | {min(r.step_s):.2f} s | {max(r.step_s):.2f} s | "
                  f"{r.tokens_per_s:.1f} | {med['user']:.1f} s | {med['sys']:.1f} s | {med['faults']:.0f} | "
                  f"{r.first_s:.1f} s | {r.loss0:.5f} | {r.loss_last:.5f} |")
        if args.only is None:
            (_, t), *ours = results
            cpu = lambda r: statistics.median(a + b for a, b in zip(r.usage["user"], r.usage["sys"],
                                                                    strict=True))
            for n, (_, o) in enumerate(ours):
                # Tokens per wall second, and tokens per CPU second (user + sys): the load-robust one.
                print(f"| ours{f' variant {n}' if n else ''} / torch | | | | "
                      f"{o.tokens_per_s / t.tokens_per_s:.2f}x | "
                      f"{cpu(t) / max(cpu(o), 1e-6):.2f}x per CPU-s | | | | "
                      f"diff {abs(o.loss0 - t.loss0):.1e} | diff {abs(o.loss_last - t.loss_last):.1e} |")

    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
