"""farskip-jax: FarSkip-Collective MoE (DeepSeek-V2 family) in JAX / Flax NNX."""

from farskip_jax import platforms as _platforms  # noqa: F401 - first: picks JAX platforms
from farskip_jax.config import Config, ConfigError, ExecutionConfig, FarSkipConfig, ModelConfig, load_config
from farskip_jax.hf_config import load_hf_config
from farskip_jax.model import Transformer, build_model, with_farskip


def from_pretrained(path, **overrides):
    """Loads an HF DeepSeek-V2 directory (config.json + *.safetensors) into a Transformer.

    Keyword overrides are dotted ModelConfig keys, e.g. `**{"farskip.enabled": True}` or
    `dtype="bfloat16"`; `exe=ExecutionConfig(...)` says how to run it.
    """
    from farskip_jax.checkpoint.hf_load import from_pretrained as _load

    return _load(path, **overrides)


__all__ = ["Config", "ConfigError", "ExecutionConfig", "FarSkipConfig", "ModelConfig", "Transformer",
           "build_model", "from_pretrained", "load_config", "load_hf_config", "with_farskip"]
