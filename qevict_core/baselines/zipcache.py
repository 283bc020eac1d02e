"""ZipCache (He et al., NeurIPS 2024) as a quantization baseline: every token kept, its precision set by its
normalised attention saliency.

- **Saliency** of a token is the attention it received divided by the number of queries that could see it (the
  normalised score; accumulated attention alone favours early tokens). Per KV head, summed over its query heads.
- **Mixed precision**: per head, the ``salient_frac`` most salient tokens are quantized with ``high_bits`` (4), the
  rest with ``low_bits`` (2). Keys by channel-separable tokenwise quantization (each channel divided by the square
  root of its largest magnitude, then min-max per token, then multiplied back); values min-max per token.
- **Streaming**: the prompt is attended in full precision and compressed right after prefill; decoded tokens wait
  in a full-precision buffer, collecting the attention they receive, and are compressed ``stream`` at a time.

Keys are kept post-RoPE (as the official code does), so no positions are stored: attention is order-free over
keys, and the high- and low-precision stores of a head can hold different tokens. Where it departs from the
official code (ThisisBillhe/ZipCache), and why:

- Saliency comes from the exact attention of every query (the prompt's in chunks, each decode step's as it runs);
  the official code estimates it from a few probe queries (recent plus random) so that FlashAttention can run.
- The decode buffer's accumulated attention is a float32 tensor (one per buffered token and head), counted in the
  bytes; the channel scales are calibrated on the prompt and reused for decoded tokens.
- ``salient_frac`` = 0.4 with 4/2 bits is our setting, not a number from the official configs.
"""

from __future__ import annotations

import torch

from ..engine.attention import sdpa_with_positions
from ..engine.budget import KVShape
from ..engine.cache_base import ReportingCache, ReportingLayer
from ..config import QEvictConfig
from ..engine.quant import dequantize_packed, pack, quantize
from ..engine.key_mass import attend_with_mass, kv_head_mass


class TokenStore:
    """Tokens (B, H, n, D) quantized per token at one bit width; keys divided by per-channel scales first."""

    def __init__(self, like: torch.Tensor, bits: int):
        b, h, _, d = like.shape
        self.bits = bits
        self.k_codes = like.new_zeros(b, h, 0, d * bits // 8, dtype=torch.uint8)
        self.v_codes = self.k_codes
        self.k_scale = self.k_zero = self.v_scale = self.v_zero = like.new_zeros(b, h, 0, 1)

    def add(self, keys: torch.Tensor, values: torch.Tensor, channel: torch.Tensor) -> None:
        k_codes, k_scale, k_zero = quantize(keys / channel, self.bits, dim=3)
        v_codes, v_scale, v_zero = quantize(values, self.bits, dim=3)
        self.k_codes = torch.cat([self.k_codes, pack(k_codes, self.bits)], dim=2)
        self.v_codes = torch.cat([self.v_codes, pack(v_codes, self.bits)], dim=2)
        self.k_scale, self.k_zero = torch.cat([self.k_scale, k_scale], 2), torch.cat([self.k_zero, k_zero], 2)
        self.v_scale, self.v_zero = torch.cat([self.v_scale, v_scale], 2), torch.cat([self.v_zero, v_zero], 2)

    def dequantized(self, channel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = dequantize_packed(self.k_codes, self.bits, self.k_scale, self.k_zero) * channel
        return keys, dequantize_packed(self.v_codes, self.bits, self.v_scale, self.v_zero)

    @property
    def tokens(self) -> int:
        return self.k_codes.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_codes, self.v_codes, self.k_scale, self.k_zero, self.v_scale, self.v_zero]


class ZipCacheLayer(ReportingLayer):
    def lazy_initialization(self, key_states, value_states):
        b, h, _, d = key_states.shape
        self.high = TokenStore(key_states, self.owner.high_bits)
        self.low = TokenStore(key_states, self.owner.low_bits)
        self.channel = None  # (B, H, 1, D): sqrt of each key channel's largest magnitude in the prompt
        self.buf_k, self.buf_v = key_states.new_zeros(b, h, 0, d), value_states.new_zeros(b, h, 0, d)
        self.buf_mass = torch.zeros(b, h, 0, dtype=torch.float32, device=key_states.device)
        self.is_initialized = True

    def append(self, key_states, value_states):
        self.buf_k = torch.cat([self.buf_k, key_states], dim=2)
        self.buf_v = torch.cat([self.buf_v, value_states], dim=2)
        self.buf_mass = torch.cat([self.buf_mass, self.buf_mass.new_zeros(*key_states.shape[:3])], dim=2)
        stored = [s.dequantized(self.channel) for s in (self.high, self.low) if s.tokens]
        keys = torch.cat([k for k, _ in stored] + [self.buf_k], dim=2)
        values = torch.cat([v for _, v in stored] + [self.buf_v], dim=2)
        return keys, values

    def attend(self, module, query, key, value, scaling, dropout, output=True):
        n_buf, q = self.buf_k.shape[2], query.shape[2]
        # Positions only order the buffer (the stores are older than every query): causality needs no more.
        key_pos = torch.arange(self.seen - key.shape[2], self.seen, device=key.device).expand(key.shape[0], -1)
        query_pos = torch.arange(self.seen - q, self.seen, device=key.device)
        if q <= self.owner.stream and dropout == 0.0:
            out, mass = attend_with_mass(query, query_pos, key, key_pos, value, scaling)
        else:  # the prompt: fused attention, its mass in chunks
            out = sdpa_with_positions(module, query, key, value, scaling, dropout) if output else None
            mass = kv_head_mass(query, query_pos, key, key_pos, scaling)
        self.buf_mass += mass[:, :, -n_buf:]
        if self.channel is None or n_buf >= self.owner.stream:
            self._compress()
            self.owner.note_bytes(self.layer_idx)
        return out

    def _compress(self) -> None:
        """Move the buffer into the two stores, the most salient ``salient_frac`` of each head at high precision."""
        b, h, n, d = self.buf_k.shape
        if self.channel is None:
            self.channel = self.buf_k.abs().amax(dim=2, keepdim=True).sqrt().clamp_min(1e-6)
        # Queries that could see buffered token i: every token from i to the newest.
        seen_by = torch.arange(n, 0, -1, device=self.buf_k.device, dtype=torch.float32)
        saliency = self.buf_mass / seen_by  # (B, H, n)
        k_high = round(self.owner.salient_frac * n)
        order = saliency.argsort(dim=2, descending=True, stable=True)
        for store, idx in ((self.high, order[:, :, :k_high]), (self.low, order[:, :, k_high:])):
            if idx.shape[2]:
                index = idx.unsqueeze(-1).expand(-1, -1, -1, d)
                store.add(self.buf_k.gather(2, index), self.buf_v.gather(2, index), self.channel)
        self.buf_k, self.buf_v = self.buf_k[:, :, :0].clone(), self.buf_v[:, :, :0].clone()
        self.buf_mass = self.buf_mass[:, :, :0].clone()

    def resident_bytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {}
        stores = self.high.tensors() + self.low.tensors()
        return {
            "quantized": sum(t.nbytes for t in stores if t.dtype == torch.uint8),
            "quant_meta": sum(t.nbytes for t in stores if t.dtype != torch.uint8)
            + (self.channel.nbytes if self.channel is not None else 0),
            "recent": self.buf_k.nbytes + self.buf_v.nbytes,
            "scores": self.buf_mass.nbytes,
        }

    def tier_counts(self) -> dict[str, int]:
        if not self.is_initialized:
            return {"sink": 0, "recent": 0, "full": 0, "quantized": 0, "evicted": 0}
        return {"sink": 0, "recent": self.buf_k.shape[2], "full": 0,
                "quantized": self.high.tokens + self.low.tokens, "evicted": 0}


class ZipCacheCache(ReportingCache):
    def __init__(self, model, config: QEvictConfig | None, max_length: int, batch_size: int = 1,
                 high_bits: int = 4, low_bits: int = 2, salient_frac: float = 0.4, stream: int = 100):
        if high_bits not in (2, 4, 8) or low_bits not in (2, 4, 8) or low_bits > high_bits:
            raise ValueError(f"bits must be 2, 4 or 8 with low_bits <= high_bits (got {high_bits}, {low_bits})")
        if not 0.0 <= salient_frac <= 1.0:
            raise ValueError(f"salient_frac must lie in [0, 1] (got {salient_frac!r})")
        self.method = "zipcache"
        self.high_bits, self.low_bits, self.salient_frac, self.stream = high_bits, low_bits, salient_frac, stream
        shape = KVShape.from_model(model, batch_size, config)
        layers = [ZipCacheLayer(i, self) for i in range(shape.num_layers)]
        super().__init__(layers, model, shape, max_length, budget_bytes=None)
        self.config = config  # what it was made with (make_cache reports it per lane)
