"""How a vLLM user switches QEvict on, and everything the plugin refuses before vLLM starts.

    LLM(model=path, **qevict_vllm.options(budget=0.2, model=path))   # kv_transfer_config, block_size, no prefix cache

``options`` checks the settings, the platform and, given the model, its attention, and raises one ValueError
naming what is allowed: nothing has loaded yet. The connector checks the same again when vLLM builds it (a user who
wrote the ``kv_transfer_config`` by hand), in its worker before the weights load.
"""

from __future__ import annotations

import dataclasses
import os

from qevict_core import QEvictConfig

CONNECTOR = "QEvictConnector"
MODULE = "qevict_vllm.connector"
WORKER_EXTENSION = "qevict_vllm.worker.QEvictWorkerExtension"  # report(llm) asks it
OPT_IN = "QEVICT_VLLM"  # set by options(): the plugin's attention is registered only in processes that asked
CPU_BLOCK = 32  # vLLM's CPU attention takes KV blocks of a multiple of 32 tokens
BLOCK_SIZE = 32  # a window is one KV block; vLLM's CPU default (128 tokens) would make windows 16x QEvict's Ω = 8
# QEvictConfig fields the plugin never reads: per-head routing is not built here, the kernel path and the events
# are the plugin's own business
IGNORED_GROUPS = ("head", "run")


def options(block_size: int = BLOCK_SIZE, model: str | None = None, **settings) -> dict:
    """The ``LLM(...)`` keyword arguments that run every request with QEvict: the connector, KV blocks of
    ``block_size`` tokens (a multiple of 32 on the CPU; a window is one block), prefix caching off, the worker
    extension ``report(llm)`` asks. ``settings`` are
    QEvictConfig fields (``budget``, ``bits``, ``coverage``, ...); ``model`` (the path or id given to ``LLM``) has its
    attention checked too. Everything refused here is refused before vLLM loads anything."""
    check_platform()
    if not isinstance(block_size, int) or block_size < CPU_BLOCK or block_size % CPU_BLOCK:
        raise ValueError(f"block_size must be a multiple of {CPU_BLOCK} tokens, what vLLM's CPU attention takes "
                         f"(got {block_size!r}); a window of QEvict is one block")
    if model is not None:
        from transformers import AutoConfig

        check_model(AutoConfig.from_pretrained(model))
    os.environ[OPT_IN] = "1"  # inherited by the engine's processes, started after this
    return {"kv_transfer_config": kv_transfer_config(block_size=block_size, **settings), "block_size": block_size,
            "enable_prefix_caching": False, "worker_extension_cls": WORKER_EXTENSION}


def kv_transfer_config(block_size: int = BLOCK_SIZE, **settings) -> dict:
    """The ``kv_transfer_config`` that runs every request of an ``LLM`` with QEvict; ``settings`` are
    ``QEvictConfig`` fields (``budget``, ``bits``, ``coverage``, ...). Checked here, before vLLM starts."""
    config_from(settings, block_size=block_size)
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE, "kv_role": "kv_both",
            "kv_connector_extra_config": dict(settings)}


def config_from(settings: dict, block_size: int | None) -> QEvictConfig:
    """``settings`` as a QEvictConfig whose windows are one KV block (Ω = ``block_size``, the default) and whose
    keys and values are stored in vLLM's KV dtype (``kv_dtype="model"`` unless given); an unknown field, a field
    only unsupported modes read or a bad value raises ValueError naming what is allowed."""
    fields = {f.name for f in dataclasses.fields(QEvictConfig)}
    unread = {name for group in IGNORED_GROUPS for name in QEvictConfig.knobs(group)} | {"budget_bytes"}
    allowed = fields - unread
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise ValueError(f"unknown QEvict settings {unknown}; allowed: {sorted(allowed)}")
    ignored = sorted(set(settings) & unread)
    if ignored:
        raise ValueError(f"QEvict in vLLM does not read {ignored} (per-head routing, kernel paths and event "
                         f"records are not part of it; budget_bytes: a request's budget is a share of its own "
                         f"tokens); allowed: {sorted(allowed)}")
    omega = settings.get("omega", block_size)
    if block_size is not None and omega != block_size:
        raise ValueError(f"omega must equal vLLM's KV block size ({block_size}): a window is one block (got "
                         f"omega={omega!r}). Leave omega out, or give options(block_size=...) a multiple of "
                         f"{CPU_BLOCK} and omega the same")
    # Keys and values in vLLM's own KV dtype (the model's, with cache_dtype "auto": bfloat16 as a GPU serves it), so
    # a request's budget is a share of the bytes vLLM itself would hold for it; kv_dtype= overrides.
    values = {"kv_dtype": "model", **settings}
    if omega is not None:
        values["omega"] = omega
    return QEvictConfig(**values)


def check_platform() -> None:
    try:
        from vllm.platforms import current_platform
    except ImportError:  # settings built where vLLM is not installed (to pass on): nothing to run them on here
        return

    if not current_platform.is_cpu():
        raise ValueError(f"QEvict in vLLM replaces vLLM's CPU attention only; this vLLM runs on "
                         f"{current_platform.device_type!r}, whose attention would still read the KV blocks QEvict "
                         "hands back. Run QEvict on a GPU through transformers (qevict_core) instead")


def check_model(hf_config) -> None:
    """Refuse a model whose attention QEvict would not compute exactly: only full causal attention with RoPE in
    every layer, no window, cap, bias or sink on the scores."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    problems = []
    if getattr(cfg, "is_encoder_decoder", False):
        problems.append("encoder-decoder attention")
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) is not False:
        problems.append(f"a sliding window of {window} tokens")
    kinds = set(getattr(cfg, "layer_types", None) or [])
    if kinds - {"full_attention"}:
        problems.append(f"layer types {sorted(kinds)}")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None):
            problems.append(f"{name} = {getattr(cfg, name)}")
    if getattr(cfg, "alibi", False) or getattr(cfg, "position_embedding_type", "rope") == "alibi":
        problems.append("ALiBi position biases")
    if getattr(cfg, "attention_sinks", None) or getattr(cfg, "use_attention_sinks", False):
        problems.append("learned attention sinks")
    if not (getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_theta", None)):
        problems.append("no rotary position embedding")
    if problems:
        raise ValueError(f"QEvict in vLLM computes full causal attention with RoPE in every layer; this model has "
                         f"{', '.join(problems)}, which it would not compute exactly. Supported: Llama, Qwen2, "
                         "Mistral without a sliding window, and models like them")


def check_engine(vllm_config) -> None:
    """What QEvict in vLLM does not support, refused when the connector is built (before the weights load)."""
    check_platform()
    check_model(vllm_config.model_config.hf_config)
    if vllm_config.cache_config.enable_prefix_caching:
        raise ValueError("QEvict compresses each request's own KV, which prefix caching would share between "
                         "requests: start vLLM with enable_prefix_caching=False (qevict_vllm.options does)")
    if vllm_config.parallel_config.world_size > 1:
        raise ValueError("QEvict in vLLM runs on one worker (tensor_parallel_size=1, pipeline_parallel_size=1)")
    if vllm_config.speculative_config is not None:
        raise ValueError("QEvict in vLLM does not support speculative decoding")
