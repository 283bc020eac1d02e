"""A prompt read in chunks: exact for FullKV, staged in INT8 and routed as if read whole for QEvict."""

import pytest
import torch

from qevict_core import Lane, QEvictConfig, Sampling, generate_lanes, make_cache
from qevict_core.generation.prefill import chunk_sizes, prefill
from qevict_core.engine.rope import Rope
from qevict_core.engine.prompt_stage import BLOCK
from tests.conftest import KV, random_prompt, tiny_model
from tests.test_budget import walked_bytes
from tests.test_equivalence import _Tok

PROMPT, NEW = 700, 16


def _decode(model, cache, logits, steps: int = NEW) -> list[int]:
    tokens, token = [], logits.argmax(-1, keepdim=True)
    with torch.inference_mode():
        for _ in range(steps):
            tokens.append(int(token))
            token = model(token, **{KV: cache}, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    return tokens


def test_chunk_sizes_put_a_whole_chunk_last():
    assert chunk_sizes(700, 96) == [28] + [96] * 7
    assert chunk_sizes(768, 96) == [96] * 8
    assert chunk_sizes(50, 96) == chunk_sizes(50, None) == [50]


def test_fullkv_reads_chunks_exactly():
    model, prompt = tiny_model("llama", 2), random_prompt(PROMPT)
    whole = make_cache("fullkv", model, None, max_length=PROMPT + NEW)
    chunked = make_cache("fullkv", model, None, max_length=PROMPT + NEW)
    ref, got = prefill(model, prompt, whole), prefill(model, prompt, chunked, chunk=96)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert _decode(model, chunked, got) == _decode(model, whole, ref)
    assert chunked.memory_report()["total_bytes"] == whole.memory_report()["total_bytes"]


@pytest.mark.parametrize("family,kv_heads,method,config", [
    ("llama", 2, "qevict", QEvictConfig(budget=0.5)),
    ("qwen2", 4, "qevict", QEvictConfig(budget=0.3, bits=4, scorer="pnorm", kernels="torch")),
    ("llama", 2, "qevict_paper", QEvictConfig(budget=0.25)),  # every prompt query scores: chunks fold as they run
], ids=["llama-gqa-int2", "qwen2-mha-int4-pnorm-torch", "paper-preset"])
def test_staged_prompt_is_routed_as_if_read_whole(family, kv_heads, method, config):
    model, prompt = tiny_model(family, kv_heads), random_prompt(PROMPT)
    whole = make_cache(method, model, config, max_length=PROMPT + NEW)
    chunked = make_cache(method, model, config, max_length=PROMPT + NEW)
    ref, got = prefill(model, prompt, whole), prefill(model, prompt, chunked, chunk=96)
    # The same windows in every tier of every layer, scores within the INT8 staging error.
    for a, b in zip(whole.layers, chunked.layers):
        assert torch.equal(a.full_ids, b.full_ids) and torch.equal(a.quant.ids, b.quant.ids)
        torch.testing.assert_close(b.scores, a.scores, rtol=2e-2, atol=1e-4)
    assert chunked.tier_counts() == whole.tier_counts() and chunked.tier_counts()[0]["evicted"] > 0
    assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert _decode(model, chunked, got) == _decode(model, whole, ref)
    report = chunked.memory_report()
    assert report["total_bytes"] == whole.memory_report()["total_bytes"] <= chunked.budget_bytes
    assert report["components"]["staged"] == 0


def test_stage_holds_the_prompt_within_half_an_int8_step_and_its_bytes_are_counted():
    model, prompt = tiny_model("llama", 2), random_prompt(PROMPT)
    reference = make_cache("fullkv", model, None, max_length=PROMPT)
    prefill(model, prompt, reference)
    cache = make_cache("qevict", model, QEvictConfig(budget=0.25), max_length=PROMPT)
    sizes, start = chunk_sizes(PROMPT, 96), 0
    with torch.inference_mode():
        for size in sizes[:-1]:
            cache.read_prompt_chunk(more_to_come=True)
            model(prompt[:, start:start + size], **{KV: cache})
            start += size
            report = cache.memory_report()
            assert report["components"]["staged"] > 0 and report["total_bytes"] == walked_bytes(cache)
    assert not cache.events and cache.step == -1  # nothing routed, no step counted while the prompt is staged
    # Layer 0's keys depend on the embeddings alone, so they are the reference's exactly before staging.
    layer, ref = cache.layers[0], reference.layers[0]
    blocks = layer.stage.blocks
    assert blocks.num_windows == (start - layer.sink_k.shape[2]) // BLOCK
    keys, values = blocks.dequantize(torch.float32)  # pre-RoPE
    span = slice(layer.sink_k.shape[2], layer.sink_k.shape[2] + keys.shape[2])
    positions = torch.arange(span.start, span.stop)[None]
    true_keys = Rope.from_model(model).unrotate(ref.keys[:, :, span].float(), positions)
    key_step = blocks.k_scale.repeat_interleave(BLOCK, dim=2)  # per channel, per block
    assert ((keys - true_keys).abs() <= key_step / 2 + 1e-5).all()
    assert ((values - ref.values[:, :, span].float()).abs() <= blocks.v_scale / 2 + 1e-5).all()
    assert key_step.max() > 0  # the bound is not vacuous


def test_generate_lanes_reads_each_lane_in_chunks():
    model, prompt = tiny_model("qwen2", 2), random_prompt(PROMPT)
    config = QEvictConfig(budget=0.25)

    def run(chunk):
        lanes = [Lane(m, make_cache(m, model, config, max_length=PROMPT + NEW)) for m in ("fullkv", "qevict")]
        list(generate_lanes(model, _Tok(), prompt, lanes, Sampling(max_new_tokens=NEW), prefill_chunk=chunk))
        return lanes

    whole, chunked = run(None), run(128)
    for a, b in zip(whole, chunked):
        assert b.done == "length" and b.tokens == a.tokens


def test_chunks_are_refused_where_they_would_change_the_method():
    model, prompt = tiny_model("llama", 2), random_prompt(300)
    for method in ("snapkv", "qevict_head", "kivi2"):
        with pytest.raises(ValueError, match="cannot read a prompt in chunks"):
            prefill(model, prompt, make_cache(method, model, QEvictConfig(budget=0.3), max_length=300), chunk=64)
    cache = make_cache("qevict", model, QEvictConfig(budget=0.3), max_length=310)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="whole number of tokens"):
            prefill(model, prompt, cache, chunk=bad)
    with pytest.raises(ValueError, match="prefill_window = 32"):
        prefill(model, prompt, cache, chunk=16)
    prefill(model, prompt, cache)
    with pytest.raises(ValueError, match="already read"):
        prefill(model, random_prompt(64), cache, chunk=32)
