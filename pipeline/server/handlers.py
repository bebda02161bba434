"""The routes, over their shared `ServerState` (`app.state.phoenix`).

A handler validates, tokenises off the event loop (length bounded first) and submits one
`serving.Request` behind a bounded admission (full: 429). The slot is freed when generation
ends, whatever the client does; a client that leaves cancels its row. Streamed text goes
through a queue bounded only by max_tokens, so the step loop never waits on a reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from .. import traffic
from ..metrics import Metrics
from ..reload import DraftReloader
from ..serving.core import ServingCore
from ..serving.request import Cancelled, CoreResult, ModeError, Refused
from ..serving.request import Request as CoreRequest
from ..speculative.sampling import Sampling
from ..traffic import TrafficLog
from .responses import Reply, TokenText, phoenix_of, usage_of
from .schemas import (
    APIError,
    ChatRequest,
    CommonRequest,
    CompletionRequest,
    bad_request,
    validation_error,
)


class Admission:
    """At most `size` requests admitted (waiting or generating). Thread-safe."""

    def __init__(self, size: int):
        self.size = size
        self.count = 0
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self.count >= self.size:
                return False
            self.count += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.count -= 1


@dataclass
class ServerState:
    """Everything the handlers share: `app.state.phoenix`."""

    telemetry: Any
    admission: Admission
    api_key: str | None
    max_tokens_limit: int
    stuck_after_s: float
    shutdown_timeout_s: float
    max_body_bytes: int = 1 << 20
    metrics: Metrics | None = None
    core: ServingCore | None = None
    error: str | None = None
    closing: bool = False  # shutting down: admit nothing new
    froze: bool = False  # this server holds the process's heap frozen (`serving.heap`)
    inflight: set[CoreRequest] = field(default_factory=set)  # handed to the core, not done
    inflight_lock: threading.Lock = field(default_factory=threading.Lock)
    traffic: TrafficLog | None = None  # traffic.capture
    reloader: DraftReloader | None = None  # hot swap of the draft
    stopping: threading.Event = field(default_factory=threading.Event)  # ends the watcher
    admin_open: bool = True  # POST /admin/* allowed (a key, a loopback address, or opted in)


async def _watch_disconnect(request: Request, creq: CoreRequest, poll_s: float = 0.1) -> None:
    """Cancel the request when its client goes away (before the first byte or mid-stream)."""
    while not creq.future.done():
        if await request.is_disconnected():
            creq.cancel.set()
            return
        await asyncio.sleep(poll_s)


def _state(request: Request) -> ServerState:
    return request.app.state.phoenix


def _ready_core(st: ServerState) -> ServingCore:
    if st.core is None:
        raise APIError(
            503, st.error or "models are loading", "server_error", None, "model_not_ready"
        )
    return st.core


router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 when ready; 503 while loading, after a load failure, shutting down, or when generation
    has made no progress for `server.stuck_after_s`."""
    st = _state(request)
    if st.closing:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    if st.core is None:
        return JSONResponse(
            {"status": "error" if st.error else "loading", "detail": st.error}, status_code=503
        )
    stalled = st.core.scheduler.stalled_s()
    figures = {"admitted": st.admission.count, "generating": st.core.generating}
    if stalled > st.stuck_after_s:
        detail = f"generation has made no progress for {stalled:.0f} s"
        return JSONResponse({"status": "stuck", "detail": detail, **figures}, status_code=503)
    return {"status": "ok", **figures}


@router.get("/metrics")
async def metrics(request: Request):
    """Prometheus exposition (vLLM's names, `phoenix:` prefix); no API key, like /health."""
    return Response(_state(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request):
    core = _ready_core(_state(request))
    entry = {"id": core.model_id, "object": "model", "created": 0, "owned_by": "phoenix"}
    entry["metadata"] = {"target": core.target_spec, "draft": core.draft_info}
    return {"object": "list", "data": [entry]}


@router.post("/admin/reload-draft")
async def reload_draft(request: Request):
    """Swap in the draft `server.draft` names now: 200 with what happened; 403 beyond loopback
    without a key (unless `server.allow_unauthenticated_admin`); 500 if the new draft fails to
    load (the old keeps serving)."""
    st = _state(request)
    if not st.admin_open:
        raise APIError(
            403,
            "admin endpoints are disabled: this server listens beyond loopback without an API "
            "key; set the key's environment variable (server.api_key_env) or "
            "server.allow_unauthenticated_admin=true",
            "permission_error",
            None,
            "admin_disabled",
        )
    _ready_core(st)
    if st.reloader is None:
        raise bad_request("this server runs without a draft: nothing to reload")
    out = await asyncio.to_thread(st.reloader.reload, "POST /admin/reload-draft")
    if "error" in out:
        return APIError(
            500, f"draft reload failed: {out['error']}", "server_error", None, "draft_reload_failed"
        ).response()
    return out


@router.post("/v1/chat/completions")
async def chat(request: Request):
    core = _ready_core(_state(request))
    req = await _parse(request, ChatRequest)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    if not any(m["content"].strip() for m in messages):
        raise bad_request("messages are all empty", "messages")
    _bound_prompt(core, sum(len(m["content"]) for m in messages), "messages")
    try:  # off the event loop: a long prompt never holds up other requests
        prompt_ids = await asyncio.to_thread(
            core.chat_prompt_ids, messages, req.chat_template_kwargs
        )
    except Exception as exc:  # a template that rejects this conversation
        raise bad_request(
            f"chat template could not render the messages: {exc}", "messages"
        ) from None
    return await _complete(request, req, prompt_ids, "chat")


@router.post("/v1/completions")
async def completions(request: Request):
    core = _ready_core(_state(request))
    req = await _parse(request, CompletionRequest)
    _bound_prompt(core, len(req.prompt), "prompt")
    prompt_ids = await asyncio.to_thread(core.text_prompt_ids, req.prompt)
    return await _complete(request, req, prompt_ids, "text")


def _bound_prompt(core: ServingCore, chars: int, param: str) -> None:
    """Refuse, before tokenising, a prompt too long to fit the context whatever its tokens."""
    if chars > core.max_prompt_chars:
        raise bad_request(
            f"the prompt has {chars} characters: more than this model's {core.max_context}-token "
            "context can hold",
            param,
            "context_length_exceeded",
        )


async def _parse(request: Request, schema):
    st = _state(request)
    body = bytearray()
    async for chunk in request.stream():  # bounded as it arrives (a body without a length)
        body += chunk
        if len(body) > st.max_body_bytes:
            raise body_too_large(st)
    try:
        raw = json.loads(bytes(body))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(raw, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None


def body_too_large(st: ServerState) -> APIError:
    return APIError(
        413,
        f"request body over this server's limit of {st.max_body_bytes // 1024} KB "
        "(server.max_body_kb)",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def _check(st: ServerState, core: ServingCore, req: CommonRequest, prompt_ids: list[int]):
    """(max_tokens, mode, sampling) of a valid request, else a 4xx APIError naming the problem."""
    if req.model != core.model_id:
        raise APIError(
            404,
            f"model '{req.model}' is not served here; it serves '{core.model_id}'",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    req.check_served()
    # Absent temperature: greedy (Phoenix's default, where OpenAI's is 1): exact output.
    sampling = Sampling(
        temperature=req.temperature or 0.0,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        seed=req.seed,
        logprobs=req.top_logprobs_asked(),
    )
    max_tokens = req.max_completion_tokens or req.max_tokens or 256
    if max_tokens > st.max_tokens_limit:
        raise bad_request(
            f"max_tokens {max_tokens} exceeds this server's limit of {st.max_tokens_limit}",
            "max_tokens",
        )
    ctx = core.max_context
    if len(prompt_ids) + max_tokens > ctx:
        raise bad_request(
            f"this model's maximum context length is {ctx} tokens (engine.max_context); the "
            f"prompt has {len(prompt_ids)} and max_tokens asks for {max_tokens}",
            "messages",
            "context_length_exceeded",
        )
    try:
        mode = core.mode(req.phoenix.mode if req.phoenix else None)
    except ModeError as exc:
        raise bad_request(str(exc), "phoenix.mode") from None
    return max_tokens, mode, sampling


async def _complete(request: Request, req: CommonRequest, prompt_ids: list[int], kind: str):
    st = _state(request)
    core = _ready_core(st)
    max_tokens, mode, sampling = _check(st, core, req, prompt_ids)
    if st.closing:
        raise APIError(503, "server is shutting down", "server_error", None, "shutting_down")
    if not st.admission.try_enter():
        st.metrics.rejected.labels(reason="queue_full").inc()
        raise APIError(
            429,
            f"server busy: {st.admission.size} requests queued or running; retry later",
            "rate_limit_error",
            None,
            "queue_full",
            headers={"Retry-After": "1"},
        )

    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue | None = asyncio.Queue() if req.stream else None

    def push(text: str | None, logprobs: list | None = None) -> None:  # never blocks
        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
            loop.call_soon_threadsafe(pieces.put_nowait, None if text is None else (text, logprobs))

    creq = CoreRequest(
        prompt_ids, max_tokens, mode, req.stop or [], push if pieces else None, sampling=sampling
    )

    def ended(_future) -> None:  # generation is over, whatever the client does
        with st.inflight_lock:
            st.inflight.discard(creq)
        st.admission.leave()
        if pieces is not None:
            push(None)

    creq.future.add_done_callback(ended)
    with st.inflight_lock:
        st.inflight.add(creq)
    capture = req.phoenix.capture if req.phoenix else True
    outcome = asyncio.ensure_future(_observe(st, creq, kind, capture))
    outcome.add_done_callback(lambda t: t.cancelled() or t.exception())  # always retrieved
    watcher = asyncio.ensure_future(_watch_disconnect(request, creq))
    try:
        core.submit(creq)
    except Exception as exc:  # noqa: BLE001 - answered like a failed step, never left hanging
        if not creq.future.done():
            creq.future.set_exception(exc)
    reply = Reply(
        core.model_id,
        kind,
        len(prompt_ids),
        bool(req.phoenix and req.phoenix.token_ids),
        tokens=TokenText(core.tokenizer, req.return_tokens_as_token_ids),
    )
    if req.stream:
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            _stream(creq, outcome, pieces, reply, include_usage, watcher),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        res = await asyncio.shield(outcome)
    except Cancelled:
        raise APIError(499, "client disconnected", "invalid_request_error") from None
    except Refused as exc:  # cannot join (checked before it would have)
        raise bad_request(str(exc), "messages") from None
    except Exception as exc:  # a failed step: this request's, named
        raise APIError(500, f"generation failed: {exc}", "server_error") from None
    finally:
        creq.cancel.set()  # harmless once generation has ended
        watcher.cancel()
    return reply.body(res)


async def _observe(st: ServerState, creq: CoreRequest, kind: str, capture: bool) -> CoreResult:
    """One request's telemetry, metrics and traffic record, in its own task (outlives the reply)."""
    with st.telemetry.request(creq.mode, st.core.draft_id) as rec:
        try:
            res = await asyncio.wrap_future(creq.future)
        except Cancelled:  # it left before joining the batch: nothing ran
            st.metrics.request_success.labels(finished_reason="abort").inc()
            raise
        rec.record(res)
    st.metrics.record(res, time.perf_counter() - creq.submitted)
    if st.traffic is not None and res.finish_reason != "abort":  # a client that left: no
        if not capture:
            st.metrics.traffic.labels(outcome="opted_out").inc()
        elif st.traffic.append(traffic.record_of(res, creq.prompt_ids, kind)):
            st.metrics.traffic.labels(outcome="captured").inc()
        else:
            st.metrics.traffic.labels(outcome="dropped").inc()
    return res


async def _stream(creq, outcome, pieces, reply: Reply, include_usage: bool, watcher):
    """The SSE body; however it ends, the request is cancelled if it still runs."""
    try:
        if reply.kind == "chat":
            yield reply.chunk(None, None, None, role=True)
        while (piece := await pieces.get()) is not None:
            yield reply.chunk(*piece, None)
        try:
            res = await asyncio.shield(outcome)
        except Cancelled:
            return
        except Exception as exc:
            err = {"message": f"generation failed: {exc}", "type": "server_error"}
            yield reply.sse({"error": {**err, "param": None, "code": None}})
            return
        yield reply.chunk(None, None, res.finish_reason)
        if include_usage:
            rec = res.record()
            yield reply.sse(
                reply.envelope([], usage=usage_of(rec, reply.n_prompt), phoenix=phoenix_of(rec))
            )
        yield "data: [DONE]\n\n"
    finally:
        creq.cancel.set()
        watcher.cancel()
