"""Windows quantized for the low-bit tier in one launch: keys per channel over each window's Ω tokens, values per
token over the channels, codes packed in bit planes, pairs stored in their dtype, and which windows' pairs it could
not hold; in PyTorch (``qevict_core.engine.quant``) the same is some sixty operators per layer and routing event.

It computes what PyTorch computes, bit for bit (a test holds it to that): the arithmetic in float32; a zero-point
rounded down and a scale rounded up to a 16-bit pair dtype (float16 or bfloat16: the nearest value, stepped one unit
in the last place where it fell on the wrong side), then the codes against the stored pair, rounded half to even,
with IEEE divisions (``div_rn``). The bfloat16 rounding is done on the bits: the interpreter truncates.

Layout (``qevict_core.engine.ledger.WindowLedger``): keys, values (B, H, m·Ω, D) pre-RoPE; codes (B, H, m·Ω, P),
P = D·bits/8, code c in byte c % P at bit bits·(c // P); key pairs (B, H, m, D); value pairs (B, H, m·Ω, 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PAIRS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _quant_kernel(k_ptr, v_ptr, k_codes_ptr, v_codes_ptr, k_scale_ptr, k_zero_ptr, v_scale_ptr, v_zero_ptr,
                  unfit_ptr, m, H, OMEGA: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr,
                  BITS: tl.constexpr, PARAM: tl.constexpr):
    b = tl.program_id(0)
    w = tl.program_id(1)
    PER: tl.constexpr = 8 // BITS
    P: tl.constexpr = D // PER
    LEVELS: tl.constexpr = (1 << BITS) - 1
    t = tl.arange(0, BLOCK_T)
    tmask = (t < OMEGA)[:, None, None]
    plane = tl.arange(0, PER)
    byte = tl.arange(0, P)
    channel = plane[:, None] * P + byte[None, :]  # (PER, P): code c = plane * P + byte
    grid = t[:, None, None] * D + channel[None, :, :]  # (T, PER, P) offsets in a window's Ω×D block
    codes_at = t[:, None] * P + byte[None, :]  # (T, P) bytes
    shifts = (plane * BITS)[None, :, None]
    bad = tl.zeros([PER, P], tl.int32)
    bad_v = tl.zeros([BLOCK_T], tl.int32)
    for h in range(H):
        window = (b * H + h) * m + w
        # keys: one pair per channel over the window's tokens
        x = tl.load(k_ptr + window * OMEGA * D + grid, mask=tmask, other=0.0).to(tl.float32)
        lo = tl.min(tl.where(tmask, x, float("inf")), axis=0)
        hi = tl.max(tl.where(tmask, x, float("-inf")), axis=0)
        zero_bits, zero, scale_bits, scale = _pair(lo, hi, LEVELS, PARAM)
        packed = tl.sum(_codes(x, zero[None], scale[None], LEVELS) << shifts, axis=1)
        tl.store(k_codes_ptr + window * OMEGA * P + codes_at, packed.to(tl.uint8), mask=(t < OMEGA)[:, None])
        _store_pair(k_scale_ptr, k_zero_ptr, window * D + channel, scale_bits, scale, zero_bits, zero, True, PARAM)
        bad |= _unfit(scale, zero)
        # values: one pair per token over the channels
        x = tl.load(v_ptr + window * OMEGA * D + grid, mask=tmask, other=0.0).to(tl.float32)
        lo = tl.min(tl.min(x, axis=2), axis=1)
        hi = tl.max(tl.max(x, axis=2), axis=1)
        zero_bits, zero, scale_bits, scale = _pair(lo, hi, LEVELS, PARAM)
        packed = tl.sum(_codes(x, zero[:, None, None], scale[:, None, None], LEVELS) << shifts, axis=1)
        tl.store(v_codes_ptr + window * OMEGA * P + codes_at, packed.to(tl.uint8), mask=(t < OMEGA)[:, None])
        _store_pair(v_scale_ptr, v_zero_ptr, window * OMEGA + t, scale_bits, scale, zero_bits, zero, t < OMEGA, PARAM)
        bad_v |= tl.where(t < OMEGA, _unfit(scale, zero), 0)
    tl.store(unfit_ptr + b * m + w, ((tl.max(tl.max(bad, axis=1), axis=0) + tl.max(bad_v, axis=0)) > 0).to(tl.int8))


@triton.jit
def _pair(lo, hi, LEVELS: tl.constexpr, PARAM: tl.constexpr):
    """(zero's bits, zero, scale's bits, scale) of slices spanning [lo, hi]: the zero-point rounded down and the
    scale up to the pair dtype (as float32 values; bits for a 16-bit dtype)."""
    if PARAM == 0:
        return lo, lo, lo, tl.math.div_rn(hi - lo, float(LEVELS))
    zero_bits, zero = _round_16(lo, PARAM, True)
    scale_bits, scale = _round_16(tl.math.div_rn(hi - zero, float(LEVELS)), PARAM, False)
    return zero_bits, zero, scale_bits, scale


@triton.jit
def _codes(x, zero, scale, LEVELS: tl.constexpr):
    """round((x - zero) / scale) half to even, in [0, LEVELS], as ``quant._codes`` (0 where the scale is 0)."""
    inv = tl.where(scale > 0, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), 0.0)
    y = (x - zero) * inv  # >= 0: zero <= every x
    low = tl.floor(y)
    rest = y - low
    odd = (low.to(tl.int32) & 1) == 1
    up = (rest > 0.5) | ((rest == 0.5) & odd)
    return tl.minimum(tl.maximum(low.to(tl.int32) + up.to(tl.int32), 0), LEVELS)


@triton.jit
def _round_16(x, PARAM: tl.constexpr, DOWN: tl.constexpr):
    """float32 ``x`` -> (its 16-bit pattern, the value in float32) in float16 (PARAM 1) or bfloat16 (2), rounded
    toward -inf (DOWN) or +inf: the nearest value, one unit in the last place further where it fell on the wrong
    side (``quant._round``: nextafter toward the infinity; from ±0 the smallest subnormal of the right sign)."""
    bits = _nearest_16(x, PARAM)
    back = _value_16(bits, PARAM)
    negative = (bits & 0x8000) != 0
    is_zero = (bits & 0x7FFF) == 0
    if DOWN:
        wrong = back > x
        stepped = tl.where(is_zero, 0x8001, tl.where(negative, bits + 1, bits - 1))
    else:
        wrong = back < x
        stepped = tl.where(is_zero, 0x0001, tl.where(negative, bits - 1, bits + 1))
    bits = tl.where(wrong, stepped, bits)
    return bits, _value_16(bits, PARAM)


@triton.jit
def _nearest_16(x, PARAM: tl.constexpr):
    """The 16-bit pattern (int32, 0..65535) nearest ``x``, ties to even."""
    if PARAM == 1:
        return x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    u = x.to(tl.uint32, bitcast=True)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF).to(tl.int32)


@triton.jit
def _value_16(bits, PARAM: tl.constexpr):
    if PARAM == 1:
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _store_pair(scale_ptr, zero_ptr, at, scale_bits, scale, zero_bits, zero, mask, PARAM: tl.constexpr):
    if PARAM == 0:
        tl.store(scale_ptr + at, scale, mask=mask)
        tl.store(zero_ptr + at, zero, mask=mask)
    else:  # 16-bit pairs through an int16 view: the patterns as computed
        tl.store(scale_ptr + at, scale_bits.to(tl.int16), mask=mask)
        tl.store(zero_ptr + at, zero_bits.to(tl.int16), mask=mask)


@triton.jit
def _unfit(scale, zero):
    """1 where a pair is not finite (its dtype could not hold it)."""
    return ((tl.abs(scale) == float("inf")) | (tl.abs(zero) == float("inf")) | (scale != scale)
            | (zero != zero)).to(tl.int32)


def quantize_windows(keys: torch.Tensor, values: torch.Tensor, omega: int, bits: int, param_dtype: torch.dtype):
    """keys (pre-RoPE), values (B, H, m·Ω, D) -> (k_codes, v_codes (B, H, m·Ω, P) uint8, k_scale, k_zero (B, H, m, D),
    v_scale, v_zero (B, H, m·Ω, 1) in ``param_dtype``, unfit (B, m) bool: a window with a pair its dtype cannot
    hold). As ``qevict_core.engine.quant.quantize`` bit for bit."""
    b, h, tokens, d = keys.shape
    m = tokens // omega
    if param_dtype not in PAIRS:
        raise ValueError(f"pairs in {param_dtype} (the kernel stores float32, float16 or bfloat16)")
    per = 8 // bits
    if bits not in (2, 4, 8) or d % per or (d // per) & (d // per - 1):
        raise ValueError(f"bits in (2, 4, 8) and head_dim / (8 // bits) a power of two (got {bits}, {d})")
    device = keys.device
    k_codes = torch.empty(b, h, tokens, d // per, dtype=torch.uint8, device=device)
    v_codes = torch.empty_like(k_codes)
    k_scale, k_zero = (torch.empty(b, h, m, d, dtype=param_dtype, device=device) for _ in range(2))
    v_scale, v_zero = (torch.empty(b, h, tokens, 1, dtype=param_dtype, device=device) for _ in range(2))
    unfit = torch.empty(b, m, dtype=torch.int8, device=device)
    if m:
        raw = [p.view(torch.int16) if p.element_size() == 2 else p for p in (k_scale, k_zero, v_scale, v_zero)]
        _quant_kernel[(b, m)](keys.contiguous(), values.contiguous(), k_codes, v_codes, *raw, unfit, m, h,
                              OMEGA=omega, BLOCK_T=triton.next_power_of_2(omega), D=d, BITS=bits,
                              PARAM=PAIRS[param_dtype])
    return k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, unfit.view(torch.bool)  # 0/1: a view, no launch
