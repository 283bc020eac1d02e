"""Kernel launches per layer and decode step beyond FullKV's, on the paths a GPU takes, counted without a GPU.

    python -m bench.kernels launches [--methods fullkv_static,qevict@torch,qevict@triton --context 1024]

Replayed from a CUDA graph, a decode step costs at least a launch slot per kernel, whatever the kernel reads; on an
8B shape at 8K tokens and batch 1 the KV bytes QEvict saves per layer take an H200 about as long to read as one
launch costs, so a few extra kernels per layer erase its margin over FullKV. Here one plain decode step and one
routing step of each method, on the model's shape in bfloat16 (its dtype on a GPU) with random weights, run under
a dispatch mode that counts what would launch: an operator that writes memory (in place, or into storage none of
its inputs has), not a view, a no-op conversion or an allocation; and each Triton kernel (run by the Triton
interpreter here, whose own operators are not counted). Steps are taken once the tiers hold their planned sizes
(past two routing events), so a step is the call a graph replays. One JSON line per (method, step kind): the count,
and per layer beyond the baseline's.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .common import RESULTS, Variant, add_model_args, kv_dtypes, method_lanes, run_metadata

ALLOCATIONS = {"aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty_strided"}


class CountLaunches(TorchDispatchMode):
    """Operators that would launch a kernel on a GPU, by name; Triton kernels as ``triton:<name>``."""

    def __init__(self):
        super().__init__()
        self.launched: collections.Counter = collections.Counter()
        self.inside_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if self.inside_kernel or name in ALLOCATIONS:
            return out
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs)) if t.device.type != "meta"}
        fresh = any(t.untyped_storage().data_ptr() not in inputs for t in _tensors(out))
        if func._schema.is_mutable or fresh:
            self.launched[name] += 1
        return out

    def kernel(self, name: str):
        self.launched[f"triton:{name}"] += 1
        self.inside_kernel += 1

    def kernel_done(self):
        self.inside_kernel -= 1


def _tensors(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.numel()]


def watch_triton(counter: CountLaunches):
    """Count each Triton kernel the interpreter runs, and none of the operators it runs them with."""
    from triton.runtime.interpreter import GridExecutor

    call = GridExecutor.__call__

    def counted(self, *args, **kwargs):
        counter.kernel(self.fn.__name__)
        try:
            return call(self, *args, **kwargs)
        finally:
            counter.kernel_done()

    GridExecutor.__call__ = counted
    return lambda: setattr(GridExecutor, "__call__", call)


def in_bfloat16(model):
    """``model`` in bfloat16, its dtype on a GPU (no conversions a float32 model would add), with its rotary
    frequencies rebuilt in float32 as transformers makes them (``.to`` would have rounded them)."""
    model = model.to(torch.bfloat16)
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config).to(next(model.parameters()).device)
    return model


def steps_of(model, variant: Variant, budget: float | None, prompt: torch.Tensor, max_new: int) -> dict:
    """{"plain": Counter, "routing": Counter} of one steady-state step of each kind."""
    from qevict_core.generation.model_call import call

    cache = variant.make_cache(model, budget, prompt.shape[1] + max_new)
    kinds = ("plain", "routing") if variant.budgeted else ("plain",)
    counted, events = {}, 0
    with torch.inference_mode():
        token = call(model, prompt, cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(max_new):
            position = torch.tensor([cache.get_seq_length()], device=prompt.device)
            counter = CountLaunches()
            undo = watch_triton(counter) if variant.kernels == "triton" else (lambda: None)
            try:
                with counter:
                    logits = call(model, token, cache, logits_to_keep=1, cache_position=position,
                                  position_ids=position[None]).logits
            finally:
                undo()
            token = logits[:, -1].argmax(-1, keepdim=True)
            kind = "routing" if variant.budgeted and cache.routed() else "plain"
            events += kind == "routing"
            if events >= 2 or len(kinds) == 1:  # the tiers hold their planned sizes from the second event on
                counted.setdefault(kind, counter.launched)
            if len(counted) == len(kinds):
                return counted
    raise ValueError(f"{variant.spec}: no steady routing step within {max_new} tokens (raise --new-tokens)")


def add_arguments(parser) -> None:
    parser.add_argument("--methods", default="fullkv_static,qevict@torch,qevict@triton")
    parser.add_argument("--baseline", default="fullkv_static", help="the method counts are taken beyond")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--out", default=str(RESULTS / "launches"))
    add_model_args(parser)
    parser.set_defaults(model="random:smollm2")


def run(args) -> None:
    specs = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.baseline not in specs:
        raise ValueError(f"--baseline must be one of --methods {specs} (got {args.baseline!r})")
    lanes = method_lanes(specs, [args.budget])
    if args.device not in (None, "cpu"):
        raise ValueError("bench.launches counts on the CPU (the Triton interpreter runs the kernels); --device cpu")
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    from .speed import load

    model, _, _ = load(args.model, "cpu", args.threads)
    model = in_bfloat16(model)
    layers = model.config.num_hidden_layers
    generator = torch.Generator().manual_seed(args.context)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.context), generator=generator)
    counts = {spec: steps_of(model, Variant.parse(spec), budget, prompt, args.new_tokens) for spec, budget in lanes}
    meta = run_metadata(args.model, "cpu")
    stored = kv_dtypes(model, lanes, args.context + args.new_tokens)
    base = sum(counts[args.baseline]["plain"].values())
    rows = []
    for spec, budget in lanes:
        for kind in ("plain", "routing"):
            if kind not in counts[spec]:
                continue
            launched = counts[spec][kind]
            total = sum(launched.values())
            rows.append({"method": spec, "budget": budget, "step": kind, "context": args.context,
                         "launches": total, "layers": layers, "baseline": args.baseline,
                         "per_layer_beyond_baseline": (total - base) / layers,
                         "by_operator": dict(launched.most_common()), "kv_dtype": stored[spec], **meta})
            print(f"{spec:24s} {kind:8s} {total:6d} launches, {(total - base) / layers:+.1f} per layer", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launches.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "launches.md").write_text(table(rows))
    print(f"wrote {out / 'launches.md'}")


def table(rows: list[dict]) -> str:
    first = rows[0]
    budget = next((r["budget"] for r in rows if r["budget"] is not None), None)
    base = next(r["by_operator"] for r in rows if r["method"] == first["baseline"] and r["step"] == "plain")
    lines = [f"{first['model']}'s shape in bfloat16 ({first['layers']} layers), {first['context']}-token prompt, "
             f"budget {budget:g}, commit {first['commit']}: kernels one decode step would launch on a GPU, counted "
             f"on the CPU (`bench.kernels launches`); per layer and by operator, beyond {first['baseline']}'s plain "
             "step.", "",
             "| method | step | launches | per layer beyond the baseline | most launched beyond the baseline |",
             "|---|---|---|---|---|"]
    for r in rows:
        extra = {name: n - base.get(name, 0) for name, n in r["by_operator"].items()}
        top = sorted(((n, name) for name, n in extra.items() if n > 0), key=lambda x: (-x[0], x[1]))[:4]
        shown = ", ".join(f"{name.removeprefix('aten.')} {n}" for n, name in top) or "—"
        lines.append(f"| {r['method']} | {r['step']} | {r['launches']} | {r['per_layer_beyond_baseline']:+.1f} | "
                     f"{shown} |")
    return "\n".join(lines) + "\n"
