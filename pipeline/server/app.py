"""The app's lifecycle: `create_app` (state, background loading, the key and body-size gate,
shutdown), `build_app` from a config, `serve` and `run_server` (uvicorn)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import ipaddress
import logging
import os
from collections.abc import Callable

from fastapi import FastAPI, Request

from .. import models, traffic
from ..drafts import resolve_served
from ..errors import ConfigError
from ..metrics import Metrics
from ..reload import DraftReloader
from ..serving import heap
from ..serving.core import ServingCore, build_core
from ..serving.scheduler import background
from ..telemetry import NullTelemetry, setup_telemetry
from ..traffic import TrafficLog
from .handlers import Admission, ServerState, body_too_large, router
from .schemas import APIError

log = logging.getLogger(__name__)


def create_app(
    load_core: Callable[[], ServingCore],
    queue_size: int = 8,
    api_key_env: str = "PHOENIX_API_KEY",
    max_tokens_limit: int = 4096,
    telemetry=None,
    stuck_after_s: float = 60.0,
    shutdown_timeout_s: float = 10.0,
    traffic_log: TrafficLog | None = None,
    reloader: Callable[[Callable[[], ServingCore | None], Metrics], DraftReloader] | None = None,
    reload_poll_s: float = 0.0,
    max_body_kb: int = 1024,
    host: str = "127.0.0.1",
    allow_unauthenticated_admin: bool = False,
) -> FastAPI:
    """`load_core` runs on a background thread (/health 503 until done). `reloader(get_core,
    metrics)`: draft hot swaps, polled every `reload_poll_s` if > 0. `host` beyond loopback with
    no API key: a WARNING, and admin endpoints 403 unless `allow_unauthenticated_admin`."""
    st = ServerState(
        telemetry=telemetry or NullTelemetry(),
        admission=Admission(queue_size),
        api_key=os.environ.get(api_key_env) or None,
        max_tokens_limit=max_tokens_limit,
        stuck_after_s=stuck_after_s,
        shutdown_timeout_s=shutdown_timeout_s,
        max_body_bytes=max_body_kb * 1024,
    )
    if st.api_key is None and not is_loopback(host):
        st.admin_open = allow_unauthenticated_admin
        _warn_open(host, api_key_env, allow_unauthenticated_admin)
    gc_pauses = heap.GCPauses()
    st.metrics = _metrics_of(st, gc_pauses)
    st.traffic = traffic_log
    if reloader is not None:
        st.reloader = reloader(lambda: st.core, st.metrics)
    load = _loader(st, load_core, reload_poll_s)
    app = FastAPI(title="Phoenix speculative server", lifespan=_lifespan(st, load, gc_pauses))
    app.state.phoenix = st
    app.include_router(router)
    app.middleware("http")(_gate(st))
    _answer_errors(app)
    return app


def _warn_open(host: str, api_key_env: str, allow_admin: bool) -> None:
    log.warning(
        "listening on %s without an API key: anyone who reaches the port may generate%s; "
        "set %s to require a bearer token",
        host,
        " and swap the draft (server.allow_unauthenticated_admin)"
        if allow_admin
        else " (admin endpoints are disabled: 403)",
        api_key_env,
    )


def _metrics_of(st: ServerState, gc_pauses: heap.GCPauses) -> Metrics:
    """The app's metrics; its gauges read the state at scrape time."""
    return Metrics(
        gc_pauses=gc_pauses,
        queue_depth=lambda: st.admission.count,
        running=lambda: st.core.generating if st.core is not None else 0,
        fallback_active=lambda: float(
            st.core is not None and st.core.guard is not None and st.core.guard.active
        ),
    )


def _loader(
    st: ServerState, load_core: Callable[[], ServingCore], reload_poll_s: float
) -> Callable[[], None]:
    """Start-up: load the core, freeze the heap, set `st.core` (ready); a failure goes to
    `st.error` for /health and the process stays up."""

    def load() -> None:
        try:
            core = load_core()
            st.metrics.set_draft(core.draft_id, (core.draft_info or {}).get("source"))
            if st.reloader is not None and core.pair is not None and core.pair.draft_ref is None:
                st.reloader = None  # a target-only server: no draft to swap
            if st.closing:  # shut down while loading: nothing to serve, nothing to freeze
                core.close(timeout=1.0)
                return
            n, took = heap.freeze()  # the start-up heap out of the collector's way (`heap`)
            st.froze = True
            log.info("gc: %d start-up objects frozen (a full collection walked them in %.0f ms)",
                     n, 1000 * took)  # fmt: skip
            st.core = core
            if st.reloader is not None and reload_poll_s > 0:
                st.reloader.watch(reload_poll_s, st.stopping)
            log.info("models loaded; ready")
        except Exception as exc:  # reported by /health; the process stays up to say so
            log.exception("model loading failed")
            st.error = f"{type(exc).__name__}: {exc}"

    return load


def _lifespan(st: ServerState, load: Callable[[], None], gc_pauses: heap.GCPauses):
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        gc_pauses.attach()
        background(load, "phoenix-load")
        yield
        await _shut_down(st)
        gc_pauses.detach()
        if st.froze:
            heap.release()

    return lifespan


async def _shut_down(st: ServerState) -> None:
    """After uvicorn's graceful wait: cancel what still runs; close core, traffic, telemetry."""
    st.closing = True
    st.stopping.set()
    with st.inflight_lock:
        inflight = list(st.inflight)
    for creq in inflight:
        creq.cancel.set()
    if inflight:
        await asyncio.to_thread(concurrent.futures.wait, [c.future for c in inflight], timeout=1.0)
    if st.core is not None:
        st.core.close(timeout=1.0)
    if st.traffic is not None:
        st.traffic.close()
    st.telemetry.flush()


def _gate(st: ServerState):
    async def gate(request: Request, call_next):
        """The API key (when set), and the body limit before a byte of the body is read."""
        if st.api_key and request.url.path not in ("/health", "/metrics"):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {st.api_key}".encode()):  # constant time
                return APIError(
                    401,
                    "invalid or missing API key",
                    "authentication_error",
                    None,
                    "invalid_api_key",
                ).response()
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > st.max_body_bytes:
            return body_too_large(st).response()
        return await call_next(request)

    return gate


def _answer_errors(app: FastAPI) -> None:
    """Every refusal, an unknown path and a wrong method included, as OpenAI's error body."""
    app.add_exception_handler(APIError, lambda _r, exc: exc.response())
    app.add_exception_handler(
        404,
        lambda _r, _e: APIError(
            404, "no such endpoint", "invalid_request_error", None, "not_found"
        ).response(),
    )
    app.add_exception_handler(
        405,
        lambda _r, _e: APIError(
            405, "method not allowed", "invalid_request_error", None, None
        ).response(),
    )


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) only listens on this machine."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name: it may resolve to any interface
        return False


def serve(cfg, ws, host: str | None, port: int | None, mode: str | None) -> None:
    host = host or cfg.server.host
    app = build_app(cfg, ws, mode, host)
    port = cfg.server.port if port is None else port
    log.info("listening on http://%s:%d", host, port)
    run_server(app, host, port)


def build_app(cfg, ws, mode: str | None = None, host: str | None = None) -> FastAPI:
    """The app `serve` runs. The draft is resolved now (a bad one exits 2 before listening);
    models load in the background."""
    mode = mode or cfg.server.mode
    served, full_head = None, False
    if mode != "target":
        served = resolve_served(cfg, ws)
        if cfg.engine.draft_vocab:
            try:
                models.counts_file(cfg, ws, served.spec)  # exit 2 now, not a 503 after loading
            except ConfigError:
                if served.source != "base":
                    raise
                log.warning(
                    "engine.draft_vocab: no token counts yet (train records them): the base "
                    "draft proposes over the full vocabulary"
                )
                full_head = True
    log.info(
        "serving target %s with %s (mode %s)",
        cfg.models.target,
        f"draft {served.sentence()}" if served else "no draft",
        mode,
    )
    telemetry = setup_telemetry(cfg, component="server")
    poll = cfg.server.reload_poll_s if cfg.server.draft.strip() == "latest" else 0.0
    return create_app(
        lambda: build_core(cfg, ws, served, mode, full_head=full_head),
        traffic_log=traffic.open_log(cfg, ws),
        reloader=(lambda get_core, metrics: DraftReloader(cfg, ws, get_core, telemetry, metrics))
        if served is not None
        else None,
        reload_poll_s=poll,
        queue_size=cfg.server.queue_size,
        api_key_env=cfg.server.api_key_env,
        max_tokens_limit=cfg.server.max_tokens_limit,
        telemetry=telemetry,
        stuck_after_s=cfg.server.stuck_after_s,
        shutdown_timeout_s=cfg.server.shutdown_timeout_s,
        max_body_kb=cfg.server.max_body_kb,
        host=host or cfg.server.host,
        allow_unauthenticated_admin=cfg.server.allow_unauthenticated_admin,
    )


def run_server(app: FastAPI, host: str, port: int) -> None:
    """Serve until SIGTERM or Ctrl-C; then stop admitting (/health 503), let running requests
    finish within `shutdown_timeout_s`, cancel the rest, exit."""
    import uvicorn

    st: ServerState = app.state.phoenix

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            st.closing = True
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=st.shutdown_timeout_s,
    )
    Server(config).run()
