"""What the studio asks of the model, as jobs whose inputs and outputs are plain data.

On a ZeroGPU Space, a function wrapped in ``spaces.GPU`` runs in a process forked for the GPU: its arguments are
pickled there and everything it yields is pickled back. So a job carries only ids, names and numbers; it builds its
own caches, runs, and yields event dicts; storage, the tab's stop flag and the views stay in the studio's process.
Stop crosses as a file the studio touches (``RunJob.stop_file``): a forked worker sees the same disk, and ZeroGPU
reuses a worker across calls, so no object made before the fork could carry it. The same code runs everywhere;
elsewhere ``ui.gpu.GPU`` is a no-op and the job runs in the studio's own thread.

Durations: ZeroGPU schedules a call for the seconds its ``duration`` says and counts them against the visitor's
daily quota, so each job asks for what its size needs, within ``MAX_SECONDS``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import torch

from qevict_core import Lane, QEvictConfig, Sampling, generate_lanes, make_cache
from qevict_core.generation.graphs import can_replay

from .cpu_threads import RunThreads

MAX_SECONDS = 120  # the most one call asks for: a free visitor's quota is a few minutes a day
# What an H200 slice needs, generously: a decode step of three SmolLM2 lanes (eager, ~40 ms), and prefill.
STEP_SECONDS = 0.06
PREFILL_TOKENS_PER_SECOND = 20_000


@dataclass(frozen=True)
class RunJob:
    """One Generate: the prompt's ids, the lanes (name, method), the form's config, the sampling, where Stop is
    signalled, the most CPU threads it may use (``cpu_threads.RunThreads``)."""

    input_ids: tuple[int, ...]
    lanes: tuple[tuple[str, str], ...]
    config: dict
    max_new_tokens: int
    temperature: float
    seed: int
    stop_file: str
    threads: int = 1

    @property
    def max_length(self) -> int:
        return len(self.input_ids) + self.max_new_tokens

    def caches(self, model) -> list[Lane]:
        """The lanes' caches, built as the studio built them to describe the run (same inputs, same caches)."""
        config = QEvictConfig.from_dict(self.config)
        return [Lane(name, make_cache(method, model, config, max_length=self.max_length))
                for name, method in self.lanes]


def run_seconds(job: RunJob) -> int:
    """The seconds a run asks ZeroGPU for: prefill and decode of every lane, plus start-up, capped."""
    lanes = len(job.lanes)
    needed = 10 + lanes * (len(job.input_ids) / PREFILL_TOKENS_PER_SECOND + job.max_new_tokens * STEP_SECONDS)
    return int(min(MAX_SECONDS, needed))


def run_events(model, tokenizer, job: RunJob) -> Iterator[list[dict]]:
    """The run's events as dicts, one list per lane-step (the lane's token, its routing events, its memory
    report) and the lanes' ends; it stops once ``job.stop_file`` exists, after the step in flight. On a GPU where
    every lane's decode steps can replay from CUDA graphs (FullKV, the eviction baselines and the QEvict methods,
    the default lanes among them), each lane decodes alone from its graphs; otherwise the lanes share
    eager forwards."""
    lanes = job.caches(model)
    sampling = Sampling(max_new_tokens=job.max_new_tokens, temperature=job.temperature, seed=job.seed)
    ids = torch.tensor([job.input_ids])
    pending: list[dict] = []
    threads = RunThreads(next(model.parameters()).device, job.threads)  # the prompt on the free cores
    try:
        for event in generate_lanes(model, tokenizer, ids, lanes, sampling,
                                    should_stop=lambda: os.path.exists(job.stop_file),
                                    graphs=can_replay(model, [lane.cache for lane in lanes])):
            pending.append(event.to_dict())
            if event.kind in ("memory", "done"):
                yield pending
                pending = []
            threads.decoding()  # the prompt is read; a resumed generator runs the next forward in this thread
        if pending:
            yield pending
    finally:
        threads.restore()


@dataclass(frozen=True)
class TimingJob:
    """"Time the lanes alone": the run's lanes rebuilt on its prompt, each decode step timed alone."""

    input_ids: tuple[int, ...]
    lanes: tuple[tuple[str, str], ...]
    config: dict
    new_tokens: int
    rounds: int
    baseline: str


def timing_seconds(job: TimingJob) -> int:
    steps = job.rounds * len(job.lanes) * job.new_tokens
    return int(min(MAX_SECONDS, 10 + steps * STEP_SECONDS + job.rounds * len(job.input_ids) / 2000))


def time_lanes(model, job: TimingJob) -> dict[str, dict[str, float]]:
    """Per lane: ms per token alone and the ratio to the baseline lane (``qevict_core.timing.tpot_ratios``),
    every lane replayed from CUDA graphs where all of them can be, as the run decodes."""
    from qevict_core.timing import tpot_ratios

    run = RunJob(job.input_ids, job.lanes, job.config, job.new_tokens, 0.0, 0, "")
    device = next(model.parameters()).device
    graphs = can_replay(model, [lane.cache for lane in run.caches(model)])
    return tpot_ratios(model, torch.tensor([job.input_ids], device=device),
                       lambda: {lane.name: lane.cache for lane in run.caches(model)}, job.baseline,
                       job.new_tokens, job.rounds, graphs=graphs)


@dataclass(frozen=True)
class LaneDiagnosis:
    """What the diagnostics need of one routed lane: its sequence (prompt + its tokens but the last), its routing
    events by layer (each with its grid), and its number of windows."""

    name: str
    sequence: tuple[int, ...]
    routing: dict
    num_windows: int
    k_full: int


def diagnosis_seconds(lanes: tuple[LaneDiagnosis, ...], prompt_len: int) -> int:
    tokens = sum(len(lane.sequence) for lane in lanes)
    return int(min(MAX_SECONDS, 15 + tokens / 200))


def diagnose(model, lanes: tuple[LaneDiagnosis, ...], prompt_len: int) -> dict[str, dict | str]:
    """Per lane: the paper's diagnostics against FullKV attention over its own tokens, or why they cannot run."""
    from qevict_core import diagnostics as dg

    device = next(model.parameters()).device
    out: dict[str, dict | str] = {}
    for lane in lanes:
        try:
            traces = dg.reference_traces(model, torch.tensor([lane.sequence], device=device), prompt_len)
            out[lane.name] = dg.diagnose(traces, lane.routing, prompt_len, lane.num_windows, lane.k_full)
        except (ValueError, IndexError, KeyError, RuntimeError) as err:  # a stored run this model cannot redo
            out[lane.name] = f"{type(err).__name__}: {str(err)[:200]}"
    return out
