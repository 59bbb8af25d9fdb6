"""FarSkip-Collective connectivity (and Instella-MoE's gated attention) for HF transformers'
DeepSeek-V3, as remote code.

farskip-jax copies this file into every HF export of a FarSkip DeepSeek-V3 or Instella-MoE model and
registers it in config.json (`auto_map`), so that

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

runs the model that was trained. Loaded without `trust_remote_code`, the same directory builds
the stock DeepseekV3ForCausalLM, which ignores the FarSkip keys and the attention gate: a different
model. Needs transformers >= 5 (its DeepSeek-V3 modules are reused, not copied); this file does not
import farskip_jax.

Config keys: Instella-MoE's `farskip`, `farskip_start_idx` (default 0), `farskip_end_idx` (default
the last layer; inclusive, clipped to the last layer), `attn_only_farskip`, `mlp_only_farskip`, and
`gated_attention`: the heads' attention output is multiplied by sigmoid(gate_proj(normed input))
before o_proj (tensor `self_attn.gate_proj.weight`, [heads * v_head_dim, hidden]).

The wiring, with x the residual stream and y the stream without the previous layer's
routed-expert output (farskip_jax/model/farskip.py holds the same recurrence for JAX):

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
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
    DeepseekV3MoE,
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


class _GatedLinear(nn.Linear):
    """o_proj that first multiplies its input by the gate its attention module set for this call
    (a subclass, so that the tensor keeps its name `self_attn.o_proj.weight`)."""

    gate: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * self.gate)


class GatedDeepseekV3Attention(DeepseekV3Attention):
    """Instella-MoE's gated attention: o_proj(attn * sigmoid(gate_proj(h))), h the normed input."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        width = config.num_attention_heads * config.v_head_dim
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.o_proj = _GatedLinear(width, config.hidden_size, bias=config.attention_bias)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        self.o_proj.gate = torch.sigmoid(self.gate_proj(hidden_states))
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self.o_proj.gate = None


class FarSkipDeepseekV3DecoderLayer(DeepseekV3DecoderLayer):
    def __init__(self, config, layer_idx: int, streams: _Streams):
        super().__init__(config, layer_idx)
        if getattr(config, "gated_attention", False):
            self.self_attn = GatedDeepseekV3Attention(config, layer_idx)
        on = layer_idx in farskip_layers(config)
        self.layer_idx = layer_idx
        self.attn_stale = on and not getattr(config, "mlp_only_farskip", False)
        self.mlp_stale = on and not getattr(config, "attn_only_farskip", False)
        self.is_moe = isinstance(self.mlp, DeepseekV3MoE)
        self._streams = streams

    def _moe(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routed, shared) outputs of the MoE on its normed input: y' needs S without R."""
        moe = self.mlp
        _, weights, indices = moe.gate(m)
        routed = moe.experts(m.reshape(-1, m.shape[-1]), indices, weights).view(m.shape)
        return routed, moe.shared_experts(m)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        x = hidden_states
        y = self._streams.y if self.layer_idx > 0 else None
        attn_in = y if self.attn_stale and y is not None else x
        a, _ = self.self_attn(hidden_states=self.input_layernorm(attn_in), **kwargs)
        h = x + a
        m = self.post_attention_layernorm(x if self.mlp_stale else h)
        y_new = None
        if self.is_moe:
            routed, shared = self._moe(m)
            x_new = h + (routed + shared)
            if self.attn_stale:
                y_new = h + shared
        else:
            x_new = h + self.mlp(m)
        self._streams.y = y_new
        return x_new


class FarSkipDeepseekV3ForCausalLM(DeepseekV3ForCausalLM):
    """DeepseekV3ForCausalLM whose decoder layers follow the config's FarSkip keys and, with
    `gated_attention`, gate their attention output (Instella-MoE)."""

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
            [FarSkipDeepseekV3DecoderLayer(config, i, streams) for i in range(config.num_hidden_layers)])
        self.post_init()
