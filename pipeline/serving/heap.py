"""The start-up heap, kept out of the garbage collector's way.

A served process holds several hundred thousand Python objects that live as long as it does:
the models' modules and transformers' and torch's tables, and with `engine.compile` the compiled
graphs' code, guards and symbolic shapes. CPython's cyclic collector walks every one of them in
each full (oldest-generation) collection, holding the GIL, so the step loop and every row in it
wait it out (hundreds of milliseconds a collection on the embedded default: docs/serving.md,
`python -m benchmarks.gc_heap`).

`freeze()` runs once the server is warm, before /health turns 200, as vLLM's engine core does
after its start-up (`freeze_gc_heap`): a full collection, then `gc.freeze()`, which moves every
object tracked then to a permanent generation the collector skips. A draft swap freezes again
(`refreeze`: the old draft's objects are unfrozen and collected first, so a cycle among them is
not kept for the process's life; that one collection pauses the loop as any full one does).
`release()` at shutdown: the last holder in the process (tests run many servers in one) gives
the heap back to the collector.

`GCPauses` times every collection (`gc.callbacks`) for the histogram `phoenix:gc_pause_seconds`
by generation, so a pause shows on /metrics rather than as an unexplained stall. The callback
only appends to a deque: a collection can start on any thread at any allocation, one holding a
metric's lock included, so the histogram is fed when /metrics is read (`drain`), not from
inside the collection.
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
    """Collect every generation, then freeze what is left (`gc.freeze`), and hold the heap
    frozen until `release`. Returns (objects frozen by this call, seconds the full collection
    took: what each such collection cost before)."""
    global _holders
    with _lock:
        _holders += 1
        return _collect_and_freeze()


def refreeze() -> tuple[int, float]:
    """Freeze again after objects frozen earlier may have died (a swapped-out draft): back to
    the collector first, so cyclic garbage among them is collected. Holders unchanged."""
    with _lock:
        gc.unfreeze()
        return _collect_and_freeze()


def release() -> None:
    """One holder lets go; the last gives the heap back to the collector (`gc.freeze` is the
    process's, and tests run several servers in one)."""
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
    """Every garbage collection while attached: (generation, seconds), kept until `drain`ed
    (the newest 10,000 young ones; full ones apart, so frequent young collections between two
    reads of /metrics cannot push them out)."""

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
