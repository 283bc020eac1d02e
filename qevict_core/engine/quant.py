"""Asymmetric low-bit quantization with bit-packed codes.

Keys are quantized per channel across the tokens of a window and values per token across channels (the KIVI
split, Section 4.3). Codes are packed along the head dimension, ``8 // bits`` codes per byte, so a window's codes
keep the (batch, kv_heads, seq, packed_dim) layout of the full-precision cache. A row of D codes is packed in
``8 // bits`` bit planes: code c sits in byte c % P at bit bits * (c // P), P = D * bits / 8, so plane k holds the
codes k*P .. (k+1)*P - 1 in order and a kernel unpacks one plane of a row with one shift and one mask over
contiguous bytes (for INT4, byte j holds channels j and j + D/2: the two halves that RoPE rotates together).
"""

from __future__ import annotations

from functools import lru_cache

import torch


def codes_per_byte(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be one of (2, 4, 8) (got {bits!r})")
    return 8 // bits


def quantize(x: torch.Tensor, bits: int, dim: int, param_dtype: torch.dtype | None = None,
             check: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one (scale, zero) pair per slice reduced along ``dim``.

    Returns unpacked uint8 codes and scale/zero in ``param_dtype`` (default ``x``'s dtype), kept along ``dim`` with
    size 1. Dequantization errs by at most scale / 2 per element (round to nearest), computed in float32 (a 16-bit
    result adds its own rounding). ``check``: a pair that ``param_dtype`` cannot hold is a ValueError now (a read
    back from the device); without it the pair is infinite and the caller checks (:func:`unfit`).
    """
    levels = (1 << bits) - 1
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    param_dtype = param_dtype or x.dtype
    if param_dtype != x.dtype or x.element_size() < 4:  # 16-bit inputs: codes computed in float32 all the same
        return _quantize_narrow(x, lo, hi, levels, param_dtype, check)
    scale = (hi - lo) / levels
    return _codes(x, lo, scale, levels), scale, lo


def _codes(x: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    # A constant slice has scale 0: every code is 0 and dequantizes to the zero-point exactly.
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return ((x - zero) * inv).round_().clamp_(0, levels).to(torch.uint8)


def _quantize_narrow(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int, param_dtype: torch.dtype,
                     check: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parameters stored in another dtype than ``x``, or ``x`` in 16 bits: the zero-point rounded down and the scale
    up to ``param_dtype``, so that [zero, zero + levels * scale] still covers the slice, and the codes computed against
    the stored pair: the half-step bound holds for the pair dequantization reads, not for one it never sees. The
    arithmetic runs in float32 at least, where every float16 and bfloat16 pair is exact."""
    work = torch.promote_types(x.dtype, torch.float32)
    x, lo, hi = x.to(work), lo.to(work), hi.to(work)
    zero = _round(lo, param_dtype, down=True)
    scale = _round((hi - zero.to(work)) / levels, param_dtype, down=False)
    if check and not (torch.isfinite(zero) & torch.isfinite(scale)).all():  # one read back, not two
        raise ValueError(f"values up to {float(x.abs().max()):.3g} {UNFIT.format(dtype=param_dtype)}")
    return _codes(x, zero.to(work), scale.to(work), levels), scale, zero


UNFIT = "do not fit {dtype} scales and zero-points: use scale_dtype='model' or 'bfloat16'"


def unfit(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Bool, on the device, per slice: a pair its dtype could not hold (infinite)."""
    return ~(torch.isfinite(scale) & torch.isfinite(zero))


def _round(x: torch.Tensor, dtype: torch.dtype, down: bool) -> torch.Tensor:
    """``x`` in ``dtype``, rounded toward -inf (``down``) or +inf instead of to nearest."""
    near = x.to(dtype)
    wrong = near.to(x.dtype) > x if down else near.to(x.dtype) < x
    # a fill, not a tensor made from host data: a captured CUDA graph cannot copy from the host
    target = torch.full((), float("-inf") if down else float("inf"), dtype=dtype, device=x.device)
    return torch.where(wrong, torch.nextafter(near, target), near)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    return codes.to(dtype or scale.dtype) * scale + zero


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) uint8 codes < 2**bits -> (..., P) bytes, P = D * bits / 8: code c in byte c % P at bit
    bits * (c // P) (the module docstring's bit planes)."""
    per = codes_per_byte(bits)
    if codes.shape[-1] % per:
        raise ValueError(f"last dimension {codes.shape[-1]} must be a multiple of {per} to pack {bits}-bit codes")
    planes = codes.reshape(*codes.shape[:-1], per, codes.shape[-1] // per)  # (..., plane, P)
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    return (planes << shifts[:, None]).sum(dim=-2, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: (..., P) bytes -> (..., P * 8 / bits) codes."""
    return planes_to_row(packed.unsqueeze(-1) >> _shifts(bits, packed.device) & ((1 << bits) - 1))


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 8, bits, device=device, dtype=torch.uint8)


def planes_to_row(per_byte: torch.Tensor) -> torch.Tensor:
    """(..., P, 8 // bits): the codes of each byte, plane by plane -> (..., D) the row in channel order."""
    return per_byte.transpose(-1, -2).reshape(*per_byte.shape[:-2], per_byte.shape[-2] * per_byte.shape[-1])


@lru_cache(maxsize=16)
def _code_table(bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 8 // bits): the codes of every possible byte, as numbers of ``dtype`` (exact: codes are < 16)."""
    return ((torch.arange(256)[:, None] >> _shifts(bits, "cpu")) & ((1 << bits) - 1)).to(dtype=dtype, device=device)


def dequantize_packed(packed: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor,
                      out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dequantize(unpack(packed), scale, zero)`` bit for bit, with one table lookup per byte instead of a shift,
    a mask and a conversion per code (the faster of the two on the CPU).
    packed (..., P) -> (..., P * 8 / bits) in ``out``'s dtype when given, else ``dtype``, else ``scale``'s (scales
    stored narrower are widened by the arithmetic's type promotion, exactly)."""
    dtype = out.dtype if out is not None else dtype or scale.dtype
    table = _code_table(bits, dtype, packed.device)
    per_byte = table.shape[1]
    flat = table.index_select(0, packed.reshape(-1).to(torch.int32))  # (numel, 8 // bits)
    planes = flat.view(*packed.shape, per_byte).transpose(-1, -2)  # (..., 8 // bits, P): plane p, channels p·P..
    if out is None:
        out = flat.new_empty(*packed.shape[:-1], packed.shape[-1] * per_byte)
    # The codes are read plane by plane and the product written in channel order: no pass that only reorders them.
    # Not addcmul: it fuses the multiply-add (one rounding), which is not what ``dequantize`` computes.
    torch.mul(planes, _by_plane(scale, per_byte), out=out.unflatten(-1, (per_byte, -1)))
    return out.add_(zero)


def _by_plane(x: torch.Tensor, per_byte: int) -> torch.Tensor:
    """A scale or zero-point (..., D) per channel, or (..., 1) per token, as a view that broadcasts by plane."""
    return x.unsqueeze(-1) if x.shape[-1] == 1 else x.unflatten(-1, (per_byte, -1))
