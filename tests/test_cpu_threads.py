"""A studio run on a CPU reads its prompt on the free cores and decodes on one thread (ui/cpu_threads.py), in
whichever thread Gradio resumes it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from bench.studio_latency import spinning
from qevict_core.testing import tiny_chat_model, tiny_tokenizer
from tests.conftest import random_prompt
from ui import cpu_threads
from ui.jobs import RunJob, run_events

LANES = (("fullkv", "fullkv"), ("qevict", "qevict"))


def test_a_spinning_process_counts_as_another_one_running():
    with spinning(1):
        assert cpu_threads.others_running() >= 1


@pytest.mark.parametrize(("others", "limit", "expected"), [(0, 2, 2), (1, 2, 1), (5, 2, 1), (0, 1, 1)])
def test_the_prompt_gets_the_free_cores_at_most_the_studios_count(monkeypatch, others, limit, expected):
    monkeypatch.setattr(cpu_threads, "cores", lambda: 2)
    monkeypatch.setattr(cpu_threads, "others_running", lambda: others)
    assert cpu_threads.prefill_threads(limit) == expected


@pytest.mark.parametrize("others", [0, 1])
def test_a_run_reads_its_prompt_on_the_free_cores_and_decodes_on_one_thread_in_every_worker(monkeypatch, others):
    monkeypatch.setattr(cpu_threads, "cores", lambda: 2)
    monkeypatch.setattr(cpu_threads, "others_running", lambda: others)
    model = tiny_chat_model()
    seen: list[tuple[int, int]] = []  # (tokens fed, the thread count where the forward runs)
    hook = model.register_forward_pre_hook(
        lambda _module, _args, kwargs: seen.append((kwargs["input_ids"].shape[1], torch.get_num_threads())),
        with_kwargs=True)
    prompt = tuple(random_prompt(40)[0].tolist())
    job = RunJob(prompt, LANES, {}, max_new_tokens=6, temperature=0.0, seed=0, stop_file="/nonexistent", threads=2)
    before = torch.get_num_threads()
    try:
        stream = run_events(model, tiny_tokenizer(), job)
        # Gradio resumes a generator in any worker thread, one that may have run torch at two threads in between
        # (each thread keeps its own count): alternate between two that do
        def resume():
            torch.set_num_threads(2)
            return next(stream, None)

        with ThreadPoolExecutor(1) as first, ThreadPoolExecutor(1) as second:
            batches = 0
            while (first, second)[batches % 2].submit(resume).result() is not None:
                batches += 1
    finally:
        hook.remove()
        torch.set_num_threads(before)
    assert batches and seen[0] == (len(prompt), 2 - others)
    assert len(seen) == 6 and all(count == 1 for _, count in seen[1:]), seen
