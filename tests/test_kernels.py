"""Triton kernels against their PyTorch references (on CPU through TRITON_INTERPRET=1), and the engine with the
kernel path forced against the PyTorch path.

Tolerances follow flash-attn's tests: the kernel's error against the float32 reference must stay within twice the
error of the same math done in bfloat16 (plus a small floor)."""

import pytest
import torch

from qevict_kernels.merge import fp_attention_with_lse, merge_attention
from qevict_kernels.quant_attention import quant_attention, quant_attention_reference
from qevict_kernels.window_mass import fp_mass, mass_reference, quant_mass, quant_mass_reference
from qevict_core import QEvictConfig, make_cache
from qevict_core.engine.ledger import WindowLedger
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


# (batch, kv heads, GQA ratio, query length, windows, Ω, head_dim, bits): T = 97 and 1025 tokens, windows of 25
# tokens straddling 64-token blocks, GQA 1/3/4, head_dim 64/128, INT2/INT4, decode and short chunks.
CASES = [(1, 2, 1, 1, 97, 1, 64, 2), (1, 1, 3, 1, 41, 25, 64, 4), (2, 2, 4, 3, 13, 8, 128, 2),
         (1, 3, 3, 1, 12, 8, 64, 2), (1, 2, 4, 4, 7, 32, 128, 4)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[4] * c[5]}-g{c[2]}-d{c[6]}-int{c[7]}-q{c[3]}")
def test_quant_attention_matches_reference(case):
    b, hkv, g, lq, windows, omega, d, bits = case
    ledger = make_ledger(b, hkv, windows, omega, d, bits)
    query = randn(b, hkv * g, lq, d, generator=torch.Generator().manual_seed(1))
    args = (SINKS, inv_freq(d), 1.0, d ** -0.5)
    out, lse = quant_attention(query, ledger, *args)
    ref, ref_lse = quant_attention_reference(query, ledger, *args)
    low, low_lse = quant_attention_reference(query, ledger, *args, dtype=torch.bfloat16)
    within_low_precision_error(out, ref, low)
    within_low_precision_error(lse, ref_lse, low_lse)


def test_quant_attention_reads_bfloat16_ledgers():
    ledger = make_ledger(1, 2, 9, 8, 64, 2, dtype=torch.bfloat16)
    query = randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    args = (SINKS, inv_freq(64), 1.0, 0.125)
    out, _ = quant_attention(query, ledger, *args)
    ref, _ = quant_attention_reference(query.float(), ledger, *args)
    low, _ = quant_attention_reference(query, ledger, *args, dtype=torch.bfloat16)
    within_low_precision_error(out, ref, low)


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_quant_attention_widens_half_precision_scales_exactly(param_dtype):
    """A float32 model's ledger with narrow scales: the kernel reads them as their float32 widening, bit for bit."""
    narrow = make_ledger(1, 2, 13, 8, 64, 4, param_dtype=param_dtype)
    wide = WindowLedger(**{**vars(narrow), **{name: getattr(narrow, name).float()
                                               for name in ("k_scale", "k_zero", "v_scale", "v_zero")}})
    query = randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(1))
    args = (SINKS, inv_freq(64), 1.0, 0.125)
    out, lse = quant_attention(query, narrow, *args)
    wide_out, wide_lse = quant_attention(query, wide, *args)
    assert torch.equal(out, wide_out) and torch.equal(lse, wide_lse)
    ref, _ = quant_attention_reference(query, narrow, *args)
    low, _ = quant_attention_reference(query, narrow, *args, dtype=torch.bfloat16)
    within_low_precision_error(out, ref, low)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"T{c[4] * c[5]}-g{c[2]}")
def test_window_mass_matches_reference(case):
    b, hkv, g, _, windows, omega, d, bits = case
    ledger = make_ledger(b, hkv, windows, omega, d, bits)
    nq = 5
    gen = torch.Generator().manual_seed(2)
    query = randn(b, hkv * g, nq, d, generator=gen)
    query_pos = torch.arange(4 * windows * omega + 40, 4 * windows * omega + 40 + nq, device=DEVICE)
    lse = randn(b, hkv * g, nq, generator=gen) + 6
    args = (SINKS, inv_freq(d), 1.0, d ** -0.5)
    # Within twice the error of the same math in bfloat16: a GPU's tl.dot runs in TF32 (seen on an H200, where a
    # fixed rtol of 1e-4 failed), the interpreter in float32.
    within_low_precision_error(quant_mass(query, query_pos, lse, ledger, *args),
                               quant_mass_reference(query, query_pos, lse, ledger, *args),
                               quant_mass_reference(query, query_pos, lse, ledger, *args, dtype=torch.bfloat16))
    keys = randn(b, hkv, 97, d, generator=gen)
    key_pos = query_pos[-1] - 95 + torch.arange(97, device=DEVICE).expand(b, -1)  # the last two keys are in the queries' future
    mass = fp_mass(query, query_pos, lse, keys, key_pos, d ** -0.5)
    within_low_precision_error(mass, mass_reference(query, query_pos, lse, keys, key_pos, d ** -0.5),
                               mass_reference(query, query_pos, lse, keys, key_pos, d ** -0.5, torch.bfloat16))
    assert torch.all(mass[..., -1] == 0)


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


def test_kernel_path_needs_the_interpreter_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_cache("qevict", tiny_model(), QEvictConfig(budget=0.3, kernels="triton"), max_length=600)
    auto = make_cache("qevict", tiny_model(), QEvictConfig(budget=0.3), max_length=600).backend.name
    assert auto in ("cpu", "torch")  # on CPU, auto never picks the interpreter


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
