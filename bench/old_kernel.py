"""The first Triton path's attention kernel (superseded by ``qevict_kernels.lowbit_attention``), kept as the baseline
``bench.kernels`` times the fused kernel against: one program per (row, KV head, split), keys decoded per channel
and again for its RoPE partner, a precise sine and cosine per element, float32 dots, no window log-sum-exp (its
routing mass needed a second pass over the keys). Layout as the engine's ``WindowLedger``."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def load_codes(codes_ptr, tok, dims, tmask, BITS: tl.constexpr, D: tl.constexpr):
    row: tl.constexpr = D * BITS // 8  # bytes per row; code c in byte c % row, bit plane c // row
    packed = tl.load(codes_ptr + tok[:, None] * row + (dims % row)[None, :], mask=tmask[:, None], other=0).to(tl.int32)
    return ((packed >> ((dims // row) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def load_keys(k_codes_ptr, k_scale_ptr, k_zero_ptr, ids_ptr, inv_freq_ptr, rope_scale, tok, tmask,
              SINKS: tl.constexpr, OMEGA: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr):
    """-> (keys (BLOCK_N, D) post-RoPE float32, positions (BLOCK_N,))."""
    dims = tl.arange(0, D)
    half: tl.constexpr = D // 2
    partner = (dims + half) % D
    win = tok // OMEGA
    pos = SINKS + tl.load(ids_ptr + win, mask=tmask, other=0) * OMEGA + tok % OMEGA
    scale = tl.load(k_scale_ptr + win[:, None] * D + dims[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    zero = tl.load(k_zero_ptr + win[:, None] * D + dims[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    p_scale = tl.load(k_scale_ptr + win[:, None] * D + partner[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    p_zero = tl.load(k_zero_ptr + win[:, None] * D + partner[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    k = load_codes(k_codes_ptr, tok, dims, tmask, BITS, D) * scale + zero
    k_partner = load_codes(k_codes_ptr, tok, partner, tmask, BITS, D) * p_scale + p_zero
    freq = tl.load(inv_freq_ptr + dims % half)
    angle = pos.to(tl.float32)[:, None] * freq[None, :]
    sign = tl.where(dims < half, -1.0, 1.0)
    rotated = k * (tl.cos(angle) * rope_scale) + sign[None, :] * k_partner * (tl.sin(angle) * rope_scale)
    return rotated, pos


@triton.jit
def load_values(v_codes_ptr, v_scale_ptr, v_zero_ptr, tok, tmask, BITS: tl.constexpr, D: tl.constexpr):
    dims = tl.arange(0, D)
    scale = tl.load(v_scale_ptr + tok, mask=tmask, other=0.0).to(tl.float32)
    zero = tl.load(v_zero_ptr + tok, mask=tmask, other=0.0).to(tl.float32)
    return load_codes(v_codes_ptr, tok, dims, tmask, BITS, D) * scale[:, None] + zero[:, None]


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


def quant_attention(query: torch.Tensor, ledger, sinks: int, inv_freq: torch.Tensor,
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
