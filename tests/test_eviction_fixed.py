"""Eviction baselines in fixed buffers: the prefill-only ones (qevict_core/baselines/eviction_fixed.py; with per-head
budgets, eviction_ragged.py) and H2O, evicting in place (eviction_heavy.py): what a GPU runs, so that a CUDA graph
replays their decode steps. Checked here on the CPU, the layout forced."""

from __future__ import annotations

import pytest
import torch

from qevict_core import QEvictConfig
from qevict_core.baselines.eviction import EvictionCache
from qevict_core.generation.graphs import GraphedSteps
from qevict_core.generation.model_call import call
from qevict_core.registry import METHODS
from tests.conftest import random_prompt, tiny_model
from tests.test_capture import REFUSED, RecordCalls
from tests.test_graphs import RecordedGraph, _generate, _host_state

PROMPT, MAX_LENGTH = 300, 400


def _cache(model, method: str, fixed: bool, budget: float = 0.3, batch: int = 1) -> EvictionCache:
    config = QEvictConfig(budget=budget)
    return EvictionCache(model, config, MAX_LENGTH, batch, METHODS[method].policy.from_config(config), method,
                         fixed_buffers=fixed)


def _room(layer) -> list[int]:
    """Per head, the decoded tokens a fixed layer takes before it rolls (its host counter ``written``: one per head
    where heads keep different counts, else one for all)."""
    written = layer.written if isinstance(layer.written, list) else [layer.written] * len(layer.limit)
    return [limit - n for limit, n in zip(layer.limit, written)]


def _decode(model, cache, tokens: list[int], prompt: bool = True) -> None:
    """The prompt (unless ``prompt`` is False: the cache read it already), then ``tokens`` one per forward (the same
    tokens whatever the cache keeps)."""
    with torch.inference_mode():
        if prompt:
            call(model, random_prompt(PROMPT), cache, logits_to_keep=1)
        for token in tokens:
            position = torch.tensor([cache.get_seq_length()])
            call(model, torch.tensor([[token]]), cache, logits_to_keep=1, cache_position=position,
                 position_ids=position[None])


def test_the_buffer_holds_the_sinks_and_the_newest_tokens_once_it_rolls():
    """StreamingLLM in fixed buffers, decoded past its limit: layer 0 (whose keys depend on the tokens and their
    positions only) holds FullKV's keys of the sinks and of the newest L - sinks positions, each once."""
    model = tiny_model("llama", 2)
    cache, reference = _cache(model, "streamingllm", True), _cache(model, "streamingllm", False, budget=1.0)
    tokens = random_prompt(90, seed=3)[0].tolist()
    _decode(model, cache, tokens)
    _decode(model, reference, tokens)
    layer = cache.layers[0]
    keys, sinks, limit = layer.key_buffer, layer.frozen[0], layer.key_buffer.shape[2]
    assert sinks == 5 and PROMPT + len(tokens) > limit + 20  # it rolled for more than 20 steps
    full = torch.stack(reference.layers[0].keys, dim=1)  # (B, H, N, D): every token (the budget holds them all)
    seen = PROMPT + len(tokens)
    kept = list(range(sinks)) + list(range(seen - (limit - sinks), seen))
    expected = full[:, :, kept]
    for h in range(keys.shape[1]):  # the same rows, in the ring's order
        rows = sorted(map(tuple, keys[0, h].float().tolist()))
        assert rows == sorted(map(tuple, expected[0, h].float().tolist()))
    assert cache.summary()["evictions"] == len(cache.layers) * (seen - limit)  # per head, over the layers
    report = cache.memory_report()
    assert report["total_bytes"] <= cache.budget_bytes
    assert report["components"]["index"] == len(cache.layers) * 8  # the device counters, paid from the budget


def test_h2o_in_place_keeps_the_lists_tokens_while_it_evicts():
    """H2O in fixed buffers (eviction_heavy.py), decoded for 90 steps past its limit, each step evicting: layer 0
    (whose keys and queries depend on the tokens and their positions only) holds exactly the tokens the chronological
    lists hold, per head, with the same evictions and within the budget; the buffer and the scores were written in
    place at every step."""
    model = tiny_model("llama", 2)
    cache, lists = _cache(model, "h2o", True), _cache(model, "h2o", False)
    tokens = random_prompt(90, seed=3)[0].tolist()
    _decode(model, cache, tokens[:1])
    addresses = [t.data_ptr() for t in cache.layers[0].buffers()]
    _decode(model, cache, tokens[1:], prompt=False)
    _decode(model, lists, tokens)
    fixed, chronological = cache.layers[0], lists.layers[0]
    limit = fixed.key_buffer.shape[2]
    assert PROMPT > limit and fixed.written == limit + len(tokens)  # full from the prompt on: every step evicts
    assert [t.data_ptr() for t in fixed.buffers()] == addresses
    for h in range(fixed.key_buffer.shape[1]):  # the same rows (the slots in their own order), the same scores
        scored = dict(zip(map(tuple, fixed.key_buffer[0, h].tolist()), fixed.acc_buffer[0, h].tolist()))
        expected = dict(zip(map(tuple, chronological.keys[h][0].tolist()), chronological.acc[h][0].tolist()))
        assert len(scored) == limit and scored.keys() == expected.keys()
        assert all(abs(scored[key] - score) <= 1e-5 * score for key, score in expected.items())  # summed apart
    assert cache.summary() == lists.summary() and cache.summary()["evictions"] > 0
    report = cache.memory_report()
    assert report["total_bytes"] <= cache.budget_bytes and report["components"]["scores"] > 0


@pytest.mark.parametrize("method", ["adakv", "defensivekv", "layer_defensivekv"])
def test_per_head_budgets_in_one_buffer_hold_what_the_lists_hold(method):
    """AdaKV and the DefensiveKVs in fixed buffers (eviction_ragged.py), decoded 90 steps past their limits: each
    head's segment of layer 0's buffer holds exactly the tokens its chronological list holds (heads keep different
    counts), with the same evictions, within the budget, the table's bytes counted."""
    model = tiny_model("llama", 2)
    cache, lists = _cache(model, method, True), _cache(model, method, False)
    tokens = random_prompt(90, seed=3)[0].tolist()
    _decode(model, cache, tokens)
    _decode(model, lists, tokens)
    fixed, chronological = cache.layers[0], lists.layers[0]
    counts = [keys.shape[1] for keys in chronological.keys]
    assert fixed.limit == counts and all(w > n + 20 for w, n in zip(fixed.written, counts))  # rolled for 20+ steps
    start = 0
    for h, n in enumerate(counts):
        assert (sorted(map(tuple, fixed.key_buffer[0, 0, start:start + n].tolist()))
                == sorted(map(tuple, chronological.keys[h][0].tolist())))
        start += n
    assert start == fixed.key_buffer.shape[2]
    assert cache.summary() == lists.summary()
    report = cache.memory_report()
    assert report["total_bytes"] <= cache.budget_bytes
    assert report["components"]["index"] == len(cache.layers) * 4 * 8 * len(counts)  # the (4, H) tables
    assert fixed.table.nbytes == fixed.index_bytes(len(counts))  # what the plan charged for it
    # each query group reads its own head's segment: while nothing leaves, a step's logits are the lists'
    pair = _cache(model, method, True), _cache(model, method, False)
    for c in pair:
        _decode(model, c, [7, 9])
    with torch.inference_mode():
        position = torch.tensor([PROMPT + 2])
        logits = [call(model, torch.tensor([[11]]), c, logits_to_keep=1, cache_position=position,
                       position_ids=position[None]).logits for c in pair]
    assert torch.allclose(*logits, rtol=1e-4, atol=1e-6)
    # greedy decoding reads what the lists read until a token leaves
    room = min(_room(_cache_after_prompt(model, method)))
    assert room > 10
    eager_lists = _generate(model, _cache(model, method, False), random_prompt(PROMPT), room)
    assert _generate(model, _cache(model, method, True), random_prompt(PROMPT), room)[0] == eager_lists[0]


def _cache_after_prompt(model, method: str):
    cache = _cache(model, method, True)
    _decode(model, cache, [7])
    return cache.layers[0]


def test_heads_keep_different_counts_in_one_buffer():
    """DefensiveKV's heads keep different counts here, and its fixed buffer holds exactly their sum."""
    model = tiny_model("llama", 2)
    cache = _cache(model, "defensivekv", True)
    _decode(model, cache, [7])
    limits = [layer.limit for layer in cache.layers]
    assert any(len(set(heads)) > 1 for heads in limits)
    assert [layer.key_buffer.shape[2] for layer in cache.layers] == [sum(heads) for heads in limits]


def test_it_reads_what_the_lists_read_until_a_token_leaves():
    """SnapKV: the prompt's selection moves into the buffers as it is, and greedy decoding gives the lists' tokens
    while the buffer fills (the two differ by the token that leaves once it is full: eviction_fixed.py)."""
    model = tiny_model("llama", 2)
    lists, fixed = _cache(model, "snapkv", False), _cache(model, "snapkv", True)
    with torch.inference_mode():
        call(model, random_prompt(PROMPT), lists, logits_to_keep=1)
        call(model, random_prompt(PROMPT), fixed, logits_to_keep=1)
    for a, b in zip(lists.layers, fixed.layers):
        assert torch.equal(torch.stack(a.keys, dim=1), b.key_buffer[:, :, :a.keys[0].shape[1]])
        room = b.key_buffer.shape[2] - a.keys[0].shape[1]
    assert room > 10
    lists, fixed = _cache(model, "snapkv", False), _cache(model, "snapkv", True)
    eager_lists = _generate(model, lists, random_prompt(PROMPT), room)
    eager_fixed = _generate(model, fixed, random_prompt(PROMPT), room)
    assert eager_fixed[0] == eager_lists[0]


@pytest.mark.parametrize("method, batch", [("streamingllm", 1), ("snapkv", 1), ("criticalkv", 1), ("snapkv", 2),
                                           ("h2o", 1), ("h2o", 2), ("adakv", 1), ("layer_defensivekv", 1)])
def test_replayed_steps_give_the_eager_tokens_and_bytes_while_filling_and_rolling(method, batch):
    model = tiny_model("llama", 2)
    steps = 60  # past the limit: the ring rolls
    prompt = torch.cat([random_prompt(PROMPT, seed=s) for s in range(batch)])  # rows select apart
    eager = _generate(model, _cache(model, method, True, batch=batch), prompt, steps)
    graphed = _generate(model, _cache(model, method, True, batch=batch), prompt, steps, RecordedGraph)
    assert graphed[:3] == eager[:3] and graphed[2]["evictions"] > 0
    assert graphed[3].replays["plain"] >= steps - 3


@pytest.mark.parametrize("method, prompt", [("snapkv", PROMPT), ("h2o", 40), ("defensivekv", PROMPT)])
def test_every_decode_step_is_one_call_asking_the_host_nothing(method, prompt):
    """Steps while the buffer fills and after it rolls (or evicts): the same operators, shapes and arguments, none
    that waits for the device (what a CUDA capture refuses)."""
    model = tiny_model("llama", 2)
    cache = _cache(model, method, True)
    calls = []
    with torch.inference_mode():
        token = call(model, random_prompt(prompt), cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        layer = cache.layers[0]
        room = max(_room(layer))
        assert room > 0  # steps while it fills, then after
        for _ in range(room + 5):
            position = torch.tensor([cache.get_seq_length()])
            mode = RecordCalls()
            with mode:
                token = call(model, token, cache, logits_to_keep=1, cache_position=position,
                             position_ids=position[None]).logits[:, -1].argmax(-1, keepdim=True)
            calls.append(mode.calls)
    assert max(_room(layer)) < 0  # every head rolled
    assert all(c == calls[0] for c in calls)
    assert not {name for call_ in calls[0] for name in [call_[0].rsplit(".", 1)[0]]} & REFUSED


@pytest.mark.parametrize("method", ["snapkv", "h2o", "adakv"])
def test_the_host_half_of_a_replayed_step_is_what_an_eager_step_advances(method):
    model = tiny_model("llama", 2)
    twins = [_cache(model, method, True) for _ in range(2)]
    for cache in twins:
        _decode(model, cache, [7] * 40)  # the ring has rolled
    key, before = twins[0].replay_key(), _host_state(twins[0])
    with torch.inference_mode():
        call(model, torch.tensor([[7]]), twins[0], logits_to_keep=1)
    assert twins[0].replay_key() == key
    twins[1].replayed(1)
    after = _host_state(twins[0])
    assert after != before and after == _host_state(twins[1])
    assert twins[0].summary() == twins[1].summary()


def test_a_policy_that_cannot_is_refused_and_the_cpu_keeps_the_lists():
    model = tiny_model("llama", 2)
    from qevict_core.baselines.policies.h2o import H2O

    class Rescoring(H2O):  # a step policy whose score is not the accumulated attention itself
        label, evicts_by_accumulation = "Rescoring", False

    with pytest.raises(ValueError, match="Rescoring cannot decode in fixed buffers: only a policy that selects once"):
        EvictionCache(model, QEvictConfig(budget=0.3), MAX_LENGTH, 1, Rescoring(), "rescoring", fixed_buffers=True)
    assert not _cache(model, "snapkv", None).replays_steps  # a CPU model: the chronological lists
    with pytest.raises(ValueError, match="cannot replay its decode steps"):
        GraphedSteps(model, _cache(model, "snapkv", None), graph_class=RecordedGraph)
