"""Prometheus metrics for `GET /metrics`: vLLM's names and meaning with a `phoenix:` prefix
(counters with `_total`), so speculative-decoding dashboards carry over. One registry per app.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20)
GC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Definition(NamedTuple):
    kind: type  # Counter, Gauge or Histogram
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # a histogram's


# Every metric, in exposition order, by the `Metrics` attribute that holds it. Three gauges
# (fallback_active, waiting, running) read callables given to `Metrics` at each scrape.
# fmt: off
DEFINITIONS: dict[str, Definition] = {
    # speculative decoding: vLLM's names and meaning
    "num_drafts": Definition(Counter, "phoenix:spec_decode_num_drafts",
        "Draft proposals (rounds that drafted)."),
    "num_draft_tokens": Definition(Counter, "phoenix:spec_decode_num_draft_tokens",
        "Draft tokens proposed."),
    "num_accepted_tokens": Definition(Counter, "phoenix:spec_decode_num_accepted_tokens",
        "Draft tokens accepted."),
    "accepted_per_pos": Definition(Counter, "phoenix:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the proposal.", ("position",)),
    # the policy, the drift guard, the served draft, traffic capture
    "arm_choices": Definition(Counter, "phoenix:bandit_arm_choices",
        "Bandit decisions, by arm (k).", ("arm",)),
    "guard_events": Definition(Counter, "phoenix:speculation_guard_events",
        "Drift guard events: fallback (to plain generation) and recovered.", ("event",)),
    "fallback_active": Definition(Gauge, "phoenix:speculation_fallback_active",
        "1 while the drift guard holds bandit requests to plain generation."),
    "draft_info": Definition(Gauge, "phoenix:draft_info",
        "1 for the draft version served now (label version; source: promoted, merged, ...).",
        ("version", "source")),
    "draft_reloads": Definition(Counter, "phoenix:draft_reloads",
        "Draft hot swaps, by outcome (ok, failed).", ("outcome",)),
    "traffic": Definition(Counter, "phoenix:traffic_records",
        "Served requests for traffic capture: captured, dropped (capture paused), opted_out.",
        ("outcome",)),
    # requests and the process
    "generation_tokens": Definition(Counter, "phoenix:generation_tokens",
        "Tokens generated for clients."),
    "request_success": Definition(Counter, "phoenix:request_success",
        "Finished requests, by finish reason.", ("finished_reason",)),
    "rejected": Definition(Counter, "phoenix:request_rejected",
        "Requests refused, by reason (queue_full: a 429).", ("reason",)),
    "latency": Definition(Histogram, "phoenix:e2e_request_latency_seconds",
        "Admission to last token.", buckets=LATENCY_BUCKETS),
    "ttft": Definition(Histogram, "phoenix:time_to_first_token_seconds",
        "Admission to first token.", buckets=TTFT_BUCKETS),
    "gc_pause": Definition(Histogram, "phoenix:gc_pause_seconds",
        "Python garbage collections, by generation (2: full): every row waits them out.",
        ("generation",), GC_BUCKETS),
    "waiting": Definition(Gauge, "phoenix:num_requests_waiting",
        "Admitted requests not generating yet."),
    "running": Definition(Gauge, "phoenix:num_requests_running", "Requests generating."),
}
# fmt: on


class Metrics:
    """One app's metrics (`DEFINITIONS`, each an attribute): `record` once per finished request;
    gauges and GC pauses (`gc_pauses`, a `serving.heap.GCPauses`) read at each scrape."""

    def __init__(
        self,
        queue_depth: Callable[[], float],
        running: Callable[[], float],
        fallback_active: Callable[[], float] = lambda: 0.0,
        gc_pauses=None,
    ):
        self.registry = CollectorRegistry()
        self.gc_pauses = gc_pauses
        reads = {
            "fallback_active": fallback_active,
            "waiting": lambda: max(0.0, queue_depth() - running()),
            "running": running,
        }
        for attr, d in DEFINITIONS.items():
            extra = {"buckets": d.buckets} if d.buckets is not None else {}
            metric = d.kind(d.name, d.help, d.labels, registry=self.registry, **extra)
            if attr in reads:
                metric.set_function(reads[attr])
            setattr(self, attr, metric)

    def set_draft(self, version: str | None, source: str | None) -> None:
        self.draft_info.clear()
        if version is not None:
            self.draft_info.labels(version=version, source=source or "").set(1)

    def record(self, res, wall_s: float) -> None:
        """One finished request: `res` its CoreResult, `wall_s` admission to the end."""
        rec = res.record()
        queued_s = max(0.0, wall_s - rec["latency_s"])
        if rec["proposed"]:
            per_pos = rec["proposed_per_position"]
            self.num_drafts.inc(per_pos[0] if per_pos else 0)
            self.num_draft_tokens.inc(rec["proposed"])
            self.num_accepted_tokens.inc(rec["accepted"])
            for pos, n in enumerate(rec["accepted_per_position"]):
                self.accepted_per_pos.labels(position=str(pos)).inc(n)
        if res.decision is not None:  # the arm the bandit chose (the drift guard's too)
            self.arm_choices.labels(arm=rec["arm"]).inc()
        if rec["guard_event"] is not None:
            self.guard_events.labels(event=rec["guard_event"]).inc()
        self.generation_tokens.inc(rec["output_tokens"])
        self.request_success.labels(finished_reason=rec["finish_reason"]).inc()
        if rec["finish_reason"] == "abort":  # the client left: no latency to report
            return
        self.latency.observe(wall_s)
        if rec["first_token_s"] is not None:
            self.ttft.observe(queued_s + rec["first_token_s"])

    def exposition(self) -> bytes:
        if self.gc_pauses is not None:  # collections timed since the last read (`serving.heap`)
            for generation, seconds in self.gc_pauses.drain():
                self.gc_pause.labels(generation=str(generation)).observe(seconds)
        return generate_latest(self.registry)
