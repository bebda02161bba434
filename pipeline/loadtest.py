"""Measuring any OpenAI-compatible server from the client's side: Phoenix's, vLLM, or another.

    python -m pipeline bench --url URL [--clients 1]        every bench.sets set, one client
    python -m benchmarks.serving_load                          every mode from 1 to 16 clients

Greedy streamed chat requests of `bench.max_new_tokens`, opted out of traffic capture (held-out
prompts never become training data). Tokens/s, latency and TTFT are the client's; acceptance is
the server's own `vllm:`/`phoenix:spec_decode_*` counters read before and after.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests
from tqdm import tqdm

from . import data, report
from .config import Config
from .errors import InputError
from .workspace import Workspace, atomic_write_json, read_jsonl

log = logging.getLogger(__name__)

SPEC_PREFIXES = ("vllm", "phoenix")


class Endpoint:
    """One OpenAI-compatible server: its model, streamed chat requests, its metrics."""

    def __init__(self, base: str, api_key: str | None = None, timeout_s: float = 900.0):
        self.base = base.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=64)
        self.session.mount("http://", adapter)
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def __repr__(self) -> str:  # never shows the key
        return f"Endpoint({self.base})"

    def model(self) -> str:
        """The first model the server lists; InputError naming the URL when none answers."""
        try:
            r = self.session.get(self.base + "/v1/models", timeout=10)
            r.raise_for_status()
            return r.json()["data"][0]["id"]
        except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
            raise InputError(
                f"no OpenAI-compatible server answering at {self.base} ({type(exc).__name__}); "
                "start one (make serve) or pass --url"
            ) from None

    def chat(
        self, model: str, prompt: str | list[dict], max_tokens: int, extra: dict | None = None,
        stream: bool = True,
    ) -> dict:  # fmt: skip
        """One greedy chat completion of a user message (or of chat `messages`) -> status,
        latency_s, ttft_s (streamed only), tokens."""
        body = {
            "model": model,
            "messages": prompt
            if isinstance(prompt, list)
            else [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}),
            **(extra or {}),
        }
        t0 = time.perf_counter()
        out: dict[str, Any] = {"status": None, "ttft_s": None, "tokens": 0}
        if not stream:
            try:
                r = self.session.post(
                    self.base + "/v1/chat/completions", json=body, timeout=self.timeout_s
                )
                out["status"] = r.status_code
                if r.status_code == 200:
                    data = r.json()
                    out["tokens"] = data["usage"]["completion_tokens"]
                    out.update(phoenix_fields(data.get("phoenix")))
                else:
                    out["error"] = r.text[:300]
            except (requests.RequestException, ValueError, KeyError) as exc:
                out["error"] = type(exc).__name__
            out["latency_s"] = time.perf_counter() - t0
            return out
        try:
            with self.session.post(
                self.base + "/v1/chat/completions", json=body, stream=True, timeout=self.timeout_s
            ) as r:
                out["status"] = r.status_code
                if r.status_code != 200:
                    out["error"] = r.text[:300]
                for line in r.iter_lines() if r.status_code == 200 else ():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        out["tokens"] = chunk["usage"]["completion_tokens"]
                    if chunk.get("phoenix"):  # Phoenix's own figures: the arm that ran it
                        out.update(phoenix_fields(chunk["phoenix"]))
                    delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                    if delta.get("content") and out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
        except (requests.RequestException, ValueError) as exc:
            out["error"] = type(exc).__name__
        out["latency_s"] = time.perf_counter() - t0
        return out

    def spec_counters(self) -> dict[str, Any] | None:
        """The server's speculative-decoding counters now (None: it exposes none, or no
        /metrics at all: a hosted API's 404 is no exposition)."""
        try:
            r = self.session.get(self.base + "/metrics", timeout=10)
        except requests.RequestException:
            return None
        return spec_counters(r.text) if r.status_code == 200 else None


def spec_counters(exposition: str) -> dict[str, Any] | None:
    """Drafts, draft tokens, accepted, accepted per position (and Phoenix's `gc_full`,
    `gc_full_s`) from a Prometheus exposition, summed over label sets; None without any."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    found = False
    for family in text_string_to_metric_families(exposition):
        if family.name == "phoenix:gc_pause_seconds":  # full collections (`serving.heap`)
            for s in family.samples:
                if s.labels.get("generation") == "2" and s.name.endswith(("_count", "_sum")):
                    out["gc_full" if s.name.endswith("_count") else "gc_full_s"] = s.value
            continue
        prefix, _, name = family.name.partition(":")
        if prefix not in SPEC_PREFIXES or not name.startswith("spec_decode_"):
            continue
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            found = True
            key = name.removeprefix("spec_decode_")
            if key == "num_accepted_tokens_per_pos":
                pos = int(s.labels["position"])
                out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + s.value
            elif key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                field = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens"}.get(
                    key, "accepted"
                )
                out[field] += s.value
    return out if found else None


def acceptance_between(before: dict | None, after: dict | None) -> dict[str, Any]:
    """As vLLM defines them: acceptance = accepted / draft tokens, per position = accepted at
    i / drafts, mean acceptance length = 1 + accepted / drafts."""
    if after is None:
        return {"acceptance": None, "per_position": [], "mean_acceptance_length": None}
    before = before or {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": {}}
    drafts = after["drafts"] - before["drafts"]
    tokens = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted"] - before["accepted"]
    positions = sorted(after["per_pos"])
    per_pos = [after["per_pos"][p] - before["per_pos"].get(p, 0.0) for p in positions]
    return {
        "drafts": drafts,
        "draft_tokens": tokens,
        "accepted": accepted,
        "acceptance": accepted / tokens if tokens else None,
        "per_position": [a / drafts for a in per_pos] if drafts else [],
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def sweep_point(
    ep: Endpoint, model: str, prompts: list[str], clients: int, max_tokens: int,
    extra: dict | None = None, progress: str | None = None, stream: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Every prompt once, `clients` at a time: one `summarise`d point."""
    return summarise([run_round(ep, model, prompts, clients, max_tokens, extra, progress, stream)])


def interleaved(
    ep: Endpoint, model: str, prompts: list[str], clients: int, max_tokens: int,
    extras: dict[str, dict | None], rounds: int = 2, stream: bool = True,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """`sweep_point` per mode of one server, interleaved: `rounds` slices of the prompts (each
    >= `clients` long), each served by every mode in turn, order reversed every other round."""
    rounds = max(1, min(rounds, len(prompts) // max(1, clients)))
    size = -(-len(prompts) // rounds)
    slices = [prompts[i : i + size] for i in range(0, len(prompts), size)]
    labels = list(extras)
    done: dict[str, list[dict]] = {label: [] for label in labels}
    for i, part in enumerate(slices):
        for label in labels if i % 2 == 0 else labels[::-1]:
            desc = f"{label} c={clients} {i + 1}/{len(slices)}"
            done[label].append(
                run_round(ep, model, part, clients, max_tokens, extras[label], desc, stream)
            )
    return {label: summarise(done[label]) | {"rounds": len(slices)} for label in labels}


def run_round(
    ep: Endpoint, model: str, prompts: list[str], clients: int, max_tokens: int,
    extra: dict | None = None, progress: str | None = None, stream: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """The prompts, `clients` at a time: results, wall_s, counters before and after."""
    before = ep.spec_counters()
    todo = iter(prompts)
    lock = threading.Lock()
    results: list[dict] = []
    bar = tqdm(total=len(prompts), desc=progress, unit="req", disable=progress is None)

    def client() -> None:
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            res = ep.chat(model, item, max_tokens, extra, stream)
            with lock:
                results.append(res)
                bar.update(1)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    wall = time.perf_counter() - t0
    bar.close()
    return {"clients": clients, "results": results, "wall_s": wall, "before": before,
            "after": ep.spec_counters()}  # fmt: skip


def _moved(before: dict | None, after: dict | None) -> dict | None:
    """The counters' change between two readings (None: the server exposes none)."""
    if after is None:
        return None
    before = before or {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": {}}
    out = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    for k in ("gc_full", "gc_full_s"):
        if k in after:
            out[k] = after[k] - before.get(k, 0.0)
    out["per_pos"] = {p: v - before["per_pos"].get(p, 0.0) for p, v in after["per_pos"].items()}
    return out


def summarise(rounds: list[dict]) -> dict[str, Any]:
    """One point from `run_round`s: requests pooled, wall clocks added, and each round's own
    tokens/s (`round_tokens_per_second`) to compare interleaved modes round by round."""
    results = [r for rnd in rounds for r in rnd["results"]]
    wall = sum(rnd["wall_s"] for rnd in rounds)
    moved = [_moved(rnd["before"], rnd["after"]) for rnd in rounds]
    total = None
    if all(m is not None for m in moved):
        total = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
        for m in moved:
            for k in ("drafts", "draft_tokens", "accepted"):
                total[k] += m[k]
            for pos, v in m["per_pos"].items():
                total["per_pos"][pos] = total["per_pos"].get(pos, 0.0) + v
    ok = [r for r in results if r["status"] == 200]
    arms = Counter(r["arm"] for r in ok if r.get("arm") is not None)
    # The bandit's guessing requests: why it chose them, and how far the per-step gate let them.
    guessing = [r for r in ok if r.get("why") and r.get("arm") not in (None, "0")]
    why = Counter(r["why"] for r in guessing)
    stepped = sum(r.get("rounds") or 0 for r in guessing)
    guessed = sum(r.get("guess_rounds") or 0 for r in guessing)
    capped = [r for r in guessing if r.get("eligible_per_position") is not None]
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    return {
        "clients": rounds[0]["clients"],
        "requests": len(results),
        "succeeded": len(ok),
        "rate_limited_429": sum(r["status"] == 429 for r in results),
        "errors": sum(r["status"] not in (200, 429) for r in results),
        "error_examples": [r.get("error") for r in results if r["status"] != 200][:3],
        "wall_s": wall,
        "output_tokens": sum(r["tokens"] for r in ok),
        "tokens_per_second": sum(r["tokens"] for r in ok) / wall if wall > 0 else 0.0,
        "round_tokens_per_second": [
            sum(r["tokens"] for r in rnd["results"] if r["status"] == 200) / rnd["wall_s"]
            if rnd["wall_s"] > 0
            else 0.0
            for rnd in rounds
        ],
        "p50_latency_s": report.percentile(lat, 50) if lat else None,
        "p95_latency_s": report.percentile(lat, 95) if lat else None,
        "p50_ttft_s": report.percentile(ttft, 50) if ttft else None,
        "p95_ttft_s": report.percentile(ttft, 95) if ttft else None,
        "arms": dict(sorted(arms.items())),  # Phoenix: which arm served the requests
        "speculated_because": dict(sorted(why.items())),
        "guessing_joined_rows": (
            sum(r.get("rows") or 0 for r in guessing) / len(guessing) if guessing else None
        ),
        "guessing_steps_share": guessed / stepped if stepped else None,
        "guessing_cap": (
            sum(sum(r["eligible_per_position"]) for r in capped)
            / max(1, sum(r.get("guess_rounds") or 0 for r in capped))
            if capped
            else None
        ),
        **acceptance_between(None, total),
        "gc_full": _gc(moved, "gc_full"),
        "gc_full_s": _gc(moved, "gc_full_s"),
    }


def _gc(moved: list[dict | None], key: str) -> float | None:
    got = [m[key] for m in moved if m is not None and key in m]
    return sum(got) if got else None


def phoenix_fields(ph: dict | None) -> dict[str, Any]:
    """What the load test keeps of a response's `phoenix` block."""
    ph = ph or {}
    return {"arm": ph.get("arm"), "why": why_of(ph), "rows": ph.get("rows"),
            "rounds": ph.get("rounds"), "guess_rounds": ph.get("guess_rounds"),
            "eligible_per_position": ph.get("eligible_per_position")}  # fmt: skip


def why_of(ph: dict | None) -> str | None:
    """How Phoenix's bandit chose a request's arm (None: not a bandit request)."""
    if not ph or ph.get("explored") is None:
        return None
    for key in ("warmup", "probe", "fallback", "explored", "deferred"):
        if ph.get(key):
            return key
    return "exploited"


def _endpoint(cfg: Config, url: str | None) -> Endpoint:
    base = url or f"http://{cfg.server.host}:{cfg.server.port}"
    return Endpoint(base, os.environ.get(cfg.server.api_key_env))


def held_out_prompts(ws: Workspace, n: int | None = None) -> list[str]:
    """The split's held-out prompts (the first `n`); InputError before the split has run."""
    _split_done(ws)
    return [r["prompt"] for r in read_jsonl(ws.test_file)][:n]


def _split_done(ws: Workspace) -> None:
    if not ws.test_file.exists():
        raise InputError(f"{ws.test_file} is missing: run the split stage first (make split)")


def load_sets(cfg: Config, ws: Workspace) -> dict[str, list[dict]]:
    """`bench.sets` by name -> rows, the first `bench.prompts` of each (the bench's and bench
    --url's alike); InputError if a set is missing or empty."""
    if "heldout" in cfg.bench.sets:
        _split_done(ws)
    sets = {name: data.load_set(name, ws)[: cfg.bench.prompts] for name in cfg.bench.sets}
    for name, rows in sets.items():
        if not rows:
            raise InputError(f"bench.sets: {name} has no prompts")
    return sets


NO_CAPTURE = {"phoenix": {"capture": False}}  # other servers ignore the field


def run_remote(cfg: Config, ws: Workspace, url: str, clients: int = 1) -> dict[str, Any]:
    """bench --url: every set of `bench.sets` against any server, each row's request as the
    bench renders it (`data.bench_messages`) -> <artifacts>/bench/remote.json: the first set's
    figures at the top level, every set's under "sets"."""
    ep = _endpoint(cfg, url)
    model = ep.model()
    points = {}
    for name, rows in load_sets(cfg, ws).items():
        prompts = [data.bench_messages(r) for r in rows]
        point = sweep_point(ep, model, prompts, clients, cfg.bench.max_new_tokens, NO_CAPTURE,
                            f"bench {name} {ep.base}")  # fmt: skip
        points[name] = {"prompts": len(prompts), **point}
        acc = point["acceptance"]
        log.info(
            "bench --url %s, set %s: %d prompts, %.2f tokens/s, acceptance %s (per position %s)",
            ep.base,
            name,
            len(prompts),
            point["tokens_per_second"],
            "n/a (no speculative counters)" if acc is None else f"{acc:.3f}",
            [round(x, 3) for x in point["per_position"]],
        )
    first = {k: v for k, v in points[cfg.bench.sets[0]].items() if k != "prompts"}
    summary = {"url": ep.base, "model": model, "max_new_tokens": cfg.bench.max_new_tokens, **first}
    summary["sets"] = points
    atomic_write_json(ws.bench / "remote.json", summary)
    return summary
