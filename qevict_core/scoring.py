"""Attention mass per key from buffered queries, without eager attention and without a T x T matrix.

At a routing event the queries seen since the previous event are replayed against the keys accessible now, with a
causal mask on absolute positions. Between two routing events the tiers do not change, so this is exactly the
sum of the probabilities those queries produced (Eq. 1); it costs one attention pass over the buffer, amortised
over Ω decode steps. Queries are processed in chunks so that prefill never materialises T x T probabilities.
"""

from __future__ import annotations

import torch

# Bound on one chunk's probability tensor (elements), ~64 MiB in float32, and on queries per chunk: small chunks
# let prefill skip the keys that no query of the chunk can see yet (about half of a causal prompt).
CHUNK_ELEMENTS = 1 << 24
CHUNK_QUERIES = 256


def key_attention_mass(query: torch.Tensor, query_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    """Sum over queries and query heads of softmax attention, divided by the number of query heads.

    query (B, Hq, q, D) post-RoPE; query_pos (q,); keys (B, Hkv, N, D) post-RoPE; key_pos (B, N).
    Query head h reads KV head h // (Hq / Hkv), as transformers' ``repeat_kv`` does. Returns (B, N) float32.
    """
    b, hq, q, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    groups = hq // hkv
    grouped = query.reshape(b, hkv, groups, q, d)  # (B, Hkv, G, q, D)
    keys_t = keys.float().transpose(2, 3)  # (B, Hkv, D, N)
    mass = torch.zeros(b, n, dtype=torch.float32, device=keys.device)
    chunk = max(1, min(CHUNK_QUERIES, CHUNK_ELEMENTS // max(1, b * hq * n)))
    for start in range(0, q, chunk):
        part = grouped[:, :, :, start:start + chunk].float()
        c, q_pos = part.shape[3], query_pos[start:start + chunk]
        # Keys after the last one any query of this chunk can see carry no mass: leave them out.
        seen_by_some = (key_pos <= q_pos.max()).any(dim=0)
        limit = int(seen_by_some.nonzero().max()) + 1 if seen_by_some.any() else 0
        logits = torch.matmul(part.reshape(b, hkv, groups * c, d), keys_t[..., :limit])  # (B, Hkv, G*c, n')
        logits = logits.mul_(scaling).view(b, hkv, groups, c, limit)
        hidden = key_pos[:, None, None, None, :limit] > q_pos[None, None, None, :, None]
        if hidden.any():
            logits.masked_fill_(hidden, float("-inf"))
        mass[:, :limit] += torch.softmax(logits, dim=-1).sum(dim=(1, 2, 3))
    return mass / hq


def window_mass(key_mass: torch.Tensor, key_window: torch.Tensor, num_windows: int) -> torch.Tensor:
    """(B, N) per-key mass and (B, N) window ids (-1 for sinks) -> (B, num_windows) per-window mass."""
    bins = torch.where(key_window >= 0, key_window, num_windows).long()
    out = torch.zeros(key_mass.shape[0], num_windows + 1, dtype=key_mass.dtype, device=key_mass.device)
    out.scatter_add_(1, bins, key_mass)
    return out[:, :num_windows]
