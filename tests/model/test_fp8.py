"""DeepSeek-V3 checkpoints in the published FP8 layout: float8_e4m3fn weights with one float32
`<name>_scale_inv` per block (config.json quantization_config, weight_block_size), embeddings, LM
head, norms, router and its bias unquantized. Tiny HF checkpoints are written in that layout (block
128, larger than every tiny weight: one partial block each; and 8 x 16 with partial edge blocks),
then read through `from_pretrained`, the converter and its dry run; the reference is HF's own
model with the dequantized weights loaded (fp32), logits <= 1e-4."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_tiny import (
    build_dsv3,
    hf_logits,
    jax_logits,
    max_abs_err,
    random_ids,
    record,
    save_hf,
    tiny_dsv3_config,
)
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

import farskip_jax
from farskip_jax.checkpoint.convert import convert_hf_to_orbax
from farskip_jax.checkpoint.hf_io import CheckpointError, TensorSource

BAR = 1e-4
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "e_score_correction_bias")


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantization: scale = amax(block) / 448, q = w / scale in float8_e4m3fn."""
    rows, cols = w.shape
    nb = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.ones(nb, dtype=torch.float32)
    for i in range(nb[0]):
        for j in range(nb[1]):
            tile = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = max(float(tile.abs().max()), 1e-12) / FP8_MAX
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return (w.float() / full).to(torch.float8_e4m3fn), scale


def write_fp8(src: Path, dest: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """`src` (an HF directory) rewritten in the FP8 layout; returns the dequantized weights."""
    dest.mkdir(parents=True)
    tensors = load_file(str(src / "model.safetensors"))
    out, dequantized = {}, {}
    for name, w in tensors.items():
        if w.ndim == 2 and name.endswith(".weight") and not any(k in name for k in KEEP):
            q, scale = _quantize(w, block)
            out[name], out[name + "_scale_inv"] = q, scale
            full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            dequantized[name] = q.float() * full[:w.shape[0], :w.shape[1]]
        else:
            out[name] = w
    save_file(out, str(dest / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": list(block)}
    (dest / "config.json").write_text(json.dumps(cfg))
    return dequantized


@pytest.fixture(scope="module")
def hf_case(tmp_path_factory):
    cfg = tiny_dsv3_config()
    hf = build_dsv3(cfg, seed=5)
    src = save_hf(hf, tmp_path_factory.mktemp("dsv3_bf"))
    return {"hf": hf, "src": src, "ids": random_ids(cfg.vocab_size)}


@pytest.fixture(scope="module", params=[(128, 128), (8, 16)], ids=["block128", "block8x16"])
def fp8_case(request, hf_case, tmp_path_factory):
    block = request.param
    d = tmp_path_factory.mktemp(f"fp8_{block[0]}x{block[1]}") / "ckpt"
    dequantized = write_fp8(hf_case["src"], d, block)
    # HF's model of the dequantized weights: the unquantized file with them in place, loaded by HF
    deq = d.parent / "dequantized"
    deq.mkdir()
    tensors = load_file(str(hf_case["src"] / "model.safetensors"))
    save_file({k: dequantized.get(k, v).contiguous() for k, v in tensors.items()},
              str(deq / "model.safetensors"))
    shutil.copyfile(hf_case["src"] / "config.json", deq / "config.json")
    ref_model = DeepseekV3ForCausalLM.from_pretrained(deq, dtype=torch.float32, attn_implementation="eager")
    ref_model.eval()
    return {"dir": d, "block": block, "n_quantized": len(dequantized),
            "ref": hf_logits(ref_model, hf_case["ids"]), "ids": hf_case["ids"]}


def test_from_pretrained_dequantizes_like_hf(fp8_case):
    model = farskip_jax.from_pretrained(fp8_case["dir"])
    err = max_abs_err(jax_logits(model, fp8_case["ids"]), fp8_case["ref"])
    record("fp8_from_pretrained", f"block{fp8_case['block']}", err)
    assert err <= BAR


def test_converter_dequantizes_while_streaming(fp8_case, tmp_path):
    lines: list[str] = []
    convert_hf_to_orbax(fp8_case["dir"], tmp_path / "dry", dry_run=True, progress=False, log=lines.append)
    text = "\n".join(lines)
    assert f"FP8: {fp8_case['n_quantized']} block-quantized tensors" in text, text
    # the unquantized tensors of the tiny checkpoint are float32: the output dtype follows them
    assert f"blocks of {list(fp8_case['block'])}" in text and "dequantized to float32" in text, text
    assert "model.layers.*.mlp.experts.*.down_proj.weight x" in text
    convert_hf_to_orbax(fp8_case["dir"], tmp_path / "orbax", dtype="fp32", progress=False,
                        log=lambda _s: None)
    err = max_abs_err(jax_logits(farskip_jax.from_pretrained(tmp_path / "orbax"), fp8_case["ids"]),
                      fp8_case["ref"])
    record("fp8_converter", f"block{fp8_case['block']}", err)
    assert err <= BAR


def test_bad_scales_are_refused_by_name(fp8_case, tmp_path):
    tensors = load_file(str(fp8_case["dir"] / "model.safetensors"))
    victim = "model.layers.1.self_attn.o_proj.weight"
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != victim + "_scale_inv"},
                    f"{victim!r} is float8_e4m3fn but has no"),
        "shape": ({**tensors, victim + "_scale_inv": torch.ones(3, 5)},
                  f"{victim}_scale_inv: shape [3, 5]"),
        "stray": ({**tensors, "model.layers.1.nonexistent.weight_scale_inv": torch.ones(1, 1)},
                  "has no weight 'model.layers.1.nonexistent.weight'"),
    }
    for name, (content, message) in cases.items():
        d = tmp_path / name
        d.mkdir()
        shutil.copyfile(fp8_case["dir"] / "config.json", d / "config.json")
        save_file(content, str(d / "model.safetensors"))
        with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
            src = TensorSource(d)
            src.read(victim)
    # scales without the config's quantization_config
    d = tmp_path / "noconfig"
    d.mkdir()
    cfg = json.loads((fp8_case["dir"] / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copyfile(fp8_case["dir"] / "model.safetensors", d / "model.safetensors")
    with pytest.raises(CheckpointError, match="no FP8 quantization_config"):
        TensorSource(d)


def test_dequantized_values_are_exact(fp8_case):
    """Each element is float32(q) * its block's scale: the partial edge blocks included."""
    src = TensorSource(fp8_case["dir"])
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    raw = load_file(str(fp8_case["dir"] / "model.safetensors"))
    q, scale = raw[name].float().numpy(), raw[name + "_scale_inv"].numpy()
    b0, b1 = fp8_case["block"]
    expect = q * np.kron(scale, np.ones((b0, b1), np.float32))[:q.shape[0], :q.shape[1]]
    np.testing.assert_array_equal(src.read(name), expect)
    assert src.dtype_name(name) == "float32" and name in src.quantized()
    assert name + "_scale_inv" not in src.keys()


def _st_tensors(d: Path) -> dict[str, tuple[str, bytes]]:
    """name -> (safetensors dtype tag, raw bytes) over every shard of an HF directory."""
    from farskip_jax.checkpoint.hf_io import read_safetensors_header

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        start, header = read_safetensors_header(f)
        raw = f.read_bytes()
        for name, h in header.items():
            out[name] = (h["dtype"], raw[start + h["data_offsets"][0]:start + h["data_offsets"][1]])
    return out


def test_fp8_export_round_trip_is_bitwise(fp8_case, tmp_path):
    """Published FP8 -> Orbax (float32) -> `--to-hf --fp8` writes the published tensors back, byte
    for byte: every float8 weight, every scale (amax / 448 alone would change ~11% of them in the last
    bit), the unquantized tensors; shards of 20 KB, so weights and their scales straddle shards."""
    from convert_torch_ckpt import main as cli

    convert_hf_to_orbax(fp8_case["dir"], tmp_path / "orbax", dtype="fp32", progress=False,
                        log=lambda _s: None)
    out = tmp_path / "hf_fp8"
    assert cli(["--to-hf", "--fp8", "--input", str(tmp_path / "orbax"), "--output", str(out),
                "--max-shard-size", "20KB", "--no-progress"]) == 0
    assert len(list(out.glob("*.safetensors"))) > 2
    src, got = _st_tensors(fp8_case["dir"]), _st_tensors(out)
    assert sorted(got) == sorted(src)
    assert sum(tag == "F8_E4M3" for tag, _ in got.values()) == fp8_case["n_quantized"]
    assert [k for k in src if got[k] != src[k]] == []
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["weight_block_size"] == list(fp8_case["block"])
    err = max_abs_err(jax_logits(farskip_jax.from_pretrained(out), fp8_case["ids"]), fp8_case["ref"])
    assert err <= BAR


def test_fp8_export_of_unquantized_weights_uses_amax_blocks(hf_case, tmp_path):
    """A checkpoint that never was FP8: every quantized block's largest |q| is 448 (scale = amax /
    448), each element within fp8's rounding (1/16 relative) of the weight, and the export loads."""
    convert_hf_to_orbax(hf_case["src"], tmp_path / "orbax", dtype="fp32", progress=False, log=lambda _s: None)
    out = tmp_path / "hf_fp8"
    lines: list[str] = []
    from farskip_jax.checkpoint.to_hf import convert_orbax_to_hf

    convert_orbax_to_hf(tmp_path / "orbax", out, fp8=True, progress=False, log=lines.append)
    assert "FP8 e4m3 in blocks of [128, 128]" in lines[0], lines
    ref = load_file(str(hf_case["src"] / "model.safetensors"))
    got = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(str(f)))
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    q, scale = got[name].float(), got[name + "_scale_inv"]
    assert got[name].dtype == torch.float8_e4m3fn and scale.shape == (1, 1)
    assert float(q.abs().max()) == FP8_MAX
    w = ref[name].float()
    assert float(((q * scale - w).abs() / w.abs().clamp_min(1e-30)).max()) <= 1 / 16 + 1e-6
    assert got["model.embed_tokens.weight"].dtype == torch.float32
    assert got["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    logits = jax_logits(farskip_jax.from_pretrained(out), hf_case["ids"])
    assert np.isfinite(logits).all()


def test_quantize_recovers_any_float32_scale_of_a_448_block():
    """Blocks whose largest |q| is 448 with random float32 scales (not computed as amax / 448):
    dequantize -> quantize gives q and the scales back bitwise, partial edge blocks included, where
    the amax / 448 rule alone changes a share of the scales (so this checks the recovery)."""
    import ml_dtypes

    from farskip_jax.checkpoint.hf_io import dequantize_fp8, quantize_fp8

    rng = np.random.default_rng(3)
    block, shape = (8, 16), (8 * 30 - 3, 16 * 20 - 5)
    nb = (30, 20)
    scale = np.exp(rng.uniform(np.log(1e-6), np.log(1e-2), nb)).astype(np.float32)
    q = np.clip(rng.standard_t(4, shape) * 60, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    for i in range(nb[0]):  # one 448 per block, at a random place inside its (partial) extent
        for j in range(nb[1]):
            r = min(i * block[0] + rng.integers(block[0]), shape[0] - 1)
            c = min(j * block[1] + rng.integers(block[1]), shape[1] - 1)
            q[r, c] = 448.0 * rng.choice([-1, 1])
    w = dequantize_fp8(q, scale, block, "w")
    q2, scale2 = quantize_fp8(w, block)
    np.testing.assert_array_equal(q2.view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(scale2, scale)
    tiles = np.zeros((nb[0] * block[0], nb[1] * block[1]), np.float32)
    tiles[:shape[0], :shape[1]] = np.abs(w)
    amax = tiles.reshape(nb[0], block[0], nb[1], block[1]).max(axis=(1, 3))
    plain = (amax / np.float32(448.0)).astype(np.float32)
    print(f"amax / 448 alone changes {np.mean(plain != scale):.1%} of the scales")
    assert np.mean(plain != scale) > 0.03
