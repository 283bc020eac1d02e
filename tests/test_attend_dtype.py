"""The PyTorch path's attention reads a 16-bit model's keys and values as stored (the path ``kernels="auto"`` takes on
CUDA, where every byte a decode step moves is its time): the product in the model's dtype, the softmax and the mass
in float32, as transformers' eager attention computes; a float32 model's arithmetic is unchanged."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qevict_core import QEvictConfig, make_cache
from qevict_core.engine.key_mass import attend_with_mass
from qevict_core.generation.model_call import call
from tests.conftest import random_prompt, tiny_model


def _case(dtype, n=97, hq=6, hkv=2, q=1, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, hq, q, d, generator=gen).mul_(2).to(dtype)
    keys = torch.randn(1, hkv, n, d, generator=gen).mul_(2).to(dtype)
    values = torch.randn(1, hkv, n, d, generator=gen).to(dtype)
    key_pos = torch.randperm(n, generator=gen)[None]  # keys in any order, as the tiers lay them out
    return query, torch.arange(n - q, n), keys, key_pos, values


def _reference(query, query_pos, keys, key_pos, values, scaling):
    """Float64 attention, query head h reading KV head h // G: out (B, q, Hq, D), mass (B, Hkv, N)."""
    b, hq, q, d = query.shape
    hkv = keys.shape[1]
    rows = query.double().reshape(b, hkv, hq // hkv * q, d)
    logits = rows @ keys.double().transpose(2, 3) * scaling  # (B, Hkv, G*q, N)
    hidden = key_pos[:, None, None, :] > query_pos.repeat(hq // hkv)[None, None, :, None]
    probs = logits.masked_fill(hidden, float("-inf")).softmax(-1)
    out = (probs @ values.double()).view(b, hq, q, d).transpose(1, 2)
    return out, probs.sum(dim=2)


def test_bfloat16_attention_within_its_rounding_and_mass_conserved():
    query, query_pos, keys, key_pos, values = _case(torch.bfloat16, q=3)
    out, mass = attend_with_mass(query, query_pos, keys, key_pos, values, 0.125)
    want_out, want_mass = _reference(query, query_pos, keys, key_pos, values, 0.125)
    assert out.dtype == torch.bfloat16 and mass.dtype == torch.float32
    # bfloat16 logits and probabilities (8 significant bits) against float64: the tolerance of that rounding
    torch.testing.assert_close(out.double(), want_out, rtol=0.05, atol=0.03)
    torch.testing.assert_close(mass.double(), want_mass, rtol=0.05, atol=0.02)
    # every query head's probabilities sum to one: G heads x q queries per KV head
    torch.testing.assert_close(mass.sum(-1), torch.full((1, 2), 9.0), rtol=1e-5, atol=1e-5)


def test_a_float32_model_computes_exactly_as_before():
    """Float32 queries over a bfloat16 cache: the keys widened once, everything in float32, bit for bit the
    arithmetic of the float32 path the committed evaluation rows come from."""
    query, query_pos, keys, key_pos, values = _case(torch.float32)
    keys16, values16 = keys.bfloat16(), values.bfloat16()
    out, mass = attend_with_mass(query, query_pos, keys16, key_pos, values16, 0.125)
    rows = query.reshape(1, 2, 3, 64)
    logits = torch.matmul(rows, keys16.float().transpose(2, 3)).mul_(0.125).view(1, 2, 3, 1, 97)
    probs = torch.softmax(logits.masked_fill_(key_pos[:, None, None, None, :] > query_pos[-1], float("-inf")), -1)
    want = torch.matmul(probs.flatten(2, 3), values16.float()).view(1, 6, 1, 64).transpose(1, 2)
    assert torch.equal(out, want) and torch.equal(mass, probs.sum(dim=(2, 3)))


class WidenedCopies(TorchDispatchMode):
    """The float32 tensors an operator makes from 16-bit ones, at least ``floor`` elements each."""

    def __init__(self, floor: int):
        super().__init__()
        self.floor, self.found = floor, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        narrow = any(isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16)
                     for a in tree_flatten((args, kwargs or {}))[0])
        if narrow and isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() >= self.floor:
            self.found.append((str(func), tuple(out.shape)))
        return out


def test_a_bfloat16_decode_step_widens_no_keys_or_values():
    """A plain decode step of a bfloat16 model on the PyTorch path, tiers full: no float32 tensor as large as a
    quarter of the keys it attends to (the logits and the mass are 1/D of them per query head)."""
    model, omega = tiny_model("llama", 2).to(torch.bfloat16), 8
    cache = make_cache("qevict", model, QEvictConfig(budget=0.3, kernels="torch", omega=omega), max_length=340)
    with torch.inference_mode():
        token = call(model, random_prompt(300), cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        while not cache.routed():
            token = call(model, token, cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        layer = cache.layers[0]
        attended = layer.quant.num_windows * omega + layer.fp.capacity
        assert layer.quant.num_windows > 0
        mode = WidenedCopies(attended * layer.sink_k.shape[1] * layer.sink_k.shape[3] // 4)
        with mode:
            token = call(model, token, cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        assert not cache.routed()
    assert mode.found == []
