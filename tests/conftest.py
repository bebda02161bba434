"""Shared fixtures: tiny models built from a config (never downloaded), the MBPP file, and
workspaces built once per session (split + distill, trained, merged) that tests copy."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
MBPP = ROOT.parent / "shared" / "data" / "mbpp.jsonl"
TINY_TARGET = "tiny:layers=2,hidden=64,seed=0"
CI = ("--config", "configs/ci.yaml")

# Two pytest-xdist workers (`make test`) share the 2 cores: one thread each.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_pair(model_cache):
    """(target_dir, draft_dir): a tiny random Llama and a 1-layer draft cut from it."""
    from pipeline import specs

    return specs.resolve_pair(TINY_TARGET, "cut:1", model_cache)


@pytest.fixture(scope="session")
def tiny_models(tiny_pair):
    from pipeline import models

    t, d = tiny_pair
    return (
        models.load_tokenizer(t),
        models.load_model(t, "float32", "cpu"),
        models.load_model(d, "float32", "cpu"),
    )


def target_greedy(target, ids: list[int], n: int, eos: int) -> list[int]:
    """The independent oracle for "speculative output equals the target's": transformers' own
    greedy `generate` on the target, cut before its end-of-turn token."""
    out = target.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos)[0, len(ids) :].tolist()  # fmt: skip
    return out[: out.index(eos)] if eos in out else out


@pytest.fixture
def mbpp_path() -> Path:
    if not MBPP.is_file():
        pytest.skip(f"{MBPP} not present")
    return MBPP


@dataclass
class CliResult:
    returncode: int
    log: str  # what the run logged: its stderr when run as a process


def run_main(*args) -> int:
    """`main()` in this process (its exit code); pytest's signal handlers are restored after."""
    from pipeline.__main__ import main

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return main([str(a) for a in args])
    finally:
        for sig, handler in saved.items():  # main() installs its own
            signal.signal(sig, handler)


@pytest.fixture
def cli(caplog):
    """`python -m pipeline ARGS` in this process: the command line's own code path (config,
    lock, stage, exit code), without paying an interpreter and a torch import per call. Real
    `python -m pipeline` processes run in a few tests and in `make test-slow`."""
    caplog.set_level(logging.INFO)

    def run(*args: str) -> CliResult:
        caplog.clear()
        code = run_main(*args)
        return CliResult(code, caplog.text)

    return run


def build_workspace(art: Path, stages: tuple[str, ...], overrides: tuple[str, ...] = ()) -> Path:
    """Run stages of configs/ci.yaml in process (stage functions, no command line)."""
    from pipeline import merge, split, teacher, train
    from pipeline.config import load_config
    from pipeline.workspace import Workspace

    if not MBPP.is_file():
        pytest.skip(f"{MBPP} not present")
    cfg = load_config("configs/ci.yaml", list(overrides))
    ws = Workspace(art)
    steps = {"split": split.run, "distill": teacher.run, "train": train.run, "merge": merge.run}
    for stage in stages:
        steps[stage](cfg, ws)
    return art


def copy_workspace(src: Path, dst: Path) -> Path:
    """A private copy of a session workspace, for a test that changes it."""
    shutil.copytree(src, dst, symlinks=True)
    return dst


def built_once(tmp_path_factory, name: str, build) -> Path:
    """`build(folder)` once per test run, whatever the number of pytest-xdist workers: the
    first worker builds it under a lock in the run's shared temporary folder, and every worker
    gets its own copy (a test may write into its workspace). Without workers: built here."""
    mine = tmp_path_factory.mktemp(name) / "art"
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        build(mine)
        return mine
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / f"shared-{name}"  # this run's, all workers
    with FileLock(str(shared) + ".lock"):
        if not (shared / ".built").is_file():
            shutil.rmtree(shared, ignore_errors=True)
            build(shared)
            (shared / ".built").touch()
    return copy_workspace(shared, mine)


@pytest.fixture(scope="session")
def distilled_ws(tmp_path_factory) -> Path:
    """split + distill on configs/ci.yaml with the local tiny teacher (a real `serve` process),
    once per test run (`built_once`)."""

    def build(art: Path) -> None:
        build_workspace(art, ("split", "distill"), ("distill.limit=100",))

    return built_once(tmp_path_factory, "distilled", build)


@pytest.fixture(scope="session")
def merged_ws(distilled_ws, tmp_path_factory) -> Path:
    """distilled_ws, then train (full, ci.yaml, two epochs) and merge, once per test run."""

    def build(art: Path) -> None:
        copy_workspace(distilled_ws, art)
        build_workspace(art, ("train", "merge"), ("distill.limit=100", "train.epochs=2"))

    return built_once(tmp_path_factory, "merged", build)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 60.0, status: int = 200) -> None:
    import requests

    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            r = requests.get(url, timeout=2)
            last = r.status_code
            if r.status_code == status:
                return
        except requests.RequestException as exc:
            last = exc
        time.sleep(0.02)  # loopback: polling costs nothing, waiting does
    raise TimeoutError(f"{url} not {status} after {timeout}s (last: {last})")


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run `python -m pipeline ...` from the project root, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_serve(
    art,
    env: dict | None = None,
    mode: str | None = "bandit",
    config: str = "configs/ci.yaml",
    timeout: float = 120,
    extra: list[str] | None = None,
):
    """`python -m pipeline serve` on a free port; returns (process, base URL) once healthy.
    `mode=None`: the config's mode, as a plain `serve` would."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline",
            "serve",
            "--config",
            config,
            "--artifacts",
            str(art),
            "--port",
            str(port),
            *(["--mode", mode] if mode else []),
            *(extra or []),
        ],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}: {proc.stderr.read()[-3000:]}"
            )
        try:
            wait_http(url + "/health", timeout=1)
            return proc, url
        except TimeoutError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
