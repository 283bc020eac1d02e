"""Scores folded step by step equal the replay of the buffered queries that they replaced (Eq. 1 / 20-23).

A recording attention function keeps, per layer, the queries since the last routing event (what the cache used
to buffer) and, at each event, replays them against the keys attention sees with ``key_attention_mass``, then
checks the cache's table against the scorer's formula applied to that replayed mass.
"""

import pytest
import torch
from transformers import AttentionInterface

from qevict_core import QEvictConfig, make_cache
from qevict_core.engine.attention import make_wrapper

qevict_attention = make_wrapper("sdpa")  # the function transformers calls for a model on SDPA
from qevict_core.engine.key_mass import kv_head_mass
from tests.conftest import KV, random_prompt, tiny_model

RECORDER = "qevict_replay_recorder"


def key_attention_mass(query, query_pos, keys, key_pos, scaling):
    """The replay the engine ran at routing events before it folded each step: Eq. 1's inner sum over the buffered
    queries and query heads, divided by the number of query heads. (B, N)."""
    return kv_head_mass(query, query_pos, keys, key_pos, scaling).sum(dim=1) / query.shape[1]


class Replay:
    """Wraps the registered ``qevict`` attention; compares each layer's table with the replay at every event."""

    def __init__(self, cache, scorer: str, decay: float = 0.99, p: float = 3.0):
        self.cache, self.scorer, self.decay, self.p = cache, scorer, decay, p
        self.queries: dict[int, list] = {}
        self.after_event: dict[int, torch.Tensor] = {}
        self.compared = 0
        self.worst = 0.0

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = self.cache.layers[module.layer_idx]
        if layer.claim(key):
            layer._returned_keys = key  # claimed again by the wrapped function
        routing = self.cache.schedule.routing_now and self.cache.step > 0
        positions = torch.arange(layer.seen - query.shape[2], layer.seen)
        self.queries.setdefault(module.layer_idx, []).append((query, positions))
        expected = self._replayed(layer, key, module.scaling) if routing else None
        out = qevict_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if self.cache.schedule.routing_now:  # a layer whose keys outlive the forward moves at its end: now, to read
            self.cache.move_deferred()
        if routing:
            got = layer.scores
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
            self.worst = max(self.worst, float(((got - expected).abs() / expected.abs().clamp_min(1e-6)).max()))
            self.compared += 1
        if self.cache.schedule.routing_now:
            self.after_event[module.layer_idx] = layer.scores.clone()
            self.queries[module.layer_idx] = []
        return out

    def _replayed(self, layer, keys, scaling):
        query = torch.cat([q for q, _ in self.queries[layer.layer_idx]], dim=2)
        query_pos = torch.cat([p for _, p in self.queries[layer.layer_idx]])
        key_pos = layer.attended_positions()
        if layer.owner.backend.reads_tier_in_place:  # the step read the quantized tier in place: replay against it too
            keys, _ = layer.with_quantized([keys], [keys])
        mass = key_attention_mass(query, query_pos, keys, key_pos, scaling)
        u = window_mass(mass, key_pos, layer.grid.sinks, layer.grid.omega, self.cache.plan.num_windows)
        before = self.after_event[layer.layer_idx]
        if self.scorer == "cumulative":
            return before + u
        if self.scorer == "decay":  # the table after an event already carries λ for the next interval
            return self.decay * (before + u)
        return before + u.pow(self.p)


def window_mass(key_mass, key_pos, sinks: int, omega: int, num_windows: int):
    """(B, N) per-key mass at absolute positions (B, N) -> (B, num_windows), binned by each key's window (sinks,
    before window 0, dropped): the position-based binning the engine used before it summed tiers by layout."""
    window = torch.where(key_pos >= sinks, torch.div(key_pos - sinks, omega, rounding_mode="floor"), num_windows)
    out = torch.zeros(key_mass.shape[0], num_windows + 1, dtype=key_mass.dtype)
    return out.scatter_add_(1, window.long(), key_mass)[:, :num_windows]


def run_with_replay(model, config, prompt_len: int, steps: int, vocab: int = 256) -> Replay:
    cache = make_cache("qevict", model, config, max_length=prompt_len + steps + 1)
    recorder = Replay(cache, config.scorer, config.decay, config.p)
    AttentionInterface.register(RECORDER, recorder)
    model.set_attn_implementation(RECORDER)
    try:
        with torch.inference_mode():
            logits = model(random_prompt(prompt_len, vocab), **{KV: cache}).logits[:, -1]
            for _ in range(steps):
                logits = model(logits.argmax(-1, keepdim=True), **{KV: cache}).logits[:, -1]
    finally:
        model.set_attn_implementation("qevict")
    return recorder


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("family,kv_heads", [("llama", 4), ("qwen2", 2), ("mistral", 2)])
@pytest.mark.parametrize("scorer", ["cumulative", "decay", "pnorm"])
def test_folded_scores_equal_the_replay_of_buffered_queries(family, kv_heads, scorer, kernels):
    model = tiny_model(family, kv_heads)
    config = QEvictConfig(budget=0.25, scorer=scorer, decay=0.9, kernels=kernels)
    recorder = run_with_replay(model, config, prompt_len=600, steps=40)
    # 40 steps after the prompt's event = 5 events per layer, all compared; the tiers moved in between.
    assert recorder.compared == 5 * len(recorder.cache.layers)
    assert recorder.cache.summary()["evictions"] > 0
    print(f"largest relative difference from the replay: {recorder.worst:.2e}")


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_folded_scores_equal_the_replay_on_smollm2(smollm2, kernels):
    model, _ = smollm2
    config = QEvictConfig(budget=0.2, kernels=kernels)
    recorder = run_with_replay(model, config, prompt_len=700, steps=16, vocab=model.config.vocab_size)
    assert recorder.compared == 2 * len(recorder.cache.layers)
    print(f"largest relative difference from the replay: {recorder.worst:.2e}")
