"""QEvict inside vLLM: recoverable quantized KV eviction for requests served by vLLM on the CPU.

    from vllm import LLM
    import qevict_vllm
    llm = LLM(model=..., **qevict_vllm.options(budget=0.2))

``register`` is the ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts, and it makes
QEvict's attention the CPU backend; that backend is the stock one until the QEvict connector is switched on.
"""

from __future__ import annotations

from .settings import kv_transfer_config, options

__all__ = ["kv_transfer_config", "options", "register", "report"]


def report() -> dict:
    """What QEvict holds and what vLLM got back, in a process that runs vLLM's engine in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): per request still registered, its cache's bytes and moves, and
    ``blocks_freed``, the KV blocks handed back to vLLM's pool."""
    from . import connector

    registry = connector.ACTIVE.get("worker")
    running = registry.report() if registry is not None else {}
    return {"requests": running, "blocks_freed": dict(connector.FREED)}


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "qevict_vllm.backend.QEvictCPUAttentionBackend")
