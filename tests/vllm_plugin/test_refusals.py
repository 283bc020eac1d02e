"""Everything QEvict in vLLM cannot serve exactly is refused by ``qevict_vllm.options`` with one clear error, before
vLLM loads anything; without the options, vLLM runs as if the plugin were absent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` builds .venv-vllm and runs these")

import qevict_vllm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def saved(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("make, reason", [
    (lambda t: t.MistralConfig(sliding_window=64), "a sliding window of 64 tokens"),
    (lambda t: t.Gemma2Config(), "layer types"),
    (lambda t: t.LlamaConfig(attn_logit_softcapping=30.0), "attn_logit_softcapping = 30.0"),
    (lambda t: t.BloomConfig(), "no rotary position embedding"),
    (lambda t: t.T5Config(), "encoder-decoder attention"),
], ids=["sliding-window", "mixed-layers", "soft-cap", "alibi", "encoder-decoder"])
def test_an_attention_qevict_would_not_compute_exactly_is_refused(tmp_path, make, reason):
    import transformers

    with pytest.raises(ValueError, match="QEvict in vLLM computes full causal attention") as refused:
        qevict_vllm.options(budget=0.2, model=saved(tmp_path, make(transformers)))
    assert reason in str(refused.value)


def test_a_llama_is_accepted(tmp_path):
    import transformers

    options = qevict_vllm.options(budget=0.2, model=saved(tmp_path, transformers.LlamaConfig()))
    assert options["block_size"] == 32 and options["enable_prefix_caching"] is False


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": 1.5}, r"budget must be a number in \(0, 1\]"),
    ({"head_blend": 0.3}, r"QEvict in vLLM does not read \['head_blend'\]"),
    ({"kernels": "cpu"}, r"does not read \['kernels'\]"),
    ({"omega": 16}, r"omega must equal vLLM's KV block size \(32\).*multiple of 32"),
    ({"block_size": 16}, r"block_size must be a multiple of 32 tokens"),
])
def test_a_bad_setting_is_refused_before_vllm_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        qevict_vllm.options(**kwargs)


def test_a_gpu_platform_is_refused(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    with pytest.raises(ValueError, match="replaces vLLM's CPU attention only"):
        qevict_vllm.options(budget=0.2)


def test_without_the_options_vllm_keeps_its_own_attention_and_imports_nothing_of_qevict():
    probe = ("import os, sys; os.environ.pop('QEVICT_VLLM', None)\n"
             "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
             "from vllm.v1.attention.backends.registry import AttentionBackendEnum as A\n"
             "print(A.CPU_ATTN.get_path()); print('qevict_core.engine.cache' in sys.modules)\n"
             "os.environ['QEVICT_VLLM'] = '1'; import qevict_vllm; qevict_vllm.register()\n"
             "print(A.CPU_ATTN.get_path())")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    stock, imported, opted = done.stdout.strip().splitlines()[-3:]
    assert "qevict" not in stock and imported == "False"
    assert opted == "qevict_vllm.backend.QEvictCPUAttentionBackend"
