"""KVQuant (Hooper et al., NeurIPS 2024) as a quantization baseline: pre-RoPE per-channel keys, per-token values,
non-uniform levels, dense-and-sparse outliers and the attention sink in full precision.

Built on the same layer API and byte accounting as every method here. Where it departs from the official code
(SqueezeAILab/KVQuant), and why:

- **Levels.** One codebook of 2^bits levels per layer for keys and one for values, fit by 1-D k-means on the
  prompt's normalised inliers when the prompt is stored (online calibration). The official code fits them offline
  on calibration text, weighted by Fisher information (squared gradients of the loss); neither calibration data
  nor gradients exist at run time here.
- **Key thresholds** (per channel, the outlier_frac/2 and 1 - outlier_frac/2 quantiles over tokens) are calibrated
  on the prompt, where the official code calibrates them offline; decode tokens beyond them become outliers.
  **Value thresholds** are per token at run time, as in the official code: the outlier_frac of each token's
  elements (over all heads) furthest in each tail.
- **Sparse outliers** are kept exactly, each as an int32 token index, an int32 position within the token and the
  value in the model dtype. The official CSR/CSC layout stores narrower indices plus row pointers, so an outlier
  costs a few bytes more here; every byte is counted.
- The prompt is attended in full precision and stored quantized after prefill; each decode token is attended in
  full precision in its own step and stored quantized (as KIVI here and transformers' QuantizedCache do).
- Only 2- and 4-bit codes: codes are packed 4 or 2 per byte, and a 3-bit code in a 4-bit slot would be charged 4
  bits, so KVQuant-3b is not offered.
"""

from __future__ import annotations

import torch

from ..engine.budget import KVShape
from ..engine.cache_base import ReportingCache, ReportingLayer
from ..config import QEvictConfig
from ..engine.quant import codes_per_byte, pack, planes_to_row
from ..engine.rope import Rope

KMEANS_ITERATIONS = 25
KMEANS_SAMPLES = 1 << 18


def fit_levels(normalised: torch.Tensor, bits: int) -> torch.Tensor:
    """1-D k-means (Lloyd) of values in [-1, 1] into 2^bits sorted levels, initialised at the quantiles."""
    x = normalised.flatten().float()
    if x.numel() > KMEANS_SAMPLES:  # a fixed stride keeps the fit deterministic
        x = x[:: x.numel() // KMEANS_SAMPLES]
    m = 1 << bits
    if x.numel() == 0:
        return torch.linspace(-1, 1, m, device=x.device)
    levels = torch.quantile(x, (torch.arange(m, dtype=torch.float32, device=x.device) + 0.5) / m)
    for _ in range(KMEANS_ITERATIONS):
        nearest = (x[:, None] - levels[None]).abs().argmin(dim=1)
        sums = torch.zeros(m, device=x.device).index_add_(0, nearest, x)
        counts = torch.zeros(m, device=x.device).index_add_(0, nearest, torch.ones_like(x))
        updated = torch.where(counts > 0, sums / counts.clamp_min(1), levels)
        if torch.equal(updated, levels):  # a fixed point: every later iteration computes these very levels
            break  # (on a 2K prompt's layers the median fit reaches one after about 15 of the 25 iterations)
        levels = updated
    return levels.sort().values


def normalise(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (x mapped to [-1, 1] between the thresholds, centre, half-range); a zero range maps to 0."""
    centre, half = (hi + lo) / 2, (hi - lo) / 2
    scaled = torch.where(half > 0, (x - centre) / torch.where(half > 0, half, 1), torch.zeros_like(x))
    return scaled, centre, half


class KVQuantLayer(ReportingLayer):
    def lazy_initialization(self, key_states, value_states):
        b, h, _, d = key_states.shape
        bits = self.owner.bits
        self.sink_k, self.sink_v = key_states.new_zeros(b, h, 0, d), value_states.new_zeros(b, h, 0, d)
        self.k_codes = key_states.new_zeros(b, h, 0, d // codes_per_byte(bits), dtype=torch.uint8)
        self.v_codes = self.k_codes
        self.k_centre = self.k_half = None  # (B, H, 1, D), calibrated on the first tokens stored quantized
        self.v_centre = self.v_half = key_states.new_zeros(b, h, 0, 1)  # (B, H, T, 1)
        self.k_levels = self.v_levels = None  # (2^bits,) float32
        empty_i, empty_v = torch.zeros(0, dtype=torch.int32, device=key_states.device), key_states.new_zeros(0)
        self.k_out = (empty_i, empty_i, empty_v)  # outliers: token index, index within the token, value
        self.v_out = (empty_i, empty_i, empty_v)
        self.is_initialized = True

    def append(self, key_states, value_states):
        to_sink = max(0, min(key_states.shape[2], self.owner.sinks - self.seen))
        past_k, past_v = self._dequantized()
        keys = torch.cat([self.sink_k, past_k, key_states[:, :, to_sink:]], dim=2)
        values = torch.cat([self.sink_v, past_v, value_states[:, :, to_sink:]], dim=2)
        if to_sink:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :to_sink]], dim=2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :to_sink]], dim=2)
        if key_states.shape[2] > to_sink:
            start = self.seen + to_sink
            positions = torch.arange(start, self.seen + key_states.shape[2], device=key_states.device)
            pre_rope = self.owner.rope.unrotate(key_states[:, :, to_sink:], positions.expand(key_states.shape[0], -1))
            self._store(pre_rope.to(key_states.dtype), value_states[:, :, to_sink:])
        return keys, values

    def _store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize new tokens (B, H, n, D): keys pre-RoPE."""
        frac, bits = self.owner.outlier_frac, self.owner.bits
        first = self.k_codes.shape[2]
        if self.k_centre is None:  # calibration on the prompt: per-channel thresholds and both codebooks
            n = keys.shape[2]
            tail = round(frac / 2 * n)
            lo = keys.kthvalue(tail + 1, dim=2, keepdim=True).values
            hi = keys.kthvalue(n - tail, dim=2, keepdim=True).values
            _, self.k_centre, self.k_half = normalise(keys, lo, hi)
        k_norm, _, _ = normalise(keys, self.k_centre - self.k_half, self.k_centre + self.k_half)
        v_norm, v_centre, v_half = normalise(values, *_value_ranges(values, frac))
        if self.k_levels is None:
            self.k_levels = fit_levels(k_norm[k_norm.abs() <= 1], bits).to(keys.device)
            self.v_levels = fit_levels(v_norm[v_norm.abs() <= 1], bits).to(keys.device)
        self.k_codes = torch.cat([self.k_codes, pack(_nearest(k_norm, self.k_levels), bits)], dim=2)
        self.v_codes = torch.cat([self.v_codes, pack(_nearest(v_norm, self.v_levels), bits)], dim=2)
        self.v_centre = torch.cat([self.v_centre, v_centre], dim=2)
        self.v_half = torch.cat([self.v_half, v_half], dim=2)
        self.k_out = _add_outliers(self.k_out, keys, k_norm.abs() > 1, first)
        self.v_out = _add_outliers(self.v_out, values, v_norm.abs() > 1, first)

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The quantized tokens as attention sees them: keys re-rotated at their positions (B, H, T, D)."""
        t = self.k_codes.shape[2]
        if t == 0:
            return self.sink_k[:, :, :0], self.sink_v[:, :, :0]
        keys = _reconstruct(self.k_codes, self.k_levels, self.k_centre, self.k_half, self.k_out, self.owner.bits)
        values = _reconstruct(self.v_codes, self.v_levels, self.v_centre, self.v_half, self.v_out, self.owner.bits)
        positions = torch.arange(self.owner.sinks, self.owner.sinks + t, device=keys.device)
        return self.owner.rope.rotate(keys, positions.expand(keys.shape[0], -1)).to(keys.dtype), values

    def resident_bytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {}
        meta = [self.v_centre, self.v_half] + [x for x in (self.k_centre, self.k_half, self.k_levels, self.v_levels)
                                               if x is not None]
        return {
            "sink": self.sink_k.nbytes + self.sink_v.nbytes,
            "quantized": self.k_codes.nbytes + self.v_codes.nbytes,
            "quant_meta": sum(x.nbytes for x in meta),
            "outliers": sum(x.nbytes for x in self.k_out + self.v_out),
        }

    def tier_counts(self) -> dict[str, int]:
        sinks = self.sink_k.shape[2] if self.is_initialized else 0
        return {"sink": sinks, "recent": 0, "full": 0, "quantized": self.seen - sinks, "evicted": 0}


def _value_ranges(values: torch.Tensor, frac: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: outliers are the frac/2 of its elements (over every head) furthest in each tail; each head's
    range is the min and max of its inliers -> lo, hi (B, H, n, 1), so that exactly the outliers fall outside."""
    b, h, n, d = values.shape
    flat = values.transpose(1, 2).reshape(b, n, h * d)  # (B, n, H*D)
    tail = round(frac / 2 * h * d)
    lo = flat.kthvalue(tail + 1, dim=2).values.view(b, 1, n, 1)
    hi = flat.kthvalue(h * d - tail, dim=2).values.view(b, 1, n, 1)
    inlier = (values >= lo) & (values <= hi)
    head_lo = torch.where(inlier, values, torch.full_like(values, float("inf"))).amin(dim=3, keepdim=True)
    head_hi = torch.where(inlier, values, torch.full_like(values, float("-inf"))).amax(dim=3, keepdim=True)
    empty = ~torch.isfinite(head_lo)  # a head whose every element is an outlier: any range will do
    return torch.where(empty, 0, head_lo), torch.where(empty, 0, head_hi)


def _nearest(normalised: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    # Levels are sorted: the nearest one is found by bucketing at the midpoints between neighbours.
    midpoints = (levels[1:] + levels[:-1]) / 2
    return torch.bucketize(normalised.float().clamp(-1, 1).contiguous(), midpoints).to(torch.uint8)


def _add_outliers(store: tuple, x: torch.Tensor, mask: torch.Tensor, first_token: int) -> tuple:
    b, h, n, d = x.shape
    bi, hi, ti, di = mask.nonzero(as_tuple=True)
    token = (ti + first_token).to(torch.int32)
    lane = ((bi * h + hi) * d + di).to(torch.int32)
    return (torch.cat([store[0], token]), torch.cat([store[1], lane]), torch.cat([store[2], x[mask]]))


def _reconstruct(codes, levels, centre, half, outliers, bits) -> torch.Tensor:
    b, h, t, p = codes.shape
    per = codes_per_byte(bits)
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    table = levels[((torch.arange(256, device=codes.device, dtype=torch.uint8)[:, None] >> shifts) & (2**bits - 1))
                   .long()]  # (256, per): the levels of every byte's codes, plane by plane
    normalised = planes_to_row(table.index_select(0, codes.reshape(-1).int()).view(b, h, t, p, per))
    out = (normalised * half.float() + centre.float()).to(half.dtype)
    token, lane, value = outliers
    if token.numel():
        d = out.shape[-1]
        out.view(b * h, t, d).index_put_((lane.long() // d, token.long(), lane.long() % d), value)
    return out


class KVQuantCache(ReportingCache):
    def __init__(self, model, config: QEvictConfig | None, max_length: int, batch_size: int = 1, bits: int = 2,
                 outlier_frac: float = 0.01, sinks: int = 1):
        if bits not in (2, 4):
            raise ValueError(f"KVQuant bits must be 2 or 4 (got {bits!r})")
        if not 0.0 <= outlier_frac < 0.5:
            raise ValueError(f"outlier_frac must lie in [0, 0.5) (got {outlier_frac!r})")
        self.method = f"kvquant{bits}"
        self.bits, self.outlier_frac, self.sinks = bits, outlier_frac, sinks
        self.rope = Rope.from_model(model)
        shape = KVShape.from_model(model, batch_size, config)
        layers = [KVQuantLayer(i, self) for i in range(shape.num_layers)]
        super().__init__(layers, model, shape, max_length, budget_bytes=None)
        self.config = config  # what it was made with (make_cache reports it per lane)
