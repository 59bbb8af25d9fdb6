"""HF DeepSeek-V2/V3 / Qwen3-MoE / Llama-4 -> Orbax conversion, streamed one group at a time (reading it
back: `orbax_io`).

Layout of a converted directory (detected by `farskip_checkpoint.json`, marker version 2):

    OUT/farskip_checkpoint.json   marker: format version, dtype, every parameter's path and shape
    OUT/model_config.json         our ModelConfig (FarSkip settings included)
    OUT/config.json               the source's config.json, verbatim
    OUT/params/                   ONE standard Orbax PyTree checkpoint: the parameter pure dict
    OUT/_CHECKPOINT_METADATA, OUT/orbax.checkpoint, OUT/commit_success.txt   Orbax v1 checkpoint files

OUT is a standard Orbax (v1) checkpoint with the single checkpointable "params" - the item name and
layout of a trainer CheckpointManager step - so plain Orbax restores it whole:
`ocp.StandardCheckpointer().restore(OUT/params)`, `ocp.experimental.v1.load(OUT)`, or a Composite
restore of item "params".

Bounded memory: Orbax's one-call `save` needs the whole tree in host memory (the maxtext "1.4 TB to
convert Llama 70B" failure), so the tree is built group by group (the embedding, each layer's
non-expert weights, each layer's stacked routed-expert arrays one at a time, the head) with
`orbax.checkpoint.experimental.v1.partial.save`, and `finalize` merges the per-call OCDBT manifests
into one (no data is copied; `orbax_io.ParamsWriter`). `workers` threads read the next groups from
the safetensors files while Orbax saves one (one save at a time: Orbax's constraint), so host
memory holds workers + 2 groups (`memory_bound`; bench/convert_rss.py checks the peak), whatever
the model size. Leaves are numpy arrays (no JAX device is involved while converting), and routed-expert arrays
are chunked one expert per chunk, so an expert-parallel restore of any EP size that divides E reads
exactly its own experts; `orbax_io.restore_params` restores with `jax.ShapeDtypeStruct` targets
carrying the wanted `NamedSharding`, so each device reads only its slices.

Version-1 directories (one Orbax checkpoint per group under OUT/params/<group>/ plus the marker's
group index) still load everywhere (`from_pretrained`, `load_params`, `--to-hf`).

Writes go to a temporary sibling directory that is renamed into place at the end (`output_dir`,
shared with the export `to_hf`); the marker is the last file written, so an interrupted conversion
never leaves a loadable half checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from farskip_jax import hf_config
from farskip_jax.checkpoint import hf_tokenizer
from farskip_jax.checkpoint.common import (
    bits,
    copy_into,
    nest_set,
    raise_problems,
    release_freed_memory,
    row_ranges,
)
from farskip_jax.checkpoint.hf_io import CheckpointError, TensorSource, np_dtype
from farskip_jax.checkpoint.hf_keys import ParamSpec, hf_key_index, param_specs
from farskip_jax.checkpoint.hf_load import config_from_dir
from farskip_jax.checkpoint.orbax_io import (
    FORMAT,
    MARKER,
    MODEL_CONFIG,
    PARAMS_ITEM,
    VERSION,
    ParamsWriter,
)
from farskip_jax.checkpoint.output_dir import atomic_output_dir, output_errors, pause_for_tests
from farskip_jax.config import ConfigError, ModelConfig, override, to_dict

DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
# Threads reading (HF -> Orbax) or restoring and writing (Orbax -> HF) at once; memory grows with it
# (`memory_bound`), the result does not.
DEFAULT_WORKERS = 2


@dataclasses.dataclass(frozen=True)
class Group:
    """Parameters written by one partial save: the embedding, a layer's non-expert weights, one
    stacked routed-expert array, or the head."""

    name: str
    specs: tuple[ParamSpec, ...]


@dataclasses.dataclass
class Summary:
    tensors: int = 0
    params: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def line(self, verb: str) -> str:
        gbs = self.bytes / max(self.seconds, 1e-9) / 1e9
        return (f"{verb} {self.tensors} tensors, {self.params:,} parameters, {self.bytes / 1e9:.3f} GB in "
                f"{self.seconds:.1f} s ({gbs:.2f} GB/s)")


def group_specs(specs: list[ParamSpec]) -> list[Group]:
    groups: dict[str, list[ParamSpec]] = {}
    for s in specs:
        if s.path[0] == "layers":
            # Each stacked expert array is its own group: Orbax/TensorStore hold about 2 more copies
            # of what one save writes (encode copy, buffered OCDBT data file), so smaller saves
            # keep the peak near 3 x one expert array instead of 3 x a whole layer.
            name = f"layer_{s.path[1]:03d}" + (f"_experts_{s.path[-1]}" if is_stacked(s) else "")
        else:
            name = "embed" if s.path[0] == "embed" else "head"
        groups.setdefault(name, []).append(s)
    return [Group(n, tuple(v)) for n, v in groups.items()]


def is_stacked(spec: ParamSpec) -> bool:
    return len(spec.hf_keys) > 1


def parse_dtype(name: str | None) -> str | None:
    if name is None:
        return None
    if name not in DTYPE_ALIASES:
        raise ConfigError(f"--dtype {name!r}: allowed: bf16, fp32")
    return DTYPE_ALIASES[name]


def parse_mesh(items: list[str] | None) -> dict[str, int]:
    """["expert=8", "data=2"] -> {"expert": 8, "data": 2}."""
    mesh: dict[str, int] = {}
    for item in items or []:
        name, _, size = item.partition("=")
        if not name or not size.isdigit() or int(size) < 1:
            raise ConfigError(f"--mesh {item!r}: expected AXIS=SIZE with SIZE >= 1, e.g. expert=8")
        mesh[name] = int(size)
    return mesh


def farskip_overrides(farskip: str | None, farskip_range: str | None) -> dict[str, Any]:
    """--farskip on|off and --farskip-range START:END (inclusive layer indices, either may be empty)."""
    ov: dict[str, Any] = {}
    if farskip is not None:
        if farskip not in ("on", "off"):
            raise ConfigError(f"--farskip {farskip!r}: allowed: on, off")
        ov["farskip.enabled"] = farskip == "on"
    if farskip_range is not None:
        if farskip == "off":
            raise ConfigError("--farskip-range contradicts --farskip off")
        m = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", farskip_range)
        if not m:
            raise ConfigError(f"--farskip-range {farskip_range!r}: expected START:END, e.g. 1:26")
        ov["farskip.enabled"] = True
        ov["farskip.start_idx"] = int(m.group(1)) if m.group(1) else None
        ov["farskip.end_idx"] = int(m.group(2)) if m.group(2) else None
    return ov


# --------------------------------------------------------------------------------------------
# Validation (everything is checked before anything is written)


def contradiction_errors(source: TensorSource, cfg: ModelConfig) -> list[str]:
    """config.json keys that the tensors contradict; clearer than the missing/unexpected they cause."""
    errs: list[str] = []
    keys = source.keys()
    where = lambda k: f"{source.key_to_file[k].name}: tensor {k!r}"
    for k in keys:
        if re.search(r"\.mlp\.experts\.(gate_up_proj|down_proj)$", k):
            errs.append(f"{where(k)} is transformers' fused in-memory expert layout; write the model with "
                        "save_pretrained() (one tensor per expert) and convert that")
    emb = "model.embed_tokens.weight"
    if emb in source.key_to_file and source.shape(emb) != (cfg.vocab_size, cfg.hidden_size):
        errs.append(f"{where(emb)} has shape {list(source.shape(emb))} but config.json says "
                    f"vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}")
    layer_keys: dict[int, str] = {}
    experts: dict[int, dict[int, str]] = {}
    for k in keys:
        if m := re.match(r"model\.layers\.(\d+)\.", k):
            layer_keys.setdefault(int(m.group(1)), k)
            if e := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.", k):
                experts.setdefault(int(e.group(1)), {}).setdefault(int(e.group(2)), k)
    if layer_keys and max(layer_keys) + 1 != cfg.num_layers:
        top = max(layer_keys)
        errs.append(f"config.json num_hidden_layers={cfg.num_layers} but the checkpoint has tensors for "
                    f"{top + 1} layers ({where(layer_keys[top])})")
    for i, found in sorted(experts.items()):
        example = where(found[max(found)])
        if i < cfg.num_layers and not cfg.is_moe_layer(i):
            errs.append(f"config.json makes layer {i} dense ({_layer_rule(cfg)}) but {example} is a routed "
                        "expert")
        elif len(found) != cfg.n_routed_experts or max(found) + 1 != cfg.n_routed_experts:
            errs.append(f"config.json n_routed_experts={cfg.n_routed_experts} but layer {i} has {len(found)} "
                        f"routed experts (highest index {max(found)}: {example})")
    return errs


def _layer_rule(cfg: ModelConfig) -> str:
    """The config.json keys that decide which layers are dense, as that family names them."""
    if cfg.attention_kind == "gqa":
        return f"decoder_sparse_step={cfg.moe_layer_freq}, mlp_only_layers={list(cfg.mlp_only_layers)}"
    return f"first_k_dense_replace={cfg.first_k_dense_replace}, moe_layer_freq={cfg.moe_layer_freq}"


def source_errors(source: TensorSource, cfg: ModelConfig, specs: list[ParamSpec]) -> list[str]:
    errs = contradiction_errors(source, cfg)
    if errs:
        return errs
    index = hf_key_index(specs)
    have = set(source.keys())
    for k in (k for k in index if k not in have):
        errs.append(f"{source.dir}: missing tensor {k!r} (needed for parameter {index[k][0].name})")
    for k in sorted(have - set(index)):
        errs.append(f"{source.key_to_file[k].name}: unexpected tensor {k!r} (not a parameter of "
                    f"{hf_config.hf_dict(cfg)['architectures'][0]} for this config.json)")
    for k, (spec, _) in index.items():
        if k not in have:
            continue
        shape, dt = source.shape(k), source.dtype_name(k)
        if shape != spec.hf_shape:
            errs.append(f"{source.key_to_file[k].name}: tensor {k!r} has shape {list(shape)}, expected "
                        f"{list(spec.hf_shape)} for the config (parameter {spec.name})")
        if dt not in ("float32", "bfloat16", "float16"):
            errs.append(f"{source.key_to_file[k].name}: tensor {k!r} has dtype {dt}; expected float32, "
                        "bfloat16 or float16")
    return errs


def resolve_dtype(source: TensorSource, specs: list[ParamSpec], requested: str | None) -> str:
    """--dtype, or the source's own dtype when every tensor has the same bf16/fp32 dtype."""
    if requested is not None:
        return requested
    seen: dict[str, str] = {}
    for s in specs:
        for k in s.hf_keys:
            if k not in source.scales:  # FP8 weights go into whatever the rest of the model is stored in
                seen.setdefault(source.dtype_name(k), k)
    if not seen and source.scales:
        return "bfloat16"
    if len(seen) == 1 and next(iter(seen)) in ("float32", "bfloat16"):
        return next(iter(seen))
    found = ", ".join(f"{d} ({source.key_to_file[k].name}: {k!r})" for d, k in seen.items())
    raise CheckpointError(f"{source.dir}: source tensors have dtype(s) {found}; pass --dtype bf16 or fp32")


# --------------------------------------------------------------------------------------------
# Resuming an interrupted conversion (the temp dir, its plan file and the resume rules: `output_dir`)


def conversion_plan(src: Path, source: TensorSource, dtype: str, overrides: dict[str, Any],
                    compress: bool, mesh: dict[str, int]) -> dict:
    """What a conversion writes, as JSON: a resumed run must match it exactly (the same input files,
    byte for byte by size and modification time, and the same settings)."""
    files = sorted({src / "config.json", *source.key_to_file.values()})
    return {"direction": "hf-to-orbax", "version": VERSION, "source": str(src.resolve()), "dtype": dtype,
            "overrides": {k: overrides[k] for k in sorted(overrides)}, "compress": compress, "mesh": mesh,
            "files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}}


def written_paths(tmp: Path) -> set[tuple]:
    """Parameter paths (as strings) already on disk in an interrupted conversion's temp dir; what an
    interrupted save left behind is removed first."""
    ParamsWriter.drop_uncommitted(tmp)
    return ParamsWriter.committed_paths(tmp)


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled,
                dynamic_ncols=True)


# --------------------------------------------------------------------------------------------
# HF -> Orbax


def read_param_as(source: TensorSource, spec: ParamSpec, dtype: np.dtype) -> np.ndarray:
    """One parameter in our layout and `dtype`, C-contiguous (what TensorStore writes without a copy).

    Stacked experts are filled into one preallocated array expert by expert, so at most one HF
    expert tensor is held besides the result. A tensor whose layout is ours or its plain transpose
    (the embedding, the LM head, every linear) is read in row blocks of `BLOCK_BYTES` into the result,
    or is the result itself when it already is in `dtype`: reading never holds a whole second copy.
    """
    if is_stacked(spec):
        out = np.empty(spec.shape, dtype)
        layout = None
        for j, key in enumerate(spec.hf_keys):
            t = source.read(key)
            if layout is None:
                layout = expert_layout(spec, t)
            copy_into(out[j], layout(t))
        return out
    key = spec.hf_keys[0]
    kind = simple_layout(spec)
    if kind == "same" and source.dtype_name(key) == dtype.name and key not in source.scales:
        arr = source.read(key)  # a fresh C-contiguous array: the result, no copy
        if arr.shape != spec.shape:
            raise CheckpointError(f"parameter {spec.name}: built shape {arr.shape} != {spec.shape}")
        return arr
    out = np.empty(spec.shape, dtype)
    if kind is not None and len(spec.hf_shape) == (2 if kind == "T" else len(spec.shape)):
        itemsize = np_dtype(source.dtype_name(key)).itemsize
        for r0, r1 in row_ranges(spec.hf_shape, itemsize, align=source.row_align(key)):
            rows = source.read_rows(key, r0, r1)
            copy_into(out[r0:r1] if kind == "same" else out[:, r0:r1], rows if kind == "same" else rows.T)
        return out
    arr = spec.to_ours([source.read(key)])
    if arr.shape != spec.shape:
        raise CheckpointError(f"parameter {spec.name}: built shape {arr.shape} != {spec.shape}")
    copy_into(out, arr)
    return out


def simple_layout(spec: ParamSpec) -> str | None:
    """"same" when `spec.to_ours` returns the HF tensor itself, "T" when it returns its transpose,
    None for anything else (a reshape into heads, a slice of a fused tensor). Found by calling
    `to_ours` on a 2 x 3 probe: the layout functions are plain lambdas, and the ones with fixed
    head dimensions refuse the probe's shape."""
    probe = np.arange(6, dtype=np.float32).reshape(2, 3)
    try:
        got = spec.to_ours([probe])
    except (ValueError, IndexError, TypeError):
        return None
    if got is probe:
        return "same"
    if isinstance(got, np.ndarray) and got.shape == (3, 2) and np.array_equal(got, probe.T):
        return "T"
    return None


def expert_layout(spec: ParamSpec, t: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """One expert's HF tensor -> its slice of our stacked array. `spec.to_ours` stacks (a copy); when
    it equals the plain transpose for the first expert (every stacked spec today), the transpose
    view is used instead, so `copy_into` makes the only copy."""
    ref = spec.to_ours([t])[0]
    if t.ndim == 2 and ref.shape == t.T.shape and np.array_equal(bits(ref), bits(t).T):
        return lambda x: x.T
    return lambda x: spec.to_ours([x])[0]


def read_group(source: TensorSource, group: Group, dtype: np.dtype) -> tuple[dict, int]:
    """(nested dict of the group's parameters, their bytes)."""
    tree: dict = {}
    nbytes = 0
    for spec in group.specs:
        arr = read_param_as(source, spec, dtype)
        nest_set(tree, spec.path, arr)
        nbytes += arr.nbytes
    return tree, nbytes


def hf_key_label(spec: ParamSpec) -> str:
    if not is_stacked(spec):
        return spec.hf_keys[0]
    return re.sub(r"\.experts\.0\.", f".experts.{{0..{len(spec.hf_keys) - 1}}}.", spec.hf_keys[0])


def mapping_table(specs: list[ParamSpec], src_dtype: Callable[[ParamSpec], str], dtype: str) -> str:
    rows = [("HF key(s)", "HF shape", "our path", "our shape", "dtype", "bytes")]
    for s in specs:
        n = len(s.hf_keys)
        hf_shape = (f"{n} x " if n > 1 else "") + str(list(s.hf_shape))
        nbytes = int(np.prod(s.shape)) * np_dtype(dtype).itemsize
        rows.append((hf_key_label(s), hf_shape, s.name, str(list(s.shape)), f"{src_dtype(s)}->{dtype}",
                     f"{nbytes:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def check_workers(workers: int) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers {workers!r}: expected an integer >= 1 (threads reading and writing "
                          "at once; each holds about one more group in memory)")


def largest_group_bytes(groups: list[Group], itemsize: int) -> int:
    return max(sum(int(np.prod(s.shape)) for s in g.specs) * itemsize for g in groups)


MEMORY_SLACK = 512 * 2**20  # Python objects, TensorStore's caches (100 MB OCDBT cache), thread stacks


def memory_bound(direction: str, largest_group: int, workers: int = DEFAULT_WORKERS,
                 fp8: bool = False) -> int:
    """The most host memory (bytes, on top of the import baseline) a conversion holds, by what it
    holds, independent of the number of layers:

    "to_orbax" (HF -> Orbax): workers + 2 largest groups: `workers` read ahead (or being read), the
    one being saved, and TensorStore's copy of it (a save assembles its data file in memory), plus
    one row block (`common.BLOCK_BYTES`) or one HF expert tensor per reader.
    "to_hf" (Orbax -> HF): 2 x workers + 1 largest groups: at most workers + 1 groups restored or
    with tensors still being written, `workers` of them being restored through TensorStore's read
    buffers (a second copy while restoring), plus one row block per writer (with `fp8`, the
    quantizer's float32 temporaries: about 4 blocks) and its direct-I/O copy buffer.
    Both plus `MEMORY_SLACK`. bench/convert_rss.py measures the peak against it."""
    from farskip_jax.checkpoint import common

    if direction == "to_orbax":
        held = (workers + 2) * largest_group + workers * common.BLOCK_BYTES
    elif direction == "to_hf":
        held = ((2 * workers + 1) * largest_group
                + workers * ((4 if fp8 else 1) * common.BLOCK_BYTES + common.COPY_BYTES))
    else:
        raise ValueError(f"direction {direction!r}: 'to_orbax' or 'to_hf'")
    return held + MEMORY_SLACK


def check_mesh(mesh: dict[str, int], cfg: ModelConfig) -> None:
    ep = mesh.get("expert", 1) * mesh.get("tensor", 1)
    if cfg.n_routed_experts % ep:
        raise ConfigError(f"--mesh {mesh}: expert x tensor = {ep} does not divide n_routed_experts="
                          f"{cfg.n_routed_experts}")


def convert_hf_to_orbax(input_dir: str | Path, output_dir: str | Path, *, dtype: str | None = None,
                        mesh: dict[str, int] | None = None, overrides: dict[str, Any] | None = None,
                        dry_run: bool = False, overwrite: bool = False, progress: bool = True,
                        compress: bool = False, resume: bool = False, workers: int = DEFAULT_WORKERS,
                        log: Callable[[str], None] = print) -> Summary:
    """Validates an HF DeepSeek-V2/V3, Instella-MoE, Qwen3-MoE or Llama-4 directory, then writes it as a
    farskip Orbax checkpoint (DeepSeek-V3's multi-token-prediction layers and Llama-4's vision tower
    are skipped, with a message;
    `compress`: zstd, about 10% smaller for bf16 weights and CPU-bound; `resume`: continue an
    interrupted conversion of the same input with the same settings, skipping the groups it wrote:
    the result is bitwise the uninterrupted one; `workers`: groups read ahead by as many threads,
    see `memory_bound`; the result does not depend on it)."""
    check_workers(workers)
    src, out = Path(input_dir), Path(output_dir)
    base_cfg = config_from_dir(src)
    source = TensorSource(src)
    for msg in (source.skip_mtp_layers(base_cfg.num_layers), source.skip_vision()):
        if msg is not None:
            log(msg)
    specs = param_specs(base_cfg)
    raise_problems(f"HF checkpoint {src}", source_errors(source, base_cfg, specs))
    dtype = resolve_dtype(source, specs, parse_dtype(dtype))
    cfg = override(base_cfg, {**(overrides or {}), "param_dtype": dtype}, "model")
    check_mesh(mesh or {}, cfg)
    raise_problems("the output", output_errors(out, overwrite, [src]))
    groups = group_specs(specs)
    itemsize = np_dtype(dtype).itemsize
    summary = Summary(tensors=len(hf_key_index(specs)),
                      params=sum(int(np.prod(s.shape)) for s in specs))
    total = summary.params * itemsize
    if dry_run:
        _log_dry_run(log, source, specs, groups, cfg, dtype, summary, out)
        return summary
    t0 = time.perf_counter()
    np_dt = np_dtype(dtype)
    plan = conversion_plan(src, source, dtype, overrides or {}, compress, mesh or {})
    with (atomic_output_dir(out, log, plan=plan, resume=resume) as tmp,
          progress_bar(total, "HF -> Orbax", progress) as bar):
        shutil.copyfile(src / "config.json", tmp / "config.json")
        hf_tokenizer.copy_from_hf_dir(src, tmp)  # so that an export back to HF carries them
        (tmp / MODEL_CONFIG).write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
        written = written_paths(tmp)
        todo = [g for g in groups if not all(tuple(map(str, s.path)) in written for s in g.specs)]
        if len(todo) < len(groups):
            done_bytes = total - sum(int(np.prod(s.shape)) * itemsize for g in todo for s in g.specs)
            log(f"resuming {out}: {len(groups) - len(todo)} of {len(groups)} groups "
                f"({done_bytes / 1e9:.3f} GB) already written")
            bar.update(done_bytes)
        # One chunk per expert: an EP restore reads only the experts it owns.
        writer = ParamsWriter(tmp, {s.path for s in specs if is_stacked(s)}, compress=compress)
        _read_and_write_groups(source, todo, np_dt, writer, workers, bar)
        writer.finish()
        marker = {"format": FORMAT, "version": VERSION, "dtype": dtype, "item": PARAMS_ITEM,
                  "params": [{"path": list(s.path), "shape": list(s.shape)} for s in specs],
                  "num_params": summary.params, "bytes": total, "mesh": mesh or {}, "source": str(src),
                  "compressed": compress}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")  # last: marks completion
    summary.bytes, summary.seconds = total, time.perf_counter() - t0
    log(summary.line(f"wrote {out}:"))
    return summary


def _log_dry_run(log: Callable[[str], None], source: TensorSource, specs: list[ParamSpec],
                 groups: list[Group], cfg: ModelConfig, dtype: str, summary: Summary, out: Path) -> None:
    """--dry-run: the mapping table, the FP8 tensors and their blocks, and what would be written."""
    itemsize = np_dtype(dtype).itemsize
    total = summary.params * itemsize
    log(mapping_table(specs, lambda s: ("float8_e4m3fn" if s.hf_keys[0] in source.scales
                                        else source.dtype_name(s.hf_keys[0])), dtype))
    if quantized := source.quantized():
        patterns: dict[str, int] = {}
        for k in quantized:
            pattern = re.sub(r"\.\d+\.", ".*.", re.sub(r"\.\d+\.", ".*.", k))
            patterns[pattern] = patterns.get(pattern, 0) + 1
        log(f"\nFP8: {len(quantized)} block-quantized tensors (float8_e4m3fn, blocks of "
            f"{list(source.fp8_block or ())}, a float32 *_scale_inv per block), dequantized to {dtype} "
            "while streaming:")
        for pattern, n in patterns.items():
            log(f"  {pattern} x {n}")
    log(f"\n{len(groups)} Orbax groups, {summary.tensors} HF tensors -> {len(specs)} parameters, "
        f"{summary.params:,} parameters, {total:,} bytes ({total / 1e9:.3f} GB) to write to {out}")
    largest = largest_group_bytes(groups, itemsize)
    log(f"largest group (bounds host memory): {largest / 1e9:.3f} GB; FarSkip layers: "
        f"{list(cfg.farskip.layer_range(cfg.num_layers))}")


def _read_and_write_groups(source: TensorSource, todo: list[Group], np_dt: np.dtype, writer: ParamsWriter,
                           workers: int, bar: Any) -> None:
    """Streams the groups `todo` from the HF files into `writer`, in order."""
    # `workers` threads read (disk + layout copies) the next groups while Orbax writes one: at
    # most workers + 1 groups in memory. Saves stay one at a time, in group order: Orbax runs
    # one partial save at a time (each stages in the same temporary directory), and a group
    # counts as written (for --resume) once its own save is committed.
    with ThreadPoolExecutor(workers, thread_name_prefix="farskip-read") as pool:
        ahead: collections.deque = collections.deque()
        queue = iter(todo)

        def read_ahead() -> None:
            while len(ahead) < workers and (g := next(queue, None)) is not None:
                ahead.append(pool.submit(read_group, source, g, np_dt))

        read_ahead()
        for gi, group in enumerate(todo):
            tree, nbytes = ahead.popleft().result()
            read_ahead()
            bar.set_postfix_str(f"writing {group.name}")
            writer.add(tree)
            del tree
            release_freed_memory()
            bar.update(nbytes)
            if gi == 0:
                pause_for_tests("group")
