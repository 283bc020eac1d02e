"""transformers conventions: ``past_key_values=`` as well as ``cache=``; the model's attention implementation left
as it was for every other cache; ``max_length`` optional."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from qevict_core import QEvictConfig, make_cache
from tests.conftest import KV, random_prompt, tiny_model

NEW = 24


def greedy(model, prompt, **cache):
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.24 calls past_key_values= deprecated
        return model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **cache)


@pytest.mark.parametrize("keyword", sorted({KV, "past_key_values"}))
def test_either_keyword_runs_the_cache(keyword):
    model, prompt = tiny_model("llama", 2), random_prompt(300)
    ref = greedy(model, prompt, **{KV: make_cache("qevict", model, QEvictConfig(budget=0.3), max_length=300 + NEW)})
    cache = make_cache("qevict", model, QEvictConfig(budget=0.3), max_length=300 + NEW)
    out = greedy(model, prompt, **{keyword: cache})
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == 300 + NEW - 1 and cache.summary()["evictions"] > 0


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_other_caches_keep_the_models_own_attention(implementation):
    """After a QEvict cache was made (and used), a DynamicCache run calls the model's own implementation and gives
    exactly the tokens and logits it gave before."""
    model, prompt = tiny_model("llama", 2), random_prompt(120)
    model.set_attn_implementation(implementation)

    def plain():
        with torch.inference_mode():
            out = model.generate(prompt, **{KV: DynamicCache(config=model.config)}, max_new_tokens=NEW,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits)

    before = plain()
    greedy(model, prompt, **{KV: make_cache("qevict", model, QEvictConfig(budget=0.5), max_length=120 + NEW)})
    assert model.config._attn_implementation != implementation  # wrapped, not replaced
    after = plain()
    assert torch.equal(after[0], before[0])
    torch.testing.assert_close(after[1], before[1], rtol=0, atol=0)


def test_eager_output_attentions_still_works_after_a_cache():
    """output_attentions needs eager attention's weights: the wrapper hands an unclaimed call to it unchanged."""
    model, prompt = tiny_model("llama", 2), random_prompt(40)
    model.set_attn_implementation("eager")
    make_cache("qevict", model, QEvictConfig(budget=1.0), max_length=60)
    with torch.inference_mode():
        out = model(prompt, output_attentions=True)
    assert out.attentions[0].shape == (1, 4, 40, 40)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(1, 4, 40))


def test_max_length_is_optional():
    """Without max_length the budget is a share of a full context of the model's, and the cache grows with the
    sequence up to it."""
    model, prompt = tiny_model("llama", 2, max_position_embeddings=2048), random_prompt(100)
    cache = make_cache("qevict", model, QEvictConfig(budget=0.2))
    assert cache.max_length == 2048 and cache.budget_bytes == int(0.2 * cache.shape.fullkv_bytes(2048))
    greedy(model, prompt, **{KV: cache})
    early = cache.memory_report()["total_bytes"]
    greedy(model, random_prompt(600), **{KV: (longer := make_cache("qevict", model, QEvictConfig(budget=0.2)))})
    assert early < longer.memory_report()["total_bytes"] <= longer.budget_bytes == cache.budget_bytes


def test_a_model_without_a_context_length_needs_max_length():
    model = tiny_model("llama", 2)
    model.config.__dict__["max_position_embeddings"] = None  # the config class refuses None; some models have none
    with pytest.raises(ValueError, match="declares no context length .* give max_length"):
        make_cache("qevict", model, QEvictConfig())
