"""ZipCache: normalised saliency picks the high-precision tokens, decoded tokens stream in, bytes are measured."""

import pytest
import torch

from qevict_core import make_cache
from qevict_core.baselines.zipcache import ZipCacheCache
from tests.conftest import KV, random_prompt, tiny_model
from tests.test_budget import walked_bytes


def constant_tokens(n: int, heads: int = 2, dim: int = 16) -> torch.Tensor:
    """Token i is the constant vector i + 1 in every head: quantized exactly (zero range), so it can be found."""
    return (torch.arange(n, dtype=torch.float32) + 1).view(1, 1, n, 1).expand(1, heads, n, dim).clone()


def test_saliency_is_normalised_by_the_queries_that_could_see_a_token():
    cache = ZipCacheCache(tiny_model("llama", 2), None, 400, salient_frac=0.4)
    layer = cache.layers[0]
    tokens = constant_tokens(10)
    layer.lazy_initialization(tokens, tokens)
    layer.buf_k, layer.buf_v = tokens, tokens
    # Equal accumulated attention: the newest tokens were seen by the fewest queries, so they are the most salient.
    # Token 1 gets 30x more: 30 / 9 queries beats 1 / 2, so it is salient too, and token 6 drops out.
    mass = torch.ones(1, 2, 10)
    mass[:, :, 1] = 30.0
    layer.buf_mass = mass
    layer._compress()
    high_values = layer.high.dequantized(layer.channel)[1][0, 0, :, 0]
    assert sorted(high_values.tolist()) == [2.0, 8.0, 9.0, 10.0]
    assert layer.low.tokens == 6 and layer.buf_k.shape[2] == 0


def test_decoded_tokens_stream_into_the_stores_and_bytes_are_measured():
    model = tiny_model("llama", 2)
    prompt = random_prompt(300)
    cache = make_cache("zipcache", model, None, max_length=440)
    out = model.generate(prompt, **{KV: cache}, max_new_tokens=130, min_new_tokens=130, do_sample=False)[0, 300:]
    counts = cache.tier_counts()[0]
    # 129 tokens were fed back: 100 compressed as one stream chunk, 29 still in full precision.
    assert counts == {"sink": 0, "recent": 29, "full": 0, "quantized": 400, "evicted": 0}
    layer = cache.layers[0]
    assert layer.high.tokens == round(0.4 * 300) + round(0.4 * 100)
    report = cache.memory_report()
    assert report["total_bytes"] == walked_bytes(cache) and report["ratio"] < 0.4  # of a 16-bit FullKV
    full = make_cache("fullkv", model, None, max_length=440)
    reference = model.generate(prompt, **{KV: full}, max_new_tokens=130, min_new_tokens=130, do_sample=False)[0, 300:]
    # Greedy paths part once one token differs; the start of the answer is FullKV's.
    assert torch.equal(out[:16], reference[:16])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="low_bits <= high_bits"):
        ZipCacheCache(tiny_model("llama", 2), None, 100, high_bits=2, low_bits=4)
    with pytest.raises(ValueError, match="salient_frac"):
        ZipCacheCache(tiny_model("llama", 2), None, 100, salient_frac=1.5)
