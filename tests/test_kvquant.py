"""KVQuant: non-uniform levels, dense-and-sparse outliers kept exactly, pre-RoPE keys, measured bytes."""

import pytest
import torch

from qevict_core import make_cache
from qevict_core.baselines.kvquant import KVQuantCache, _nearest, fit_levels
from tests.conftest import KV, random_prompt, tiny_model
from tests.test_budget import walked_bytes


def test_kmeans_levels_fit_bell_shaped_data_better_than_uniform_ones():
    x = (torch.randn(20000, generator=torch.Generator().manual_seed(0)) / 3).clamp(-1, 1)
    for bits in (2, 4):
        levels = fit_levels(x, bits)
        uniform = torch.linspace(-1, 1, 1 << bits)
        nuq = (levels[_nearest(x, levels).long()] - x).pow(2).mean()
        flat = (uniform[_nearest(x, uniform).long()] - x).pow(2).mean()
        assert levels.shape == (1 << bits,) and torch.all(levels[1:] > levels[:-1])
        assert nuq < 0.8 * flat, (bits, nuq, flat)


def _lloyd_every_iteration(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The fit as the committed rows ran it: every one of the KMEANS_ITERATIONS Lloyd steps."""
    from qevict_core.baselines.kvquant import KMEANS_ITERATIONS

    m = 1 << bits
    levels = torch.quantile(x, (torch.arange(m, dtype=torch.float32) + 0.5) / m)
    for _ in range(KMEANS_ITERATIONS):
        nearest = (x[:, None] - levels[None]).abs().argmin(dim=1)
        sums = torch.zeros(m).index_add_(0, nearest, x)
        counts = torch.zeros(m).index_add_(0, nearest, torch.ones_like(x))
        levels = torch.where(counts > 0, sums / counts.clamp_min(1), levels)
    return levels.sort().values


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bits", [2, 4])
def test_the_fit_stops_at_a_fixed_point_with_the_levels_of_every_iteration(bits, seed):
    """Stopping once an iteration leaves the levels unchanged gives the same bits as running them all."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(30000, generator=gen) / 3, torch.rand(5000, generator=gen) * 2 - 1]).clamp(-1, 1)
    assert torch.equal(fit_levels(x, bits), _lloyd_every_iteration(x, bits))


@pytest.mark.parametrize("bits", [2, 4])
def test_outliers_come_back_exactly_and_inliers_within_the_level_spacing(bits):
    # The tiny model has 2 heads of 16 channels: 1% of a token's 32 values rounds to no outlier, so take 10%.
    cache = KVQuantCache(tiny_model("llama", 2), None, 400, bits=bits, outlier_frac=0.1)
    layer = cache.layers[0]
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 300, 16, generator=generator), torch.randn(1, 2, 300, 16, generator=generator)
    values[0, 1, 200, 3] = 40.0  # a value outlier
    # A key far below its channel's calibrated range, planted where KVQuant looks: before RoPE.
    all_positions = torch.arange(300)[None]
    pre = cache.rope.unrotate(keys, all_positions)
    pre[0, 0, 250, 5] = -30.0
    keys = cache.rope.rotate(pre, all_positions)
    layer.update(keys[:, :, :240], values[:, :, :240])  # the prompt: calibration
    for t in range(240, 300):
        layer.update(keys[:, :, t:t + 1], values[:, :, t:t + 1])
    k_out, v_out = layer._dequantized()  # tokens 1.. (token 0 is the sink, kept in full precision)
    assert torch.equal(layer.sink_k, keys[:, :, :1])
    assert v_out[0, 1, 199, 3] == 40.0
    positions = torch.arange(1, 300)[None]
    pre_rope = cache.rope.unrotate(k_out, positions)
    assert pre_rope[0, 0, 249, 5].item() == pytest.approx(-30.0, abs=1e-4)
    # Inliers: within half the widest gap between neighbouring levels, times the half-range.
    gap = (layer.v_levels[1:] - layer.v_levels[:-1]).max()
    bound = gap / 2 * layer.v_half + 1e-5
    inlier = (values[:, :, 1:] - v_out).abs()
    assert torch.all(inlier <= bound)
    report = layer.resident_bytes()
    assert report["quantized"] == 2 * 299 * 2 * 16 * bits // 8
    assert report["outliers"] > 0 and sum(report.values()) == walked_bytes(cache)


def test_generation_tracks_fullkv_and_bytes_follow_the_bit_width():
    model = tiny_model("llama", 2)
    prompt = random_prompt(400)
    outputs, ratios = {}, {}
    for method in ("fullkv", "kvquant2", "kvquant4"):
        cache = make_cache(method, model, None, max_length=440)
        outputs[method] = model.generate(prompt, **{KV: cache}, max_new_tokens=40, min_new_tokens=40,
                                         do_sample=False)[0, 400:]
        ratios[method] = cache.memory_report()["ratio"]
        assert cache.memory_report()["total_bytes"] == walked_bytes(cache)
    assert ratios["kvquant2"] < ratios["kvquant4"] < 0.35
    agree4 = (outputs["kvquant4"] == outputs["fullkv"]).float().mean()
    agree2 = (outputs["kvquant2"] == outputs["fullkv"]).float().mean()
    assert agree4 >= 0.9 and agree4 >= agree2


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        KVQuantCache(tiny_model("llama", 2), None, 100, bits=3)
    with pytest.raises(ValueError, match="outlier_frac"):
        KVQuantCache(tiny_model("llama", 2), None, 100, outlier_frac=0.7)
