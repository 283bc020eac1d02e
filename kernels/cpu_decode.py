"""Decode attention over the packed low-bit tier on the CPU, in C, with the codes read in place.

The PyTorch path rebuilds the whole quantized tier in full precision before every decode step (unpack, rescale,
re-rotate: a profile put ~150 ms of a 4K-token SmolLM2 step there, on one thread). ``quant_decode.c`` does the
same arithmetic one key at a time inside the dot products, so the tier is read once and nothing is materialised.
It is compiled on first use (about a second) with the system C compiler (``$CC``, else ``cc``) into a cache keyed by
the source, the flags and the CPU's features (``$QEVICT_CACHE_DIR/kernels``, else ``~/.cache/qevict/kernels``);
:func:`available` says whether that worked and, if not, why.
Work is split over KV heads across ``torch.get_num_threads()`` threads (ctypes releases the GIL).

``quant_logits_reference`` and ``quant_values_reference`` are the same math in PyTorch, in a chosen dtype.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu") / "quant_decode.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class KernelUnavailable(RuntimeError):
    """No C compiler, or the source did not build: the message says which and how to fix it."""


def _cache_dir() -> Path:
    """Where the converted model also lives (qevict_core/models.py): $QEVICT_CACHE_DIR, else the XDG cache."""
    base = os.environ.get("QEVICT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qevict")
    return Path(base) / "kernels"


def _machine_key() -> str:
    """-march=native code only runs where it was built: key the library by the CPU's feature flags."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "")
    except OSError:
        flags = ""
    return platform.machine() + flags


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise KernelUnavailable("no C compiler found (set $CC or install gcc); kernels='torch' needs none")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode() + _machine_key().encode()).hexdigest()[:16]
    target = _cache_dir() / f"quant_decode-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True,
                                    text=True)
            if result.returncode != 0:
                raise KernelUnavailable(f"{compiler} could not build {SOURCE.name}: {result.stderr.strip()[:500]}")
            os.replace(built, target)  # atomic: a concurrent process sees either no library or a whole one
    lib = ctypes.CDLL(str(target))
    lib.quant_logits.argtypes = [_PTR] * 8 + [_I64] * 9 + [ctypes.c_float]
    lib.quant_values.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR] + [_I64] * 6
    lib.quant_logits.restype = lib.quant_values.restype = ctypes.c_int
    return lib


@lru_cache(maxsize=1)
def available() -> str | None:
    """None when the kernel is built and loaded, else why not (remembered: a failed build is not retried for every
    cache the process makes)."""
    try:
        _library()
    except (KernelUnavailable, OSError) as err:
        return str(err)
    return None


def _forget() -> None:
    """Forget the loaded library and any failure, as a new process would (for tests)."""
    available.cache_clear()
    _library.cache_clear()


@lru_cache(maxsize=4)
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qevict-cpu")


def _over_heads(call, heads: int) -> None:
    """call(h0, h1) over [0, heads), split across torch's thread count; a nonzero return is a bad shape."""
    workers = min(torch.get_num_threads(), heads)
    if workers <= 1:
        codes = [call(0, heads)]
    else:
        bounds = [heads * i // workers for i in range(workers + 1)]
        codes = list(_pool(workers).map(call, bounds[:-1], bounds[1:]))
    if any(codes):  # the C side re-checks what _shape checked: reaching this is a bug, not bad input
        raise RuntimeError("quant_decode.c refused shapes that the Python checks accepted")


def _shape(d: int, bits: int, n: int = 0, omega: int = 1) -> None:
    if bits not in (2, 4):
        raise ValueError(f"bits must be one of (2, 4) for the CPU kernel (got {bits})")
    if d <= 0 or d % 2 or d > 512:
        raise ValueError(f"head_dim must be even and at most 512 for the CPU kernel (got {d})")
    if omega < 1 or n % omega:
        raise ValueError(f"the tier must hold whole windows: {n} tokens is not a multiple of Ω = {omega}")


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tensor.device.type != "cpu" or tensor.dtype != dtype:
        raise ValueError(f"{name} must be a CPU {dtype} tensor (got {tensor.dtype} on {tensor.device})")
    return tensor.contiguous()


def quant_logits(rows: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                 ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sinks: int, omega: int, bits: int,
                 scaling: float) -> torch.Tensor:
    """rows (B, H, R, D) float32 post-RoPE queries of each KV head's group; k_codes (B, H, N, D·bits/8) uint8
    pre-RoPE keys, window-major; k_scale, k_zero (B, H, N/Ω, D); ids (B, N/Ω) window ids; cos, sin (T, D)
    rows by absolute position (window w's token j sits at sinks + w·Ω + j). -> logits (B, H, R, N) float32."""
    b, h, r, d = rows.shape
    n = k_codes.shape[2]
    _shape(d, bits, n, omega)
    tensors = [_check("rows", rows, torch.float32), _check("k_codes", k_codes, torch.uint8),
               _check("k_scale", k_scale, torch.float32), _check("k_zero", k_zero, torch.float32),
               _check("ids", ids, torch.int32), _check("cos", cos, torch.float32), _check("sin", sin, torch.float32)]
    out = rows.new_empty(b, h, r, n)
    ptrs = [t.data_ptr() for t in tensors] + [out.data_ptr()]
    lib = _library()
    _over_heads(lambda h0, h1: lib.quant_logits(*ptrs, h, h0, h1, r, n, d, bits, omega, sinks, scaling), b * h)
    return out


def quant_values(probs: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                 bits: int) -> torch.Tensor:
    """probs (B, H, R, S) float32 whose first N columns weigh the quantized values; v_codes (B, H, N, D·bits/8);
    v_scale, v_zero (B, H, N, 1). -> (B, H, R, D) float32: probs[..., :N] @ dequantized values."""
    b, h, r, stride = probs.shape
    _shape(2, bits)
    n, d = v_codes.shape[2], v_codes.shape[3] * 8 // bits
    _shape(d, bits)
    tensors = [_check("probs", probs, torch.float32), _check("v_codes", v_codes, torch.uint8),
               _check("v_scale", v_scale, torch.float32), _check("v_zero", v_zero, torch.float32)]
    out = probs.new_empty(b, h, r, d)
    p, codes, scale, zero = (t.data_ptr() for t in tensors)
    lib = _library()
    _over_heads(lambda h0, h1: lib.quant_values(p, stride, codes, scale, zero, out.data_ptr(), h0, h1, r, n, d,
                                                bits), b * h)
    return out


def _dequantize(codes: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    unpacked = ((codes.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)
    return unpacked.to(scale.dtype) * scale + zero


def quant_logits_reference(rows, k_codes, k_scale, k_zero, ids, cos, sin, sinks, omega, bits, scaling,
                           dtype=torch.float32):
    """:func:`quant_logits` in PyTorch, computed in ``dtype``."""
    b, h, n, p = k_codes.shape
    by_window = k_codes.reshape(b, h, n // omega, omega, p)  # (B, H, W, Ω, P)
    keys = _dequantize(by_window, bits, k_scale.to(dtype).unsqueeze(3), k_zero.to(dtype).unsqueeze(3))
    keys = keys.reshape(b, h, n, -1)  # (B, H, N, D)
    positions = (sinks + ids.long().unsqueeze(-1) * omega + torch.arange(omega)).flatten(1)  # (B, N)
    c, s = cos.to(dtype)[positions].unsqueeze(1), sin.to(dtype)[positions].unsqueeze(1)
    half = keys.shape[-1] // 2
    rotated = keys * c + torch.cat([-keys[..., half:], keys[..., :half]], dim=-1) * s
    return (rows.to(dtype) @ rotated.transpose(2, 3) * scaling).float()


def quant_values_reference(probs, v_codes, v_scale, v_zero, bits, dtype=torch.float32):
    """:func:`quant_values` in PyTorch, computed in ``dtype``."""
    values = _dequantize(v_codes, bits, v_scale.to(dtype), v_zero.to(dtype))
    return (probs[..., :v_codes.shape[2]].to(dtype) @ values).float()
