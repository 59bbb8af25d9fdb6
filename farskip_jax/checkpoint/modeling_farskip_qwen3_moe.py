"""FarSkip-Collective connectivity for HF transformers' Qwen3-MoE, as remote code.

farskip-jax copies this file into every HF export of a FarSkip Qwen3-MoE model and registers it
in config.json (`auto_map`), so that

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

runs the model that was trained. Loaded without `trust_remote_code`, the same directory builds
the stock Qwen3MoeForCausalLM, which ignores the FarSkip keys: regular connectivity, i.e. a
different model. Needs transformers >= 5 (its Qwen3-MoE modules are reused, not copied); this
file does not import farskip_jax.

Config keys (Instella-MoE's): `farskip`, `farskip_start_idx` (default 0), `farskip_end_idx`
(default the last layer; inclusive), `attn_only_farskip`, `mlp_only_farskip`.

The wiring (farskip_jax/model/farskip.py holds the same recurrence for JAX). Qwen3-MoE has no
shared expert, so y, the stream without the previous layer's routed output, is x + A:

    FarSkip MoE layer:  A = Attn(LN1(y));  R = MoE(LN2(x))    (attn_only: LN2(x + A))
                        y' = x + A;  x' = (x + A) + R
    mlp_only:           attention reads x, the MoE reads LN2(x), no y stream
    dense layer:        A = Attn(LN1(y)), M = MLP(LN2(x)), x' = (x + A) + M, no y stream
    regular layer:      A = Attn(LN1(x)), x' = (x + A) + MoE(LN2(x + A))

A layer that receives no y (the first layer, or one after a dense or regular layer) uses y = x.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeForCausalLM,
    Qwen3MoeSparseMoeBlock,
)


def farskip_layers(config) -> range:
    """The inclusive layer range `farskip_start_idx .. min(farskip_end_idx, L - 1)` (empty if off)."""
    n = config.num_hidden_layers
    if not getattr(config, "farskip", False):
        return range(0)
    start = getattr(config, "farskip_start_idx", None)
    end = getattr(config, "farskip_end_idx", None)
    start = 0 if start is None else int(start)
    end = n - 1 if end is None else min(int(end), n - 1)
    return range(start, end + 1)


class _Streams:
    """The y stream one layer hands the next inside a forward pass (None: same as x). Every layer
    overwrites it and layer 0 never reads it, so nothing leaks from one forward pass to the next."""

    y: torch.Tensor | None = None


class FarSkipQwen3MoeDecoderLayer(Qwen3MoeDecoderLayer):
    def __init__(self, config, layer_idx: int, streams: _Streams):
        super().__init__(config, layer_idx)
        on = layer_idx in farskip_layers(config)
        self.layer_idx = layer_idx
        self.attn_stale = on and not getattr(config, "mlp_only_farskip", False)
        self.mlp_stale = on and not getattr(config, "attn_only_farskip", False)
        self.is_moe = isinstance(self.mlp, Qwen3MoeSparseMoeBlock)
        self._streams = streams

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        x = hidden_states
        y = self._streams.y if self.layer_idx > 0 else None
        attn_in = y if self.attn_stale and y is not None else x
        a, _ = self.self_attn(hidden_states=self.input_layernorm(attn_in), **kwargs)
        h = x + a
        m = self.post_attention_layernorm(x if self.mlp_stale else h)
        self._streams.y = h if self.is_moe and self.attn_stale else None
        return h + self.mlp(m)


class FarSkipQwen3MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3MoeForCausalLM whose decoder layers follow the config's FarSkip keys."""

    # The y hand-over is a side effect of each layer's forward: re-running a layer for activation
    # checkpointing would hand over the wrong stream.
    supports_gradient_checkpointing = False

    def __init__(self, config):
        stale = int(getattr(config, "farskip_stale_blocks", 1))
        if stale != 1:
            raise ValueError(f"farskip_stale_blocks={stale}: this modeling file runs the paper's FarSkip "
                             "(one sub-block stale) only; the experimental model runs in farskip_jax")
        super().__init__(config)
        streams = _Streams()
        self.model.layers = nn.ModuleList(
            [FarSkipQwen3MoeDecoderLayer(config, i, streams) for i in range(config.num_hidden_layers)])
        self.post_init()
