"""Baselines on the same engine: byte budgets, selections under each method's own score, reference scores."""

import pytest
import torch

from qevict_core import QEvictConfig, make_cache
from qevict_core.baselines.policies.base import ScoreInputs
from qevict_core.baselines.policies.criticalkv import CriticalKV
from qevict_core.baselines.policies.defensivekv import DefensiveKV
from qevict_core.registry import METHODS
from tests.conftest import KV, random_prompt, tiny_model
from tests.test_budget import walked_bytes

BUDGETED = [name for name, spec in METHODS.items() if spec.family in ("qevict", "eviction")]
PREFILL_POLICIES = ["streamingllm", "snapkv", "adakv", "criticalkv", "defensivekv", "layer_defensivekv"]


def teacher_forced(model, cache, prompt, continuation):
    with torch.inference_mode():
        model(prompt, **{KV: cache})
        for i in range(continuation.shape[1]):
            model(continuation[:, i:i + 1], **{KV: cache})
            yield cache.memory_report()


@pytest.mark.parametrize("kv_heads", [2, pytest.param(4, marks=pytest.mark.slow)], ids=["gqa", "mha"])
@pytest.mark.parametrize("method", BUDGETED)
def test_bytes_stay_within_budget_for_200_steps(method, kv_heads):
    model = tiny_model("llama", kv_heads)
    cache = make_cache(method, model, QEvictConfig(budget=0.2), max_length=1000 + 200)
    steps = 0
    for report in teacher_forced(model, cache, random_prompt(1000), random_prompt(200, seed=9)):
        steps += 1
        assert report["total_bytes"] <= cache.budget_bytes, f"{method} step {steps}"
        assert report["total_bytes"] == walked_bytes(cache), f"{method} step {steps}"
    assert report["ratio"] <= 0.2 + 1e-6 and steps == 200
    assert cache.summary()["evictions"] > 0


def test_every_registry_method_is_listed_with_a_reference():
    from qevict_core import list_methods

    # The product's list: FullKV, QEvict, QEvict as in the paper, the paper's baselines; the ablations on request.
    assert list(list_methods()) == ["fullkv", "qevict", "qevict_paper", "streamingllm", "h2o", "snapkv", "adakv",
                                    "criticalkv", "defensivekv", "layer_defensivekv", "kivi2", "kvquant2", "zipcache"]
    listed = list_methods(ablations=True)
    assert set(listed) == set(METHODS) >= {"r1", "r2", "qevict_nopromo", "qevict_head", "qevict_int2", "kivi4"}
    assert {METHODS[name].kind for name in set(METHODS) - set(list_methods())} == {"ablation"}
    assert all(METHODS[m].reference and listed[m] for m in METHODS)


def kept_positions(stored: torch.Tensor, full: torch.Tensor) -> list[int]:
    """Recover which tokens a head kept by matching its key vectors with the uncompressed ones (B=1)."""
    match = (stored[0][:, None, :] == full[0][None, :, :]).all(-1)  # (n_kept, N)
    assert bool((match.sum(1) == 1).all()), "every kept key must be one original key"
    return match.float().argmax(1).tolist()


def recording(cache):
    recorded = {}
    score = cache.policy.score

    def wrapped(inputs):
        out = score(inputs)
        recorded.setdefault("scores", []).append((out[:, :, :inputs.candidates].clone(), inputs.candidates))
        return out

    cache.policy.score = wrapped
    return recorded


@pytest.mark.parametrize("method", PREFILL_POLICIES)
def test_prefill_policies_keep_their_top_scored_tokens(method):
    model = tiny_model("llama", 2)
    prompt = random_prompt(600)
    full = make_cache("fullkv", model, None, max_length=620)
    cache = make_cache(method, model, QEvictConfig(budget=0.2), max_length=620)
    recorded = recording(cache)
    with torch.inference_mode():
        model(prompt, **{KV: full})
        model(prompt, **{KV: cache})
    assert len(recorded["scores"]) == len(cache.layers)
    for layer, ref, (scores, candidates) in zip(cache.layers, full.layers, recorded["scores"]):
        for h in range(len(layer.keys)):
            kept = kept_positions(layer.keys[h], ref.keys[:, h])
            chosen = [p for p in kept if p < candidates]
            assert kept[len(chosen):] == list(range(candidates, 600)), "the observation window/tail is kept"
            top = scores[0, h].topk(len(chosen)).indices.sort().values.tolist()
            assert chosen == top or torch.allclose(scores[0, h, chosen].sort().values,
                                                   scores[0, h, top].sort().values)  # ties


def test_snapkv_scores_match_eager_reimplementation():
    model = tiny_model("llama", 2)
    prompt = random_prompt(500)
    # float32 keys, as eager attention's reference reads them (the scoring is what is compared, not storage)
    cache = make_cache("snapkv", model, QEvictConfig(budget=0.2, kv_dtype="model"), max_length=510)
    recorded = recording(cache)
    with torch.inference_mode():
        model(prompt, **{KV: cache})
        model.set_attn_implementation("eager")
        eager = model(prompt, output_attentions=True).attentions
        model.set_attn_implementation("qevict")
    for (scores, candidates), probs in zip(recorded["scores"], eager):  # probs (1, Hq, T, T)
        window = probs[0, :, -32:, :candidates].sum(dim=1)  # (Hq, P): last 32 queries over the prefix
        pooled = torch.nn.functional.avg_pool1d(window[:, None], 5, stride=1, padding=2)[:, 0]  # as SnapKV's code
        expected = pooled.reshape(2, 2, candidates).mean(dim=1)  # mean over each KV head's 2 query heads
        torch.testing.assert_close(scores[0], expected, rtol=1e-4, atol=1e-5)


def test_criticalkv_first_stage_is_half_of_everything_kept_window_included():
    """keep = 10 candidates + a window of 4: the first stage is int(14 / 2) = 7 tokens, the 4 of the window and
    the 3 best-scored candidates (kvpress's CriticalKVPress); the value-weighted stage ranks the rest."""
    n, window, d = 24, 4, 4
    base = torch.linspace(1.0, 0.1, n - window)  # candidate 0 scores highest
    probs = torch.zeros(1, 1, 1, window, n)
    probs[..., 0, :n - window] = base  # one window row carries the scores; the window's own columns stay 0
    values = torch.zeros(1, 1, n, d)
    values[0, 0, :, 0] = torch.arange(1, n + 1, dtype=torch.float32) ** 3  # later tokens weigh more
    module = torch.nn.Module()
    module.o_proj, module.num_key_value_groups = torch.nn.Linear(d, d, bias=False), 1
    torch.nn.init.eye_(module.o_proj.weight)
    inputs = ScoreInputs(torch.zeros(1, 1, n, d), values, module, keep=10, candidates=n - window, probs=probs)
    ranked = CriticalKV(kernel=1).score(inputs)[0, 0].argsort(descending=True).tolist()
    assert sorted(ranked[:3]) == [0, 1, 2]  # the first stage, by attention score
    weighted = (base / window + 1e-4) * values[0, 0, :n - window, 0]  # (mean score + ε) · ||W_o v||_1, W_o = I
    assert ranked[3] == 3 + int(weighted[3:].argmax())  # then the value-weighted order


def test_h2o_keeps_recent_plus_heavy_hitters_of_eager_attention():
    model = tiny_model("qwen2", 2)
    prompt = random_prompt(500)
    cache = make_cache("h2o", model, QEvictConfig(budget=0.2, kv_dtype="model"), max_length=510)  # as eager's
    full = make_cache("fullkv", model, QEvictConfig(kv_dtype="model"), max_length=510)
    with torch.inference_mode():
        model(prompt, **{KV: cache})
        model(prompt, **{KV: full})
        model.set_attn_implementation("eager")
        eager = model(prompt, output_attentions=True).attentions
        model.set_attn_implementation("qevict")
    capacity = cache.plan.capacity
    recent = capacity // 2
    for layer, ref, probs in zip(cache.layers, full.layers, eager):
        accumulated = probs[0].sum(dim=1).reshape(2, 2, 500).mean(dim=1)  # column sums, mean over the group
        for h in range(2):
            kept = kept_positions(layer.keys[h], ref.keys[:, h])
            assert kept[-recent:] == list(range(500 - recent, 500))
            heavy = accumulated[h, :500 - recent].topk(capacity - recent).indices.sort().values.tolist()
            assert kept[:-recent] == heavy
            torch.testing.assert_close(layer.acc[h][0], accumulated[h, kept], rtol=1e-4, atol=1e-5)


def test_streamingllm_keeps_exactly_sinks_and_recent():
    model = tiny_model("llama", 2)
    prompt, continuation = random_prompt(600), random_prompt(150, seed=5)
    cache = make_cache("streamingllm", model, QEvictConfig(budget=0.2, sinks=4), max_length=750)
    full = make_cache("fullkv", model, None, max_length=750)
    list(teacher_forced(model, cache, prompt, continuation))
    list(teacher_forced(model, full, prompt, continuation))
    capacity = cache.plan.capacity
    kept = kept_positions(cache.layers[0].keys[0], full.layers[0].keys[:, 0])  # layer 0 keys depend on tokens only
    assert kept == list(range(4)) + list(range(750 - (capacity - 4), 750))


def test_ragged_policies_free_memory_per_head():
    model = tiny_model("llama", 4)
    for method in ("adakv", "defensivekv"):
        cache = make_cache(method, model, QEvictConfig(budget=0.2), max_length=800)
        with torch.inference_mode():
            model(random_prompt(790), **{KV: cache})
        lengths = [[k.shape[1] for k in layer.keys] for layer in cache.layers]
        if method == "adakv":  # near-uniform random attention saturates DefensiveKV's protection: equal counts there
            assert any(len(set(per_layer)) > 1 for per_layer in lengths), f"{method}: heads kept equal counts"
        layer = cache.layers[0]
        assert layer.resident_bytes()["full"] == sum(k.nbytes + v.nbytes for k, v in zip(layer.keys, layer.values))
        assert layer.lengths.tolist() == lengths[0]
        with pytest.raises(ValueError, match="batch size 1"):
            make_cache(method, model, QEvictConfig(budget=0.2), max_length=800, batch_size=2)


def test_defensivekv_gives_a_concentrated_head_fewer_slots():
    """Head 0 puts its attention on five tokens, head 1 spreads it: head 0's protected set is small, so the
    layer-wide top-k hands head 1 the slots head 0 does not need, and head 0 still keeps its five tokens."""
    model = tiny_model("llama", 2)
    module = model.model.layers[0].self_attn
    n, window, groups, keep = 200, 8, module.num_key_value_groups, 40
    hot = torch.tensor([3, 50, 97, 120, 181])
    logits = torch.zeros(1, 2, groups, window, n + window)
    logits[:, 0, :, :, hot] = 12.0
    probs = logits.softmax(-1)
    torch.manual_seed(0)
    values = torch.randn(1, 2, n + window, module.head_dim)
    inputs = ScoreInputs(keys=torch.randn_like(values), values=values, module=module, keep=keep, candidates=n,
                         probs=probs)
    policy = DefensiveKV()
    scores = policy.score(inputs)
    counts = policy.allocate(scores, keep)
    assert sum(counts) == 2 * keep and counts[0] < counts[1]
    kept = policy.select(scores, counts)[0][0]
    assert set(hot.tolist()) <= set(kept.tolist())


def test_layer_defensivekv_gives_layers_different_budgets():
    model = tiny_model("llama", 2, num_hidden_layers=3)
    cache = make_cache("layer_defensivekv", model, QEvictConfig(budget=0.2), max_length=800)
    with torch.inference_mode():
        model(random_prompt(790), **{KV: cache})
    per_layer = [sum(k.shape[1] for k in layer.keys) for layer in cache.layers]
    assert len(set(per_layer)) > 1
    assert cache.memory_report()["total_bytes"] <= cache.budget_bytes


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_round_trip_and_residual(bits):
    model = tiny_model("llama", 2)
    cache = make_cache(f"kivi{bits}", model, None, max_length=400)
    layer = cache.layers[0]
    keys, values = torch.randn(1, 2, 150, 16), torch.randn(1, 2, 150, 16)
    for start, size in [(0, 70), (70, 1), (71, 40), (111, 39)]:
        if layer.is_initialized:  # the scales of what was stored before this call
            k_scale_before, v_scale_before = layer.k_scale.clone(), layer.v_scale.clone()
        k_out, v_out = layer.update(keys[:, :, start:start + size], values[:, :, start:start + size])
        seen = start + size
        assert layer.k_res.shape[2] == seen % 32  # keys: quantized in blocks of R = 32
        assert layer.v_res.shape[2] == min(seen, 32)  # values: the last R tokens stay in full precision
        # Attention sees earlier tokens as stored (dequantized) and this call's tokens in full precision.
        k_old, v_old = start - start % 32, max(0, start - 32)
        assert torch.equal(k_out[:, :, k_old:], keys[:, :, k_old:seen])
        assert torch.equal(v_out[:, :, v_old:], values[:, :, v_old:seen])
        if k_old:
            k_step = k_scale_before.repeat_interleave(32, dim=2)  # one scale per channel per 32-token group
            k_err = (k_out[:, :, :k_old] - keys[:, :, :k_old]).abs()
            assert torch.all(k_err <= k_step / 2 + 1e-5) and k_err.max() > 0
        if v_old:
            v_step = v_scale_before.repeat_interleave(16, dim=3)  # one scale per token per 16-channel group
            v_err = (v_out[:, :, :v_old] - values[:, :, :v_old]).abs()
            assert torch.all(v_err <= v_step / 2 + 1e-5) and v_err.max() > 0
    report = layer.resident_bytes()
    assert report["quantized"] == (128 + 118) * 2 * 16 * bits // 8  # 128 keys and 118 values coded, 2 heads
    assert sum(report.values()) == walked_bytes(cache)  # the residuals do not pin the prompt's storage
