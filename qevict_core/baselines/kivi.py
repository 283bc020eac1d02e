"""KIVI: tuning-free asymmetric low-bit quantization of the whole cache (a quantization baseline).

Keys are quantized per channel over groups of G tokens (post-RoPE, as in the official code) once R full-precision
keys have accumulated; values per token over groups of G channels, keeping the last R tokens in full precision.
Codes are bit-packed, scales and minimums are kept in the cache's 16-bit dtype (``kv_dtype``), as is the residual.
KIVI has no byte budget: it runs at its own operating point, reported at its measured bytes (~(bits + 2·16/G)/16 of
FullKV plus the residual).
"""

from __future__ import annotations

import torch

from ..engine.budget import KVShape
from ..engine.cache_base import ReportingCache, ReportingLayer
from ..config import QEvictConfig
from ..engine.quant import dequantize, pack, quantize, unpack


class KIVILayer(ReportingLayer):
    def lazy_initialization(self, key_states, value_states):
        b, h, _, d = key_states.shape
        cache = self.owner
        self.value_group = min(cache.group, d)  # channels per value group (tiny test models have D < G)
        empty = key_states[:, :, :0]
        packed = d * cache.bits // 8
        self.k_codes = key_states.new_zeros(b, h, 0, packed, dtype=torch.uint8)
        self.v_codes = key_states.new_zeros(b, h, 0, packed, dtype=torch.uint8)
        self.k_scale = self.k_min = key_states.new_zeros(b, h, 0, d)  # (B, H, T/G, D)
        self.v_scale = self.v_min = key_states.new_zeros(b, h, 0, d // self.value_group)  # (B, H, T, D/G)
        self.k_res, self.v_res = empty, empty
        self.is_initialized = True

    def append(self, key_states, value_states):
        bits, residual, g, gv = self.owner.bits, self.owner.residual, self.owner.group, self.value_group
        # Attention sees what was stored before this call plus this call's tokens in full precision (as the
        # official code and transformers' QuantizedCache do: a prompt is attended unquantized).
        past_keys, past_values = self._dequantized()
        self.k_res = torch.cat([self.k_res, key_states], dim=2)
        self.v_res = torch.cat([self.v_res, value_states], dim=2)
        keys = torch.cat([past_keys, self.k_res], dim=2)
        values = torch.cat([past_values, self.v_res], dim=2)
        full_blocks = self.k_res.shape[2] // residual * residual
        if full_blocks:
            block, self.k_res = self.k_res[:, :, :full_blocks], self.k_res[:, :, full_blocks:].clone()
            b, h, t, d = block.shape
            codes, scale, lo = quantize(block.reshape(b, h, t // g, g, d), bits, dim=3)  # (B, H, T/G, G, D)
            self.k_codes = torch.cat([self.k_codes, pack(codes.reshape(b, h, t, d), bits)], dim=2)
            self.k_scale = torch.cat([self.k_scale, scale.squeeze(3)], dim=2)
            self.k_min = torch.cat([self.k_min, lo.squeeze(3)], dim=2)
        overflow = self.v_res.shape[2] - residual
        if overflow > 0:
            old, self.v_res = self.v_res[:, :, :overflow], self.v_res[:, :, overflow:].clone()
            b, h, t, d = old.shape
            codes, scale, lo = quantize(old.reshape(b, h, t, d // gv, gv), bits, dim=4)  # (B, H, T, D/G, G)
            self.v_codes = torch.cat([self.v_codes, pack(codes.reshape(b, h, t, d), bits)], dim=2)
            self.v_scale = torch.cat([self.v_scale, scale.squeeze(4)], dim=2)
            self.v_min = torch.cat([self.v_min, lo.squeeze(4)], dim=2)
        return keys, values

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, t, _ = self.k_codes.shape
        g, gv, bits = self.owner.group, self.value_group, self.owner.bits
        k_codes = unpack(self.k_codes, bits)
        d = k_codes.shape[-1]
        keys = dequantize(k_codes.reshape(b, h, t // g, g, d), self.k_scale.unsqueeze(3),
                          self.k_min.unsqueeze(3)).reshape(b, h, t, d)
        tv = self.v_codes.shape[2]
        values = dequantize(unpack(self.v_codes, bits).reshape(b, h, tv, d // gv, gv), self.v_scale.unsqueeze(4),
                            self.v_min.unsqueeze(4)).reshape(b, h, tv, d)
        return keys, values

    def resident_bytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {}
        return {
            "quantized": self.k_codes.nbytes + self.v_codes.nbytes,
            "quant_meta": self.k_scale.nbytes + self.k_min.nbytes + self.v_scale.nbytes + self.v_min.nbytes,
            "recent": self.k_res.nbytes + self.v_res.nbytes,
        }

    def tier_counts(self) -> dict[str, int]:
        fp = self.v_res.shape[2] if self.is_initialized else 0
        return {"sink": 0, "recent": fp, "full": 0, "quantized": self.seen - fp, "evicted": 0}


class KIVICache(ReportingCache):
    def __init__(self, model, config: QEvictConfig | None, max_length: int, batch_size: int = 1, bits: int = 2,
                 group: int = 32, residual: int = 32):
        if residual % group:
            raise ValueError(f"KIVI residual length {residual} must be a multiple of the group size {group}")
        self.method = f"kivi{bits}"
        self.bits, self.group, self.residual = bits, group, residual
        shape = KVShape.from_model(model, batch_size, config)
        layers = [KIVILayer(i, self) for i in range(shape.num_layers)]
        super().__init__(layers, model, shape, max_length, budget_bytes=None)
        self.config = config  # what it was made with (make_cache reports it per lane)
