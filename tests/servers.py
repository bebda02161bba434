"""Real HTTP servers on 127.0.0.1 for tests: uvicorn in a thread."""

from __future__ import annotations

import random
import threading
import time

import uvicorn

from pipeline.spec.bandit import EpsilonGreedy
from pipeline.spec.core import ServingCore
from pipeline.spec.engine import SpecEngine
from tests.conftest import free_port


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


def tiny_core(tiny_models, state_file=None, mode="bandit", seed=0) -> ServingCore:
    tok, target, draft = tiny_models
    engine = SpecEngine(target, draft, [tok.eos_token_id])
    bandit = EpsilonGreedy([0, 2, 4, 6, 8], random.Random(seed))
    return ServingCore(
        engine, tok, bandit, "tiny", "cut:1", default_mode=mode, state_file=state_file
    )
