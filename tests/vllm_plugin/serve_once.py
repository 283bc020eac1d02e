"""One vLLM engine in a fresh process (the tests start one per setting: vLLM keeps process-wide state), greedy
generation of every prompt together; prints a JSON line with each request's tokens, and with QEvict on, its
windows per layer and what vLLM got back.

    python -m tests.vllm_plugin.serve_once '{"prompts": [[1, 2, ...]], "max_tokens": 32, "settings": {"budget": 0.2},
                                           "llm": {"max_num_batched_tokens": 512}}'
"""

from __future__ import annotations

import json
import os
import sys

from bench.vllm_plugin import VLLM_ENV, tiers

PREEMPTED = [0]


def main() -> None:
    job = json.loads(sys.argv[1])
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import qevict_vllm
    from qevict_core.models import converted_dir
    from qevict_vllm import connector

    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule

    def counting(self, *args, **kwargs):  # how many requests vLLM preempted, for the tests that make it
        out = schedule(self, *args, **kwargs)
        PREEMPTED[0] += len(out.preempted_req_ids or ())
        return out

    Scheduler.schedule = counting
    settings = job.get("settings")
    options = qevict_vllm.options(**settings) if settings is not None else {"block_size": 32,
                                                                             "enable_prefix_caching": False}
    llm = LLM(model=str(converted_dir()), dtype="float32", enforce_eager=True, **options,
              **{"max_model_len": 4096, **job.get("llm", {})})
    if settings is not None:
        connector.ACTIVE["worker"].retain = len(job["prompts"])  # finished requests stay inspectable
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]],
                        SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True))
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "request_ids": [o.request_id for o in outs]}
    if settings is not None:
        registry = connector.ACTIVE["worker"]
        running = [*registry.finished.values(), *registry.by_block.values()]
        report = qevict_vllm.report()

        def internal(request_id: str) -> str:  # vLLM adds a suffix to the ids it hands back
            return next(r.req_id for r in running if r.req_id == request_id or r.req_id.startswith(request_id + "-"))

        ids = [internal(o.request_id) for o in outs]
        by_id = {r.req_id: r for r in running}
        caches = [by_id[i].cache for i in ids]  # None: vLLM served it alone (its budget holds every token)
        result["tiers"] = [tiers(c) if c is not None else None for c in caches]
        result["moves"] = [c.summary() if c is not None else None for c in caches]
        result["blocks_freed"] = [report["blocks_freed"].get(i, 0) for i in ids]
        result["blocks_kept"] = [report["blocks_kept"].get(i) for i in ids]
        result["bytes"] = [report["requests"][i]["total_bytes"] for i in ids]
    result["preempted"] = PREEMPTED[0]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
