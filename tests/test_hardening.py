"""Field hardening: who may reach the server, state that belongs to its draft, locks that outlive
their pod, a client that stops reading. Each test fails on the code before it."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import pytest
import requests

from pipeline.artifacts import weights_id
from pipeline.config import BanditConfig
from pipeline.errors import LockHeld
from pipeline.server import app as server_app
from pipeline.server import create_app, is_loopback
from pipeline.serving.policy import make_policy
from pipeline.workspace import workspace_lock
from tests.conftest import CI, wait_http
from tests.servers import ServerThread, tiny_core

CHAT = "/v1/chat/completions"
ADMIN = "/admin/reload-draft"


def chat(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **kw}  # fmt: skip


# -- who may reach the server --------------------------------------------------------------------
def test_loopback_names():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.1.2.3")
    assert not is_loopback("phoenix.internal")


def test_beyond_loopback_without_a_key_the_admin_endpoint_is_403(tiny_models, caplog, monkeypatch):
    monkeypatch.delenv("PHOENIX_API_KEY", raising=False)
    caplog.set_level(logging.WARNING, "pipeline.server")
    app = create_app(lambda: tiny_core(tiny_models), host="0.0.0.0")
    warned = [r.getMessage() for r in caplog.records if "without an API key" in r.getMessage()]
    assert len(warned) == 1 and "0.0.0.0" in warned[0] and "PHOENIX_API_KEY" in warned[0]
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        r = requests.post(s.url + ADMIN, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
        assert "server.api_key_env" in r.text and "allow_unauthenticated_admin" in r.text
        assert requests.post(s.url + CHAT, json=chat(), timeout=30).status_code == 200
        assert requests.get(s.url + "/v1/models", timeout=10).status_code == 200
        assert requests.get(s.url + "/metrics", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "host, allow, key",
    [
        ("0.0.0.0", True, None),
        ("127.0.0.1", False, None),
        ("0.0.0.0", False, "sekret"),
    ],  # fmt: skip
)
def test_the_admin_endpoint_opens_with_a_key_loopback_or_the_opt_in(
    tiny_models, monkeypatch, host, allow, key
):
    if key:
        monkeypatch.setenv("PHOENIX_API_KEY", key)
    else:
        monkeypatch.delenv("PHOENIX_API_KEY", raising=False)
    app = create_app(lambda: tiny_core(tiny_models), host=host, allow_unauthenticated_admin=allow)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        r = requests.post(s.url + ADMIN, headers=headers, timeout=10)
        assert r.status_code == 400 and "nothing to reload" in r.text  # reached: no draft to swap


def test_the_bearer_token_is_compared_in_constant_time(tiny_models, monkeypatch):
    monkeypatch.setenv("PHOENIX_API_KEY", "sekret")
    seen = []
    real = server_app.hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(server_app.hmac, "compare_digest", spy)
    with ServerThread(create_app(lambda: tiny_core(tiny_models))) as s:
        wait_http(s.url + "/health")
        bad = requests.get(s.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        good = requests.get(s.url + "/v1/models", headers={"Authorization": "Bearer sekret"})
    assert bad.status_code == 401 and good.status_code == 200
    assert (b"Bearer nope", b"Bearer sekret") in seen and (
        b"Bearer sekret",
        b"Bearer sekret",
    ) in seen


# -- state that belongs to its draft ------------------------------------------------------------
def test_bandit_state_of_another_draft_forgets_the_draft_arms_only(tmp_path, caplog):
    state = tmp_path / "bandit.json"
    arms = ["0", "draft:4", "ngram:4"]
    p = make_policy(BanditConfig(), arms, state, draft_weights="a" * 64)
    for arm, reward in (("0", 10.0), ("draft:4", 30.0), ("ngram:4", 20.0)):
        p.bandit.update(arm, reward)
    p._dirty = True
    p.save()
    assert json.loads(state.read_text())["draft_weights"] == "a" * 64
    same = make_policy(BanditConfig(), arms, state, draft_weights="a" * 64)
    assert same.bandit.counts["draft:4"] == 1
    caplog.set_level(logging.WARNING)
    other = make_policy(BanditConfig(), arms, state, draft_weights="b" * 64)
    assert other.bandit.counts["draft:4"] == 0 and other.bandit.means["draft:4"] == 0
    assert other.bandit.counts["ngram:4"] == 1 and other.bandit.means["ngram:4"] == 20.0
    assert other.bandit.counts["0"] == 1
    assert any("start over" in r.getMessage() and "aaaaaaaaaaaa" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    other.save()  # and the file now belongs to the new draft
    assert json.loads(state.read_text())["draft_weights"] == "b" * 64


def test_weights_id_covers_every_shard(tmp_path):
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                             "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    ids = []
    for name, second in (("x", b"shard two"), ("y", b"shard TWO")):
        d = tmp_path / name
        d.mkdir()
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        (d / "model-00001-of-00002.safetensors").write_bytes(b"shard one")
        (d / "model-00002-of-00002.safetensors").write_bytes(second)
        ids.append(weights_id(d))
    assert ids[0] != ids[1] and all(ids)


def test_a_run_resumed_with_other_data_is_refused(tmp_path, cli):
    root = tmp_path / "rt"
    run = root / "runs" / "20261203T000000000000Z"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": run.name, "status": "running",
                                              "data": "mbpp", "stages": {"split": "done"}}))  # fmt: skip
    r = cli("retrain", *CI, "--artifacts", root, "--set", "retrain.data=traffic")
    assert r.returncode == 2, r.log[-2000:]
    assert run.name in r.log and "retrain.data=mbpp" in r.log and "retrain.data=traffic" in r.log
    assert json.loads((run / "run.json").read_text())["stages"] == {"split": "done"}


# -- locks that outlive their pod ---------------------------------------------------------------
def _foreign(lock, age_s: float) -> None:
    lock.write_text(json.dumps({"pid": 1, "host": "evicted-pod-7", "job": "retrain",
                                "run_id": "r9", "heartbeat": time.time() - age_s}))  # fmt: skip


def test_a_stale_lock_from_another_host_is_taken_over(tmp_path, caplog):
    lock = tmp_path / "phoenix.lock"
    _foreign(lock, age_s=3600)
    caplog.set_level(logging.WARNING)
    with workspace_lock(lock, "train", stale_after_s=600):
        assert json.loads(lock.read_text())["host"] == socket.gethostname()
    msg = next(r.getMessage() for r in caplog.records if "taking over" in r.getMessage())
    assert "evicted-pod-7" in msg and "r9" in msg
    assert not lock.exists()


def test_a_live_lock_from_another_host_is_respected(tmp_path, cli):
    lock = tmp_path / "phoenix.lock"
    _foreign(lock, age_s=5)
    with pytest.raises(LockHeld, match="evicted-pod-7"):
        with workspace_lock(lock, "train", stale_after_s=600):
            pass
    r = cli("split", *CI, "--artifacts", tmp_path)
    assert r.returncode == 6 and "evicted-pod-7" in r.log


def test_the_holder_refreshes_its_heartbeat(tmp_path):
    lock = tmp_path / "phoenix.lock"
    with workspace_lock(lock, "train", heartbeat_s=0.05, stale_after_s=1.0):
        first = json.loads(lock.read_text())["heartbeat"]
        deadline = time.monotonic() + 5
        while json.loads(lock.read_text())["heartbeat"] == first and time.monotonic() < deadline:
            time.sleep(0.02)
        assert json.loads(lock.read_text())["heartbeat"] > first
    assert not lock.exists()


# -- a client that stops reading -----------------------------------------------------------------
def test_a_client_that_never_reads_holds_up_no_one(tiny_models):
    """A streamed answer far larger than the socket buffers (1,000 tokens, ~170 KB of events,
    to a client with a 1 KB receive buffer that reads nothing until the end): other requests
    are served meanwhile, the silent request's generation ends and its slot comes back while
    the client still reads nothing, and the client then gets the whole stream."""
    app = create_app(lambda: tiny_core(tiny_models, mode="target"), queue_size=2)
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        st = app.state.phoenix
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        sock.connect(("127.0.0.1", s.port))
        body = json.dumps(chat(max_tokens=1000, stream=True))  # greedy "hi": no end of turn
        sock.sendall((f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}").encode())  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while st.admission.count == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert st.admission.count == 1  # admitted, generating
            served = 0
            deadline = time.monotonic() + 120
            while st.admission.count and time.monotonic() < deadline:
                r = requests.post(s.url + CHAT, json=chat(max_tokens=8), timeout=30)
                assert r.status_code == 200  # the other slot keeps serving
                served += 1
            assert st.admission.count == 0 and served >= 2  # it ended; nothing was read
            received = b""
            sock.settimeout(30)
            while chunk := sock.recv(65536):
                received += chunk
        finally:
            sock.close()
    assert b"data: [DONE]" in received[-64:]  # the whole stream (chunked transfer encoding)
    wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[1])  # a send buffer
    assert len(received) > 4 * (rcvbuf + wmem) and received.count(b"data: {") > 300
