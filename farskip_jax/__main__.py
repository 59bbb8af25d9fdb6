"""`python -m farskip_jax SUBCOMMAND ...`: thin dispatch to the subcommands' own `main(argv)`.

Subcommands:
  logits   run an HF DeepSeek-V2 checkpoint on token ids, write float32 logits (farskip_jax.cli_logits)
  generate prefill + decode over the MLA latent cache: text or token ids (farskip_jax.cli_generate)
  inspect  deviceless compile + HLO overlap report (farskip_jax.inspect.cli)
  describe parameters, layer plan, bytes per device and HF architecture of a checkpoint or config
           (farskip_jax.cli_describe)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = {
    "logits": ("farskip_jax.cli_logits", "run a checkpoint on token ids and write float32 logits"),
    "generate": ("farskip_jax.cli_generate", "generate text or token ids from a checkpoint (KV cache)"),
    "inspect": ("farskip_jax.inspect.cli", "deviceless compile and HLO collective-overlap report"),
    "describe": ("farskip_jax.cli_describe", "parameters, layer plan, bytes per device, HF architecture"),
}


def _usage() -> str:
    lines = ["usage: python -m farskip_jax SUBCOMMAND [options]", "", "subcommands:"]
    lines += [f"  {name:<9} {doc}" for name, (_, doc) in SUBCOMMANDS.items()]
    lines += ["", "Run `python -m farskip_jax SUBCOMMAND --help` for a subcommand's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"error: unknown subcommand {name!r}; choose from {sorted(SUBCOMMANDS)}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            print(f"error: subcommand {name!r} is not available: module {module_name} is missing "
                  f"({e})", file=sys.stderr)
            return 2
        raise
    entry = getattr(module, "main", None)
    if entry is None:
        print(f"error: subcommand {name!r} is not available: {module_name} has no main(argv)",
              file=sys.stderr)
        return 2
    rc = entry(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
