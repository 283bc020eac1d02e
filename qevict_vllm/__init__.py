"""QEvict inside vLLM: recoverable quantized KV eviction for requests served by vLLM on the CPU.

    from vllm import LLM
    import qevict_vllm
    llm = LLM(model=path, **qevict_vllm.options(budget=0.2, model=path))
    qevict_vllm.report(llm)   # per request: the bytes its QEvict cache holds, its moves; blocks handed back

Opt-in: ``register`` is the ``vllm.general_plugins`` entry point, which vLLM calls in every process it starts; it
makes QEvict's attention the CPU backend only in processes started after ``options()`` (which sets
``QEVICT_VLLM=1``). Without it vLLM runs exactly as if the package were absent; ``VLLM_PLUGINS=""`` turns every
plugin off.
"""

from __future__ import annotations

import os

from .settings import OPT_IN, kv_transfer_config, options

__all__ = ["kv_transfer_config", "options", "register", "report"]


def report(llm=None) -> dict:
    """What QEvict holds and what vLLM got back: per request still registered (and the few last finished), its
    cache's bytes (``memory_report``) and moves; ``blocks_freed``, the KV blocks handed back to vLLM's pool, and
    ``blocks_kept``, those kept allocated for its QEvict store (its budget in blocks, counted by vLLM's admission).
    ``llm``: the ``LLM`` whose worker to ask, in vLLM's default multiprocess mode too; None: this process's own
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    if llm is not None:
        reports = llm.collective_rpc("qevict_report")  # worker.QEvictWorkerExtension, which options() adds
        return reports[0] if len(reports) == 1 else {"workers": reports}
    return report_here()


def report_here() -> dict:
    """``report`` of this process's registry (the engine's process, where the worker asks it)."""
    from . import connector

    registry = connector.ACTIVE.get("worker")
    running = registry.report() if registry is not None else {}
    return {"requests": running, "blocks_freed": dict(connector.FREED), "blocks_kept": dict(connector.KEPT)}


def register() -> None:
    if os.environ.get(OPT_IN) != "1":
        return  # not asked for: vLLM keeps its own attention, and nothing of QEvict is imported
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "qevict_vllm.backend.QEvictCPUAttentionBackend")
