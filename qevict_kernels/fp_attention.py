"""The full-precision part of a decode step over a layer's whole buffer, in one launch: split-K attention with each
split's log-sum-exp (what ``lowbit_attention.merge`` joins with the low-bit splits) and the masked logits (what
``score_fold`` turns into each key's mass once the merged log-sum-exp is known).

The buffer keeps its live tokens first and a reserved tail no token has reached yet; its fill is a device count,
so the launch has the same shape at every fill (CUDA-graph capturable) and the tail is hidden by slot index. Every
live key is older than the step's query (a decode step), so no other mask applies. In PyTorch the same is a dozen
operators per layer and step (the conversions to float32, two products, the mask, the log-sum-exp, the exponential);
``fp_attention_masked`` (merge.py) is its reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .lowbit_attention import _store_split, default_splits


@triton.jit
def _fp_kernel(q_ptr, k_ptr, v_ptr, count_ptr, out_ptr, lse_ptr, logits_ptr, n, keys_per_split, scale,
               SPLITS: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr, EXACT: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_R)
    rmask = rows < R
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + (bh * R + rows)[:, None] * D + dims[None, :], mask=rmask[:, None], other=0.0)
    count = tl.load(count_ptr)  # the buffer's live slots (one fill for every row and head)
    start = split * keys_per_split
    stop = tl.minimum(start + keys_per_split, n)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for first in range(start, stop, BLOCK_N):
        tok = first + tl.arange(0, BLOCK_N)
        inside = tok < stop
        keys = tl.load(k_ptr + (bh * n + tok)[:, None] * D + dims[None, :], mask=inside[:, None], other=0.0)
        if EXACT:  # float32 products: the interpreter (its bfloat16 ones are wrong), or a float32 cache (not TF32)
            s = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
        else:  # compiled: the cache's 16-bit operands on the tensor cores, float32 sums
            s = tl.dot(q.to(keys.dtype), tl.trans(keys))
        s = tl.where((inside & (tok < count))[None, :], s * scale, float("-inf"))  # natural log; the tail hidden
        tl.store(logits_ptr + (bh * R + rows)[:, None] * n + tok[None, :], s, mask=rmask[:, None] & inside[None, :])
        s = s * 1.4426950408889634  # online softmax in base 2
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        values = tl.load(v_ptr + (bh * n + tok)[:, None] * D + dims[None, :], mask=inside[:, None], other=0.0)
        if EXACT:
            acc = acc * alpha[:, None] + tl.dot(p, values.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    _store_split(out_ptr, lse_ptr, (bh * SPLITS + split) * R + rows, rmask, dims, acc, l, m, D)


def block_keys(head_dim: int) -> int:
    """Keys per tile: 32 at head_dim 128, 64 below (as the low-bit kernel's tiles; bench/kernel_resources.py)."""
    return 32 if head_dim >= 128 else 64


def buffer_attention(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, count: torch.Tensor,
                     scale: float, splits: int | None = None, exact: bool | None = None):
    """rows (B, Hkv, R, D): the R = G·L query rows of each KV group; keys, values (B, Hkv, n, D) a whole buffer
    whose first ``count`` (a (1,) device tensor) slots are live. -> (parts_out (B, Hkv, S, R, D), parts_lse
    (B, Hkv, S, R), logits (B, Hkv, R, n): -inf at the hidden slots), float32: S splits of the keys, each normalised
    over its own. ``exact``: products in float32 (default: where the interpreter runs, or the cache is in float32)
    rather than in the cache's 16-bit dtype (compiled)."""
    b, hkv, r, d = rows.shape
    n = keys.shape[2]
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton path (got {d})")
    splits = splits or default_splits(n, b, hkv, block_keys(d), rows.device)  # as the low-bit splits, in keys
    exact = rows.device.type != "cuda" or keys.dtype == torch.float32 if exact is None else exact
    per_split = max(1, math.ceil(n / splits))
    parts_out = torch.empty(b, hkv, splits, r, d, device=rows.device, dtype=torch.float32)
    parts_lse = torch.empty(b, hkv, splits, r, device=rows.device, dtype=torch.float32)
    logits = torch.empty(b, hkv, r, n, device=rows.device, dtype=torch.float32)  # every slot written by the kernel
    _fp_kernel[(b * hkv, splits)](rows.contiguous(), keys.contiguous(), values.contiguous(), count, parts_out,
                                  parts_lse, logits, n, per_split, float(scale), SPLITS=splits, R=r,
                                  BLOCK_R=max(16, triton.next_power_of_2(r)), D=d, BLOCK_N=block_keys(d),
                                  EXACT=exact)
    return parts_out, parts_lse, logits
