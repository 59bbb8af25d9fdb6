"""The tokenizer and generation settings that make an HF export usable as it is.

A serving stack (transformers `generate`, vLLM, SGLang) pointed at an export reads the tokenizer
files, the chat template in `tokenizer_config.json` and the stop token in `generation_config.json`
from the same directory. Where they come from:

* a training checkpoint: the tokenizer the run was trained with (`data.tokenizer` in the config
  stored in the checkpoint's meta), the files beside it, and `data.template`'s BOS/EOS strings;
  without a `tokenizer_config.json` beside it, one is written with a chat template rendering
  `data.template` exactly as the data pipeline does;
* a converted checkpoint: the files the converter copied from the HF directory it read
  (`hf_tokenizer/` inside the Orbax directory).

The BOS/EOS ids in config.json and generation_config.json are the tokenizer's ids of those tokens,
never a family default (DeepSeek-V2's 100000 / 100001 for a 32-token vocabulary made transformers
run past the first EOS).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Files of an HF directory that describe its tokenizer and generation defaults (copied as they are).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")
SUBDIR = "hf_tokenizer"  # inside a converted (Orbax) checkpoint


@dataclass
class TokenizerAssets:
    """What an export writes besides the weights and config.json."""

    source: str  # where the files come from, for the converter's summary
    files: dict[str, Path] = field(default_factory=dict)  # output name -> file to copy
    bos: str | None = None  # token strings; None: take the ids from `token_ids`
    eos: str | None = None
    token_ids: dict[str, int] = field(default_factory=dict)  # bos/eos/pad ids known without a lookup
    chat_template: str | None = None  # written into a generated tokenizer_config.json
    template_pieces: tuple[str, ...] = ()  # the training template's strings (bos, eos, role markers)


def copy_from_hf_dir(src: Path, dest: Path) -> list[str]:
    """At conversion: the tokenizer files of HF directory `src` into `dest`/hf_tokenizer."""
    found = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if found:
        (dest / SUBDIR).mkdir(parents=True, exist_ok=True)
        for name in found:
            shutil.copyfile(src / name, dest / SUBDIR / name)
    return found


def _token_text(value: Any) -> str | None:
    """A tokenizer_config.json special token: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def from_converted(orbax_dir: Path) -> TokenizerAssets | None:
    d = orbax_dir / SUBDIR
    files = {f.name: f for f in sorted(d.iterdir()) if f.is_file()} if d.is_dir() else {}
    assets = TokenizerAssets(source=str(d if files else orbax_dir / "config.json"), files=files)
    if (d / "tokenizer_config.json").is_file():
        tc = json.loads((d / "tokenizer_config.json").read_text())
        assets.bos, assets.eos = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
    for name in ("generation_config.json", "config.json"):  # the checkpoint's own ids
        path = d / name if name != "config.json" else orbax_dir / name
        if path.is_file():
            ids = json.loads(path.read_text())
            for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if ids.get(k) is not None:
                    assets.token_ids.setdefault(k, ids[k])
    return assets if files or assets.token_ids else None


def chat_template(template: dict[str, str]) -> str:
    """A Jinja chat template (HF `apply_chat_template`) rendering the data pipeline's ChatTemplate:
    bos, then each turn as prefix + content + suffix, an assistant turn's content followed by eos;
    the generation prompt is the assistant prefix."""
    def lit(key: str) -> str:
        return "{{ " + json.dumps(template.get(key, "")) + " }}"

    return ("{{ bos_token }}{% for message in messages %}"
            "{% if message['role'] == 'system' %}" + lit("system_prefix") + "{{ message['content'] }}"
            + lit("system_suffix") +
            "{% elif message['role'] == 'user' %}" + lit("user_prefix") + "{{ message['content'] }}"
            + lit("user_suffix") +
            "{% else %}" + lit("assistant_prefix") + "{{ message['content'] }}{{ eos_token }}"
            + lit("assistant_suffix") + "{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}" + lit("assistant_prefix") + "{% endif %}")


def from_training_config(config: dict[str, Any]) -> TokenizerAssets | None:
    """From the config a training checkpoint stores: `data.tokenizer` and `data.template`. None when
    the tokenizer file is no longer where the run read it."""
    data = config.get("data") or {}
    tok = Path(str(data.get("tokenizer") or ""))
    if not tok.is_file():
        return None
    template = data.get("template") or {}
    assets = TokenizerAssets(source=str(tok), files={"tokenizer.json": tok},
                             bos=template.get("bos") or None, eos=template.get("eos") or None)
    for name in ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        if (tok.parent / name).is_file():
            assets.files[name] = tok.parent / name
    if "tokenizer_config.json" not in assets.files:
        assets.chat_template = chat_template(template)
        assets.template_pieces = tuple(v for v in template.values() if isinstance(v, str) and v.strip())
    return assets


def _split_out_template_tokens(tok: Any, pieces: tuple[str, ...], path: Path) -> None:
    """Marks the template strings that are single tokens of the vocabulary as special tokens of the
    exported tokenizer, so that a rendered chat template tokenizes as the data pipeline did.

    Why: the pipeline tokenises every template piece on its own, so its pieces need no separator
    ("<bos>User:" is two tokens there); the chat template renders one string, which a
    word-level tokenizer would read as one unknown word. A special token is split out of the text
    before pre-tokenisation and keeps its vocabulary id. Pieces that are several tokens (a BPE
    tokenizer's "User: ") are left to the tokenizer, which reads them from text as it always does."""
    from tokenizers import AddedToken

    single = sorted({p.strip() for p in pieces if tok.token_to_id(p.strip()) is not None})
    if single:
        tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in single])
        tok.save(str(path))


def find(checkpoint: Path, trainer_config: dict[str, Any] | None) -> TokenizerAssets | None:
    """The assets for an export of `checkpoint`: a converted checkpoint's copied files; for a
    training checkpoint (`trainer_config`: the config in its meta) the run's tokenizer, else the
    files of the converted checkpoint it started from (`train.init_checkpoint`)."""
    if trainer_config is None:
        return from_converted(checkpoint)
    assets = from_training_config(trainer_config)
    if assets is None:
        init = (trainer_config.get("train") or {}).get("init_checkpoint")
        if init and Path(init).is_dir():
            assets = from_converted(Path(init))
    return assets


def write(assets: TokenizerAssets, out: Path, config_json: dict[str, Any]) -> dict[str, int]:
    """Copies and writes the tokenizer files and generation_config.json into `out`; sets config.json's
    bos/eos/pad ids (in `config_json`, which the caller writes). Returns the ids."""
    from tokenizers import Tokenizer

    for name, src in assets.files.items():
        shutil.copyfile(src, out / name)
    ids = dict(assets.token_ids)
    tok = Tokenizer.from_file(str(out / "tokenizer.json")) if (out / "tokenizer.json").is_file() else None
    if tok is not None and assets.template_pieces:
        _split_out_template_tokens(tok, assets.template_pieces, out / "tokenizer.json")
    for key, text in (("bos_token_id", assets.bos), ("eos_token_id", assets.eos)):
        if text is not None and tok is not None:
            token_id = tok.token_to_id(text)
            if token_id is None:
                raise ValueError(f"{assets.source}: the {key[:3]} token {text!r} is not in the tokenizer")
            ids[key] = token_id
    if "eos_token_id" in ids:
        ids.setdefault("pad_token_id", ids["eos_token_id"] if isinstance(ids["eos_token_id"], int)
                       else ids["eos_token_id"][0])
    if assets.chat_template is not None and not (out / "tokenizer_config.json").exists():
        tc: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "chat_template": assets.chat_template, "clean_up_tokenization_spaces": False}
        for key, text in (("bos_token", assets.bos), ("eos_token", assets.eos)):
            if text is not None:
                tc[key] = text
        if assets.eos is not None:
            tc["pad_token"] = assets.eos
        (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen.update(ids)
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in ids:
            config_json[k] = ids[k]
        elif k != "pad_token_id":
            config_json.pop(k, None)  # a family default would name a token of another vocabulary
    return ids
