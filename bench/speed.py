"""Speed and memory (Appendix H.1): TTFT, TPOT, throughput and peak memory per method, as ratios to FullKV
measured in the same process.

    python -m bench.speed --methods fullkv,snapkv,kivi2,qevict --budget 0.2 --contexts 1024,2048,4096,8192 \\
        --new-tokens 64 --repeats 3 --threads 1
    python -m bench.speed --device cuda --model random:llama-8b --contexts 8192,16384 --batch 8   # on a GPU
    python -m bench.speed --methods fullkv,qevict,qevict@torch --contexts 4096   # a method on a chosen path
    python -m bench.speed --methods fullkv,qevict --contexts 4096 --mmap-threshold 131072   # allocator setting
    python -m bench.speed --methods fullkv,fullkv/512,qevict/512 --contexts 4096   # prompts read in chunks
    python -m bench.speed --device cuda --model random:llama-8b --methods fullkv_static,qevict@torch \
        --baseline fullkv_static --graphs --contexts 8192 --batch 8   # plain steps replayed from CUDA graphs

``method@path`` runs a method with ``QEvictConfig(kernels=path)`` (auto, triton, cpu, torch); a bare name runs
``auto``, which is what users get (on CPU: the C kernel when a compiler builds it). ``method/N`` reads the prompt
in chunks of N tokens (``qevict_core.generation.prefill``); ratios are always against ``fullkv``, which reads it whole.

Every method runs alone (no shared prefill), after a warm-up run at the timed shape (the same prompt and batch,
so a GPU compiles every kernel at the sizes it then runs), ``repeats`` times, methods interleaved; medians are
reported. On a GPU each step is timed by CUDA events read after the run (no host sync between steps). TTFT =
prefill + first token; TPOT = (t_end - t_first) / (N - 1); throughput = batch * N / (t_end - t_start); plain and
routing steps are reported apart (medians), and the routing overhead = (routing step - plain step) / Ω as a share
of the plain step. ``--baseline fullkv_static`` takes ratios against FullKV preallocated and written in place (the
fair GPU baseline: the growing FullKV copies its cache every step); ``--prefill-chunk N`` reads every prompt that
can be in chunks of N, so that peak memory compares the caches, not the prefill. ``--graphs`` (a GPU) replays
every plain decode step from a captured CUDA graph (``qevict_core.generation.graphs``) for every method, which must
all be able to (``fullkv_static``, the QEvict family on ``@torch``); a method that cannot is skipped, saying why. Peak memory: on a GPU ``torch.cuda.max_memory_allocated``; on CPU each run happens in a fresh
process (an allocator that has seen an earlier run would hide its peak) and reports the resident set size above
its level after loading the model and warming up, from the kernel's high-water mark (``PeakRSS``). KV bytes are
the cache's measured bytes (``memory_report``): every persistent tensor, and the prefill peak. This machine is shared and noisy: pin threads.

glibc's allocator keeps freed blocks for reuse, and after a large block is freed it raises its mmap threshold, so
large buffers freed during a prefill can stay resident: peak RSS then measures the allocator as well as the
method. ``--mmap-threshold BYTES`` starts every measured process with ``MALLOC_MMAP_THRESHOLD_`` fixed at that size
(blocks above it are mapped and returned on free), for every method alike; the table header says when it is set.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from qevict_core.backends import choose
from qevict_core.generation.graphs import GraphedSteps
from qevict_core.generation.model_call import call
from qevict_core.generation.prefill import prefill

from .common import RESULTS, Variant, add_model_args, default_device, kv_dtypes, method_lanes, run_metadata, setup

RANDOM_MODELS = {  # shapes of public models, random weights: no download needed
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
}


def load(model_name: str | None, device: str | None, threads: int | None):
    if model_name and model_name.startswith("random:"):
        from transformers import LlamaConfig, LlamaForCausalLM

        if threads:
            torch.set_num_threads(threads)
        device = device or "cuda"
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        with torch.device("meta"):  # no float32 copy of 8B weights: built empty, then initialised in place
            model = LlamaForCausalLM(LlamaConfig(**RANDOM_MODELS[model_name.split(":", 1)[1]]))
        model = model.to_empty(device=device).to(dtype).eval()
        model.tie_weights()  # to_empty gives tied parameters storage of their own
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.normal_(0.0, 0.02) if param.dim() > 1 else param.fill_(1.0)
        # to_empty left the rotary module's inverse frequencies unset (and .to(dtype) would round them): rebuilt
        model.model.rotary_emb = type(model.model.rotary_emb)(model.config).to(device)
        return model, None, run_metadata(model_name, device)
    return setup(model_name, device, threads)


class PeakRSS:
    """Peak resident set size above the starting level, from the kernel's high-water mark (``VmHWM``), reset at
    the start by writing 5 to ``/proc/self/clear_refs``: exact, and nothing runs beside the timed code. Where that
    is unavailable (not Linux), a thread samples the RSS every 2 ms; a sampling thread takes the GIL from the
    timed loop, which costs a method in proportion to its Python work, so it is only the fallback."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.process = interval, psutil.Process()
        self._thread = None

    def __enter__(self):
        self.base = self.high = self.process.memory_info().rss
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = _high_water_mark()
        except (OSError, ValueError):
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.high = max(self.high, self.process.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc):
        if self._thread is None:
            self.high = _high_water_mark()
        else:
            self._stop.set()
            self._thread.join()
        self.peak = self.high - self.base


def _high_water_mark() -> int:
    """Peak RSS in bytes since the last reset (``VmHWM`` of /proc/self/status); ValueError when absent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise ValueError("no VmHWM in /proc/self/status")


def release_free_memory() -> None:
    """Hand memory the allocator keeps after the warm-up back to the system, so that the resident set at the start
    of a run holds only live tensors and the run's peak above it is its own (glibc; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def one_run(model, method: str, budget: float | None, prompt: torch.Tensor, new_tokens: int,
            chunk: int | None = None, graphs: bool = False) -> dict:
    device = prompt.device
    variant = Variant.parse(method)
    chunk = variant.chunk or (chunk if variant.chunk is None and chunk and chunkable(variant) else None)
    cache = variant.make_cache(model, budget, prompt.shape[1] + new_tokens, batch_size=prompt.shape[0])
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        release_free_memory()
    stepper = GraphedSteps(model, cache) if graphs else None
    clock = StepClock(device)
    routed: list[bool] = []
    with PeakRSS() as rss, torch.inference_mode():
        clock.mark()
        token = prefill(model, prompt, cache, chunk).argmax(-1, keepdim=True)
        clock.mark()
        for _ in range(new_tokens - 1):
            logits = stepper(token) if stepper else call(model, token, cache, logits_to_keep=1).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)
            clock.mark()
            routed.append(cache.routed())
        seconds = clock.seconds()  # one wait for the device, after the run: no host sync between steps
    steps = list(zip(seconds[1:], routed))  # (seconds, routed) per decode step
    prefill_s, decode_s = seconds[0], sum(seconds[1:])
    report = cache.memory_report()
    return {"ttft": prefill_s, "tpot": decode_s / max(1, new_tokens - 1),
            "throughput": prompt.shape[0] * new_tokens / (prefill_s + decode_s),
            "peak_memory": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss.peak,
            "kv_bytes": report["total_bytes"], "kv_peak_bytes": report["peak_bytes"], "kv_ratio": report["ratio"],
            **({f"replayed_{kind}": n for kind, n in stepper.replays.items()} if stepper else {}),
            **routing_overhead(steps)}


def chunkable(variant: Variant) -> bool:
    from qevict_core.registry import METHODS

    return variant.method in ("fullkv", "fullkv_static") or METHODS[variant.method].family == "qevict" \
        and variant.method != "qevict_head"


class StepClock:
    """Times between marks: CUDA events on a GPU (read once at the end, so the steps are never stalled by the
    timer), the wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def routing_overhead(steps: list[tuple[float, bool]]) -> dict:
    """Extra time of a decode step that routes over the median step that does not, spread over the steps
    between two routing events, as a share of the median plain step (issue 10's target: <= 10%)."""
    plain = [s for s, routed in steps if not routed]
    routing = [s for s, routed in steps if routed]
    if not plain or not routing:
        return {}
    base = statistics.median(plain)
    extra = statistics.median(routing) - base
    interval = len(steps) / len(routing)
    return {"plain_step": base, "routing_step": statistics.median(routing), "routing_extra": extra,
            "routing_share": extra / interval / base}


def measure(args, model, tokenizer, device, method: str, budget: float | None, context: int) -> dict:
    """One timed run; on CPU in a fresh process so that its peak memory is its own."""
    if device.type == "cuda":
        return warm_then_run(model, tokenizer, method, budget, context, args.batch, args.new_tokens,
                             args.prefill_chunk, args.graphs)
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_isolated_run, args.model, args.threads, method, budget, context, args.batch,
                           args.new_tokens, args.prefill_chunk).result()


def _isolated_run(model_name, threads, method, budget, context, batch, new_tokens, chunk) -> dict:
    model, tokenizer, _ = load(model_name, "cpu", threads)
    return warm_then_run(model, tokenizer, method, budget, context, batch, new_tokens, chunk)


def warm_then_run(model, tokenizer, method, budget, context, batch, new_tokens, chunk=None, graphs=False) -> dict:
    """A warm-up at the timed shape (the same prompt, with a routing event or two), then the timed run: on a GPU
    the warm-up compiles every kernel the timed steps launch, at the sizes they launch them."""
    prompt = prompt_ids(tokenizer, model, context, batch, next(model.parameters()).device)
    one_run(model, method, budget, prompt, min(new_tokens, 20), chunk, graphs)
    return one_run(model, method, budget, prompt, new_tokens, chunk, graphs)


def prompt_ids(tokenizer, model, length: int, batch: int, device) -> torch.Tensor:
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        generator = torch.Generator().manual_seed(length)
        return torch.randint(0, model.config.vocab_size, (batch, length), generator=generator).to(device)
    from .ruler_tasks import essay_sentences

    text = " ".join(essay_sentences("austen"))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
    while ids.shape[1] < length:
        ids = torch.cat([ids, ids], dim=1)[:, :length]
    return ids.expand(batch, -1).contiguous().to(device)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="fullkv,streamingllm,snapkv,kivi2,qevict")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--contexts", default="1024,2048,4096,8192")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default="fullkv",
                        help="the method ratios are taken against (fullkv_static: FullKV preallocated, for GPUs)")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="every method that can reads the prompt in chunks of this many tokens (a fair peak)")
    parser.add_argument("--graphs", action="store_true",
                        help="replay plain decode steps from CUDA graphs (a GPU; methods that cannot are skipped)")
    parser.add_argument("--out", default=str(RESULTS / "speed"))
    parser.add_argument("--mmap-threshold", type=int, default=None,
                        help="start each CPU run with MALLOC_MMAP_THRESHOLD_ set to this many bytes (glibc)")
    add_model_args(parser, "bundled SmolLM2 by default; random:llama-8b for GPU runs")
    args = parser.parse_args(argv)
    model, tokenizer, meta = load(args.model, args.device or default_device(), args.threads)
    device = next(model.parameters()).device
    if args.graphs and device.type != "cuda":
        raise ValueError(f"--graphs replays CUDA graphs: it needs --device cuda (this run is on {device.type})")
    meta["auto_path"] = choose("auto", device, next(model.parameters()).dtype).name  # what a bare "qevict" runs
    if args.mmap_threshold is not None:
        if device.type != "cpu":
            raise ValueError("--mmap-threshold applies to CPU runs (each in a fresh process); this run is on "
                             f"{device.type}")
        if args.mmap_threshold < 0:
            raise ValueError(f"--mmap-threshold must be a number of bytes >= 0 (got {args.mmap_threshold})")
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # read by glibc when each run's process starts
        meta["mmap_threshold"] = args.mmap_threshold
    specs = [m.strip() for m in args.methods.split(",")]
    lanes = [(spec, b) for spec, b in method_lanes(specs, [args.budget])  # bad specs fail here, before any run
             if args.batch == 1 or Variant.parse(spec).method not in ("adakv", "defensivekv", "layer_defensivekv")]
    budget_of = dict(lanes)  # None for methods without a byte budget (fullkv, the quantization baselines)
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        runs: dict[str, list[dict]] = {}
        for _ in tqdm(range(args.repeats), desc=f"speed at {context}", unit="round"):
            for method, budget in lanes:  # interleaved, so drifting machine load hits every method alike
                try:
                    result = measure(args, model, tokenizer, device, method, budget, context)
                except (ValueError, torch.cuda.OutOfMemoryError) as err:
                    print(f"skip {method} at {context}: {err}")
                    continue
                runs.setdefault(method, []).append(result)
        results = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
        for method, res in results.items():
            print(f"{context:>6} {method:18s} " + " ".join(f"{k}={v:.4g}" for k, v in res.items()), flush=True)
        base = results.get(args.baseline)
        stored = kv_dtypes(model, [(m, budget_of[m]) for m in results], context + args.new_tokens)
        for method, res in results.items():
            ratios = {f"{k}_vs_fullkv": res[k] / base[k] for k in ("ttft", "tpot", "throughput", "peak_memory")
                      if base and base[k]}
            rows.append({"method": method, "budget": budget_of[method],
                         "context": context, "batch": args.batch, "new_tokens": args.new_tokens,
                         "repeats": args.repeats, "baseline": args.baseline, "prefill_chunk": args.prefill_chunk,
                         "graphs": args.graphs, "kv_dtype": stored[method],
                         **res, **ratios, **meta})
        write_rows(Path(args.out), args, meta, rows)  # after each context: a run cut short keeps what it measured


def write_rows(out: Path, args, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"speed-{meta['device'].split(':')[0]}-{(args.model or 'smollm2').replace(':', '-')}-b{args.batch}"
    (out / f"{stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / f"{stem}.md").write_text(speed_table(rows, meta))
    print(f"wrote {out / (stem + '.md')}", flush=True)


def speed_table(rows: list[dict], meta: dict) -> str:
    lines = [f"{meta['model']} on {meta['gpu'] or meta['cpu']} ({meta['device']}, {meta['threads']} threads), "
             f"{meta['date']}, commit {meta['commit']}. Medians; ratios against FullKV in the same process. "
             f"QEvict's path for its low-bit tier when not named: {meta.get('auto_path', 'torch')}."
             + (" Plain decode steps replayed from CUDA graphs." if rows and rows[0].get("graphs") else "")
             + (f" glibc MALLOC_MMAP_THRESHOLD_={meta['mmap_threshold']} in every run."
                if meta.get("mmap_threshold") is not None else ""), "",
             "| context | method | TTFT s | TPOT ms | tok/s | peak mem MiB | KV MiB | TTFT × | TPOT × | tok/s × | "
             "peak × | routing overhead |", "|" + "---|" * 12]
    for r in rows:
        overhead = (f"{100 * r['routing_share']:.1f}% ({1000 * r['routing_extra']:.0f} ms per event)"
                    if "routing_share" in r else "—")
        lines.append(f"| {r['context']} | {r['method']} | {r['ttft']:.3f} | {1000 * r['tpot']:.1f} | "
                     f"{r['throughput']:.2f} | {r['peak_memory'] / 2**20:.1f} | {r['kv_bytes'] / 2**20:.2f} | "
                     + " | ".join(f"{r.get(k + '_vs_fullkv', float('nan')):.2f}"
                                  for k in ("ttft", "tpot", "throughput", "peak_memory")) + f" | {overhead} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
