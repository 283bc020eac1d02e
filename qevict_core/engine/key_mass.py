"""Attention mass per key (Eq. 1's inner sum), without eager attention over the prompt and without a T x T matrix.

Decode steps fold their own attention mass into the window score table as they run: :func:`attend_with_mass`
computes the step's attention once, as probabilities, and returns both the output and every key's mass, so nothing
but the (B, W) table persists between routing events (a buffer of the queries since the last event used to be
replayed against the keys at the event; between two events the tiers do not change, so the sum is the same).
The prompt's mass comes from :func:`kv_head_mass`, in chunks, so prefill never materialises T x T probabilities.
"""

from __future__ import annotations

import torch

from .shared_work import shared

# Bound on one chunk's probability tensor (elements), ~64 MiB in float32, and on queries per chunk: small chunks
# let prefill skip the keys that no query of the chunk can see yet (about half of a causal prompt).
CHUNK_ELEMENTS = 1 << 24
CHUNK_QUERIES = 256
# Query blocks up to this long (decode steps) mask densely, without a host round trip; longer ones sparsely
DENSE_MASK_QUERIES = 4


def attention_probs(query: torch.Tensor, query_pos: torch.Tensor | None, keys: torch.Tensor,
                    key_pos: torch.Tensor | None, scaling: float, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention: query (B, Hq, q, D), keys (B, Hkv, N, D) -> (B, Hkv, G, q, N) float32. ``hidden``
    (broadcast to (B, Hkv, G, q, N)): the keys hidden from the queries, where the caller knows them without
    positions (then ``query_pos`` and ``key_pos`` are not read).

    Query head h reads KV head h // G (G = Hq / Hkv), as transformers' ``repeat_kv`` does. For short query
    blocks (an observation window); longer ones go through :func:`kv_head_mass` in chunks.
    The product runs in the query's dtype, the softmax in float32, as transformers' eager attention does: a 16-bit
    model's keys and values are read as they are stored, never widened (a float32 copy of each at every step writes
    and reads back twice their 16-bit bytes); a float32 model widens only a 16-bit cache.
    """
    b, hq, q, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    groups = hq // hkv
    logits = torch.matmul(query.reshape(b, hkv, groups * q, d), keys.to(query.dtype).transpose(2, 3)).float()
    logits = logits.mul_(scaling).view(b, hkv, groups, q, n)
    if hidden is not None:
        return torch.softmax(logits.masked_fill_(hidden, float("-inf")), dim=-1)
    return causal_softmax(logits, query_pos, key_pos)


def causal_softmax(logits: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """Softmax over N of logits (B, Hkv, G, q, N), keys later than a query hidden from it (masked in place)."""
    if logits.shape[3] <= DENSE_MASK_QUERIES:
        # A decode step: the whole (q, N) mask is 1/D of the scores' work and asks the host nothing, so the step
        # never waits for the device (and stays capturable in a CUDA graph)
        hidden = key_pos[:, None, None, None, :] > query_pos[None, None, None, :, None]  # (B, 1, 1, q, N)
        return torch.softmax(logits.masked_fill_(hidden, float("-inf")), dim=-1)
    # Longer query blocks (a routing event's observation window): only keys newer than the oldest query can be
    # hidden from some query; keys come in any order, so find them first and mask just those columns (the whole
    # (q, N) mask cost more than the scores at a routing event).
    later = (key_pos > query_pos.min()).any(dim=0).nonzero().flatten()
    if later.numel():
        hidden = key_pos[:, None, None, None, later] > query_pos[None, None, None, :, None]  # (B, 1, 1, q, k)
        cols = logits.index_select(4, later).masked_fill_(hidden, float("-inf"))
        logits.index_copy_(4, later, cols)
    return torch.softmax(logits, dim=-1)


@shared
def kv_head_mass(query: torch.Tensor, query_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """Attention mass each key receives from every query of its KV group: (B, Hkv, N) float32.

    query (B, Hq, q, D) post-RoPE; query_pos (q,); keys (B, Hkv, N, D) post-RoPE; key_pos (B, N).
    """
    b, hq, q, _ = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    mass = torch.zeros(b, hkv, n, dtype=torch.float32, device=keys.device)
    chunk = max(1, min(CHUNK_QUERIES, CHUNK_ELEMENTS // max(1, b * hq * n)))
    for start in range(0, q, chunk):
        q_pos = query_pos[start:start + chunk]
        # Keys after the last one any query of this chunk can see carry no mass: leave them out.
        seen_by_some = (key_pos <= q_pos.max()).any(dim=0)
        limit = int(seen_by_some.nonzero().max()) + 1 if seen_by_some.any() else 0
        probs = attention_probs(query[:, :, start:start + chunk], q_pos, keys[:, :, :limit], key_pos[:, :limit],
                                scaling)
        mass[:, :, :limit] += probs.sum(dim=(2, 3))
    return mass


def attend_with_mass(query: torch.Tensor, query_pos: torch.Tensor | None, keys: torch.Tensor,
                     key_pos: torch.Tensor | None, values: torch.Tensor, scaling: float,
                     hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention that also returns what each key received: for a few queries (decode steps).

    query (B, Hq, q, D); keys, values (B, Hkv, N, D) in any order with positions key_pos (B, N), or ``hidden``
    instead of positions (as ``attention_probs``).
    -> out (B, q, Hq, D) in the query dtype, as transformers' attention functions return it, and the per-key mass
    (B, Hkv, N) float32 summed over each group's query heads and the queries.
    """
    b, hq, q, d = query.shape
    probs = attention_probs(query, query_pos, keys, key_pos, scaling, hidden)  # (B, Hkv, G, q, N)
    out = torch.matmul(probs.flatten(2, 3).to(query.dtype), values.to(query.dtype))  # (B, Hkv, G*q, D)
    out = out.view(b, hq, q, d).transpose(1, 2).to(query.dtype)  # (B, q, Hq, D): head h reads KV head h // G
    return out, probs.sum(dim=(2, 3))

