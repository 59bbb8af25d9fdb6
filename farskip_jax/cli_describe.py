"""`python -m farskip_jax describe`: what a checkpoint or config holds, before anything is loaded.

    python -m farskip_jax describe --checkpoint DIR            # HF, converted or training checkpoint
    python -m farskip_jax describe --config dsv2lite_farskip   # a bundled config (its mesh, --set overrides)
    python -m farskip_jax describe --config deepseek_v3 --mesh expert=64 --json

Prints total and active parameters (active: the weights a token's forward multiplies by, i.e. all
but the embedding table, a row lookup, and the routed experts the token is not sent to), the layer
plan (dense or MoE, FarSkip or regular, attention variant), the bytes per device of the weights
(and, for a training config, of the training state) under the mesh, and the HF architecture the
model maps to. Reads config files only: no
weights, no JAX devices.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from farskip_jax.config import Config, ModelConfig
from farskip_jax.errors import UserError, cli_main

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def _parse_mesh(text: str) -> dict[str, int]:
    mesh = {"data": 1, "expert": 1, "tensor": 1}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in mesh or not value.isdigit() or int(value) < 1:
            raise UserError(f"--mesh {text!r}: expected axis=N with axis in data, expert, tensor and N >= 1")
        mesh[key] = int(value)
    return mesh


def model_config_of(path: Path) -> ModelConfig:
    """The model of an HF directory, a converted (Orbax) checkpoint or a training checkpoint step."""
    from farskip_jax import hf_config
    from farskip_jax.checkpoint.orbax_io import is_orbax_checkpoint, is_trainer_step, load_model_config
    from farskip_jax.checkpoint.to_hf import trainer_model_config

    if not path.is_dir():
        raise UserError(f"--checkpoint {path}: no such directory")
    if is_orbax_checkpoint(path):
        return load_model_config(path)
    if is_trainer_step(path):
        return trainer_model_config(path)
    if (path / "config.json").is_file():
        return hf_config.model_config(json.loads((path / "config.json").read_text()))
    raise UserError(f"--checkpoint {path}: neither an HF directory (config.json), a converted checkpoint "
                    "nor a training checkpoint step")


def _is_routed(spec_path: tuple) -> bool:
    return "experts" in spec_path and "shared" not in spec_path


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 4, 5] -> "0-2, 4-5"."""
    parts, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None], strict=True):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


def _layer_plan(cfg: ModelConfig) -> list[dict[str, Any]]:
    """One row per distinct layer description, with the layers that have it ("0-2, 4-6")."""
    farskip = set(cfg.farskip.layer_range(cfg.num_layers))
    kind = "attn_only" if cfg.farskip.attn_only else "mlp_only" if cfg.farskip.mlp_only else "full"
    groups: dict[tuple[str, str, str], list[int]] = {}
    for i in range(cfg.num_layers):
        ffn = (f"MoE {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}"
               + (f" + {cfg.n_shared_experts} shared" if cfg.n_shared_experts else "")
               if cfg.is_moe_layer(i) else "dense MLP")
        attn = "MLA" if cfg.attention_kind == "mla" else f"GQA {cfg.num_heads}/{cfg.kv_heads}"
        attn += "" if cfg.uses_rope(i) else ", NoPE"
        attn += f", chunks of {cfg.attention_chunk_size}" if cfg.chunked_layer(i) else ""
        conn = (f"FarSkip ({kind})" if kind != "full" else "FarSkip") if i in farskip else "regular"
        groups.setdefault((ffn, attn, conn), []).append(i)
    return [{"layers": _ranges(ls), "ffn": ffn, "attention": attn, "connectivity": conn}
            for (ffn, attn, conn), ls in groups.items()]


# Expert ranks per node assumed for `mesh.expert_per_node: auto` (describe sees no devices): the
# 8 GPUs of an H200 or MI300X node.
GPUS_PER_NODE = 8


def train_nodes(train: Config, mesh: dict[str, int]) -> int:
    """Expert ranks per node of the training mesh: mesh.expert_per_node, or GPUS_PER_NODE for auto
    where the expert axis spans whole nodes of them; 0 where it stays on one node."""
    per = train.mesh.expert_per_node
    if per == "auto":
        per = GPUS_PER_NODE if mesh["expert"] > GPUS_PER_NODE and mesh["expert"] % GPUS_PER_NODE == 0 else 0
    return per if 0 < per < mesh["expert"] else 0


def describe(cfg: ModelConfig, mesh: dict[str, int], train: Config | None = None) -> dict[str, Any]:
    """The description as a dict (what `--json` prints)."""
    from farskip_jax import hf_config
    from farskip_jax.checkpoint.hf_keys import param_specs
    from farskip_jax.checkpoint.to_hf import REMOTE_CODE
    from farskip_jax.parallel.mesh import partition_spec

    specs = param_specs(cfg)
    total = sum(math.prod(s.shape) for s in specs)
    routed = sum(math.prod(s.shape) for s in specs if _is_routed(s.path))
    embedding = math.prod(next(s.shape for s in specs if s.path == ("embed",)))
    # a token's forward multiplies by every weight except the embedding table (a row lookup) and the
    # routed experts it is not sent to
    active = total - embedding - routed + routed * cfg.num_experts_per_tok // max(cfg.n_routed_experts, 1)
    layout = "tp" if mesh["tensor"] > 1 else "ep"

    def per_device(spec_path: tuple, shape: tuple[int, ...]) -> float:
        n = math.prod(shape)
        for axes in partition_spec(spec_path, layout):
            for axis in (axes if isinstance(axes, tuple) else (axes,)) if axes else ():
                n /= mesh[axis]
        return n

    weights = sum(per_device(s.path, s.shape) for s in specs)  # elements per device
    hf = hf_config.hf_dict(cfg)
    arch = hf["architectures"][0]
    if hf.get("farskip"):
        arch = f"{REMOTE_CODE[hf['model_type']][1]} (trust_remote_code; stock: {arch})"
    out: dict[str, Any] = {
        "parameters": {"total": total, "active_per_token": active, "embedding": embedding,
                       "routed_experts": routed},
        "layers": _layer_plan(cfg),
        "mesh": mesh, "layout": layout,
        "weights_bytes_per_device": {"param_dtype": weights * DTYPE_BYTES[cfg.param_dtype],
                                     "compute_dtype": weights * DTYPE_BYTES[cfg.dtype]},
        "hf_architecture": arch, "hf_model_type": hf["model_type"],
    }
    if train is not None and layout == "ep":
        # The trainer's state between steps: master weights, AdamW's two fp32 moments, FCSD's frozen
        # teacher in train.teacher_dtype. ZeRO-1 (train/zero1.py) splits the replicated weights'
        # masters and moments over every device; each step gathers the masters in the compute dtype
        # (a temporary of the step, like the activations).
        devices = mesh["data"] * mesh["expert"]
        replicated = sum(per_device(s.path, s.shape) for s in specs if not _is_routed(s.path))
        owned = weights - replicated + (replicated / devices if train.train.zero1 else replicated)
        state = owned * DTYPE_BYTES[cfg.param_dtype] + 2 * 4 * owned
        teacher = ""
        if train.train.mode == "fcsd":
            t_bytes = DTYPE_BYTES[train.train.teacher_dtype]
            from farskip_jax.train.program import teacher_copy_share

            copies = teacher_copy_share(train.mesh.teacher_experts, routed * t_bytes, mesh["expert"],
                                        train_nodes(train, mesh))
            state += (weights + routed * copies) * t_bytes
            teacher = ", FCSD teacher"
            if copies and train.mesh.teacher_experts == "local":
                teacher += " with all of its routed experts on every device"
            elif copies:
                teacher += f" with its routed experts in each node of {train_nodes(train, mesh)} ranks"
            if (train.mesh.teacher_experts == "auto" and mesh["expert"] > 1
                    and train.train.teacher_cache is None):
                # on a GPU the trainer's memory search (train/remat.py) runs this where the step fits
                out["teacher_local_bytes_per_device"] = state + routed * t_bytes * (
                    teacher_copy_share("local", 0, mesh["expert"], 0) - copies)
        out["training_state_bytes_per_device"] = state
        out["training_state_parts"] = "weights, AdamW moments" + teacher
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _print(d: dict[str, Any], source: str) -> None:
    p = d["parameters"]
    print(f"{source}: {d['hf_architecture']} (model_type {d['hf_model_type']})")
    print(f"  parameters: {p['total'] / 1e9:.3f} B total, {p['active_per_token'] / 1e9:.3f} B active per "
          f"token ({(p['active_per_token'] + p['embedding']) / 1e9:.3f} B counting the embedding table, as "
          f"some model cards do); routed experts {p['routed_experts'] / 1e9:.3f} B")
    print("  layers:")
    for row in d["layers"]:
        print(f"    {row['ffn']}; {row['attention']}; {row['connectivity']}: layers {row['layers']}")
    mesh = ", ".join(f"{k}={v}" for k, v in d["mesh"].items() if v > 1) or "one device"
    w = d["weights_bytes_per_device"]
    print(f"  per device ({mesh}, {d['layout']} layout): weights {_gib(w['param_dtype'])} in the parameter "
          f"dtype, {_gib(w['compute_dtype'])} in the compute dtype")
    if "training_state_bytes_per_device" in d:
        print(f"  training state per device ({d['training_state_parts']}; activations not included): "
              f"{_gib(d['training_state_bytes_per_device'])}")
    if "teacher_local_bytes_per_device" in d:
        print(f"    with the teacher's routed experts on every device, which mesh.teacher_experts=auto runs "
              f"where the compiled step fits the memory budget and is estimated faster: "
              f"{_gib(d['teacher_local_bytes_per_device'])}")


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m farskip_jax describe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="HF directory, converted or training checkpoint")
    src.add_argument("--config", help="a config name in configs/ or a YAML path")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (with --config)")
    p.add_argument("--mesh", default=None,
                   help="e.g. expert=8 or tensor=8 (default: the config's mesh; one device for a checkpoint)")
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    args = p.parse_args(argv)
    from farskip_jax.config import load_config, parse_overrides

    train = None
    if args.config is not None:
        train = load_config(args.config, parse_overrides(args.set))
        cfg, source = train.model, f"config {args.config}"
        mesh = {"data": train.mesh.data, "expert": train.mesh.expert, "tensor": train.mesh.tensor}
    else:
        if args.set:
            raise UserError("--set applies to --config only")
        cfg, source = model_config_of(args.checkpoint), str(args.checkpoint)
        mesh = {"data": 1, "expert": 1, "tensor": 1}
    if args.mesh is not None:
        mesh = _parse_mesh(args.mesh)
    if mesh["expert"] > 1 and mesh["tensor"] > 1:
        raise UserError(f"--mesh: expert={mesh['expert']} and tensor={mesh['tensor']}: training is expert "
                        "parallel, inference tensor parallel; describe one layout at a time")
    if cfg.n_routed_experts % mesh["expert"] or cfg.n_routed_experts % mesh["tensor"]:
        raise UserError(f"--mesh: {cfg.n_routed_experts} routed experts do not split over {mesh}")
    d = describe(cfg, mesh, train)
    if args.json:
        json.dump(d, sys.stdout, indent=1)
        print()
    else:
        _print(d, source)
    return 0
