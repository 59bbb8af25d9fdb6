"""`python -m farskip_jax logits`: an HF DeepSeek-V2 checkpoint on token ids -> float32 logits.

The stable interface other tools rely on:

    python -m farskip_jax logits --checkpoint DIR --input-ids IDS.npy --out LOGITS.npy \
        [--farskip on|off] [--farskip-range START:END] [--farskip-mode both|attn_only|mlp_only] \
        [--dtype float32|bfloat16] [--mesh expert=8 | data=2,expert=4 | tensor=8]

IDS.npy holds integer token ids [batch, seq]; LOGITS.npy receives float32 [batch, seq, vocab].
Every row is one sequence starting at position 0 (no padding mask: pad on the right and ignore
the padded positions' logits). `--mesh` runs the same forward sharded (expert or tensor
parallel) and writes the same file; on a CPU-only host the CLI creates the host devices itself.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from farskip_jax.config import MeshConfig, ModelConfig
from farskip_jax.errors import UserError, cli_main
from farskip_jax.xla.flags import detect_local_target

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

Sharded forward: --mesh AXIS=N[,AXIS=N...] with axes data, expert, tensor, e.g.
  --mesh expert=8          expert parallelism: sequences split over 8 devices, routed experts too
  --mesh data=2,expert=4   the same over a 2 x 4 grid (sequences over all 8, experts over 4)
  --mesh tensor=8          tensor parallelism: every device sees the whole batch, attention heads,
                           experts and MLP widths are split (they must be divisible by 8)
tensor cannot be combined with expert or data. The output file is the same as without --mesh.
A batch that data x expert does not divide is padded with token-0 rows, run, and stripped again.
On a CPU-only host the CLI appends --xla_force_host_platform_device_count=N to XLA_FLAGS before
JAX starts its backend, unless XLA_FLAGS or JAX_NUM_CPU_DEVICES already sets a device count.
"""

EXIT_USAGE = 2  # the exit status of a user error (printed by errors.cli_main)
MESH_AXES = ("data", "expert", "tensor")
FORCE_COUNT = "xla_force_host_platform_device_count"


class CliError(UserError):
    """A user-facing error: printed as `error: ...` with exit status 2 (by `cli_main`)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m farskip_jax logits", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="HF checkpoint directory with config.json and weights")
    p.add_argument("--input-ids", required=True, metavar="IDS.npy",
                   help="integer token ids, shape [batch, seq]")
    p.add_argument("--out", required=True, metavar="LOGITS.npy",
                   help="where to write float32 logits [batch, seq, vocab]")
    add_farskip_args(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter and compute dtype (default float32); output is always float32")
    p.add_argument("--mesh", default=None, metavar="AXIS=N[,AXIS=N]",
                   help="run sharded: expert=8, data=2,expert=4 (expert parallel) or tensor=8 (tensor "
                        "parallel); default: one device")
    return p


def add_farskip_args(p: argparse.ArgumentParser) -> None:
    """--farskip, --farskip-range, --farskip-mode (read back by `farskip_overrides`)."""
    p.add_argument("--farskip", choices=("on", "off"), default=None,
                   help="override the checkpoint's FarSkip switch (default: as in its config)")
    p.add_argument("--farskip-range", default=None, metavar="START:END",
                   help="inclusive FarSkip layer range, e.g. 0:26, ':10', '5:' (implies --farskip on)")
    p.add_argument("--farskip-mode", choices=("both", "attn_only", "mlp_only"), default=None,
                   help="which sub-block reads stale inputs (default: as in the config, else both)")


def parse_mesh(text: str) -> MeshConfig:
    """'data=2,expert=4' -> MeshConfig(data=2, expert=4); axes not named are 1."""
    usage = "expected AXIS=N[,AXIS=N] with axes data, expert, tensor, e.g. --mesh expert=8"
    sizes: dict[str, int] = {}
    for part in text.split(","):
        axis, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not axis:
            raise CliError(f"--mesh {text!r}: {usage}")
        if axis not in MESH_AXES:
            raise CliError(f"--mesh {text!r}: unknown axis {axis!r}; {usage}")
        if axis in sizes:
            raise CliError(f"--mesh {text!r}: axis {axis!r} given twice")
        try:
            sizes[axis] = int(value)
        except ValueError:
            raise CliError(f"--mesh {text!r}: size of {axis!r} must be an integer, e.g. {axis}=8") from None
        if sizes[axis] < 1:
            raise CliError(f"--mesh {text!r}: size of {axis!r} must be >= 1")
    mesh = MeshConfig(**sizes)
    if mesh.tensor > 1 and (mesh.expert > 1 or mesh.data > 1):
        # The TP layout splits the experts over `tensor` itself, and its forward replicates the
        # batch over every other axis, so a data axis would only repeat the same work.
        raise CliError(f"--mesh {text!r}: tensor cannot be combined with expert or data; use "
                       f"--mesh tensor={mesh.tensor} (tensor parallel) or --mesh expert=N / data=D,expert=E "
                       "(expert parallel)")
    return mesh


def host_device_flags(needed: int, xla_flags: str, platforms: str | None, accelerator_present: bool,
                      num_cpu_devices: int) -> str | None:
    """The XLA_FLAGS value that gives the CPU backend `needed` devices, or None to leave it alone.

    Only when JAX will run on the CPU (JAX_PLATFORMS names cpu first, or is unset on a host
    without accelerator device nodes) and the user has not chosen a host device count: their own
    XLA_FLAGS count or JAX_NUM_CPU_DEVICES wins, and a shortfall is reported after start-up.
    """
    if needed <= 1 or num_cpu_devices >= 0 or FORCE_COUNT in xla_flags:
        return None
    first = (platforms or "").split(",")[0].strip().lower()
    on_cpu = first == "cpu" if first else not accelerator_present
    if not on_cpu:
        return None
    return f"{xla_flags.strip()} --{FORCE_COUNT}={needed}".strip()


def accelerator_present() -> bool:
    """A GPU or TPU device node exists (read from /dev: no JAX backend is started by asking)."""
    return (detect_local_target() != "local" or bool(glob.glob("/dev/accel*"))
            or bool(glob.glob("/dev/vfio/[0-9]*")))


def provide_host_devices(needed: int) -> None:
    """Appends the host device count to XLA_FLAGS; must run before JAX starts its backend.

    `python -m farskip_jax` has imported jax by now (the package imports it), but XLA reads
    XLA_FLAGS when the first backend is created (the first jax.devices() or array), not at import.
    """
    import jax

    flags = host_device_flags(needed, os.environ.get("XLA_FLAGS", ""),
                              jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS"),
                              accelerator_present(), int(getattr(jax.config, "jax_num_cpu_devices", -1)))
    if flags is not None:
        os.environ["XLA_FLAGS"] = flags


def check_devices(mesh: MeshConfig, text: str) -> None:
    """Enough devices for the mesh, else one line naming the fix (starts the JAX backend)."""
    import jax

    devices = jax.devices()
    if len(devices) >= mesh.num_devices:
        return
    platform = devices[0].platform
    n = mesh.num_devices
    user_count = int(getattr(jax.config, "jax_num_cpu_devices", -1))  # JAX_NUM_CPU_DEVICES or config
    if platform == "cpu" and user_count >= 0:
        fix = f"raise JAX_NUM_CPU_DEVICES (now {user_count}) to {n} or unset it"
    elif platform == "cpu" and FORCE_COUNT in os.environ.get("XLA_FLAGS", ""):
        fix = f"raise --{FORCE_COUNT} in your XLA_FLAGS to {n} or remove it"
    elif platform == "cpu":
        fix = f"start the process with XLA_FLAGS=--{FORCE_COUNT}={n} (JAX had started before --mesh was read)"
    else:
        fix = f"choose a mesh of at most {len(devices)} devices"
    raise CliError(f"--mesh {text}: needs {n} devices, {len(devices)} {platform} device(s) available; {fix}")


def check_layout(cfg: ModelConfig, mesh: MeshConfig, text: str) -> None:
    """The checkpoint's shapes split evenly over the mesh (checked before loading any weight)."""
    if mesh.tensor > 1:
        bad = cfg.tensor_layout_errors(mesh.tensor)
        if bad:
            fit = [t for t in range(1, 2 * mesh.tensor) if not cfg.tensor_layout_errors(t)]
            raise CliError(f"--mesh {text}: tensor={mesh.tensor} does not split the checkpoint's "
                           f"{', '.join(bad)}; tensor sizes that do, up to {2 * mesh.tensor - 1}: "
                           f"{', '.join(map(str, fit))}")
    elif cfg.n_routed_experts % mesh.expert:
        raise CliError(f"--mesh {text}: expert={mesh.expert} does not divide the checkpoint's "
                       f"{cfg.n_routed_experts} routed experts; choose a divisor of {cfg.n_routed_experts}")


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


def pad_rows(ids: np.ndarray, multiple: int) -> np.ndarray:
    """Appends token-0 rows until the batch divides by `multiple`. Rows are independent, so the
    real rows' logits do not change: attention stays inside a row, and routing is dropless or,
    with a capacity factor, limited per sequence (ExecutionConfig.capacity_factor)."""
    pad = -ids.shape[0] % multiple
    return np.concatenate([ids, np.zeros((pad, ids.shape[1]), ids.dtype)]) if pad else ids


def compute_logits(checkpoint: str | Path, ids: np.ndarray, overrides: dict[str, Any],
                   mesh: MeshConfig | None = None) -> np.ndarray:
    """Loads the checkpoint with `overrides` and returns float32 logits [B, T, V].

    With `mesh`: tensor > 1 runs `parallel.tp_forward` (TP layout, batch replicated); otherwise
    `parallel.ep_forward` with the batch split over data x expert (padded, then stripped).
    """
    import jax
    from flax import nnx

    from farskip_jax.checkpoint.hf_load import from_pretrained

    if mesh is None:
        model = from_pretrained(checkpoint, **overrides)
        graphdef, state = nnx.split(model)

        @jax.jit
        def forward(state, ids):
            return nnx.merge(graphdef, state)(ids).logits

        return np.asarray(jax.device_get(forward(state, ids)), dtype=np.float32)

    from farskip_jax.parallel import batch_sharding, ep_forward, make_mesh, place, tp_forward

    jmesh = make_mesh(mesh)
    # Bounded routed-expert buffers first; if they overflowed, the same call with the worst case.
    if mesh.tensor > 1:
        graphdef, state = nnx.split(from_pretrained(checkpoint, **overrides))
        forwards = [tp_forward(graphdef, state, jmesh, bounded=bounded) for bounded in (True, False)]
        placed = place(state, jmesh, "tp")
        del state
        for tp in forwards:
            logits, _, overflow = jax.jit(tp)(placed, ids)
            if not int(overflow):
                break
        return np.asarray(jax.device_get(logits), dtype=np.float32)
    # Loading with the mesh puts each expert stack straight into its shard (no full copy on one device).
    graphdef, state = nnx.split(from_pretrained(checkpoint, mesh=jmesh, **overrides))
    state = place(state, jmesh, "ep")  # every other leaf replicated; a no-op for those already placed
    padded = jax.device_put(pad_rows(ids, mesh.data * mesh.expert), batch_sharding(jmesh))
    for bounded in (True, False):
        ep = ep_forward(graphdef, jmesh, bounded=bounded)
        logits, overflow = jax.jit(
            lambda s, i, ep=ep: (lambda o: (o.logits, o.aux["moe_overflow"]))(ep(s, i)))(
            state, padded)
        if not int(overflow):
            break
    return np.asarray(jax.device_get(logits), dtype=np.float32)[: ids.shape[0]]


def run(args: argparse.Namespace) -> np.ndarray:
    from farskip_jax.checkpoint.hf_load import config_from_dir

    mesh = parse_mesh(args.mesh) if args.mesh is not None else None
    if mesh is not None:
        provide_host_devices(mesh.num_devices)  # before anything below can start the JAX backend
    overrides = farskip_overrides(args)
    if args.dtype != "float32":
        overrides.update({"param_dtype": args.dtype, "dtype": args.dtype})
    if not Path(args.checkpoint).is_dir():
        raise CliError(f"--checkpoint {args.checkpoint}: no such directory (expected an HF checkpoint "
                       "with config.json and weights)")
    ids = load_ids(args.input_ids)
    cfg = config_from_dir(args.checkpoint, **overrides)  # validates the overrides before loading
    ids = check_vocab(ids, cfg.vocab_size, args.input_ids)
    if mesh is not None:
        check_layout(cfg, mesh, args.mesh)
        check_devices(mesh, args.mesh)
    logits = compute_logits(args.checkpoint, ids, overrides, mesh)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, logits)
    fs = cfg.farskip
    layers = list(fs.layer_range(cfg.num_layers))
    mode = "attn_only" if fs.attn_only else "mlp_only" if fs.mlp_only else "both"
    where = f"layers {layers[0]}..{layers[-1]} ({mode})" if layers else "off"
    sharded = ""
    if mesh is not None:
        kind = "tensor parallel" if mesh.tensor > 1 else "expert parallel"
        rows = logits.shape[0]
        padded = rows if mesh.tensor > 1 else rows + -rows % (mesh.data * mesh.expert)
        sharded = f"; mesh {args.mesh} ({kind}, {mesh.num_devices} devices"
        sharded += f", batch padded {rows} -> {padded} and stripped)" if padded != rows else ")"
    print(f"wrote {out}: float32 {list(logits.shape)}; farskip {where}; dtype {args.dtype}{sharded}",
          file=sys.stderr)
    return logits


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m farskip_jax logits`; returns the exit status (2: user error)."""
    from farskip_jax.checkpoint.hf_io import CheckpointError

    args = build_parser().parse_args(argv)
    try:
        run(args)
    except CheckpointError as e:  # a ValueError subclass: make it a one-line user error too
        raise CliError(str(e)) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
