"""The project's eviction baselines beside NVIDIA kvpress's presses, on the same prompts and token ids.

    python -m bench.kvpress_check --methods streamingllm,snapkv,adakv,criticalkv --budget 0.2 --length 2048 \
        --samples 3 --seed 2 --out bench/results/kvpress        # needs .venv-kvpress (make setup-kvpress)

kvpress pins an older transformers than this project, so its side runs in its own environment
(``.venv-kvpress``, ``make setup-kvpress``) as ``python -m bench.kvpress_check --worker JOB``, which imports only
torch, transformers and kvpress. Both sides read the same RULER-style prompts (the same token ids) with the bundled
SmolLM2 in float32, keys stored in float32 on both sides (``kv_dtype="model"``), so a difference is the selection
rule's, not rounding's.

For each prompt and method, this side runs the project's cache at ``--budget`` and reads which prompt positions
each KV head of each layer kept after the prompt (each kept key is found among the keys of an uncompressed
prefill of the same prompt). The press then keeps the same number of tokens per head (kvpress's
``compression_ratio`` chosen for it), its kept positions read the same way (AdaKV masks instead of removing: the
unmasked ones). Both then decode greedily. One row per prompt and method: the overlap of the kept sets (Jaccard, per
head, over every layer and head), the heads that kept exactly the same set, the greedy tokens alike, each side's
RULER score.

Presses, with the project's settings where kvpress has the knob: ``StreamingLLMPress(n_sink=sinks)``,
``SnapKVPress(window_size=32, kernel_size=5)``, ``AdaKVPress(SnapKVPress(32, 5), alpha_safeguard=0.2)``,
``CriticalKVPress(SnapKVPress(32, 5))``. Rows: ``kvpress.jsonl``; table: ``python -m bench.report kvpress``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-kvpress"
PRESSES = ("streamingllm", "snapkv", "adakv", "criticalkv")


def kept_positions(kept: torch.Tensor, full: torch.Tensor) -> list[int]:
    """Positions of the (n, D) kept keys among the (N, D) keys of the whole prompt (each an exact copy of one)."""
    dist, index = torch.cdist(kept.float(), full.to(kept.dtype).float(),
                              compute_mode="donot_use_mm_for_euclid_dist").min(dim=1)  # exact: copies are at 0
    scale = float(full.float().norm(dim=-1).max())
    if float(dist.max()) > 1e-5 * scale:
        raise RuntimeError(f"a kept key is no key of the prompt (distance {float(dist.max()):.3g})")
    return sorted(index.tolist())


def greedy(model, ids: torch.Tensor, cache, new_tokens: int, eos: set[int], after_prompt) -> list[int]:
    """Prefill ``ids`` into ``cache`` and call ``after_prompt()``, then greedy tokens with explicit positions (a
    compressed cache is shorter than the sequence it read)."""
    n = ids.shape[1]
    out = model(input_ids=ids, past_key_values=cache, position_ids=torch.arange(n)[None], use_cache=True)
    after_prompt()
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < new_tokens and tokens[-1] not in eos:
        position = torch.tensor([[n + len(tokens) - 1]])
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=position,
                    use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def full_keys(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's (H, N, D) keys of an uncompressed prefill."""
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    return [layer.keys[0] for layer in cache.layers]


# -- kvpress's side (its own environment) -------------------------------------------------------------------------
def press_for(method: str, ratio: float, sinks: int):
    from kvpress import AdaKVPress, CriticalKVPress, SnapKVPress, StreamingLLMPress

    snap = SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=5)
    return {"streamingllm": lambda: StreamingLLMPress(compression_ratio=ratio, n_sink=sinks),
            "snapkv": lambda: snap, "adakv": lambda: AdaKVPress(snap, alpha_safeguard=0.2),
            "criticalkv": lambda: CriticalKVPress(snap)}[method]()


def press_side(job: dict) -> list[dict]:
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    attention = [layer.self_attn for layer in model.model.layers]
    results = []
    with torch.no_grad():
        for prompt in job["prompts"]:
            ids = torch.tensor([prompt["ids"]])
            n, full = ids.shape[1], full_keys(model, ids)
            for method, kept in prompt["kept"].items():
                press = press_for(method, 1 - (kept + 0.5) / n, job["sinks"])  # keeps int(n * (1 - ratio)) = kept
                cache, positions = DynamicCache(), []

                def read_kept():
                    for layer, module in enumerate(attention):
                        masked = getattr(module, "masked_key_indices", None)
                        heads = full[layer].shape[0]
                        if masked is None:
                            positions.append([kept_positions(cache.layers[layer].keys[0, h], full[layer][h])
                                              for h in range(heads)])
                            continue
                        pruned = [set() for _ in range(heads)]  # AdaKV: every key stays, the pruned ones masked
                        for h, s in zip(masked[1].tolist(), masked[2].tolist()):
                            pruned[h].add(s)
                        positions.append([sorted(set(range(n)) - pruned[h]) for h in range(heads)])

                with press(model):
                    tokens = greedy(model, ids, cache, prompt["new_tokens"], set(job["eos"]), read_kept)
                for module in attention:
                    module.masked_key_indices = None  # the next prompt starts unmasked
                results.append({"task": prompt["task"], "sample": prompt["sample"], "method": method,
                                "tokens": tokens, "positions": positions})
    return results


# -- this project's side ------------------------------------------------------------------------------------------
def project_side(model, method: str, budget: float, ids: torch.Tensor, new_tokens: int, eos: set[int],
                 full: list[torch.Tensor]) -> dict:
    from qevict_core import QEvictConfig, make_cache

    from .common import kv_dtype

    cache = make_cache(method, model, QEvictConfig(budget=budget, kv_dtype="model"),
                       max_length=ids.shape[1] + new_tokens)
    positions = []

    def read_kept():  # each KV head's kept keys, (B, n_h, D) per head, chronological
        positions.extend([kept_positions(layer.keys[h][0], full[i][h]) for h in range(len(layer.keys))]
                         for i, layer in enumerate(cache.layers))

    return {"tokens": greedy(model, ids, cache, new_tokens, eos, read_kept), "positions": positions,
            "kv_dtype": kv_dtype(cache)}


def agreement(ours: list, theirs: list) -> dict:
    """Kept sets per layer and head: mean Jaccard, the share of heads identical, the mean kept per head."""
    jaccard, same, count_a, count_b = [], 0, [], []
    for layer_a, layer_b in zip(ours, theirs):
        for a, b in zip(layer_a, layer_b):
            a, b = set(a), set(b)
            jaccard.append(len(a & b) / len(a | b) if a | b else 1.0)
            same += a == b
            count_a.append(len(a))
            count_b.append(len(b))
    return {"jaccard": sum(jaccard) / len(jaccard), "jaccard_min": min(jaccard), "heads_same": same,
            "heads": len(jaccard), "kept_ours": sum(count_a) / len(count_a),
            "kept_kvpress": sum(count_b) / len(count_b)}


def run(args) -> None:
    from qevict_core import QEvictConfig, load_model
    from qevict_core.models import converted_dir

    from .common import append_jsonl, run_metadata
    from .ruler_tasks import DEFAULT_TASKS, TASKS, haystack_source, sample_seed, sized_sample, string_match_all

    if not (VENV / "bin" / "python").exists():
        raise SystemExit(f"kvpress's environment is missing: run `make setup-kvpress` (it builds {VENV})")
    torch.set_num_threads(args.threads)
    model, tok = load_model()
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    prompts, ours = [], {}
    with torch.no_grad():
        for task in DEFAULT_TASKS:
            for i in range(args.samples):
                sample, ids = sized_sample(tok, task, args.length, sample_seed(task, args.length, i, args.seed), None,
                                           "auto")
                full = full_keys(model, ids)
                new_tokens, kept = TASKS[task].max_new_tokens, {}
                for method in args.methods:
                    side = project_side(model, method, args.budget, ids, new_tokens, eos, full)
                    ours[task, i, method] = (side, sample.answers)
                    kept[method] = round(sum(len(p) for p in side["positions"][0]) / len(side["positions"][0]))
                prompts.append({"task": task, "sample": i, "ids": ids[0].tolist(), "new_tokens": new_tokens,
                                "kept": kept})
    job = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvpress_check_{os.getpid()}.json"
    job.write_text(json.dumps({"model": str(converted_dir()), "prompts": prompts, "threads": args.threads,
                               "eos": sorted(eos), "sinks": QEvictConfig().sinks}))
    done = subprocess.run([str(VENV / "bin" / "python"), "-m", "bench.kvpress_check", "--worker", str(job)],
                          cwd=ROOT, capture_output=True, text=True)
    job.unlink(missing_ok=True)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"kvpress's side failed:\n{done.stderr[-3000:]}")
    versions = json.loads(line[len("RESULT "):])
    for theirs in versions.pop("results"):
        side, answers = ours[theirs["task"], theirs["sample"], theirs["method"]]
        same = next((k for k, (a, b) in enumerate(zip(side["tokens"], theirs["tokens"])) if a != b),
                    min(len(side["tokens"]), len(theirs["tokens"])))
        row = {"benchmark": "kvpress_check", "method": theirs["method"], "budget": args.budget,
               "length": args.length, "seed": args.seed, "task": theirs["task"], "sample": theirs["sample"],
               **agreement(side["positions"], theirs["positions"]), "tokens_alike": same,
               "tokens": max(len(side["tokens"]), len(theirs["tokens"])),
               "score_ours": string_match_all(tok.decode(side["tokens"], skip_special_tokens=True), answers),
               "score_kvpress": string_match_all(tok.decode(theirs["tokens"], skip_special_tokens=True), answers),
               "haystack": haystack_source("auto"), "kv_dtype": side["kv_dtype"], **versions, **run_metadata("SmolLM2-135M-Instruct", "cpu")}
        print(f"{row['method']:>12} {row['task']}/{row['sample']}: Jaccard {row['jaccard']:.3f}, heads same "
              f"{row['heads_same']}/{row['heads']}, tokens alike {same}/{row['tokens']}, scores "
              f"{row['score_ours']:.2f} / {row['score_kvpress']:.2f}")
        if args.out:
            append_jsonl(args.out / "kvpress.jsonl", row)


def table(rows: list[dict]) -> str:
    """Per method: how alike the kept sets are, the greedy tokens alike, and the RULER scores of both sides paired
    over the prompts."""
    from .stats import paired, paired_cell

    lines = ["| method | prompts | kept per head (ours / kvpress) | Jaccard of kept sets: mean (least head) | heads "
             "keeping the same set | greedy tokens all alike | string_match_all × 100 (ours / kvpress) | ours − "
             "kvpress |", "|---|---|---|---|---|---|---|---|"]
    for method in [m for m in PRESSES if any(r["method"] == m for r in rows)]:
        mine = [r for r in rows if r["method"] == method]
        n = len(mine)
        ours, theirs = [r["score_ours"] for r in mine], [r["score_kvpress"] for r in mine]
        lines.append(
            f"| {method} | {n} | {sum(r['kept_ours'] for r in mine) / n:.0f} / "
            f"{sum(r['kept_kvpress'] for r in mine) / n:.0f} | {sum(r['jaccard'] for r in mine) / n:.3f} "
            f"({min(r['jaccard_min'] for r in mine):.3f}) | {sum(r['heads_same'] for r in mine)} of "
            f"{sum(r['heads'] for r in mine)} | {sum(r['tokens_alike'] == r['tokens'] for r in mine)} of {n} | "
            f"{100 * sum(ours) / n:.1f} / {100 * sum(theirs) / n:.1f} | "
            f"{paired_cell(paired(ours, theirs), 100, 1, 'higher')} |")
    first = rows[0]
    return (f"{len({(r['task'], r['sample']) for r in rows})} RULER-style prompts of {first['length']:,} tokens "
            f"(seed {first['seed']}), the project's caches at {first['budget']:.0%} of FullKV's bytes and kvpress "
            f"{first['kvpress']} (transformers {first['kvpress_transformers']}) keeping as many tokens per head, "
            f"commit {', '.join(sorted({r['commit'] for r in rows}))}.\n\n" + "\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kvpress_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", type=lambda s: s.split(","), default=list(PRESSES))
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=3, help="prompts per task (4 tasks)")
    parser.add_argument("--seed", type=int, default=2, help="RULER draw (2: a development draw)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="folder for kvpress.jsonl (none: print only)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # kvpress's side, in its environment
    args = parser.parse_args(argv)
    if args.worker:
        from importlib.metadata import version

        results = press_side(json.loads(Path(args.worker).read_text()))
        print("RESULT " + json.dumps({"results": results, "kvpress": version("kvpress"),
                                      "kvpress_transformers": version("transformers")}))
        return
    unknown = sorted(set(args.methods) - set(PRESSES))
    if unknown:
        raise SystemExit(f"no kvpress counterpart for {unknown}; compared: {', '.join(PRESSES)}")
    run(args)


if __name__ == "__main__":
    main()
