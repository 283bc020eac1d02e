"""How a vLLM user switches QEvict on: the KV connector's ``kv_transfer_config``, with QEvict's settings in its
``kv_connector_extra_config``, validated when the engine starts.

    LLM(model=..., **qevict_vllm.options(budget=0.2))   # kv_transfer_config, block_size=32, no prefix caching
"""

from __future__ import annotations

import dataclasses

from qevict_core import QEvictConfig

CONNECTOR = "QEvictConnector"
MODULE = "qevict_vllm.connector"


BLOCK_SIZE = 32  # a window is one KV block; vLLM's CPU default (128 tokens) would make windows 16x QEvict's Ω = 8


def options(block_size: int = BLOCK_SIZE, **settings) -> dict:
    """The ``LLM(...)`` keyword arguments that run every request with QEvict: the connector, KV blocks of
    ``block_size`` tokens (a multiple of 32 on the CPU), prefix caching off; ``settings`` are QEvictConfig
    fields (``budget``, ``bits``, ``coverage``, ...)."""
    return {"kv_transfer_config": kv_transfer_config(**settings), "block_size": block_size,
            "enable_prefix_caching": False}


def kv_transfer_config(**settings) -> dict:
    """The ``kv_transfer_config`` that runs every request of an ``LLM`` with QEvict; ``settings`` are
    ``QEvictConfig`` fields (``budget``, ``bits``, ``coverage``, ...). Checked here, before vLLM starts."""
    config_from(settings, block_size=None)
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE, "kv_role": "kv_both",
            "kv_connector_extra_config": dict(settings)}


def config_from(settings: dict, block_size: int | None) -> QEvictConfig:
    """``settings`` as a QEvictConfig whose windows are one KV block (Ω = ``block_size``, the default); an unknown
    field or a bad value raises ValueError naming what is allowed."""
    allowed = {f.name for f in dataclasses.fields(QEvictConfig)} - {"record_events", "kernels", "budget_bytes"}
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise ValueError(f"unknown QEvict settings {unknown}; allowed: {sorted(allowed)}")
    omega = settings.get("omega", block_size)
    if block_size is not None and omega != block_size:
        raise ValueError(f"omega must equal vLLM's KV block size ({block_size}): a window is one block (got "
                         f"omega={omega!r}); set block_size={omega} or leave omega out")
    values = dict(settings)
    if omega is not None:
        values["omega"] = omega
    return QEvictConfig(**values)


def check_engine(vllm_config) -> None:
    """What QEvict in vLLM does not support yet, refused before the first request."""
    if vllm_config.cache_config.enable_prefix_caching:
        raise ValueError("QEvict compresses each request's own KV, which prefix caching would share between "
                         "requests: start vLLM with enable_prefix_caching=False")
    if vllm_config.parallel_config.world_size > 1:
        raise ValueError("QEvict in vLLM runs on one worker (tensor_parallel_size=1, pipeline_parallel_size=1)")
    if vllm_config.speculative_config is not None:
        raise ValueError("QEvict in vLLM does not support speculative decoding")
