"""One prefill forward for several caches.

Every method attends to the whole prompt during prefill and compresses only after a layer's attention, so the
hidden states of a prefill are the same whichever cache is in use. ``SharedPrefill`` runs the model once and fans
each layer's keys, values and queries out to every cache, which then compresses in its own way: N lanes cost one
forward plus N attention passes instead of N forwards. The next layer's input is the first cache's attention
output; the others' are equal up to float summation order.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .cache_base import ReportingCache


class _FanOut:
    """Stands in as ``module.qevict_layer`` for one layer: runs every cache's attention on its own keys."""

    def __init__(self, layers, returned):
        self.layers, self.returned = layers, returned
        self._keys = returned[0][0]

    def claim(self, keys: torch.Tensor) -> bool:
        mine, self._keys = self._keys is keys, None
        return mine

    def attend(self, module, query, key, value, scaling, dropout):
        outputs = []
        for layer, (keys, values) in zip(self.layers, self.returned):
            layer.claim(keys)
            outputs.append(layer.attend(module, query, keys, values, scaling, dropout))
        return outputs[0]


class SharedPrefill(Cache):
    def __init__(self, caches: list[ReportingCache]):
        super().__init__(layers=caches[0].layers)
        self.caches = caches

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        returned = [cache.update(key_states, value_states, layer_idx) for cache in self.caches]
        module = self.caches[0]._attention_modules[layer_idx]
        module.qevict_layer = _FanOut([cache.layers[layer_idx] for cache in self.caches], returned)
        return returned[0]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.caches[0].get_seq_length(layer_idx)


def shared_prefill(model, input_ids: torch.Tensor, caches: list[ReportingCache]) -> torch.Tensor:
    """Prefill every (fresh) cache with ``input_ids`` in one forward; returns the last position's logits."""
    cache = caches[0] if len(caches) == 1 else SharedPrefill(caches)
    with torch.inference_mode():
        return model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
