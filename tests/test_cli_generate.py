"""`python -m farskip_jax generate` on a tiny saved HF checkpoint with a local tokenizer and chat
template: token-identical to HF generate, text prompts through the template, FarSkip flags,
tensor parallel, output files, and errors that name the problem."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "model"))
from hf_tiny import build_hf, save_hf, tiny_hf_config  # noqa: E402

from farskip_jax import cli_generate, from_pretrained  # noqa: E402
from farskip_jax.config import ExecutionConfig  # noqa: E402
from farskip_jax.demo.task import vocab, write_tokenizer  # noqa: E402
from farskip_jax.generation import PAD, Generator  # noqa: E402

NEW = 6
SYMBOLS = 87  # + 9 specials and task words = the model's 96 ids
TEMPLATE = "{{ bos_token }} {% for m in messages %}User: {{ m['content'] }} {% endfor %}Assistant:"
PROMPTS = [[2, 4, 10, 11, 12, 13], [2, 4, 20, 5], [2, 4, 30, 31, 32, 5, 5]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = tiny_hf_config(q_lora_rank=12, num_attention_heads=8)
    hf = build_hf(cfg, seed=21)
    d = save_hf(hf, tmp_path_factory.mktemp("gen_ckpt"))
    write_tokenizer(d / "tokenizer.json", SYMBOLS)
    assert len(vocab(SYMBOLS)) == cfg.vocab_size  # every id the model can produce is a word
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<bos>",
                                                         "eos_token": {"content": "<eos>"}}))
    ids = np.full((len(PROMPTS), max(map(len, PROMPTS))), PAD, np.int32)
    for b, p in enumerate(PROMPTS):
        ids[b, : len(p)] = p
    np.save(d.parent / "prompts.npy", ids)
    return dict(dir=d, hf=hf, ids=ids, ids_file=d.parent / "prompts.npy")


def gen(ckpt, tmp_path, *extra: str, out: str = "out.npy") -> tuple[int, Path]:
    path = tmp_path / out
    rc = cli_generate.main(["--checkpoint", str(ckpt["dir"]), "--max-new-tokens", str(NEW),
                            "--out", str(path), *extra])
    return rc, path


def test_prompt_ids_match_hf_generate(ckpt, tmp_path, capsys):
    rc, path = gen(ckpt, tmp_path, "--prompt-ids", str(ckpt["ids_file"]))
    assert rc == 0
    out = np.load(path)
    assert out.dtype == np.int32 and out.shape == (len(PROMPTS), ckpt["ids"].shape[1] + NEW)
    for b, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = ckpt["hf"].generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                      eos_token_id=None, pad_token_id=0).numpy()[0]
        assert np.array_equal(out[b, : len(p) + NEW], ref), (b, out[b], ref)
        assert (out[b, len(p) + NEW :] == PAD).all()
    printed = capsys.readouterr().out
    assert printed.count("\n[") + printed.startswith("[") == len(PROMPTS)  # one line per row


def test_text_prompt_goes_through_the_chat_template(ckpt, tmp_path, capsys):
    rc, path = gen(ckpt, tmp_path, "--prompt", "rev a b c", out="out.jsonl")
    assert rc == 0
    streamed = capsys.readouterr().out.strip()
    rec = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert len(rec) == 1 and rec[0]["prompt"] == "rev a b c"
    assert streamed == rec[0]["completion"].strip()
    # The same prompt as ids, rendered by hand: <bos> User: rev a b c Assistant:
    v = vocab(SYMBOLS)
    ids = np.array([[v[t] for t in ["<bos>", "User:", "rev", "a", "b", "c", "Assistant:"]]], np.int32)
    dropless = ExecutionConfig(capacity_factor=0.0)
    want = Generator(from_pretrained(ckpt["dir"], exe=dropless)).generate(ids, NEW, eos_ids=[100001])
    rc, path = gen(ckpt, tmp_path, "--prompt", "rev a b c")
    assert rc == 0 and np.array_equal(np.load(path), want)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt["dir"] / "tokenizer.json"))
    text = tok.decode([int(t) for t in want[0, ids.shape[1] :] if t != PAD], skip_special_tokens=True)
    assert rec[0]["completion"] == text and text  # some new tokens are words of the tokenizer


# slow (CI time): tensor-parallel generation equals one device and HF in the default suite
# (tests/model/test_generation.py, the family tests' *_and_tp2); this checks the CLI's flags for it.
@pytest.mark.slow
def test_farskip_flags_and_tensor_parallel(ckpt, tmp_path):
    rc, path = gen(ckpt, tmp_path, "--prompt-ids", str(ckpt["ids_file"]), "--farskip-range", "1:2",
                   "--mesh", "tensor=8")
    assert rc == 0
    model = from_pretrained(ckpt["dir"], **{"farskip.enabled": True, "farskip.start_idx": 1,
                                            "farskip.end_idx": 2})
    want = Generator(model).generate(ckpt["ids"], NEW, eos_ids=[100001])
    assert np.array_equal(np.load(path), want)
    regular = Generator(from_pretrained(ckpt["dir"])).generate(ckpt["ids"], NEW)
    assert not np.array_equal(want, regular)  # the flag changed the model


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "BAD_ROW"], "row 0: a token follows padding"),
    (["--prompt-ids", "IDS", "--mesh", "expert=8"], "tensor parallel only"),
    (["--prompt-ids", "IDS", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--prompt", "x", "--tokenizer", "/nonexistent/tokenizer.json"], "no such file"),
])
def test_errors_name_the_problem(ckpt, tmp_path, capsys, args, message):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.array([[3, PAD, 4]], np.int32))
    args = [str(bad) if a == "BAD_ROW" else str(ckpt["ids_file"]) if a == "IDS" else a for a in args]
    rc, _ = gen(ckpt, tmp_path, *args)
    assert rc == 2
    assert message in capsys.readouterr().err
