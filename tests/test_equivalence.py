"""With a budget that holds everything, QEvict must be the uncompressed model: same tokens, same logits."""

import torch
from transformers import DynamicCache

from qevict_core import Lane, QEvictConfig, Sampling, generate_lanes, make_cache
from tests.conftest import KV, random_prompt, tiny_model

NEW = 40


class _Tok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _greedy_with_logits(model, prompt, cache):
    out = model.generate(prompt, **{KV: cache}, max_new_tokens=NEW, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, min_new_tokens=NEW)
    return out.sequences, torch.stack(out.logits)


def test_full_budget_matches_dynamic_cache(any_tiny_model):
    prompt = random_prompt(150)
    ref_tokens, ref_logits = _greedy_with_logits(any_tiny_model, prompt, DynamicCache(config=any_tiny_model.config))
    cache = make_cache("qevict", any_tiny_model, QEvictConfig(budget=1.0), max_length=150 + NEW)
    assert cache.plan.uncompressed and cache.plan.k_quant == 0
    tokens, logits = _greedy_with_logits(any_tiny_model, prompt, cache)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    # Nothing was routed or quantized, and the bytes are FullKV's: no score table on top.
    assert not cache.events and all(t["quantized"] == t["evicted"] == 0 for t in cache.tier_counts())
    report = cache.memory_report()
    assert report["total_bytes"] == report["fullkv_bytes"] == cache.shape.fullkv_bytes(150 + NEW - 1)


def test_fullkv_method_matches_dynamic_cache():
    model = tiny_model("llama", 2)
    prompt = random_prompt(90)
    ref_tokens, ref_logits = _greedy_with_logits(model, prompt, DynamicCache(config=model.config))
    cache = make_cache("fullkv", model, None, max_length=90 + NEW)
    tokens, logits = _greedy_with_logits(model, prompt, cache)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    report = cache.memory_report()
    assert report["total_bytes"] == report["fullkv_bytes"] == cache.shape.fullkv_bytes(90 + NEW - 1)


def test_decode_loop_and_model_generate_agree_under_compression():
    model = tiny_model("qwen2", 2)
    prompt = random_prompt(300)
    config = QEvictConfig(budget=0.25, recent=16, sinks=4)
    via_generate = model.generate(prompt, **{KV: make_cache("qevict", model, config, max_length=300 + NEW)},
                                  max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)[0, 300:].tolist()
    lane = Lane("q", make_cache("qevict", model, config, max_length=300 + NEW))
    events = list(generate_lanes(model, _Tok(), prompt, [lane], Sampling(max_new_tokens=NEW)))
    assert lane.tokens == via_generate
    assert events[-1].kind == "done" and events[-1].reason == "length"
    assert lane.cache.summary()["evictions"] > 0  # the comparison ran under real compression


def test_multi_token_chunk_after_eviction_stays_causal():
    """Feeding 5 tokens in one forward gives the logits of feeding them one at a time."""
    model = tiny_model("llama", 2)
    prompt, chunk = random_prompt(240), random_prompt(5, seed=7)
    config = QEvictConfig(budget=0.3, recent=16, sinks=4, omega=8)
    one = make_cache("qevict", model, config, max_length=260)
    many = make_cache("qevict", model, config, max_length=260)
    with torch.inference_mode():
        model(prompt, **{KV: one})
        model(prompt, **{KV: many})
        assert one.tier_counts()[0]["evicted"] > 0 and one.tier_counts()[0]["quantized"] > 0
        together = model(chunk, **{KV: one}).logits[0]
        apart = torch.cat([model(chunk[:, i:i + 1], **{KV: many}).logits[0] for i in range(5)])
    torch.testing.assert_close(together, apart, rtol=1e-4, atol=1e-4)
    assert one.get_seq_length() == many.get_seq_length() == 245


def test_lanes_together_give_each_lane_its_solo_result():
    """One prefill fanned out to nine caches (only the first computes its attention output), then one batched forward
    per step = nine separate runs."""
    model = tiny_model("llama", 2)
    prompt = random_prompt(500)
    methods = ["fullkv", "qevict", "qevict_head", "snapkv", "h2o", "adakv", "kivi2", "zipcache",
               "layer_defensivekv"]
    config = QEvictConfig(budget=0.2)

    def run(share):
        lanes = [Lane(m, make_cache(m, model, config, max_length=500 + 20)) for m in methods]
        list(generate_lanes(model, _Tok(), prompt, lanes, Sampling(max_new_tokens=20), together=share))
        return {lane.name: (lane.tokens, lane.cache.memory_report()["total_bytes"]) for lane in lanes}

    shared, solo = run(True), run(False)
    assert shared == solo
    assert len({tuple(tokens) for tokens, _ in shared.values()}) > 1  # the methods really differ
