"""The attention function registered with transformers as ``"qevict"``.

transformers calls it once per layer per forward with the keys and values that ``cache.update`` returned. The
cache attaches its layer to the module while in use (``module.qevict_layer``); the layer claims the call only if
the keys are the very tensor it returned, so a model later used with another cache falls back to plain SDPA.
Causality is applied here, by position. SDPA's mask function is registered under the same name so that a padded
batch reaches this function with its mask (transformers drops the mask of an attention implementation without
one): a ``RowCache`` (``make_cache(..., padded=True)``, padded.py) reads each row's padding from it, and every other
cache refuses a padded batch instead of attending to padding.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTN_NAME = "qevict"


def qevict_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    layer = getattr(module, "qevict_layer", None)
    if layer is None or not layer.claim(key):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scaling = module.scaling if scaling is None else scaling
    if layer.accepts_padding:
        return layer.attend_rows(module, query, key, value, attention_mask, scaling, dropout), None
    if attention_mask is not None:
        refuse_padding(attention_mask)
    return layer.attend(module, query, key, value, scaling, dropout), None


def refuse_padding(attention_mask: torch.Tensor) -> None:
    """The newest query of every row may see every earlier token; a column hidden from it is padding."""
    last_row = attention_mask[:, :, -1, :]  # (B, 1, kv): bool from SDPA's mask function, additive floats otherwise
    hidden = ~last_row if last_row.dtype == torch.bool else last_row < 0
    if hidden.any():
        rows = hidden.flatten(1).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"rows {rows} of this batch have padding, which this cache would route and attend as "
                         "context: make it with make_cache(..., padded=True) (one cache per row, each seeing only "
                         "its row's tokens), or generate prompts of equal length together.")


def sdpa_with_positions(module, query, key, value, scaling: float, dropout: float = 0.0) -> torch.Tensor:
    """SDPA where the last ``q`` keys are the queries' own tokens and every earlier key is older.

    Keys may be in any order before that (attention is order-free once RoPE is applied), so the mask is
    bottom-right causal. Single queries and whole-prompt prefill take SDPA's unmasked and ``is_causal`` paths,
    exactly as transformers' own SDPA attention does.
    """
    q_len, k_len = query.shape[2], key.shape[2]
    mask = None
    if 1 < q_len < k_len:
        offset = k_len - q_len
        mask = (torch.arange(k_len, device=key.device)[None, :]
                <= torch.arange(q_len, device=key.device)[:, None] + offset)[None, None]  # (1, 1, q, k)
    out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling)
    return out


def use_qevict_attention(model) -> None:
    """Register the function (idempotent) and select it on ``model``. Done when a cache is made, never at import."""
    if ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_NAME, qevict_attention)
    if ATTN_NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
