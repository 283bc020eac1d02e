"""The PyTorch path's faster assembly of [quantized | sinks | full | recent] is the path it replaced, bit for bit:
same keys and values at every step, so the same tokens."""

import pytest
import torch

import qevict_core.engine.qevict_layer as cache_module
from qevict_core import Lane, QEvictConfig, Sampling, generate_lanes, make_cache
from qevict_core.engine.assemble import assemble, assemble_reference
from qevict_core.engine.layout import WindowGrid
from tests.conftest import KV, random_prompt, tiny_model
from tests.test_equivalence import _Tok


def reference_assemble(config):
    """``assemble`` with the old arithmetic: shifts to unpack, the rotary module per position, a cat."""
    def run(ledger, fp_keys, fp_values, cos, sin, dtype=None):
        rope = run.rope
        positions = WindowGrid(config.sinks, config.omega).positions(ledger.ids)
        return assemble_reference(ledger, fp_keys, fp_values, rope, positions, dtype)
    return run


def layer_parts(layer):
    return [layer.sink_k, layer.full_k, layer.recent_k], [layer.sink_v, layer.full_v, layer.recent_v]


@pytest.mark.parametrize("dtype, scale_dtype", [(torch.float32, "model"), (torch.bfloat16, "model"),
                                                (torch.float32, "float16")])
@pytest.mark.parametrize("bits", [2, 4])
def test_assembled_tiers_equal_the_reference_bit_for_bit(dtype, scale_dtype, bits):
    model = tiny_model("qwen2", 2).to(dtype)
    config = QEvictConfig(budget=0.2, bits=bits, sinks=4, recent=16, scale_dtype=scale_dtype)
    cache = make_cache("qevict", model, config, max_length=460)
    checked = 0
    with torch.inference_mode():
        logits = model(random_prompt(400), **{KV: cache}).logits
        for _ in range(40):
            logits = model(logits[:, -1:].argmax(-1), **{KV: cache}).logits
            for layer in cache.layers:
                positions = cache.grid.positions(layer.quant.ids)
                cache.begin_forward(0)  # a fresh table, as a forward would build it
                cos, signed_sin = cache.tier_rope(layer.sink_k, layer.quant.ids)
                fast = assemble(layer.quant, *layer_parts(layer), cos, signed_sin, dtype=dtype)
                slow = assemble_reference(layer.quant, *layer_parts(layer), cache.rope, positions, dtype)
                assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
                checked += layer.quant.num_windows > 0
    assert checked > 40  # the quantized tier was there to compare


@pytest.mark.parametrize("family, kv_heads", [("llama", 2), ("mistral", 4)])
def test_generation_yields_the_tokens_of_the_path_it_replaced(monkeypatch, family, kv_heads):
    model = tiny_model(family, kv_heads)
    config = QEvictConfig(budget=0.15, coverage=None)  # three tiers: promotions and demotions

    def generate():
        lane = Lane("q", make_cache("qevict", model, config, max_length=700))
        list(generate_lanes(model, _Tok(), random_prompt(600, seed=3), [lane], Sampling(max_new_tokens=100)))
        return lane.tokens, lane.cache.summary()

    fast = generate()
    old = reference_assemble(config)
    old.rope = make_cache("qevict", model, config, max_length=700).rope
    monkeypatch.setattr(cache_module, "assemble", old)
    assert generate() == fast
    assert fast[1]["promotions"] + fast[1]["demotions"] > 0  # tiers moved while the tokens were compared
