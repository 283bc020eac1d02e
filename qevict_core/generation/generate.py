"""One decode loop for every consumer: the CLI, the studio and the benchmarks.

Several lanes (a lane = a method with its own cache) run on the same model in lockstep: all lanes prefill, then
each step advances every unfinished lane by one token. The loop yields the event stream (tokens, routing events,
memory reports, and a final ``DoneEvent`` per lane); a ``should_stop`` callback ends it early, keeping what was
generated. ``model.generate(..., cache=...)`` works with the same caches; a test keeps both paths equal.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..engine.cache_base import ReportingCache
from ..events import DoneEvent, MemoryEvent, TokenEvent
from ..timing import sync
from .graphs import GraphedSteps
from .prefill import check_chunk, prefill
from .lanes_forward import forward_lanes


@dataclass(frozen=True)
class Sampling:
    """Greedy when temperature == 0; otherwise seeded sampling (the same seed in every lane)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, 0 = greedy (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1] (got {self.top_p})")


@dataclass
class Lane:
    name: str
    cache: ReportingCache
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    done: str | None = None
    generator: torch.Generator | None = None


def eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = ids if isinstance(ids, list) else [ids]
    return {i for i in ids + [tokenizer.eos_token_id] if i is not None}


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    if sampling.temperature == 0:
        return int(logits.argmax(dim=-1))
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < sampling.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def generate_lanes(model, tokenizer, input_ids: torch.Tensor, lanes: list[Lane], sampling: Sampling,
                   should_stop: Callable[[], bool] | None = None, together: bool = True,
                   prefill_chunk: int | None = None, graphs: bool = False) -> Iterator:
    """Yield events while every lane decodes ``input_ids`` (1, T). Lanes must have fresh caches. Each lane's
    ``DoneEvent`` comes as soon as it ends (end of text, length, an error), the stopped lanes' once Stop is seen.

    With ``together`` the lanes share each forward (``lanes_forward.forward_lanes``): one prefill for all, then
    one batched forward per step in which row i attends only to lane i's cache. Each lane reports that forward's
    time, so per-lane speeds are those of the shared forward; speed benchmarks run lanes alone.

    ``prefill_chunk``: read the prompt in chunks of that many tokens (prefill.py), each lane alone: a staged
    cache's chunks attend to its own staged prompt, which no other lane's forward could stand in for.

    ``graphs``: on CUDA, each lane decodes alone and replays its decode steps from captured graphs (graphs.py);
    a ValueError before any step if the model is elsewhere or a lane's cache cannot replay its steps.
    """
    stop_ids = eos_ids(model, tokenizer) if sampling.stop_at_eos else set()
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    for lane in lanes:
        needed = input_ids.shape[1] + sampling.max_new_tokens
        if lane.cache.max_length < needed:
            raise ValueError(f"lane {lane.name!r}: cache max_length {lane.cache.max_length} < prompt + new tokens "
                             f"= {needed}")
        if sampling.temperature > 0:
            lane.generator = torch.Generator().manual_seed(sampling.seed)
        check_chunk(lane.cache, prefill_chunk)
    steppers = {id(lane): GraphedSteps(model, lane.cache) for lane in lanes} if graphs else {}

    for step in range(sampling.max_new_tokens):
        active = [lane for lane in lanes if not lane.done]
        if should_stop is not None and should_stop():
            for lane in active:
                lane.done = "stopped"
            break
        separate = not together or graphs or (step == 0 and prefill_chunk is not None)
        for group in [[lane] for lane in active] if separate else [active]:
            feed = input_ids if step == 0 else torch.tensor([[lane.tokens[-1]] for lane in group], device=device)
            try:
                owns = [lane.cache.own_seconds for lane in group]
                started = time.perf_counter()
                if step == 0 and prefill_chunk is not None:
                    logits = prefill(model, feed, group[0].cache, prefill_chunk)
                elif step > 0 and graphs:
                    logits = steppers[id(group[0])](feed)
                else:
                    logits = forward_lanes(model, feed, [lane.cache for lane in group])
                sync(device)  # a GPU runs the step after the host returns: the time covers its work
                seconds = time.perf_counter() - started
                owns = [lane.cache.own_seconds - before for lane, before in zip(group, owns)]
            except Exception as err:  # end the lanes of this forward, keep what they generated
                for lane in group:
                    lane.done = f"error: {err}"
                    yield _done(lane)
                continue
            alone = lane_seconds(seconds, owns, group[0].cache.device_type == "cpu")
            for lane, row, own in zip(group, logits, alone):
                token = next_token(row, sampling, lane.generator)
                if step == 0:
                    lane.prefill_seconds = seconds
                else:
                    lane.decode_seconds += seconds
                yield from _lane_events(lane, step, token, seconds, own, tokenizer)
                if token in stop_ids:
                    lane.done = "eos"
                elif step + 1 == sampling.max_new_tokens:
                    lane.done = "length"
                if lane.done:
                    yield _done(lane)
        if all(lane.done for lane in lanes):
            break
    for lane in lanes:
        if lane.done in (None, "stopped"):
            lane.done = "stopped"
            yield _done(lane)


def _done(lane: Lane) -> DoneEvent:
    """A lane's end, as soon as it ends (the others may go on)."""
    return DoneEvent(lane=lane.name, step=max(len(lane.tokens) - 1, 0), reason=lane.done, text=lane.text,
                     tokens=len(lane.tokens), prefill_seconds=lane.prefill_seconds,
                     decode_seconds=lane.decode_seconds, summary=lane.cache.summary())


def lane_seconds(seconds: float, owns: list[float], timed: bool) -> list[float | None]:
    """Each lane's time had it run alone: the shared part of the forward (everything but the lanes' own cache
    and attention work, the same for one row as for several on a CPU, where decoding is bound by reading the
    weights) plus its own part. None where the parts were not timed (one lane: its forward is its own)."""
    if len(owns) == 1:
        return [seconds]
    if not timed:
        return [None] * len(owns)
    shared = max(0.0, seconds - sum(owns))
    return [shared + own for own in owns]


def _lane_events(lane: Lane, step: int, token: int, seconds: float, alone: float | None, tokenizer) -> Iterator:
    for event in lane.cache.drain_events():
        event.lane = lane.name
        yield event
    lane.tokens.append(token)
    text = tokenizer.decode(lane.tokens, skip_special_tokens=True)
    # A character split over tokens (emoji, CJK, Hebrew in byte-level vocabularies) decodes as U+FFFD until its
    # last byte arrives: its text waits for that token, so every token's text is whole characters.
    delta = "" if text.endswith("\ufffd") else text[len(lane.text):]
    lane.text += delta
    yield TokenEvent(lane=lane.name, step=step, token_id=token, text=delta, seconds=seconds, alone_seconds=alone)
    report = lane.cache.memory_report()
    yield MemoryEvent(lane=lane.name, step=step, total_bytes=report["total_bytes"],
                      fullkv_bytes=report["fullkv_bytes"], budget_bytes=report["budget_bytes"],
                      peak_bytes=report["peak_bytes"], components=report["components"],
                      tiers=mean_tier_counts(lane.cache))


def mean_tier_counts(cache: ReportingCache) -> dict[str, int]:
    """Tokens per tier in one layer, averaged over layers: the same unit for every method."""
    layers = cache.tier_counts()
    return {tier: round(sum(layer[tier] for layer in layers) / len(layers)) for tier in layers[0]}
