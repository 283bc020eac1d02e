"""Command line: ``python -m qevict_core generate ...`` and ``python -m qevict_core methods``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import BITS, POOL_DIRECTIONS, SCALE_DTYPES, SCORERS, QEvictConfig
from .events import DoneEvent, TokenEvent
from .generation.generate import Lane, Sampling, generate_lanes
from .registry import list_methods, make_cache

DEFAULTS = QEvictConfig()


def quiet_transformers() -> None:
    """Progress bars and load warnings would interleave with streamed text."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m qevict_core", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    methods = sub.add_parser("methods", help="list the cache methods")
    methods.add_argument("--ablations", action="store_true", help="list the ablations the benchmarks run too")
    gen = sub.add_parser("generate", help="generate text through a compressed cache")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", type=Path, help="file holding the prompt")
    gen.add_argument("--method", default="qevict", help="cache method (see `methods`)")
    gen.add_argument("--model", default=None, help="local HF directory or hub id (default: bundled SmolLM2)")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--budget", type=float, default=DEFAULTS.budget, help="fraction of the full KV bytes")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--omega", type=int, default=DEFAULTS.omega)
    gen.add_argument("--sinks", type=int, default=DEFAULTS.sinks)
    gen.add_argument("--recent", type=int, default=DEFAULTS.recent)
    gen.add_argument("--q-frac", type=float, default=DEFAULTS.q_frac)
    gen.add_argument("--coverage", type=float, default=DEFAULTS.coverage,
                     help="size the low-bit tier first to hold this fraction (0, 1] of the windows; 0 = split the "
                          "bytes by --q-frac (Eq. 3)")
    gen.add_argument("--bits", type=int, default=DEFAULTS.bits, help=f"one of {BITS}")
    gen.add_argument("--scale-dtype", default=DEFAULTS.scale_dtype,
                     help=f"storage of the low-bit tier's scales and zero-points, one of {SCALE_DTYPES}")
    gen.add_argument("--scorer", default=DEFAULTS.scorer, help=f"one of {SCORERS}")
    gen.add_argument("--pool", type=int, default=DEFAULTS.pool,
                     help="rank a window by the largest score within this many windows of it (0 = no pooling)")
    gen.add_argument("--pool-weight", type=float, default=DEFAULTS.pool_weight,
                     help="what a neighbour's score counts for in pooling, in (0, 1]")
    gen.add_argument("--pool-direction", default=DEFAULTS.pool_direction,
                     help=f"one of {POOL_DIRECTIONS}: borrow from neighbours on either side, or from earlier ones only")
    gen.add_argument("--no-promotion", action="store_true", help="one-way Full -> Quantized -> Evicted")
    gen.add_argument("--prefill-chunk", type=int, default=None,
                     help="read the prompt in chunks of this many tokens (bounds prefill memory; fullkv and the "
                          "QEvict family except qevict_head)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def encode_prompt(tokenizer, text: str, raw: bool):
    if not raw and tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(text, return_tensors="pt").input_ids


def run_generate(args) -> dict:
    from .models import load_model

    config = QEvictConfig(budget=args.budget, omega=args.omega, sinks=args.sinks, recent=args.recent,
                          q_frac=args.q_frac, coverage=args.coverage or None, bits=args.bits, scale_dtype=args.scale_dtype,
                          scorer=args.scorer, pool=args.pool, pool_weight=args.pool_weight,
                          pool_direction=args.pool_direction,
                          promotion=not args.no_promotion)
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    text = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    if not text.strip():
        raise ValueError("the prompt is empty")
    model, tokenizer = load_model(args.model, device=args.device)
    input_ids = encode_prompt(tokenizer, text, args.raw)
    cache = make_cache(args.method, model, config, max_length=input_ids.shape[1] + args.max_new_tokens)
    done = None
    for event in generate_lanes(model, tokenizer, input_ids, [Lane(args.method, cache)], sampling,
                                prefill_chunk=args.prefill_chunk):
        if isinstance(event, TokenEvent) and not args.json:
            print(event.text, end="", flush=True)
        elif isinstance(event, DoneEvent):
            done = event
    if done.reason.startswith("error"):
        raise RuntimeError(done.reason)
    summary = done.summary
    return {
        "text": done.text,
        "prompt_tokens": input_ids.shape[1],
        "new_tokens": done.tokens,
        "stop_reason": done.reason,
        "seconds": {"prefill": done.prefill_seconds, "decode": done.decode_seconds},
        "memory": cache.memory_report(),
        "tiers": cache.tier_counts(),
        "events_summary": {k: summary.get(k, 0) for k in ("promotions", "demotions", "evictions")},
        "config": cache.config.to_dict(),  # what the lane ran with: the flags, with its method's own fields
        "method": args.method,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_transformers()
    if args.command == "methods":
        for name, description in list_methods(ablations=args.ablations).items():
            print(f"{name:20s} {description}")
        return 0
    try:
        result = run_generate(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    mem = result["memory"]
    print(f"\n\n[{result['method']}] {result['new_tokens']} tokens, stop: {result['stop_reason']}, "
          f"prefill {result['seconds']['prefill']:.2f}s, decode {result['seconds']['decode']:.2f}s")
    budget = f"{mem['budget_bytes']:,}" if mem["budget_bytes"] is not None else "none"
    print(f"KV bytes {mem['total_bytes']:,} = {mem['ratio']:.3f} of FullKV ({mem['fullkv_bytes']:,}); "
          f"budget {budget}; prefill peak {mem['peak_bytes']:,}")
    print("components: " + ", ".join(f"{k}={v:,}" for k, v in mem["components"].items() if v))
    print("events: " + ", ".join(f"{k}={v}" for k, v in result["events_summary"].items()))
    print("tiers (tokens) per layer:")
    for i, tiers in enumerate(result["tiers"]):
        print(f"  layer {i:2d}: " + " ".join(f"{k}={v}" for k, v in tiers.items()))
    return 0
