"""Hot swap: a running server picks up a newly promoted draft without failing a request.

A watcher reads <artifacts>/current every `server.reload_poll_s` (`server.draft: latest`);
`POST /admin/reload-draft` asks at once. A reload resolves `server.draft` again; other weights
load beside the old draft while it serves, then swap between two steps (`swap_draft`). A draft
that fails to load leaves the old one serving (logged, sent to Sentry).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from . import compiling, models, specs
from .artifacts import current_pointer, weights_id
from .drafts import resolve_served
from .serving import heap
from .serving.scheduler import apart, background

log = logging.getLogger(__name__)


def same_draft(a: str, b: str) -> bool:
    """The same weights (or, for a Hub id, the same id)."""
    wa, wb = weights_id(a), weights_id(b)
    return wa == wb if wa is not None and wb is not None else a == b


def same_head(head: str | None, core) -> bool:
    """Whether `head` (a directory, or None) is the EAGLE-3 head the core serves now."""
    now = (core.draft_info or {}).get("head")
    return head == now if head is None or now is None else same_draft(head, now)


class DraftReloader:
    def __init__(self, cfg, ws, get_core, telemetry, metrics):
        self.cfg, self.ws = cfg, ws
        self.get_core = get_core  # the ServingCore, once loaded (None before)
        self.telemetry = telemetry
        self.metrics = metrics
        self._lock = threading.Lock()  # one reload at a time
        self._seen = self.pointer()
        self._retry_at = 0.0  # after a failed reload: when the watcher tries again
        self._backoff = 0.0

    def pointer(self) -> str | None:
        """What the watcher compares: where <artifacts>/current points."""
        return current_pointer(self.ws.root)

    def watch(self, poll_s: float, stop: threading.Event) -> threading.Thread:
        def loop() -> None:
            while not stop.wait(poll_s):
                now = self.pointer()
                if now == self._seen or self.get_core() is None:
                    continue
                if time.monotonic() < self._retry_at:
                    continue
                log.info("draft reload: %s/current now points at %s", self.ws.root, now)
                if "error" in self.reload("current changed"):  # retried, less and less often
                    self._backoff = min(300.0, max(poll_s, self._backoff * 2 or poll_s))
                    self._retry_at = time.monotonic() + self._backoff
                else:
                    self._seen, self._backoff = now, 0.0

        return background(loop, "phoenix-draft-watch")

    def _load(self, served, current: models.Pair) -> models.Pair:
        """The new draft beside the served target, warm; run it `apart` (docs/serving.md, "One
        thread runs the models")."""
        ws, spec = self.ws, served.spec
        pair = models.load_pair(self.cfg, ws, spec, share_target=current, head_dir=served.head)
        compiling.compile_engine(self.cfg, self.ws, pair)
        return pair

    def reload(self, reason: str) -> dict[str, Any]:
        """Resolve `server.draft` again and swap if it names other weights. Never raises: returns
        the outcome (logged; a failure also sent to Sentry)."""
        with self._lock:
            t0 = time.perf_counter()
            core = self.get_core()
            if core is None:
                return {"reloaded": False, "reason": "models are still loading"}
            if core.pair is None or core.pair.draft_ref is None:
                return {"reloaded": False, "reason": "this server runs without a draft"}
            old = core.draft_id
            try:
                served = resolve_served(self.cfg, self.ws)
                ref = specs.resolve(served.spec, self.ws.models_cache, core.pair.target_ref)
                if same_draft(ref, core.pair.draft_ref) and same_head(served.head, core):
                    return {"reloaded": False, "reason": "already serving it", "draft": old}
                head = models.is_eagle3(ref)
                if (not head, head or served.head is not None) != (core.has_draft, core.has_head):
                    return {"reloaded": False, "draft": old,
                            "reason": f"{served.spec} is another kind of draft (draft model, "
                            "EAGLE-3 head): restart the server to serve it"}  # fmt: skip
                pair = apart(lambda: self._load(served, core.pair), "phoenix-draft-load")
                if core.has_parallel and pair.models.parallel_token is None:
                    return {"reloaded": False, "draft": old,
                            "reason": f"{served.spec} names no mask token (pard_token), and "
                            "this server's pard:K arms need one: restart the server to serve "
                            "it"}  # fmt: skip
                waited = core.swap_draft(pair, served.label, served.describe())
            except Exception as exc:  # noqa: BLE001 - whatever failed, the old draft serves on
                self.metrics.draft_reloads.labels(outcome="failed").inc()
                # Sentry first, with tags: the logging integration's copy is then a duplicate.
                self.telemetry.event(
                    f"phoenix draft reload failed: {type(exc).__name__}: {exc}",
                    level="error",
                    tags={"draft_reload": "failed", "draft_version": old or "none"},
                    exc=exc,
                )
                log.exception("draft reload failed (%s); still serving %s", reason, old)
                return {"reloaded": False, "error": f"{type(exc).__name__}: {exc}", "draft": old}
            _, collected = heap.refreeze()  # the old draft collected, the new one frozen
            seconds = time.perf_counter() - t0
            self.metrics.set_draft(served.label, served.source)
            self.metrics.draft_reloads.labels(outcome="ok").inc()
            log.info(
                "draft reload (%s): now serving %s (was %s); %.2f s, generation paused %.3f s "
                "for the swap and %.3f s for the old draft's garbage collection",
                reason, served.sentence(), old, seconds, waited, collected,
            )  # fmt: skip
            self.telemetry.event(
                f"phoenix draft swapped: {old} -> {served.label}",
                level="info",
                tags={"draft_reload": "ok", "draft_version": served.label},
            )
            return {
                "reloaded": True,
                "draft": served.label,
                "previous": old,
                "info": served.describe(),
                "seconds": round(seconds, 3),
                "paused_s": round(waited, 3),
            }
