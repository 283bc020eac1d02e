"""Quantization, packing, RoPE round trips and the write-once ledger."""

import pytest
import torch

from qevict_core.engine.budget import KVShape, quant_window_bytes
from qevict_core.engine.ledger import WindowLedger
from qevict_core.engine.quant import dequantize, pack, quantize, unpack
from qevict_core.engine.rope import Rope
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


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4])
def test_narrow_scales_keep_the_half_step_bound_and_cover_every_slice(param_dtype, bits):
    # Channels far from zero (offset 40) are where a zero-point rounded to nearest would leave the slice's minimum
    # outside the grid: bfloat16 has 8 bits of mantissa.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, 64, generator=g) * torch.linspace(0.01, 3, 64) + torch.linspace(-40, 40, 64)
    codes, scale, zero = quantize(x, bits, dim=2, param_dtype=param_dtype)
    assert scale.dtype == zero.dtype == param_dtype
    wide_scale, wide_zero = scale.double(), zero.double()
    assert torch.all(wide_zero <= x.amin(2, keepdim=True).double())
    assert torch.all(wide_zero + ((1 << bits) - 1) * wide_scale >= x.amax(2, keepdim=True).double())
    err = (dequantize(codes, scale, zero, torch.float32).double() - x.double()).abs()
    assert dequantize(codes, scale, zero, torch.float32).dtype == torch.float32
    assert torch.all(err <= wide_scale / 2 * (1 + 1e-5) + 1e-5)
    # Against the model-dtype pair the step grows by no more than the stored dtype's rounding: one ulp of the
    # zero-point spread over the levels, one ulp of the scale.
    _, full_scale, _ = quantize(x, bits, dim=2)
    ulp = 2.0 ** -(10 if param_dtype == torch.float16 else 7)
    assert torch.all(scale.float() <= (full_scale + zero.float().abs() * ulp / ((1 << bits) - 1)) * (1 + 2 * ulp))
    assert (scale.float() / full_scale).max() > 1  # rounding up shows: the check above is not vacuous


def test_a_bfloat16_model_with_float16_scales_keeps_the_bound_against_the_stored_pair():
    x = (torch.randn(1, 2, 8, 64, generator=torch.Generator().manual_seed(1)) * 3 + 20).bfloat16()
    codes, scale, zero = quantize(x, 4, dim=2, param_dtype=torch.float16)
    err = (dequantize(codes, scale.double(), zero.double()) - x.double()).abs()
    assert torch.all(err <= scale.double() / 2 * (1 + 1e-6))


def test_values_beyond_float16_say_which_scale_dtypes_fit():
    x = torch.full((1, 1, 8, 4), -6.9e4)  # the zero-point, -7e4, is past float16's largest number (65,504)
    x[..., 0, :] = -7e4
    with pytest.raises(ValueError, match="do not fit torch.float16 scales.*scale_dtype='model' or 'bfloat16'"):
        quantize(x, 2, dim=2, param_dtype=torch.float16)
    codes, scale, zero = quantize(x, 2, dim=2, param_dtype=torch.bfloat16)
    assert torch.isfinite(scale).all()


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
    half = WindowLedger.quantize(keys, values, ledger.ids, omega=8, bits=bits, param_dtype=torch.float16)
    assert half.dequantize(torch.float32)[0].dtype == torch.float32
    meta = ledger.nbytes_by_component()["quant_meta"]
    assert half.nbytes_by_component() == {**ledger.nbytes_by_component(), "quant_meta": meta // 2}
    assert sum(half.nbytes_by_component().values()) == 3 * quant_window_bytes(shape, 8, bits, torch.float16)


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
