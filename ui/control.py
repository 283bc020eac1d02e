"""Per browser tab: its stop flag, whether its run is queued or running, and its live view.

Stop must reach a run that is still waiting in the queue, and a closed tab must stop its run: both act on this
tab's flag, which Generate arms before it queues (``arm``) and the run reads at every step. Engine objects stay
here, server side, keyed by Gradio's session hash (``gr.State`` would deep-copy them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .view import RunView


@dataclass
class TabRuns:
    stops: dict[str, threading.Event] = field(default_factory=dict)
    queued: dict[str, int] = field(default_factory=dict)  # runs of the tab waiting in the queue
    running: set[str] = field(default_factory=set)
    live: dict[str, RunView] = field(default_factory=dict)
    replays: dict[str, tuple[str, int]] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)  # tabs whose replay Pause stopped: a tick already sent is dropped
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def arm(self, key: str) -> None:
        """Generate was pressed. A fresh flag unless the tab already has runs in flight: Stop then ends them all."""
        with self._lock:
            if key not in self.running and not self.queued.get(key):
                self.stops[key] = threading.Event()
            self.queued[key] = self.queued.get(key, 0) + 1

    def start(self, key: str) -> threading.Event | None:
        """A run leaves the queue: its flag, or None when Stop came first (the run must not start). A run that
        was never armed (an API call) gets a fresh flag."""
        with self._lock:
            if self.queued.get(key):
                self.queued[key] -= 1
            elif key not in self.running:
                self.stops[key] = threading.Event()
            flag = self.stops.setdefault(key, threading.Event())
            if flag.is_set():
                return None
            self.running.add(key)
            return flag

    def finish(self, key: str) -> None:
        with self._lock:
            self.running.discard(key)

    def stop(self, key: str) -> str | None:
        """-> "running" or "queued" for what was stopped, None when this tab has nothing to stop."""
        with self._lock:
            phase = "running" if key in self.running else "queued" if self.queued.get(key) else None
            if phase is not None:
                self.stops[key].set()
            return phase

    def forget(self, key: str) -> None:
        """The tab closed: stop its runs and drop its views."""
        self.stop(key)
        with self._lock:
            for table in (self.live, self.replays):
                table.pop(key, None)
            self.paused.discard(key)
