"""One layer's decode attention over T cached tokens, four ways, and the device's copy bandwidth as the ceiling.

    python -m bench.kernels --device cuda --keys 8192,32768 --batch 1,8 --bits 4
    TRITON_INTERPRET=1 python -m bench.kernels --device cpu --keys 512 --batch 1 --repeats 1   # smoke run

For a layer of 8 KV heads × 4 query heads, head_dim 128 (an 8B shape), one query per head:

- ``fused``: QEvict's path: the T tokens in the low-bit tier, read once by ``qevict_kernels.lowbit_attention``,
  plus 64 full-precision tokens (sinks and recent) through SDPA, merged by log-sum-exp with every window's mass;
- ``old_kernel``: the first Triton kernel over the same tier (``bench/old_kernel.py``), attention only;
- ``dequant+sdpa``: the tier dequantized and re-rotated in PyTorch, then SDPA;
- ``sdpa_bf16``: SDPA (on CUDA its flash backend) over T bfloat16 tokens: FullKV's attention.

On CUDA every way is captured in a CUDA graph and replayed, timed with CUDA events over back-to-back replays
(a decode step replays a graph; a host timer around one launch would time the launch). ``copy`` is a
device-to-device copy of 1 GiB, the bandwidth any of them can reach. Each row: median seconds, the bytes it must
read, GB/s and the fraction of the copy's bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .common import RESULTS, run_metadata

HKV, GROUPS, HEAD_DIM, OMEGA, FP_TOKENS = 8, 4, 128, 8, 64


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds per call: on CUDA a graph of ``fn`` replayed ``repeats`` times back to back, five times."""
    fn()  # warm-up (and compilation)
    if not device.startswith("cuda"):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # graphs are captured on a side stream, after a warm-up there
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    per_call = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        per_call.append(start.elapsed_time(end) / 1000 / repeats)
    return statistics.median(per_call)


def copy_bandwidth(device: str, repeats: int) -> float | None:
    """Bytes per second a device-to-device copy moves (read + write), the ceiling of a bandwidth-bound kernel."""
    if not device.startswith("cuda"):
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats)
    return 2 * src.nbytes / seconds


def case(batch: int, keys: int, bits: int, device: str, repeats: int) -> list[dict]:
    from qevict_core.engine.ledger import WindowLedger
    from qevict_kernels.lowbit_attention import dequantized_keys_reference, lowbit_attention, merge
    from qevict_kernels.merge import fp_attention_with_lse

    from .old_kernel import quant_attention

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    windows, d = keys // OMEGA, HEAD_DIM
    k = torch.randn(batch, HKV, windows * OMEGA, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    ids = torch.arange(windows, device=device, dtype=torch.int32).expand(batch, -1).contiguous()
    ledger = WindowLedger.quantize(k, v, ids, OMEGA, bits, torch.float16)
    count = torch.full((batch,), windows, dtype=torch.int32, device=device)
    query = torch.randn(batch, HKV * GROUPS, 1, d, device=device, dtype=dtype)
    rows = query.reshape(batch, HKV, GROUPS, d)  # (B, Hkv, G, D): one decode query per head
    fp_k = torch.randn(batch, HKV, FP_TOKENS, d, device=device, dtype=dtype)
    fp_v = torch.randn_like(fp_k)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, device=device).float() / d))
    scale = d ** -0.5
    ledger_bytes = sum(ledger.nbytes_by_component().values())

    def fused():
        parts = lowbit_attention(rows, ledger, count, 5, inv_freq, 1.0, scale)
        fp_out, fp_lse = fp_attention_with_lse(query, fp_k, fp_v, scale, causal_tail=False)
        return merge(*parts[:2], fp_out.reshape(rows.shape), fp_lse.reshape(rows.shape[:3]), parts[2], ids, count)

    def dequant_sdpa():
        keys_, values_ = dequantized_keys_reference(ledger, 5, inv_freq, 1.0, dtype)
        return torch.nn.functional.scaled_dot_product_attention(query, keys_, values_, scale=scale, enable_gqa=True)

    runs = {
        "fused": (fused, ledger_bytes + fp_k.nbytes + fp_v.nbytes),
        "old_kernel": (lambda: quant_attention(query, ledger, 5, inv_freq, 1.0, scale), ledger_bytes),
        "dequant+sdpa": (dequant_sdpa, ledger_bytes + k.nbytes + v.nbytes),
        "sdpa_bf16": (lambda: torch.nn.functional.scaled_dot_product_attention(query, k, v, scale=scale,
                                                                               enable_gqa=True), k.nbytes + v.nbytes),
    }
    rows_out = []
    for name, (fn, nbytes) in runs.items():
        seconds = timed(fn, device, repeats)
        rows_out.append({"impl": name, "batch": batch, "keys": keys, "bits": bits, "seconds": seconds,
                         "bytes": nbytes, "bandwidth": nbytes / seconds})
    return rows_out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--keys", default="8192,32768")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(RESULTS / "kernels"))
    args = parser.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on a CPU the kernels run in Triton's interpreter: set TRITON_INTERPRET=1")
    meta = run_metadata("synthetic layer (8 KV heads x 4, head_dim 128)", args.device)
    ceiling = copy_bandwidth(args.device, args.repeats)
    rows = [{"impl": "copy", "bandwidth": ceiling, **meta}] if ceiling else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernels-{args.device.split(':')[0]}-int{args.bits}.jsonl"
    sizes = [(int(b), int(k)) for b in args.batch.split(",") for k in args.keys.split(",")]
    for batch, keys in tqdm(sizes, desc="kernels", unit="size"):
        try:
            found = case(batch, keys, args.bits, args.device, args.repeats)
        except torch.cuda.OutOfMemoryError:
            tqdm.write(f"skip batch {batch} keys {keys}: out of memory")
            continue
        for row in found:
            row["ceiling_fraction"] = row["bandwidth"] / ceiling if ceiling else None
            rows.append({**row, **meta})
            frac = f"{row['ceiling_fraction']:.0%} of the copy" if ceiling else ""
            tqdm.write(f"b={batch:3d} keys={keys:7d} {row['impl']:13s} {1e6 * row['seconds']:9.1f} us "
                       f"{row['bandwidth'] / 1e9:8.1f} GB/s {frac}")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # after each size: a cut-short run keeps it
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
