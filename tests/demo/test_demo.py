"""The embedded demo's pipeline end to end on an even smaller setting: the real trainer trains a regular
teacher, FarSkip conversion of the same weights drops its exact-match accuracy, FCSD wins part of it back,
and the plots are valid PNGs. Thresholds come from measured runs (fixed seeds) with margin."""

from __future__ import annotations

from pathlib import Path

import pytest

from farskip_jax.config import load_config, parse_overrides
from farskip_jax.demo import run_demo

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Short strings over few symbols, 3 layers, no trainer eval: the smallest setting that still tells the story.
# Chance exact match is (1/6)^len <= 2.8% for len >= 2. Measured (seed 0, CPU): teacher 0.320, converted
# 0.000, after FCSD 0.293 (91% of the drop regained); the thresholds below leave margin on each.
SMALL = [
    "demo.symbols=6", "demo.min_len=2", "demo.max_len=4", "demo.n_train=4000", "demo.n_eval=64",
    "demo.n_test=256", "demo.inspect=false", "data.seq_len=48", "data.batch_size=8",
    "demo.teacher.train.total_steps=250", "demo.fcsd.train.total_steps=100", "train.eval_every=1000",
    "train.log_every=5", "demo.trainer_eval=false", "model.num_layers=3",
]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("demo")
    cfg = load_config("tiny_demo", parse_overrides([*SMALL, f"train.output_dir={out}"]))
    return run_demo(cfg, cfg_path=None, log=lambda _s: None), out


def test_accuracy_story(demo_run: tuple[dict, Path]) -> None:
    res, _ = demo_run
    teacher, conv, fcsd = (res[k]["exact_match"] for k in ("teacher", "converted", "fcsd"))
    assert teacher >= 0.2, res  # well above chance (< 0.03)
    assert conv <= teacher - 0.15, res  # untrained all-layer conversion hurts
    assert fcsd >= conv + 0.5 * (teacher - conv), res  # FCSD regains at least half of the drop
    assert res["recovered_fraction_of_drop"] >= 0.5


def test_outputs_written(demo_run: tuple[dict, Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    res, out = demo_run
    assert (out / "demo_results.json").exists()
    assert (out / "data" / "tokenizer.json").exists() and (out / "data" / "train.jsonl").exists()
    assert len(res["plots"]) == 2
    for p in map(Path, res["plots"]):
        assert p.read_bytes()[:8] == PNG_SIGNATURE, p
        img = mpimg.imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_export_of_the_fcsd_student_serves_as_it_is(demo_run: tuple[dict, Path], tmp_path: Path) -> None:
    """`convert_torch_ckpt.py --to-hf` of the demo's FCSD checkpoint is a directory transformers
    serves as it is: the run's tokenizer with a chat template rendering the training template,
    config.json and generation_config.json with that tokenizer's BOS/EOS ids (not DeepSeek-V2's
    100000 / 100001), and `generate` stops at the first EOS."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from farskip_jax.checkpoint.to_hf import convert_orbax_to_hf

    _, out = demo_run
    steps = sorted((out / "fcsd" / "checkpoints").glob("[0-9]*"), key=lambda p: int(p.name))
    hf_dir = tmp_path / "hf"
    convert_orbax_to_hf(steps[-1], hf_dir, progress=False, log=lambda _line: None)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (hf_dir / name).is_file(), name
    tok = AutoTokenizer.from_pretrained(hf_dir)
    eos = tok.convert_tokens_to_ids("<eos>")
    config = json.loads((hf_dir / "config.json").read_text())
    gen = json.loads((hf_dir / "generation_config.json").read_text())
    assert config["eos_token_id"] == gen["eos_token_id"] == tok.eos_token_id == eos
    assert config["bos_token_id"] == tok.convert_tokens_to_ids("<bos>") < config["vocab_size"]
    record = json.loads((out / "data" / "train.jsonl").read_text().splitlines()[0])
    user, answer = record["messages"][0]["content"], record["messages"][1]["content"]
    # the chat template gives a training record the token ids the data pipeline gave it
    rendered = tok.apply_chat_template(record["messages"], return_dict=True)["input_ids"]
    words = ["<bos>", "User:", *user.split(), "Assistant:", *answer.split(), "<eos>"]
    assert list(rendered) == tok.convert_tokens_to_ids(words), tok.convert_ids_to_tokens(rendered)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)["input_ids"]
    new = model.generate(prompt, max_new_tokens=16, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert new and new[-1] == eos and new.count(eos) == 1, tok.convert_ids_to_tokens(new)


def test_overlap_line_reads_the_ragged_exchange() -> None:
    """The demo's inspect summary names the exchange the GPU target compiles (ragged all-to-all since
    the bounded dropless exchange; `make demo` failed on a missing dense all-to-all group)."""
    from farskip_jax.demo.pipeline import overlap_line

    def cmp(kind: str) -> dict:
        return {"groups": {kind: {"farskip": {"hidden_frac": 0.9}, "regular": {"hidden_frac": 0.5}}},
                "est_step_us": {"farskip": 100.0, "regular": 110.0}, "speedup_est": 1.1}

    for kind in ("ragged-all-to-all", "all-to-all"):
        assert overlap_line(cmp(kind)).startswith("all-to-all time hidden under compute: FarSkip 90.0% vs "
                                                  "regular 50.0%")
    assert overlap_line({"groups": {"all-reduce": {}}}).startswith("no all-to-all")
