"""Command line: ``qevict generate ...`` (or ``python -m qevict_core generate ...``) and ``qevict methods``.

The flags are the ``QEvictConfig`` knobs (config.py declares them, with their help and allowed values). Nothing
heavy is imported until a model is needed, so ``--help`` is immediate, and every argument is checked before the
model loads: a bad one is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from .config import QEvictConfig
from .registry import method_names

EXIT_USAGE = 2
CLI_KNOBS = ("method", "scorer", "head", "run")  # capacity overrides are for the benchmarks' ablations


class UsageError(Exception):
    """A refused argument: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, as every other refusal (argparse would print the usage first)."""
        self.exit(EXIT_USAGE, f"qevict: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="qevict", description="Recoverable quantized KV-cache eviction "
                                     "(arXiv 2608.05326): generate through a compressed cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    methods = sub.add_parser("methods", help="list the cache methods")
    methods.add_argument("--ablations", action="store_true", help="list the ablations the benchmarks run too")
    gen = sub.add_parser("generate", help="generate text through a compressed cache")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", type=Path, help="file holding the prompt")
    gen.add_argument("--method", default="qevict", choices=method_names(ablations=True), metavar="METHOD",
                     help=f"cache method: {', '.join(method_names())} (`qevict methods --ablations` lists the "
                          "ablations too)")
    gen.add_argument("--model", default=None, help="local HF directory or hub id (default: the bundled SmolLM2)")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="(default: 128)")
    gen.add_argument("--prefill-chunk", type=int, default=None,
                     help="read the prompt in chunks of this many tokens (bounds prefill memory; fullkv and the "
                          "QEvict family except qevict_head)")
    gen.add_argument("--graphs", action="store_true",
                     help="on CUDA, replay decode steps from captured graphs (FullKV, an eviction baseline, or a "
                          "QEvict method with --kernels torch or triton)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.add_argument("--strict-budget", action="store_true",
                     help="refuse a budget too small for what the method always keeps (default: run at the least "
                          "it can and say so)")
    gen.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="a progress bar on stderr (default: with --json on a terminal)")
    knobs = gen.add_argument_group("cache settings (QEvictConfig; each method reads what it needs)")
    for name, spec in QEvictConfig.knobs().items():
        if spec.group not in CLI_KNOBS or name == "record_events":
            continue
        flag = "--" + name.replace("_", "-")
        default = QEvictConfig.__dataclass_fields__[name].default
        if spec.kind is bool:
            knobs.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=f"{spec.help} (default: {default})".replace("%", "%%"))
            continue
        metavar = "{" + ",".join(map(str, spec.choices)) + "}" if spec.choices else spec.kind.__name__.upper()
        allowed = "" if spec.choices else f"; {spec.allowed()}"
        knobs.add_argument(flag, default=default, metavar=metavar, type=_reader(spec),
                           help=f"{spec.help}{allowed} (default: {default})".replace("%", "%%"))
    return parser


def _reader(spec):
    """The flag's text as the knob's type; 'none' for an optional knob. Range checks are the config's."""
    def read(text: str):
        if spec.optional and text.lower() == "none":
            return None
        try:
            return int(text) if spec.kind is int else float(text) if spec.kind is float else text
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {spec.allowed()} (got {text!r})") from None
    read.__name__ = spec.kind.__name__
    return read


def check_args(args) -> tuple[QEvictConfig, str]:
    """Everything the flags say, checked before any model loads: -> (config, prompt text)."""
    fields = {name: getattr(args, name) for name, spec in QEvictConfig.knobs().items()
              if spec.group in CLI_KNOBS and name != "record_events"}
    try:
        config = QEvictConfig(**fields)
    except ValueError as err:
        name, _, rest = str(err).partition(" ")  # the config names its field first: say the flag instead
        raise UsageError(f"--{name.replace('_', '-')} {rest}" if name in fields else str(err)) from None
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if args.temperature < 0 or args.temperature != args.temperature:
        raise UsageError(f"--temperature must be a number >= 0, 0 = greedy (got {args.temperature})")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk must be a whole number of tokens >= 1 (got {args.prefill_chunk})")
    if args.prompt is not None:
        text = args.prompt
    else:
        try:
            text = args.prompt_file.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"--prompt-file {args.prompt_file}: {getattr(err, 'strerror', None) or err}") from None
    if not text.strip():
        raise UsageError("the prompt is empty")
    return config, text


def encode_prompt(tokenizer, text: str, raw: bool):
    if not raw and tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(text, return_tensors="pt").input_ids


def run_generate(args, config: QEvictConfig, text: str) -> dict:
    from transformers.utils import logging

    from .events import DoneEvent, TokenEvent
    from .factory import BudgetRaised, make_cache
    from .generation.generate import Lane, Sampling, generate_lanes
    from .generation.graphs import require_graphs
    from .models import ModelNotFoundError, load_model

    logging.set_verbosity_error()  # progress bars and load warnings would interleave with streamed text
    logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=BudgetRaised)  # the report says it (``fitted``)
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    try:
        model, tokenizer = load_model(args.model, device=args.device)
    except ModelNotFoundError as err:
        raise UsageError(str(err).splitlines()[0]) from None
    input_ids = encode_prompt(tokenizer, text, args.raw)
    try:
        cache = make_cache(args.method, model, config, max_length=input_ids.shape[1] + args.max_new_tokens,
                           strict=args.strict_budget)
        if args.graphs:
            require_graphs(model, cache)
    except ValueError as err:
        raise UsageError(str(err)) from None
    show_bar = args.progress if args.progress is not None else args.json and sys.stderr.isatty()
    bar = _progress(args.max_new_tokens, show_bar)
    done = None
    for event in generate_lanes(model, tokenizer, input_ids, [Lane(args.method, cache)], sampling,
                                prefill_chunk=args.prefill_chunk, graphs=args.graphs):
        if isinstance(event, TokenEvent):
            bar.update(1)
            if not args.json:
                print(event.text, end="", flush=True)
        elif isinstance(event, DoneEvent):
            done = event
    bar.close()
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
        "fitted": cache.fitted.message() if cache.fitted else None,
        "tiers": cache.tier_counts(),
        "events_summary": {k: summary.get(k, 0) for k in ("promotions", "demotions", "evictions")},
        "config": cache.config.to_dict() if cache.config else None,  # what the lane ran with: the flags + its method's
        "method": args.method,
    }


def _progress(total: int, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", desc="generating", file=sys.stderr, disable=not show, leave=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "methods":
        from .registry import list_methods

        for name, description in list_methods(ablations=args.ablations).items():
            print(f"{name:20s} {description}")
        return 0
    try:
        config, text = check_args(args)
        result = run_generate(args, config, text)
    except UsageError as err:
        print(f"qevict: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(result))
        return 0
    print_report(result)
    return 0


def print_report(result: dict) -> None:
    mem = result["memory"]
    print(f"\n\n[{result['method']}] {result['new_tokens']} tokens, stop: {result['stop_reason']}, "
          f"prefill {result['seconds']['prefill']:.2f}s, decode {result['seconds']['decode']:.2f}s")
    if result["fitted"]:
        print(result["fitted"])
    budget = f"{mem['budget_bytes']:,}" if mem["budget_bytes"] is not None else "none"
    print(f"KV bytes {mem['total_bytes']:,} = {mem['ratio']:.3f} of FullKV ({mem['fullkv_bytes']:,}); "
          f"budget {budget}; prefill peak {mem['peak_bytes']:,}")
    print("components: " + ", ".join(f"{k}={v:,}" for k, v in mem["components"].items() if v))
    print("events: " + ", ".join(f"{k}={v}" for k, v in result["events_summary"].items()))
    print("tiers (tokens) per layer:")
    for i, tiers in enumerate(result["tiers"]):
        print(f"  layer {i:2d}: " + " ".join(f"{k}={v}" for k, v in tiers.items()))
