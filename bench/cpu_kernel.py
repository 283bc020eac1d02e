"""Microbenchmark of the C decode kernel (``qevict_kernels.cpu_decode``) by the dtype of the stored scales and zero-points.

    python -m bench.cpu_kernel --windows 342 --heads 3 --rows 3 --bits 4 --threads 1

One random low-bit tier of ``--windows`` windows per KV head (Ω = 8, head_dim 64 by default), its pairs stored in
float32, float16 and bfloat16 (the same values, widened exactly by the kernel): the median time of ``quant_logits``
and ``quant_values`` for each, in the same process, and each as a ratio to float32. The defaults are SmolLM2's
shapes at 4K/20% with float16 pairs (342 INT4 windows per layer, 3 KV heads, a GQA group of 3 query rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qevict_kernels import cpu_decode

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tier(windows: int, heads: int, rows: int, dim: int, omega: int, bits: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = windows * omega
    codes = lambda: torch.randint(0, 256, (1, heads, n, dim * bits // 8), dtype=torch.uint8, generator=g)  # noqa: E731
    angle = torch.arange(8 + windows * omega * 2)[:, None].float() / 10000 ** (torch.arange(0, dim, 2) / dim)
    angle = torch.cat([angle, angle], dim=-1)
    keys = dict(rows=torch.randn(1, heads, rows, dim, generator=g), k_codes=codes(),
                k_scale=torch.rand(1, heads, windows, dim, generator=g) / 4,
                k_zero=torch.randn(1, heads, windows, dim, generator=g),
                ids=torch.randperm(windows * 2, generator=g)[:windows].int()[None], cos=angle.cos(), sin=angle.sin(),
                sinks=5, omega=omega, bits=bits, scaling=dim ** -0.5)
    values = (codes(), torch.rand(1, heads, n, 1, generator=g) / 4, torch.randn(1, heads, n, 1, generator=g))
    return keys, values


def median_us(fn, repeats: int, calls: int) -> float:
    fn()  # warm-up (and the kernel's first build)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times) * 1e6


def measure(windows: int, heads: int, rows: int, dim: int, omega: int, bits: int, repeats: int,
            calls: int) -> dict[str, tuple[float, float]]:
    """-> {dtype name: (quant_logits µs, quant_values µs)}, medians, all in this process."""
    keys, (v_codes, v_scale, v_zero) = tier(windows, heads, rows, dim, omega, bits)
    probs = torch.softmax(cpu_decode.quant_logits(**keys), dim=-1)
    result = {}
    for dtype in DTYPES:
        narrow = {**keys, "k_scale": keys["k_scale"].to(dtype), "k_zero": keys["k_zero"].to(dtype)}
        scale, zero = v_scale.to(dtype), v_zero.to(dtype)
        result[str(dtype).removeprefix("torch.")] = (
            median_us(lambda: cpu_decode.quant_logits(**narrow), repeats, calls),
            median_us(lambda: cpu_decode.quant_values(probs, v_codes, scale, zero, bits), repeats, calls))
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_kernel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=342)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--omega", type=int, default=8)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed repeat")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; pin it on shared machines")
    args = parser.parse_args(argv)
    if cpu_decode.available() is not None:
        raise SystemExit(f"the C kernel is unavailable: {cpu_decode.available()}")
    torch.set_num_threads(args.threads)
    result = measure(args.windows, args.heads, args.rows, args.dim, args.omega, args.bits, args.repeats, args.calls)
    base_logits, base_values = result["float32"]
    print(f"{args.windows} windows x {args.heads} KV heads, {args.rows} rows, head_dim {args.dim}, Ω = {args.omega}, "
          f"INT{args.bits}, {args.threads} thread(s); medians of {args.repeats} x {args.calls} calls")
    for name, (logits, values) in result.items():
        print(f"{name:9s} quant_logits {logits:7.1f} us ({logits / base_logits:.2f}x)  "
              f"quant_values {values:7.1f} us ({values / base_values:.2f}x)")


if __name__ == "__main__":
    main()
