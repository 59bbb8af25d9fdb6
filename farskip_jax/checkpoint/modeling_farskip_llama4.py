"""FarSkip-Collective connectivity for HF transformers' Llama-4 text model, as remote code.

farskip-jax copies this file into every HF export of a FarSkip Llama-4 model and registers it in
config.json (`auto_map`), so that

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

runs the model that was trained. Loaded without `trust_remote_code`, the same directory builds
the stock Llama4ForCausalLM, which ignores the FarSkip keys: regular connectivity, i.e. a
different model. Needs transformers >= 5 (its Llama-4 modules are reused, not copied); this file
does not import farskip_jax.

Config keys (Instella-MoE's): `farskip`, `farskip_start_idx` (default 0), `farskip_end_idx`
(default the last layer; inclusive), `attn_only_farskip`, `mlp_only_farskip`.

The wiring (farskip_jax/model/farskip.py holds the same recurrence for JAX). Llama-4's MoE output
is its shared expert S plus the routed experts R; y, the stream without the previous layer's
routed output, is x + A + S:

    FarSkip MoE layer:  A = Attn(LN1(y));  S, R = MoE(LN2(x))    (attn_only: LN2(x + A))
                        y' = (x + A) + S;  x' = (x + A) + (R + S)
    mlp_only:           attention reads x, the MoE reads LN2(x), no y stream
    dense layer:        A = Attn(LN1(y)), M = MLP(LN2(x)), x' = (x + A) + M, no y stream
    regular layer:      A = Attn(LN1(x)), x' = (x + A) + MoE(LN2(x + A))

A layer that receives no y (the first layer, or one after a dense or regular layer) uses y = x.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama4.modeling_llama4 import (
    Llama4ForCausalLM,
    Llama4TextDecoderLayer,
    Llama4TextMoe,
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


def shared_and_routed(moe: Llama4TextMoe, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, R) of Llama-4's MoE block apart, from its own router, experts and shared expert: every
    expert reads the tokens scaled by its router score (0 for the experts not chosen)."""
    flat = h.reshape(-1, h.shape[-1])
    scores, _ = moe.router(flat)  # [N, E]
    experts = scores.shape[1]
    routed_in = flat.repeat(experts, 1) * scores.transpose(0, 1).reshape(-1, 1)
    routed = moe.experts(routed_in).reshape(experts, flat.shape[0], -1).sum(dim=0)
    return moe.shared_expert(flat).reshape(h.shape), routed.reshape(h.shape)


class _Streams:
    """The y stream one layer hands the next inside a forward pass (None: same as x). Every layer
    overwrites it and layer 0 never reads it, so nothing leaks from one forward pass to the next."""

    y: torch.Tensor | None = None


class FarSkipLlama4TextDecoderLayer(Llama4TextDecoderLayer):
    def __init__(self, config, layer_idx: int, streams: _Streams):
        super().__init__(config, layer_idx)
        on = layer_idx in farskip_layers(config)
        self.attn_stale = on and not getattr(config, "mlp_only_farskip", False)
        self.mlp_stale = on and not getattr(config, "attn_only_farskip", False)
        self._streams = streams

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        x = hidden_states
        y = self._streams.y if self.layer_idx > 0 else None
        attn_in = y if self.attn_stale and y is not None else x
        a, _ = self.self_attn(hidden_states=self.input_layernorm(attn_in), **kwargs)
        h = x + a
        m = self.post_attention_layernorm(x if self.mlp_stale else h)
        if not self.is_moe_layer:
            self._streams.y = None
            return h + self.feed_forward(m)
        shared, routed = shared_and_routed(self.feed_forward, m)
        self._streams.y = h + shared if self.attn_stale else None
        return h + (routed + shared)


class FarSkipLlama4ForCausalLM(Llama4ForCausalLM):
    """Llama4ForCausalLM whose decoder layers follow the config's FarSkip keys."""

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
            [FarSkipLlama4TextDecoderLayer(config, i, streams) for i in range(config.num_hidden_layers)])
        self.post_init()
