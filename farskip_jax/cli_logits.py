"""`python -m farskip_jax logits`: an HF DeepSeek-V2 checkpoint on token ids -> float32 logits.

The stable interface other tools rely on:

    python -m farskip_jax logits --checkpoint DIR --input-ids IDS.npy --out LOGITS.npy \
        [--farskip on|off] [--farskip-range START:END] [--farskip-mode both|attn_only|mlp_only] \
        [--dtype float32|bfloat16]

IDS.npy holds integer token ids [batch, seq]; LOGITS.npy receives float32 [batch, seq, vocab].
Every row is one sequence starting at position 0 (no padding mask: pad on the right and ignore
the padded positions' logits).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

DESCRIPTION = """\
Run an HF DeepSeek-V2 checkpoint (config.json + *.safetensors, sharded or not, or
pytorch_model*.bin) on a batch of token ids and write the logits.

Input:  --input-ids IDS.npy, an integer array [batch, seq] (int32 preferred; any integer dtype
        whose values fit is accepted), every id in [0, vocab_size). Each row is one sequence
        starting at position 0; there is no padding mask.
Output: --out LOGITS.npy, float32 [batch, seq, vocab_size] (parent directories are created).

FarSkip connectivity: the defaults come from the checkpoint's config.json keys as Instella-MoE
writes them (farskip, farskip_start_idx, farskip_end_idx, attn_only_farskip, mlp_only_farskip);
absent keys mean regular connectivity. The flags below override them:
  --farskip on|off         turn FarSkip connectivity on or off (off = the regular model, exactly).
  --farskip-range S:E      inclusive layer range of FarSkip layers, e.g. 1:26; either end may be
                           omitted (':10' = layers 0..10, '5:' = 5..last). Implies --farskip on.
  --farskip-mode MODE      both (default: attention reads the stale y stream and the MoE reads the
                           previous layer's output), attn_only or mlp_only.
--farskip on without a range uses config.json's range, else every layer.

Precision: --dtype float32 (default) or bfloat16 (parameters and activations in bf16; the
logits are still written as float32).
"""

EXIT_USAGE = 2


class CliError(Exception):
    """A user-facing error: printed as `error: ...` with exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m farskip_jax logits", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="HF checkpoint directory with config.json and weights")
    p.add_argument("--input-ids", required=True, metavar="IDS.npy",
                   help="integer token ids, shape [batch, seq]")
    p.add_argument("--out", required=True, metavar="LOGITS.npy",
                   help="where to write float32 logits [batch, seq, vocab]")
    p.add_argument("--farskip", choices=("on", "off"), default=None,
                   help="override config.json's FarSkip switch (default: as in config.json)")
    p.add_argument("--farskip-range", default=None, metavar="START:END",
                   help="inclusive FarSkip layer range, e.g. 0:26, ':10', '5:' (implies --farskip on)")
    p.add_argument("--farskip-mode", choices=("both", "attn_only", "mlp_only"), default=None,
                   help="which sub-block reads stale inputs (default: as in config.json, else both)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter and compute dtype (default float32); output is always float32")
    return p


def parse_range(text: str) -> tuple[int | None, int | None]:
    """'3:7' -> (3, 7); ':7' -> (None, 7); '3:' -> (3, None); both ends inclusive."""
    start, sep, end = text.partition(":")
    if not sep:
        raise CliError(f"--farskip-range {text!r}: expected START:END, e.g. 1:26 (inclusive)")
    try:
        lo = int(start) if start.strip() else None
        hi = int(end) if end.strip() else None
    except ValueError:
        raise CliError(f"--farskip-range {text!r}: START and END must be integers, e.g. 1:26") from None
    if (lo is not None and lo < 0) or (hi is not None and hi < 0):
        raise CliError(f"--farskip-range {text!r}: layer indices must be >= 0")
    if lo is not None and hi is not None and lo > hi:
        raise CliError(f"--farskip-range {text!r}: START > END")
    return lo, hi


def farskip_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted ModelConfig overrides from the FarSkip flags (empty: keep config.json's settings)."""
    out: dict[str, Any] = {}
    if args.farskip_range is not None:
        if args.farskip == "off":
            raise CliError("--farskip-range was given with --farskip off; drop one of them")
        lo, hi = parse_range(args.farskip_range)
        out.update({"farskip.enabled": True, "farskip.start_idx": lo, "farskip.end_idx": hi})
    if args.farskip is not None:
        out["farskip.enabled"] = args.farskip == "on"
    if args.farskip_mode is not None:
        out["farskip.attn_only"] = args.farskip_mode == "attn_only"
        out["farskip.mlp_only"] = args.farskip_mode == "mlp_only"
    return out


def load_ids(path: str | Path) -> np.ndarray:
    """Reads and checks IDS.npy: integer dtype, rank 2, non-empty; returns int32."""
    p = Path(path)
    if not p.is_file():
        raise CliError(f"--input-ids {p}: no such file")
    try:
        ids = np.load(p, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file becomes one clear message
        raise CliError(f"--input-ids {p}: not a readable .npy array ({e})") from None
    if not isinstance(ids, np.ndarray):
        raise CliError(f"--input-ids {p}: expected a single .npy array, got {type(ids).__name__}")
    if ids.dtype.kind not in "iu":
        raise CliError(f"--input-ids {p}: dtype {ids.dtype} is not an integer type; save int32 token ids")
    if ids.ndim != 2:
        raise CliError(f"--input-ids {p}: expected rank 2 [batch, seq], got shape {list(ids.shape)}"
                       + (" (use ids[None] for one sequence)" if ids.ndim == 1 else ""))
    if ids.size == 0:
        raise CliError(f"--input-ids {p}: empty array of shape {list(ids.shape)}")
    return ids


def check_vocab(ids: np.ndarray, vocab_size: int, path: str | Path) -> np.ndarray:
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = np.argwhere((ids < 0) | (ids >= vocab_size))[0]
        raise CliError(f"--input-ids {path}: token id {int(ids[tuple(bad)])} at [{bad[0]}, {bad[1]}] is "
                       f"outside the vocabulary [0, {vocab_size}) (min {lo}, max {hi})")
    return ids.astype(np.int32)


def compute_logits(checkpoint: str | Path, ids: np.ndarray, overrides: dict[str, Any]) -> np.ndarray:
    """Loads the checkpoint with `overrides` and returns float32 logits [B, T, V]."""
    import jax
    from flax import nnx

    from farskip_jax.checkpoint.hf_load import from_pretrained

    model = from_pretrained(checkpoint, **overrides)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids):
        return nnx.merge(graphdef, state)(ids).logits

    return np.asarray(jax.device_get(forward(state, ids)), dtype=np.float32)


def run(args: argparse.Namespace) -> np.ndarray:
    from farskip_jax.checkpoint.hf_load import config_from_dir

    overrides = farskip_overrides(args)
    if args.dtype != "float32":
        overrides.update({"param_dtype": args.dtype, "dtype": args.dtype})
    ids = load_ids(args.input_ids)
    cfg = config_from_dir(args.checkpoint, **overrides)  # validates the overrides before loading
    ids = check_vocab(ids, cfg.vocab_size, args.input_ids)
    logits = compute_logits(args.checkpoint, ids, overrides)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, logits)
    fs = cfg.farskip
    layers = list(fs.layer_range(cfg.num_layers))
    mode = "attn_only" if fs.attn_only else "mlp_only" if fs.mlp_only else "both"
    where = f"layers {layers[0]}..{layers[-1]} ({mode})" if layers else "off"
    print(f"wrote {out}: float32 {list(logits.shape)}; farskip {where}; dtype {args.dtype}", file=sys.stderr)
    return logits


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m farskip_jax logits`; returns the exit status."""
    from farskip_jax.checkpoint.hf_io import CheckpointError
    from farskip_jax.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (CliError, CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
