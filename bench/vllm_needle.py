"""The studio's needle example through vLLM with QEvict, beside the transformers engine on the same token ids.

Run in the vLLM environment (``make test-vllm`` builds it):

    .venv-vllm/bin/python -m bench.vllm_needle --budget 0.2 --out bench/results/vllm

Both sides run QEvict at Ω = 32 (a window is one vLLM KV block): the transformers engine through the model's own
forward, vLLM through the plugin (qevict_vllm). Printed and written as one JSONL row: each side's answer and
whether it holds the expected number, how many greedy tokens agree, how many layers end with the same full and
low-bit windows, the moves between tiers, the KV blocks vLLM got back and the bytes QEvict holds.
"""

from __future__ import annotations

import argparse
from importlib.metadata import version
import os
from pathlib import Path

import torch

from qevict_core import QEvictConfig, load_model, make_cache
from qevict_vllm.settings import config_from
from qevict_core.generation.model_call import call
from ui.examples import EXAMPLES

from .common import append_jsonl, run_metadata

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
            "qevict_bytes": report["requests"][running.req_id]["total_bytes"],
            "fullkv_bytes": report["requests"][running.req_id]["fullkv_bytes"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--out", type=Path, default=None, help="folder for needle.jsonl (none: print only)")
    args = parser.parse_args(argv)
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
           "blocks_freed": served["blocks_freed"], "prompt_blocks": -(-len(ids) // 32),
           "qevict_bytes": served["qevict_bytes"], "fullkv_bytes": served["fullkv_bytes"],
           **run_metadata("SmolLM2-135M-Instruct", "cpu"), "vllm": version("vllm-cpu")}
    row["engine_found"] = example.expected in row["engine_text"]
    row["vllm_found"] = example.expected in row["vllm_text"]
    for key in ("engine_found", "vllm_found", "tokens_agreeing", "layers_same_tiers", "blocks_freed",
                "qevict_bytes", "fullkv_bytes"):
        print(f"{key}: {row[key]}")
    print("vLLM + QEvict:", repr(row["vllm_text"][:120]))
    if args.out:
        append_jsonl(args.out / "needle.jsonl", row)


if __name__ == "__main__":
    main()
