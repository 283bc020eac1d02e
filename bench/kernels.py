"""Microbenchmarks of the quantized-segment attention kernel (decode: one query per head).

    python -m bench.kernels --device cuda --keys 4096,16384,65536,131072 --batch 1,8,32 --bits 2
    python -m bench.kernels --device cpu --keys 512 --batch 1 --repeats 2   # smoke run (Triton interpreter)

For each size, three ways to attend to the same number of keys: ``kernel`` reads packed INT2/INT4 codes and
dequantizes + re-rotates in registers; ``dequant+sdpa`` dequantizes the ledger in PyTorch, re-applies RoPE, then
runs SDPA (the paper's path); ``sdpa_fp16`` is fused SDPA (FlashAttention when available) over full-precision keys.
Reported: median time, bytes each must read, and achieved bandwidth as a fraction of the device's peak (decode
attention is bandwidth-bound: INT2 codes are 1/8 of fp16's bytes, plus scales).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from .common import RESULTS, run_metadata

PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 8.64e11, "A10G": 6.0e11}  # bytes/s


def peak_bandwidth(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds per call. On CUDA, CUDA events around ``repeats`` back-to-back calls, five times: one call
    of a small case lasts about as long as a launch, which a host timer around a single call would measure."""
    fn()  # warm-up (and compilation)
    if device.startswith("cuda"):
        per_call = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            torch.cuda.synchronize()
            per_call.append(start.elapsed_time(end) / 1000 / repeats)
        return statistics.median(per_call)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def case(batch: int, keys: int, bits: int, device: str, repeats: int, hkv=8, groups=4, d=128, omega=8) -> list[dict]:
    from qevict_kernels.quant_attention import dequantized_keys_reference, quant_attention
    from qevict_core.engine.ledger import WindowLedger

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    windows = keys // omega
    k = torch.randn(batch, hkv, windows * omega, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    ids = torch.arange(windows, device=device, dtype=torch.int32).expand(batch, -1).contiguous()
    ledger = WindowLedger.quantize(k, v, ids, omega, bits)
    query = torch.randn(batch, hkv * groups, 1, d, device=device, dtype=dtype)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, device=device).float() / d))
    scale = d ** -0.5
    ledger_bytes = sum(ledger.nbytes_by_component().values())
    fp_bytes = k.nbytes + v.nbytes

    def dequant_sdpa():
        keys_, values_ = dequantized_keys_reference(ledger, 5, inv_freq, 1.0, dtype)
        return torch.nn.functional.scaled_dot_product_attention(query, keys_, values_, scale=scale, enable_gqa=True)

    runs = {
        "kernel": (lambda: quant_attention(query, ledger, 5, inv_freq, 1.0, scale), ledger_bytes),
        "dequant+sdpa": (dequant_sdpa, ledger_bytes + 2 * fp_bytes),
        "sdpa_fp": (lambda: torch.nn.functional.scaled_dot_product_attention(query, k, v, scale=scale,
                                                                             enable_gqa=True), fp_bytes),
    }
    peak = peak_bandwidth(device)
    rows = []
    for name, (fn, nbytes) in runs.items():
        seconds = timed(fn, device, repeats)
        rows.append({"impl": name, "batch": batch, "keys": keys, "bits": bits, "seconds": seconds, "bytes": nbytes,
                     "bandwidth": nbytes / seconds, "peak_fraction": nbytes / seconds / peak if peak else None})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--keys", default="4096,16384,65536,131072")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(RESULTS / "kernels"))
    args = parser.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on CPU the kernel runs in Triton's interpreter: set TRITON_INTERPRET=1")
    meta = run_metadata("synthetic (8 KV heads x 4, head_dim 128)", args.device)
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        for keys in [int(k) for k in args.keys.split(",")]:
            try:
                found = case(batch, keys, args.bits, args.device, args.repeats)
            except torch.cuda.OutOfMemoryError:
                print(f"skip batch {batch} keys {keys}: out of memory")
                continue
            for row in found:
                rows.append({**row, **meta})
                frac = f"{row['peak_fraction']:.0%} of peak" if row["peak_fraction"] else ""
                print(f"b={batch:3d} keys={keys:7d} {row['impl']:13s} {1e6 * row['seconds']:9.1f} us "
                      f"{row['bandwidth'] / 1e9:8.1f} GB/s {frac}", flush=True)
            out = Path(args.out)  # after each size: a run cut short keeps what it measured
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"kernels-{args.device.split(':')[0]}-int{args.bits}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
