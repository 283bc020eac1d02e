"""The uncompressed reference: every token in full precision, reported like every other method.

``fullkv_static`` holds room for ``max_length`` tokens from the start and writes each token in place, as a server or
transformers' StaticCache does: no copy of the cache per step, and every decode step one call, so a CUDA graph can
replay it - the fair baseline of a speed comparison on a GPU.

``fullkv`` grows with the sequence, so that the bytes it reports are about its tokens' (the studio draws them step by
step) and a cache made for a whole context does not hold it from the start: on a CPU token by token, as
transformers' DynamicCache does; on a GPU in buffers grown ``grow_by`` tokens at a time, written in place like
``fullkv_static``'s, so a CUDA graph replays every step between two growths (re-concatenating every layer's keys and
values at every step is what made the growing cache host-bound there)."""

from __future__ import annotations

import torch

from ..engine.budget import KVShape
from ..engine.attention import sdpa_with_positions
from ..engine import cache_base
from ..engine.cache_base import ReportingCache, ReportingLayer, tensor_key
from ..config import QEvictConfig


class FullKVLayer(ReportingLayer):
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def append(self, key_states, value_states):
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        return self.keys, self.values

    def resident_bytes(self) -> dict[str, int]:
        return {"full": self.keys.nbytes + self.values.nbytes} if self.is_initialized else {}

    def tier_counts(self) -> dict[str, int]:
        return {"sink": 0, "recent": 0, "full": self.seen, "quantized": 0, "evicted": 0}


class FullKVCache(ReportingCache):
    method = "fullkv"
    chunked_prefill = "exact"
    fixed_buffers: bool | None = None  # None: in buffers on a GPU, token by token elsewhere
    grow_by: int | None = 256  # tokens a buffer grows by (None: room for max_length from the start)

    def __init__(self, model, config: QEvictConfig | None, max_length: int, batch_size: int = 1):
        shape = KVShape.from_model(model, batch_size, config)
        fixed = self.fixed_buffers
        if fixed is None:
            fixed = cache_base.lays_out_for_graphs(model)
        layer_class = StaticFullKVLayer if fixed else FullKVLayer
        layers = [layer_class(i, self) for i in range(shape.num_layers)]
        super().__init__(layers, model, shape, max_length, budget_bytes=None)
        self.config = config  # what it was made with (make_cache reports it per lane)


class StaticFullKVLayer(FullKVLayer):
    """Keys and values in buffers, as transformers' StaticCache keeps them: room for ``max_length`` tokens, or for
    the next multiple of the cache's ``grow_by`` (at most ``max_length``), grown when a token finds no room. A decode
    token is written at the slot ``count`` (on the device) says and attention reads the whole buffer, the slots not
    yet written hidden by position, so every decode step between two growths is the same call (what a replayed CUDA
    graph needs); a prompt reads its first ``seen`` tokens (a view)."""

    steps_at_fixed_shape = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.key_buffer, self.value_buffer = self._buffers(key_states, value_states, key_states.shape[2])
        self.keys, self.values = self.key_buffer[:, :, :0], self.value_buffer[:, :, :0]
        self.count = torch.zeros(1, dtype=torch.long, device=key_states.device)
        self.whole = False  # the last append returned the whole buffer
        self.is_initialized = True

    def _buffers(self, key_states, value_states, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed buffers with room for ``needed`` tokens (zeros: attention reads the unwritten slots, masked, and a
        masked NaN would still poison its sums)."""
        b, h, _, d = key_states.shape
        grow, length = self.owner.grow_by, self.owner.max_length
        room = length if grow is None else min(length, -(-needed // grow) * grow)
        return key_states.new_zeros(b, h, room, d), value_states.new_zeros(b, h, room, value_states.shape[-1])

    def _grow(self, key_states, value_states, needed: int) -> None:
        keys, values = self._buffers(key_states, value_states, needed)
        self.owner.note_workspace(keys.nbytes + values.nbytes)  # beside the old buffers while they are copied
        keys[:, :, :self.seen], values[:, :, :self.seen] = self.key_buffer[:, :, :self.seen], \
            self.value_buffer[:, :, :self.seen]
        self.key_buffer, self.value_buffer = keys, values

    def append(self, key_states, value_states):
        end = self.seen + key_states.shape[2]
        if end > self.key_buffer.shape[2]:
            self._grow(key_states, value_states, end)
        self.whole = key_states.shape[2] == 1
        if self.whole:
            self.key_buffer.index_copy_(2, self.count, key_states)
            self.value_buffer.index_copy_(2, self.count, value_states)
            self.keys, self.values = self.key_buffer, self.value_buffer
        else:
            self.key_buffer[:, :, self.seen:end] = key_states
            self.value_buffer[:, :, self.seen:end] = value_states
            self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        self.count.add_(key_states.shape[2])
        return self.keys, self.values

    def attend(self, module, query, key, value, scaling: float, dropout: float, output: bool = True):
        if not self.whole or not output:
            return super().attend(module, query, key, value, scaling, dropout, output)
        slots = torch.arange(key.shape[2], device=key.device).expand(key.shape[0], -1)  # (B, N): slot = position
        return sdpa_with_positions(module, query, key, value, scaling, dropout, (slots, self.count - 1))

    def resident_bytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {}
        return {"full": self.key_buffer.nbytes + self.value_buffer.nbytes, "index": self.count.nbytes}

    def step_key(self) -> tuple:
        # a step that must grow the buffers is not the captured one: it runs eagerly
        return (self.seen < self.key_buffer.shape[2], *tensor_key(self.key_buffer, self.value_buffer, self.count))

    def replayed(self, num_tokens: int) -> None:
        self.seen += num_tokens  # the graph wrote the token and advanced ``count``
        self.whole = True
        self.keys, self.values = self.key_buffer, self.value_buffer


class StaticFullKVCache(FullKVCache):
    method = "fullkv_static"
    fixed_buffers = True
    grow_by = None
