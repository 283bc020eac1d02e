"""Eviction baselines whose heads keep different counts (AdaKV, DefensiveKV, Layer-DefensiveKV) in one fixed buffer
per layer, so that every decode step is one call (a CUDA graph can replay it): what ``EvictionCache`` builds on a GPU
for a policy that selects once, after the prompt, per-head budgets allowed.

The prompt runs as in the chronological layer (eviction.py): per-head lists and the policy's selection (across
layers for Layer-DefensiveKV, at the end of the prompt's forward). Then the heads' kept tokens move into one buffer
(1, 1, S, D), head h's in its own segment of L_h slots (its selection, its tail and the decoding reserve: the bytes
the plan charges, S = Σ L_h), so the memory freed per head stays freed. A table (4, H) on the device holds each
segment's start, frozen selection f_h, length L_h and the tokens written to it; a decoded token goes to slot
``start_h + f_h + (count_h - f_h) mod (L_h - f_h)`` of its head's segment: the next free slot while the segment
fills, then a ring, as in eviction_fixed.py. Attention reads the whole buffer, each query head's group seeing only
its KV head's written slots (one SDPA call with a mask; keys are post-RoPE, so their order does not matter).

Where it departs from the chronological layer: as eviction_fixed.py, once a segment is full the new token takes the
leaving token's slot before it attends. The table (32 bytes a head and layer) is paid from the budget, where the
lists pay 4 bytes a head for their lengths, so a head may hold a token fewer.
"""

from __future__ import annotations

import torch

from ..engine.cache_base import tensor_key
from .eviction import COUNTER_BYTES
from .eviction_fixed import FixedEvictionLayer

START, FROZEN, LIMIT, COUNT = range(4)  # the rows of the table


class RaggedEvictionLayer(FixedEvictionLayer):

    @staticmethod
    def index_bytes(heads: int) -> int:
        """What the layer keeps besides its tokens: its (4, H) table."""
        return 4 * heads * COUNTER_BYTES

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.count = self.lengths = None  # the table holds them once the prompt is compressed
        self.table: torch.Tensor | None = None

    def append(self, key_states, value_states):
        if self.key_buffer is None and self.compressed:  # a selection across layers ends with the prompt's forward
            self._to_buffers()
        return super().append(key_states, value_states)

    def _write(self, key_states, value_states) -> None:
        start, frozen, limit, count = self.table
        slots = (count - frozen).remainder_(limit - frozen).add_(frozen).add_(start)  # (H,): each head's slot
        self.key_buffer.index_copy_(2, slots, key_states.transpose(1, 2))  # (1, 1, H, D): head h to slots[h]
        self.value_buffer.index_copy_(2, slots, value_states.transpose(1, 2))
        count.add_(1)

    def attend(self, module, query, key, value, scaling, dropout, output=True):
        if self.key_buffer is None:
            return super().attend(module, query, key, value, scaling, dropout, output)
        if not output:
            return None
        keys, values = self.key_buffer, self.value_buffer
        if keys.dtype != query.dtype:  # a 16-bit cache beside a model computing in float32: widened for this call
            keys, values = keys.to(query.dtype), values.to(query.dtype)
        start, _, limit, count = self.table
        heads, groups = self.table.shape[1], query.shape[1] // self.table.shape[1]
        local = torch.arange(keys.shape[2], device=keys.device) - start[:, None]  # (H, S): slot in head h's segment
        visible = (local >= 0) & (local < torch.minimum(count, limit)[:, None])  # its written slots
        mask = visible.repeat_interleave(groups, dim=0)[None, :, None, :]  # (1, Hq, 1, S): head h's query group
        shape = (1, query.shape[1], keys.shape[2], keys.shape[3])  # every query head reads the one buffer
        out = torch.nn.functional.scaled_dot_product_attention(query, keys.expand(shape), values.expand(shape),
                                                               attn_mask=mask, scale=scaling)
        return out.transpose(1, 2)  # (1, 1, Hq, D), as transformers' attention functions return it

    def _to_buffers(self) -> None:
        """Every head's kept tokens, (1, n_h, D) each, into its segment of the layer's buffer."""
        counts, limits = [k.shape[1] for k in self.keys], self.limit
        total, d = sum(limits), self.keys[0].shape[2]
        self.key_buffer = self.keys[0].new_zeros(1, 1, total, d)  # zeros: a masked NaN poisons sums
        self.value_buffer = self.values[0].new_zeros(1, 1, total, self.values[0].shape[2])
        starts = [sum(limits[:h]) for h in range(len(limits))]
        for h, (first, n) in enumerate(zip(starts, counts)):
            self.key_buffer[0, 0, first:first + n] = self.keys[h][0]
            self.value_buffer[0, 0, first:first + n] = self.values[h][0]
        self.table = torch.tensor([starts, self.frozen, limits, counts], dtype=torch.long,
                                  device=self.key_buffer.device)
        self.owner.note_workspace(sum(t.nbytes for t in self.buffers()))  # beside the lists, briefly
        self.keys = self.values = self.lengths = None
        self.written = counts
        self.owner.note_bytes(self.layer_idx)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.key_buffer, self.value_buffer, self.table

    def _advance(self, num_tokens: int) -> None:
        """The host's counters after ``num_tokens`` decoded tokens: each one past a head's limit evicted one."""
        for h, limit in enumerate(self.limit):
            self.owner.evicted += max(0, self.written[h] + num_tokens - limit) - max(0, self.written[h] - limit)
        self.written = [w + num_tokens for w in self.written]

    def step_key(self) -> tuple:
        return tensor_key(*self.buffers())

    def resident_bytes(self) -> dict[str, int]:
        if not self.is_initialized or self.key_buffer is None:  # the lists, the table's bytes charged already
            return super().resident_bytes()
        return {"full": self.key_buffer.nbytes + self.value_buffer.nbytes, "index": self.table.nbytes}

    def tier_counts(self) -> dict[str, int]:
        if self.key_buffer is None:
            return super().tier_counts()
        kept = round(sum(min(w, limit) for w, limit in zip(self.written, self.limit)) / len(self.limit))
        return {"sink": 0, "recent": 0, "full": kept, "quantized": 0, "evicted": self.seen - kept}
