"""A prefill-only eviction baseline laid out in fixed buffers, so that every decode step is one call (a CUDA graph
can replay it): what ``EvictionCache`` builds on a GPU for a policy that keeps the same tokens in every head and
compresses once, after the prompt (StreamingLLM, SnapKV, CriticalKV); per-head budgets (AdaKV, the DefensiveKVs)
are eviction_ragged.py, and H2O, which evicts at every step, eviction_heavy.py.

The prompt runs as in the chronological layer (eviction.py): per-head lists, the policy's selection. Then every
head's kept tokens move into one buffer (B, H, L, D), L the layer's limit (the selection, its tail and the decoding
reserve: the bytes the plan charges), with a device counter ``count`` of the tokens written since. A decoded token
goes to slot ``f + (count - f) mod (L - f)``, ``f`` the frozen selection: the next free slot while the buffer fills,
then the oldest decoded or tail token's slot, a ring, so the same operators run at every step. Attention reads the
whole buffer, the unwritten slots hidden by their index; keys are post-RoPE, so their order does not matter.

Where it departs from the chronological layer: once the buffer is full, the new token takes the leaving token's
slot before it attends (StreamingLLM's own order: StartRecentKVCache evicts for space first), where the lists
attend over L + 1 tokens and then drop one, which would need a slot the budget does not pay for. So the two read the
same tokens until the first token leaves, then one token apart. The device counter (8 bytes a layer) is paid from
the budget, so where the budget holds the lists' tokens exactly, the buffers hold one token fewer per head.
"""

from __future__ import annotations

import torch

from ..engine.attention import sdpa_with_positions
from ..engine.cache_base import tensor_key
from .eviction import COUNTER_BYTES, EvictionLayer


class FixedEvictionLayer(EvictionLayer):
    steps_at_fixed_shape = True

    @staticmethod
    def index_bytes(heads: int) -> int:
        """What the layer keeps besides its tokens: its device counter."""
        return COUNTER_BYTES

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.key_buffer = self.value_buffer = None  # until the prompt is compressed
        self.count = torch.zeros(1, dtype=torch.long, device=key_states.device)
        self.written = 0  # the host's copy of ``count``

    def append(self, key_states, value_states):
        if self.key_buffer is None:  # the prompt: the policy selects from the lists
            return super().append(key_states, value_states)
        if key_states.shape[2] != 1:
            raise ValueError(f"{self.owner.method} in fixed buffers reads one token per forward after the prompt "
                             f"(got {key_states.shape[2]})")
        self._write(key_states, value_states)
        self._advance(1)
        return self.key_buffer, self.value_buffer

    def _selected(self) -> bool:
        """Whether the prompt's forward left the lists as the buffers keep them: once the policy selected (across
        layers, only once the last layer's prompt is through)."""
        return self.compressed

    def _write(self, key_states, value_states) -> None:
        """A decoded token (B, H, 1, D) into its slot of the ring."""
        frozen, limit = self.frozen[0], self.key_buffer.shape[2]
        slot = (self.count - frozen).remainder_(limit - frozen).add_(frozen)  # (1,)
        self.key_buffer.index_copy_(2, slot, key_states)
        self.value_buffer.index_copy_(2, slot, value_states)
        self.count.add_(1)

    def attend(self, module, query, key, value, scaling, dropout, output=True):
        if self.key_buffer is None:
            out = super().attend(module, query, key, value, scaling, dropout, output)
            if self._selected():
                self._to_buffers()
            return out
        if not output:
            return None
        keys = self.key_buffer
        slots = torch.arange(keys.shape[2], device=keys.device).expand(keys.shape[0], -1)  # (B, L)
        return sdpa_with_positions(module, query, keys, self.value_buffer, scaling, dropout, (slots, self.count - 1))

    def _to_buffers(self) -> None:
        """Every head's kept tokens, (B, n, D) each, into the layer's buffers of ``limit`` slots."""
        kept, limit = self.keys[0].shape[1], self.limit[0]
        b, d = self.keys[0].shape[0], self.keys[0].shape[2]
        self.key_buffer = self.keys[0].new_zeros(b, len(self.keys), limit, d)  # zeros: a masked NaN poisons sums
        self.value_buffer = self.values[0].new_zeros(b, len(self.values), limit, self.values[0].shape[2])
        self.key_buffer[:, :, :kept] = torch.stack(self.keys, dim=1)  # (B, H, n, D)
        self.value_buffer[:, :, :kept] = torch.stack(self.values, dim=1)
        self.owner.note_workspace(sum(t.nbytes for t in self.buffers()))  # beside the lists, briefly
        self.keys = self.values = None
        self.count.fill_(kept)
        self.written = kept
        self.owner.note_bytes(self.layer_idx)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The tensors a decode step reads and writes in place (built after the prompt)."""
        return self.key_buffer, self.value_buffer

    def _advance(self, num_tokens: int) -> None:
        """The host's counters after ``num_tokens`` decoded tokens: each one past the limit evicted one."""
        heads, limit = self.key_buffer.shape[1:3]
        left = max(0, self.written + num_tokens - limit) - max(0, self.written - limit)
        self.owner.evicted += heads * left  # counted per head, as the lists count
        self.written += num_tokens

    def step_key(self) -> tuple:
        return (self.frozen[0], *tensor_key(self.key_buffer, self.value_buffer, self.count))

    def replayed(self, num_tokens: int) -> None:
        self.seen += num_tokens
        self._advance(num_tokens)

    def resident_bytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {}
        if self.key_buffer is None:  # the prompt's lists, and the counter already there
            lists = super().resident_bytes()
            return {**lists, "index": lists["index"] + self.index_bytes(len(self.limit))}
        return {"full": self.key_buffer.nbytes + self.value_buffer.nbytes, "index": self.count.nbytes}

    def tier_counts(self) -> dict[str, int]:
        if self.key_buffer is None:
            return super().tier_counts()
        kept = min(self.written, self.key_buffer.shape[2])
        return {"sink": 0, "recent": 0, "full": kept, "quantized": 0, "evicted": self.seen - kept}
