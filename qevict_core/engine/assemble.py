"""What attention sees on the PyTorch path: keys and values laid out [quantized | sinks | full | recent].

Between two routing events the quantized tier and its positions do not change, but nothing full-precision of it
may persist (it would be bytes outside the budget), so every step rebuilds it, and a profile found that rebuild a
large share of the PyTorch path's step: ``>>`` and ``&`` to unpack codes, ``cos``/``sin`` of every quantized
position in every layer, ``mul``/``add``/``neg``/``cat`` to rescale and rotate, and a ``cat`` of all tiers. ``assemble`` does the same arithmetic in fewer passes:

- codes are unpacked by one table lookup per byte (``quant.dequantize_packed``);
- cos/sin come from a table the cache builds once per forward for all layers, looked up by window id
  (``QEvictCache.tier_rope``): the same numbers the rotary module gives position by position, and no positions;
- keys are rotated straight into one workspace with rotate_half's sign in the table (four passes, no
  ``rotate_half`` copy), values rescaled into it, and the small full-precision tiers copied after them: no
  concatenation of the whole cache.

The result is bit-identical to ``assemble_reference``, the path it replaced (tests compare the two), so
generation yields the same tokens. The workspace is transient and counted in ``peak_bytes``.
"""

from __future__ import annotations

import torch

from .ledger import WindowLedger
from .quant import dequantize_packed
from .rope import Rope


def assemble(ledger: WindowLedger, fp_keys: list[torch.Tensor], fp_values: list[torch.Tensor],
             cos: torch.Tensor, signed_sin: torch.Tensor, capacity: int = 0,
             dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ledger: the quantized tier (pre-RoPE keys); fp_*: full-precision tiers (B, H, n_i, D) in order; cos,
    signed_sin (B, 1, n*Ω, D): rows for the tier's positions, the sine's first half negated (``tier_rope``).
    -> keys, values (B, H, N, D) in ``dtype`` (default the full-precision tiers': a cache passes the dtype attention
    computes in, so a 16-bit cache beside a float32 model dequantizes in float32, as the kernels do, and widens its
    16-bit tiers once).

    ``capacity``: allocate room for that many tokens and return views of the first N. A caller whose N grows
    from call to call (a prompt read in chunks) then asks the allocator for the same size every time, which it
    reuses; growing requests leave holes that glibc does not hand back, and the process's peak memory grows."""
    b, h, nq, _ = ledger.v_codes.shape
    d = fp_keys[0].shape[-1]
    total = nq + sum(t.shape[2] for t in fp_keys)
    dtype = dtype or fp_keys[0].dtype
    keys = fp_keys[0].new_empty(b, h, max(total, capacity), d, dtype=dtype)[:, :, :total]  # (B, H, N, D)
    values = fp_values[0].new_empty(b, h, max(total, capacity), d, dtype=dtype)[:, :, :total]
    by_window = ledger.k_codes.reshape(b, h, ledger.num_windows, ledger.omega, -1)  # (B, H, n, Ω, D/c)
    quant_keys = dequantize_packed(by_window, ledger.bits, ledger.k_scale.unsqueeze(3), ledger.k_zero.unsqueeze(3),
                                   dtype=keys.dtype)
    _rotate_into(keys[:, :, :nq], quant_keys.reshape(b, h, nq, d), cos, signed_sin)
    dequantize_packed(ledger.v_codes, ledger.bits, ledger.v_scale, ledger.v_zero, out=values[:, :, :nq])
    start = nq
    for k, v in zip(fp_keys, fp_values):
        keys[:, :, start:start + k.shape[2]].copy_(k)
        values[:, :, start:start + v.shape[2]].copy_(v)
        start += k.shape[2]
    return keys, values


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """out = x * cos + rotate_half(x) * sin, with rotate_half's sign in ``signed_sin`` = [−s₁ | s₂]: per half,
    [x₁·c₁ + x₂·(−s₁) | x₂·c₂ + x₁·s₂]. x₂·(−s₁) is −(x₂·s₁) exactly and a + (−b) is a − b, so every element is
    what :meth:`Rope.rotate` computes, bit for bit."""
    half = x.shape[-1] // 2
    torch.mul(x, cos, out=out)
    turned = torch.empty_like(x)  # rotate_half(x) * sin: x's halves multiplied crosswise, no rotated copy of x
    torch.mul(x[..., half:], signed_sin[..., :half], out=turned[..., :half])
    torch.mul(x[..., :half], signed_sin[..., half:], out=turned[..., half:])
    out.add_(turned)


def assemble_reference(ledger: WindowLedger, fp_keys: list[torch.Tensor], fp_values: list[torch.Tensor],
                       rope: Rope, positions: torch.Tensor,
                       dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The path ``assemble`` replaced: unpack with shifts, rotate with the rotary module, concatenate (in
    ``dtype``, default the full-precision tiers')."""
    dtype = dtype or fp_keys[0].dtype
    quant_keys, quant_values = ledger.dequantize_reference(dtype)  # narrower pairs widen to it
    keys = torch.cat([rope.rotate(quant_keys, positions), *(k.to(dtype) for k in fp_keys)], dim=2)
    return keys, torch.cat([quant_values, *(v.to(dtype) for v in fp_values)], dim=2)
