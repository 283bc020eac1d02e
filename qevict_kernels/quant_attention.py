"""Attention over the quantized tier straight from the ledger: no dequantized copy, no chronological rebuild.

Every key of the low-bit tier is older than every query (queries are the newest tokens), so no mask is needed.
One program handles one (batch, KV head, key split): the G query heads of the group (times the query length) form
the rows of one tile, so each key tile is dequantized and rotated once for the whole group. Splits are merged by
log-sum-exp (flash-decoding), and the result is merged with the full-precision segment the same way (merge.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


from .packed import PackedWindows, window_positions
from .ledger_tiles import load_keys, load_values


@triton.jit
def _quant_attention_kernel(q_ptr, k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr,
                            ids_ptr, inv_freq_ptr, out_ptr, lse_ptr, rope_scale, sm_scale, n_tokens, n_windows,
                            tokens_per_split, HKV: tl.constexpr, G: tl.constexpr, LQ: tl.constexpr,
                            SPLITS: tl.constexpr, SINKS: tl.constexpr, OMEGA: tl.constexpr, BITS: tl.constexpr,
                            D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    per_byte: tl.constexpr = 8 // BITS
    dims = tl.arange(0, D)
    rows = tl.arange(0, BLOCK_M)  # row r = query head (hkv * G + r // LQ), query position r % LQ
    rmask = rows < G * LQ
    # q is (B, Hq, LQ, D): the group's heads are contiguous, so rows index it directly.
    q = tl.load(q_ptr + (bh * G * LQ + rows)[:, None] * D + dims[None, :], mask=rmask[:, None], other=0.0)
    q = q.to(tl.float32)
    codes_stride = n_tokens * (D // per_byte)
    k_codes = k_codes_ptr + bh * codes_stride
    v_codes = v_codes_ptr + bh * codes_stride
    k_scale = k_scale_ptr + bh * n_windows * D
    k_zero = k_zero_ptr + bh * n_windows * D
    v_scale = v_scale_ptr + bh * n_tokens
    v_zero = v_zero_ptr + bh * n_tokens
    ids = ids_ptr + b * n_windows

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    start = split * tokens_per_split
    stop = tl.minimum(start + tokens_per_split, n_tokens)
    for block in range(start, stop, BLOCK_N):
        tok = block + tl.arange(0, BLOCK_N)
        tmask = tok < stop
        keys, _ = load_keys(k_codes, k_scale, k_zero, ids, inv_freq_ptr, rope_scale, tok, tmask,
                            SINKS, OMEGA, BITS, D)
        s = tl.dot(q, tl.trans(keys)) * sm_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        values = load_values(v_codes, v_scale, v_zero, tok, tmask, BITS, D)
        acc = acc * alpha[:, None] + tl.dot(p, values)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))
    # out (B, Hq, LQ, SPLITS, D), lse (B, Hq, LQ, SPLITS)
    row_index = (bh * G * LQ + rows) * SPLITS + split
    tl.store(out_ptr + row_index[:, None] * D + dims[None, :], out, mask=rmask[:, None])
    tl.store(lse_ptr + row_index, lse, mask=rmask)


def quant_attention(query: torch.Tensor, ledger: PackedWindows, sinks: int, inv_freq: torch.Tensor,
                    rope_scale: float, sm_scale: float, splits: int | None = None,
                    block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """query (B, Hq, Lq, D) post-RoPE over the ledger's windows -> (out (B, Hq, Lq, D), lse (B, Hq, Lq)), float32."""
    b, hq, lq, d = query.shape
    hkv, n_tokens = ledger.k_codes.shape[1], ledger.k_codes.shape[2]
    groups = hq // hkv
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for the Triton path (got {d})")
    if splits is None:  # enough programs to fill the device, each with a few key blocks
        splits = max(1, min(64, math.ceil(n_tokens / (4 * block_n))))
    per_split = math.ceil(max(n_tokens, 1) / splits / block_n) * block_n
    out = torch.empty(b, hq, lq, splits, d, device=query.device, dtype=torch.float32)
    lse = torch.empty(b, hq, lq, splits, device=query.device, dtype=torch.float32)
    block_m = max(16, triton.next_power_of_2(groups * lq))
    _quant_attention_kernel[(b * hkv, splits)](
        query.contiguous(), ledger.k_codes.contiguous(), ledger.k_scale.contiguous(), ledger.k_zero.contiguous(),
        ledger.v_codes.contiguous(), ledger.v_scale.contiguous(), ledger.v_zero.contiguous(),
        ledger.ids.to(torch.int32).contiguous(), inv_freq.float().contiguous(), out, lse, float(rope_scale),
        float(sm_scale), n_tokens, ledger.num_windows, per_split, HKV=hkv, G=groups, LQ=lq, SPLITS=splits,
        SINKS=sinks, OMEGA=ledger.omega, BITS=ledger.bits, D=d, BLOCK_M=block_m, BLOCK_N=block_n)
    total = torch.logsumexp(lse, dim=-1)
    weights = torch.exp(lse - total.unsqueeze(-1)).nan_to_num(0.0)
    return (out * weights.unsqueeze(-1)).sum(dim=3), total


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float):
    angle = positions.float().unsqueeze(-1) * inv_freq.float()
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos() * rope_scale, angle.sin() * rope_scale


def dequantized_keys_reference(ledger: PackedWindows, sinks: int, inv_freq: torch.Tensor, rope_scale: float,
                               dtype: torch.dtype = torch.float32):
    """The same dequantize + re-rotate in PyTorch, computed in ``dtype``: (keys (B, Hkv, T, D), values)."""
    keys, values = ledger.dequantize(dtype)
    cos, sin = rope_tables(window_positions(ledger.ids, sinks, ledger.omega), inv_freq, rope_scale)
    keys = keys.to(dtype)
    half = keys.shape[-1] // 2
    rotated = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    return keys * cos[:, None].to(dtype) + rotated * sin[:, None].to(dtype), values.to(dtype)


def quant_attention_reference(query, ledger, sinks, inv_freq, rope_scale, sm_scale, dtype=torch.float32):
    """PyTorch attention over the dequantized ledger, all math in ``dtype`` -> (out, lse) float32."""
    keys, values = dequantized_keys_reference(ledger, sinks, inv_freq, rope_scale, dtype)
    b, hq, lq, d = query.shape
    hkv = keys.shape[1]
    q = query.to(dtype).reshape(b, hkv, hq // hkv * lq, d)  # (B, Hkv, G*Lq, D): the group's rows
    scores = q @ keys.transpose(2, 3) * sm_scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ values
    return out.reshape(b, hq, lq, d).float(), lse.reshape(b, hq, lq).float()
