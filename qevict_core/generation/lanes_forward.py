"""Several caches in one forward: lanes share the model's matrix work.

Prefill: every method attends to the whole prompt and compresses only after a layer's attention, so a prefill's
hidden states are the same whichever cache is in use. One forward fans each layer's keys, values and queries out
to every cache, which then compresses in its own way: N lanes cost one forward plus N attention passes. The next
layer's input is the first cache's attention output; the others' are equal up to float summation order.

Decode: lanes are batch rows. Row i's keys and values go to cache i and row i attends only to cache i, so each lane
decodes exactly as alone while the projections and MLPs run once for the whole batch. Each cache's own part of the
forward (its updates and attention) is timed into ``cache.own_seconds``, so a lane's speed can be told apart.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch
from transformers.cache_utils import Cache

from ..engine.cache_base import ReportingCache
from ..engine.shared_work import sharing
from .model_call import call


class _FanOut:
    """Stands in as ``module.qevict_layer`` for one layer: runs every cache's attention on its own keys."""

    accepts_padding = False  # lanes share one unpadded prompt

    def __init__(self, layers, returned, broadcast: bool):
        self.layers, self.returned, self.broadcast = layers, returned, broadcast
        self._keys = returned[0][0]

    def claim(self, keys: torch.Tensor) -> bool:
        mine, self._keys = self._keys is keys, None
        return mine

    def attend(self, module, query, key, value, scaling, dropout):
        outputs = []
        for row, (layer, (keys, values)) in enumerate(zip(self.layers, self.returned)):
            layer.claim(keys)
            rows = query if self.broadcast else query[row:row + 1]
            # A shared prompt's next layer reads the first lane's output: the others need not compute theirs.
            with own_time(layer.owner):
                outputs.append(layer.attend(module, rows, keys, values, scaling, dropout,
                                            output=not (self.broadcast and row)))
        return outputs[0] if self.broadcast else torch.cat(outputs, dim=0)


@contextmanager
def own_time(cache: ReportingCache):
    """Adds the wall time of the block to ``cache.own_seconds``: the part of a shared forward that is this lane's
    alone (its cache updates and attention). CPU only: on an accelerator the time would be of kernel launches."""
    if cache.device_type != "cpu":
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        cache.own_seconds += time.perf_counter() - started


class LaneBatch(Cache):
    """Caches of batch size 1 driven together: a batch-1 input is shared by all, a batch-N input is split by row."""

    def __init__(self, caches: list[ReportingCache]):
        super().__init__(layers=caches[0].layers)
        self.caches = caches

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        broadcast = key_states.shape[0] == 1
        if not broadcast and key_states.shape[0] != len(self.caches):
            raise ValueError(f"batch of {key_states.shape[0]} rows for {len(self.caches)} lanes")
        returned = []
        for i, cache in enumerate(self.caches):
            with own_time(cache):
                returned.append(cache.update(key_states if broadcast else key_states[i:i + 1],
                                             value_states if broadcast else value_states[i:i + 1], layer_idx))
        module = self.caches[0]._attention_modules[layer_idx]
        module.qevict_layer = _FanOut([cache.layers[layer_idx] for cache in self.caches], returned, broadcast)
        return returned[0]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        lengths = {cache.get_seq_length(layer_idx) for cache in self.caches}
        if len(lengths) != 1:
            raise ValueError(f"lanes have seen different numbers of tokens: {sorted(lengths)}")
        return lengths.pop()


def forward_lanes(model, input_ids: torch.Tensor, caches: list[ReportingCache]) -> torch.Tensor:
    """One forward for all caches; ``input_ids`` (1, T) is shared, (N, 1) gives row i to cache i.
    Returns the last position's logits, one row per cache."""
    cache = caches[0] if len(caches) == 1 else LaneBatch(caches)
    # a shared prompt: lanes that score it alike compute the score once (shared_work.py)
    together = sharing() if len(caches) > 1 and input_ids.shape[0] == 1 else nullcontext()
    with torch.inference_mode(), together:
        logits = call(model, input_ids, cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    return logits.expand(len(caches), -1) if logits.shape[0] == 1 else logits

