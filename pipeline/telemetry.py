"""Telemetry behind one interface: Sentry, or a do-nothing twin with the same methods.

The DSN is a secret from the environment; only its host and project id are logged. Per request:
a transaction named by mode (tags `mode`, `arm`, `draft_model`; `SENTRY_DATA`) with draft and
verify child spans and a structured log line. Per stage: a transaction `stage.<name>` with its
figures, exceptions captured with the stage name.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

from .errors import ConfigError

log = logging.getLogger(__name__)


class NullRecorder:
    """What `telemetry.request` yields: `record(result)` once the request has run."""

    def record(self, res) -> None:
        pass


class NullTelemetry:
    """Same methods as SentryTelemetry; records nothing."""

    enabled = False

    @contextlib.contextmanager
    def request(self, mode, draft_id: str | None = None) -> Iterator[NullRecorder]:
        """`with telemetry.request(mode, draft) as rec: ...; rec.record(res)`, in the caller."""
        yield NullRecorder()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[dict[str, Any]]:
        yield {}

    def event(self, message: str, level: str, tags: dict[str, str], exc=None) -> None:
        """One event outside a request (a draft swapped in, a reload that failed)."""

    def flush(self) -> None:
        pass


# A transaction's data: these fields of the request's record (`CoreResult.record()`).
SENTRY_DATA = {
    "latency_seconds": "latency_s",
    "output_tokens": "output_tokens",
    "prompt_tokens": "prompt_tokens",
    "tokens_per_second": "tokens_per_second",
    "draft_accepted": "accepted",
    "draft_proposed": "proposed",
    "acceptance": "acceptance",
    "draft_seconds": "draft_s",
    "verify_seconds": "verify_s",
    "finish_reason": "finish_reason",
    "goodput": "goodput",  # tokens over its share of the batch's time (the policy's reward)
    "batch_rows": "batch_rows",  # the mean rows of the steps it was in
    "queued_seconds": "queued_s",
}


class SentryRecorder(NullRecorder):
    """One request's figures on its transaction: draft/verify child spans, data, tags, logs."""

    def __init__(self, sdk, tx, gen, mode):
        self.sdk, self.tx, self.gen, self.mode = sdk, tx, gen, mode
        self.started = datetime.now(timezone.utc)

    def record(self, res) -> None:
        rec, tx = res.record(), self.tx
        t0 = self.started  # a row's shares of its steps, laid out as two back-to-back spans
        for op, name, secs in (
            ("phoenix.draft", "draft candidate generation", rec["draft_s"]),
            ("phoenix.verify", "target verification", rec["verify_s"]),
        ):
            if secs > 0:
                span = self.gen.start_child(op=op, name=name, start_timestamp=t0)
                t0 = t0 + timedelta(seconds=secs)
                span.set_data("seconds", secs)
                span.finish(end_timestamp=t0)
        tx.set_tag("arm", rec["arm"])
        if rec["draft"]:  # the draft version that ran it (hot swaps change it)
            tx.set_tag("draft_version", rec["draft"])
        data = {name: rec[key] for name, key in SENTRY_DATA.items()}
        for key, value in data.items():
            tx.set_data(key, value)
        self.sdk.logger.info(
            "phoenix request mode={mode} arm={arm} latency={latency:.3f}s tokens/s={tps:.2f} "
            "accepted={accepted}/{proposed}",
            mode=self.mode.name, arm=rec["arm"], latency=rec["latency_s"],
            tps=rec["tokens_per_second"], accepted=rec["accepted"], proposed=rec["proposed"],
            attributes={"mode": self.mode.name, "arm": rec["arm"], **data},  # the tx's fields
        )  # fmt: skip
        ev = res.guard_event
        if ev is not None:  # the drift guard fell back to plain generation, or recovered
            with self.sdk.new_scope() as scope:
                scope.set_tag("speculation", ev["event"])
                scope.set_context("drift_guard", ev)
                self.sdk.capture_message(
                    f"phoenix speculation {ev['event']}: speculative "
                    f"{ev['speculative_tps']:.2f} vs plain {ev['plain_tps']:.2f} (goodput relative to "
                    "plain at the same load)",
                    level="warning" if ev["event"] == "fallback" else "info",
                )
        if res.decision is not None:
            d = res.decision
            means = str({a: round(m, 3) for a, m in d.means.items()})
            self.sdk.logger.info(
                "bandit decision arm={arm} explored={explored} epsilon={epsilon:.4f}",
                arm=d.arm, explored=d.explored, epsilon=d.epsilon,
                attributes={"warmup": d.warmup, "fallback": d.fallback, "means": means},
            )  # fmt: skip


class SentryTelemetry(NullTelemetry):
    enabled = True

    def __init__(self, sentry_sdk, shutdown_timeout_s: float):
        self.sdk = sentry_sdk
        self.shutdown_timeout_s = shutdown_timeout_s

    @contextlib.contextmanager
    def request(self, mode, draft_id: str | None = None) -> Iterator[SentryRecorder]:
        with self.sdk.start_transaction(op="phoenix.request", name=mode.name) as tx:
            tx.set_tag("mode", mode.name)
            tx.set_tag("draft_model", draft_id or "none")
            with tx.start_child(op="phoenix.generate", name="speculative generation") as gen:
                yield SentryRecorder(self.sdk, tx, gen, mode)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[dict[str, Any]]:
        figures: dict[str, Any] = {}
        with self.sdk.start_transaction(op="phoenix.stage", name=f"stage.{name}") as tx:
            tx.set_tag("stage", name)
            try:
                yield figures
            except BaseException as exc:
                with self.sdk.new_scope() as scope:
                    scope.set_tag("stage", name)
                    self.sdk.capture_exception(exc)
                tx.set_status("internal_error")
                raise
            finally:
                for key, value in figures.items():
                    if isinstance(value, (int, float, str, bool)) or value is None:
                        tx.set_data(key, value)

    def event(self, message: str, level: str, tags: dict[str, str], exc=None) -> None:
        with self.sdk.new_scope() as scope:
            for key, value in tags.items():
                scope.set_tag(key, value)
            if exc is not None:
                self.sdk.capture_exception(exc)
            else:
                self.sdk.capture_message(message, level=level)

    def flush(self) -> None:
        self.sdk.flush(timeout=self.shutdown_timeout_s)


def describe_dsn(dsn: str) -> tuple[str, str]:
    """(host, project id) of a DSN, validated; raises ValueError naming what is wrong."""
    from sentry_sdk.utils import BadDsn, Dsn

    try:
        parsed = Dsn(dsn)
    except BadDsn as exc:
        raise ValueError(str(exc)) from None
    if not parsed.project_id:
        raise ValueError("missing project id")
    return f"{parsed.host}:{parsed.port}", parsed.project_id


def setup_telemetry(cfg, component: str) -> NullTelemetry:
    """Sentry when configured and a DSN is set; the do-nothing twin otherwise."""
    o = cfg.observability
    if not o.enabled:
        if o.required:
            raise ConfigError("observability.required is true but observability.enabled is false")
        return NullTelemetry()
    dsn = os.environ.get(o.dsn_env, "").strip()
    if not dsn:
        if o.required:
            raise ConfigError(
                f"observability.required is true but the environment variable {o.dsn_env} "
                "is not set: export the project's Sentry DSN"
            )
        log.info("Sentry off (%s not set)", o.dsn_env)
        return NullTelemetry()
    try:
        host, project = describe_dsn(dsn)
    except ValueError as exc:
        msg = f"{o.dsn_env} is not a valid Sentry DSN ({exc})"
        if o.required:
            raise ConfigError(msg) from None
        log.warning("%s; Sentry off", msg)
        return NullTelemetry()
    import sentry_sdk
    from sentry_sdk.integrations.fastapi import FastApiIntegration
    from sentry_sdk.integrations.logging import LoggingIntegration
    from sentry_sdk.integrations.starlette import StarletteIntegration

    from . import __version__

    sentry_sdk.init(
        dsn=dsn,
        environment=o.environment,
        release=o.release or f"phoenix@{__version__}",
        traces_sample_rate=o.traces_sample_rate,
        profile_session_sample_rate=o.profile_session_sample_rate,
        profile_lifecycle="trace",
        enable_logs=True,
        send_default_pii=False,
        shutdown_timeout=o.shutdown_timeout_s,
        server_name=component,
        # Phoenix opens its own transaction per request; per-route ones would duplicate it.
        disabled_integrations=[StarletteIntegration(), FastApiIntegration()],
        # Python log records go to Sentry logs from WARNING up; per-request logs are explicit.
        integrations=[LoggingIntegration(sentry_logs_level=logging.WARNING)],
    )
    log.info("Sentry on: host %s, project %s, environment %s (%s)",
             host, project, o.environment, component)  # fmt: skip
    return SentryTelemetry(sentry_sdk, o.shutdown_timeout_s)
