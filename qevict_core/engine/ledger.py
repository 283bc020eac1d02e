"""The write-once quantization ledger: packed low-bit windows of one layer.

A window is quantized once, at its first demotion, and its codes and parameters are then only moved (promotion
keeps them as a dormant record, a later demotion reactivates them) or freed (eviction). Nothing here ever
re-quantizes a dequantized tensor, which is what keeps repeated migrations bit-stable (Section 4.3).

Keys are stored in the pre-RoPE domain so that per-channel statistics are not smeared by the rotation; the
caller re-rotates them at their original positions after dequantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import gather_seq
from .quant import UNFIT, codes_per_byte, dequantize, dequantize_packed, pack, quantize, unfit, unpack

# Tensors laid out along the sequence axis (dim 2): per window (key statistics) or per token (codes, value stats).
_PER_WINDOW = ("k_scale", "k_zero")
_SEQ_FIELDS = ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero")
TENSORS = ("ids", *_SEQ_FIELDS)  # every tensor a ledger holds


@dataclass
class WindowLedger:
    """n quantized windows per batch row, window-major in the (B, H, seq, ·) layout.

    ids      (B, n)             int32 window ids
    k_codes  (B, H, n*Ω, D/c)   uint8, c = 8 // bits codes per byte, pre-RoPE keys
    v_codes  (B, H, n*Ω, D/c)   uint8
    k_scale, k_zero (B, H, n, D)     one pair per channel per window
    v_scale, v_zero (B, H, n*Ω, 1)   one pair per token
    """

    ids: torch.Tensor
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    omega: int
    bits: int

    @property
    def num_windows(self) -> int:
        return self.ids.shape[1]

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, omega: int, bits: int, dtype: torch.dtype,
              device: torch.device | str, num_windows: int = 0, zeroed: bool = True) -> WindowLedger:
        """Room for ``num_windows`` windows; ``zeroed=False`` leaves it unwritten (storage to be filled later, whose
        pages take no memory until written)."""
        packed = head_dim // codes_per_byte(bits)
        new = torch.zeros if zeroed else torch.empty
        tokens = num_windows * omega
        return cls(
            ids=new(batch, num_windows, dtype=torch.int32, device=device),
            k_codes=new(batch, heads, tokens, packed, dtype=torch.uint8, device=device),
            v_codes=new(batch, heads, tokens, packed, dtype=torch.uint8, device=device),
            k_scale=new(batch, heads, num_windows, head_dim, dtype=dtype, device=device),
            k_zero=new(batch, heads, num_windows, head_dim, dtype=dtype, device=device),
            v_scale=new(batch, heads, tokens, 1, dtype=dtype, device=device),
            v_zero=new(batch, heads, tokens, 1, dtype=dtype, device=device),
            omega=omega,
            bits=bits,
        )

    @classmethod
    def quantize(cls, keys_prerope: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, omega: int,
                 bits: int, param_dtype: torch.dtype | None = None, check: bool = True) -> WindowLedger:
        """keys_prerope, values (B, H, n*Ω, D); ids (B, n); scales and zero-points in ``param_dtype`` (default the
        keys' dtype). ``check=False``: pairs the dtype cannot hold are left infinite for :meth:`unfit` to find."""
        b, h, t, d = keys_prerope.shape
        n = t // omega
        by_window = keys_prerope.reshape(b, h, n, omega, d)  # (B, H, n, Ω, D)
        k_codes, k_scale, k_zero = quantize(by_window, bits, dim=3, param_dtype=param_dtype, check=check)
        v_codes, v_scale, v_zero = quantize(values, bits, dim=3, param_dtype=param_dtype, check=check)
        return cls(
            ids=ids.to(torch.int32),
            k_codes=pack(k_codes.reshape(b, h, t, d), bits),
            v_codes=pack(v_codes, bits),
            k_scale=k_scale.squeeze(3),
            k_zero=k_zero.squeeze(3),
            v_scale=v_scale,
            v_zero=v_zero,
            omega=omega,
            bits=bits,
        )

    @classmethod
    def quantize_on(cls, backend, keys_prerope: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, omega: int,
                    bits: int, param_dtype: torch.dtype, check: bool) -> tuple[WindowLedger, torch.Tensor | None]:
        """:meth:`quantize` by ``backend``'s kernel where it has one -> (the ledger, unfit (B, n) on the device, or
        None with ``check``, which raises instead)."""
        fields = backend.quantize_windows(keys_prerope, values, omega, bits, param_dtype)
        if fields is None:
            ledger = cls.quantize(keys_prerope, values, ids, omega, bits, param_dtype, check=check)
            return ledger, None if check else ledger.unfit()
        *tensors, unfit = fields
        if check and bool(unfit.any()):
            raise ValueError(f"values up to {float(keys_prerope.abs().max()):.3g} {UNFIT.format(dtype=param_dtype)}")
        return cls(ids.to(torch.int32), *tensors, omega=omega, bits=bits), None if check else unfit

    def unfit(self) -> torch.Tensor:
        """(B, n) bool on the device: windows with a scale or zero-point their dtype could not hold."""
        b, h = self.ids.shape[0], self.k_scale.shape[1]
        keys = unfit(self.k_scale, self.k_zero).any(dim=3)  # (B, H, n)
        values = unfit(self.v_scale, self.v_zero).reshape(b, h, self.num_windows, -1).any(dim=3)
        return (keys | values).any(dim=1)

    def dequantize(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (pre-RoPE keys, values), each (B, H, n*Ω, D) in ``dtype`` (default the scale dtype)."""
        b, h, t, p = self.k_codes.shape
        by_window = self.k_codes.reshape(b, h, self.num_windows, self.omega, p)  # (B, H, n, Ω, D/c)
        keys = dequantize_packed(by_window, self.bits, self.k_scale.unsqueeze(3), self.k_zero.unsqueeze(3),
                                 dtype=dtype)
        values = dequantize_packed(self.v_codes, self.bits, self.v_scale, self.v_zero, dtype=dtype)
        return keys.reshape(b, h, t, -1), values

    def dequantize_reference(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`dequantize` through explicit unpacking (the slower path it replaced; tests compare the two)."""
        b, h, t, _ = self.k_codes.shape
        k_codes = unpack(self.k_codes, self.bits)
        d = k_codes.shape[-1]
        keys = dequantize(k_codes.reshape(b, h, self.num_windows, self.omega, d), self.k_scale.unsqueeze(3),
                          self.k_zero.unsqueeze(3), dtype).reshape(b, h, t, d)
        return keys, dequantize(unpack(self.v_codes, self.bits), self.v_scale, self.v_zero, dtype)

    def select(self, window_idx: torch.Tensor, into: WindowLedger | None = None, flat: bool = False) -> WindowLedger:
        """Per-row selection of windows by slot: window_idx (B, m) -> a ledger of m windows, written into ``into``'s
        storage when it holds m windows and shares none with this ledger (a routing event that keeps a tier's size:
        one copy, its addresses kept), else into new storage. ``flat``: ``gather_seq``'s."""
        if into is not None and not self._can_write(into, window_idx.shape[1]):
            return into.overwrite(self.select(window_idx, flat=flat))
        picked = {"ids": torch.gather(self.ids, 1, window_idx.long(), out=None if into is None else into.ids)}
        for name in _SEQ_FIELDS:
            rows = gather_seq(self._by_window(name), window_idx, out=None if into is None else into._by_window(name),
                              flat=flat)  # (B, H, m, Ω·X): a row a window
            picked[name] = rows.reshape(*rows.shape[:2], -1, getattr(self, name).shape[3])
        return into if into is not None else WindowLedger(**picked, omega=self.omega, bits=self.bits)

    def _can_write(self, into: WindowLedger, num_windows: int) -> bool:
        """Whether a selection of ``num_windows`` can be written straight into ``into``: as many windows, the same
        dtypes, contiguous storage of its own (a view into other tiers' storage is replaced, never written), none
        shared with this ledger (it would read what it overwrites)."""
        mine = {getattr(self, name).untyped_storage().data_ptr() for name in TENSORS}
        return (into.num_windows == num_windows and into.omega == self.omega and into.bits == self.bits
                and all(getattr(into, name).dtype == getattr(self, name).dtype for name in TENSORS)
                and all(getattr(into, name).is_contiguous() for name in TENSORS)
                and not any(getattr(into, name).untyped_storage().data_ptr() in mine for name in TENSORS))

    def overwrite(self, other: WindowLedger) -> WindowLedger:
        """``other``'s windows in this ledger's storage when it holds as many, else ``other`` itself: a routing
        event that keeps the tier's size rewrites it in place, so its tensors keep their addresses. (Only for a
        ledger that owns its storage: a view into storage other tiers share is replaced, never written.)"""
        mine, theirs = ([(getattr(led, f).shape, getattr(led, f).dtype) for f in TENSORS] for led in (self, other))
        if mine != theirs or other.omega != self.omega or other.bits != self.bits:
            return other
        for name in TENSORS:
            getattr(self, name).copy_(getattr(other, name))
        return self

    def cat(self, *others: WindowLedger) -> WindowLedger:
        """Windows of ``self`` then of each of ``others``, in one copy."""
        parts = (self, *others)
        joined = {"ids": torch.cat([part.ids for part in parts], dim=1)}
        joined.update({name: torch.cat([getattr(part, name) for part in parts], dim=2) for name in _SEQ_FIELDS})
        return WindowLedger(**joined, omega=self.omega, bits=self.bits)

    @classmethod
    def join_rows(cls, ledgers: list[WindowLedger]) -> WindowLedger:
        """Ledgers of as many windows as rows of one, in order (one copy): layer_stack.py."""
        first = ledgers[0]
        return cls(**{name: torch.cat([getattr(ledger, name) for ledger in ledgers]) for name in TENSORS},
                   omega=first.omega, bits=first.bits)

    def rows(self, start: int, stop: int) -> WindowLedger:
        """Batch rows ``start:stop`` as views (contiguous: a row is a contiguous run of every field)."""
        return WindowLedger(**{name: getattr(self, name)[start:stop] for name in TENSORS}, omega=self.omega,
                            bits=self.bits)

    def split(self, counts: list[int]) -> list[WindowLedger]:
        """Consecutive runs of ``counts`` windows, as views (no copy): one ledger per run."""
        tokens = [n * self.omega for n in counts]
        fields = {"ids": self.ids.split(counts, dim=1)}
        fields.update({name: getattr(self, name).split(counts if name in _PER_WINDOW else tokens, dim=2)
                       for name in _SEQ_FIELDS})
        return [WindowLedger(**{name: parts[i] for name, parts in fields.items()}, omega=self.omega, bits=self.bits)
                for i in range(len(counts))]

    def _by_window(self, name: str) -> torch.Tensor:
        """A field as one row per window, (B, H, n, Ω·X) for per-token fields: moving whole windows indexes n rows
        instead of n·Ω tokens (8x fewer indices; index_select's cost is per index on the CPU)."""
        field = getattr(self, name)
        if name in _PER_WINDOW:
            return field
        b, h, _, width = field.shape
        return field.reshape(b, h, self.num_windows, self.omega * width)

    def nbytes_by_component(self) -> dict[str, int]:
        return {
            "quantized": self.k_codes.nbytes + self.v_codes.nbytes,
            "quant_meta": self.k_scale.nbytes + self.k_zero.nbytes + self.v_scale.nbytes + self.v_zero.nbytes,
            "index": self.ids.nbytes,
        }
