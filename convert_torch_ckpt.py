#!/usr/bin/env python
"""Convert HF DeepSeek-V2/V3 (FP8 included), Instella-MoE, Qwen3-MoE and Llama-4 checkpoints (safetensors or
pytorch_model*.bin) to Orbax and back."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from farskip_jax.errors import UserError, cli_main, storage_refusal

DEFAULT_WORKERS = 2  # farskip_jax.checkpoint.convert.DEFAULT_WORKERS; imported late there (jax)

EPILOG = """\
examples:
  # HF -> Orbax, bf16, layout hint for 8-way expert parallelism, FarSkip on layers 1..26
  python convert_torch_ckpt.py --input DeepSeek-V2-Lite --output ckpt/dsv2lite \\
      --dtype bf16 --mesh expert=8 --farskip on --farskip-range 1:26
  # show the HF key -> parameter table and the bytes to be written, write nothing
  python convert_torch_ckpt.py --input DeepSeek-V2-Lite --output ckpt/dsv2lite --dry-run
  # the same command after a kill or Ctrl-C: continue from the last group written
  python convert_torch_ckpt.py --input DeepSeek-V2-Lite --output ckpt/dsv2lite --dtype bf16 --resume
  # Orbax (converted, or a training step RUN_DIR/checkpoints/STEP) -> HF safetensors
  python convert_torch_ckpt.py --to-hf --input runs/x/checkpoints/5000 --output hf_out
  # ... in DeepSeek-V3's published FP8 layout (128 x 128 blocks, float32 scales)
  python convert_torch_ckpt.py --to-hf --fp8 --input runs/x/checkpoints/5000 --output hf_fp8

The Orbax directory (marker farskip_checkpoint.json) loads with farskip_jax.from_pretrained(DIR)
or from_pretrained(DIR, mesh=mesh) straight into expert-sharded arrays; it is one standard Orbax
checkpoint (item DIR/params), so orbax.checkpoint.StandardCheckpointer().restore(DIR/params) reads it
without this package. Everything is validated
before anything is written; output goes to a temp dir renamed into place at the end.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True,
                   help="HF directory (config.json + weights); with --to-hf an Orbax directory written by "
                        "this tool or a training checkpoint step directory (items params/, meta/)")
    p.add_argument("--output", required=True,
                   help="directory to create (refused if non-empty without --overwrite)")
    p.add_argument("--to-hf", action="store_true", help="convert Orbax -> HF safetensors instead")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="stored dtype (default: the input's dtype; required when the input is fp16 or mixed)")
    p.add_argument("--mesh", nargs="*", metavar="AXIS=SIZE", default=None,
                   help="target mesh, e.g. expert=8: checked against n_routed_experts and recorded as a hint "
                        "(expert arrays are always chunked per expert, so any EP size restores)")
    p.add_argument("--farskip", choices=["on", "off"], default=None,
                   help="set FarSkip connectivity in the written config (default: from config.json)")
    p.add_argument("--farskip-range", metavar="START:END", default=None,
                   help="inclusive FarSkip layer range, e.g. 1:26 (either side may be empty); implies "
                        "--farskip on")
    p.add_argument("--compress", action="store_true",
                   help="zstd-compress the Orbax arrays (10-20%% smaller for bf16 weights; CPU-bound, "
                        "so slower than the disk on few cores)")
    p.add_argument("--max-shard-size", default="5GB", help="with --to-hf: shard size limit (default 5GB)")
    p.add_argument("--fp8", action="store_true",
                   help="with --to-hf: write DeepSeek-V3's published FP8 layout: attention and MLP/expert "
                        "weights as float8_e4m3fn with a float32 <name>_scale_inv per block (the blocks of "
                        "the HF checkpoint the input was converted from, else 128 x 128), embeddings, LM "
                        "head, norms and router in --dtype. Weights converted from FP8 and kept in fp32 "
                        "are written back bitwise")
    p.add_argument("--dry-run", action="store_true",
                   help="validate, print the HF key -> parameter mapping and the bytes to write, write "
                        "nothing")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted (killed, Ctrl-C) conversion to --output from the last "
                        "group (with --to-hf: shard) it finished, refused if the input files or "
                        "settings changed; the result is bitwise that of an uninterrupted run. Without "
                        "it, an interrupted conversion's temp dir is removed and everything is written "
                        "again")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS, metavar="N",
                   help="threads reading ahead (and with --to-hf: restoring and writing tensors) at once, "
                        f"default {DEFAULT_WORKERS}; host memory grows by about one largest group per "
                        "worker (docs/checkpoints-and-families.md), the output does not change")
    p.add_argument("--buffered-writes", action="store_true",
                   help="with --to-hf: write the shards through the page cache; by default they are "
                        "written with direct I/O (O_DIRECT) where the file system takes it, which spares "
                        "the CPU the page cache's copies (BENCHMARKS.md section 5); the files are the same")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    """Checkpoint and argument problems (CheckpointError is a UserError) end as `error: ...` on
    stderr with exit status 2 (`cli_main`), as do writes the output's storage refuses."""
    args = build_parser().parse_args(argv)
    try:
        return _convert(args)
    except OSError as e:
        if (reason := storage_refusal(e)) is None:
            raise
        # os.write names no file: then the output (its temp dir beside it was being written)
        raise UserError(reason if e.filename else f"writing {args.output}: {reason}") from e


def _convert(args: argparse.Namespace) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # conversion needs no accelerator
    from farskip_jax.checkpoint.convert import convert_hf_to_orbax, farskip_overrides, parse_mesh
    from farskip_jax.checkpoint.to_hf import convert_orbax_to_hf

    if not Path(args.input).exists():
        raise UserError(f"--input {args.input}: no such directory; pass an HF checkpoint directory (or, with "
                        "--to-hf, a converted or training checkpoint directory)")
    overrides = farskip_overrides(args.farskip, args.farskip_range)
    common = dict(dtype=args.dtype, overrides=overrides, dry_run=args.dry_run, overwrite=args.overwrite,
                  progress=not args.no_progress, workers=args.workers)
    if args.to_hf:
        if args.mesh or args.compress:
            raise UserError("--mesh and --compress apply to HF -> Orbax only; drop them with --to-hf")
        convert_orbax_to_hf(args.input, args.output, max_shard_size=args.max_shard_size, resume=args.resume,
                            fp8=args.fp8, direct_io=not args.buffered_writes, **common)
    else:
        if args.buffered_writes:
            raise UserError("--buffered-writes applies to --to-hf only: Orbax writes its own files "
                            "(through TensorStore, buffered)")
        if args.fp8:
            raise UserError("--fp8 applies to --to-hf; an FP8 HF checkpoint is dequantized on the way in "
                            "by itself (config.json quantization_config)")
        convert_hf_to_orbax(args.input, args.output, mesh=parse_mesh(args.mesh), compress=args.compress,
                            resume=args.resume, **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
