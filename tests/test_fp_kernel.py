"""The full-precision part of a whole-buffer decode step in one launch (``qevict_kernels.fp_attention``) against its
PyTorch reference (``fp_attention_masked``), at odd sizes, over several splits, with the buffer's unwritten tail
holding stale values no query may see; and merged with the low-bit splits, the mass conserved."""

from __future__ import annotations

import pytest
import torch

from qevict_kernels.fp_attention import buffer_attention
from qevict_kernels.lowbit_attention import lowbit_attention, merge
from qevict_kernels.merge import fp_attention_masked
from tests.test_kernels import DEVICE, SINKS, inv_freq, randn, rows_of, setup, within_low_precision_error


def buffer(b, hkv, n, live, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    keys, values = randn(b, hkv, n, d, generator=gen), randn(b, hkv, n, d, generator=gen)
    keys[:, :, live:], values[:, :, live:] = 1e4, -1e4  # stale slots: any leak shows
    return keys.to(dtype), values.to(dtype)


def merged(parts_out, parts_lse):
    lse = torch.logsumexp(parts_lse, dim=2)
    return (parts_out * torch.exp(parts_lse - lse.unsqueeze(2)).nan_to_num(0.0).unsqueeze(-1)).sum(2), lse


# (batch, kv heads, GQA group, buffer slots, live, head_dim, cache dtype, splits): T = 97 and 1025, a buffer filled
# to its last slot and one mostly empty, a 16-bit cache beside float32 queries (a model computing in float32)
CASES = [(1, 2, 3, 97, 77, 64, torch.float32, 1), (2, 3, 4, 1025, 1000, 128, torch.bfloat16, 3),
         (1, 1, 1, 97, 97, 64, torch.float16, 4), (2, 2, 3, 300, 5, 64, torch.bfloat16, 5)]


def low_precision(query, keys, values, scale, hidden):
    """The same attention with the query and the probabilities rounded to the cache's dtype, as a GPU's 16-bit
    products take them (the interpreter computes in float32)."""
    rows = query.to(keys.dtype).float()
    scores = (rows @ keys.float().transpose(2, 3) * scale).masked_fill(hidden, float("-inf"))
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).to(keys.dtype).float()
    return probs @ values.float(), lse, scores


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[3]}-live{c[4]}-d{c[5]}-{str(c[6]).split('.')[-1]}-s{c[7]}")
def test_the_buffer_kernel_matches_plain_math_over_the_live_slots(case):
    b, hkv, g, n, live, d, dtype, splits = case
    keys, values = buffer(b, hkv, n, live, d, dtype, seed=n)
    query = randn(b, hkv * g, 1, d, generator=torch.Generator().manual_seed(live))
    count = torch.tensor([live], device=DEVICE)
    parts_out, parts_lse, logits = buffer_attention(rows_of(query, hkv), keys, values, count, d ** -0.5, splits)
    assert parts_out.shape[2] == splits
    out, lse = merged(parts_out, parts_lse)
    hidden = (torch.arange(n, device=DEVICE) >= live)[None, None]  # (1, 1, n)
    ref_out, ref_lse, ref_logits = fp_attention_masked(query, keys, values, d ** -0.5, hidden)
    low = low_precision(rows_of(query, hkv), keys, values, d ** -0.5, hidden[:, None])
    within_low_precision_error(out, ref_out.reshape(out.shape), low[0])
    within_low_precision_error(lse, ref_lse.reshape(lse.shape), low[1])
    assert torch.isinf(logits[..., live:]).all() and logits[..., :live].isfinite().all()
    within_low_precision_error(logits[..., :live], ref_logits[..., :live], low[2][..., :live])


def test_the_compiled_branch_with_16_bit_products():
    """The branch a GPU compiles (the cache's 16-bit operands), run where the interpreter's products are right
    (float16): within twice the error of the same math with 16-bit operands."""
    keys, values = buffer(2, 2, 300, 250, 64, torch.float16, seed=5)
    query = randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(6))
    count = torch.tensor([250], device=DEVICE)
    parts_out, parts_lse, logits = buffer_attention(rows_of(query, 2), keys, values, count, 0.125, 3, exact=False)
    out, lse = merged(parts_out, parts_lse)
    hidden = (torch.arange(300, device=DEVICE) >= 250)[None, None]
    ref_out, ref_lse, _ = fp_attention_masked(query, keys, values, 0.125, hidden)
    low = low_precision(rows_of(query, 2), keys, values, 0.125, hidden[:, None])
    assert (low[0] - ref_out.reshape(out.shape)).abs().max() > 0  # the 16-bit operands do round
    within_low_precision_error(out, ref_out.reshape(out.shape), low[0])
    within_low_precision_error(lse, ref_lse.reshape(lse.shape), low[1])
    assert torch.isinf(logits[..., 250:]).all()


def test_a_split_past_the_live_slots_contributes_nothing():
    keys, values = buffer(1, 2, 97, 10, 64, torch.float32, seed=1)
    query = randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(2))
    parts_out, parts_lse, _ = buffer_attention(rows_of(query, 2), keys, values, torch.tensor([10], device=DEVICE),
                                               0.125, splits=4)
    assert torch.isinf(parts_lse[:, :, 1:]).all() and not parts_out[:, :, 1:].any()
    assert parts_lse[:, :, 0].isfinite().all()


def test_merged_with_the_low_bit_splits_every_rows_attention_sums_to_one():
    ledger, live, rows, count = setup((2, 2, 3, 1, 9, 12, 8, 64, 4, torch.float32), seed=11)
    b, hkv, r, d = rows.shape
    keys, values = buffer(b, hkv, 130, 70, d, torch.bfloat16, seed=12)
    parts = lowbit_attention(rows, ledger, count, SINKS, inv_freq(d), 1.0, d ** -0.5, splits=2)
    fp_out, fp_lse, logits = buffer_attention(rows, keys, values, torch.tensor([70], device=DEVICE), d ** -0.5, 3)
    out, lse, mass = merge(parts[0], parts[1], fp_out, fp_lse, parts[2], ledger.ids, count)
    fp_mass = torch.exp(logits - lse.unsqueeze(-1)).sum(dim=(2, 3))  # (B, Hkv)
    torch.testing.assert_close(mass.sum(-1) + fp_mass, torch.full((b, hkv), float(r), device=DEVICE), rtol=1e-4,
                               atol=1e-4)
    assert out.isfinite().all() and (fp_mass > 0).all() and (mass[:, :, :9] > 0).all()
