"""Prometheus metrics for the server (`GET /metrics`), named like vLLM's with a `phoenix:` prefix
so existing speculative-decoding dashboards carry over.

One registry per app (tests run several apps in one process). Counters are exposed with the
`_total` suffix, as vLLM's are.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20)
GC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(
        self,
        queue_depth: Callable[[], float],
        running: Callable[[], float],
        fallback_active: Callable[[], float] = lambda: 0.0,
        gc_pauses=None,
    ):
        """`gc_pauses`: a `serving.heap.GCPauses` whose collections /metrics reports."""
        r = self.registry = CollectorRegistry()
        self.gc_pauses = gc_pauses
        self.num_drafts = Counter(
            "phoenix:spec_decode_num_drafts", "Draft proposals (rounds that drafted).", registry=r
        )
        self.num_draft_tokens = Counter(
            "phoenix:spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r
        )
        self.num_accepted_tokens = Counter(
            "phoenix:spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r
        )
        self.accepted_per_pos = Counter(
            "phoenix:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the proposal.",
            ["position"],
            registry=r,
        )
        self.arm_choices = Counter(
            "phoenix:bandit_arm_choices", "Bandit decisions, by arm (k).", ["arm"], registry=r
        )
        self.guard_events = Counter(
            "phoenix:speculation_guard_events",
            "Drift guard events: fallback (to plain generation) and recovered.",
            ["event"],
            registry=r,
        )
        Gauge(
            "phoenix:speculation_fallback_active",
            "1 while the drift guard holds bandit requests to plain generation.",
            registry=r,
        ).set_function(fallback_active)
        self.draft_info = Gauge(
            "phoenix:draft_info",
            "1 for the draft version served now (label version; source: promoted, merged, ...).",
            ["version", "source"],
            registry=r,
        )
        self.draft_reloads = Counter(
            "phoenix:draft_reloads",
            "Draft hot swaps, by outcome (ok, failed).",
            ["outcome"],
            registry=r,
        )
        self.traffic = Counter(
            "phoenix:traffic_records",
            "Served requests for traffic capture: captured, dropped (capture paused), opted_out.",
            ["outcome"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "phoenix:generation_tokens", "Tokens generated for clients.", registry=r
        )
        self.request_success = Counter(
            "phoenix:request_success",
            "Finished requests, by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "phoenix:request_rejected",
            "Requests refused, by reason (queue_full: a 429).",
            ["reason"],
            registry=r,
        )
        self.latency = Histogram(
            "phoenix:e2e_request_latency_seconds",
            "Admission to last token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "phoenix:time_to_first_token_seconds",
            "Admission to first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.gc_pause = Histogram(
            "phoenix:gc_pause_seconds",
            "Python garbage collections, by generation (2: full): every row waits them out.",
            ["generation"],
            buckets=GC_BUCKETS,
            registry=r,
        )
        waiting = Gauge(
            "phoenix:num_requests_waiting", "Admitted requests not generating yet.", registry=r
        )
        waiting.set_function(lambda: max(0.0, queue_depth() - running()))
        Gauge("phoenix:num_requests_running", "Requests generating.", registry=r).set_function(
            running
        )

    def set_draft(self, version: str | None, source: str | None) -> None:
        self.draft_info.clear()
        if version is not None:
            self.draft_info.labels(version=version, source=source or "").set(1)

    def record(self, res, wall_s: float) -> None:
        """One finished request: `res` is its CoreResult, `wall_s` admission to the end (the
        wait for the models is what the engine's own latency does not cover)."""
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
