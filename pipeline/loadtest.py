"""Load test: N concurrent clients against a running OpenAI-compatible Phoenix server.

    python -m pipeline bench --load --clients 4 --requests 40 [--url http://127.0.0.1:8000]

The held-out prompts (<artifacts>/data/test.jsonl) as chat requests of `bench.max_new_tokens`,
opted out of traffic capture (held-out prompts must never become training data). Writes
<artifacts>/bench/load.json: throughput, p50/p95 latency, errors and 429s.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from . import report
from .config import Config
from .errors import InputError
from .workspace import Workspace, atomic_write_json, read_jsonl

log = logging.getLogger(__name__)


def run(
    cfg: Config, ws: Workspace, url: str | None, clients: int, requests_total: int
) -> dict[str, Any]:
    import requests

    base = (url or f"http://{cfg.server.host}:{cfg.server.port}").rstrip("/")
    if not ws.test_file.exists():
        raise InputError(f"{ws.test_file} is missing: run the split stage first (make split)")
    prompts = [r["prompt"] for r in read_jsonl(ws.test_file)]
    headers = {}
    key = os.environ.get(cfg.server.api_key_env)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        listed = requests.get(base + "/v1/models", headers=headers, timeout=10).json()["data"]
    except Exception as exc:
        raise InputError(
            f"no Phoenix server answering at {base} ({type(exc).__name__}); start one with make serve"
        ) from None
    model = listed[0]["id"]

    def one(i: int) -> dict:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
            "max_tokens": cfg.bench.max_new_tokens,
            "phoenix": {"capture": False},  # held-out prompts: never training data
        }
        t0 = time.perf_counter()
        try:
            r = requests.post(
                base + "/v1/chat/completions", json=body, headers=headers, timeout=600
            )
            out = {"status": r.status_code, "latency_s": time.perf_counter() - t0}
            if r.status_code == 200:
                out["tokens"] = r.json()["usage"]["completion_tokens"]
            return out
        except requests.RequestException as exc:
            return {
                "status": None,
                "error": type(exc).__name__,
                "latency_s": time.perf_counter() - t0,
            }

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(
            tqdm(
                pool.map(one, range(requests_total)), total=requests_total, desc="load", unit="req"
            )
        )
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    lat = [r["latency_s"] for r in ok]
    summary = {
        "url": base,
        "model": model,
        "clients": clients,
        "requests": requests_total,
        "succeeded": len(ok),
        "rate_limited_429": sum(r["status"] == 429 for r in results),
        "errors": sum(r["status"] not in (200, 429) for r in results),
        "wall_s": wall,
        "requests_per_second": len(ok) / wall if wall > 0 else 0.0,
        "tokens_per_second": sum(r.get("tokens", 0) for r in ok) / wall if wall > 0 else 0.0,
        "p50_latency_s": report.percentile(lat, 50) if lat else None,
        "p95_latency_s": report.percentile(lat, 95) if lat else None,
    }
    atomic_write_json(ws.bench / "load.json", summary)
    log.info("load: %s", json.dumps(summary))
    return summary
