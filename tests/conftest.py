"""Shared fixtures: tiny random models built from configs (no downloads) and the bundled SmolLM2."""

from __future__ import annotations

import os

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels run through Triton's interpreter, chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Shared with the benchmarks' smoke runs, re-exported for the tests.
from qevict_core.testing import tiny_chat_model, tiny_model, tiny_tokenizer  # noqa: F401, E402

torch.set_num_threads(int(os.environ.get("QEVICT_TEST_THREADS", "2")))

# The cache's keyword in this transformers (``cache`` from 5.24, ``past_key_values`` before: Python 3.10's 5.20).
from qevict_core.generation.model_call import cache_keyword  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

KV = cache_keyword(LlamaForCausalLM)

TINY_CASES = [("llama", 2), ("llama", 4), ("qwen2", 2), ("mistral", 2), ("mistral", 4), ("qwen2", 4)]
FAST_CASES = {("llama", 2), ("qwen2", 4), ("mistral", 2)}  # one per family, GQA and MHA both: the fast suite's matrix


def pytest_collection_modifyitems(config, items):
    """A test that asks for SmolLM2 is slow whatever it says: the fast suite (make test-fast) loads no real model."""
    for item in items:
        if {"smollm2", "smollm2_studio"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=[c if c in FAST_CASES else pytest.param(c, marks=pytest.mark.slow) for c in TINY_CASES],
                ids=lambda c: f"{c[0]}-kv{c[1]}")
def any_tiny_model(request):
    family, kv_heads = request.param
    return tiny_model(family, kv_heads)


@pytest.fixture(scope="session")
def smollm2():
    from qevict_core import load_model

    return load_model(device="cpu")


def random_prompt(length: int, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, length), generator=generator)


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL server (Debian's postgresql package) on a free loopback port: -> a URL prefix."""
    from tests.postgres import start_postgres

    server = start_postgres()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """A fresh, empty database of each kind the studio supports."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/sessions.sqlite"
    return request.getfixturevalue("postgres_server").new_database()
