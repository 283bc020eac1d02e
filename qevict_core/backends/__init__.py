"""Who reads the low-bit tier at a decode step: an object chosen once, when a cache is built.

``torch`` rebuilds the tier in full precision every step (``assemble``) and attends over the whole sequence;
``cpu`` (the C kernel, ``cpu_path``) and ``triton`` (``triton_path``) read the packed codes in place, so ``update``
hands attention only the full-precision keys. Code asks a backend what it can do (``reads_tier_in_place``,
``steps_heads_in_one_pass``) and lets it run the step; it never compares names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class Backend:
    name: ClassVar[str] = "torch"
    reads_tier_in_place: ClassVar[bool] = False  # update() returns [sinks | full | recent] only
    steps_heads_in_one_pass: ClassVar[bool] = False  # a per-head cache's decode step runs every head at once
    # A routing event sizes its work by what was decided (windows to quantize or dequantize: read back from the
    # device), which on the CPU costs nothing and spares work; otherwise it works to bounds the host knows, so a
    # routing step asks the device nothing (what a CUDA graph needs).
    sizes_moves_on_host: ClassVar[bool] = False
    # A decode step reads each layer's whole full-precision buffer, its fill counted on the device, so every plain
    # step runs the same operators on the same shapes (what a CUDA graph replays); the C kernel's reads the live
    # part (on the CPU, where no graph replays).
    steps_at_fixed_shape: ClassVar[bool] = False
    # A move gathers several rows' windows (a batch, the stacked layers' rows) as whole-row copies by one flat index:
    # about 8x faster on the CPU than the elementwise gather, which a GPU path keeps (one kernel; the index would
    # take three more).
    gathers_by_flat_index: ClassVar[bool] = False

    def prepare(self, cache) -> None:
        """Once, when ``cache`` is made: whatever its decode steps share (nothing by default)."""

    def decode_step(self, layer, query, key, value, scaling, scored: bool):
        """(out (B, L, Hq, D), mass (B, Hkv, N) per key or None: the step folded its mass itself) of a decode step,
        or None: the layer's PyTorch path."""
        return None

    def step_heads(self, layer, query, scaling):
        """A decode step of every KV head of a per-head layer (``qevict_head``) in one pass -> (out, keys, values);
        only a backend with ``steps_heads_in_one_pass``."""
        raise NotImplementedError(f"the {self.name} backend steps a per-head layer head by head")

    def quantize_windows(self, keys, values, omega: int, bits: int, param_dtype):
        """Windows entering the low-bit tier, keys (pre-RoPE), values (B, H, m·Ω, D) -> (k_codes, v_codes, k_scale,
        k_zero, v_scale, v_zero, unfit (B, m) bool: pairs ``param_dtype`` cannot hold), the ledger's fields; or None:
        the engine's PyTorch quantization."""
        return None


class TorchBackend(Backend):
    steps_at_fixed_shape = True


class CPUBackend(Backend):
    name = "cpu"
    reads_tier_in_place = True
    steps_heads_in_one_pass = True
    sizes_moves_on_host = True
    gathers_by_flat_index = True

    def decode_step(self, layer, query, key, value, scaling, scored):
        from . import cpu_path

        return cpu_path.attend(layer, query, key, value, scaling, scored)

    def step_heads(self, layer, query, scaling):
        from . import cpu_heads

        return cpu_heads.attend(layer, query, scaling)


class TritonBackend(Backend):
    name = "triton"
    reads_tier_in_place = True
    steps_at_fixed_shape = True

    def prepare(self, cache) -> None:
        from . import triton_path

        triton_path.prepare(cache)

    def decode_step(self, layer, query, key, value, scaling, scored):
        from . import triton_path

        out, quant, fp_keys = triton_path.attend(layer, query, key, value, scaling, scored)
        if quant is not None:  # the fused kernel gives the low-bit tier's mass per window: fold it as such
            layer.fold_windows(quant, fp_keys, query.shape[1])
        return out, None

    def quantize_windows(self, keys, values, omega, bits, param_dtype):
        """In one launch (``qevict_kernels.window_quant``), bit for bit what PyTorch's quantization gives."""
        from qevict_kernels.window_quant import quantize_windows

        return quantize_windows(keys, values, omega, bits, param_dtype)


def choose(setting: str, device: torch.device, dtype: torch.dtype) -> Backend:
    """``QEvictConfig.kernels`` -> the backend. auto: the C kernel on the CPU in float32 when a compiler builds
    it, else torch (on CUDA too: on an H200 the Triton path decoded slower than torch's, bench/gpu.md).
    triton: forced (on CPU only under TRITON_INTERPRET=1). cpu: forced (CPU, float32). torch: always. A
    forced backend that cannot run is a ValueError saying why."""
    if setting == "torch":
        return TorchBackend()
    if setting == "cpu" or (setting == "auto" and device.type == "cpu"):
        why = _cpu_kernel_unusable(device, dtype)
        if why is None:
            return CPUBackend()
        if setting == "cpu":
            raise ValueError(f"kernels='cpu' cannot run: {why} (kernels='torch' always can)")
        return TorchBackend()
    if setting == "auto":
        return TorchBackend()
    try:  # triton, forced
        import triton  # noqa: F401
    except ImportError as err:
        raise ValueError("kernels='triton' needs the triton package (pip install triton)") from err
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernels='triton' on CPU runs the Triton interpreter: set TRITON_INTERPRET=1 before "
                         "starting Python (or use kernels='torch')")
    return TritonBackend()


def _cpu_kernel_unusable(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"the model is on {device.type}, the C kernel runs on the CPU"
    if dtype != torch.float32:
        return f"the model is in {dtype}, the C kernel reads float32 scales and keys"
    from qevict_kernels import cpu_decode

    return cpu_decode.available()
