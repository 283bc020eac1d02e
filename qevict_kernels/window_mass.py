"""Routing scores without materialising attention rows.

Right after a step attends, its queries' log-sum-exp over everything they could see gives the probability of key
j as exp(q·k_j·scale - lse): one pass over the keys gives every key's mass, summed over the group's query heads and
the step's queries, with a causal mask on absolute positions. Quantized keys are dequantized and re-rotated in
registers, as in attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .packed import PackedWindows, window_positions
from .ledger_tiles import load_keys
from .quant_attention import dequantized_keys_reference


@triton.jit
def _mass_kernel(q_ptr, q_pos_ptr, lse_ptr, keys_ptr, key_pos_ptr, k_codes_ptr, k_scale_ptr, k_zero_ptr, ids_ptr,
                 inv_freq_ptr, out_ptr, rope_scale, sm_scale, n_tokens, n_windows, HKV: tl.constexpr,
                 G: tl.constexpr, NQ: tl.constexpr, QUANT: tl.constexpr, SINKS: tl.constexpr, OMEGA: tl.constexpr,
                 BITS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // HKV
    tok = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tmask = tok < n_tokens
    dims = tl.arange(0, D)
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < G * NQ
    q = tl.load(q_ptr + (bh * G * NQ + rows)[:, None] * D + dims[None, :], mask=rmask[:, None], other=0.0)
    lse = tl.load(lse_ptr + bh * G * NQ + rows, mask=rmask, other=float("inf"))
    q_pos = tl.load(q_pos_ptr + rows % NQ, mask=rmask, other=-1)
    if QUANT:
        per_byte: tl.constexpr = 8 // BITS
        keys, pos = load_keys(k_codes_ptr + bh * n_tokens * (D // per_byte), k_scale_ptr + bh * n_windows * D,
                              k_zero_ptr + bh * n_windows * D, ids_ptr + b * n_windows, inv_freq_ptr, rope_scale,
                              tok, tmask, SINKS, OMEGA, BITS, D)
    else:
        keys = tl.load(keys_ptr + (bh * n_tokens + tok)[:, None] * D + dims[None, :], mask=tmask[:, None],
                       other=0.0).to(tl.float32)
        pos = tl.load(key_pos_ptr + b * n_tokens + tok, mask=tmask, other=0)
    s = tl.dot(q.to(tl.float32), tl.trans(keys)) * sm_scale
    visible = (pos[None, :] <= q_pos[:, None]) & rmask[:, None] & tmask[None, :]
    p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
    tl.store(out_ptr + bh * n_tokens + tok, tl.sum(p, axis=0), mask=tmask)


def _launch(query, query_pos, lse, n_tokens, quant, keys=None, key_pos=None, ledger=None, sinks=0, inv_freq=None,
            rope_scale=1.0, sm_scale=1.0, block_n=64):
    b, hq, nq, d = query.shape
    hkv = (ledger.k_codes if quant else keys).shape[1]
    out = torch.zeros(b, hkv, n_tokens, device=query.device, dtype=torch.float32)
    if n_tokens == 0 or nq == 0:
        return out
    dummy = torch.zeros(1, device=query.device)
    ids = ledger.ids.to(torch.int32).contiguous() if quant else dummy.int()
    _mass_kernel[(b * hkv, triton.cdiv(n_tokens, block_n))](
        query.contiguous(), query_pos.to(torch.int32).contiguous(), lse.float().contiguous(),
        keys.contiguous() if not quant else dummy, key_pos.to(torch.int32).contiguous() if not quant else dummy.int(),
        ledger.k_codes.contiguous() if quant else dummy, ledger.k_scale.contiguous() if quant else dummy,
        ledger.k_zero.contiguous() if quant else dummy, ids,
        inv_freq.float().contiguous() if quant else dummy, out, float(rope_scale), float(sm_scale), n_tokens,
        ledger.num_windows if quant else 0, HKV=hkv, G=hq // hkv, NQ=nq, QUANT=quant, SINKS=sinks,
        OMEGA=ledger.omega if quant else 1, BITS=ledger.bits if quant else 2, D=d,
        BLOCK_M=max(16, triton.next_power_of_2(hq // hkv * nq)), BLOCK_N=block_n)
    return out


def quant_mass(query, query_pos, lse, ledger: PackedWindows, sinks, inv_freq, rope_scale, sm_scale) -> torch.Tensor:
    """Per-key mass (B, Hkv, T) over the ledger's tokens, summed over each group's heads and the queries."""
    return _launch(query, query_pos, lse, ledger.k_codes.shape[2], True, ledger=ledger, sinks=sinks,
                   inv_freq=inv_freq, rope_scale=rope_scale, sm_scale=sm_scale)


def fp_mass(query, query_pos, lse, keys, key_pos, sm_scale) -> torch.Tensor:
    """Per-key mass (B, Hkv, N) over full-precision keys (B, Hkv, N, D) at positions (B, N)."""
    return _launch(query, query_pos, lse, keys.shape[2], False, keys=keys, key_pos=key_pos, sm_scale=sm_scale)


def mass_reference(query, query_pos, lse, keys, key_pos, sm_scale, dtype=torch.float32) -> torch.Tensor:
    """The same mass in PyTorch, the scores computed in ``dtype`` (the tests' low-precision yardstick)."""
    b, hq, nq, d = query.shape
    hkv = keys.shape[1]
    q = query.to(dtype).reshape(b, hkv, hq // hkv, nq, d)  # (B, Hkv, G, Nq, D): a group's heads together
    scores = torch.einsum("bhgqd,bhnd->bhgqn", q, keys.to(dtype)).float() * sm_scale
    probs = torch.exp(scores - lse.float().reshape(b, hkv, hq // hkv, nq, 1))
    visible = key_pos[:, None, None, None, :] <= query_pos[None, None, None, :, None]
    return torch.where(visible, probs, torch.zeros_like(probs)).sum(dim=(2, 3))


def quant_mass_reference(query, query_pos, lse, ledger, sinks, inv_freq, rope_scale, sm_scale, dtype=torch.float32):
    keys, _ = dequantized_keys_reference(ledger, sinks, inv_freq, rope_scale, dtype)
    return mass_reference(query, query_pos, lse, keys, window_positions(ledger.ids, sinks, ledger.omega), sm_scale,
                          dtype)
