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
    phase: dict[str, str] = field(default_factory=dict)  # "queued" or "running"
    live: dict[str, RunView] = field(default_factory=dict)
    replays: dict[str, tuple[str, int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def arm(self, key: str) -> None:
        """Generate was pressed: a fresh flag, set aside while the run waits in the queue."""
        with self._lock:
            self.stops[key] = threading.Event()
            self.phase[key] = "queued"

    def start(self, key: str) -> threading.Event | None:
        """The run leaves the queue: its flag, or None when Stop came first (the run must not start)."""
        with self._lock:
            flag = self.stops.setdefault(key, threading.Event())
            if flag.is_set():
                self.phase.pop(key, None)
                return None
            self.phase[key] = "running"
            return flag

    def finish(self, key: str) -> None:
        with self._lock:
            self.phase.pop(key, None)

    def stop(self, key: str) -> str | None:
        """-> "queued" or "running" for what was stopped, None when this tab has nothing to stop."""
        with self._lock:
            phase = self.phase.get(key)
            if phase is not None:
                self.stops[key].set()
            return phase

    def forget(self, key: str) -> None:
        """The tab closed: stop its run and drop its state."""
        self.stop(key)
        with self._lock:
            for table in (self.live, self.replays):
                table.pop(key, None)
