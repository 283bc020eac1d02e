"""Decode attention over the packed low-bit tier on the CPU, in C, with the codes read in place.

The PyTorch path rebuilds the whole quantized tier in full precision before every decode step (unpack, rescale,
re-rotate: most of a long-context step, by profile). ``quant_decode.c`` does the same arithmetic one key at a time
inside the dot products, so the tier is read once and nothing is materialised.
It is compiled on first use (about a second) with the system C compiler (``$CC``, else ``cc``) into a cache keyed by
the source, the flags and the CPU's features (``$QEVICT_CACHE_DIR/kernels``, else ``~/.cache/qevict/kernels``);
:func:`available` says whether that worked and, if not, why.
Work is split over KV heads across ``torch.get_num_threads()`` threads (ctypes releases the GIL) when it is large
enough to pay for the hand-off (``PARALLEL_WORK``).

The ``*_varlen`` entries take the heads of one layer whose tiers differ in length, packed head after head in one
tensor per field with each head's length (``qevict_head``): one call per layer, padded columns at -inf.

``fold_varlen`` adds such a layer's decode-step window masses to its heads' score tables (Eq. 1), the last of its
per-step work that was many small PyTorch operations. ``quant_logits_reference`` and ``quant_values_reference``
(and their ``_varlen`` forms, and ``fold_varlen_reference``) are the same math in PyTorch, in a chosen dtype.
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
MAX_OMEGA = 256  # quant_decode.c's MAX_OMEGA: the longest window fold_varlen sums on the stack


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
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return platform.machine() + next((line for line in lines if line.startswith("flags")), "")


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    return build(FLAGS)


def build(flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernel compiled with ``flags`` (cached by source, flags and CPU), loaded. Tests build variants with it,
    such as ``-DQEVICT_BITWISE_HALF`` (the float16 widening of compilers without ``_Float16``)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise KernelUnavailable("no C compiler found (set $CC or install gcc); kernels='torch' needs none")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(flags).encode() + _machine_key().encode()).hexdigest()[:16]
    target = _cache_dir() / f"quant_decode-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], capture_output=True,
                                    text=True)
            if result.returncode != 0:
                raise KernelUnavailable(f"{compiler} could not build {SOURCE.name}: {result.stderr.strip()[:500]}")
            os.replace(built, target)  # atomic: a concurrent process sees either no library or a whole one
    lib = ctypes.CDLL(str(target))
    lib.quant_logits.argtypes = [_PTR] * 4 + [_I64] + [_PTR] * 4 + [_I64] * 9 + [ctypes.c_float]
    lib.quant_values.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR] + [_I64] * 6
    lib.quant_logits_varlen.argtypes = [_PTR] * 4 + [_I64] + [_PTR] * 5 + [_I64] * 8 + [ctypes.c_float]
    lib.quant_values_varlen.argtypes = [_PTR, _I64] + [_PTR] * 3 + [_I64] + [_PTR] * 2 + [_I64] * 5
    lib.fold_varlen.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR] + [_I64] * 5
    for fn in (lib.quant_logits, lib.quant_values, lib.quant_logits_varlen, lib.quant_values_varlen, lib.fold_varlen):
        fn.restype = ctypes.c_int
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


# Multiply-adds a worker must get for a thread's hand-off to pay (2 cores, quant_logits, d 64, 3 rows per head):
# 3 heads x 1,440 keys took 80 us on the calling thread, 139 us over 2; 24 heads x 1,440 keys 527 against 366 us.
PARALLEL_WORK = 2_000_000


def _over_heads(call, heads: int, work: int, refused: str | None = None) -> None:
    """call(h0, h1) over [0, heads), split across torch's threads when the ``work`` (multiply-adds) pays for it and
    every worker gets two heads; a nonzero return is a bad shape, or (``refused`` says what) bad input that only
    the C side checks."""
    workers = min(torch.get_num_threads(), heads // 2, work // PARALLEL_WORK)
    if workers <= 1:
        codes = [call(0, heads)]
    else:
        bounds = [heads * i // workers for i in range(workers + 1)]
        codes = list(_pool(workers).map(call, bounds[:-1], bounds[1:]))
    if any(codes) and refused:
        raise ValueError(refused)
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


# The C side's code for each dtype scales and zero-points may be stored in.
PARAM_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _pair(prefix: str, scale: torch.Tensor, zero: torch.Tensor,
          dtype: torch.dtype | None = None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A scale and a zero-point stored in one dtype (``dtype``, default the scale's) -> (the C side's code for it,
    the checked pair)."""
    dtype = dtype or scale.dtype
    if dtype not in PARAM_KINDS:
        raise ValueError(f"scales and zero-points must be one of {tuple(PARAM_KINDS)} (got {dtype})")
    return PARAM_KINDS[dtype], _check(f"{prefix}_scale", scale, dtype), _check(f"{prefix}_zero", zero, dtype)


def quant_logits(rows: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                 ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sinks: int, omega: int, bits: int,
                 scaling: float) -> torch.Tensor:
    """rows (B, H, R, D) float32 post-RoPE queries of each KV head's group; k_codes (B, H, N, D·bits/8) uint8
    pre-RoPE keys, window-major; k_scale, k_zero (B, H, N/Ω, D); ids (B, N/Ω) window ids; cos, sin (T, D)
    rows by absolute position (window w's token j sits at sinks + w·Ω + j). -> logits (B, H, R, N) float32."""
    b, h, r, d = rows.shape
    n = k_codes.shape[2]
    _shape(d, bits, n, omega)
    kind, *params = _pair("k", k_scale, k_zero)
    tensors = [_check("rows", rows, torch.float32), _check("k_codes", k_codes, torch.uint8),
               _check("ids", ids, torch.int32), _check("cos", cos, torch.float32), _check("sin", sin, torch.float32)]
    out = rows.new_empty(b, h, r, n)
    ptrs = [t.data_ptr() for t in tensors[:2] + params] + [kind] + [t.data_ptr() for t in tensors[2:]]
    lib = _library()
    _over_heads(lambda h0, h1: lib.quant_logits(*ptrs, out.data_ptr(), h, h0, h1, r, n, d, bits, omega, sinks,
                                                scaling), b * h, b * h * r * n * d)
    return out


def quant_values(probs: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                 bits: int) -> torch.Tensor:
    """probs (B, H, R, S) float32 whose first N columns weigh the quantized values; v_codes (B, H, N, D·bits/8);
    v_scale, v_zero (B, H, N, 1). -> (B, H, R, D) float32: probs[..., :N] @ dequantized values."""
    b, h, r, stride = probs.shape
    _shape(2, bits)
    n, d = v_codes.shape[2], v_codes.shape[3] * 8 // bits
    _shape(d, bits)
    kind, v_scale, v_zero = _pair("v", v_scale, v_zero)
    tensors = [_check("probs", probs, torch.float32), _check("v_codes", v_codes, torch.uint8), v_scale, v_zero]
    out = probs.new_empty(b, h, r, d)
    p, codes, scale, zero = (t.data_ptr() for t in tensors)
    lib = _library()
    _over_heads(lambda h0, h1: lib.quant_values(p, stride, codes, scale, zero, kind, out.data_ptr(), h0, h1, r, n,
                                                d, bits), b * h, b * h * r * n * d)
    return out


def _packed(name: str, tensor: torch.Tensor, dtype: torch.dtype, elements: int) -> torch.Tensor:
    """One field of every head's tier, packed head after head: ``elements`` of ``dtype``, contiguous."""
    tensor = _check(name, tensor, dtype)
    if tensor.numel() != elements:
        raise ValueError(f"{name} must hold {elements} elements for the heads' lengths (got {tensor.numel()})")
    return tensor


def _offsets(lengths: list[int], heads: int, omega: int) -> tuple[list[int], int]:
    """Each head's first key in the packed tiers, and their total; lengths are whole windows, >= 0."""
    if len(lengths) != heads:
        raise ValueError(f"one length per head: {heads} heads, {len(lengths)} lengths")
    starts, total = [], 0
    for head, n in enumerate(lengths):
        if n < 0 or n % omega:
            raise ValueError(f"head {head}'s tier must hold whole windows of Ω = {omega} keys (got {n})")
        starts.append(total)
        total += n
    return starts, total


def _pointers(tensor: torch.Tensor, starts: list[int], per_start: int):
    """Head h's part of a packed field: its first element at ``starts[h] * per_start`` elements in."""
    base, size = tensor.data_ptr(), tensor.element_size() * per_start
    return (ctypes.c_void_p * len(starts))(*(base + start * size for start in starts))


def quant_logits_varlen(rows: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                        ids: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor, sinks: int,
                        omega: int, bits: int, scaling: float, width: int | None = None) -> torch.Tensor:
    """:func:`quant_logits` for the KV heads of one layer whose tiers differ in length (qevict_head).

    rows (H, R, D) float32, head h's query rows; the heads' tiers packed head after head along the key axis, each
    as :func:`quant_logits`' with B = H = 1: k_codes (N, D·bits/8) uint8, k_scale, k_zero (N/Ω, D), ids (N/Ω,) int32,
    any shapes holding those elements contiguously; lengths[h] = n_h, head h's keys (whole windows, may be 0,
    summing to N). -> (H, R, width) float32, width >= max n_h (default max n_h): head h's logits in columns
    [0, n_h) and -inf after them, so that one softmax over padded rows weighs each head's own keys only. The fields
    are checked once per call, not once per head (a layer's call used to check 4·H tensors)."""
    h, r, d = rows.shape
    _shape(d, bits, 0, omega)
    starts, total = _offsets(lengths, h, omega)
    width = max(lengths, default=0) if width is None else width
    if width < max(lengths, default=0):
        raise ValueError(f"width must be at least the longest tier, {max(lengths)} keys (got {width})")
    packed, windows = d * bits // 8, [s // omega for s in starts]
    codes = _packed("k_codes", k_codes, torch.uint8, total * packed)
    kind, scale, zero = _pair("k", k_scale, k_zero)
    scale, zero = (_packed(f"k_{name}", t, t.dtype, total // omega * d) for name, t in (("scale", scale),
                                                                                        ("zero", zero)))
    ids = _packed("ids", ids, torch.int32, total // omega)
    rows, cos, sin = _check("rows", rows, torch.float32), _check("cos", cos, torch.float32), \
        _check("sin", sin, torch.float32)
    out = rows.new_empty(h, r, width)
    n = (ctypes.c_int64 * h)(*lengths)
    pointers = (_pointers(codes, starts, packed), _pointers(scale, windows, d), _pointers(zero, windows, d))
    id_pointers = _pointers(ids, windows, 1)
    lib = _library()
    _over_heads(lambda h0, h1: lib.quant_logits_varlen(rows.data_ptr(), *pointers, kind, id_pointers, n,
                                                       cos.data_ptr(), sin.data_ptr(), out.data_ptr(), width, h0, h1,
                                                       r, d, bits, omega, sinks, scaling), h, r * total * d)
    return out


def quant_values_varlen(probs: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                        lengths: list[int], bits: int) -> torch.Tensor:
    """:func:`quant_values` for heads of different lengths: probs (H, R, S) float32 whose first n_h columns of head
    h weigh its values; the heads' values packed head after head: v_codes (..., N, D·bits/8) uint8, v_scale, v_zero
    (N,) (any shapes holding those elements); lengths[h] = n_h (summing to N, each at most S).
    -> (H, R, D) float32: each head's probs[:, :n_h] @ its dequantized values."""
    h, r, stride = probs.shape
    starts, total = _offsets(lengths, h, 1)  # values are per token: any length
    if max(lengths, default=0) > stride:
        raise ValueError(f"a head's {max(lengths)} values need as many probability columns (got {stride})")
    d = v_codes.shape[-1] * 8 // bits
    _shape(d, bits)
    if not total:
        return probs.new_zeros(h, r, d)
    packed = d * bits // 8
    codes = _packed("v_codes", v_codes, torch.uint8, total * packed)
    kind, scale, zero = _pair("v", v_scale, v_zero)
    scale, zero = (_packed(f"v_{name}", t, t.dtype, total) for name, t in (("scale", scale), ("zero", zero)))
    probs = _check("probs", probs, torch.float32)
    out = probs.new_empty(h, r, d)
    n = (ctypes.c_int64 * h)(*lengths)
    pointers = (_pointers(codes, starts, packed), _pointers(scale, starts, 1), _pointers(zero, starts, 1))
    lib = _library()
    _over_heads(lambda h0, h1: lib.quant_values_varlen(probs.data_ptr(), stride, *pointers, kind, n,
                                                       out.data_ptr(), h0, h1, r, d, bits), h, r * total * d)
    return out


def fold_varlen(probs: torch.Tensor, table: torch.Tensor, q_ids: list[torch.Tensor], f_ids: list[torch.Tensor],
                width_q: int, sinks: int, first_recent: int, recent: int, omega: int) -> None:
    """Eq. 1's fold of one decode step for the KV heads of one layer (qevict_head), in place, in the layout its
    decode step gives the probabilities: probs (H, R, stride) float32, head h's quantized windows (ids q_ids[h]) in
    columns [0, Ω·len(q_ids[h])), its ``sinks`` keys from column ``width_q`` (no window), then its full windows
    (ids f_ids[h]) and the ``recent`` keys of windows first_recent, first_recent + 1, ... (the last may be
    partial); anything after them is padding and not read. table (H, W) float32: each window's mass, averaged
    over the R rows (a KV head's query heads), is added to table[h, id]. Window ids are int32, distinct within a
    head, and < W."""
    h, r, stride = probs.shape
    if not 1 <= omega <= MAX_OMEGA:
        raise ValueError(f"fold_varlen: Ω must lie in [1, {MAX_OMEGA}] (got {omega})")
    if len(q_ids) != h or len(f_ids) != h or table.shape[0] != h or table.dim() != 2:
        raise ValueError(f"one table row and one pair of id lists per head: probs has {h} heads, table "
                         f"{tuple(table.shape)}, {len(q_ids)} and {len(f_ids)} id lists")
    probs = _check("probs", probs, torch.float32)
    if table.device.type != "cpu" or table.dtype != torch.float32 or not table.is_contiguous():
        raise ValueError(f"table must be a contiguous CPU float32 tensor, added to in place (got {table.dtype} "
                         f"on {table.device})")
    q_ids = [_check("q_ids", ids, torch.int32) for ids in q_ids]
    f_ids = [_check("f_ids", ids, torch.int32) for ids in f_ids]
    n_q = (ctypes.c_int64 * h)(*(ids.numel() * omega for ids in q_ids))
    n_f = (ctypes.c_int64 * h)(*(ids.numel() for ids in f_ids))
    q_ptrs = (ctypes.c_void_p * h)(*(ids.data_ptr() for ids in q_ids))
    f_ptrs = (ctypes.c_void_p * h)(*(ids.data_ptr() for ids in f_ids))
    lib = _library()
    _over_heads(lambda h0, h1: lib.fold_varlen(probs.data_ptr(), stride, r, n_q, q_ptrs, width_q, sinks, n_f, f_ptrs,
                                               first_recent, recent, table.data_ptr(), table.shape[1], omega, h,
                                               h0, h1), h, h * r * stride,
                refused=f"fold_varlen: the tiers need more than the {stride} probability columns, or a window id is "
                        f"outside [0, {table.shape[1]}) (the table's windows)")


def _dequantize(codes: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    unpacked = ((codes.unsqueeze(-2) >> shifts[:, None]) & ((1 << bits) - 1)).flatten(-2)  # plane by plane
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


def _split(tensor: torch.Tensor, lengths: list[int], per_key: int) -> list[torch.Tensor]:
    return list(tensor.reshape(-1).split([n * per_key for n in lengths]))


def quant_logits_varlen_reference(rows, k_codes, k_scale, k_zero, ids, lengths, cos, sin, sinks, omega, bits,
                                  scaling, width=None, dtype=torch.float32):
    """:func:`quant_logits_varlen` in PyTorch, one head at a time, computed in ``dtype``."""
    d = rows.shape[-1]
    windows = [n // omega for n in lengths]
    parts = []
    for head, (n, codes, scale, zero, head_ids) in enumerate(zip(
            lengths, _split(k_codes, lengths, d * bits // 8), _split(k_scale, windows, d),
            _split(k_zero, windows, d), _split(ids, windows, 1))):
        parts.append(quant_logits_reference(rows[head][None, None], codes.reshape(1, 1, n, d * bits // 8),
                                            scale.reshape(1, 1, -1, d), zero.reshape(1, 1, -1, d),
                                            head_ids.reshape(1, -1), cos, sin, sinks, omega, bits, scaling,
                                            dtype)[0, 0] if n else rows.new_zeros(rows.shape[1], 0, dtype=dtype))
    width = max((p.shape[-1] for p in parts), default=0) if width is None else width
    return torch.stack([torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=float("-inf")) for p in parts])


def quant_values_varlen_reference(probs, v_codes, v_scale, v_zero, lengths, bits, dtype=torch.float32):
    """:func:`quant_values_varlen` in PyTorch, one head at a time, computed in ``dtype``."""
    d = v_codes.shape[-1] * 8 // bits
    return torch.stack([quant_values_reference(probs[head][None, None], codes.reshape(1, 1, n, d * bits // 8),
                                               scale.reshape(1, 1, n, 1), zero.reshape(1, 1, n, 1), bits,
                                               dtype)[0, 0]
                        for head, (n, codes, scale, zero) in enumerate(zip(
                            lengths, _split(v_codes, lengths, d * bits // 8), _split(v_scale, lengths, 1),
                            _split(v_zero, lengths, 1)))])


def fold_varlen_reference(probs, table, q_ids, f_ids, width_q, sinks, first_recent, recent, omega,
                          dtype=torch.float32):
    """:func:`fold_varlen` in PyTorch, one head at a time, computed in ``dtype``: the updated table (a copy)."""
    out, rows = table.to(dtype).clone(), probs.shape[1]
    mass = probs.to(dtype).sum(dim=1)  # (H, stride): each key's mass over the head's rows
    for h, (qi, fi) in enumerate(zip(q_ids, f_ids)):
        n_q, fp = qi.numel() * omega, width_q + sinks
        recent_windows = torch.arange(first_recent, first_recent + -(-recent // omega))
        keys = torch.cat([mass[h, :n_q], mass[h, fp:fp + fi.numel() * omega + recent]])
        keys = torch.nn.functional.pad(keys, (0, -keys.numel() % omega))
        ids = torch.cat([qi.long().flatten(), fi.long().flatten(), recent_windows])
        out[h].index_add_(0, ids, keys.view(-1, omega).sum(dim=1) / rows)
    return out
