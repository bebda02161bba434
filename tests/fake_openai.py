"""A real HTTP server on 127.0.0.1 that speaks just enough OpenAI, and misbehaves on request."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def canned_answer(prompt: str) -> str:
    return "def solution():\n    return " + hashlib.sha256(prompt.encode()).hexdigest()[:8]


def char_logprobs(text: str, top: int) -> list[dict]:
    """OpenAI's logprobs.content for `text` as one token per character: each is the likeliest
    (-0.1), then other characters at -3, -4, ..."""
    out = []
    for ch in text:
        others = [c for c in "xyz0123456789" if c != ch][: max(0, top - 1)]
        entries = [{"token": ch, "logprob": -0.1}] + [
            {"token": c, "logprob": -3.0 - i} for i, c in enumerate(others)
        ]
        out.append({"token": ch, "logprob": -0.1, "top_logprobs": entries[:top]})
    return out


class FakeOpenAI:
    """Behaviour knobs (all counters are of requests seen so far):
    health_503: first N /health calls answer 503; no_health: /health is 404 (hosted APIs)
    models_empty: first N /v1/models calls list no model; auth: required bearer key
    chat_429: first N chat calls answer 429 with Retry-After; drop: first N chat calls close the
    connection without answering; malformed: first N chat calls return a non-JSON 200;
    bad_request_for: prompts (substring) that always get a 400; delay_s: per chat answer;
    reasoning: answers carry `reasoning_content` (a reasoning model behind a reasoning parser).
    logprobs (answered only when a request asks for them): "chars": one token per character of
    the answer, with its top_logprobs (the character first, then "x", "y", ... as needed);
    "none": no logprobs at all; "wrong": tokens that do not spell the answer.
    """

    def __init__(self, model="fake", **knobs):
        self.model = model
        self.knobs = {
            "health_503": 0,
            "no_health": False,
            "models_empty": 0,
            "auth": None,
            "chat_429": 0,
            "retry_after": "0.2",
            "drop": 0,
            "malformed": 0,
            "bad_request_for": None,
            "delay_s": 0.0,
            "logprobs": "chars",
            "reasoning": False,
            **knobs,
        }
        self.calls = {"health": 0, "models": 0, "chat": 0}
        self.chat_prompts: list[str] = []
        self.chat_bodies: list[dict] = []  # every chat request body as received
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status, body, headers=None):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self):
                key = fake.knobs["auth"]
                if key and self.headers.get("Authorization") != f"Bearer {key}":
                    self._send(
                        401, {"error": {"message": "bad key", "type": "authentication_error"}}
                    )
                    return False
                return True

            def do_GET(self):
                if not self.path.startswith(("/health", "/v1/")):  # served under /v1 only
                    return self._send(404, {"error": {"message": "not found"}})
                with fake.lock:
                    if self.path == "/health":
                        fake.calls["health"] += 1
                        n = fake.calls["health"]
                    elif self.path == "/v1/models":
                        fake.calls["models"] += 1
                        n = fake.calls["models"]
                    else:
                        return self._send(404, {"error": {"message": "nope"}})
                if self.path == "/health":
                    if fake.knobs["no_health"]:
                        return self._send(404, {"error": {"message": "no such route"}})
                    return self._send(503 if n <= fake.knobs["health_503"] else 200, {})
                if not self._authorized():
                    return
                data = (
                    []
                    if n <= fake.knobs["models_empty"]
                    else [{"id": fake.model, "object": "model"}]
                )
                self._send(200, {"object": "list", "data": data})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if not self._authorized():
                    return
                with fake.lock:
                    fake.chat_bodies.append(body)
                    fake.calls["chat"] += 1
                    n = fake.calls["chat"]
                prompt = body["messages"][-1]["content"]
                k = fake.knobs
                if k["bad_request_for"] and k["bad_request_for"] in prompt:
                    return self._send(
                        400,
                        {
                            "error": {
                                "message": "prompt rejected by policy",
                                "type": "invalid_request_error",
                            }
                        },
                    )
                if n <= k["chat_429"]:
                    return self._send(
                        429, {"error": {"message": "slow down"}}, {"Retry-After": k["retry_after"]}
                    )
                if n <= k["chat_429"] + k["drop"]:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if n <= k["chat_429"] + k["drop"] + k["malformed"]:
                    return self._send(200, b"<html>oops</html>")
                time.sleep(k["delay_s"])
                with fake.lock:
                    fake.chat_prompts.append(prompt)
                text = canned_answer(prompt)
                finish = "length" if "cut me" in prompt else "stop"
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
                if k["reasoning"]:
                    choice["message"]["reasoning_content"] = "Think: " + prompt[:12]
                if body.get("logprobs") and k["logprobs"] != "none":
                    spelt = text if k["logprobs"] == "chars" else text[::-1]
                    choice["logprobs"] = {
                        "content": char_logprobs(spelt, int(body.get("top_logprobs") or 0))
                    }
                self._send(
                    200,
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "model": fake.model,
                        "choices": [choice],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
                    },
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
