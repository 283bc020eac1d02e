"""The attention function registered with transformers when a cache is made, wrapping the model's own.

transformers calls it once per layer per forward with the keys and values that ``cache.update`` returned. The
cache attaches its layer to the module while in use (``module.qevict_layer``); the layer claims the call only if
the keys are the very tensor it returned. Any other call (the same model later run with a ``DynamicCache``, or
without a cache) goes to the implementation the model had before (SDPA, FlashAttention, eager, ...), with the
mask that implementation builds: the wrapper is registered per base implementation (``qevict`` over SDPA,
``qevict_<base>`` over another) with the base's own mask function, so making a cache changes nothing for the
model's other uses.

Inside a claimed call, causality is applied by position. A padded batch reaches the function with its mask: a
``RowCache`` (``make_cache(..., padded=True)``, padded.py) reads each row's padding from it, and every other cache
refuses a padded batch instead of attending to padding.
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

ATTN_NAME = "qevict"


def wrapper_name(base: str) -> str:
    return ATTN_NAME if base == "sdpa" else f"{ATTN_NAME}_{base}"


def base_of(name: str) -> str:
    """The implementation a wrapper name wraps (``name`` itself when it is no wrapper)."""
    if name == ATTN_NAME:
        return "sdpa"
    return name.removeprefix(f"{ATTN_NAME}_") if name.startswith(f"{ATTN_NAME}_") else name


def base_attention(base: str):
    """The attention function of implementation ``base``: transformers' registry, or for eager the model's own
    ``eager_attention_forward`` (each modeling file defines one)."""
    if base == "eager":
        return lambda module, *args, **kwargs: sys.modules[type(module).__module__].eager_attention_forward(
            module, *args, **kwargs)
    return AttentionInterface._global_mapping[base]


def make_wrapper(base: str):
    fallback = base_attention(base)

    def qevict_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = getattr(module, "qevict_layer", None)
        if layer is None or not layer.claim(key):
            return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        scaling = module.scaling if scaling is None else scaling
        visible = last_row_visibility(attention_mask, key.shape[2])
        if layer.accepts_padding:
            return layer.attend_rows(module, query, key, value, visible, scaling, dropout), None
        if visible is not None:
            refuse_padding(visible)
        return layer.attend(module, query, key, value, scaling, dropout), None

    return qevict_attention


def last_row_visibility(attention_mask: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """(B, kv) bool: which keys the newest query of each row may see, from any implementation's mask (SDPA's bool
    (B, 1, q, kv), eager's additive floats, FlashAttention's (B, kv) padding mask); None when there is none."""
    if attention_mask is None:
        return None
    last = attention_mask if attention_mask.dim() == 2 else attention_mask[:, 0, -1, :]
    last = last[:, -kv_len:]
    if last.dtype == torch.bool:
        return last
    return last > 0 if attention_mask.dim() == 2 else last == 0


def refuse_padding(visible: torch.Tensor) -> None:
    """The newest query of every row may see every earlier token; a key hidden from it is padding."""
    hidden = ~visible
    if hidden.any():
        rows = hidden.any(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"rows {rows} of this batch have padding, which this cache would route and attend as "
                         "context: make it with make_cache(..., padded=True) (one cache per row, each seeing only "
                         "its row's tokens), or generate prompts of equal length together.")


def sdpa_with_positions(module, query, key, value, scaling: float, dropout: float = 0.0,
                        positions: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """SDPA where the last ``q`` keys are the queries' own tokens and every earlier key is older.

    Keys may be in any order before that (attention is order-free once RoPE is applied), so the mask is
    bottom-right causal. Single queries and whole-prompt prefill take SDPA's unmasked and ``is_causal`` paths,
    exactly as transformers' own SDPA attention does (on CUDA, its flash backend: FlashAttention-2).
    ``positions``: (key positions (B, N), query positions (q,)) where the keys are in no such order (a layer's
    whole buffer, its reserved tail after the queries): a key is visible where it is not later than the query.
    """
    if key.dtype != query.dtype:  # a 16-bit cache beside a model computing in float32: widened for this call
        key, value = key.to(query.dtype), value.to(query.dtype)
    q_len, k_len = query.shape[2], key.shape[2]
    mask = None
    if positions is not None:
        key_pos, query_pos = positions
        mask = key_pos[:, None, None, :] <= query_pos[None, None, :, None]  # (B, 1, q, N)
    elif 1 < q_len < k_len:
        offset = k_len - q_len
        mask = (torch.arange(k_len, device=key.device)[None, :]
                <= torch.arange(q_len, device=key.device)[:, None] + offset)[None, None]  # (1, 1, q, k)
    out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling)
    return out


def use_qevict_attention(model) -> None:
    """Register the wrapper of the model's current implementation (idempotent) and select it on ``model``. Done
    when a cache is made, never at import; the model's other uses still run its own implementation."""
    current = model.config._attn_implementation or "sdpa"
    if base_of(current) != current:  # already wrapped
        return
    name = wrapper_name(current)
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, make_wrapper(current))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[current])
    model.set_attn_implementation(name)
