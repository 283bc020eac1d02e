"""Time per output token of several caches decoding side by side in one process, their steps interleaved.

The one measurement of decode speed that ``bench.tpot`` reports and the studio's "time the lanes alone" shows:
every cache is prefilled in turn, then each decode step of each cache is timed alone, the order rotating every
step, so a drift in the machine's speed reaches every cache within one step of the others.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from .generation.graphs import GraphedSteps
from .generation.model_call import call
from .generation.prefill import prefill


def sync(device: torch.device) -> None:
    """Wait for the device, so a wall-clock time covers the work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_steps(model, prompt: torch.Tensor, caches: dict[str, object], new_tokens: int,
                      chunks: dict[str, int | None] | None = None,
                      graphs: bool = False) -> dict[str, list[tuple[float, bool]]]:
    """Prefill each fresh cache with ``prompt`` (1, T), then ``new_tokens - 1`` greedy decode steps of every cache,
    interleaved -> per cache its (seconds, routed) per step. ``graphs``: every cache's steps replayed from CUDA
    graphs (generation/graphs.py; a ValueError before any step where one cannot)."""
    device, chunks = prompt.device, chunks or {}
    tokens, steps = {}, {name: [] for name in caches}
    steppers = {name: GraphedSteps(model, cache) for name, cache in caches.items()} if graphs else {}
    with torch.inference_mode():
        for name, cache in caches.items():
            tokens[name] = prefill(model, prompt, cache, chunks.get(name)).argmax(-1, keepdim=True)
        order = list(caches)
        for step in range(new_tokens - 1):
            for name in order[step % len(order):] + order[:step % len(order)]:
                sync(device)
                began = time.perf_counter()
                if graphs:
                    logits = steppers[name](tokens[name])
                else:
                    logits = call(model, tokens[name], caches[name], logits_to_keep=1).logits[:, -1]
                tokens[name] = logits.argmax(-1, keepdim=True)
                sync(device)
                steps[name].append((time.perf_counter() - began, caches[name].routed()))
    return steps


def tpot_ratios(model, prompt: torch.Tensor, make_caches: Callable[[], dict[str, object]], baseline: str,
                new_tokens: int, rounds: int, graphs: bool = False) -> dict[str, dict[str, float]]:
    """Per cache: the median over ``rounds`` (fresh caches each) of its mean step time ("tpot") and of that time
    over ``baseline``'s in the same round ("ratio"), with the ratio's range over rounds. ``graphs``: as
    ``interleaved_steps``."""
    per_round = []
    for _ in range(rounds):
        steps = interleaved_steps(model, prompt, make_caches(), new_tokens, graphs=graphs)
        tpot = {name: sum(s for s, _ in st) / len(st) for name, st in steps.items()}
        per_round.append({name: (t, t / tpot[baseline]) for name, t in tpot.items()})
    return {name: {"tpot": statistics.median(r[name][0] for r in per_round),
                   "ratio": statistics.median(r[name][1] for r in per_round),
                   "ratio_min": min(r[name][1] for r in per_round), "ratio_max": max(r[name][1] for r in per_round)}
            for name in per_round[0]}
