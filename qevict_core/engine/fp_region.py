"""The full-precision part of one layer's tiers, [sinks | full | recent], in one buffer the layer owns.

A step writes its token in place and attention reads a view of the live part (or, counting on the device, the
whole buffer): no per-step concatenation of the full-precision keys and values, and the same addresses every step.
From the first routing event on, the buffer holds what the plan charges for (``budget.plan_tiers``): the sinks, K_f
windows, and the recent region with the Ω tokens that arrive between two events, so it is taken once per
generation after the prompt, and every later event rewrites it in place. Before that event the prompt takes what it
needs, and a forward of more tokens than that (a continuation read at once) grows it until the next event brings it
back to the plan's size. The unused part counts as resident (``reserved``): it is memory the cache holds.

A buffer that ``counts`` on the device also keeps ``count``, its live tokens as a tensor: a single decode token is
written at that slot by ``index_copy_`` and attention reads the whole buffer (the reserved tail hidden by slot index),
so a plain step runs the same operators on the same shapes at every fill (what a replayed CUDA graph needs).
"""

from __future__ import annotations

import torch


class FullPrecision:
    """keys, values (B, H, capacity, D): sinks (``sinks`` tokens), then the full tier (``full`` tokens), then the
    recent region, up to ``length``; the rest is reserved room. ``reserve``: the capacity from a routing event on
    (0: exactly what is live, as when nothing is ever routed). ``counts``: keep ``length`` on the device too, and
    zeros in new room (attention reads the reserved tail, masked, and a masked NaN would still poison its sums)."""

    def __init__(self, like: torch.Tensor, reserve: int, counts: bool = False):
        b, h, _, d = like.shape
        self.keys = like.new_empty(b, h, 0, d)
        self.values = like.new_empty(b, h, 0, d)
        self.reserve = reserve
        self.sinks = self.full = self.length = 0
        self.count = torch.zeros(1, dtype=torch.long, device=like.device) if counts else None

    @classmethod
    def join_rows(cls, parts: list[FullPrecision]) -> FullPrecision:
        """Buffers of the same layout as rows of one (one copy; ``count`` (n,), one per part): layer_stack.py."""
        first = parts[0]
        joined = cls.__new__(cls)
        joined.keys = torch.cat([part.keys for part in parts])
        joined.values = torch.cat([part.values for part in parts])
        joined.count = None if first.count is None else torch.cat([part.count for part in parts])
        joined.follow(first)
        return joined

    def take_rows(self, joined: FullPrecision, index: int) -> None:
        """Become part ``index`` of ``joined`` (``join_rows``): views of its rows, its host counters."""
        b = self.keys.shape[0]
        self.keys, self.values = joined.keys[index * b:(index + 1) * b], joined.values[index * b:(index + 1) * b]
        if joined.count is not None:
            self.count = joined.count[index:index + 1]
        self.follow(joined)

    def follow(self, other: FullPrecision) -> None:
        """``other``'s host counters (a buffer of the same layout and fill)."""
        self.reserve, self.sinks, self.full, self.length = other.reserve, other.sinks, other.full, other.length

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[sinks | full | recent] as views (what attention reads)."""
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]

    def replayed(self, n: int, drop: int = 0) -> None:
        """The host half of appending ``n`` decode tokens whose writes a captured graph replayed (it advanced
        ``count``; such a step completes no sinks), then, at a routing event that kept the full tier's size,
        ``drop`` aged tokens leaving the recent region (``rebuild``)."""
        self.length += n - drop

    def part(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        start, stop = {"sink": (0, self.sinks), "full": (self.sinks, self.sinks + self.full),
                       "recent": (self.sinks + self.full, self.length)}[name]
        return self.keys[:, :, start:stop], self.values[:, :, start:stop]

    def append(self, keys: torch.Tensor, values: torch.Tensor, to_sinks: int) -> None:
        """New tokens (B, H, n, D) after the live ones; the first ``to_sinks`` of them complete the sinks (only ever
        before anything else is kept, so they land right after the sinks)."""
        assert not to_sinks or self.length == self.sinks, "sinks are completed before any other token is kept"
        n = keys.shape[2]
        if self.count is not None and n == 1 and self.length < self.capacity:  # at the slot the device counts
            self.keys.index_copy_(2, self.count, keys.to(self.keys.dtype))
            self.values.index_copy_(2, self.count, values.to(self.values.dtype))
        else:
            self._room(self.length + n)
            self.keys[:, :, self.length:self.length + n] = keys
            self.values[:, :, self.length:self.length + n] = values
        self.sinks += to_sinks
        self.length += n
        if self.count is not None:
            self.count.add_(n)

    def rebuild(self, full_k: torch.Tensor, full_v: torch.Tensor, drop: int) -> None:
        """A routing event: the full tier becomes ``full_k/v`` (B, H, F, D; already copies) and the recent region
        loses its first ``drop`` tokens (the windows that aged out)."""
        rest_k, rest_v = self.part("recent")
        rest_k, rest_v = rest_k[:, :, drop:], rest_v[:, :, drop:]
        self._write(full_k, full_v, rest_k, rest_v)

    def drop_recent(self, tokens: int) -> None:
        """The recent region's first ``tokens`` leave it (a prompt stage took them)."""
        rest_k, rest_v = self.part("recent")
        full_k, full_v = self.part("full")
        self._write(full_k, full_v, rest_k[:, :, tokens:], rest_v[:, :, tokens:])

    def set_recent(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The recent region becomes ``keys/values`` (a prompt stage's restored prompt with what followed it)."""
        full_k, full_v = self.part("full")
        self._write(full_k, full_v, keys, values)

    def _write(self, full_k, full_v, rest_k, rest_v) -> None:
        """[sinks | full_k | rest_k]: in place when the size stays, else into storage of the new size. The parts
        may be views of this buffer that the write overlaps, so they are copied out first."""
        length = self.sinks + full_k.shape[2] + rest_k.shape[2]
        size = max(length, self.reserve) if self.reserve else length
        parts = [(full_k, full_v), (rest_k, rest_v)]
        if size == self.capacity:
            parts = [(k.clone(), v.clone()) if k.untyped_storage().data_ptr() == self.keys.untyped_storage().data_ptr()
                     else (k, v) for k, v in parts]
        else:
            keys, values = self._empty(size)
            keys[:, :, :self.sinks], values[:, :, :self.sinks] = self.part("sink")
            self.keys, self.values = keys, values
        at = self.sinks
        for k, v in parts:
            self.keys[:, :, at:at + k.shape[2]] = k
            self.values[:, :, at:at + k.shape[2]] = v
            at += k.shape[2]
        self.full, self.length = full_k.shape[2], length
        if self.count is not None:
            self.count.fill_(length)

    def _room(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        keys, values = self._empty(max(needed, self.reserve))
        keys[:, :, :self.length], values[:, :, :self.length] = self.live()
        self.keys, self.values = keys, values

    def _empty(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, _, d = self.keys.shape
        make = self.keys.new_zeros if self.count is not None else self.keys.new_empty
        return make(b, h, size, d), make(b, h, size, d, dtype=self.values.dtype)

    def nbytes_by_part(self) -> dict[str, int]:
        per_token = (self.keys.nbytes + self.values.nbytes) // max(self.capacity, 1)
        recent = self.length - self.sinks - self.full
        return {"sink": self.sinks * per_token, "full": self.full * per_token, "recent": recent * per_token,
                "reserved": (self.capacity - self.length) * per_token}
