"""Decode steps replayed from a captured CUDA graph: one launch for the whole model's step instead of hundreds.

A cache whose one-token decode step is the same call at every fill (``replays_steps``: the PyTorch path of the
QEvict family, ``fullkv_static``) writes its token at a slot it counts on the device and reads its tiers in place,
so a step captured once replays at every later fill, as long as nothing it reads was reallocated or resized
(``replay_key``). A step that routes, and the first plain step after the tiers change size, run eagerly; the plain
step after that is captured (the capture runs the step's Python, which advances the cache's host counters, and the
replay that follows does its device work); every later plain step copies its inputs into the graph's, replays, and
advances the host counters with ``cache.replayed`` (what an eager step advances; a test compares the two).

Positions reach the model as tensors (``cache_position``, ``position_ids``), as a graph's inputs must.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .model_call import call


_CANNOT = ("{method} cannot replay its decode steps from a graph: they follow the cache's fill (graphs need "
           "fullkv_static or a QEvict method on its PyTorch path, kernels='torch')")


def require_graphs(model, cache) -> None:
    """ValueError, saying why, unless ``cache``'s decode steps can be replayed from CUDA graphs on ``model``."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"decode steps replay from CUDA graphs: the model is on {device.type}, not a GPU")
    if not cache.replays_steps:
        raise ValueError(_CANNOT.format(method=cache.method))


class GraphedSteps:
    """``steps(token)`` -> the next token's logits (B, V), the cache advanced by one step; ``replays`` counts the
    steps a graph stood in for. ``graph_class``: CUDA graphs by default (a test stands another in on the CPU)."""

    def __init__(self, model, cache, graph_class=None):
        if graph_class is None:
            require_graphs(model, cache)
        elif not cache.replays_steps:
            raise ValueError(_CANNOT.format(method=cache.method))
        self.model, self.cache = model, cache
        self.graph_class = graph_class or torch.cuda.CUDAGraph
        self.graph = None
        self.key: tuple | None = None
        self.replays = 0
        self._inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._logits: torch.Tensor | None = None

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """token (B, 1) on the model's device."""
        cache = self.cache
        position = cache.get_seq_length()
        if cache.routes_at(1):
            return self._eager(token, position)
        key = cache.replay_key()
        if key != self.key:  # the tiers changed: run this step eagerly (a warm-up), capture the next
            self.graph, self.key = None, key
            with _side_stream(token):
                return self._eager(token, position)
        if self.graph is None:
            self._capture(token, position)
        else:
            self._feed(token, position)
            self.graph.replay()
            cache.replayed(1)
            self.replays += 1
        return self._logits[:, -1].clone()

    def _eager(self, token: torch.Tensor, position: int) -> torch.Tensor:
        positions = torch.tensor([position], device=token.device)
        return self._forward(token, positions)[:, -1]

    def _forward(self, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return call(self.model, token, self.cache, logits_to_keep=1, use_cache=True, cache_position=positions,
                    position_ids=positions.expand(token.shape[0], -1)).logits

    def _feed(self, token: torch.Tensor, position: int) -> None:
        ids, positions = self._inputs
        ids.copy_(token)
        positions.fill_(position)

    def _capture(self, token: torch.Tensor, position: int) -> None:
        """Capture this step (its Python runs: the host counters advance) and replay it (its device work)."""
        self._inputs = (token.clone(), torch.tensor([position], device=token.device))
        graph = self.graph_class()
        with _capturing(graph):
            self._logits = self._forward(*self._inputs)
        graph.replay()
        self.graph = graph


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
