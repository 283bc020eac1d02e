"""Fidelity to the full cache, teacher-forced: how far each method's next-token distribution drifts from FullKV's.

    python -m bench.fidelity --methods fullkv,streamingllm,snapkv,h2o,adakv,defensivekv,kivi2,qevict \\
        --budgets 0.05,0.1,0.2 --prefill 2048 --steps 256 --passages 5 --out bench/results/fidelity
    python -m bench.fidelity --methods qevict,qevict/256 ...   # the prompt read in chunks of 256 (prefill.py)
    python -m bench.fidelity --methods qevict_head,qevict_head+head_blend=0.75 ...  # a config field changed

Each passage of a natural text (Austen, ``--spacing`` sentences apart) is prefilled, then its next ``steps`` tokens
are fed one at a time through every cache. At each step: KL(FullKV || method) of the next-token distributions, whether the top-1 tokens agree, and the
log-probability of the true next token (perplexity). Continuous and sensitive at every budget. All lanes run as
rows of one batched forward (qevict_core.generation.lanes_forward), each row attending only to its own cache.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from tqdm import tqdm

from qevict_core import make_cache
from qevict_core.generation.prefill import check_chunk
from qevict_core.generation.prefill import prefill as read_prompt
from qevict_core.generation.lanes_forward import forward_lanes

from . import report
from .common import RESULTS, Variant, add_model_args, append_jsonl, kv_dtype, method_lanes, read_jsonl, setup
from .ruler_tasks import essay_sentences


def text_tokens(tokenizer, count: int, offset: int = 0) -> torch.Tensor:
    sentences = essay_sentences("austen")
    ids = tokenizer(" ".join(sentences[offset:]), return_tensors="pt").input_ids[:, :count]
    if ids.shape[1] < count:
        raise ValueError(f"the text from sentence {offset} has only {ids.shape[1]} tokens, {count} needed "
                         f"(it has {len(sentences)} sentences: lower --offset, --spacing or --passages)")
    return ids


def passage_tokens(tokenizer, count: int, offsets: list[int], tiny: bool) -> dict[int, torch.Tensor]:
    """The first ``count`` tokens of the passage at each sentence offset, all checked before any run starts; the
    tiny test model gets seeded random tokens instead."""
    if tiny:
        return {o: torch.randint(0, 256, (1, count), generator=torch.Generator().manual_seed(o)) for o in offsets}
    return {o: text_tokens(tokenizer, count, o) for o in offsets}


def measure(model, tokens: torch.Tensor, prefill: int, lanes: list[tuple[str, float | None]],
            curves: bool = False) -> list[dict]:
    """One row per lane; ``curves`` adds each step's KL and top-1 agreement (``kl_steps``, ``top1_steps``).
    A lane named ``method/N`` reads the prompt alone in chunks of N tokens (``qevict_core.generation.prefill``); the others
    share one prefill with the FullKV reference."""
    steps = tokens.shape[1] - prefill
    variants = [Variant.parse(spec) for spec, _ in lanes]
    caches = [v.make_cache(model, b, tokens.shape[1]) for v, (_, b) in zip(variants, lanes)]
    for cache, variant in zip(caches, variants):
        check_chunk(cache, variant.chunk)
    everyone = [make_cache("fullkv", model, None, max_length=tokens.shape[1])] + caches  # row 0: the reference
    forward_lanes(model, tokens[:, :prefill], everyone[:1] + [c for c, v in zip(caches, variants) if v.chunk is None])
    for cache, variant in zip(caches, variants):
        if variant.chunk is not None:
            read_prompt(model, tokens[:, :prefill], cache, variant.chunk)
    kl, top1, nll = torch.zeros(len(everyone)), torch.zeros(len(everyone)), torch.zeros(len(everyone))
    kl_steps, top1_steps = [], []
    for t in tqdm(range(prefill, tokens.shape[1]), desc="fidelity", unit="step", leave=False):
        feed = tokens[:, t:t + 1].expand(len(everyone), 1)  # the true next token for every lane
        logp = torch.log_softmax(forward_lanes(model, feed, everyone).float(), dim=-1).cpu()  # (lanes, vocab)
        ref = logp[0]
        step_kl = (ref.exp() * (ref - logp)).sum(dim=-1)
        step_top1 = (logp.argmax(dim=-1) == ref.argmax()).float()
        kl += step_kl
        top1 += step_top1
        if curves:
            kl_steps.append(step_kl)
            top1_steps.append(step_top1)
        if t + 1 < tokens.shape[1]:
            nll -= logp[:, tokens[0, t + 1]]
    scored = steps - 1
    rows = []
    for i, ((method, budget), cache) in enumerate(zip(lanes, caches), start=1):
        memory, summary = cache.memory_report(), cache.summary()
        rows.append({"method": method, "budget": budget, "steps": steps, "prefill": prefill,
                     "k_full": summary.get("k_full"), "k_quant": summary.get("k_quant"),
                     "kl": kl[i].item() / steps, "top1": top1[i].item() / steps,
                     "ppl": math.exp(nll[i].item() / scored), "ppl_fullkv": math.exp(nll[0].item() / scored),
                     "kv_ratio": memory["ratio"], "budget_ratio": memory["budget_ratio"], "kv_dtype": kv_dtype(cache)})
        if curves:
            rows[-1].update(kl_steps=[float(v[i]) for v in kl_steps], top1_steps=[float(v[i]) for v in top1_steps])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="fullkv,streamingllm,snapkv,h2o,adakv,defensivekv,kivi2,qevict")
    parser.add_argument("--budgets", default="0.05,0.1,0.2")
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--offset", type=int, default=0, help="first sentence of the first passage")
    parser.add_argument("--passages", type=int, default=5, help="passages of the text, each its own run")
    parser.add_argument("--spacing", type=int, default=700, help="sentences between the starts of two passages")
    parser.add_argument("--out", default=str(RESULTS / "fidelity"))
    add_model_args(parser)
    args = parser.parse_args(argv)
    model, tokenizer, meta = setup(args.model, args.device, args.threads)
    budgets = [float(b) for b in args.budgets.split(",")]
    lanes = method_lanes([m for m in args.methods.split(",") if m.strip()], budgets)
    out = Path(args.out)
    path = out / "fidelity.jsonl"
    # Resumable: a passage (by its offset) already in the file is not run again.
    done = {r.get("offset", 0) for r in read_jsonl([path])} if path.exists() else set()
    offsets = [args.offset + i * args.spacing for i in range(args.passages)]
    todo = passage_tokens(tokenizer, args.prefill + args.steps, [o for o in offsets if o not in done],
                          args.model == "tiny")
    device = next(model.parameters()).device
    for offset, tokens in todo.items():
        for row in measure(model, tokens.to(device), args.prefill, lanes):
            append_jsonl(path, {**row, "passage": offsets.index(offset), "offset": offset, **meta})
    print(f"wrote {report.fidelity_report(read_jsonl([path]), out)}")

if __name__ == "__main__":
    main()
