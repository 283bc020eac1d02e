"""Decode steps replayed from a captured CUDA graph: one launch for the whole model's step instead of hundreds.

A cache whose one-token decode step is the same call at every fill (``replays_steps``: the QEvict family on the
PyTorch or Triton path; FullKV and the eviction baselines on a GPU, in fixed buffers; ``fullkv_static``)
writes its token at a slot it counts on the device and reads its tiers in place, so a step captured once replays at
every later fill, as long as nothing it reads was reallocated or resized (``replay_key``). Plain steps and routing
steps (``replays_routing``: once the tiers keep their sizes and storage across an event, every event is the same
call too) each have a graph. The first step of a kind at given tiers runs eagerly, as a warm-up (a routing step
whose event reallocated something is never captured); the next is captured (the capture runs the step's Python,
which advances the cache's host counters, and the replay that follows does its device work); every later one copies
its inputs into the graph's, replays, and advances the host counters with ``cache.replayed`` (what an eager step
advances; a test compares the two). What a step records for the host (routing events, for the studio) the captured
step writes to tensors, which the host reads after each replay (``cache.replayed_records``).

Positions reach the model as tensors (``cache_position``, ``position_ids``), as a graph's inputs must.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .model_call import call


_CANNOT = ("{method} cannot replay its decode steps from a graph: they follow the cache's fill (graphs need "
           "fixed buffers: FullKV or an eviction baseline on a GPU, fullkv_static, "
           "or a QEvict method on a GPU path, kernels='torch' or 'triton')")


def require_graphs(model, cache) -> None:
    """ValueError, saying why, unless ``cache``'s decode steps can be replayed from CUDA graphs on ``model``."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"decode steps replay from CUDA graphs: the model is on {device.type}, not a GPU")
    if not cache.replays_steps:
        raise ValueError(_CANNOT.format(method=cache.method))


def can_replay(model, caches) -> bool:
    """Whether every one of ``caches`` can replay its decode steps from CUDA graphs on ``model``: what a caller that
    may run anywhere (the studio) asks before it passes ``graphs=True``, so that its lanes are all graphed or all
    eager, never timed differently."""
    try:
        for cache in caches:
            require_graphs(model, cache)
    except ValueError:
        return False
    return True


@dataclass
class _Slot:
    """One captured step: the plain step's or the routing step's, valid while ``key`` holds."""

    key: tuple | None = None
    graph: object = None
    records: list | None = None  # what the step records for the host (routing events), as tensors it writes
    inputs: tuple[torch.Tensor, torch.Tensor] | None = None
    logits: torch.Tensor | None = None


class GraphedSteps:
    """``steps(token)`` -> the next token's logits (B, V), the cache advanced by one step; ``replays`` counts the
    steps a graph stood in for, by kind ("plain", "routing"). ``graph_class``: CUDA graphs by default (a test
    stands another in on the CPU)."""

    def __init__(self, model, cache, graph_class=None):
        if graph_class is None:
            require_graphs(model, cache)
        elif not cache.replays_steps:
            raise ValueError(_CANNOT.format(method=cache.method))
        self.model, self.cache = model, cache
        self.graph_class = graph_class or torch.cuda.CUDAGraph
        self.slots = {"plain": _Slot(), "routing": _Slot()}
        self.replays = {"plain": 0, "routing": 0}

    @torch.inference_mode()  # as every forward of this library: a step's tensors join no autograd graph
    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """token (B, 1) on the model's device."""
        cache = self.cache
        position = cache.get_seq_length()
        kind = "routing" if cache.routes_at(1) else "plain"
        if kind == "routing" and not cache.replays_routing:
            return self._eager(token, position)
        slot, key = self.slots[kind], cache.replay_key()
        if key != slot.key:  # first step of this kind at these tiers: eagerly (a warm-up); the next is captured
            with _side_stream(token):
                logits = self._eager(token, position)
            # an event that reallocated or resized a tier cannot be replayed: it would write where nothing reads
            slot.key, slot.graph = (key if cache.replay_key() == key else None), None
            return logits
        if slot.graph is None:
            self._capture(slot, token, position)
        else:
            slot.inputs[0].copy_(token)
            slot.inputs[1].fill_(position)
            slot.graph.replay()
            cache.replayed(1)
            cache.replayed_records(slot.records)
            self.replays[kind] += 1
        return slot.logits[:, -1].clone()

    def _eager(self, token: torch.Tensor, position: int) -> torch.Tensor:
        positions = torch.tensor([position], device=token.device)
        return self._forward(token, positions)[:, -1]

    def _forward(self, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return call(self.model, token, self.cache, logits_to_keep=1, use_cache=True, cache_position=positions,
                    position_ids=positions.expand(token.shape[0], -1)).logits

    def _capture(self, slot: _Slot, token: torch.Tensor, position: int) -> None:
        """Capture this step (its Python runs: the host counters advance) and replay it (its device work)."""
        slot.inputs = (token.clone(), torch.tensor([position], device=token.device))
        graph = self.graph_class()
        self.cache.capture_records = []  # the step's records wait for the replay: no host read inside a capture
        try:
            with _capturing(graph):
                slot.logits = self._forward(*slot.inputs)
        finally:
            slot.records, self.cache.capture_records = self.cache.capture_records, None
        graph.replay()
        self.cache.replayed_records(slot.records)
        slot.graph = graph


@contextmanager
def _side_stream(like: torch.Tensor):
    """A CUDA warm-up runs on a side stream before a capture (what torch.cuda.graphs asks); elsewhere, nothing."""
    if not like.is_cuda:
        yield
        return
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


def _capturing(graph):
    """CUDA graph capture, on a side stream as torch.cuda.graph does; another graph class gives its own."""
    if isinstance(graph, torch.cuda.CUDAGraph):
        return torch.cuda.graph(graph)
    return graph.capture()
