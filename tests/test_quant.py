"""Quantization, packing, RoPE round trips and the write-once ledger."""

import pytest
import torch

from qevict_core.budget import KVShape, quant_window_bytes
from qevict_core.ledger import WindowLedger
from qevict_core.quant import dequantize, pack, quantize, unpack
from qevict_core.rope import Rope
from tests.conftest import tiny_model


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dim", [2, 3])
def test_quantize_error_within_half_step(bits, dim):
    x = torch.randn(2, 3, 8, 16) * torch.linspace(0.1, 5, 16)
    codes, scale, zero = quantize(x, bits, dim)
    err = (dequantize(codes, scale, zero) - x).abs()
    assert codes.max() <= (1 << bits) - 1
    assert torch.all(err <= scale / 2 + 1e-5)
    # The bound is tight enough to mean something: the error is not zero.
    assert err.max() > 0


def test_constant_slice_dequantizes_exactly():
    x = torch.full((1, 1, 8, 4), 3.25)
    codes, scale, zero = quantize(x, 2, dim=2)
    assert torch.equal(dequantize(codes, scale, zero), x)


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (2, 3, 5, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)


def test_pack_rejects_unaligned_width():
    with pytest.raises(ValueError, match="multiple of 4"):
        pack(torch.zeros(1, 6, dtype=torch.uint8), 2)


def test_unrotate_then_rotate_is_identity():
    rope = Rope.from_model(tiny_model())
    keys = torch.randn(2, 2, 24, 16)
    positions = torch.randint(0, 3000, (2, 24))
    assert torch.allclose(rope.rotate(rope.unrotate(keys, positions), positions), keys, atol=1e-5)
    assert torch.allclose(rope.unrotate(rope.rotate(keys, positions), positions), keys, atol=1e-5)
    # Rotation at another position is not the identity: positions matter.
    assert not torch.allclose(rope.rotate(keys, positions + 1), rope.rotate(keys, positions), atol=1e-3)


def test_quantizing_rerotated_keys_matches_direct_prerope_quantization():
    """un-rotate -> quantize -> dequantize -> re-rotate == re-rotate(quantize(pre-RoPE key)) within float error."""
    rope = Rope.from_model(tiny_model())
    pre = torch.randn(1, 2, 16, 16)
    positions = torch.arange(100, 116).expand(1, -1)
    ids = torch.tensor([[0, 1]])
    via_rotated = WindowLedger.quantize(rope.unrotate(rope.rotate(pre, positions), positions), pre, ids, 8, 2)
    direct = WindowLedger.quantize(pre, pre, ids, 8, 2)
    k1, _ = via_rotated.dequantize()
    k2, _ = direct.dequantize()
    assert torch.allclose(rope.rotate(k1, positions), rope.rotate(k2, positions), atol=1e-4)


@pytest.mark.parametrize("bits", [2, 4])
def test_ledger_layout_and_bytes(bits):
    keys, values = torch.randn(2, 3, 24, 16), torch.randn(2, 3, 24, 16)
    ledger = WindowLedger.quantize(keys, values, torch.tensor([[4, 7, 9], [1, 2, 3]]), omega=8, bits=bits)
    k, v = ledger.dequantize()
    assert k.shape == keys.shape and v.shape == values.shape
    # Per-channel key error bound, per-token value error bound.
    k_scale = ledger.k_scale.repeat_interleave(8, dim=2)
    assert torch.all((k - keys).abs() <= k_scale / 2 + 1e-5)
    assert torch.all((v - values).abs() <= ledger.v_scale / 2 + 1e-5)
    shape = KVShape(num_layers=1, num_kv_heads=3, num_q_heads=3, head_dim=16, dtype=torch.float32, batch=2)
    measured = sum(ledger.nbytes_by_component().values())
    assert measured == 3 * quant_window_bytes(shape, 8, bits)


def test_select_and_cat_move_records_without_changing_them():
    keys, values = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    ledger = WindowLedger.quantize(keys, values, torch.tensor([[10, 11, 12, 13]]), omega=8, bits=2)
    picked = ledger.select(torch.tensor([[2, 0]]))
    assert picked.ids.tolist() == [[12, 10]]
    k_all, _ = ledger.dequantize()
    k_picked, _ = picked.dequantize()
    assert torch.equal(k_picked[:, :, :8], k_all[:, :, 16:24])
    fresh = WindowLedger.quantize(torch.ones(1, 2, 8, 16), torch.ones(1, 2, 8, 16), torch.tensor([[99]]), 8, 2)
    joined = picked.cat(ledger.select(torch.tensor([[3]])), fresh)
    assert joined.ids.tolist() == [[12, 10, 13, 99]]
    k_joined, v_joined = joined.dequantize()
    assert torch.equal(k_joined[:, :, :16], k_picked)
    assert torch.equal(k_joined[:, :, 16:24], k_all[:, :, 24:32])
    assert torch.equal(k_joined[:, :, 24:], torch.ones(1, 2, 8, 16))
    assert torch.equal(v_joined[:, :, 24:], torch.ones(1, 2, 8, 16))
