"""What the converter's test modules share (test_convert.py, test_convert_resume.py; their fixtures in
conftest.py): a tiny random DeepSeek-V2 built by transformers, its logits, and tensor comparisons."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from farskip_jax.checkpoint.hf_io import TensorSource  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
E = 8
IDS = np.array([[3, 17, 5, 60, 22, 9, 41, 2, 33, 12, 7, 50]], dtype=np.int64)


def hf_config(**kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=E,
                n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                max_position_embeddings=64)
    base.update(kw)
    return transformers.DeepseekV2Config(**base)


def random_hf_model(seed: int):
    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(hf_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Small-magnitude weights keep fp32 logits comparable to 1e-4; norms stay near 1.
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def hf_logits_of(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(IDS)).logits.float().numpy()


@nnx.jit
def _forward(model, ids):
    return model(ids).logits


def our_logits(model) -> np.ndarray:
    return np.asarray(_forward(model, jnp.asarray(IDS, jnp.int32)))


def read_tensors(d: Path) -> dict[str, np.ndarray]:
    src = TensorSource(d)
    return {k: src.read(k) for k in src.keys()}


def same_tensors(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k


def saved_bits(directory: Path) -> dict:
    """The bytes of every array of an Orbax conversion's `params` item, by key path."""
    import orbax.checkpoint as ocp

    tree = ocp.StandardCheckpointer().restore((directory / "params").absolute())
    return {jax.tree_util.keystr(k): np.asarray(v).view(np.uint8)
            for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
