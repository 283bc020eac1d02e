"""End to end on the bundled SmolLM2-135M-Instruct (slow: loads the model)."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from qevict_core import Lane, QEvictConfig, Sampling, generate_lanes, make_cache
from qevict_core.cli import encode_prompt
from tests.conftest import KV

pytestmark = pytest.mark.slow
AUSTEN = Path(__file__).resolve().parents[1] / "ui" / "data" / "austen.txt"


def passage_prompt(tokenizer, tokens: int) -> torch.Tensor:
    text = AUSTEN.read_text()
    ids = tokenizer(text).input_ids[:tokens]
    passage = tokenizer.decode(ids)
    return encode_prompt(tokenizer, f"Read this passage.\n\n{passage}\n\nSummarize the passage in three sentences.",
                         raw=False)


def test_full_budget_matches_dynamic_cache_on_smollm2(smollm2):
    model, tok = smollm2
    prompt = passage_prompt(tok, 300)
    ref = model.generate(prompt, **{KV: DynamicCache(config=model.config)}, max_new_tokens=24, do_sample=False)
    cache = make_cache("qevict", model, QEvictConfig(budget=1.0), max_length=prompt.shape[1] + 24)
    out = model.generate(prompt, **{KV: cache}, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, ref)


def test_the_default_at_20_percent_on_a_long_prompt_is_fluent(smollm2):
    model, tok = smollm2
    prompt = passage_prompt(tok, 1450)
    assert 1400 < prompt.shape[1] < 1600
    new = 80
    cache = make_cache("qevict", model, QEvictConfig(budget=0.2), max_length=prompt.shape[1] + new)
    lane = Lane("qevict", cache)
    for event in generate_lanes(model, tok, prompt, [lane], Sampling(max_new_tokens=new)):
        if event.kind == "memory":
            assert event.total_bytes <= cache.budget_bytes
    words = lane.text.split()
    assert len(words) >= 20, lane.text
    four_grams = Counter(zip(words, words[1:], words[2:], words[3:]))
    assert max(four_grams.values()) <= 2, f"repetition loop: {lane.text!r}"
    assert len(set(words)) / len(words) > 0.4, lane.text
    tiers = cache.tier_counts()[10]
    assert tiers["quantized"] and tiers["evicted"]
    # At 20% of a 16-bit cache the low-bit tier's 70% coverage takes every historical byte: no full window.
    assert not tiers["full"] and cache.plan.k_full == 0


def test_cli_json_output_parses(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(AUSTEN.read_text()[:3000] + "\n\nWho is Mr. Bennet?")
    done = subprocess.run([sys.executable, "-m", "qevict_core", "generate", "--prompt-file", str(prompt),
                           "--budget", "0.3", "--max-new-tokens", "12", "--bits", "4", "--scale-dtype", "float16",
                           "--coverage", "0.7", "--pool", "1", "--pool-weight", "0.5",
                           "--pool-direction", "forward",
                           "--json"],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) >= {"text", "memory", "tiers", "events_summary"}
    assert result["memory"]["total_bytes"] <= result["memory"]["budget_bytes"]
    assert len(result["tiers"]) == 30 and result["events_summary"]["evictions"] > 0
    assert result["text"].strip()


def test_cli_runs_a_short_prompt_at_the_least_budget_and_says_so():
    """"Hi" with 8 new tokens cannot fit QEvict's sinks and recent region in 20%: the CLI runs it at the least it
    can and prints that ratio; --strict-budget refuses instead, in one line."""
    base = [sys.executable, "-m", "qevict_core", "generate", "--prompt", "Hi", "--budget", "0.2",
            "--max-new-tokens", "8"]
    done = subprocess.run(base, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert "qevict runs at " in done.stdout and "of FullKV's bytes, not 20.0%" in done.stdout
    done = subprocess.run(base + ["--strict-budget"], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot hold the protected regions" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_cli_graphs_without_a_gpu_is_one_line():
    done = subprocess.run([sys.executable, "-m", "qevict_core", "generate", "--prompt", "Hi", "--graphs",
                           "--max-new-tokens", "2"], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "decode steps replay from CUDA graphs: the model is on cpu, not a GPU" in done.stderr


def test_a_prompt_read_in_chunks_is_routed_as_if_read_whole_on_smollm2(smollm2):
    """The INT8 stage (prompt_stage.py) on the real model: the same full tier in nearly every layer, the same tokens."""
    from qevict_core.generation.prefill import prefill

    model, tok = smollm2
    prompt = passage_prompt(tok, 600)

    def run(chunk):
        cache = make_cache("qevict", model, QEvictConfig(budget=0.2), max_length=prompt.shape[1] + 8)
        logits, tokens = prefill(model, prompt, cache, chunk), []
        with torch.inference_mode():
            for _ in range(8):
                tokens.append(logits.argmax(-1, keepdim=True))
                logits = model(tokens[-1], **{KV: cache}, logits_to_keep=1).logits[:, -1]
        return cache, torch.cat(tokens, dim=1)

    (whole, ref), (chunked, got) = run(None), run(128)
    assert torch.equal(got, ref)
    same_full = sum(torch.equal(a.full_ids, b.full_ids) for a, b in zip(whole.layers, chunked.layers))
    assert same_full >= 27, f"{same_full} of 30 layers kept the same full tier"


NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def needle_prompt(tokenizer, seed: int, tokens: int = 2000):
    """A RULER niah_single_1-style prompt: noise haystack, a 7-digit needle at half depth, the answer prefix."""
    import random

    rng = random.Random(seed)
    key = rng.choice(["apple", "river", "lantern", "violet", "harbor", "falcon"])
    value = str(rng.randint(10**6, 10**7 - 1))
    haystack = [NOISE] * (tokens // 23)
    haystack.insert(len(haystack) // 2, f"One of the special magic numbers for {key} is: {value}.")
    question = (f"Some special magic numbers are hidden within the following text. Make sure to memorize it. I will "
                f"quiz you about the numbers afterwards.\n{' '.join(haystack)}\nWhat are all the special magic numbers "
                f"for {key} mentioned in the provided text?")
    ids = encode_prompt(tokenizer, question, raw=False)
    prefix = tokenizer(f" The special magic numbers for {key} mentioned in the provided text are",
                       add_special_tokens=False, return_tensors="pt").input_ids
    return torch.cat([ids, prefix], dim=1), value


@pytest.mark.parametrize("seed", [0, 1])
def test_needle_in_the_middle_survives_qevict_not_streamingllm(smollm2, seed):
    model, tok = smollm2
    prompt, value = needle_prompt(tok, seed)
    assert 2000 < prompt.shape[1] < 2300
    answers = {}
    for method in ("fullkv", "qevict", "streamingllm"):
        cache = make_cache(method, model, QEvictConfig(budget=0.2), max_length=prompt.shape[1] + 12)
        lane = Lane(method, cache)
        list(generate_lanes(model, tok, prompt, [lane], Sampling(max_new_tokens=12)))
        answers[method] = lane.text
    assert value in answers["fullkv"], answers
    assert value in answers["qevict"], answers
    assert value not in answers["streamingllm"], answers
