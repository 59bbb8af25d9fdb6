"""Declarative configuration: frozen dataclasses, YAML files, dotted CLI overrides (HF config.json
conversion: `hf_config.py`, which imports this module).

A run's `Config` holds what to compute (`model`: `ModelConfig`, the architecture and its FarSkip
connectivity) apart from how to run it (`execution`: `ExecutionConfig`, farskip_jax/execution.py,
which states the rule for which is which), plus the mesh, training (`train`: `TrainConfig`,
farskip_jax/train_config.py) and free-form sections.

Every field is validated when a config is built. An unknown key or a bad value raises
`ConfigError` naming the dotted key and what is allowed, so a typo in a YAML file or in
`--set model.num_layers=4` fails loudly instead of being ignored. The dict <-> dataclass machinery
is `config_io.py`; this module re-exports it, `ConfigError`, `ExecutionConfig` and the train
section's classes, so
`farskip_jax.config` stays the one place to import config things from.

Most of this module is the fields' comments (what each does, why its default, where it was
measured), kept beside the field they explain.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from farskip_jax.config_io import apply_overrides, from_dict, override, parse_overrides, to_dict
from farskip_jax.errors import ConfigError
from farskip_jax.execution import ExecutionConfig
from farskip_jax.train_config import GenEvalConfig, TrainConfig

__all__ = ["CONFIG_DIR", "Config", "ConfigError", "ExecutionConfig", "FarSkipConfig", "GenEvalConfig",
           "MeshConfig", "ModelConfig", "RopeScaling", "TrainConfig", "apply_overrides", "from_dict",
           "load_config", "migrate_stored_config", "override", "parse_overrides", "resolve_config_path",
           "to_dict"]


# --------------------------------------------------------------------------------------------
# Model


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling: YaRN as DeepSeek-V2 defines it (`rope_scaling` in its config.json), or Llama 3.1's
    frequency-band scaling ("llama3", Llama-4: `factor`, `low_freq_factor`, `high_freq_factor`,
    `original_max_position_embeddings`; the beta/mscale fields are YaRN's only)."""

    type: Literal["yarn", "llama3"] = "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


@dataclasses.dataclass(frozen=True)
class FarSkipConfig:
    """Which layers use FarSkip connectivity (FARSKIP.md section 1).

    `start_idx`/`end_idx` are inclusive layer indices, as in Instella-MoE's HF config keys
    `farskip_start_idx`/`farskip_end_idx`; None means the first/last layer. `first_n`/`last_n`
    are conveniences for the paper's Fig. 3 experiments and override the range.
    """

    enabled: bool = False
    start_idx: int | None = None
    end_idx: int | None = None
    attn_only: bool = False
    mlp_only: bool = False
    first_n: int | None = None
    last_n: int | None = None
    # Sub-blocks of staleness (model/farskip.py has the equations). 1: the paper's FarSkip (each
    # sub-block's input lacks the previous sub-block's communicated output). 2: EXPERIMENTAL, no
    # published system has trained it: each sub-block's input lacks the previous two sub-blocks'
    # outputs, so every TP psum / EP Combine may run under two sub-blocks instead of one. It is a
    # different model (needs FCSD), only with attention and MoE both stale (no attn_only/mlp_only).
    stale_blocks: int = 1

    def layer_range(self, num_layers: int) -> range:
        """Indices of the layers with FarSkip connectivity (empty when disabled)."""
        if not self.enabled:
            return range(0)
        if self.first_n is not None:
            return range(0, min(self.first_n, num_layers))
        if self.last_n is not None:
            return range(max(num_layers - self.last_n, 0), num_layers)
        start = 0 if self.start_idx is None else self.start_idx
        end = num_layers - 1 if self.end_idx is None else self.end_idx
        return range(start, end + 1)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V2/V3, Instella-MoE, Qwen3-MoE and Llama-4 hyper-parameters (names follow HF's
    DeepseekV2Config where one exists). The fields below `tie_word_embeddings`'s group that say what
    the architecture does (attention kind, qk-norm, RoPE layout, layer rule, router scores and
    normalisation, attention gate, Llama-4's attention variants) default to DeepSeek-V2. Widths:
    `intermediate_size` is the dense layers' MLP (Llama-4's `intermediate_size_mlp`),
    `moe_intermediate_size` each routed and shared expert's (Llama-4's `intermediate_size`)."""

    # How to run the model (kernels, exchange, remat, splits, buffers, schedule hints, the student's
    # capacity drop) was in this class until it became `ExecutionConfig` (farskip_jax/execution.py):
    # `model.<key>` of one of those is refused with its new key.
    MOVED_KEYS: ClassVar[Mapping[str, str]] = types.MappingProxyType({k: f"execution.{k}" for k in (
        "capacity_factor", "moe_buffer_factor", "expert_matmul", "ep_exchange", "attention",
        "attention_block_q", "attention_block_kv", "remat", "layer_loop", "tp_microbatches", "tp_reduce",
        "tp_order_barriers", "batch_split", "batch_split_stagger")})

    vocab_size: int = 102400
    hidden_size: int = 2048
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_layers: int = 27
    num_heads: int = 16
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    num_experts_per_tok: int = 6
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    routing: Literal["greedy", "group_limited_greedy"] = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # DeepSeek's original code normalises the top-k weights when this is set (and then does not
    # apply routed_scaling_factor); HF's port ignores the key. We follow DeepSeek's code.
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 163840
    tie_word_embeddings: bool = False
    # Attention: "mla" is DeepSeek-V2's multi-head latent attention (q_lora_rank .. v_head_dim);
    # "gqa" is grouped-query attention (Qwen3-MoE, model/gqa_attention.py) with `num_kv_heads`
    # key/value heads (None: num_heads) of `head_dim` (None: hidden_size // num_heads), optional
    # per-head RMSNorm of q and k before RoPE (`qk_norm`) and projection biases (`attention_bias`).
    attention_kind: Literal["mla", "gqa"] = "mla"
    num_kv_heads: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    attention_bias: bool = False
    # RoPE pairs: "interleaved" rotates (x[2i], x[2i+1]) (DeepSeek-V2's complex form; DeepSeek-V3's
    # rope_interleave=true, whose output order differs by one permutation of q and k alike, so the
    # scores are the same), "half" rotates (x[i], x[i + R/2]) (NeoX rotate-half: Qwen3-MoE, Llama,
    # DeepSeek-V3 with rope_interleave=false).
    rope_style: Literal["interleaved", "half"] = "interleaved"
    # Layer rule: layer i is MoE iff i >= first_k_dense_replace, i not in mlp_only_layers and
    # (i + moe_layer_offset) % moe_layer_freq == 0. DeepSeek-V2: offset 0; Qwen3-MoE: offset 1 with
    # moe_layer_freq = decoder_sparse_step.
    mlp_only_layers: tuple[int, ...] = ()
    moe_layer_offset: int = 0
    # norm_topk_prob renormalises the top-k weights only when num_experts_per_tok >= this:
    # DeepSeek's code skips it for top-1 (2), Qwen3-MoE and DeepSeek-V3 always renormalise (1).
    router_norm_min_k: int = 2
    # Router scores: softmax over the experts (DeepSeek-V2, Qwen3-MoE) or an independent sigmoid per
    # expert (DeepSeek-V3). `router_bias`: a per-expert bias (HF `e_score_correction_bias`) added to
    # the scores for choosing experts only; the combine weights come from the unbiased scores. It is
    # balanced by a rule outside gradient descent, so the model never passes it a gradient.
    # "sigmoid_topk" (Llama-4): the top-k are chosen on the router logits and weighted by the sigmoid
    # of their logits (no bias, no groups).
    router_score: Literal["softmax", "sigmoid", "sigmoid_topk"] = "softmax"
    router_bias: bool = False
    # Llama-4: each routed expert reads its input scaled by its router weight, expert(x * w), and the
    # experts' outputs are summed unweighted (SwiGLU is not linear, so this differs from w * expert(x)).
    expert_input_scaling: bool = False
    # Group-limited routing: a group's score is its best expert's score (DeepSeek-V2) or the sum of
    # its two best (DeepSeek-V3, on the biased scores).
    group_score: Literal["max", "top2_sum"] = "max"
    # routed_scaling_factor multiplies the weights after norm_topk_prob too (DeepSeek-V3); otherwise
    # only the unnormalised weights (DeepSeek-V2's code).
    scale_normalized_weights: bool = False
    # Gated attention (Instella-MoE): the per-head attention output is multiplied by
    # sigmoid(normed input @ W_gate) before o_proj; W_gate [D, H, V] (HF `self_attn.gate_proj`).
    attn_output_gate: bool = False
    # Llama-4 attention (GQA only). `nope_layers`: layers without RoPE (HF no_rope_layers[i] == 0).
    # `attention_chunk_size`: the RoPE layers attend only within chunks of that many positions
    # (causal and pos // chunk equal); the NoPE layers stay full causal. `qk_norm_after_rope`: q and k
    # RMS-normalised without a weight (eps rms_norm_eps) after RoPE, on the RoPE layers only.
    # `attn_temperature_tuning`: on the NoPE layers q is multiplied by
    # 1 + attn_scale * log1p(floor((pos + 1) / floor_scale)).
    nope_layers: tuple[int, ...] = ()
    attention_chunk_size: int | None = None
    qk_norm_after_rope: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    # Auxiliary balance losses of DeepSeek-V2 (expert level, device level); returned, never
    # added by the model itself.
    aux_loss_alpha: float = 0.001
    seq_aux: bool = True
    device_aux_loss_alpha: float = 0.0
    aux_device_groups: int = 1
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    dtype: Literal["float32", "bfloat16"] = "float32"
    farskip: FarSkipConfig = dataclasses.field(default_factory=FarSkipConfig)

    @property
    def kv_heads(self) -> int:
        """Key/value heads of GQA (num_heads when unset)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def attn_head_dim(self) -> int:
        """GQA's per-head q/k/v width (hidden_size // num_heads when unset)."""
        return self.hidden_size // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head (what the softmax scale is computed from)."""
        if self.attention_kind == "gqa":
            return self.attn_head_dim
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_head_dim(self) -> int:
        """Rotary dims per head: MLA's qk_rope_head_dim, GQA's whole head."""
        return self.attn_head_dim if self.attention_kind == "gqa" else self.qk_rope_head_dim

    def uses_rope(self, idx: int) -> bool:
        """Whether layer `idx` rotates q and k (every layer but `nope_layers`)."""
        return idx not in self.nope_layers

    def chunked_layer(self, idx: int) -> bool:
        """Whether layer `idx` attends within `attention_chunk_size` chunks (the RoPE layers)."""
        return self.attention_chunk_size is not None and self.uses_rope(idx)

    def is_moe_layer(self, idx: int) -> bool:
        return (idx >= self.first_k_dense_replace and idx not in self.mlp_only_layers
                and (idx + self.moe_layer_offset) % self.moe_layer_freq == 0)

    def tensor_split_sizes(self) -> dict[str, int]:
        """Every size the tensor-parallel layout splits over `mesh.tensor` (each must divide). GQA's
        key/value heads are not among them: see `tensor_layout_errors`."""
        sizes = {"attention heads": self.num_heads, "routed experts": self.n_routed_experts,
                 "shared-expert width": self.moe_intermediate_size * self.n_shared_experts}
        if any(not self.is_moe_layer(i) for i in range(self.num_layers)):
            sizes["dense MLP width"] = self.intermediate_size
        return sizes

    def tensor_layout_errors(self, tensor: int) -> list[str]:
        """What keeps the tensor-parallel layout from splitting `self` over `tensor` ranks, as
        "name (size)" items; empty when it splits evenly. GQA's key/value heads are split when
        `tensor` divides them and replicated when they divide `tensor` (`tp_kv_heads`)."""
        bad = [f"{name} ({size})" for name, size in self.tensor_split_sizes().items() if size % tensor]
        g = self.kv_heads
        if self.attention_kind == "gqa" and g % tensor and tensor % g:
            bad.append(f"key/value heads ({g}: neither a multiple nor a divisor of {tensor})")
        return bad

    def tp_kv_heads(self, tensor: int) -> int:
        """GQA key/value heads in the tensor-parallel layout over `tensor` ranks: the model's own
        when they split evenly, else one per rank, each head copied to the tensor / G ranks whose
        query heads read it (vLLM's rule for TP beyond the key/value heads, e.g. Qwen3-30B-A3B's 4
        at TP=8)."""
        return max(self.kv_heads, tensor)

    def validate(self) -> None:
        positive = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                    "num_layers", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", "n_routed_experts", "num_experts_per_tok", "moe_layer_freq",
                    "n_group", "topk_group", "aux_device_groups"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        self._validate_architecture()
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"model.num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                f"model.n_routed_experts ({self.n_routed_experts})")
        if self.routing == "group_limited_greedy":
            if self.n_routed_experts % self.n_group:
                raise ConfigError(f"model.n_group ({self.n_group}) must divide n_routed_experts "
                                  f"({self.n_routed_experts})")
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"model.topk_group must be in [1, n_group={self.n_group}], "
                                  f"got {self.topk_group}")
            if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
                raise ConfigError("model.topk_group groups hold fewer experts than num_experts_per_tok")
        fs = self.farskip
        if fs.stale_blocks not in (1, 2):
            raise ConfigError(f"model.farskip.stale_blocks must be 1 or 2, got {fs.stale_blocks}")
        if fs.stale_blocks == 2 and (fs.attn_only or fs.mlp_only):
            raise ConfigError("model.farskip.stale_blocks=2 is defined for attention and MoE both stale: "
                              "it excludes attn_only and mlp_only")
        if fs.attn_only and fs.mlp_only:
            raise ConfigError("model.farskip.attn_only and model.farskip.mlp_only are exclusive")
        if fs.first_n is not None and fs.last_n is not None:
            raise ConfigError("model.farskip.first_n and model.farskip.last_n are exclusive")
        for name in ("start_idx", "end_idx"):
            v = getattr(fs, name)
            if v is not None and not 0 <= v < self.num_layers:
                raise ConfigError(f"model.farskip.{name} must be in [0, {self.num_layers - 1}], got {v}")
        if fs.start_idx is not None and fs.end_idx is not None and fs.start_idx > fs.end_idx:
            raise ConfigError(f"model.farskip.start_idx ({fs.start_idx}) > end_idx ({fs.end_idx})")
        for name in ("first_n", "last_n"):
            v = getattr(fs, name)
            if v is not None and not 0 <= v <= self.num_layers:
                raise ConfigError(f"model.farskip.{name} must be in [0, {self.num_layers}], got {v}")

    def _validate_architecture(self) -> None:
        """The attention-kind, RoPE, layer-rule and router fields."""
        if self.attention_kind == "mla":
            gqa_only = {"num_kv_heads": None, "head_dim": None, "qk_norm": False, "attention_bias": False}
            for name, default in gqa_only.items():
                if getattr(self, name) != default:
                    raise ConfigError(f"model.{name}={getattr(self, name)!r} applies to "
                                      f"model.attention_kind=gqa only (MLA needs {default!r})")
        else:
            for name in ("num_kv_heads", "head_dim"):
                v = getattr(self, name)
                if v is not None and v <= 0:
                    raise ConfigError(f"model.{name} must be > 0 or null, got {v}")
            if self.num_heads % self.kv_heads:
                raise ConfigError(f"model.num_kv_heads ({self.kv_heads}) must divide model.num_heads "
                                  f"({self.num_heads}): each key/value head serves a group of query heads")
            if self.attn_head_dim % 2:
                raise ConfigError(f"model.head_dim must be even (RoPE pairs), got {self.attn_head_dim}")
            if self.rope_scaling is not None and self.rope_scaling.type != "llama3":
                raise ConfigError("model.rope_scaling (YaRN) is implemented as DeepSeek-V2's MLA defines it; "
                                  "model.attention_kind=gqa supports plain RoPE or type llama3")
            if self.attn_output_gate:
                raise ConfigError("model.attn_output_gate is implemented for model.attention_kind=mla only "
                                  "(Instella-MoE)")
        llama4_attention = {"nope_layers": (), "attention_chunk_size": None, "qk_norm_after_rope": False,
                            "attn_temperature_tuning": False}
        for name, default in llama4_attention.items():
            if self.attention_kind != "gqa" and getattr(self, name) != default:
                raise ConfigError(f"model.{name}={getattr(self, name)!r} applies to model.attention_kind=gqa "
                                  "only (Llama-4)")
        if self.attention_chunk_size is not None and self.attention_chunk_size <= 0:
            raise ConfigError(f"model.attention_chunk_size must be > 0 or null, got "
                              f"{self.attention_chunk_size}")
        if self.floor_scale <= 0:
            raise ConfigError(f"model.floor_scale must be > 0, got {self.floor_scale}")
        if self.qk_norm and self.qk_norm_after_rope:
            raise ConfigError("model.qk_norm (weighted, before RoPE) and model.qk_norm_after_rope (no "
                              "weight, after RoPE) are exclusive")
        if self.router_score == "sigmoid_topk" and (self.router_bias or self.routing != "greedy"
                                                    or self.norm_topk_prob):
            raise ConfigError("model.router_score=sigmoid_topk chooses on the plain logits and weights by "
                              "their sigmoid: it needs model.routing=greedy, model.router_bias=false and "
                              "model.norm_topk_prob=false")
        for name in ("mlp_only_layers", "nope_layers"):
            bad = [i for i in getattr(self, name) if not 0 <= i < self.num_layers]
            if bad:
                raise ConfigError(f"model.{name}: layer {bad[0]} is not in [0, {self.num_layers - 1}]")
        if self.moe_layer_offset < 0:
            raise ConfigError(f"model.moe_layer_offset must be >= 0, got {self.moe_layer_offset}")
        if self.router_norm_min_k < 1:
            raise ConfigError(f"model.router_norm_min_k must be >= 1, got {self.router_norm_min_k}")
        if (self.routing == "group_limited_greedy" and self.group_score == "top2_sum"
                and self.n_routed_experts // self.n_group < 2):
            raise ConfigError(f"model.group_score=top2_sum needs >= 2 experts per group, got "
                              f"n_routed_experts={self.n_routed_experts} / n_group={self.n_group}")


# --------------------------------------------------------------------------------------------
# Parallelism (the training and evaluation sections: farskip_jax/train_config.py)


TeacherExperts = Literal["auto", "local", "node", "expert"]


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh. `data` x `expert` devices hold different tokens (training EP); `tensor` splits
    attention heads and experts over one group that shares its activations (inference TP)."""

    data: int = 1
    expert: int = 1
    tensor: int = 1
    # Expert ranks per node when the expert axis spans nodes: > 0 runs the node-aware two-stage
    # exchange (parallel/node_aware.py: each token crosses to a node once, then fans out over the
    # node's NVLink / xGMI). 0, or >= expert: the flat exchange, one NIC crossing per (token, expert)
    # pair beyond the node. auto (default): the devices' own nodes decide (parallel.mesh.
    # expert_ranks_per_node: node-aware where the expert axis spans nodes in whole blocks of ranks,
    # as parallel.make_mesh lays them out; flat inside one node). Est. 1.01-1.16x the flat step at
    # EP16-EP64 (BENCHMARKS K8), never slower.
    expert_per_node: int | Literal["auto"] = "auto"
    # Where the frozen FCSD teacher's routed experts live (it has no gradients or optimizer state,
    # so copies cost only its weights; docs/gpus-and-multi-node.md). expert: over the expert axis, as
    # the student's. node: copied on every node, split over its ranks, so its exchanges stay off the
    # NICs (+2.5 GiB for DeepSeek-V2-Lite on 4 nodes of 8). local: all on every device, nothing
    # exchanged (+23.5 GiB at EP8; BENCHMARKS.md K23). auto: local where execution.remat's search
    # (train/remat.py) finds it fits the memory budget and is estimated faster (never without a
    # budget, e.g. on CPU), else node where the exchange is node-aware and adds <= 4 GiB, else expert.
    teacher_experts: TeacherExperts = "auto"

    def validate(self) -> None:
        for name in ("data", "expert", "tensor"):
            if getattr(self, name) < 1:
                raise ConfigError(f"mesh.{name} must be >= 1, got {getattr(self, name)}")
        if self.expert_per_node != "auto" and (not isinstance(self.expert_per_node, int)
                                                or self.expert_per_node < 0):
            raise ConfigError(f"mesh.expert_per_node must be auto or an integer >= 0, got "
                              f"{self.expert_per_node!r}")
        if self.tensor > 1 and self.expert > 1:
            raise ConfigError("mesh.tensor > 1 and mesh.expert > 1 together are not supported: the TP "
                              "layout splits experts over the tensor axis itself")

    @property
    def num_devices(self) -> int:
        return self.data * self.expert * self.tensor


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run: model (what to compute), execution (how to run it), mesh, train, plus
    free-form sections owned by their subsystems."""

    name: str = "unnamed"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    execution: ExecutionConfig = dataclasses.field(default_factory=ExecutionConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: dict = dataclasses.field(default_factory=dict)
    demo: dict = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        self.model.validate()
        self.execution.validate()
        self.mesh.validate()
        self.train.validate()


# --------------------------------------------------------------------------------------------
# YAML files and stored configs


CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def resolve_config_path(name_or_path: str) -> Path:
    """A config name (`dsv2lite_farskip`) from configs/, or a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    for candidate in (CONFIG_DIR / f"{name_or_path}.yaml", Path(f"{name_or_path}.yaml")):
        if candidate.exists():
            return candidate
    names = sorted(q.stem for q in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.exists() else []
    raise ConfigError(f"config {name_or_path!r} not found; known configs: {names}")


def _load_yaml_tree(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    base = data.pop("base", None)
    if base is None:
        return data
    parent = _load_yaml_tree(resolve_config_path(str(base)))
    return _deep_merge(parent, data)


def _deep_merge(a: dict[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def load_config(name_or_path: str, overrides: Mapping[str, Any] | None = None) -> Config:
    """Loads a YAML config (with optional `base:` inheritance) and applies dotted overrides."""
    path = resolve_config_path(name_or_path)
    tree = _load_yaml_tree(path)
    tree.setdefault("name", path.stem)
    base = to_dict(from_dict(Config, tree))
    merged = apply_overrides(base, overrides or {})
    cfg = from_dict(Config, merged)
    cfg.validate()
    return cfg


def migrate_stored_config(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A config dict stored by any version (a training checkpoint's meta "config", a run's
    config.json; `{"model": d}` for a converted checkpoint's model_config.json) in today's layout:
    the keys that moved from `model` to `execution` (`ModelConfig.MOVED_KEYS`) are moved there.

    For stored configs only: they were valid when written, so the move cannot change what they
    mean. User input (YAML, `--set`, overrides) is never migrated: a moved key there is refused
    with its new name (`config_io.from_dict`). A stored config holding a moved key both under
    `model` and under `execution` is not one any version wrote, and is refused."""
    out = dict(tree)
    model = out.get("model")
    if not isinstance(model, Mapping) or not any(k in ModelConfig.MOVED_KEYS for k in model):
        return out
    execution = dict(out.get("execution") or {})
    model = dict(model)
    for key in [k for k in model if k in ModelConfig.MOVED_KEYS]:
        name = ModelConfig.MOVED_KEYS[key].partition(".")[2]
        if name in execution:
            raise ConfigError(f"stored config holds model.{key} and execution.{name}: no version wrote both")
        execution[name] = model.pop(key)
    out["model"], out["execution"] = model, execution
    return out
