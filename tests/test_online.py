"""Online distillation: traffic capture, retrain on captured traffic, hot swap of the draft."""

from __future__ import annotations

import gc
import json
import shutil
import signal
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from pipeline import artifacts, specs, traffic
from pipeline.config import load_config
from pipeline.server import build_app
from pipeline.workspace import Workspace, read_jsonl
from tests.conftest import CI, copy_workspace, start_serve, wait_http
from tests.servers import ServerThread

MODEL = "tiny:layers=2,hidden=64,seed=0"
CHAT = "/v1/chat/completions"


def rec(i: int, ts: float, prompt=None, finish="stop", by_string=False) -> dict:
    prompt = prompt if prompt is not None else [1, 2, i]
    return {
        "id": f"r{i}",
        "ts": ts,
        "prompt_sha256": traffic.prompt_hash(prompt),
        "prompt_token_ids": prompt,
        "token_ids": [5, 6, i],
        "finish_reason": finish,
        "stopped_by_string": by_string,
    }


# --- capture files ------------------------------------------------------------------------------
def test_capture_rotates_bounded_files_and_reading_skips_bad_lines(tmp_path):
    log = traffic.TrafficLog(tmp_path, max_file_bytes=600, max_files=3)
    for i in range(40):
        assert log.append(rec(i, 1000.0 + i))
    log.close()
    assert not log.append(rec(41, 2000.0))  # after close (shutdown): dropped, nothing reopened
    files = sorted(tmp_path.glob("traffic-*.jsonl"))
    assert len(files) == 3 and all(f.stat().st_size < 600 + 300 for f in files)
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)  # users' prompts: owner only
    records, skipped = traffic.read_traffic(tmp_path)
    assert skipped == 0 and [r["id"] for r in records][-1] == "r39"
    assert len(records) < 40  # the oldest files went
    # A new process starts a new file; torn, foreign and incomplete lines are skipped, counted.
    with open(files[-1], "a") as f:
        f.write('{"id": "torn", "ts": 1.0, "prompt_token_ids": [1,\n')
        f.write("not json at all\n")
        f.write(json.dumps({"id": "x", "ts": 2.0, "prompt_token_ids": [1]}) + "\n")
        f.write(json.dumps({**rec(99, 3000.0), "token_ids": ["a"]}) + "\n")
    log2 = traffic.TrafficLog(tmp_path, max_file_bytes=600, max_files=10)
    assert log2.append(rec(100, 4000.0))
    log2.close()
    assert len(list(tmp_path.glob("traffic-*.jsonl"))) == 4
    again, skipped = traffic.read_traffic(tmp_path)
    assert skipped == 4 and len(again) == len(records) + 1 and again[-1]["id"] == "r100"


def test_a_full_disk_pauses_capture_then_it_resumes(tmp_path, caplog):
    log = traffic.TrafficLog(tmp_path, max_file_bytes=1 << 20, max_files=4, pause_s=0.3)
    (tmp_path / "traffic-000001.jsonl").symlink_to("/dev/full")  # writes fail: ENOSPC
    assert not log.append(rec(1, 1.0))
    assert "traffic capture paused" in caplog.text and "No space left" in caplog.text
    assert not log.append(rec(2, 2.0)) and log.dropped == 2  # paused: not even tried
    time.sleep(0.35)
    assert log.append(rec(3, 3.0))  # a new file after the pause
    log.close()
    (tmp_path / "traffic-000001.jsonl").unlink()
    assert [r["id"] for r in traffic.read_traffic(tmp_path)[0]] == ["r3"]


def test_selection_dedupes_prompts_keeps_complete_answers_and_holds_out_the_newest():
    records = [
        rec(0, 1.0),  # before the watermark
        rec(1, 11.0, prompt=[9, 9]),
        rec(2, 12.0, prompt=[9, 9]),  # the same prompt later: the one kept
        rec(3, 13.0, finish="length"),  # cut at max_tokens: a prefix of the target's answer
        rec(4, 14.0, by_string=True),  # cut by the client's stop string: not trained
        rec(5, 15.0, finish="abort"),
        rec(6, 16.0),
        rec(7, 17.0),
    ]
    train, test = traffic.select(records, since=10.0, test_size=2)
    assert [r["id"] for r in train] == ["r2", "r3"]
    assert [r["id"] for r in test] == ["r6", "r7"]


# --- the server captures ------------------------------------------------------------------------
def test_the_server_captures_what_it_served_and_never_a_key(tmp_path, monkeypatch):
    monkeypatch.setenv("PHX_CAPTURE_KEY", "sekrit-key-123")
    cfg = load_config(
        "configs/ci.yaml",
        ["traffic.capture=true", "server.api_key_env=PHX_CAPTURE_KEY", "server.draft=base"],
    )
    ws = Workspace(tmp_path)
    auth = {"Authorization": "Bearer sekrit-key-123"}
    with ServerThread(build_app(cfg, ws)) as s:
        wait_http(s.url + "/health", timeout=60)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Write a function to add two numbers."}],
            "max_tokens": 12,
            "phoenix": {"mode": "fixed:2", "token_ids": True},
        }
        served = requests.post(s.url + CHAT, json=body, headers=auth, timeout=60).json()
        optout = {**body, "phoenix": {"mode": "target", "capture": False}}
        assert requests.post(s.url + CHAT, json=optout, headers=auth, timeout=60).ok
        text = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 6, "stop": ["\n"]}
        assert requests.post(s.url + "/v1/completions", json=text, headers=auth, timeout=60).ok
        metrics = requests.get(s.url + "/metrics", timeout=10).text
    records, skipped = traffic.read_traffic(tmp_path / "traffic")
    assert skipped == 0 and len(records) == 2  # the opted-out request is not there
    chat, completion = records
    assert chat["token_ids"] == served["phoenix"]["token_ids"]
    assert chat["mode"] == "fixed:2" and chat["arm"] == "draft:2" and chat["kind"] == "chat"
    assert len(chat["accepted_per_position"]) == 2 and chat["draft"] == "cut:1"
    assert chat["prompt_sha256"] == traffic.prompt_hash(chat["prompt_token_ids"])
    assert completion["kind"] == "text"
    raw = "".join(p.read_text() for p in (tmp_path / "traffic").iterdir())
    assert "sekrit" not in raw and "Bearer" not in raw and "127.0.0.1" not in raw
    assert 'phoenix:traffic_records_total{outcome="opted_out"} 1.0' in metrics
    assert 'phoenix:traffic_records_total{outcome="captured"} 2.0' in metrics


# --- hot swap -----------------------------------------------------------------------------------
def fingerprint(url: str, prompts: list[str]) -> list[list[int]]:
    out = []
    for p in prompts:
        r = requests.post(
            url + CHAT,
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": p}],
                "max_tokens": 24,
                "phoenix": {"mode": "fixed:4"},
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        out.append(r.json()["phoenix"]["accepted_per_position"])
    return out


def promote_copy(art: Path, run: str, source: Path) -> Path:
    """A promoted run as retrain leaves it: runs/<run>/merged (verified) and `current`."""
    merged = shutil.copytree(source, art / "runs" / run / "merged")
    (merged / "phoenix.json").write_text(json.dumps({"method": "full"}))
    (art / "runs" / run / "gate.json").write_text(
        json.dumps({"published": {"version": f"v0009-{run}"}})
    )
    artifacts.point_current(art, run)
    return merged


def test_a_promoted_draft_is_swapped_in_under_load_without_failing_a_request(merged_ws, tmp_path):
    """The watcher sees `current` move while 24 clients keep requests in flight: every
    request succeeds, the new draft serves (its acceptance fingerprint, /v1/models, /metrics,
    the Sentry tag); a broken draft then fails to load over POST /admin/reload-draft: 500,
    reported to Sentry, and the old draft keeps serving."""
    from tests.fake_sentry import FakeSentry

    art = copy_workspace(merged_ws, tmp_path / "art")
    ws = Workspace(art)
    base_dir = Path(specs.resolve("cut:1", ws.models_cache, specs.resolve(MODEL, ws.models_cache)))
    prompts = [r["prompt"] for r in read_jsonl(ws.test_file)[:2]]
    with FakeSentry() as sentry:
        proc, url = start_serve(
            art, {"SENTRY_DSN": sentry.dsn}, mode=None, extra=["--set", "server.reload_poll_s=0.2"]
        )
        try:
            before = fingerprint(url, prompts)
            stop, results, peak = threading.Event(), [], []

            def client(i: int) -> None:
                modes = ("bandit", "fixed:4", "target")
                while not stop.is_set():
                    sent = time.monotonic()
                    try:
                        r = requests.post(
                            url + CHAT,
                            json={
                                "model": MODEL,
                                "messages": [
                                    {"role": "user", "content": f"Task {i}: sort a list."}
                                ],
                                "max_tokens": 16,
                                "phoenix": {"mode": modes[i % 3]},
                            },
                            timeout=120,
                        )
                        results.append((r.status_code, sent))
                    except requests.RequestException as exc:  # a failure too, never lost
                        results.append((repr(exc), sent))

            threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                admitted = requests.get(url + "/health", timeout=10).json()["admitted"]
                if admitted >= 20:
                    break
            peak.append(admitted)
            promote_copy(art, "r2", base_dir)  # the watcher notices within 0.2 s
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                info = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["metadata"]
                if info["draft"].get("version") == "v0009-r2":
                    break
                time.sleep(0.1)
            swapped = time.monotonic()  # requests keep coming after the swap: wait for 4 of them

            def after() -> int:
                return sum(1 for _, sent in list(results) if sent > swapped)

            deadline = swapped + 60
            while after() < 4 and time.monotonic() < deadline:
                time.sleep(0.1)
            stop.set()
            for t in threads:
                t.join(timeout=120)
            assert peak[0] >= 20, peak
            assert info["draft"]["version"] == "v0009-r2" and info["draft"]["source"] == "promoted"
            codes = {code for code, _ in results}
            assert after() >= 4 and codes == {200}, (len(results), after(), sorted(map(str, codes)))
            after = fingerprint(url, prompts)
            metrics = requests.get(url + "/metrics", timeout=10).text
            assert 'phoenix:draft_info{source="promoted",version="v0009-r2"} 1.0' in metrics
            assert 'phoenix:draft_reloads_total{outcome="ok"} 1.0' in metrics

            broken = art / "runs" / "r3" / "merged"
            shutil.copytree(base_dir, broken)
            (broken / "phoenix.json").write_text("{}")
            (broken / "model.safetensors").write_bytes(b"not weights")
            artifacts.point_current(art, "r3")  # the watcher fails on it too; ask directly
            r = requests.post(url + "/admin/reload-draft", timeout=120)
            assert r.status_code == 500 and r.json()["error"]["code"] == "draft_reload_failed"
            assert fingerprint(url, prompts) == after  # the old draft serves on
            info = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["metadata"]
            assert info["draft"]["version"] == "v0009-r2"
            assert sentry.wait_for(
                lambda: any(
                    (e.get("tags") or {}).get("draft_reload") == "failed"
                    and e["exception"]["values"][-1]["type"]
                    for e in sentry.items("event")
                )
            )
            tags = {t["tags"].get("draft_version") for t in sentry.transactions()}
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
    assert before != after  # the swap changed which draft guesses
    assert "v0009-r2" in tags and "draft reload failed" in err
    assert "now serving" in err and "v0009-r2" in err


# --- retrain on traffic -------------------------------------------------------------------------
def test_retrain_learns_from_captured_traffic_without_a_teacher(merged_ws, tmp_path, cli):
    """Serve the held-out prompts with capture on, then `retrain` with retrain.data=traffic and
    a teacher URL nobody answers: a run trains on the captured answers, the gate compares the new
    draft with the base on the newest traffic, and a second retrain finds nothing new."""
    art = tmp_path / "art"
    shutil.copytree(Path(merged_ws) / "cache", art / "cache")
    cfg = load_config("configs/ci.yaml", ["traffic.capture=true"])
    ws = Workspace(art)
    prompts = [r["prompt"] for r in read_jsonl(Path(merged_ws) / "data" / "test.jsonl")]
    with ServerThread(build_app(cfg, ws, mode="target")) as s:
        wait_http(s.url + "/health", timeout=60)

        def ask(p: str) -> bool:
            body = {"model": MODEL, "messages": [{"role": "user", "content": p}], "max_tokens": 24}
            return requests.post(s.url + CHAT, json=body, timeout=60).ok

        with ThreadPoolExecutor(8) as pool:  # the server batches them
            assert all(pool.map(ask, prompts[:30]))
    folder = art / "traffic"
    with open(sorted(folder.iterdir())[-1], "a") as f:
        f.write('{"id": "torn", "ts": 9')  # a crash mid-write
    args = (
        *CI,
        "--artifacts",
        str(art),
        "--set",
        "retrain.data=traffic",
        "--set",
        "retrain.traffic_test_size=6",
        "--set",
        "retrain.traffic_min_records=20",
        "--set",
        "teacher.url=http://127.0.0.1:9/v1",  # nobody there: a teacher call would fail
        "--set",
        "retrain.min_gain=-1",
        *("--set", "train.max_steps=6", "--set", "bench.max_new_tokens=8"),  # the gate's inputs
    )
    res = cli(*args, "retrain")
    assert res.returncode == 0, res.log[-3000:]
    assert "24 new trainable record(s) and 6 to hold out" in res.log and "1 bad line" in res.log
    run = artifacts.current_run(art)
    run_dir = art / "runs" / run
    assert len(read_jsonl(run_dir / "teacher" / "answers.jsonl")) == 24
    test_rows = read_jsonl(run_dir / "data" / "test.jsonl")
    assert len(test_rows) == 6 and all("prompt_token_ids" in r for r in test_rows)
    gate = json.loads((run_dir / "gate.json").read_text())
    assert gate["promoted"] and gate["baseline"] == "the base draft on the held-out traffic"
    results = json.loads((run_dir / "bench" / "results.json").read_text())
    assert results["protocol"]["prompts"] == 6 and results["lossless"]

    res = cli(*args, "retrain")  # no traffic since the promoted run
    assert res.returncode == 0 and "nothing to do: 0 new trainable record(s)" in res.log
    assert "0 newer than the last run that ended" in res.log
    assert artifacts.current_run(art) == run


@pytest.mark.parametrize(
    "sets, names",
    [
        (["traffic.capture=maybe"], "traffic.capture"),
        (["retrain.traffic_test_size=-1"], "retrain.traffic_test_size"),
        (
            [
                "retrain.data=traffic",
                "train.objective=kd",
                "train.top_logprobs=4",
                "teacher.url=http://127.0.0.1:9/v1",
            ],
            "captured answers carry no teacher logprobs",
        ),
    ],
)
def test_bad_traffic_settings_exit_2(cli, tmp_path, sets, names):
    over = [x for s in sets for x in ("--set", s)]
    res = cli(*CI, "--artifacts", str(tmp_path), "retrain", *over)
    assert res.returncode == 2 and names in res.log


def test_reload_endpoint_needs_the_key_and_keeps_an_unchanged_draft(tmp_path, monkeypatch):
    monkeypatch.setenv("PHX_RELOAD_KEY", "k3y")
    cfg = load_config("configs/ci.yaml", ["server.api_key_env=PHX_RELOAD_KEY"])
    with ServerThread(build_app(cfg, Workspace(tmp_path))) as s:
        wait_http(s.url + "/health", timeout=60)
        r = requests.post(s.url + "/admin/reload-draft", timeout=30)
        assert r.status_code == 401 and "k3y" not in r.text
        r = requests.post(
            s.url + "/admin/reload-draft", headers={"Authorization": "Bearer k3y"}, timeout=60
        )
        assert r.status_code == 200
        assert r.json() == {"reloaded": False, "reason": "already serving it", "draft": "cut:1"}
    target_only = build_app(cfg, Workspace(tmp_path), mode="target")
    with ServerThread(target_only) as s:
        wait_http(s.url + "/health", timeout=60)
        r = requests.post(
            s.url + "/admin/reload-draft", headers={"Authorization": "Bearer k3y"}, timeout=60
        )
        assert r.status_code == 400 and "without a draft" in r.json()["error"]["message"]


def test_a_reload_loads_the_new_draft_on_a_thread_that_ends(tmp_path, monkeypatch):
    """A reload's loading runs apart (`scheduler.apart`): not on the request handler's thread,
    which would keep an OpenMP pool beside the step loop's (every later step 1.6-1.75x slower on
    2 cores), but on a thread that is gone once the new draft serves. The old draft is freed."""
    from pipeline import drafts
    from pipeline import reload as reloading

    cfg = load_config("configs/ci.yaml")
    other = drafts.resolve_served(load_config("configs/ci.yaml", ["models.draft=cut:2"]),
                                  Workspace(tmp_path))  # fmt: skip
    seen, real = [], reloading.models.load_pair

    def load_pair(*a, **k):
        seen.append(threading.current_thread())
        return real(*a, **k)

    app = build_app(cfg, Workspace(tmp_path))
    with ServerThread(app) as s:
        wait_http(s.url + "/health", timeout=60)
        old = weakref.ref(app.state.phoenix.core.pair.draft)
        monkeypatch.setattr(reloading, "resolve_served", lambda *_: other)
        monkeypatch.setattr(reloading.models, "load_pair", load_pair)
        r = requests.post(s.url + "/admin/reload-draft", timeout=120)
        assert r.status_code == 200 and r.json()["reloaded"] and r.json()["draft"] == "cut:2"
        assert [t.name for t in seen] == ["phoenix-draft-load"] and not seen[0].is_alive()
        # The old draft's objects were frozen with the start-up heap: given back to the
        # collector before the new heap is frozen, they are freed, not kept for good.
        assert old() is None and gc.get_freeze_count() > 0


def wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_swap_lands_between_steps_and_old_rewards_are_dropped(tiny_models):
    """One request generates on the old draft while five wait to join: the swap lands between
    two steps, so the running request finishes on the new draft (exactly: its output is still
    target-only greedy, its reward dropped) and the five join on the new draft; the draft arms
    start over."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.serving.request import Request, fixed
    from pipeline.speculative.loaded import Models
    from tests.servers import Valve, tiny_core

    tok, target, draft = tiny_models
    core = tiny_core(tiny_models, max_batch=1)  # one row: the five wait
    core._labels[0] = "old"
    core.bandit.warmup_issued = 1  # the first request's warm-up arm: draft:2 (arms[1])
    ids = core.text_prompt_ids("def add(a, b):")
    reference = core.generate(Request(ids, 8, fixed("0"))).result.token_ids
    valve = Valve(target)
    try:
        valve.close()  # the first request's step waits until the valve opens
        first = Request(ids, 8, core.mode("bandit"))
        core.submit(first)
        wait_until(lambda: core.generating == 1)
        waiting = [Request(ids, 8, fixed("draft:2")) for _ in range(5)]
        for r in waiting:
            core.submit(r)
        new = models_pair(tok, Models(target, draft, [tok.eos_token_id]))
        with ThreadPoolExecutor(1) as pool:
            swap = pool.submit(core.swap_draft, new, "new", {"spec": "new"})
            time.sleep(0.3)  # the swap waits for the step to end
            valve.open()
            swap.result(timeout=60)
        results = [r.result(timeout=60) for r in [first, *waiting]]
    finally:
        valve.remove()
    assert results[0].draft == "old" and all(r.draft == "new" for r in results[1:])
    assert all(r.result.token_ids == reference for r in results)  # lossless across the swap
    assert results[0].decision.arm == "draft:2" and core.draft_epoch == 1
    assert core.bandit.counts["draft:2"] == 0  # forgotten, and the old reward dropped
    assert set(core.bandit.rewarm) == {"draft:2", "draft:4", "draft:6", "draft:8"}  # not ngram
    core.close()


def models_pair(tok, loaded):
    from pipeline.models import Pair

    return Pair(tok, loaded, "tiny", "new-draft")


def test_a_reward_earned_by_a_swapped_out_draft_is_not_credited(tiny_models):
    """The epoch check alone: the draft changes (epoch bumped) while a bandit request still
    generates on the old one; its reward is dropped."""
    from pipeline.serving.request import Request
    from tests.servers import Valve, tiny_core

    _, target, _ = tiny_models
    core = tiny_core(tiny_models)
    core.bandit.warmup_issued = 1  # the request's warm-up arm: draft:2
    ids = core.text_prompt_ids("def add(a, b):")
    valve = Valve(target)
    try:
        valve.close()
        running = Request(ids, 8, core.mode("bandit"))
        core.submit(running)
        wait_until(lambda: core.generating == 1)
        core.scheduler.batch.epoch += 1  # what a swap does between steps
        valve.open()
        res = running.result(timeout=60)
    finally:
        valve.remove()
    assert res.decision.arm == "draft:2" and core.bandit.counts["draft:2"] == 0
    core.generate(Request(ids, 8, core.mode("bandit")))  # a reward on the current draft counts
    assert sum(core.bandit.counts.values()) == 1
    core.close()
