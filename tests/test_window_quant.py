"""Windows quantized in one launch (``qevict_kernels.window_quant``) equal PyTorch's quantization bit for bit:
codes, packed bytes, pairs in float32, float16 and bfloat16, constant slices (scale 0) and pairs their dtype cannot
hold, at Ω = 8 and an Ω that is no power of two."""

from __future__ import annotations

import pytest
import torch

from qevict_core.engine.ledger import WindowLedger
from qevict_kernels.window_quant import quantize_windows
from tests.test_kernels import DEVICE


def windows(b, h, m, omega, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, m * omega, d, generator=g) * torch.logspace(-2, 1.5, d)  # channels of many scales
    values = torch.randn(b, h, m * omega, d, generator=g) * 3
    keys[0, 0, :omega] = 0.25  # a constant window: scale 0, every code 0
    values[-1, -1, -1] = -7.5  # a constant token
    values[0, 0, 1] = torch.arange(d) % 31  # scale 30 / levels, exact for INT2/INT4: codes that tie, half to even
    if m > 1:
        keys[-1, 0, omega:2 * omega, 3] = -9e4  # below float16's range: that window's zero-point cannot be held
    return keys.to(DEVICE, dtype), values.to(DEVICE, dtype)


CASES = [(2, 3, 5, 8, 64, 4, torch.float32, torch.float16), (1, 2, 3, 8, 128, 2, torch.bfloat16, torch.bfloat16),
         (2, 1, 4, 6, 64, 2, torch.float32, torch.float32), (1, 4, 2, 16, 128, 4, torch.bfloat16, torch.float16),
         (1, 1, 1, 8, 64, 8, torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[2]}-o{c[3]}-d{c[4]}-int{c[5]}-{c[6]}-{c[7]}".replace(
    "torch.", ""))
def test_the_kernel_quantizes_as_pytorch_does_bit_for_bit(case):
    b, h, m, omega, d, bits, dtype, pair = case
    keys, values = windows(b, h, m, omega, d, dtype, seed=m * d + bits)
    ids = torch.arange(m, device=DEVICE, dtype=torch.int32).expand(b, -1)
    ref = WindowLedger.quantize(keys, values, ids, omega, bits, pair, check=False)
    got = quantize_windows(keys, values, omega, bits, pair)
    for name, tensor in zip(("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero"), got[:6]):
        expected = getattr(ref, name)
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, name
        assert torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8)), name  # the same bits
    assert torch.equal(got[6], ref.unfit())
    assert got[6].any() == (m > 1 and pair == torch.float16)  # the -9e4 window, only where float16 holds the pairs


def test_no_windows_launches_nothing():
    keys = torch.zeros(1, 2, 0, 64, device=DEVICE)
    out = quantize_windows(keys, keys, 8, 4, torch.float16)
    assert out[0].shape == (1, 2, 0, 32) and out[6].shape == (1, 0)
