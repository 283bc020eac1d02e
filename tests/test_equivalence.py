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


class RoundedDynamicCache(DynamicCache):
    """transformers' cache holding each key and value as ``dtype`` would store it: the reference of a 16-bit
    cache beside a float32 model, built without any of this package's code."""

    def __init__(self, config, dtype):
        super().__init__(config=config)
        self.stored = dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rounded = (t.to(self.stored).to(t.dtype) for t in (key_states, value_states))
        return super().update(*rounded, layer_idx, *args, **kwargs)


def test_full_budget_is_fullkv_and_fullkv_is_transformers_cache(any_tiny_model):
    prompt = random_prompt(150)
    for kv_dtype, reference in (("model", DynamicCache(config=any_tiny_model.config)),
                                ("bfloat16", RoundedDynamicCache(any_tiny_model.config, torch.bfloat16))):
        ref_tokens, ref_logits = _greedy_with_logits(any_tiny_model, prompt, reference)
        config = QEvictConfig(budget=1.0, kv_dtype=kv_dtype)
        for method in ("qevict", "fullkv"):
            cache = make_cache(method, any_tiny_model, config, max_length=150 + NEW)
            tokens, logits = _greedy_with_logits(any_tiny_model, prompt, cache)
            assert torch.equal(tokens, ref_tokens), (kv_dtype, method)
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
            report = cache.memory_report()
            assert report["total_bytes"] == report["fullkv_bytes"] == cache.shape.fullkv_bytes(150 + NEW - 1)
            if method == "qevict":  # nothing routed or quantized, and the bytes are FullKV's: no score table
                assert cache.plan.uncompressed and cache.plan.k_quant == 0 and not cache.events
                assert all(t["quantized"] == t["evicted"] == 0 for t in cache.tier_counts())


def test_every_method_stores_sixteen_bits_beside_a_float32_model():
    """Budgets are shares of a 16-bit cache: FullKV's bytes per token are half a float32 cache's, and no method
    keeps a float32 key or value, whichever tier holds it."""
    from tests.test_budget import resident_tensors

    model = tiny_model("llama", 2)
    prompt = random_prompt(200)
    wide = make_cache("fullkv", model, QEvictConfig(kv_dtype="model"), max_length=240)
    for method in ("fullkv", "qevict", "qevict_head", "snapkv", "adakv", "kivi2", "kvquant2", "zipcache"):
        cache = make_cache(method, model, QEvictConfig(budget=0.3, kv_dtype="float16"), max_length=240)
        assert cache.shape.token_bytes() * 2 == wide.shape.token_bytes()
        model.generate(prompt, **{KV: cache}, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        stored = {t.dtype for layer in cache.layers for t in resident_tensors(layer)
                  if t.is_floating_point() and t.shape[-1] == model.config.head_dim}
        assert stored == {torch.float16}, (method, stored)


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
