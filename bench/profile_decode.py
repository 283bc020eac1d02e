"""Where a method's decode step spends its time: torch.profiler over a few decode steps after a prefill.

    python -m bench.profile_decode --device cuda --model random:llama-8b --method qevict --context 8192 --batch 8
    python -m bench.profile_decode --method qevict --context 1024 --steps 8 --threads 2   # CPU, bundled SmolLM2

Prints the operators that take the most device time (on a GPU) and host time, and the wall time per step, and
writes both tables to ``--out``. The steps profiled include the routing events that fall among them (every Ω).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from .common import RESULTS, Variant, add_model_args, default_device
from .speed import load, prompt_ids
from qevict_core.generation.model_call import call
from qevict_core.generation.prefill import prefill
from qevict_core.timing import sync


def profile_steps(model, tokenizer, method: str, budget: float, context: int, batch: int, steps: int):
    device = next(model.parameters()).device
    prompt = prompt_ids(tokenizer, model, context, batch, device)
    variant = Variant.parse(method)
    with torch.inference_mode():  # a warm-up at the profiled shape: kernels compile here, not in the profile
        warm = variant.make_cache(model, budget, context + steps + 1, batch_size=batch)
        token = prefill(model, prompt, warm, None).argmax(-1, keepdim=True)
        for _ in range(min(steps, 10)):
            token = call(model, token, warm, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        del warm
    cache = variant.make_cache(model, budget, context + steps + 1, batch_size=batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        token = prefill(model, prompt, cache, None).argmax(-1, keepdim=True)
        sync(device)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                token = call(model, token, cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            sync(device)
            per_step = (time.perf_counter() - start) / steps
    return prof, per_step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="qevict")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--out", default=str(RESULTS / "profile"))
    add_model_args(parser, "bundled SmolLM2 by default; random:llama-8b for GPU runs")
    args = parser.parse_args(argv)
    model, tokenizer, meta = load(args.model, args.device or default_device(), args.threads)
    profile_steps(model, tokenizer, args.method, args.budget, min(args.context, 1024), args.batch, 4)  # warm-up
    prof, per_step = profile_steps(model, tokenizer, args.method, args.budget, args.context, args.batch, args.steps)
    averages = prof.key_averages()
    tables = [f"{args.method} at {args.context} tokens, batch {args.batch}, {meta['model']} on "
              f"{meta['gpu'] or meta['cpu']}, commit {meta['commit']}: {1000 * per_step:.1f} ms per step "
              f"over {args.steps} steps (profiler on)"]
    if meta["gpu"]:
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=args.rows))
    tables.append(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    text = "\n\n".join(tables)
    print(text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"profile-{meta['device'].split(':')[0]}-{args.method.replace('@', '-').replace('/', '-')}-{args.context}.txt"
    (out / name).write_text(text + "\n")
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
