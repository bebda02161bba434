"""An OpenAI-compatible HTTP server over the serving core.

    python -m pipeline serve --config configs/default.yaml [--host H] [--port P]
                             [--mode target|fixed:K|bandit]          (or: make serve)

GET /health (503 while loading, shutting down or stuck; 200 when ready), GET /metrics,
GET /v1/models, POST /v1/chat/completions, POST /v1/completions (streaming with
`stream: true`), POST /admin/reload-draft. Every request runs on the core's one step loop,
beside every other, behind a bounded admission: a full server answers 429. Bad input always
gets a 4xx with an OpenAI-style error body, never a 500; a body over `server.max_body_kb` gets
413 before it is read.

schemas.py    the request schemas, what is refused, the error body
responses.py  response bodies, SSE chunks, logprobs, usage
handlers.py   the routes, admission, streaming, each request's record
app.py        create_app (loading, the gate, shutdown), build_app, serve, run_server
"""

from .app import build_app, create_app, is_loopback, run_server, serve

__all__ = ["build_app", "create_app", "is_loopback", "run_server", "serve"]
