"""The teacher's HTTP client: one OpenAI-compatible endpoint, a readiness wait with a deadline,
chat completions with retries (backoff on 408/429/5xx that honours Retry-After, none on other
4xx) drawn from a budget the whole stage shares.
"""

from __future__ import annotations

import email.utils
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import requests

from .errors import PhoenixError, TeacherUnavailable

log = logging.getLogger(__name__)

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
TRANSIENT = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


class TeacherRequestError(PhoenixError):
    """The teacher refused a request in a way retrying cannot fix (a 4xx other than 408/429)."""

    exit_code = 2


class RetryBudget:
    """Retries shared by every request of a stage, so a sick teacher cannot stall it forever."""

    def __init__(self, total: int):
        self.total = total
        self.used = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.used >= self.total:
                return False
            self.used += 1
            return True


def retry_after_seconds(value: str | None) -> float | None:
    """Parse Retry-After: delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError):
        return None


@dataclass
class Answer:
    completion: str
    finish_reason: str
    completion_tokens: int
    prompt_tokens: int | None
    model: str
    latency_s: float
    token_ids: list[int] | None = None
    # With logprobs asked for: per answer token [token, logprob, [[token, logprob], ...top-N]].
    logprobs: list[list] | None = None
    reasoning: str | None = None  # a reasoning model's `reasoning_content`, apart from the answer


class TeacherClient:
    """One OpenAI-compatible endpoint: readiness wait, chat completions with retries."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        request_timeout_s: float = 300.0,
        max_retries: int = 5,
        budget: RetryBudget | None = None,
        backoff_cap_s: float = 8.0,
        pool_size: int = 16,
    ):
        self.base_url = base_url.rstrip("/")
        root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self.health_url = root + "/health"
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.budget = budget or RetryBudget(10**9)
        self.backoff_cap_s = backoff_cap_s
        self.cancel = threading.Event()  # set to stop retrying (Ctrl-C, another request failed)
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=pool_size)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def __repr__(self) -> str:  # never shows the key
        return f"TeacherClient({self.base_url})"

    # --- readiness ---------------------------------------------------------------------------
    def wait_ready(self, model: str, timeout_s: float, max_delay_s: float = 4.0) -> None:
        """Poll /health until 200 (a 404 means the server has none), then /models until it lists
        `model`. Exponential backoff capped at `max_delay_s`; auth failures fail at once."""
        deadline = time.monotonic() + timeout_s
        delay = 0.25
        last = "no answer yet"
        health_done = False
        served: list[str] = []
        while True:
            try:
                if not health_done:
                    r = self.session.get(self.health_url, timeout=10)
                    self._fail_on_auth(r)
                    last = f"GET {self.health_url} -> {r.status_code}"
                    health_done = r.status_code in (200, 404)
                if health_done:
                    r = self.session.get(self.base_url + "/models", timeout=10)
                    self._fail_on_auth(r)
                    last = f"GET {self.base_url}/models -> {r.status_code}"
                    if r.status_code == 404:  # a server that is up, at the wrong path
                        hint = ""
                        if not self.base_url.endswith("/v1"):
                            hint = "; OpenAI-compatible servers serve it under /v1: teacher.url="
                            hint += f"{self.base_url}/v1"
                        raise TeacherRequestError(
                            f"teacher has no {self.base_url}/models (404){hint}"
                        )
                    if r.status_code == 200:
                        served = [m.get("id") for m in r.json().get("data", [])]
                        if model in served:
                            log.info("teacher ready at %s, serving %s", self.base_url, model)
                            return
                        last += f" (serves {served}, not yet {model!r})"
            except (requests.ConnectionError, requests.Timeout) as exc:
                last = f"{type(exc).__name__} connecting to {self.base_url}"
            except (ValueError, AttributeError):
                last = f"GET {self.base_url}/models -> malformed body"
            if time.monotonic() + delay > deadline:
                detail = f"; it serves {served}" if served else ""
                raise TeacherUnavailable(
                    f"teacher at {self.base_url} not ready for model {model!r} after {timeout_s:.0f}s "
                    f"(last: {last}){detail}"
                )
            time.sleep(delay)
            delay = min(delay * 2, max_delay_s)

    @staticmethod
    def _fail_on_auth(r: requests.Response) -> None:
        if r.status_code in (401, 403):
            raise TeacherRequestError(
                f"teacher refused our credentials ({r.status_code}) at {r.url}: set the API key "
                "environment variable named by teacher.api_key_env"
            )

    # --- generation --------------------------------------------------------------------------
    def chat(
        self,
        model: str,
        messages: list[dict],
        max_tokens: int,
        temperature: float = 0.0,
        extra: dict[str, Any] | None = None,
    ) -> tuple[Answer, int]:
        """One chat completion; returns the answer and the retries it took."""
        body = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=temperature)
        body.update(extra or {})
        retries = 0
        while True:
            t0 = time.perf_counter()
            wait_s: float | None = None
            try:
                r = self.session.post(
                    self.base_url + "/chat/completions", json=body, timeout=self.request_timeout_s
                )
                if r.status_code == 200:
                    return self._parse(r, model, time.perf_counter() - t0), retries
                if r.status_code not in RETRYABLE_STATUS:
                    raise TeacherRequestError(
                        f"teacher answered {r.status_code} to a chat request: {_error_message(r)}"
                    )
                problem = f"HTTP {r.status_code}: {_error_message(r)}"
                wait_s = retry_after_seconds(r.headers.get("Retry-After"))
            except TRANSIENT as exc:
                problem = f"{type(exc).__name__}"
            except _Malformed as exc:
                problem = f"malformed response: {exc}"
            if self.cancel.is_set():
                raise TeacherUnavailable(
                    f"teacher request abandoned: the stage is stopping (last: {problem})"
                )
            if retries >= self.max_retries or not self.budget.take():
                raise TeacherUnavailable(
                    f"teacher request failed after {retries} retries (last: {problem})"
                )
            retries += 1
            if wait_s is None:
                wait_s = min(self.backoff_cap_s, 0.5 * 2 ** (retries - 1))
            log.warning("teacher: %s; retry %d in %.1fs", problem, retries, wait_s)
            time.sleep(wait_s)

    @staticmethod
    def _parse(r: requests.Response, model: str, latency: float) -> Answer:
        try:
            data = r.json()
            choice = data["choices"][0]
            message = choice["message"]
            content = message["content"]
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            if content is None and isinstance(reasoning, str):  # cut off while still reasoning
                content = ""
            if not isinstance(content, str) or not isinstance(reasoning, str | None):
                raise TypeError("content is not a string")
            usage = data.get("usage") or {}
            # The answer's exact token ids: Phoenix's `phoenix.token_ids`, vLLM's `token_ids`.
            ids = (data.get("phoenix") or {}).get("token_ids")
            if ids is None:
                ids = choice.get("token_ids")
            content_lp = (choice.get("logprobs") or {}).get("content")
            logprobs = None
            if content_lp is not None:  # [] for an empty answer
                logprobs = [
                    [str(e["token"]), float(e["logprob"]),
                     [[str(x["token"]), float(x["logprob"])] for x in e.get("top_logprobs") or []]]
                    for e in content_lp
                ]  # fmt: skip
            return Answer(
                completion=content,
                finish_reason=choice.get("finish_reason") or "stop",
                completion_tokens=int(usage.get("completion_tokens", len(ids or []))),
                prompt_tokens=usage.get("prompt_tokens"),
                model=data.get("model", model),
                latency_s=latency,
                token_ids=ids,
                logprobs=logprobs,
                reasoning=reasoning or None,
            )
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise _Malformed(f"{type(exc).__name__}: {exc}") from None


class _Malformed(Exception):
    pass


def _error_message(r: requests.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:300]
