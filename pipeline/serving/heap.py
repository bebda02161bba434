"""The start-up heap, kept out of the garbage collector's way.

A served process holds several hundred thousand Python objects that live as long as it does:
the models' modules and transformers' and torch's tables, and with `engine.compile` the compiled
graphs' code, guards and symbolic shapes. CPython's cyclic collector walks every one of them in
each full (oldest-generation) collection, holding the GIL, so the step loop and every row in it
wait it out: 402,000 objects and 155 ms a collection with the embedded default served eager,
1,345,000 and 620 ms with its pass compiled (Intel Xeon; `python -m benchmarks.gc_heap`).

`freeze()` runs once the server is warm, before /health turns 200, as vLLM's engine core does
after its start-up (`freeze_gc_heap`): a full collection, then `gc.freeze()`, which moves every
object tracked then to a permanent generation the collector skips. A draft swap freezes again
(`refreeze`: the old draft's objects are unfrozen and collected first, so a cycle among them is
not kept for the process's life). `unfreeze()` at shutdown gives the heap back to the collector
(tests run many servers in one process).

`GCPauses` times every collection (`gc.callbacks`) for the histogram `phoenix:gc_pause_seconds`
by generation, so a pause shows on /metrics rather than as an unexplained stall. The callback
only appends to a deque: a collection can start on any thread at any allocation, one holding a
metric's lock included, so the histogram is fed when /metrics is read (`drain`), not from
inside the collection.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Iterator

log = logging.getLogger(__name__)


def freeze() -> tuple[int, float]:
    """Collect every generation, then freeze what is left (`gc.freeze`). Returns (objects
    frozen by this call, seconds the full collection took: what each such collection cost
    before)."""
    t0 = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t0
    before = gc.get_freeze_count()
    gc.freeze()
    return gc.get_freeze_count() - before, took


def refreeze() -> tuple[int, float]:
    """`freeze` again after objects frozen earlier may have died (a swapped-out draft): back
    to the collector first, so cyclic garbage among them is collected."""
    gc.unfreeze()
    return freeze()


def unfreeze() -> None:
    gc.unfreeze()


def frozen() -> int:
    return gc.get_freeze_count()


class GCPauses:
    """Every garbage collection while attached: (generation, seconds), kept until `drain`ed
    (the newest 10,000)."""

    def __init__(self):
        self.pending: deque[tuple[int, float]] = deque(maxlen=10_000)
        self._start: float | None = None
        self.attached = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.pending.append(
                (int(info.get("generation", -1)), time.perf_counter() - self._start)
            )
            self._start = None

    def drain(self) -> Iterator[tuple[int, float]]:
        while self.pending:
            yield self.pending.popleft()

    def attach(self) -> None:
        if not self.attached:
            gc.callbacks.append(self._callback)
            self.attached = True

    def detach(self) -> None:
        if self.attached:
            gc.callbacks.remove(self._callback)
            self.attached = False
