"""The step loop's thread (the only one in serving): it owns the models and every running row.

`submit` does not block; `Job.on_done` is called once from the loop with the result,
`Cancelled` (before joining) or the error. Between steps the loop runs `call`s, drops cancelled
rows (they finish with their output so far) and admits waiting jobs in order up to the batch's
room, once more for those that arrived during that prefill. A failing step fails its rows, a
failing prefill its joiners; the loop goes on.

Only the loop's thread runs torch while it lives (idle OpenMP pools slow every pass:
docs/serving.md): `start=False` runs on the caller's thread (`drain`) until `start()`, and other
torch work beside a running loop goes through `apart`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..speculative.arms import Arm
from ..speculative.batch import Row, RowBatch
from ..speculative.row import GenerationResult
from ..speculative.sampling import GREEDY, Sampling
from .request import Cancelled, Refused

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    """One request as the loop runs it. `on_tokens(output, logprobs or None)` after each step that
    added tokens; True ends the row. `cancel`: leave after this step (before joining:
    `Cancelled`). `on_done(job)` once, with `result` or `error` and `epoch` (draft epoch joined)."""

    prompt: list[int]
    max_tokens: int
    arm: Arm
    on_done: Callable[[Job], None]
    on_tokens: Callable[[list[int], list | None], bool] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    result: GenerationResult | None = None
    error: BaseException | None = None
    epoch: int = -1
    sampling: Sampling = GREEDY
    adaptive: bool = False  # the bandit chose its arm: the scheduler's gate may cap its guesses


def background(fn: Callable[[], object], name: str) -> threading.Thread:
    """Run `fn` on a daemon thread (model loading, the draft watcher); exit does not wait."""
    thread = threading.Thread(target=fn, name=name, daemon=True)
    thread.start()
    return thread


def apart(fn: Callable[[], object], name: str = "phoenix-apart") -> object:
    """Run `fn` on a short-lived thread and wait: its value, or its error raised here (torch
    work beside a running loop: the thread's OpenMP pool ends with it)."""
    box: list = [None, None]

    def run() -> None:
        try:
            box[0] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            box[1] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if box[1] is not None:
        raise box[1]
    return box[0]


class Scheduler:
    def __init__(
        self,
        batch: RowBatch,
        name: str = "phoenix-steps",
        gate: Callable[[list[Row]], list[int]] | None = None,
        start: bool = True,
    ):
        """`gate`: `RowBatch.step`'s, called on the loop's thread. `start=False`: no thread until
        `start()`; `call` and `drain` run on the caller's."""
        self.batch = batch
        self.gate = gate
        self.queue: queue.Queue[Job] = queue.Queue()
        self.calls: queue.Queue[tuple[Callable, threading.Event, list]] = queue.Queue()
        self._wake = threading.Event()
        self._stopping = False
        self._last_beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if start:
            self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> None:
        """Start the loop's thread (once); from now on it alone runs the models."""
        if not self.started:
            self._thread.start()

    # -- callers' side --------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.batch.rows)

    @property
    def waiting(self) -> int:
        return self.queue.qsize()

    def submit(self, job: Job) -> None:
        """Queue a job (refused at once, through `on_done`, if it cannot join)."""
        try:
            self.batch.check(job.prompt, job.max_tokens, job.arm)
        except ValueError as exc:
            self._done(job, error=Refused(str(exc)))
            return
        if self._stopping:
            self._done(job, error=Cancelled("the server is shutting down"))
            return
        self.queue.put(job)
        self._wake.set()

    def call(self, fn: Callable[[RowBatch], object], timeout: float | None = None) -> object:
        """Run `fn(batch)` between two steps (not started: here); its value, or its error raised."""
        if not self.started:
            with torch.inference_mode():
                return fn(self.batch)
        done, box = threading.Event(), []
        self.calls.put((fn, done, box))
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError("the step loop did not take the call in time")
        value, error = box
        if error is not None:
            raise error
        return value

    def stalled_s(self) -> float:
        """Seconds with work in hand and no step finished (0.0 when idle)."""
        busy = self.batch.rows or not self.queue.empty()
        return time.monotonic() - self._last_beat if busy else 0.0

    def stop(self, timeout: float = 5.0) -> None:
        """End the loop after its current step; jobs still waiting hear `Cancelled`."""
        self._stopping = True
        self._wake.set()
        if self.started:
            self._thread.join(timeout)
        else:
            self._close()

    def drain(self) -> None:
        """Not started: run the loop here until every job submitted so far has finished."""
        if self.started:
            raise RuntimeError("drain: the loop runs on its own thread")
        with torch.inference_mode():
            while not self._stopping and (self.batch.rows or not self.queue.empty()):
                self._once()

    # -- the loop -------------------------------------------------------------------------------
    def _beat(self) -> None:
        self._last_beat = time.monotonic()

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                self._run_calls()
                if not self.batch.rows and self.queue.empty():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    self._beat()
                    continue
                self._once()
        self._close()

    def _once(self) -> None:
        """Drop the cancelled, admit (twice: a burst joins whole), step."""
        self._drop_cancelled()
        if self._admit() and self.batch.room and not self.queue.empty():
            self._admit()  # those that arrived during that prefill: a burst joins whole
        if self.batch.rows:
            self._step()
        self._beat()

    def _close(self) -> None:
        for row in self.batch.reset():
            self._done(row.key, error=Cancelled("the server is shutting down"))
        while not self.queue.empty():
            self._done(self.queue.get_nowait(), error=Cancelled("the server is shutting down"))

    def _run_calls(self) -> None:
        while True:
            try:
                fn, done, box = self.calls.get_nowait()
            except queue.Empty:
                return
            try:
                box[:] = [fn(self.batch), None]
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                box[:] = [None, exc]
            done.set()

    def _done(self, job: Job, result=None, error=None) -> None:
        job.result, job.error = result, error
        try:
            job.on_done(job)
        except Exception:  # noqa: BLE001 - a caller's bug must not stop the loop
            log.exception("a request's completion failed")

    def _finish(self, row: Row, reason: str) -> None:
        job: Job = row.key
        self._done(job, result=row.result(reason, queued_s=row.start - job.submitted))

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.batch.rows if r.key.cancel.is_set()]:
            self.batch.leave(row)
            self._finish(row, "stop")

    def _admit(self) -> bool:
        """Let waiting jobs join, in order, up to the batch's room; whether any joined."""
        jobs: list[Job] = []
        while len(jobs) < self.batch.room:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job.cancel.is_set():
                self._done(job, error=Cancelled("cancelled while waiting to join"))
            else:
                jobs.append(job)
        if not jobs:
            return False
        try:
            rows = self.batch.join([(j, j.prompt, j.max_tokens, j.arm, j.sampling) for j in jobs])
        except Exception as exc:  # noqa: BLE001 - only the joiners fail
            log.exception("prefill failed for %d joining requests", len(jobs))
            for job in jobs:
                self._done(job, error=exc)
            return False
        for row in rows:
            row.key.epoch = row.epoch
            row.adaptive = row.key.adaptive
        self._beat()
        return True

    def _step(self) -> None:
        def on_tokens(row: Row) -> bool:
            job: Job = row.key
            stop = job.on_tokens is not None and job.on_tokens(row.out, row.logprobs)
            return stop or job.cancel.is_set()

        try:
            finished = self.batch.step(on_tokens, self.gate)
        except Exception as exc:  # noqa: BLE001 - the step's rows hear of it; the loop goes on
            log.exception("step failed; its %d requests fail with it", len(self.batch.rows))
            for row in self.batch.reset():
                self._done(row.key, error=exc)
            return
        for row, reason in finished:
            self._finish(row, reason)
