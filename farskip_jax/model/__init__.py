"""DeepSeek-V2/V3, Qwen3-MoE and Llama-4 families with FarSkip connectivity, in Flax NNX."""

from farskip_jax.model.farskip import Connectivity, layer_connectivity, residual_step
from farskip_jax.model.transformer import ModelOutput, Transformer, build_model, with_farskip

__all__ = ["Connectivity", "ModelOutput", "Transformer", "build_model", "layer_connectivity",
           "residual_step", "with_farskip"]
