"""Careless clients and stuck workers must not take the server down (issue 13).

Real servers on 127.0.0.1, real sockets that hang up before the first byte, mid-stream, or stop
reading; real tiny models (slowed or stopped with a forward hook where a test needs time).
"""

import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from pipeline.server import create_app
from tests.conftest import ROOT, free_port, start_serve, wait_http
from tests.servers import (
    ServerThread,
    Valve,
    hang_up_before_first_byte,
    hang_up_mid_stream,
    stop_reading,
    tiny_core,
)

CHAT = "/v1/chat/completions"
MODES = ["target", "fixed:0", "fixed:2", "fixed:4", "bandit"]


def body(model="tiny", mode=None, stream=False, max_tokens=24, text="Write a function."):
    b = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if mode:
        b["phoenix"] = {"mode": mode}
    return b


def settle(url: str, timeout: float = 20.0) -> dict:
    """/health once nothing is admitted or generating any more (what a leak would never reach)."""
    deadline = time.monotonic() + timeout
    while True:
        h = requests.get(url + "/health", timeout=5).json()
        if h.get("admitted") == 0 and h.get("generating") == 0:
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"slots or workers leaked: {h}")
        time.sleep(0.1)


def every_mode_serves(url: str, model: str = "tiny") -> None:
    for mode in MODES:
        r = requests.post(url + CHAT, json=body(model, mode, max_tokens=8), timeout=30)
        assert r.status_code == 200, (mode, r.text)


def last_event(r: requests.Response) -> bytes:
    return [line for line in r.iter_lines() if line][-1]


def sigterm_exits_within(proc: subprocess.Popen, deadline_s: float) -> float:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"SIGTERM did not stop the server within {deadline_s} s") from None
    return time.monotonic() - t0


@contextlib.contextmanager
def ci_server(art, mode: str, real_process: bool):
    """What `python -m pipeline serve --config configs/ci.yaml --mode MODE` serves: as that very
    process (and then SIGTERM must stop it), or its app (`build_app`) in this process."""
    if real_process:
        proc, url = start_serve(art, mode=mode)
        try:
            yield url
        finally:
            sigterm_exits_within(proc, 15)
        return
    from pipeline.config import load_config
    from pipeline.server import build_app
    from pipeline.workspace import Workspace

    with ServerThread(build_app(load_config("configs/ci.yaml"), Workspace(art), mode)) as s:
        wait_http(s.url + "/health", timeout=60)
        yield s.url


@pytest.mark.parametrize(
    "real_process", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["app", "process"]
)
def test_two_hang_ups_before_the_first_byte_do_not_wedge_the_server(tmp_path, real_process):
    """The reported wedge: `serve --config configs/ci.yaml --mode fixed:2`, two streaming chat
    requests whose clients close right after sending. Every later request hung, and SIGTERM no
    longer stopped the process."""
    with ci_server(tmp_path / "art", "fixed:2", real_process) as url:
        model = requests.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        for _ in range(2):
            hang_up_before_first_byte(url, CHAT, body(model, stream=True, max_tokens=900))
        time.sleep(0.5)
        every_mode_serves(url, model)
        r = requests.post(url + CHAT, json=body(model, stream=True), stream=True, timeout=30)
        assert r.status_code == 200 and last_event(r) == b"data: [DONE]"
        assert settle(url)["status"] == "ok"


@pytest.fixture
def slow_server(tiny_models):
    """A server whose target takes 10 ms a forward pass: long answers take seconds."""
    valve = Valve(tiny_models[1], delay_s=0.01)
    app = create_app(lambda: tiny_core(tiny_models, mode="fixed:2"), queue_size=4)
    try:
        with ServerThread(app) as s:
            wait_http(s.url + "/health")
            yield s, valve, app.state.phoenix
    finally:
        valve.remove()


@pytest.mark.parametrize("leave", [hang_up_before_first_byte, hang_up_mid_stream])
def test_generation_for_a_client_that_left_stops_at_the_next_round(slow_server, leave):
    s, valve, _ = slow_server
    before = valve.calls
    t0 = time.monotonic()
    leave(s.url, CHAT, body(stream=True, max_tokens=900, mode="fixed:0"))

    def aborted() -> bool:  # counted when it left before joining the batch (nothing ran)
        return 'finished_reason="abort"} 1.0' in requests.get(s.url + "/metrics", timeout=5).text

    while valve.calls == before and not aborted() and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert valve.calls > before or aborted()  # the server had it: it started, or was dropped
    settle(s.url)
    # 900 tokens would take 900 passes (9 s or more); the job ended within a few rounds.
    assert valve.calls - before < 150 and time.monotonic() - t0 < 5


def test_a_client_that_stops_reading_holds_no_slot(slow_server):
    s, _, st = slow_server
    held = threading.Thread(
        target=stop_reading, args=(s.url, CHAT, body(stream=True, max_tokens=60), 1.0)
    )
    held.start()
    try:
        time.sleep(0.3)
        assert st.admission.count == 1
        settle(s.url, timeout=10)  # generation ran to max_tokens into an unread queue
        every_mode_serves(s.url)
    finally:
        held.join()


def test_health_turns_503_while_generation_is_stuck(tiny_models):
    valve = Valve(tiny_models[1])
    app = create_app(lambda: tiny_core(tiny_models, mode="fixed:2"), stuck_after_s=0.5)
    try:
        with ServerThread(app) as s:
            wait_http(s.url + "/health")
            valve.close()
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(requests.post, s.url + CHAT, json=body(), timeout=60)
                wait_http(s.url + "/health", timeout=10, status=503)
                h = requests.get(s.url + "/health", timeout=5).json()
                assert h["status"] == "stuck" and "no progress" in h["detail"], h
                valve.open()
                assert pending.result().status_code == 200
            assert settle(s.url)["status"] == "ok"
    finally:
        valve.remove()


def test_sigterm_with_a_stuck_request_exits_within_the_deadline(model_cache):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.stuck_server", str(model_cache), str(port), "1"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(url + "/health", timeout=60)

        def stuck_client():
            with contextlib.suppress(requests.RequestException):  # cut off by the shutdown
                _ = requests.post(url + CHAT, json=body(stream=True), timeout=30).content

        threading.Thread(target=stuck_client, daemon=True).start()
        wait_http(url + "/health", timeout=10, status=503)  # stuck in its forward pass
    finally:
        took = sigterm_exits_within(proc, 10)
    assert took < 1 + 3, took  # the deadline, plus start-up of shutdown and process exit


def _careless_client(url: str, until: float, seed: int, counts: dict, lock) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        mode = rng.choice(MODES)
        stream = rng.random() < 0.6
        b = body(mode=mode, stream=stream, max_tokens=rng.choice([8, 32, 100]))
        how = rng.choice(["plain", "before_first_byte", "mid_stream", "stop_reading"])
        if how == "before_first_byte":
            hang_up_before_first_byte(url, CHAT, b)
        elif how == "mid_stream" and stream:
            hang_up_mid_stream(url, CHAT, b)
        elif how == "stop_reading":
            stop_reading(url, CHAT, b, hold_s=rng.uniform(0.1, 1.0))
        else:
            r = requests.post(url + CHAT, json=b, timeout=60)
            assert r.status_code in (200, 429), r.text
            how = f"plain {r.status_code}"
        with lock:
            counts[how] = counts.get(how, 0) + 1


@pytest.mark.parametrize(
    "seconds", [2, pytest.param(90, marks=pytest.mark.slow, id="90s")], ids=lambda x: f"{x}s"
)
def test_soak_careless_clients_in_every_mode(tiny_models, seconds):
    """Several clients mixing every mode, streaming and not, hanging up before the first byte,
    mid-stream, or not reading. Afterwards every request succeeds, no slot is leaked, no
    row is left in the batch."""
    app = create_app(lambda: tiny_core(tiny_models, max_batch=4), queue_size=4)
    st = app.state.phoenix
    counts: dict = {}
    lock = threading.Lock()
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        until = time.monotonic() + seconds
        with ThreadPoolExecutor(6) as pool:
            for f in [
                pool.submit(_careless_client, s.url, until, seed, counts, lock) for seed in range(6)
            ]:
                f.result()
        settle(s.url)
        every_mode_serves(s.url)
        r = requests.post(s.url + CHAT, json=body(stream=True), stream=True, timeout=30)
        assert last_event(r) == b"data: [DONE]"
        assert st.admission.count == 0 and not st.inflight
        assert st.core.scheduler.running == 0 and st.core.scheduler.waiting == 0  # no row left
    assert counts.get("before_first_byte") and counts.get("plain 200"), counts


@pytest.mark.slow
def test_health_reports_no_leak_after_mixed_hang_ups_in_a_real_process(tmp_path):
    """The issue's second run, short: a real `serve` with queue_size=4 and clients that hang up;
    it ended answering only 429s. Now it drains, and SIGTERM stops it."""
    proc, url = start_serve(tmp_path / "art", mode="bandit", extra=["--set", "server.queue_size=4"])
    try:
        model = requests.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        for mode, stream in itertools.product(MODES, [True, False]):
            hang_up_before_first_byte(url, CHAT, body(model, mode, stream, max_tokens=300))
            hang_up_mid_stream(url, CHAT, body(model, mode, True, max_tokens=300))
        settle(url)
        every_mode_serves(url, model)
    finally:
        sigterm_exits_within(proc, 15)


def test_a_draft_made_slow_mid_run_falls_back_to_plain_then_recovers(model_cache):
    """The drift guard, end to end in a real server process (tests/drift_server.py) with the
    real Sentry SDK pointed at a local endpoint: fast drafting, then a slow draft until the
    guard falls back (log line, Sentry event, metric), a cool-down of plain requests, then a
    probe with the draft fast again that recovers."""
    import json

    from prometheus_client.parser import text_string_to_metric_families

    from tests.fake_sentry import FakeSentry

    with FakeSentry() as sentry:
        r = subprocess.run(
            [sys.executable, "-m", "tests.drift_server", str(model_cache)],
            cwd=ROOT,
            env={**os.environ, "SENTRY_DSN": sentry.dsn},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert sentry.wait_for(lambda: len(sentry.items("event")) >= 2)
        events = sentry.items("event")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    resp = out["responses"]
    phases = [x["phase"] for x in resp]
    fast = [x for x in resp if x["phase"] == "fast"]
    assert [x["arm"] for x in fast] == ["0"] + ["draft:4"] * 7
    assert not any(x["fallback"] or x["guard_event"] for x in fast)  # drafting paid: no alarm
    assert [x["deferred"] for x in fast] == [False] * 8  # one client: every arm chosen outright
    slow = [x for x in resp if x["phase"] == "slow"]
    assert slow[-1]["guard_event"] == "fallback" and len(slow) <= 4, resp
    assert all(x["arm"] == "draft:4" for x in slow), resp  # the bandit alone kept exploiting it
    cool = [x for x in resp if x["phase"] == "cooldown"]
    assert len(cool) == 3 and all(x["arm"] == "0" and x["fallback"] for x in cool)
    probe = [x for x in resp if x["phase"] == "probe"]
    assert [x["arm"] for x in probe] == ["draft:4"] * 3 and not any(x["fallback"] for x in probe)
    assert probe[1]["guard_event"] == "recovered", phases
    assert "speculation fallback" in r.stderr and "speculation recovered" in r.stderr
    messages = [e.get("message") or e.get("logentry", {}).get("message", "") for e in events]
    assert any("speculation fallback" in m for m in messages), messages
    assert any("speculation recovered" in m for m in messages), messages
    fb = next(e for e in events if "fallback" in (e.get("message") or ""))
    assert fb["level"] == "warning" and fb["tags"]["speculation"] == "fallback"
    assert "publickey" not in r.stderr
    samples = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for fam in text_string_to_metric_families(out["metrics"])
        for x in fam.samples
    }
    assert samples[("phoenix:speculation_guard_events_total", (("event", "fallback"),))] == 1
    assert samples[("phoenix:speculation_guard_events_total", (("event", "recovered"),))] == 1
    assert samples[("phoenix:speculation_fallback_active", ())] == 0


def test_a_huge_body_is_refused_at_once_and_a_plain_request_is_not_held_up(tiny_models):
    """The reported stall: a 64 MB body got no answer for 120 s and a plain request after it
    waited 23 s. Now a body over server.max_body_kb is a 413 before it is read (declared
    length, or counted as it streams in), a prompt too long to fit the context in any
    tokenisation is a 400 before it is tokenised, and a plain request meanwhile is served."""
    import socket

    app = create_app(lambda: tiny_core(tiny_models), queue_size=4, max_body_kb=64)
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        host, port = "127.0.0.1", s.port
        # Declared 64 MB: refused from the headers, nothing of the body sent.
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(
                f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {64 << 20}\r\n\r\n".encode()
            )
            t0 = time.monotonic()
            reply = b""
            while b"}}" not in reply:  # the headers, then the JSON error body
                got = sock.recv(4096)
                if not got:
                    break
                reply += got
            text = reply.decode()
            assert text.startswith("HTTP/1.1 413") and time.monotonic() - t0 < 5, text
            assert "request_too_large" in text and "server.max_body_kb" in text

        # No declared length (chunked): counted as it arrives, refused past the limit.
        def chunks():
            yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
            for _ in range(200):
                yield b"x" * 1024
            yield b'"}]}'

        r = requests.post(s.url + CHAT, data=chunks(), timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        # Under the body limit, over what the context could hold in characters: not tokenised.
        core = app.state.phoenix.core
        text = "y" * (core.max_prompt_chars + 1)
        t0 = time.monotonic()
        r = requests.post(s.url + CHAT, json=body(text=text), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        assert requests.post(s.url + CHAT, json=body(max_tokens=4), timeout=30).status_code == 200
        assert time.monotonic() - t0 < 10


def test_a_failed_step_is_a_500_naming_the_error_and_the_loop_goes_on(tiny_models, monkeypatch):
    from pipeline.speculative import batch

    real = batch.target_logits
    calls = {"n": 0}

    def once_broken(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the first step after the prefill
            raise RuntimeError("injected step failure")
        return real(*a, **k)

    app = create_app(lambda: tiny_core(tiny_models, mode="fixed:2"), queue_size=4)
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        monkeypatch.setattr(batch, "target_logits", once_broken)
        r = requests.post(s.url + CHAT, json=body(max_tokens=8), timeout=30)
        assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
        streamed = requests.post(s.url + CHAT, json=body(max_tokens=8, stream=True), timeout=30)
        assert streamed.status_code == 200 and last_event(streamed) == b"data: [DONE]"
        assert requests.post(s.url + CHAT, json=body(max_tokens=8), timeout=30).status_code == 200
        assert settle(s.url)["status"] == "ok"
