"""A stand-in for ZeroGPU's ``spaces.GPU`` that crosses the same boundary on a CPU: the call runs in a forked
process; its arguments are pickled there and every value it returns or yields is pickled back; closing the
generator on this side sets an event the worker checks after each yield, as ``spaces.zero.wrappers`` does. (The
real decorator needs CUDA in its worker: its torch patches read the CUDA version at import.)"""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import os
import pickle
import traceback

CONTEXT = multiprocessing.get_context("fork")
MAX_SECONDS = 120  # what a call may ask for (ui/jobs.py keeps within a free visitor's quota)


class ForkedGPU:
    def __init__(self):
        self.calls: list[dict] = []  # per call: the seconds it asked for, the worker's pid
        self.last = None

    def __call__(self, task=None, *, duration=None, **_):
        if task is None:
            return functools.partial(self.__call__, duration=duration)
        run = self._stream if inspect.isgeneratorfunction(task) else self._call

        @functools.wraps(task)
        def handler(*args, **kwargs):
            seconds = duration(*args, **kwargs) if callable(duration) else duration
            assert seconds is not None and 0 < seconds <= MAX_SECONDS, seconds
            payload = pickle.dumps((args, kwargs))  # what ZeroGPU sends to its worker
            return run(task, payload, seconds)
        return handler

    def _start(self, task, payload, seconds):
        results, stop = CONTEXT.Queue(), CONTEXT.Event()
        worker = CONTEXT.Process(target=_work, args=(task, payload, results, stop), daemon=True)
        worker.start()
        self.last = worker
        self.calls.append({"seconds": seconds, "pid": worker.pid})
        return worker, results, stop

    def _call(self, task, payload, seconds):
        worker, results, _ = self._start(task, payload, seconds)
        kind, value = results.get(timeout=600)
        worker.join(timeout=60)
        if kind == "error":
            raise RuntimeError(value)
        return pickle.loads(value)

    def _stream(self, task, payload, seconds):
        worker, results, stop = self._start(task, payload, seconds)
        try:
            while True:
                kind, value = results.get(timeout=600)
                if kind == "end":
                    break
                if kind == "error":
                    raise RuntimeError(value)
                yield pickle.loads(value)
        except GeneratorExit:
            stop.set()
            raise
        finally:
            worker.join(timeout=60)


def _work(task, payload, results, stop) -> None:
    import torch

    # The parent's OpenMP pool does not survive a fork (a GNU libgomp child can hang in its first parallel
    # region); ZeroGPU's workers compute on the GPU, these on one CPU thread.
    torch.set_num_threads(1)
    args, kwargs = pickle.loads(payload)
    try:
        out = task(*args, **kwargs)
        if not inspect.isgenerator(out):
            results.put(("value", pickle.dumps(out)))
            return
        for item in out:
            if stop.is_set():
                out.close()
                break
            results.put(("item", pickle.dumps(item)))
        results.put(("end", None))
    except Exception:  # noqa: BLE001 - the caller shows it, as ZeroGPU does
        results.put(("error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)  # no atexit handlers of the parent's (the database pool among them) run in the worker
