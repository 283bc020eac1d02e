"""Reading a prompt into a cache, whole or in chunks of ``chunk`` tokens.

A prompt read whole holds every layer's activations for all its tokens at once. Chunks bound that by the chunk
size; the cache decides what it keeps between chunks (``ReportingCache.chunked_prefill``): FullKV keeps every
token exactly, QEvict stages the prompt in INT8 and routes it at the last chunk (prompt_stage.py). The last chunk is a
whole ``chunk`` and the first takes the remainder, so the prompt's last queries (QEvict's observation window) are
read together.
"""

from __future__ import annotations

import torch

from ..engine.cache_base import ReportingCache
from .model_call import call


def chunk_sizes(length: int, chunk: int | None) -> list[int]:
    """Token counts of the forwards that read a prompt of ``length`` tokens: [length] when ``chunk`` is None."""
    if chunk is None or chunk >= length:
        return [length]
    head = length % chunk
    return ([head] if head else []) + [chunk] * (length // chunk)


def check_chunk(cache: ReportingCache, chunk: int | None) -> None:
    if chunk is None:
        return
    cache.require_chunked_prefill()
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"prefill_chunk must be a whole number of tokens >= 1, or None to read the prompt whole "
                         f"(got {chunk!r})")
    window = getattr(getattr(cache, "config", None), "prefill_window", 0)
    if cache.chunked_prefill == "staged" and chunk < window:
        raise ValueError(f"prefill_chunk must be >= prefill_window = {window}, so that the prompt's observation "
                         f"window is read in its last chunk (got {chunk})")


def prefill(model, input_ids: torch.Tensor, cache: ReportingCache, chunk: int | None = None) -> torch.Tensor:
    """Read ``input_ids`` (B, T) into a fresh ``cache``; -> the last position's logits (B, V)."""
    check_chunk(cache, chunk)
    sizes = chunk_sizes(input_ids.shape[1], chunk)
    start = 0
    with torch.inference_mode():
        for i, size in enumerate(sizes):
            if len(sizes) > 1:
                cache.read_prompt_chunk(more_to_come=i + 1 < len(sizes))
            logits = call(model, input_ids[:, start:start + size], cache, use_cache=True,
                           logits_to_keep=1).logits[:, -1]
            start += size
    return logits
