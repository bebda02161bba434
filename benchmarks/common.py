"""What the benchmark scripts share: the environment header, running a stage or a server the way a
user does (`python -m pipeline ...`), timing one draft pass, and writing results. (A target's pass
is timed by the step loop's own `speculative.runner.step_ms`.)

Scripts run from the repository root as modules: `.venv/bin/python -m benchmarks.serving_load`.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests
import torch

from pipeline import models
from pipeline.bench import environment as _environment
from pipeline.speculative.rows import RowCache, draft_scores, prefill
from pipeline.speculative.sampling import greedy_ids
from pipeline.subprocs import PREEXEC, free_port, stop
from pipeline.teacher import serve_command
from pipeline.workspace import atomic_write_json, atomic_write_text

ROOT = Path(__file__).resolve().parent.parent


def environment(cfg) -> dict:
    """Machine, device, dtype, threads, versions and date (the bench's `environment`)."""
    return _environment(cfg, models.pick_device(cfg.models.device))


def header(env: dict) -> str:
    """One line naming the machine and the run, for every report."""
    return (
        f"{env['hardware']}; {env['device']}, {env['dtype']}, {env['threads']} threads; torch "
        f"{env['torch']}, transformers {env['transformers']}; {env['date']}"
    )


@torch.inference_mode()
def draft_step_ms(drafter, repeat: int = 30, context: int = 64) -> float:
    """Median milliseconds of one draft pass of a `propose.draft_model.Drafter` as its proposer
    runs it (one token fed, scored by the drafter's head, pruned or full, the greedy pick read
    back) after a prefill of `context` tokens, in a scratch cache of its own: what
    `speculative.runner.step_ms` is for a target. Prepare the model first (`runner.prepare`)."""
    model = drafter.model
    cache = RowCache(model, 1, context + 1)
    slot = cache.alloc()
    prefill(model, cache, [slot], [[0] * context])
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        greedy_ids(draft_scores(model, cache, [slot], [[0]], drafter.head)).tolist()
        times.append(time.perf_counter() - t0)
        cache.crop(slot, context)
    return 1000 * sorted(times[1:])[repeat // 2]


def table(head: list[str], rows: list[list]) -> list[str]:
    """A Markdown table's lines."""
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(str(c) for c in r) + " |" for r in rows),
    ]


def write_results(folder: Path, name: str, results: dict, markdown: str) -> None:
    """<folder>/<name>.json and .md, written whole; the Markdown is printed too."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / f"{name}.json", results)
    atomic_write_text(folder / f"{name}.md", markdown)
    print(markdown, flush=True)


def _sets(sets) -> list[str]:
    return [x for s in sets for x in ("--set", s)]


def run_stage(
    stage: str, config: str, artifacts: Path, sets=(), log: Path | None = None, cache=None,
    allow: tuple[int, ...] = (0,),
) -> tuple[int, float]:  # fmt: skip
    """`python -m pipeline STAGE` as a user runs it; its output to `log` (appended). Exits
    naming the log if the stage exits with a code not in `allow`; returns (exit code,
    seconds)."""
    cmd = [sys.executable, "-m", "pipeline", stage, "--config", str(config)]
    cmd += ["--artifacts", str(artifacts), *(["--cache", str(cache)] if cache else [])]
    cmd += _sets(sets)
    log = log or Path(artifacts) / f"{stage}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if rc not in allow:
        sys.exit(f"{stage} in {artifacts} failed (exit {rc}); see {log}")
    return rc, time.perf_counter() - t0


@contextlib.contextmanager
def server(
    config: str, artifacts: Path, mode: str, sets=(), log: Path | None = None, cache=None,
    timeout_s: float = 900,
) -> Iterator[tuple[str, float]]:  # fmt: skip
    """`python -m pipeline serve` on a free loopback port until /health says 200: yields
    (base URL, seconds it took to be ready); stopped (SIGTERM, then kill) on the way out."""
    port = free_port()
    extra = [*(["--cache", str(cache)] if cache else []), *_sets(sets)]
    cmd = serve_command(config, artifacts, port, mode, extra)
    log = log or Path(artifacts) / "serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, preexec_fn=PREEXEC
        )
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                sys.exit(f"server exited ({proc.returncode}); see {log}")
            if time.perf_counter() - t0 > timeout_s:
                sys.exit(f"server not ready after {timeout_s:.0f} s; see {log}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        yield url, time.perf_counter() - t0
    finally:
        stop(proc, 60)


def served_model(url: str) -> dict:
    """The first entry of the server's /v1/models."""
    return requests.get(url + "/v1/models", timeout=10).json()["data"][0]


def chat(url: str, model: str, text: str, tokens: int, phoenix: dict | None = None) -> dict:
    """One greedy chat completion; raises on an HTTP error."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
        **({"phoenix": phoenix} if phoenix else {}),
    }
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=900)
    r.raise_for_status()
    return r.json()
