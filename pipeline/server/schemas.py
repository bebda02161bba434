"""The OpenAI request schemas and the error body every refusal carries (`APIError`, a 4xx).

Fields that change nothing (user, metadata, ...) are accepted; a field that would change the
answer and is not served gets a 400 naming it (`UNSERVED`), never silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..speculative.sampling import MAX_TOP_LOGPROBS


class APIError(Exception):
    """A refusal: the HTTP status and OpenAI's error object (message, type, param, code)."""

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
        self.status, self.message, self.type = status, message, type_
        self.param, self.code, self.headers = param, code, headers

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class PhoenixOptions(BaseModel):
    """The request's `phoenix` object: Phoenix's own options."""

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


def validation_error(exc: ValidationError) -> APIError:
    """The 400 of a body the schema refused: its first error, with the field's path as `param`."""
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return bad_request(f"{param}: {err['msg']}" if param else err["msg"], param)
