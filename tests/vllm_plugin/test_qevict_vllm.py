"""QEvict inside vLLM (qevict_vllm), in the vLLM environment: ``make test-vllm`` builds it and runs these.

Each vLLM engine runs in a fresh process (tests.vllm_plugin.serve_once.py); the transformers engine runs here, on the same
token ids, as the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` builds .venv-vllm and runs these")

from bench.vllm_plugin import engine_side  # noqa: E402
from qevict_core import KVShape, load_model  # noqa: E402
from qevict_vllm.settings import config_from  # noqa: E402
from ui.examples import austen, needle_in_austen  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def serve(prompts: list[list[int]], max_tokens: int, settings: dict | None, **llm) -> dict:
    job = json.dumps({"prompts": prompts, "max_tokens": max_tokens, "settings": settings, "llm": llm})
    done = subprocess.run([sys.executable, "-m", "tests.vllm_plugin.serve_once", job], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, done.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def smollm2():
    return load_model()


def chat_ids(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"]


def block_bytes(model) -> int:
    """One vLLM block of 32 tokens over every layer, in the served dtype (float32 here)."""
    return KVShape.from_model(model).fullkv_bytes(32)


def test_a_request_whose_budget_holds_everything_is_vllms_own(smollm2):
    """At budget 1 no request gets a QEvict cache: vLLM's own attention over its own blocks, nothing handed back,
    nothing held twice, the same tokens as vLLM alone."""
    _, tok = smollm2
    prompts = [chat_ids(tok, "What is the capital of France?"), chat_ids(tok, austen(1000, 3000) + "\nSummarise."),
               chat_ids(tok, needle_in_austen(chars=4000))]
    stock = serve(prompts, 40, None)
    qevict = serve(prompts, 40, {"budget": 1.0})
    assert qevict["tokens"] == stock["tokens"]
    assert qevict["moves"] == [None] * 3 and qevict["bytes"] == [0] * 3
    assert qevict["blocks_freed"] == [0] * 3 and qevict["blocks_kept"] == [None] * 3


def test_a_request_too_short_to_compress_is_served_by_vllm_beside_compressed_ones(smollm2):
    """At 20% a one-line question cannot hold its sinks and recent tokens in a fifth of its bytes, so vLLM serves it
    alone (its tokens are vLLM's), in the same batch as a long prompt that QEvict compresses and answers."""
    model, tok = smollm2
    prompts = [chat_ids(tok, "What is the capital of France?"), chat_ids(tok, needle_in_austen())]
    stock = serve(prompts[:1], 24, None)
    mixed = serve(prompts, 24, {"budget": 0.2})
    assert mixed["tokens"][0] == stock["tokens"][0] and mixed["moves"][0] is None
    assert mixed["moves"][1]["evictions"] > 0 and "4738291" in tok.decode(mixed["tokens"][1])
    assert mixed["bytes"][1] <= mixed["blocks_kept"][1] * block_bytes(model)


def test_concurrent_requests_are_each_routed_as_the_transformers_engine_routes_them_alone(smollm2):
    """Three needle prompts of different lengths served together at 20%, Ω = 32: each request's windows in every
    layer end where the transformers engine puts them when it runs that prompt alone, and it finds its number."""
    model, tok = smollm2
    needles = [("lantern", "4738291", 8200), ("harbor", "5190437", 5000), ("violet", "8812044", 6500)]
    prompts = [chat_ids(tok, needle_in_austen(chars=chars, key=key, value=value, start=9000 * i))
               for i, (key, value, chars) in enumerate(needles)]
    served = serve(prompts, 24, {"budget": 0.2})
    for i, ((key, value, _), ids) in enumerate(zip(needles, prompts)):
        alone = engine_side(model, ids, config_from({"budget": 0.2}, 32), 24, None)  # the plugin's config
        same = sum(a == tuple(map(list, b)) or a == b for a, b in zip(alone["tiers"], served["tiers"][i]))
        assert same == len(alone["tiers"]), f"request {i}: {same} of {len(alone['tiers'])} layers route alike"
        assert served["moves"][i] == alone["moves"], i
        assert value in tok.decode(served["tokens"][i]), (key, tok.decode(served["tokens"][i]))
        assert served["tokens"][i] == alone["tokens"], i
        # the blocks of its budget stay allocated (vLLM's admission counts them) and hold what its cache holds;
        # every other block it has read went back to the pool
        assert 0 < served["bytes"][i] <= served["blocks_kept"][i] * block_bytes(model)
        assert served["blocks_freed"][i] >= len(ids) // 32 - served["blocks_kept"][i] - 1


def test_a_prompt_vllm_reads_in_chunks_is_staged_and_still_answered(smollm2):
    """With at most 512 tokens per step vLLM reads the 2K needle prompt in five chunks: the engine stages them in
    INT8 and routes once, at the last; the blocks of earlier chunks go back to the pool while it reads."""
    _, tok = smollm2
    ids = chat_ids(tok, needle_in_austen())
    served = serve([ids], 24, {"budget": 0.2}, max_num_batched_tokens=512)
    assert "4738291" in tok.decode(served["tokens"][0])
    assert served["moves"][0]["evictions"] > 0 and not served["moves"][0]["uncompressed"]
    assert served["blocks_freed"][0] >= len(ids) // 32 - served["blocks_kept"][0] - 1


def test_the_documented_snippet_runs_as_printed(tmp_path):
    """docs/vllm.md's example, as written (vLLM's default: its engine in a second process)."""
    import re

    block = next(b for b in re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "vllm.md").read_text(), re.S)
                 if "qevict_vllm.options" in b)
    script = tmp_path / "snippet.py"
    script.write_text(block)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "QEVICT_VLLM")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if "INFO" not in line and "WARNING" not in line]
    assert any("Paris" in line for line in printed), done.stdout[-2000:]  # the chat template applied: it answers
    freed = next(line for line in reversed(printed) if line.startswith("{"))
    assert sum(json.loads(freed.replace("'", '"')).values()) == 0  # a short prompt: every block still in use


def test_preemption_is_survived_and_answers_equal_an_unpreempted_run():
    """24 prompts of 224 tokens in a pool of 64 blocks: vLLM preempts and recomputes requests. At a budget that
    holds everything (vLLM's own) the tokens equal those of a pool large enough for all; at 20% (each raised to the
    least it runs with, still compressed) each preempted request gets a fresh QEvict cache on its recomputed tokens,
    and every request finishes."""
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(224)] for i in range(24)]
    roomy = serve(prompts, 24, {"budget": 1.0}, max_model_len=1024)
    tight = serve(prompts, 24, {"budget": 1.0}, num_gpu_blocks_override=64, max_model_len=1024)
    assert len(tight["tokens"]) == 24 and all(len(t) == 24 for t in tight["tokens"])
    assert tight["tokens"] == roomy["tokens"]
    assert tight["preempted"] > 0  # the pool was tight enough that vLLM preempted
    compressed = serve(prompts, 24, {"budget": 0.2}, num_gpu_blocks_override=64, max_model_len=1024)
    assert len(compressed["tokens"]) == 24 and all(len(t) == 24 for t in compressed["tokens"])
    assert compressed["preempted"] > 0 and all(m["evictions"] + m["demotions"] > 0 for m in compressed["moves"])
