"""vLLM alone against vLLM + QEvict as a server operator meets them: for each setting an OpenAI-compatible vLLM
server on the same fixed KV pool, every prompt sent at once, measured by vLLM's own serving benchmark
(``vllm.benchmarks.serve``, what ``vllm bench serve`` runs). Run from ``bench.vllm_plugin served``.

The prompts are the RULER-style default tasks (bench.ruler's, seed ``--seed``, ``--samples`` per task at each of
``--lengths``), chat-templated as text, each with its task's answer length. Per setting, one JSONL row: vLLM's
benchmark result (request and output-token throughput, time to first token, time per output token and end-to-end
latency: mean, median, p90, p99), each prompt's string_match_all, and what the server's Prometheus metrics said
while it ran (polled every 0.2 s): the most requests running at once (admitted), the most waiting, the highest KV
pool use. Settings run one after another in separate servers, the order reversed every other round: the speed
columns compare processes back to back on a shared machine, a direction rather than a figure.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from .ruler_tasks import DEFAULT_TASKS, TASKS, sample_seed, sized_sample, string_match_all

METRICS = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
           "kv_use": "vllm:kv_cache_usage_perc"}
PERCENTILES = "50,90,99"
DTYPE = "float32"  # the served model's dtype, and so its KV cache's (vLLM's cache_dtype "auto")


def prompts(lengths: list[int], samples: int, seed: int) -> list[dict]:
    """The prompts as vLLM's custom dataset takes them (``prompt`` text, ``output_tokens``), with their answers."""
    from qevict_core import load_model

    _, tok = load_model()
    jobs = []
    for length in lengths:
        for task in DEFAULT_TASKS:
            for i in range(samples):
                sample, ids = sized_sample(tok, task, length, sample_seed(task, length, i, seed), None, "auto")
                jobs.append({"prompt": tok.decode(ids[0]), "output_tokens": TASKS[task].max_new_tokens,
                             "task": task, "length": length, "sample": i, "answers": list(sample.answers)})
    return jobs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: str, port: int, budget: float | None, kv_space_gib: int, max_len: int):
    """An OpenAI server of vLLM on ``port``: KV blocks of 32 tokens, no prefix caching, the pool fixed at
    ``kv_space_gib``; with QEvict at ``budget`` when given (its options as the server's flags)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    flags = ["--model", model_dir, "--dtype", DTYPE, "--max-model-len", str(max_len), "--port", str(port),
             "--block-size", "32", "--no-enable-prefix-caching"]
    if budget is not None:
        import qevict_vllm

        options = qevict_vllm.options(budget=budget)  # checks the settings; sets the opt-in the server inherits
        env["QEVICT_VLLM"] = os.environ["QEVICT_VLLM"]
        flags += ["--kv-transfer-config", json.dumps(options["kv_transfer_config"]),
                  "--worker-extension-cls", options["worker_extension_cls"]]
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    return proc, log.name


def wait_ready(port: int, proc, log: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({proc.returncode}):\n{Path(log).read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"the vLLM server was not ready in {timeout:.0f} s:\n{Path(log).read_text()[-3000:]}")


class MetricsPoller(threading.Thread):
    """The highest value of each of ``METRICS`` the server's /metrics showed while polled."""

    def __init__(self, port: int, every: float = 0.2):
        super().__init__(daemon=True)
        self.url, self.every, self.done = f"http://127.0.0.1:{port}/metrics", every, threading.Event()
        self.peak = {name: 0.0 for name in METRICS}

    def run(self) -> None:
        while not self.done.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=2) as reply:
                    text = reply.read().decode()
                for name, metric in METRICS.items():
                    for value in re.findall(rf"^{re.escape(metric)}\{{[^}}]*\}} ([0-9.eE+-]+)$", text, re.M):
                        self.peak[name] = max(self.peak[name], float(value))
            except OSError:
                pass
            self.done.wait(self.every)


def benchmark(port: int, model_dir: str, dataset: Path, requests: int, out: Path) -> dict:
    """vLLM's serving benchmark against the server on ``port``: every request at once (infinite rate), greedy."""
    import argparse

    from vllm.benchmarks import serve

    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
        "--model", model_dir, "--tokenizer", model_dir, "--dataset-name", "custom", "--dataset-path", str(dataset),
        "--disable-shuffle", "--skip-chat-template", "--num-prompts", str(requests), "--request-rate", "inf",
        "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES,
        "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", "vllm-bench.json"])
    return serve.main(args)


def run_setting(model_dir: str, jobs: list[dict], dataset: Path, budget: float | None, kv_space_gib: int,
                max_len: int) -> dict:
    port = free_port()
    proc, log = start_server(model_dir, port, budget, kv_space_gib, max_len)
    try:
        wait_ready(port, proc, log)
        poller = MetricsPoller(port)
        poller.start()
        with tempfile.TemporaryDirectory() as folder:
            result = benchmark(port, model_dir, dataset, len(jobs), Path(folder))
        poller.done.set()
        poller.join()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    os.unlink(log)  # kept only when the server failed: the error quotes it
    texts = result.pop("generated_texts")
    scores = [string_match_all(text, tuple(job["answers"])) for text, job in zip(texts, jobs)]
    keep = {k: v for k, v in result.items() if isinstance(v, (int, float, str)) and not k.startswith("date")}
    return {**keep, "scores": scores, "errors": sum(bool(e) for e in result.get("errors", [])),
            "peak_running": poller.peak["running"], "peak_waiting": poller.peak["waiting"],
            "peak_kv_use": poller.peak["kv_use"]}


def served(args, meta: dict):
    """Every setting (vLLM alone, then QEvict at each budget), ``args.rounds`` rounds: yields a row each."""
    from qevict_core.models import converted_dir

    lengths = [int(n) for n in args.lengths.split(",")]
    jobs = prompts(lengths, args.samples, args.seed)
    settings = [None] + [float(b) for b in args.budgets.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        dataset = Path(folder) / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": j["prompt"], "output_tokens": j["output_tokens"]}) + "\n"
                                   for j in jobs))
        for round_ in range(args.rounds):
            for budget in settings if round_ % 2 == 0 else settings[::-1]:
                measured = run_setting(str(converted_dir()), jobs, dataset, budget, args.kv_space, max(lengths))
                row = {"benchmark": "vllm_served", "method": "qevict" if budget is not None else "vllm",
                       "budget": budget, "round": round_, "lengths": lengths, "seed": args.seed,
                       "kv_space_gib": args.kv_space, "requests": len(jobs),
                       "samples": [[j["task"], j["length"], j["sample"]] for j in jobs], **measured, **meta}
                print(f"round {round_} {row['method']} @{budget}: score "
                      f"{100 * sum(row['scores']) / len(jobs):.1f}, {row['request_throughput']:.3f} req/s, "
                      f"admitted at most {row['peak_running']:.0f} at once ({row['peak_waiting']:.0f} waiting), "
                      f"TTFT p50 {row['median_ttft_ms']:.0f} ms", flush=True)
                yield row


def table(rows: list[dict]) -> str:
    """Per setting: retrieval paired with vLLM alone over the same prompts (the first round's answers), the most
    requests admitted and waiting at once in any round, and vLLM's benchmark figures, medians over rounds:
    throughput, latency percentiles."""
    from statistics import median

    from .stats import paired, paired_cell

    alone = [r for r in rows if r["method"] == "vllm"]
    if not alone:
        return "No vLLM-alone rows to compare with.\n"
    lines = ["| setting | string_match_all × 100 | − vLLM alone | admitted at once (most; waiting) | requests/s | "
             "output tokens/s | TTFT p50 / p99 s | TPOT p50 / p99 ms | end to end p50 / p99 s | failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for budget in [None] + sorted({r["budget"] for r in rows if r["budget"] is not None}):
        mine = [r for r in rows if r["budget"] == budget]

        def mid(key: str) -> float:
            return median(r[key] for r in mine)

        scores = mine[0]["scores"]
        diff = "—" if budget is None else paired_cell(paired(scores, alone[0]["scores"]), 100, 1, "higher")
        name = "vLLM alone" if budget is None else f"vLLM + QEvict @{budget:.0%}"
        lines.append(f"| {name} | {100 * sum(scores) / len(scores):.1f} | {diff} | "
                     f"{max(r['peak_running'] for r in mine):.0f}; {max(r['peak_waiting'] for r in mine):.0f} | "
                     f"{mid('request_throughput'):.3f} | {mid('output_throughput'):.1f} | "
                     f"{mid('p50_ttft_ms') / 1000:.1f} / {mid('p99_ttft_ms') / 1000:.1f} | "
                     f"{mid('p50_tpot_ms'):.0f} / {mid('p99_tpot_ms'):.0f} | {mid('p50_e2el_ms') / 1000:.1f} / "
                     f"{mid('p99_e2el_ms') / 1000:.1f} | {mid('failed'):.0f} |")
    first = rows[0]
    lengths = ", ".join(f"{n:,}" for n in first["lengths"])
    return (f"{first['requests']} RULER-style prompts ({lengths} tokens, seed {first['seed']}) sent at once to a vLLM "
            f"server with a {first['kv_space_gib']:g} GiB KV pool in {DTYPE} (the served model's dtype), measured "
            f"by vLLM's serving benchmark; "
            f"{len(alone)} round(s) per setting, vLLM {first['vllm']}, commit "
            f"{', '.join(sorted({r['commit'] for r in rows}))}, {first['cores']} cores.\n\n" + "\n".join(lines) + "\n")
