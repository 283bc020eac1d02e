"""How many CPU threads each phase of a studio run gets, on a machine the studio may share.

A prompt is read on the cores that no other process is busy on; the decode steps run on one thread. A decode step
of the studio's lanes is a handful of small operators: split over threads, each operator ends at a barrier that
waits for the slowest thread, and on a shared machine a thread the scheduler has parked stalls them all. Measured
in docs/studio.md (``bench.studio_latency``, quiet and with ``--busy 2``). On a GPU nothing changes.

``torch.set_num_threads`` counts for the thread that calls it (OpenMP), and Gradio may resume a generator in a
different worker thread each time: ``decoding()`` is called before every forward, in the thread that runs it.
"""

from __future__ import annotations

import os
import time

import torch

DECODE_THREADS = 1


def cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def others_running(samples: int = 3, gap: float = 0.01) -> int:
    """Runnable tasks on the machine besides the one asking, the fewest seen over ``samples`` reads of
    /proc/stat (a task that merely passes by is not a load); 0 where the kernel does not say."""
    seen = []
    for i in range(samples):
        try:
            with open("/proc/stat") as stat:
                running = next(int(line.split()[1]) for line in stat if line.startswith("procs_running"))
        except (OSError, StopIteration, ValueError):
            return 0
        seen.append(running - 1)  # the reader is running
        if i + 1 < samples:
            time.sleep(gap)
    return max(0, min(seen))


def prefill_threads(limit: int) -> int:
    """Threads for reading a prompt: the free cores, at least one, at most ``limit``."""
    return max(1, min(limit, cores() - others_running()))


class RunThreads:
    """The thread count of one run on a CPU, at most ``limit``: set for the prompt at creation, one thread for
    the decode steps, ``limit`` back at ``restore`` (in the thread that calls it; the others set their own at their
    next run). Does nothing on another device."""

    def __init__(self, device: torch.device, limit: int):
        self.active, self.limit = device.type == "cpu", max(1, limit)
        self.prefill = prefill_threads(self.limit) if self.active else self.limit
        if self.active:
            torch.set_num_threads(self.prefill)

    def decoding(self) -> None:
        if self.active:
            torch.set_num_threads(min(DECODE_THREADS, self.limit))

    def restore(self) -> None:
        if self.active:
            torch.set_num_threads(self.limit)
