"""The Triton kernels against their PyTorch references (on a CPU through TRITON_INTERPRET=1, on CUDA compiled), and
the engine with the kernel path forced against the PyTorch path.

The fused low-bit kernel's error against the float32 reference must stay within twice the error of the same math in
bfloat16 (plus a small floor), as flash-attn's tests hold theirs; the routing mass must be conserved: every row's
attention sums to one over the low-bit and the full-precision keys together."""

from __future__ import annotations

import pytest
import torch

from qevict_core import QEvictConfig, make_cache
from qevict_core.engine.ledger import WindowLedger
from qevict_kernels.lowbit_attention import dequantized_keys_reference, lowbit_attention, lowbit_reference, merge
from qevict_kernels.merge import fp_attention_masked, fp_attention_with_lse, merge_attention
from qevict_kernels.score_fold import fold_step_mass, fold_step_mass_reference
from tests.conftest import KV, random_prompt, tiny_model

SINKS = 5
# On a GPU host the kernels run compiled on CUDA tensors; elsewhere through the interpreter on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inv_freq(d):
    return (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))).to(DEVICE)


def randn(*shape, generator):
    return torch.randn(*shape, generator=generator).to(DEVICE)


def make_ledger(batch, hkv, windows, omega, d, bits, seed=0, dtype=torch.float32, param_dtype=None):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, hkv, windows * omega, d, generator=g) * torch.linspace(0.2, 3, d)
    values = torch.randn(batch, hkv, windows * omega, d, generator=g)
    ids = torch.stack([torch.randperm(4 * windows + 7, generator=g)[:windows] for _ in range(batch)]).int()
    return WindowLedger.quantize(keys.to(DEVICE, dtype), values.to(DEVICE, dtype), ids.to(DEVICE), omega, bits,
                                 param_dtype)


def within_low_precision_error(out, ref32, ref_lp, floor=1e-5):
    assert (out - ref32).abs().max() <= 2 * (ref_lp - ref32).abs().max() + floor

# (batch, kv heads, GQA ratio, query length, live windows, capacity, Ω, head_dim, bits, scale dtype): T = 97 + 1
# windows of 8 = 104 and 1025 + 7 = 1032 tokens, GQA 1/3/4, head_dim 64/128, INT2/INT4, decode and a short chunk,
# a tier filled below its capacity, half-precision and float32 scales.
CASES = [(1, 2, 1, 1, 13, 13, 8, 64, 2, torch.float32), (1, 1, 3, 1, 129, 129, 8, 64, 4, torch.float16),
         (2, 2, 4, 2, 9, 16, 8, 128, 2, torch.bfloat16), (1, 3, 3, 1, 21, 24, 4, 64, 4, torch.float32),
         (1, 2, 4, 1, 5, 7, 16, 128, 4, torch.float16)]


def case_id(c):
    return f"w{c[4]}of{c[5]}-g{c[2]}-q{c[3]}-o{c[6]}-d{c[7]}-int{c[8]}-{str(c[9]).split('.')[-1]}"


def rows_of(query: torch.Tensor, hkv: int) -> torch.Tensor:
    b, hq, lq, d = query.shape
    return query.reshape(b, hkv, hq // hkv * lq, d)  # (B, Hkv, G*L, D): a group's heads, then its queries


def setup(case, seed=0):
    b, hkv, g, lq, live, cap, omega, d, bits, dtype = case
    ledger = make_ledger(b, hkv, cap, omega, d, bits, seed=seed, param_dtype=dtype)
    rows = rows_of(randn(b, hkv * g, lq, d, generator=torch.Generator().manual_seed(seed + 1)), hkv)
    count = torch.full((b,), live, dtype=torch.int32, device=DEVICE)
    live_ledger = ledger.select(torch.arange(live, device=DEVICE).expand(b, -1))
    return ledger, live_ledger, rows, count


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_split_kernel_matches_the_reference_over_the_live_windows(case):
    ledger, live, rows, count = setup(case)
    d = rows.shape[-1]
    args = (SINKS, inv_freq(d), 1.0, d ** -0.5)
    parts_out, parts_lse, win_lse = lowbit_attention(rows, ledger, count, *args, splits=3)
    lse = torch.logsumexp(parts_lse, dim=2)
    out = (parts_out * torch.exp(parts_lse - lse.unsqueeze(2)).nan_to_num(0.0).unsqueeze(-1)).sum(2)
    ref, ref_lse, ref_win = lowbit_reference(rows, live, *args)
    low, low_lse, low_win = lowbit_reference(rows, live, *args, dtype=torch.bfloat16)
    within_low_precision_error(out, ref, low)
    within_low_precision_error(lse, ref_lse, low_lse)
    n = case[4]
    within_low_precision_error(win_lse[:, :, :n], ref_win, low_win)
    assert torch.isinf(win_lse[:, :, n:]).all()  # windows past the live count are never read


@pytest.mark.parametrize("case", CASES[:3], ids=case_id)
def test_merge_with_the_full_precision_part_conserves_the_mass(case):
    """out and lse of [low-bit | full precision] equal attention over both at once, and Σ window mass + Σ full-
    precision mass = G·L per KV head: the mass the routing folds is every row's attention, nothing lost."""
    ledger, live, rows, count = setup(case, seed=3)
    b, hkv, r, d = rows.shape
    gen = torch.Generator().manual_seed(7)
    fp_k, fp_v = randn(b, hkv, 37, d, generator=gen), randn(b, hkv, 37, d, generator=gen)
    args = (SINKS, inv_freq(d), 1.0, d ** -0.5)
    parts_out, parts_lse, win_lse = lowbit_attention(rows, ledger, count, *args, splits=2)
    fp_out, fp_lse = fp_attention_with_lse(rows, fp_k, fp_v, d ** -0.5, causal_tail=False)
    out, lse, mass = merge(parts_out, parts_lse, fp_out[:, :, None], fp_lse[:, :, None], win_lse, ledger.ids, count)
    keys, values = _reference_keys(live, d)
    all_k, all_v = torch.cat([keys, fp_k], dim=2), torch.cat([values, fp_v], dim=2)
    scores = rows @ all_k.transpose(2, 3) * d ** -0.5
    torch.testing.assert_close(out, scores.softmax(-1) @ all_v, rtol=0, atol=3e-2)
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=0, atol=3e-2)
    fp_mass = torch.exp(rows @ fp_k.transpose(2, 3) * d ** -0.5 - lse.unsqueeze(-1)).sum(2)  # (B, Hkv, 37)
    total = mass.sum(-1) + fp_mass.sum(-1)
    torch.testing.assert_close(total, torch.full_like(total, r), rtol=1e-3, atol=1e-3)
    assert (mass[:, :, case[4]:] == 0).all()
    per_window = torch.exp(scores[..., :keys.shape[2]] - lse.unsqueeze(-1)).reshape(
        b, hkv, r, case[4], -1).sum(dim=(2, 4))
    torch.testing.assert_close(mass[:, :, :case[4]], per_window, rtol=3e-2, atol=3e-3)


def test_the_kernels_write_every_slot_of_their_outputs(monkeypatch):
    """Their outputs are allocated without a fill (a launch fewer each): with the allocations poisoned (NaN), the
    windows past the live count still read -inf (their log-sum-exp) and 0 (their mass), over several splits."""
    import qevict_kernels.lowbit_attention as kernels

    monkeypatch.setattr(kernels.torch, "empty", lambda *size, **kw: torch.full(size, float("nan"), **kw))
    ledger, _, rows, count = setup((2, 2, 3, 1, 5, 23, 8, 64, 4, torch.float32), seed=5)  # 5 of 23 live
    count[1] = 0  # a row with an empty tier
    parts_out, parts_lse, win_lse = lowbit_attention(rows, ledger, count, SINKS, inv_freq(64), 1.0, 0.125, splits=3)
    fp_out, fp_lse = torch.zeros(2, 2, 1, 3, 64, device=DEVICE), torch.zeros(2, 2, 1, 3, device=DEVICE)  # 1 split
    out, lse, mass = merge(parts_out, parts_lse, fp_out, fp_lse, win_lse, ledger.ids, count)
    assert torch.isinf(win_lse[0, :, 5:]).all() and torch.isinf(win_lse[1]).all() and win_lse[0, :, :5].isfinite().all()
    assert (mass[0, :, 5:] == 0).all() and (mass[1] == 0).all() and (mass[0, :, :5] > 0).all()
    assert out.isfinite().all() and lse.isfinite().all()


@pytest.mark.parametrize("b, hkv, r, n, cap, live, n_full, sinks, omega", [
    (1, 3, 3, 97, 13, 13, 4, 4, 8), (2, 2, 4, 1025, 7, 5, 0, 3, 4), (1, 1, 1, 35, 0, 0, 2, 1, 16)])
def test_the_fold_kernel_adds_what_the_layers_fold_adds(b, hkv, r, n, cap, live, n_full, sinks, omega):
    """The step's mass per window into the table in one launch: the low-bit windows' mass summed over the KV heads,
    the full-precision keys' exp(logit - lse) summed over heads, rows and each window's keys, the recent windows
    numbered from the device origin, those past the table's end (the unwritten tail) skipped, all over the query
    heads; against the same fold in PyTorch, to float32 rounding (the sums run in another order)."""
    gen = torch.Generator().manual_seed(n)
    width = 40 + n // omega
    recent = -(-(n - sinks) // omega) - n_full  # windows of the recent region, up to two past the table's end
    first = width + 2 - recent
    table = torch.rand(b, width, generator=gen).to(DEVICE)
    ids = [torch.randperm(min(first, width), generator=gen) for _ in range(b)]  # quantized, then full: older
    quant_ids = torch.stack([i[:cap] for i in ids]).int().to(DEVICE)
    full_ids = torch.stack([i[cap:cap + n_full] for i in ids]).int().to(DEVICE)
    win_mass = torch.rand(b, hkv, cap, generator=gen).to(DEVICE)
    logits = randn(b, hkv, r, n, generator=gen)
    logits[..., n - 5:] = float("-inf")  # the unwritten tail
    lse = torch.logsumexp(logits, -1) + 0.5  # merged with a low-bit part the keys here do not include
    count = torch.full((b,), live, dtype=torch.int32, device=DEVICE)
    origin = torch.tensor([first * omega - n_full * omega], dtype=torch.long, device=DEVICE)
    args = (win_mass, count, quant_ids, logits, lse, full_ids, origin, sinks, n_full * omega, omega, 3 * hkv)
    got, want = table.clone(), table.clone()
    fold_step_mass(got, *args)
    fold_step_mass_reference(want, *args)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (got != table).sum() == b * (live + n_full + recent - min(2, recent))  # each live window; the tail's not


def _reference_keys(live, d):
    return dequantized_keys_reference(live, SINKS, inv_freq(d), 1.0)


def test_an_empty_tier_contributes_nothing():
    case = (1, 2, 2, 1, 0, 4, 8, 64, 4, torch.float32)
    ledger, _, rows, count = setup(case)
    parts_out, parts_lse, win_lse = lowbit_attention(rows, ledger, count, SINKS, inv_freq(64), 1.0, 0.125, splits=2)
    assert torch.isinf(parts_lse).all() and torch.isinf(win_lse).all()
    fp_out, fp_lse = torch.ones(1, 2, 1, 2, 64, device=DEVICE), torch.zeros(1, 2, 1, 2, device=DEVICE)  # 1 split
    out, lse, mass = merge(parts_out, parts_lse, fp_out, fp_lse, win_lse, ledger.ids, count)
    assert torch.equal(out, fp_out[:, :, 0]) and torch.equal(lse, fp_lse[:, :, 0]) and not mass.any()


def test_no_count_reads_every_window_of_the_tier():
    """The engine passes no count (its tiers hold exactly their windows): the same as a count of every window."""
    ledger, _, rows, _ = setup((2, 2, 3, 1, 11, 11, 8, 64, 4, torch.float32), seed=9)
    full = torch.full((2,), 11, dtype=torch.int32, device=DEVICE)
    args = (SINKS, inv_freq(64), 1.0, 0.125)
    with_count, without = (lowbit_attention(rows, ledger, count, *args, splits=3) for count in (full, None))
    assert all(torch.equal(a, b) for a, b in zip(with_count, without))
    fp_out, fp_lse = torch.zeros(2, 2, 1, 3, 64, device=DEVICE), torch.zeros(2, 2, 1, 3, device=DEVICE)
    merged = [merge(*parts[:2], fp_out, fp_lse, parts[2], ledger.ids, count) for parts, count in
              ((with_count, full), (without, None))]
    assert all(torch.equal(a, b) for a, b in zip(*merged))


def test_bfloat16_ledgers_and_queries():
    case = (1, 2, 3, 1, 9, 9, 8, 64, 2, torch.bfloat16)
    ledger, live, rows, count = setup(case)
    rows = rows.bfloat16()
    args = (SINKS, inv_freq(64), 1.0, 0.125)
    parts_out, parts_lse, _ = lowbit_attention(rows, ledger, count, *args, splits=1)
    ref, _, _ = lowbit_reference(rows.float(), live, *args)
    low, _, _ = lowbit_reference(rows, live, *args, dtype=torch.bfloat16)
    within_low_precision_error(parts_out[:, :, 0], ref, low)


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_half_precision_scales_are_read_as_their_float32_widening(param_dtype):
    """A float32 model's ledger with narrow scales: the kernel reads them as their widening, bit for bit."""
    narrow = make_ledger(1, 2, 13, 8, 64, 4, param_dtype=param_dtype)
    wide = WindowLedger(**{**vars(narrow), **{name: getattr(narrow, name).float()
                                               for name in ("k_scale", "k_zero", "v_scale", "v_zero")}})
    rows = randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(1))
    count = torch.full((1,), 13, dtype=torch.int32, device=DEVICE)
    args = (SINKS, inv_freq(64), 1.0, 0.125)
    got = lowbit_attention(rows, narrow, count, *args, splits=2)
    assert all(torch.equal(a, b) for a, b in zip(got, lowbit_attention(rows, wide, count, *args, splits=2)))


def test_segments_merge_exactly():
    gen = torch.Generator().manual_seed(3)
    q, k, v = randn(1, 6, 4, 64, generator=gen), randn(1, 2, 130, 64, generator=gen), \
        randn(1, 2, 130, 64, generator=gen)
    whole, whole_lse = fp_attention_with_lse(q, k, v, 0.125, causal_tail=True)
    pieces = [fp_attention_with_lse(q, k[:, :, :50], v[:, :, :50], 0.125, causal_tail=False),
              fp_attention_with_lse(q, k[:, :, 50:], v[:, :, 50:], 0.125, causal_tail=True)]
    merged, merged_lse = merge_attention(pieces)
    torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged_lse, whole_lse, rtol=1e-5, atol=1e-6)
    mask = (torch.arange(130)[None, :] <= (126 + torch.arange(4))[:, None]).to(DEVICE)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1),
                                                                v.repeat_interleave(3, 1), attn_mask=mask, scale=0.125)
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)


def test_masked_full_precision_attention_sees_what_its_mask_says():
    """A whole buffer (97 keys) whose last 20 slots hold stale keys no query sees: the same output and log-sum-exp as
    the live 77 keys with the queries' own tokens last (bottom-right causal)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = randn(2, 6, 3, 64, generator=gen), randn(2, 2, 97, 64, generator=gen), randn(2, 2, 97, 64, generator=gen)
    k[:, :, 77:], v[:, :, 77:] = 1e4, -1e4  # stale slots (finite: the buffers start at zeros)
    positions = torch.arange(97, device=DEVICE).expand(2, -1)
    query_pos = torch.arange(74, 77, device=DEVICE)
    out, lse, scores = fp_attention_masked(q, k, v, 0.125, positions[:, None, :] > query_pos[None, :, None])
    ref_out, ref_lse = fp_attention_with_lse(q, k[:, :, :77], v[:, :, :77], 0.125, causal_tail=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # the masked logits: row r (position 74 + r % 3) sees keys up to its own position, at the same scale
    assert torch.isinf(scores[..., 77:]).all() and torch.isinf(scores[:, :, 0, 75:]).all()
    row = q[:, 0, 2].float().unsqueeze(1) @ k[:, 0, :77].float().transpose(1, 2) * 0.125  # query head 0 at 76
    torch.testing.assert_close(scores[:, 0, 2:3, :77], row)
    one, one_lse, _ = fp_attention_masked(q[:, :, :1], k, v, 0.125, positions[:1, None, :] > 74)  # one position
    torch.testing.assert_close(one, ref_out[:, :, :1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one_lse, ref_lse[:, :, :1], rtol=1e-5, atol=1e-5)


def test_kernel_path_needs_the_interpreter_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_cache("qevict", tiny_model(), QEvictConfig(budget=0.3, kernels="triton"), max_length=600)
    auto = make_cache("qevict", tiny_model(), QEvictConfig(budget=0.3), max_length=600).backend.name
    assert auto in ("cpu", "torch")  # on CPU, auto never picks the interpreter


@pytest.mark.slow  # the Triton interpreter over whole generations: ~45 s
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_forced_kernels_generate_the_torch_paths_tokens(kv_heads):
    model = tiny_model("llama", kv_heads).to(DEVICE)
    prompt = random_prompt(400).to(DEVICE)
    results = {}
    for kernels in ("torch", "triton"):  # 48 steps: six routing events after the prefill
        cache = make_cache("qevict", model, QEvictConfig(budget=0.2, kernels=kernels), max_length=400 + 48)
        assert cache.backend.name == kernels
        out = model.generate(prompt, **{KV: cache}, max_new_tokens=48, min_new_tokens=48, do_sample=False)
        results[kernels] = (out[0, 400:].tolist(), cache.summary(), cache.memory_report())
    torch_tokens, torch_moves, torch_mem = results["torch"]
    triton_tokens, triton_moves, triton_mem = results["triton"]
    assert triton_tokens == torch_tokens
    assert triton_moves == torch_moves and torch_moves["evictions"] > 0 and torch_mem["components"]["quantized"] > 0
    assert triton_mem["total_bytes"] <= triton_mem["budget_bytes"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the interpreter is too slow for SmolLM2")
def test_forced_kernels_on_smollm2_generate_the_torch_paths_tokens():
    from qevict_core import load_model
    from qevict_core.models import ModelNotFoundError
    from tests.test_smollm2 import passage_prompt

    try:  # a GPU host reached without the bundled model (it is 98 MB) runs the tests above and skips this one
        model, tok = load_model(device="cuda", dtype=torch.float32)
    except ModelNotFoundError as err:
        pytest.skip(str(err))
    prompt = passage_prompt(tok, 1400).cuda()
    tokens = {}
    for kernels in ("torch", "triton"):
        cache = make_cache("qevict", model, QEvictConfig(budget=0.2, kernels=kernels), max_length=prompt.shape[1] + 256)
        out = model.generate(prompt, **{KV: cache}, max_new_tokens=256, min_new_tokens=256, do_sample=False)
        tokens[kernels] = out[0, prompt.shape[1]:].tolist()
    agree = sum(a == b for a, b in zip(tokens["torch"], tokens["triton"])) / 256
    assert tokens["triton"][:64] == tokens["torch"][:64] and agree > 0.95, agree
