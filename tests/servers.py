"""Real HTTP servers on 127.0.0.1 for tests: uvicorn in a thread."""

from __future__ import annotations

import json
import socket
import threading
import time

import uvicorn

from pipeline.config import load_config
from pipeline.models import Pair
from pipeline.serving.core import ServingCore, make_core
from pipeline.speculative.loaded import Models
from tests.conftest import free_port

TINY_ARMS = ["0", "draft:2", "draft:4", "draft:6", "draft:8", "ngram:4"]


class ServerThread:
    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def tiny_core(
    tiny_models,
    state_file=None,
    mode="bandit",
    seed=0,
    max_batch=4,
    arms=TINY_ARMS,
    with_draft=True,
    sets=("bandit.fallback=false",),
    draft=None,
) -> ServingCore:
    """A serving core over the tiny pair, built as every core is (`make_core`), from the
    default config with these arms (`sets`: more overrides; the drift guard off by default;
    `draft`: another draft model in place of the tiny one)."""
    tok, target, tiny_draft = tiny_models
    draft = draft if draft is not None else tiny_draft
    engine = Models(target, draft if with_draft else None, [tok.eos_token_id])
    cfg = load_config(
        None,
        [
            f"bandit.arms={json.dumps(arms)}",
            f"bandit.seed={seed}",
            "models.served_name=tiny",
            *sets,
        ],
    )
    draft_ref = "cut:1" if with_draft else None
    pair = Pair(tok, engine, "tiny", draft_ref)
    return make_core(cfg, pair, mode, draft_ref, state_file=state_file, max_batch=max_batch)


class Valve:
    """A forward pre-hook on a real model's input embeddings (the first thing every forward
    runs, transformers' and the lean runner's alike): `close()` makes the next forward passes
    wait until `open()` (a generation worker that is stuck), `delay_s` slows every pass."""

    def __init__(self, model, delay_s: float = 0.0):
        self.gate = threading.Event()
        self.gate.set()
        self.delay_s = delay_s
        self.calls = 0
        embeddings = model.get_input_embeddings()
        self.handle = embeddings.register_forward_pre_hook(self._hook)

    def _hook(self, _module, _args):
        self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        self.gate.wait()

    def close(self) -> None:
        self.gate.clear()

    def open(self) -> None:
        self.gate.set()

    def remove(self) -> None:
        self.gate.set()
        self.handle.remove()


# --- careless clients: real sockets that leave at the worst moments ---------------------------
def _raw_post(url: str, path: str, body: dict, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    data = json.dumps(body).encode()
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def hang_up_before_first_byte(url: str, path: str, body: dict) -> None:
    """Send the whole request, then close before anything comes back."""
    _raw_post(url, path, body).close()


def hang_up_mid_stream(url: str, path: str, body: dict) -> None:
    """Read until the first streamed event arrives, then close."""
    sock = _raw_post(url, path, body)
    sock.settimeout(60)
    seen = b""
    while b"data: " not in seen:
        got = sock.recv(4096)
        if not got:
            break
        seen += got
    sock.close()


def stop_reading(url: str, path: str, body: dict, hold_s: float) -> None:
    """Send the request, read nothing for `hold_s` seconds (a tiny receive buffer), then close."""
    sock = _raw_post(url, path, body, rcvbuf=1024)
    time.sleep(hold_s)
    sock.close()


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.held.append(conn)

    def __enter__(self) -> SilentServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()
