import signal
import time

import pytest
import requests

from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.telemetry import NullTelemetry, describe_dsn, setup_telemetry
from tests.conftest import CI, free_port, run_cli, start_serve
from tests.fake_sentry import FakeSentry
from tests.servers import SilentServer

MODEL = "tiny:layers=2,hidden=64,seed=0"


def chat(url, mode, tokens=24):
    r = requests.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Write a function to add two numbers."}],
            "max_tokens": tokens,
            "phoenix": {"mode": mode},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_requests_send_transactions_spans_logs_and_profiles(tmp_path):
    with FakeSentry() as sentry:
        proc, url = start_serve(tmp_path, {"SENTRY_DSN": sentry.dsn})
        try:
            for mode in ("target", "fixed:4", "bandit"):
                chat(url, mode)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        assert sentry.wait_for(
            lambda: len(sentry.transactions()) >= 3 and sentry.items("profile_chunk")
        )
    assert "publickey123" not in err and "Sentry on: host 127.0.0.1" in err
    txs = {t["transaction"]: t for t in sentry.transactions()}
    assert {"target", "fixed_4", "bandit"} <= set(
        txs
    )  # one per request, named by mode; nothing else
    assert not [name for name in txs if name.startswith("/")]
    for name, arm in (("target", "0"), ("fixed_4", "draft:4")):
        t = txs[name]
        assert (
            t["tags"]["mode"] == name
            and t["tags"]["arm"] == arm
            and t["tags"]["draft_model"] == "cut:1"
        )
        data = t["contexts"]["trace"]["data"]
        for key in (
            "latency_seconds",
            "output_tokens",
            "tokens_per_second",
            "draft_accepted",
            "draft_proposed",
            "acceptance",
        ):
            assert key in data
        assert data["output_tokens"] > 0 and data["tokens_per_second"] > 0
    spans = {s["op"]: s for s in txs["fixed_4"]["spans"]}
    assert {"phoenix.generate", "phoenix.draft", "phoenix.verify"} <= set(spans)
    gen = spans["phoenix.generate"]
    assert (
        spans["phoenix.draft"]["parent_span_id"]
        == gen["span_id"]
        == spans["phoenix.verify"]["parent_span_id"]
    )
    assert txs["fixed_4"]["contexts"]["trace"]["data"]["draft_proposed"] > 0
    assert "phoenix.draft" not in {s["op"] for s in txs["target"]["spans"]}  # arm 0: no draft work
    # Continuous profiling, linked to the transactions by profiler id.
    profiler_ids = {c.get("profiler_id") for c in sentry.items("profile_chunk")}
    assert txs["fixed_4"]["contexts"]["trace"]["data"]["profiler_id"] in profiler_ids
    # Structured logs: one per request, one per bandit decision.
    bodies = [entry["body"] for entry in sentry.logs()]
    assert sum(b.startswith("phoenix request mode=") for b in bodies) == 3
    request_log = next(e for e in sentry.logs() if e["body"].startswith("phoenix request"))
    for key in ("latency_seconds", "tokens_per_second", "draft_accepted", "verify_seconds"):
        assert key in request_log["attributes"], key  # the transaction's fields
    decision = [e for e in sentry.logs() if e["body"].startswith("bandit decision")]
    assert len(decision) == 1 and "explored" in decision[0]["body"]
    assert "sentry.message.parameter.epsilon" in decision[0]["attributes"]


def test_stage_transaction_and_captured_exception(tmp_path, mbpp_path):
    with FakeSentry() as sentry:
        env = {"SENTRY_DSN": sentry.dsn}
        assert (
            run_cli(
                "split", "--config", "configs/ci.yaml", "--artifacts", str(tmp_path), env=env
            ).returncode
            == 0
        )
        r = run_cli(
            "split",
            "--config",
            "configs/ci.yaml",
            "--artifacts",
            str(tmp_path),
            "--set",
            "data.train_size=5000",
            env=env,
        )
        assert r.returncode == 2
        assert sentry.wait_for(
            lambda: len(sentry.items("event")) >= 1 and len(sentry.transactions()) >= 2
        )
    ok = [
        t
        for t in sentry.transactions()
        if t["transaction"] == "stage.split" and t["contexts"]["trace"]["data"].get("train") == 500
    ]
    assert ok and ok[0]["tags"]["stage"] == "split"
    events = sentry.items("event")
    assert any(
        e["tags"].get("stage") == "split" and "exceeds" in str(e["exception"]) for e in events
    )


def test_required_dsn_missing_or_malformed_stops_start_up(tmp_path, cli, monkeypatch):
    monkeypatch.delenv("SENTRY_DSN", raising=False)
    args = ["--artifacts", tmp_path, "--set", "observability.required=true"]
    r = cli("serve", *CI, "--port", str(free_port()), *args)
    assert r.returncode == 2 and "SENTRY_DSN is not set" in r.log
    monkeypatch.setenv("SENTRY_DSN", "not-a-dsn")
    r = cli("split", *args)
    assert r.returncode == 2 and "not a valid Sentry DSN" in r.log


def test_setup_falls_back_to_the_null_twin(monkeypatch):
    cfg = load_config(None)
    # SentryTelemetry subclasses NullTelemetry, so only the exact type means "Sentry is off".
    monkeypatch.delenv("SENTRY_DSN", raising=False)
    off = setup_telemetry(cfg, "t")
    assert type(off) is NullTelemetry and off.enabled is False
    monkeypatch.setenv("SENTRY_DSN", "ftp://nope")
    off = setup_telemetry(cfg, "t")
    assert type(off) is NullTelemetry and off.enabled is False
    with pytest.raises(ConfigError):
        setup_telemetry(load_config(None, ["observability.required=true"]), "t")
    assert describe_dsn("https://abc@o1.ingest.sentry.io/77") == ("o1.ingest.sentry.io:443", "77")


@pytest.mark.slow
def test_a_sentry_that_never_answers_does_not_slow_serving(tmp_path):
    """An ingest that accepts connections and never answers (worse than one that refuses)."""
    with SilentServer() as silent:
        dsn = f"http://publickey123@127.0.0.1:{silent.port}/42"
        proc, url = start_serve(tmp_path, {"SENTRY_DSN": dsn}, mode="fixed:2")
        try:
            chat(url, "fixed:2")  # the first request also pays for warm-up
            t0 = time.monotonic()
            for _ in range(3):
                body = chat(url, "fixed:2")
                assert body["choices"][0]["message"]["content"] is not None
            assert time.monotonic() - t0 < 10  # no request waits on Sentry (tiny model: ~0.1 s)
            assert silent.accepted > 0  # the SDK did try to send
        finally:
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 10  # the flush on exit is bounded too (2 s)
