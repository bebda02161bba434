"""A real server whose draft turns slow mid-run, with Sentry from the environment (tests).

    SENTRY_DSN=... python -m tests.drift_server MODEL_CACHE

The draft is a copy of the tiny target (every guess accepted) and every target pass takes 20 ms,
so draft:4 pays about 3x at first. Requests go to the process's own HTTP server: warm-up and
fast drafting; then the draft is made slow (50 ms a pass: drafting now loses to plain
generation) until the drift guard falls back; the cool-down; then the draft is fast again and
the probe recovers. Prints one JSON line: every response's `phoenix` object (with the phase),
and the /metrics text. Its own process, because the Sentry SDK is process-wide.
"""

import json
import sys
from pathlib import Path

import requests

from pipeline import models, specs
from pipeline.config import load_config
from pipeline.server import create_app
from pipeline.serving.core import make_core
from pipeline.speculative.loaded import Models
from pipeline.telemetry import setup_telemetry
from tests.conftest import TINY_TARGET, wait_http
from tests.servers import ServerThread, Valve

COOLDOWN = 3
FAST = 8


def main() -> None:
    cache = Path(sys.argv[1])
    t, _ = specs.resolve_pair(TINY_TARGET, "cut:1", cache)
    tok = models.load_tokenizer(t)
    target, draft = (models.load_model(t, "float32", "cpu") for _ in range(2))
    Valve(target, delay_s=0.02)
    slow = Valve(draft)
    engine = Models(target, draft, [tok.eos_token_id])
    # No exploration: after warm-up the bandit exploits draft:4, so only the guard can stop it.
    cfg = load_config(
        None,
        [
            "bandit.arms=[0, 'draft:4']",
            "bandit.policy=seed",
            "bandit.epsilon_start=0",
            "bandit.epsilon_floor=0",
            "bandit.fallback_window=2",
            f"bandit.fallback_cooldown={COOLDOWN}",
            "bandit.fallback_min_samples=2",
            "models.served_name=tiny",
        ],
    )
    core = make_core(cfg, models.Pair(tok, engine, t, "copy"), "bandit", "copy", max_batch=1)
    telemetry = setup_telemetry(cfg, component="server")
    out = []
    with ServerThread(create_app(lambda: core, telemetry=telemetry)) as s:
        wait_http(s.url + "/health")

        def ask(phase: str) -> dict:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Write a function to add numbers."}],
                "max_tokens": 8,
                "phoenix": {"mode": "bandit"},
            }
            r = requests.post(s.url + "/v1/chat/completions", json=body, timeout=60)
            r.raise_for_status()
            out.append({**r.json()["phoenix"], "phase": phase})
            return out[-1]

        # Eight fast requests: the bandit's mean (tokens over time) holds draft:4 above plain
        # through the slow requests the guard needs (its window: 2).
        for _ in range(FAST):
            ask("fast")
        slow.delay_s = 0.05
        for _ in range(8):
            if ask("slow")["guard_event"] == "fallback":
                break
        for _ in range(COOLDOWN):
            ask("cooldown")
        slow.delay_s = 0.0
        for _ in range(3):
            ask("probe")
        metrics = requests.get(s.url + "/metrics", timeout=5).text
    telemetry.flush()
    print(json.dumps({"responses": out, "metrics": metrics}))


if __name__ == "__main__":
    main()
