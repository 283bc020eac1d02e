"""What every cache in the registry shares: measured byte reports, tier counts, events, and the link to the
model's attention modules.

A ``ReportingCache`` is a transformers ``Cache`` whose layers are ``ReportingLayer``s. Reports are measured:
each layer lists the ``nbytes`` of the tensors it keeps, and the cache adds them up.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import sdpa_with_positions, use_qevict_attention
from .budget import KVShape


class ReportingLayer(CacheLayerMixin):
    """A cache layer that reports the tensors it keeps. Layout (B, H, T, D) everywhere.

    ``accepts_padding``: the layer attends through ``attend_rows`` with the batch's attention mask (padded.py);
    other layers never see a padded batch (the attention function refuses it)."""

    accepts_padding = False
    steps_at_fixed_shape = False  # every decode step of one token is the same call (a graph can replay it)
    stacks_as_rows = False  # its tiers can be rows of one storage with its cache's other layers' (layer_stack.py)

    def __init__(self, layer_idx: int, owner: ReportingCache):
        super().__init__()
        self.layer_idx = layer_idx
        self.owner = owner
        self.seen = 0

    def update(self, key_states, value_states, *args, **kwargs):
        """Store new tokens (B, H, n, D) and return what attention must see (or the new states as a handle for
        layers whose ``attend`` reads their own stores)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_length(key_states.shape[2])
        keys, values = self.append(key_states, value_states)
        self.seen += key_states.shape[2]
        return self.returning(keys, values)

    @abstractmethod
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the tokens at positions ``seen ..``; -> what ``update`` returns."""

    @abstractmethod
    def resident_bytes(self) -> dict[str, int]:
        """nbytes of every persistent tensor, by component."""

    @abstractmethod
    def tier_counts(self) -> dict[str, int]:
        """Tokens per tier (sink, recent, full, quantized, evicted)."""

    def attend(self, module, query, key, value, scaling: float, dropout: float,
               output: bool = True) -> torch.Tensor | None:
        """Attention over what ``update`` returned; layers that score or route override this. ``output=False``:
        the caller discards the output (a lane of a shared prompt forward whose hidden states are another lane's,
        lanes_forward.py), so a prompt's attention output need not be computed; everything else happens."""
        return sdpa_with_positions(module, query, key, value, scaling, dropout) if output else None

    def claim(self, keys: torch.Tensor) -> bool:
        """True once for the keys the last ``update`` returned: this attention call belongs to this cache."""
        mine = getattr(self, "_returned_keys", None) is keys
        self._returned_keys = None
        return mine

    def returning(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._returned_keys = keys
        return keys, values

    def replayed(self, num_tokens: int) -> None:
        """The host half of a decode step whose device work a captured graph replayed (``ReportingCache.replayed``):
        only layers whose every decode step is one call have one."""
        raise NotImplementedError(f"{type(self).__name__} has no decode step a graph could replay")

    def step_key(self) -> tuple:
        """What a replayed decode step of this layer depends on (``ReportingCache.replay_key``)."""
        raise NotImplementedError(f"{type(self).__name__} has no decode step a graph could replay")

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def _check_length(self, incoming: int) -> None:
        if self.seen + incoming > self.owner.max_length:
            raise ValueError(
                f"this cache was sized for max_length={self.owner.max_length} tokens; "
                f"{self.seen + incoming} would exceed it (make the cache with a larger max_length)"
            )


class ReportingCache(Cache):
    """Base of every registry cache. ``step`` counts forwards (0 = prefill, the prompt's last chunk when it is read
    in chunks).

    ``chunked_prefill``: how the cache reads a prompt given in several forwards (``prefill.py``): "exact" (it keeps
    every token as it comes), "staged" (it holds the prompt compactly until the last chunk, then treats the prompt
    as if read whole), or None: it decides what to keep from its first forward, so a chunk would be taken for the
    whole prompt, and it refuses chunks."""

    method = "base"
    chunked_prefill: str | None = None
    config = None  # the QEvictConfig it runs with, after its method's own settings; None where it reads none
    fitted = None  # factory.Fitted when make_cache ran it above the asked budget (the least it can run with)

    def __init__(self, layers: list[ReportingLayer], model, shape: KVShape, max_length: int,
                 budget_bytes: int | None):
        super().__init__(layers=layers)
        use_qevict_attention(model)  # wraps the model's own implementation: other caches still run it
        self.shape = shape
        self.max_length = max_length
        self.budget_bytes = budget_bytes
        self.events: list = []
        self.step = -1
        self.staging = False  # the next forwards are chunks of the prompt before its last (set by prefill.py)
        self.peak_bytes = 0
        self.own_seconds = 0.0  # time spent in this cache's own work inside shared forwards (lanes_forward.py)
        param = next(model.parameters())
        self.device_type = param.device.type
        self.compute_dtype = param.dtype  # what attention computes in; shape.dtype is what the cache stores
        self._layer_bytes = [0] * len(layers)
        self._attention_modules = _attention_modules(model, len(layers))

    # -- transformers Cache API -------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            self.step += not self.staging
            self.begin_forward(key_states.shape[-2])
        if key_states.dtype != self.shape.dtype:  # stored in kv_dtype (16 bits) whatever the model computes in
            key_states, value_states = key_states.to(self.shape.dtype), value_states.to(self.shape.dtype)
        # The attention function finds the layer through its module: the cache attaches itself while in use.
        self._attention_modules[layer_idx].qevict_layer = self.layers[layer_idx]
        keys, values = self.layers[layer_idx].update(key_states, value_states)
        self.note_bytes(layer_idx)
        return keys, values

    def begin_forward(self, num_tokens: int) -> None:
        """Hook for caches that keep a schedule (all layers see the same step)."""

    # -- decode steps replayed from a captured graph (generation/graphs.py) -------------------------------------
    @property
    def replays_steps(self) -> bool:
        """Whether a decode step of one token is the same call at every fill (same operators, shapes, arguments and
        addresses while ``replay_key`` holds), so that a captured graph can stand in for it."""
        return all(layer.steps_at_fixed_shape for layer in self.layers)

    @property
    def replays_routing(self) -> bool:
        """Whether a routing step, too, is one call once the tiers keep their sizes and storage across events."""
        return False

    def routes_at(self, num_tokens: int) -> bool:
        """Whether the next forward of ``num_tokens`` would move tokens between tiers (never, by default)."""
        return False

    # While a graph captures a step: what the step records for the host (a list), read after each replay
    capture_records: list | None = None

    def replayed_records(self, records: list) -> None:
        """The host half of what a replayed step records (events), from the tensors its capture wrote them to."""

    def replay_key(self) -> tuple:
        """What a captured step depends on beyond its inputs: every layer's persistent tensors (shape, dtype,
        address) and the sizes that shape the step. A graph replays only while it is unchanged."""
        return tuple(layer.step_key() for layer in self.layers)

    def replayed(self, num_tokens: int = 1) -> None:
        """The host half of a decode step whose device work a graph replayed: the counters advance as that step
        advances them when it runs eagerly (a test compares the two)."""
        self.step += 1
        self.begin_forward(num_tokens)
        for layer in self.layers:
            layer.replayed(num_tokens)

    def require_chunked_prefill(self) -> None:
        """ValueError, saying which methods can, unless this cache reads a prompt in chunks."""
        if self.chunked_prefill is None:
            raise ValueError(f"{self.method} cannot read a prompt in chunks: it decides what to keep from the first "
                             "forward it sees. Chunked prefill works with fullkv and the QEvict family except "
                             "qevict_head, without padded=True; read the prompt whole "
                             "(prefill_chunk=None) otherwise.")

    def read_prompt_chunk(self, more_to_come: bool) -> None:
        """The next forward is a chunk of the prompt; ``more_to_come``: it is not the last one."""
        self.require_chunked_prefill()
        if self.step >= 0:
            raise ValueError("the prompt was already read: chunks go before the first generated token")
        self.staging = more_to_come

    # -- reports ----------------------------------------------------------------------------------------------
    def note_bytes(self, layer_idx: int) -> None:
        self._layer_bytes[layer_idx] = sum(self.layers[layer_idx].resident_bytes().values())
        self.peak_bytes = max(self.peak_bytes, sum(self._layer_bytes))

    def note_workspace(self, nbytes: int) -> None:
        """A transient buffer of ``nbytes`` exists now, next to the resident tensors: it counts towards the peak."""
        self.peak_bytes = max(self.peak_bytes, sum(self._layer_bytes) + nbytes)

    def memory_report(self) -> dict:
        components: dict[str, int] = {}
        for layer in self.layers:
            for name, nbytes in layer.resident_bytes().items():
                components[name] = components.get(name, 0) + nbytes
        total = sum(components.values())
        seen = self.get_seq_length()
        fullkv = self.shape.fullkv_bytes(seen)
        return {
            "total_bytes": total,
            "fullkv_bytes": fullkv,
            "ratio": total / fullkv if fullkv else 0.0,
            "budget_bytes": self.budget_bytes,
            "budget_ratio": (self.budget_bytes / self.shape.fullkv_bytes(self.max_length)
                             if self.budget_bytes is not None else None),
            "peak_bytes": self.peak_bytes,
            "seen": seen,
            "max_length": self.max_length,
            "components": components,
        }

    def tier_counts(self) -> list[dict[str, int]]:
        return [layer.tier_counts() for layer in self.layers]

    def routed(self) -> bool:
        """Whether the last forward moved tokens between tiers (caches that route on a schedule override this)."""
        return False

    def drain_events(self) -> list:
        events, self.events = self.events, []
        return events

    def summary(self) -> dict:
        return {}


def _attention_modules(model, num_layers: int) -> list:
    found = {m.layer_idx: m for m in model.modules()
             if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")}
    if sorted(found) != list(range(num_layers)):
        raise ValueError(f"{type(model).__name__}: expected attention modules for layers 0..{num_layers - 1}, "
                         f"found {sorted(found)}")
    return [found[i] for i in range(num_layers)]


def lays_out_for_graphs(model) -> bool:
    """Whether caches made for ``model`` lay their decode steps out for CUDA graphs where they can (fixed buffers,
    the same call at every fill): on a GPU, where graphs replay; elsewhere the layouts that follow the fill."""
    return next(model.parameters()).device.type == "cuda"


def tensor_key(*tensors: torch.Tensor | None) -> tuple:
    """(shape, dtype, address) of each tensor, None for none: what a captured graph reads in place."""
    return tuple(None if t is None else (tuple(t.shape), t.dtype, t.data_ptr()) for t in tensors)
