"""Exact merging of attention over disjoint key segments, and the full-precision segment with its log-sum-exp.

softmax over the union of segments = Σ_s exp(lse_s - lse) · out_s with lse = logsumexp_s(lse_s): nothing needs
concatenating or reordering.
"""

from __future__ import annotations

import torch


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(out (B, H, L, D), lse (B, H, L))] -> merged (out, lse); segments with lse = -inf contribute nothing."""
    lses = torch.stack([lse.float() for _, lse in parts])  # (S, B, H, L)
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total).nan_to_num(0.0)
    out = sum(w.unsqueeze(-1) * o.float() for w, (o, _) in zip(weights, parts))
    return out, total


def fp_attention_with_lse(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                          causal_tail: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """query (B, Hq, L, D) over full-precision keys (B, Hkv, N, D) -> (out, lse) in float32.

    ``causal_tail``: the last L keys are the queries' own tokens (bottom-right causal); every earlier key is
    visible to all queries. Earlier keys go through PyTorch's fused attention with GQA rows packed per KV head
    (one query row per head and position), the L x L tail through plain math.
    """
    b, hq, lq, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    old = n - lq if causal_tail else n
    packed = query.reshape(b, hkv, hq // hkv * lq, d)  # all old keys are visible to every row: no mask
    parts = []
    if old > 0:
        out, lse = _fused(packed, keys[:, :, :old], values[:, :, :old], scale)
        parts.append((out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)))
    if causal_tail and lq > 0:
        tail_k, tail_v = keys[:, :, old:].float(), values[:, :, old:].float()
        scores = packed.float() @ tail_k.transpose(2, 3) * scale  # (B, Hkv, G*L, L)
        row_pos = torch.arange(packed.shape[2], device=keys.device) % lq
        visible = torch.arange(lq, device=keys.device)[None, :] <= row_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        parts.append(((scores.softmax(-1) @ tail_v).reshape(b, hq, lq, d), scores.logsumexp(-1).reshape(b, hq, lq)))
    return merge_attention(parts) if len(parts) > 1 else (parts[0][0].float(), parts[0][1].float())


def fp_attention_masked(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query (B, Hq, L, D) over full-precision keys (B, Hkv, N, D) in any order, ``hidden`` (B or 1, L, N) saying
    which keys each query position does not see -> (out (B, Hq, L, D), lse (B, Hq, L), scores (B, Hkv, G*L, N), the
    masked logits, row r at position r % L) in float32. Plain math: the reference of ``fp_attention.buffer_attention``
    (a whole buffer, its unwritten tail visible to no query); a query that sees no key gets lse = -inf and a zero
    output."""
    b, hq, lq, d = query.shape
    hkv = keys.shape[1]
    rows = query.reshape(b, hkv, hq // hkv * lq, d).float()  # (B, Hkv, G*L, D): row r is position r % L
    scores = rows @ keys.float().transpose(2, 3) * scale  # (B, Hkv, G*L, N)
    # one query position (a decode step): its mask broadcasts over the rows, no index to build
    rows_hidden = hidden[:, None] if lq == 1 else hidden[:, None, torch.arange(rows.shape[2], device=keys.device) % lq]
    scores = scores.masked_fill_(rows_hidden, float("-inf"))  # (B or 1, 1, G*L, N) broadcast over the KV heads
    lse = scores.logsumexp(-1)
    out = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0) @ values.float()
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq), scores


def _fused(query, keys, values, scale):
    """PyTorch's fused attention with its log-sum-exp: FlashAttention-2 (SDPA's flash backend) on a GPU for half
    precision, else the memory-efficient kernel, the CPU's flash kernel on a CPU; plain math where none runs."""
    try:
        if query.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys, values, 0.0, False,
                                                                                 scale=scale)[:2]
            return out, lse
        if query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(query, keys, values, 0.0, False, False,
                                                                          scale=scale)[:2]
            return out, lse
    except RuntimeError:
        pass
    try:
        if query.device.type == "cuda":
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, keys, values, None, True, 0.0, False, scale=scale)[:2]
            return out, lse[..., :query.shape[2]]
    except RuntimeError:
        pass
    scores = query.float() @ keys.float().transpose(2, 3) * scale
    return scores.softmax(-1) @ values.float(), scores.logsumexp(-1)
