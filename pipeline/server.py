"""An OpenAI-compatible HTTP server over the speculative core.

    python -m pipeline serve --config configs/default.yaml [--host H] [--port P]
                             [--mode target|fixed:K|bandit]          (or: make serve)

GET /health (503 while loading, shutting down or stuck; 200 when ready), GET /v1/models,
POST /v1/chat/completions, POST /v1/completions (streaming with `stream: true`). Every request
runs on the core's one step loop, beside every other, behind a bounded admission: a full server
answers 429. Bad input always gets a 4xx with an OpenAI-style error body, never a 500; a body
over `server.max_body_kb` gets 413 before it is read.

A handler validates, tokenises (off the event loop, the prompt's length bounded first), builds
one `serving.Request` and hands it to the core (`ServingCore.submit`); the core answers through
the request's future. The admission slot is handed back when generation ends, whatever the client
does; a client that leaves sets the request's `cancel`, and it leaves the batch after the
current step. Streamed text reaches the response through an unbounded queue (bounded by
max_tokens), so the step loop never waits for a reader.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from . import models, traffic
from .drafts import resolve_served
from .errors import ConfigError
from .metrics import Metrics
from .reload import DraftReloader
from .serving import heap
from .serving.core import ServingCore, build_core
from .serving.request import Cancelled, CoreResult, ModeError, Refused
from .serving.request import Request as CoreRequest
from .serving.scheduler import background
from .speculative.sampling import MAX_TOP_LOGPROBS, Sampling
from .telemetry import NullTelemetry, setup_telemetry
from .traffic import TrafficLog

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code=None,
        headers=None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# --- request schemas ---------------------------------------------------------------------------
# Fields that change nothing (user, metadata, store, ...) are accepted; a field that would change
# the answer and that Phoenix does not serve is refused with a 400 naming it (`UNSERVED`), never
# silently ignored: a client must not get a different answer than it asked for.
class PhoenixOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str | None = None
    token_ids: bool = False  # the output's token ids in the response (distillation wants them)
    capture: bool = True  # false: this request is not recorded as traffic (traffic.capture)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request("only text content parts are supported", "messages")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


def _neutral_penalty(v) -> bool:
    return v in (None, 0, 0.0)


def _no_tools(v) -> bool:
    return v in (None, [], "none")


# field -> (is the value one that changes nothing?, why it is refused otherwise)
UNSERVED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_no_tools, "tool calling is not served"),
    "tool_choice": (_no_tools, "tool calling is not served"),
    "functions": (_no_tools, "function calling is not served"),
    "function_call": (_no_tools, "function calling is not served"),
    "response_format": (
        lambda v: v is None or (isinstance(v, dict) and v.get("type", "text") == "text"),
        "only response_format type 'text' is served (no JSON mode or schemas)",
    ),
    "logit_bias": (lambda v: not v, "logit_bias is not served"),
    "presence_penalty": (_neutral_penalty, "presence_penalty must be 0 or absent"),
    "frequency_penalty": (_neutral_penalty, "frequency_penalty must be 0 or absent"),
    "repetition_penalty": (lambda v: v in (None, 1, 1.0), "repetition_penalty must be 1"),
    "min_p": (_neutral_penalty, "min_p must be 0 or absent"),
    "best_of": (lambda v: v in (None, 1), "best_of > 1 is not served"),
    "echo": (lambda v: not v, "echo is not served"),
    "suffix": (lambda v: not v, "suffix is not served"),
    "modalities": (lambda v: v in (None, ["text"]), "only text output is served"),
    "audio": (lambda v: v is None, "audio output is not served"),
    "prediction": (lambda v: v is None, "predicted outputs are not served"),
}


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # vLLM's extension; 0: every token
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int | None = None
    phoenix: PhoenixOptions | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens as "token_id:N"

    def check_served(self) -> None:
        """A 400 naming the first field that asks for what Phoenix does not serve."""
        if self.n not in (None, 1):
            raise bad_request(f"n = {self.n}: one choice per request is served (n must be 1)", "n")
        extra = self.model_extra or {}
        for name, (neutral, why) in UNSERVED.items():
            if name in extra and not neutral(extra[name]):
                raise bad_request(f"{name}: {why}", name, "unsupported_parameter")

    def top_logprobs_asked(self) -> int | None:
        raise NotImplementedError

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (
            len(stops) > 4 or not all(isinstance(s, str) and s for s in stops)
        ):
            raise ValueError("stop must be a non-empty string or a list of at most 4 of them")
        return stops


class ChatRequest(CommonRequest):
    messages: list[Message] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def top_logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(CommonRequest):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the legacy API: top n

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("exactly one prompt is supported")
            v = v[0]
        if not v:
            raise ValueError("prompt is empty")
        return v


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return bad_request(f"{param}: {err['msg']}" if param else err["msg"], param)


class Admission:
    """At most `size` requests admitted (waiting for the models or generating). Thread-safe:
    a slot is taken on the event loop and handed back by the request's generation thread."""

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
    """200 when ready and generating normally; 503 while loading, after a load failure, while
    shutting down, or when generation has made no progress for `server.stuck_after_s`."""
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
    """Prometheus exposition (vLLM's spec-decode names, `phoenix:` prefix); no API key, like
    /health, so a scraper needs no secret."""
    return Response(_state(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request):
    core = _ready_core(_state(request))
    entry = {"id": core.model_id, "object": "model", "created": 0, "owned_by": "phoenix"}
    entry["metadata"] = {"target": core.target_spec, "draft": core.draft_info}
    return {"object": "list", "data": [entry]}


@router.post("/admin/reload-draft")
async def reload_draft(request: Request):
    """Swap in the draft `server.draft` names now (the newly promoted one, with `latest`).
    Behind the API key when one is set; without a key on an address other than loopback, 403
    unless `server.allow_unauthenticated_admin`. 200 with what happened; 500 when the new draft
    failed to load (the old one keeps serving)."""
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
        raise _validation_error(exc) from None


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
    """(max_tokens, mode, sampling) of a valid request; a 4xx APIError naming the problem
    otherwise."""
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
    """One request's telemetry, metrics and traffic record, however its client behaves: a task
    of its own, so a response that ends early does not end it."""
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
    """The SSE body. However it ends (finished, client gone, server cancelled), the request is
    cancelled if it still runs."""
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
            yield reply.sse(
                {
                    "error": {
                        "message": f"generation failed: {exc}",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                }
            )
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


class TokenText:
    """How a logprob entry names its token: its text (`tokenizer.decode([id])`), or vLLM's
    `token_id:N` when the request asked `return_tokens_as_token_ids` (exact, where a byte-level
    token's own text may be a fragment of a character)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def text(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


@dataclass
class Reply:
    """Builds the OpenAI response bodies and SSE chunks of one request."""

    model: str
    kind: str  # "chat" | "text"
    n_prompt: int
    token_ids: bool = False  # asked for with phoenix.token_ids
    tokens: TokenText | None = None  # how a logprob entry names its token
    id: str = ""
    created: int = 0

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self._streamed = 0  # characters of text sent in chunks so far
        self.created = int(time.time())

    def envelope(self, choices: list[dict], chunk: bool = True, **extra) -> dict:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    @staticmethod
    def sse(obj: dict) -> str:
        return "data: " + json.dumps(obj) + "\n\n"

    def logprobs(self, entries: list | None, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for these (token, logprob, top) entries: chat's `content`
        list, or the legacy completions' four lists (`offset`: the text before them). None
        when not asked for (a chunk: when it has none)."""
        if entries is None:
            return None
        name = self.tokens.text
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": name(t),
                        "logprob": lp,
                        "bytes": list(name(t).encode("utf-8")),
                        "top_logprobs": [
                            {"token": name(a), "logprob": v, "bytes": list(name(a).encode("utf-8"))}
                            for a, v in top
                        ],
                    }
                    for t, lp, top in entries
                ]
            }
        tokens = [name(t) for t, _, _ in entries]
        offsets = []
        for t, _, _ in entries:  # where each token's text starts in the answer
            offsets.append(offset)
            offset += len(self.tokens.tokenizer.decode([t]))
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{name(a): v for a, v in top} for _, _, top in entries],
            "text_offset": offsets,
        }

    def chunk(
        self, text: str | None, logprobs: list | None, finish: str | None, role: bool = False
    ) -> str:
        lp = self.logprobs(logprobs or None, self._streamed)
        self._streamed += len(text or "")
        if self.kind == "chat":
            delta = (
                {"role": "assistant", "content": ""}
                if role
                else ({"content": text} if text else {})
            )
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            if lp is not None:
                choice["logprobs"] = lp
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}
        return self.sse(self.envelope([choice]))

    def body(self, res: CoreResult) -> dict:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": res.text},
                "finish_reason": res.finish_reason,
                "logprobs": self.logprobs(res.logprobs),
            }
        else:
            choice = {
                "index": 0,
                "text": res.text,
                "finish_reason": res.finish_reason,
                "logprobs": self.logprobs(res.logprobs),
            }
        rec = res.record()
        ph = phoenix_of(rec)
        if self.token_ids and not res.stopped_by_string:  # the exact ids, for distillation
            ph["token_ids"] = res.result.token_ids
        return self.envelope([choice], chunk=False, usage=usage_of(rec, self.n_prompt), phoenix=ph)


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
    """`load_core` runs in a background thread at start-up; /health says 503 until it is done.
    `traffic_log`: capture served requests. `reloader(get_core, metrics)`: hot swaps of the
    draft (POST /admin/reload-draft), polling every `reload_poll_s` when > 0. `host`: the
    address it will listen on: beyond loopback and without an API key, one WARNING now and the
    admin endpoints answer 403 unless `allow_unauthenticated_admin`."""
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
        log.warning(
            "listening on %s without an API key: anyone who reaches the port may generate%s; "
            "set %s to require a bearer token",
            host,
            " and swap the draft (server.allow_unauthenticated_admin)"
            if allow_unauthenticated_admin
            else " (admin endpoints are disabled: 403)",
            api_key_env,
        )
    gc_pauses = heap.GCPauses()
    st.metrics = Metrics(
        gc_pauses=gc_pauses,
        queue_depth=lambda: st.admission.count,
        running=lambda: st.core.generating if st.core is not None else 0,
        fallback_active=lambda: float(
            st.core is not None and st.core.guard is not None and st.core.guard.active
        ),
    )

    st.traffic = traffic_log
    if reloader is not None:
        st.reloader = reloader(lambda: st.core, st.metrics)

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

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        gc_pauses.attach()
        background(load, "phoenix-load")
        yield
        # Shutdown: uvicorn has stopped accepting and waited (up to the deadline) for running
        # requests; whatever still generates is cancelled and leaves after the current step.
        st.closing = True
        st.stopping.set()
        with st.inflight_lock:
            inflight = list(st.inflight)
        for creq in inflight:
            creq.cancel.set()
        if inflight:
            await asyncio.to_thread(
                concurrent.futures.wait, [c.future for c in inflight], timeout=1.0
            )
        if st.core is not None:
            st.core.close(timeout=1.0)
        if st.traffic is not None:
            st.traffic.close()
        st.telemetry.flush()
        gc_pauses.detach()
        if st.froze:
            heap.release()

    app = FastAPI(title="Phoenix speculative server", lifespan=lifespan)
    app.state.phoenix = st
    app.include_router(router)

    @app.middleware("http")
    async def _gate(request: Request, call_next):
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
    return app


def usage_of(rec: dict, n_prompt: int) -> dict:
    """The OpenAI usage object of a request's record (`CoreResult.record()`)."""
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": rec["output_tokens"],
        "total_tokens": n_prompt + rec["output_tokens"],
        "completion_tokens_details": {
            "accepted_prediction_tokens": rec["accepted"],
            "rejected_prediction_tokens": rec["proposed"] - rec["accepted"],
        },
    }


# The response's `phoenix` object: these fields of the request's record.
PHOENIX_FIELDS = (
    "mode", "arm", "proposed", "accepted", "rounds", "acceptance", "tokens_per_second",
    "latency_s", "draft_s", "verify_s", "accepted_per_position", "proposed_per_position",
    "explored", "warmup", "probe", "fallback", "deferred", "guard_event", "epsilon", "goodput",
    "batch_rows", "queued_s", "rows", "guess_rounds", "eligible_per_position",
)  # fmt: skip


def phoenix_of(rec: dict) -> dict:
    return {k: rec[k] for k in PHOENIX_FIELDS}


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
    """The app `serve` runs: the draft resolved (`server.draft`) and checked now, so a missing
    or unloadable one exits 2 before anything listens; models load in the background."""
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
    """Serve until SIGTERM or Ctrl-C. Then: stop admitting (/health says 503), let running
    requests finish within `shutdown_timeout_s`, cancel the rest, flush telemetry, exit."""
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
