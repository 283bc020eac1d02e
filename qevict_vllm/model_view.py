"""What the engine reads of a model, built from vLLM's Hugging Face config without loading the weights twice.

``QEvictCache`` reads a model's shape (its config), device and dtype (one parameter), its rotary embedding (to
un-rotate keys before they are quantized and re-rotate them after) and one attention module per layer (the layer
attaches itself there). vLLM owns the real model; this view gives the engine exactly those, nothing else.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RotaryEmbedding(nn.Module):
    """cos and sin at absolute positions, as the Hugging Face model's rotary module computes them (default and
    scaled RoPE alike: the same init functions)."""

    def __init__(self, config, device: torch.device):
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        kind = params.get("rope_type", "default")
        if kind == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = scaling

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (self.inv_freq[None, :, None].float() @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        return ((emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype))


class AttentionView(nn.Module):
    """One layer's attention as transformers' SDPA function reads it: its index and its query groups."""

    def __init__(self, layer_idx: int, groups: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_key_value_groups = groups
        self.is_causal = True


class ModelView(nn.Module):
    """config, one parameter (device and dtype), the rotary module and the attention modules: what
    ``make_cache`` needs of a model."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = config
        self.anchor = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)
        self.rotary_emb = RotaryEmbedding(config, device)
        groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None)
                                                or config.num_attention_heads)
        self.attention = nn.ModuleList(AttentionView(i, groups) for i in range(config.num_hidden_layers))

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    def set_attn_implementation(self, name: str) -> None:
        self.config._attn_implementation = name  # vLLM runs the attention; the engine only reads the name back

    @classmethod
    def from_vllm(cls, vllm_config) -> ModelView:
        model = vllm_config.model_config
        config = AutoConfig.from_pretrained(model.model, trust_remote_code=model.trust_remote_code)
        return cls(config.get_text_config(), model.dtype, torch.device("cpu"))
