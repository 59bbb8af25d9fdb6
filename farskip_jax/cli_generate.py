"""`python -m farskip_jax generate`: text or token generation from an HF or Orbax checkpoint.

The stable interface other tools rely on:

    python -m farskip_jax generate --checkpoint DIR \
        {--prompt TEXT | --prompt-file PROMPTS.jsonl | --prompt-ids IDS.npy} --max-new-tokens N \
        [--temperature T --top-p P --seed S] [--farskip on|off] [--farskip-range A:B] \
        [--dtype float32|bfloat16] [--mesh tensor=8] [--out OUT.npy | OUT.jsonl]

IDS.npy: int32 [batch, P], each row one prompt right-padded with -1. OUT.npy: int32
[batch, P + N], each row the prompt without its padding, then its new tokens (up to and including
EOS), right-padded with -1. OUT.jsonl: one {"prompt", "completion"} object per row.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from farskip_jax import distributed
from farskip_jax.cli_logits import (
    CliError,
    add_farskip_args,
    check_devices,
    check_layout,
    farskip_overrides,
    parse_mesh,
    provide_host_devices,
)
from farskip_jax.config import ExecutionConfig
from farskip_jax.errors import cli_main, jsonl_values
from farskip_jax.xla.flags import apply_default_xla_flags, detect_local_target

DESCRIPTION = """\
Generate from a DeepSeek-V2 checkpoint (an HF directory, or an Orbax directory written by
convert_torch_ckpt.py): one prefill of the prompts, then one decode step per token over the
MLA latent cache. Greedy unless --temperature > 0. Every row stops at an EOS id
(generation_config.json / config.json, or --eos-id).

Prompts (one of):
  --prompt TEXT            one prompt; the checkpoint's chat template wraps it as a user turn
                           when tokenizer_config.json has one (--no-chat-template: raw text)
  --prompt-file F.jsonl    one prompt per line: {"prompt": TEXT} or {"messages": [{role, content}]}
  --prompt-ids IDS.npy     int32 [batch, P], each row right-padded with -1 (no tokenizer needed)
Text prompts need a tokenizer: tokenizer.json in the checkpoint directory, or --tokenizer.

Output: the new text streams to stdout for a single prompt; a batch is printed row by row when it
is done (token ids when there is no tokenizer). --out OUT.npy writes int32 [batch, P + N] (each
row: prompt without padding, new tokens, -1 padding, also after EOS); --out OUT.jsonl writes one
{"prompt", "completion"} object per row.

FarSkip: as the checkpoint's config says (Instella-MoE keys), or --farskip / --farskip-range /
--farskip-mode. At decode FarSkip works as in prefill: attention reads the stream without the
previous layer's routed output, whose psum only the next layer's MoE input waits for.
--mesh tensor=N runs tensor parallel (heads and experts split, latent cache replicated).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m farskip_jax generate", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="HF or converted Orbax directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="one text prompt")
    src.add_argument("--prompt-file", metavar="JSONL", help='{"prompt": ...} or {"messages": [...]} per line')
    src.add_argument("--prompt-ids", metavar="IDS.npy", help="int32 [batch, P], rows right-padded with -1")
    p.add_argument("--max-new-tokens", type=int, required=True, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--eos-id", type=int, action="append", default=None, metavar="ID",
                   help="stop token id (repeatable; default: the checkpoint's eos_token_id)")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json (default: CHECKPOINT/tokenizer.json)")
    p.add_argument("--no-chat-template", action="store_true", help="tokenize text prompts as they are")
    add_farskip_args(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter, activation and cache dtype (default float32)")
    p.add_argument("--mesh", default=None, metavar="tensor=N", help="tensor parallel over N devices")
    p.add_argument("--out", default=None, metavar="OUT.npy|OUT.jsonl", help="also write the results")
    distributed.add_distributed_args(p)
    return p


# --------------------------------------------------------------------------------------------
# Checkpoint side: config, EOS ids, tokenizer, chat template


def checkpoint_config(path: Path, overrides: dict[str, Any]):
    from farskip_jax.checkpoint import orbax_io
    from farskip_jax.checkpoint.hf_load import config_from_dir

    if orbax_io.is_orbax_checkpoint(path):
        return orbax_io.load_model_config(path, **overrides)
    return config_from_dir(path, **overrides)


def checkpoint_eos_ids(path: Path) -> list[int]:
    """eos_token_id from generation_config.json, else config.json (an int or a list)."""
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def _token_text(value: Any) -> str:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    return value.get("content", "") if isinstance(value, dict) else (value or "")


class TextCodec:
    """A tokenizers.Tokenizer plus the checkpoint's chat template (Jinja, rendered sandboxed)."""

    def __init__(self, tokenizer_path: Path, use_template: bool):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tokenizer_path))
        self.template, self.specials = None, {}
        cfg_file = tokenizer_path.parent / "tokenizer_config.json"
        if use_template and cfg_file.is_file():
            tc = json.loads(cfg_file.read_text())
            template = tc.get("chat_template")
            if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
                template = next((t["template"] for t in template if t.get("name") == "default"), None)
            if template:
                from jinja2.sandbox import ImmutableSandboxedEnvironment

                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = _raise_template_error
                self.template = env.from_string(template)
                self.specials = {k: _token_text(tc.get(k)) for k in ("bos_token", "eos_token")}

    def encode(self, prompt: str | list[dict[str, str]]) -> list[int]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if self.template is not None:
            text = self.template.render(messages=messages, add_generation_prompt=True, **self.specials)
            return self.tok.encode(text, add_special_tokens=False).ids
        if not isinstance(prompt, str):
            raise CliError("a {\"messages\": ...} prompt needs a chat template (tokenizer_config.json)")
        return self.tok.encode(prompt).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def _raise_template_error(message: str) -> None:
    raise CliError(f"chat template: {message}")


def read_prompt_file(path: Path) -> list[str | list[dict[str, str]]]:
    if not path.is_file():
        raise CliError(f"--prompt-file {path}: no such file")
    prompts: list[str | list[dict[str, str]]] = []
    for n, rec in jsonl_values(path, f"--prompt-file {path}"):
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            prompts.append(rec["prompt"])
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            prompts.append(rec["messages"])
        else:
            raise CliError(f'--prompt-file {path}:{n}: expected {{"prompt": TEXT}} or {{"messages": [...]}}')
    if not prompts:
        raise CliError(f"--prompt-file {path}: no prompts")
    return prompts


def load_prompt_ids(path: Path, vocab: int) -> np.ndarray:
    from farskip_jax.generation import PAD, prompt_lengths

    if not path.is_file():
        raise CliError(f"--prompt-ids {path}: no such file")
    try:
        ids = np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file becomes one clear message
        raise CliError(f"--prompt-ids {path}: not a readable .npy array ({e})") from None
    if ids.dtype.kind not in "iu" or ids.ndim != 2:
        raise CliError(f"--prompt-ids {path}: expected integer [batch, P], got {ids.dtype} {list(ids.shape)}")
    try:
        prompt_lengths(ids)
    except ValueError as e:
        raise CliError(f"--prompt-ids {path}: {e}") from None
    bad = (ids != PAD) & ((ids < 0) | (ids >= vocab))
    if bad.any():
        b, t = np.argwhere(bad)[0]
        raise CliError(f"--prompt-ids {path}: token id {int(ids[b, t])} at [{b}, {t}] is outside the "
                       f"vocabulary [0, {vocab}) (padding is {PAD})")
    return ids.astype(np.int32)


# --------------------------------------------------------------------------------------------


class Printer:
    """Streams row 0's new text when the batch is one prompt; otherwise nothing until the end."""

    def __init__(self, codec: TextCodec | None, batch: int):
        self.codec, self.stream = codec, codec is not None and batch == 1
        self.ids: list[int] = []
        self.shown = ""

    def step(self, tokens: np.ndarray, live: np.ndarray) -> None:
        if not self.stream or not live[0]:
            return
        self.ids.append(int(tokens[0]))
        text = self.codec.decode(self.ids)
        # Print only what is settled: a multi-byte character may arrive over several tokens.
        if not text.endswith("\ufffd") and text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown) :])
            sys.stdout.flush()
            self.shown = text


def run(args: argparse.Namespace) -> np.ndarray:
    from farskip_jax.generation import PAD, Sampling, prompt_lengths

    ckpt = Path(args.checkpoint)
    if not ckpt.is_dir():
        raise CliError(f"--checkpoint {ckpt}: no such directory (an HF checkpoint or a converted Orbax one)")
    mesh = parse_mesh(args.mesh) if args.mesh is not None else None
    # A multi-process run (one process per node) generates over a mesh of every process's devices;
    # each process runs the same prompts and process 0 alone prints and writes.
    distributed.initialize(args)
    if mesh is not None:
        if mesh.tensor == 1:
            raise CliError(f"--mesh {args.mesh}: generate runs tensor parallel only, e.g. --mesh tensor=8")
        # Before anything below starts the JAX backend: host devices on a CPU-only machine, the GPU
        # family's flags (FarSkip's psums kept apart) on a GPU one.
        provide_host_devices(mesh.num_devices)
        apply_default_xla_flags(detect_local_target(), tp_inference=True)
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed)
    except ValueError as e:
        raise CliError(f"--temperature/--top-p: {e}") from None
    overrides = farskip_overrides(args)
    # Generation is dropless as HF's model is: a training capacity would let padding displace tokens.
    exe = ExecutionConfig().dropless()
    if args.dtype != "float32":
        overrides.update({"param_dtype": args.dtype, "dtype": args.dtype})
    cfg = checkpoint_config(ckpt, overrides)
    if mesh is not None:
        check_layout(cfg, mesh, args.mesh)
        check_devices(mesh, args.mesh)

    tok_path = Path(args.tokenizer) if args.tokenizer else ckpt / "tokenizer.json"
    codec = TextCodec(tok_path, not args.no_chat_template) if tok_path.is_file() else None
    if args.tokenizer and codec is None:
        raise CliError(f"--tokenizer {tok_path}: no such file")
    if args.prompt_ids is not None:
        prompts = load_prompt_ids(Path(args.prompt_ids), cfg.vocab_size)
        texts = None
    else:
        if codec is None:
            raise CliError(f"text prompts need a tokenizer: no {tok_path}; pass --tokenizer PATH or "
                           "--prompt-ids")
        texts = [args.prompt] if args.prompt is not None else read_prompt_file(Path(args.prompt_file))
        from farskip_jax.generation import pad_prompts

        prompts = pad_prompts([codec.encode(t) for t in texts])
    eos = args.eos_id if args.eos_id is not None else checkpoint_eos_ids(ckpt)

    from farskip_jax.checkpoint.hf_load import from_pretrained
    from farskip_jax.generation import Generator

    model = from_pretrained(ckpt, exe=exe, **overrides)
    jmesh = None
    if mesh is not None:
        from farskip_jax.parallel import make_mesh

        jmesh = make_mesh(mesh)
    printer = Printer(codec, prompts.shape[0])
    main_process = distributed.is_main_process()
    out = Generator(model, mesh=jmesh).generate(prompts, args.max_new_tokens, eos_ids=eos, sampling=sampling,
                                                on_step=printer.step if main_process else None)
    if not main_process:
        return out
    lengths = prompt_lengths(prompts)
    completions = [[int(t) for t in out[b, lengths[b] :] if t != PAD] for b in range(out.shape[0])]
    if printer.stream:
        print()
    else:
        for b, ids in enumerate(completions):
            print(f"[{b}] {codec.decode(ids) if codec is not None else ids}")
    if args.out is not None:
        write_out(Path(args.out), out, prompts, completions, codec, texts)
    return out


def write_out(path: Path, out: np.ndarray, prompts: np.ndarray, completions: list[list[int]],
              codec: TextCodec | None, texts: list | None) -> None:
    from farskip_jax.generation import PAD

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npy":
        np.save(path, out)
    elif path.suffix == ".jsonl":
        if codec is None:
            raise CliError(f"--out {path}: text output needs a tokenizer; write OUT.npy instead")
        with path.open("w") as f:
            for b, ids in enumerate(completions):
                prompt = texts[b] if texts is not None else codec.decode(prompts[b][prompts[b] != PAD])
                f.write(json.dumps({"prompt": prompt, "completion": codec.decode(ids)}) + "\n")
    else:
        raise CliError(f"--out {path}: expected a .npy (token ids) or .jsonl (text) file name")
    print(f"wrote {path}", file=sys.stderr)


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m farskip_jax generate`; returns the exit status (2: user error)."""
    from farskip_jax.checkpoint.hf_io import CheckpointError

    args = build_parser().parse_args(argv)
    if args.out is not None and Path(args.out).suffix not in (".npy", ".jsonl"):
        raise CliError(f"--out {args.out}: expected a .npy (token ids) or .jsonl (text) file name")
    try:
        run(args)
    except CheckpointError as e:
        raise CliError(str(e)) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
