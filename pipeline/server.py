"""An OpenAI-compatible HTTP server over the speculative core.

    python -m pipeline serve --config configs/default.yaml [--host H] [--port P]
                             [--mode target|fixed:K|bandit]          (or: make serve)

GET /health (503 while loading, 200 when ready), GET /v1/models, POST /v1/chat/completions,
POST /v1/completions (streaming with `stream: true`). Generation is serialised per model pair
behind a bounded queue: a full queue answers 429. Bad input always gets a 4xx with an
OpenAI-style error body, never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .spec.core import CoreResult, ModeError, ServingCore

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


# --- request schemas (extra fields that OpenAI clients send are accepted and ignored) ---------
class PhoenixOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str | None = None


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


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=1)
    phoenix: PhoenixOptions | None = None

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


class CompletionRequest(CommonRequest):
    prompt: str | list[str]

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


class Gate:
    """Bounded admission: at most `size` requests waiting or running, one generating at a time."""

    def __init__(self, size: int):
        self.size = size
        self.admitted = 0
        self.turn = asyncio.Lock()

    def try_admit(self) -> bool:
        if self.admitted >= self.size:
            return False
        self.admitted += 1
        return True

    def leave(self) -> None:
        self.admitted -= 1


def create_app(
    load_core: Callable[[], ServingCore],
    queue_size: int = 8,
    api_key_env: str = "PHOENIX_API_KEY",
    max_tokens_limit: int = 4096,
    telemetry=None,
) -> FastAPI:
    """`load_core` runs in a background thread at start-up; /health says 503 until it is done."""
    from .telemetry import NullTelemetry

    telemetry = telemetry or NullTelemetry()
    app = FastAPI(title="Phoenix speculative server")
    state: dict[str, Any] = {"core": None, "error": None}
    app.state.phoenix = state  # the loaded core, for introspection (tests, embedding apps)
    gate_holder: dict[str, Gate] = {}
    api_key = os.environ.get(api_key_env) or None
    # One thread per admitted request: waiting batch members each hold one.
    pool = ThreadPoolExecutor(max_workers=queue_size + 1, thread_name_prefix="phoenix-gen")

    def _load() -> None:
        try:
            state["core"] = load_core()
            log.info("models loaded; ready")
        except Exception as exc:  # reported by /health; the process stays up to say so
            log.exception("model loading failed")
            state["error"] = f"{type(exc).__name__}: {exc}"

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        gate_holder["gate"] = Gate(queue_size)
        threading.Thread(target=_load, name="phoenix-load", daemon=True).start()
        yield
        telemetry.flush()

    app.router.lifespan_context = lifespan

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path != "/health":
            header = request.headers.get("authorization", "")
            if header != f"Bearer {api_key}":
                return APIError(
                    401,
                    "invalid or missing API key",
                    "authentication_error",
                    None,
                    "invalid_api_key",
                ).response()
        return await call_next(request)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(404)
    async def _not_found(_request: Request, _exc):
        return APIError(
            404, "no such endpoint", "invalid_request_error", None, "not_found"
        ).response()

    @app.exception_handler(405)
    async def _bad_method(_request: Request, _exc):
        return APIError(405, "method not allowed", "invalid_request_error", None, None).response()

    def ready_core() -> ServingCore:
        core = state["core"]
        if core is None:
            raise APIError(
                503, state["error"] or "models are loading", "server_error", None, "model_not_ready"
            )
        return core

    @app.get("/health")
    async def health():
        if state["core"] is not None:
            return {"status": "ok"}
        return JSONResponse(
            {"status": "error" if state["error"] else "loading", "detail": state["error"]},
            status_code=503,
        )

    @app.get("/v1/models")
    async def list_models():
        core = ready_core()
        return {
            "object": "list",
            "data": [{"id": core.model_id, "object": "model", "created": 0, "owned_by": "phoenix"}],
        }

    async def parse(request: Request, schema):
        try:
            raw = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise bad_request("request body is not valid JSON") from None
        if not isinstance(raw, dict):
            raise bad_request("request body must be a JSON object")
        try:
            return schema.model_validate(raw)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    def prepare(core: ServingCore, req: CommonRequest, prompt_ids: list[int]):
        if req.model != core.model_id:
            raise APIError(
                404,
                f"model '{req.model}' is not served here; it serves '{core.model_id}'",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        if req.temperature not in (None, 0.0):
            raise bad_request(
                "Phoenix serves greedy decoding only: temperature must be 0 or absent",
                "temperature",
            )
        max_tokens = req.max_completion_tokens or req.max_tokens or 256
        if max_tokens > max_tokens_limit:
            raise bad_request(
                f"max_tokens {max_tokens} exceeds this server's limit of {max_tokens_limit}",
                "max_tokens",
            )
        ctx = core.max_context
        if ctx is not None and len(prompt_ids) + max_tokens > ctx:
            raise bad_request(
                f"this model's maximum context length is {ctx} tokens; the prompt has "
                f"{len(prompt_ids)} and max_tokens asks for {max_tokens}",
                "messages",
                "context_length_exceeded",
            )
        try:
            mode = core.mode(req.phoenix.mode if req.phoenix else None)
        except ModeError as exc:
            raise bad_request(str(exc), "phoenix.mode") from None
        return max_tokens, mode

    async def run(request: Request, req: CommonRequest, prompt_ids: list[int], kind: str):
        core = ready_core()
        max_tokens, mode = prepare(core, req, prompt_ids)
        gate = gate_holder["gate"]
        if not gate.try_admit():
            raise APIError(
                429,
                f"server busy: {gate.size} requests queued or running; retry later",
                "rate_limit_error",
                None,
                "queue_full",
                headers={"Retry-After": "1"},
            )
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        cancel = threading.Event()
        loop = asyncio.get_running_loop()
        try:
            if req.stream:
                return StreamingResponse(
                    stream(
                        request,
                        core,
                        gate,
                        req,
                        prompt_ids,
                        max_tokens,
                        mode,
                        cancel,
                        rid,
                        created,
                        kind,
                    ),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            watcher = asyncio.create_task(_watch_disconnect(request, cancel))

            def work():
                return telemetry.request(core, prompt_ids, max_tokens, mode, req.stop, None, cancel)

            try:
                if core.batcher is not None and mode.kind == "target" and not req.stop:
                    # Batched with whatever else is waiting: no turn, the batcher serialises.
                    res = await loop.run_in_executor(pool, work)
                else:
                    if not await _take_turn(gate, cancel):
                        raise APIError(499, "client disconnected", "invalid_request_error")
                    try:
                        res = await loop.run_in_executor(pool, work)
                    finally:
                        gate.turn.release()
            finally:
                watcher.cancel()
            return body(core, res, rid, created, kind, len(prompt_ids))
        finally:
            if not req.stream:
                gate.leave()

    async def stream(
        request, core, gate, req, prompt_ids, max_tokens, mode, cancel, rid, created, kind
    ):
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> str:
            if kind == "chat":
                delta = (
                    {"role": "assistant", "content": ""}
                    if role
                    else ({"content": delta_text} if delta_text else {})
                )
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {
                    "index": 0,
                    "text": delta_text or "",
                    "finish_reason": finish,
                    "logprobs": None,
                }
            return (
                "data: "
                + json.dumps(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": core.model_id,
                        "choices": [choice],
                    }
                )
                + "\n\n"
            )

        fut = None
        has_turn = False
        try:
            if not await _take_turn(gate, cancel):
                return
            has_turn = True
            if kind == "chat":
                yield chunk(None, None, role=True)
            fut = loop.run_in_executor(
                pool,
                lambda: telemetry.request(
                    core,
                    prompt_ids,
                    max_tokens,
                    mode,
                    req.stop,
                    lambda t: loop.call_soon_threadsafe(queue.put_nowait, t),
                    cancel,
                ),
            )
            # The turn and the slot are handed back when generation ends, even if the client
            # left first (then `cancel` stops the engine after its current round).
            fut.add_done_callback(
                lambda _f: (queue.put_nowait(None), gate.turn.release(), gate.leave())
            )
            while (piece := await queue.get()) is not None:
                yield chunk(piece, None)
            res = await fut
            yield chunk(None, res.finish_reason)
            if (req.stream_options or {}).get("include_usage"):
                usage = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": core.model_id,
                    "choices": [],
                    "usage": usage_of(res, len(prompt_ids)),
                    "phoenix": phoenix_of(res),
                }
                yield "data: " + json.dumps(usage) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if fut is None:
                if has_turn:
                    gate.turn.release()
                gate.leave()
            elif not fut.done():
                cancel.set()

    def body(core: ServingCore, res: CoreResult, rid: str, created: int, kind: str, n_prompt: int):
        if kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": res.text},
                "finish_reason": res.finish_reason,
                "logprobs": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": res.text,
                "finish_reason": res.finish_reason,
                "logprobs": None,
            }
            obj = "text_completion"
        ph = phoenix_of(res)
        if not res.stopped_by_string:  # the exact ids, for distillation on the teacher's tokens
            ph["token_ids"] = res.result.token_ids
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": core.model_id,
            "choices": [choice],
            "usage": usage_of(res, n_prompt),
            "phoenix": ph,
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        core = ready_core()
        req = await parse(request, ChatRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        if not any(m["content"].strip() for m in messages):
            raise bad_request("messages are all empty", "messages")
        try:
            prompt_ids = core.chat_prompt_ids(messages, req.chat_template_kwargs)
        except Exception as exc:  # a template that rejects this conversation
            raise bad_request(
                f"chat template could not render the messages: {exc}", "messages"
            ) from None
        return await run(request, req, prompt_ids, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        core = ready_core()
        req = await parse(request, CompletionRequest)
        return await run(request, req, core.text_prompt_ids(req.prompt), "text")

    return app


async def _take_turn(gate: Gate, cancel: threading.Event) -> bool:
    """Wait for the generation turn; give up if the client went away meanwhile."""
    acquire = asyncio.ensure_future(gate.turn.acquire())
    while True:
        done, _ = await asyncio.wait({acquire}, timeout=0.1)
        if done:
            if cancel.is_set():
                gate.turn.release()
                return False
            return True
        if cancel.is_set():
            acquire.cancel()
            try:
                await acquire
                gate.turn.release()  # it won the race: hand the turn back
            except asyncio.CancelledError:
                pass
            return False


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    while not cancel.is_set():
        if await request.is_disconnected():
            cancel.set()
            return
        await asyncio.sleep(0.1)


def usage_of(res: CoreResult, n_prompt: int) -> dict:
    r = res.result
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": r.output_tokens,
        "total_tokens": n_prompt + r.output_tokens,
        "completion_tokens_details": {
            "accepted_prediction_tokens": r.accepted,
            "rejected_prediction_tokens": r.proposed - r.accepted,
        },
    }


def phoenix_of(res: CoreResult) -> dict:
    r, d = res.result, res.decision
    return {
        "mode": res.mode.spec,
        "arm": r.arm,
        "proposed": r.proposed,
        "accepted": r.accepted,
        "acceptance": r.acceptance,
        "tokens_per_second": r.tokens_per_second,
        "latency_s": r.latency_s,
        "draft_s": r.draft_s,
        "verify_s": r.verify_s,
        "accepted_per_position": r.accepted_per_position,
        "proposed_per_position": r.proposed_per_position,
        "explored": d.explored if d else None,
        "epsilon": d.epsilon if d else None,
    }


def serve(cfg, ws, host: str | None, port: int | None, mode: str | None) -> None:
    import uvicorn

    from .spec.core import build_core
    from .telemetry import setup_telemetry

    mode = mode or cfg.server.mode
    telemetry = setup_telemetry(cfg, component="server")
    app = create_app(
        lambda: build_core(cfg, ws, mode=mode),
        queue_size=cfg.server.queue_size,
        api_key_env=cfg.server.api_key_env,
        max_tokens_limit=cfg.server.max_tokens_limit,
        telemetry=telemetry,
    )
    host = host or cfg.server.host
    port = cfg.server.port if port is None else port
    log.info("serving %s (mode %s) on http://%s:%d", cfg.models.target, mode, host, port)
    uvicorn.run(app, host=host, port=port, log_level="warning")
