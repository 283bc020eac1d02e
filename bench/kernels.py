"""The low-bit tier's kernels alone: the GPU attention path against the device's copy bandwidth (``attention``),
the C kernel by the dtype of its stored pairs (``c``), what the fused kernels need of an sm_90 GPU
(``resources``, bench/kernel_resources.py), and the kernels a decode step launches on the GPU's paths, counted
without a GPU (``launches``, bench/launches.py).

    python -m bench.kernels attention --device cuda --keys 8192,32768 --batch 1,8 --bits 4
    TRITON_INTERPRET=1 python -m bench.kernels attention --device cpu --keys 512 --batch 1 --repeats 1   # smoke run
    python -m bench.kernels c --windows 342 --heads 3 --rows 3 --bits 4 --threads 1
    python -m bench.kernels resources [--device cuda]
    python -m bench.kernels launches --out bench/results/launches

``attention``: one layer's decode attention over T cached tokens, four ways. For a layer of 8 KV heads × 4 query
heads, head_dim 128 (an 8B shape), one query per head:

- ``fused``: QEvict's path: the T tokens in the low-bit tier, read once by ``qevict_kernels.lowbit_attention``,
  plus 64 full-precision tokens (sinks and recent) through ``qevict_kernels.fp_attention`` (as a layer's whole
  buffer), merged by log-sum-exp with every window's mass;
- ``old_kernel``: the first Triton kernel over the same tier (``bench/old_kernel.py``), attention only;
- ``dequant+sdpa``: the tier dequantized and re-rotated in PyTorch, then SDPA;
- ``sdpa_bf16``: SDPA (on CUDA its flash backend) over T bfloat16 tokens: FullKV's attention.

On CUDA every way is captured in a CUDA graph and replayed, timed with CUDA events over back-to-back replays
(a decode step replays a graph; a host timer around one launch would time the launch). ``copy`` is a
device-to-device copy of 1 GiB, the bandwidth any of them can reach. Each row: median seconds, the bytes it must
read, GB/s and the fraction of the copy's bandwidth.

``c``: one random low-bit tier of ``--windows`` windows per KV head (Ω = 8, head_dim 64 by default), its pairs
stored in float32, float16 and bfloat16 (the same values, widened exactly by the kernel): the median time of
``quant_logits`` and ``quant_values`` for each, in the same process, and each as a ratio to float32. The defaults are SmolLM2's
shapes at 4K/20% with float16 pairs (342 INT4 windows per layer, 3 KV heads, a GQA group of 3 query rows).
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

from qevict_kernels import cpu_decode

from . import kernel_resources, launches
from .common import RESULTS, dtype_name, run_metadata

HKV, GROUPS, HEAD_DIM, OMEGA, FP_TOKENS = 8, 4, 128, 8, 64
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the C kernel's stored pairs


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
    from qevict_kernels.fp_attention import buffer_attention
    from qevict_kernels.lowbit_attention import dequantized_keys_reference, lowbit_attention, merge

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

    fp_count = torch.tensor([FP_TOKENS], device=device)

    def fused():  # as the engine's decode step over a layer's whole buffer
        parts = lowbit_attention(rows, ledger, count, 5, inv_freq, 1.0, scale)
        fp_out, fp_lse, _ = buffer_attention(rows, fp_k, fp_v, fp_count, scale)
        return merge(*parts[:2], fp_out, fp_lse, parts[2], ids, count)

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


def c_tier(windows: int, heads: int, rows: int, dim: int, omega: int, bits: int, seed: int = 0):
    """A random low-bit tier as the C kernel takes it: -> (quant_logits' keywords, (value codes, scales, zeros))."""
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


def c_measure(windows: int, heads: int, rows: int, dim: int, omega: int, bits: int, repeats: int,
              calls: int) -> dict[str, tuple[float, float]]:
    """-> {dtype name: (quant_logits µs, quant_values µs)}, medians, all in this process."""
    keys, (v_codes, v_scale, v_zero) = c_tier(windows, heads, rows, dim, omega, bits)
    probs = torch.softmax(cpu_decode.quant_logits(**keys), dim=-1)
    result = {}
    for dtype in DTYPES:
        narrow = {**keys, "k_scale": keys["k_scale"].to(dtype), "k_zero": keys["k_zero"].to(dtype)}
        scale, zero = v_scale.to(dtype), v_zero.to(dtype)
        result[dtype_name(dtype)] = (
            median_us(lambda: cpu_decode.quant_logits(**narrow), repeats, calls),
            median_us(lambda: cpu_decode.quant_values(probs, v_codes, scale, zero, bits), repeats, calls))
    return result


def attention(args) -> None:
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


def c_kernel(args) -> None:
    if cpu_decode.available() is not None:
        raise SystemExit(f"the C kernel is unavailable: {cpu_decode.available()}")
    torch.set_num_threads(args.threads)
    result = c_measure(args.windows, args.heads, args.rows, args.dim, args.omega, args.bits, args.repeats, args.calls)
    base_logits, base_values = result["float32"]
    print(f"{args.windows} windows x {args.heads} KV heads, {args.rows} rows, head_dim {args.dim}, Ω = {args.omega}, "
          f"INT{args.bits}, {args.threads} thread(s); medians of {args.repeats} x {args.calls} calls")
    for name, (logits, values) in result.items():
        print(f"{name:9s} quant_logits {logits:7.1f} us ({logits / base_logits:.2f}x)  "
              f"quant_values {values:7.1f} us ({values / base_values:.2f}x)")



def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kernel", required=True)
    gpu = sub.add_parser("attention", help="one layer's decode attention, four ways, against the copy bandwidth")
    gpu.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    gpu.add_argument("--keys", default="8192,32768")
    gpu.add_argument("--batch", default="1,8")
    gpu.add_argument("--bits", type=int, default=4)
    gpu.add_argument("--repeats", type=int, default=20)
    gpu.add_argument("--out", default=str(RESULTS / "kernels"))
    c = sub.add_parser("c", help="the C kernel by the dtype of its stored scales and zero-points")
    c.add_argument("--windows", type=int, default=342)
    c.add_argument("--heads", type=int, default=3)
    c.add_argument("--rows", type=int, default=3)
    c.add_argument("--dim", type=int, default=64)
    c.add_argument("--omega", type=int, default=8)
    c.add_argument("--bits", type=int, default=4)
    c.add_argument("--repeats", type=int, default=7)
    c.add_argument("--calls", type=int, default=200, help="calls per timed repeat")
    c.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; pin it on shared machines")
    kernel_resources.add_arguments(sub.add_parser("resources", help="registers, spills and shared memory on sm_90"))
    launches.add_arguments(sub.add_parser("launches", help="kernels a decode step launches on the GPU's paths"))
    args = parser.parse_args(argv)
    run = {"attention": attention, "c": c_kernel, "resources": kernel_resources.run, "launches": launches.run}
    run[args.kernel](args)


if __name__ == "__main__":
    main()
