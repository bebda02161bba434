"""The start-up heap frozen out of the garbage collector's way (as vLLM's `freeze_gc_heap`),
and GC pauses timed for `phoenix:gc_pause_seconds` (why: docs/serving.md).

`freeze()` once warm, `refreeze()` after a draft swap, `release()` at shutdown (the last holder
in the process unfreezes). `GCPauses`' callback only appends to a deque (a collection may start
on a thread holding a metric's lock); /metrics `drain`s it.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import deque
from collections.abc import Iterator

_lock = threading.Lock()
_holders = 0  # servers (and benches) in this process that froze the heap and have not let go


def freeze() -> tuple[int, float]:
    """Full collection, then `gc.freeze`, held until `release`. Returns (objects frozen,
    seconds the collection took)."""
    global _holders
    with _lock:
        _holders += 1
        return _collect_and_freeze()


def refreeze() -> tuple[int, float]:
    """Unfreeze, collect (a swapped-out draft's cycles) and freeze again; holders unchanged."""
    with _lock:
        gc.unfreeze()
        return _collect_and_freeze()


def release() -> None:
    """One holder lets go; the last unfreezes (`gc.freeze` is process-wide)."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders == 0:
            gc.unfreeze()


def holders() -> int:
    return _holders


def _collect_and_freeze() -> tuple[int, float]:
    t0 = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t0
    before = gc.get_freeze_count()
    gc.freeze()
    return gc.get_freeze_count() - before, took


class GCPauses:
    """(generation, seconds) of every collection while attached, until `drain`ed (newest 10,000;
    full ones kept apart so young ones cannot push them out)."""

    def __init__(self):
        self.young: deque[tuple[int, float]] = deque(maxlen=10_000)
        self.full: deque[tuple[int, float]] = deque(maxlen=10_000)
        self._start: float | None = None
        self.attached = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            generation = int(info.get("generation", -1))
            took = time.perf_counter() - self._start
            (self.full if generation == 2 else self.young).append((generation, took))
            self._start = None

    def drain(self) -> Iterator[tuple[int, float]]:
        for pending in (self.young, self.full):
            while pending:
                yield pending.popleft()

    def attach(self) -> None:
        if not self.attached:
            gc.callbacks.append(self._callback)
            self.attached = True

    def detach(self) -> None:
        if self.attached:
            gc.callbacks.remove(self._callback)
            self.attached = False
