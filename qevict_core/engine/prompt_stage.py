"""A prompt read in chunks, held in INT8 until its last chunk: QEvict's peak memory no longer holds the prompt in
full precision.

Read whole, a 4K prompt's prefill holds every layer's activations for all 4K tokens at once; on SmolLM2 that
transient is larger than FullKV's whole cache, so it set QEvict's peak RSS however small its tiers. Read in chunks,
the activations shrink with the chunk, but QEvict cannot route before the prompt ends: the question that decides
which windows matter usually comes last (the observation window is the prompt's last queries). So until the last
chunk each layer keeps the prompt read so far as INT8 blocks (``PromptStage``: pre-RoPE keys with one scale and
zero-point per channel per block of ``BLOCK`` tokens, values per token, the ledger's own format) and each chunk
attends to it dequantized and re-rotated. The last chunk turns the stage back into full precision, and the prompt
is scored and routed exactly as when it is read whole, on keys within half an INT8 step of the originals. Tokens
that do not fill a block yet stay in full precision in the recent region.

The stage is resident between forwards, so ``resident_bytes`` counts it ("staged") and it sets ``peak_bytes``;
the byte budget holds from the end of the prompt on, as for a prompt read whole (whose full-precision keys are
resident while it is read). Scores of queries before the last chunk are folded as the chunks run, so a scorer
that sums over every prompt query (``prefill_window=0``) sees them all.
"""

from __future__ import annotations

import torch

from .assemble import assemble
from .layout import WindowGrid
from .ledger import WindowLedger
from .rope import unrotate

BITS = 8  # INT8: the prompt must come out of the stage close enough to be routed as if read whole
BLOCK = 64  # tokens per block of key statistics: 8 bytes of scale and zero per token and head at D = 64


class PromptStage:
    """The INT8 blocks of one layer's prompt, from position ``sinks`` on, in order.

    Storage for ``capacity`` tokens is taken once and filled block by block (pages not yet written take no memory), and
    every transient copy is asked for at the same size: a prompt read in chunks otherwise makes requests that grow
    chunk by chunk, and glibc keeps the holes they leave (measured: the process's peak grew with every chunk)."""

    def __init__(self, like: torch.Tensor, sinks: int, capacity: int):
        b, h, _, d = like.shape
        self.grid = WindowGrid(sinks, BLOCK)  # blocks of statistics, laid out as windows are
        self.capacity, self.count = capacity, 0
        self.store = WindowLedger.empty(b, h, d, BLOCK, BITS, like.dtype, like.device,
                                        num_windows=self.grid.whole(capacity), zeroed=False)

    @property
    def num_tokens(self) -> int:
        return self.count * BLOCK

    @property
    def blocks(self) -> WindowLedger:
        """The filled blocks, as views of the storage."""
        n, tokens = self.count, self.count * BLOCK
        store = self.store
        return WindowLedger(ids=store.ids[:, :n], k_codes=store.k_codes[:, :, :tokens],
                            v_codes=store.v_codes[:, :, :tokens], k_scale=store.k_scale[:, :, :n],
                            k_zero=store.k_zero[:, :, :n], v_scale=store.v_scale[:, :, :tokens],
                            v_zero=store.v_zero[:, :, :tokens], omega=BLOCK, bits=BITS)

    def absorb(self, layer) -> None:
        """Move the recent region's whole blocks into the stage (``layer.recent_start`` advances past them)."""
        n = layer.recent_k.shape[2] // BLOCK
        if not n:
            return
        ids = torch.arange(self.count, self.count + n, device=layer.recent_k.device).expand(
            layer.recent_k.shape[0], -1)
        tokens = n * BLOCK
        cos, sin = layer.owner.cos_sin(layer.recent_k, self.grid.positions(ids))
        # codes against the pairs as stored (the keys come out of un-rotation in attention's dtype)
        fresh = WindowLedger.quantize(unrotate(layer.recent_k[:, :, :tokens], cos, sin),
                                      layer.recent_v[:, :, :tokens], ids, BLOCK, BITS, self.store.k_scale.dtype)
        first, last = self.count * BLOCK, (self.count + n) * BLOCK
        store = self.store
        store.ids[:, self.count:self.count + n] = fresh.ids
        store.k_scale[:, :, self.count:self.count + n] = fresh.k_scale
        store.k_zero[:, :, self.count:self.count + n] = fresh.k_zero
        for name in ("k_codes", "v_codes", "v_scale", "v_zero"):
            getattr(store, name)[:, :, first:last] = getattr(fresh, name)
        self.count += n
        layer.drop_recent(tokens)

    def keys_values(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """[stage | sinks | recent], full precision: a transient copy of the prompt so far (attention is order-free
        once keys are rotated; the chunk's own tokens come last, as ``sdpa_with_positions`` needs)."""
        return self._restore(layer, [layer.sink_k, layer.recent_k], [layer.sink_v, layer.recent_v],
                             layer.owner.compute_dtype)

    def positions(self, layer) -> torch.Tensor:
        """(B, N) absolute positions of the keys of :meth:`keys_values`, in its order."""
        b, device = layer.recent_k.shape[0], layer.recent_k.device
        return torch.cat([self.grid.positions(self.blocks.ids),
                          torch.arange(layer.sink_k.shape[2], device=device).expand(b, -1),
                          torch.arange(layer.recent_start, layer.recent_start + layer.recent_k.shape[2],
                                       device=device).expand(b, -1)], dim=1)

    def fold(self, layer, kv_mass: torch.Tensor, q_heads: int) -> None:
        """Per-key mass (B, Hkv, N) over :meth:`keys_values` into the layer's score table, as ``_fold`` does for
        a prompt read whole: every window after the sinks, in order, is a candidate of the first routing event."""
        omega, n_staged, sinks = layer.owner.config.omega, self.num_tokens, layer.sink_k.shape[2]
        per_key = kv_mass.sum(dim=1)  # (B, N)
        tokens = torch.cat([per_key[:, :n_staged], per_key[:, n_staged + sinks:]], dim=1)  # position order
        pad = -tokens.shape[1] % omega
        if pad:
            tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], pad)], dim=1)
        per_window = tokens.reshape(tokens.shape[0], -1, omega).sum(dim=2).div_(q_heads)  # (B, M)
        ids = torch.arange(per_window.shape[1], device=per_window.device).expand(per_window.shape[0], -1)
        layer.owner.scorer.fold(layer.scores, layer.interval, ids, per_window)

    def release(self, layer) -> None:
        """The last chunk: the stage back into the front of the recent region, which then holds the whole prompt
        after the sinks, as when the prompt is read whole."""
        if self.count:
            keys, values = self._restore(layer, [layer.recent_k], [layer.recent_v], layer.owner.shape.dtype)
            layer.restore_recent(keys, values, self.num_tokens)

    def _restore(self, layer, keys: list[torch.Tensor], values: list[torch.Tensor], dtype: torch.dtype):
        """[dequantized, re-rotated stage | *keys] in ``dtype`` (attention's, or the cache's when it is kept):
        ``assemble``, the PyTorch decode path's rebuild."""
        if self.count:
            blocks = self.blocks
            cos, signed_sin = layer.owner.tier_rope(keys[0], blocks.ids, self.grid)
            return assemble(blocks, keys, values, cos, signed_sin, capacity=self.capacity, dtype=dtype)
        total = sum(k.shape[2] for k in keys)
        b, h, _, d = keys[0].shape
        return tuple(torch.cat(parts, dim=2, out=parts[0].new_empty(b, h, self.capacity, d, dtype=dtype)[:, :, :total])
                     for parts in (keys, values))

    def nbytes(self) -> int:
        return sum(self.store.nbytes_by_component().values())
