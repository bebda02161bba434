import copy
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from pipeline.server import create_app
from tests.conftest import wait_http
from tests.servers import ServerThread, tiny_core

CHAT = "/v1/chat/completions"


def chat_body(text="Write a function to add two numbers.", **kw):
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 24,
        **kw,
    }


@pytest.fixture
def server(tiny_models, tmp_path):
    app = create_app(lambda: tiny_core(tiny_models, tmp_path / "bandit.json"), queue_size=4)
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        yield s


@pytest.fixture(scope="module")
def shared_server(tiny_models):
    """One server for the tests that only check answers (the bad-input cases): each would
    otherwise start and stop its own."""
    with ServerThread(create_app(lambda: tiny_core(tiny_models), queue_size=4)) as s:
        wait_http(s.url + "/health")
        yield s


def post(server, path, body, **kw):
    return requests.post(server.url + path, json=body, timeout=60, **kw)


def test_health_503_while_loading_then_200(tiny_models):
    gate = threading.Event()

    def slow_load():
        gate.wait(30)
        return tiny_core(tiny_models)

    with ServerThread(create_app(slow_load)) as s:
        r = requests.get(s.url + "/health", timeout=5)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = requests.post(s.url + CHAT, json=chat_body(), timeout=5)
        assert r.status_code == 503 and "error" in r.json()
        gate.set()
        wait_http(s.url + "/health", timeout=30)
        assert requests.get(s.url + "/v1/models", timeout=5).json()["data"][0]["id"] == "tiny"


def test_every_mode_is_lossless_over_http(server):
    outputs = {}
    for mode in ["target", "fixed:0", "fixed:2", "fixed:4", "fixed:8", "ngram:4", "bandit"]:
        r = post(server, CHAT, chat_body(phoenix={"mode": mode}))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        choice = body["choices"][0]
        assert (
            choice["finish_reason"] in ("stop", "length")
            and choice["message"]["role"] == "assistant"
        )
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        details = usage["completion_tokens_details"]
        ph = body["phoenix"]
        assert details["accepted_prediction_tokens"] == ph["accepted"]
        assert details["rejected_prediction_tokens"] == ph["proposed"] - ph["accepted"]
        assert ph["mode"] == ("target" if mode == "fixed:0" else mode)
        assert ph["tokens_per_second"] > 0
        assert ph["rows"] == 1 and 0 <= ph["guess_rounds"] <= ph["rounds"]  # alone; a fixed arm
        if mode in ("fixed:2", "fixed:4", "fixed:8"):
            # A fixed arm guesses every step but a last one with a single token left to go.
            assert ph["rounds"] - 1 <= ph["guess_rounds"] <= ph["rounds"]
            assert ph["arm"] == f"draft:{mode[6:]}"
        if mode == "ngram:4":
            assert ph["arm"] == "ngram:4" and ph["proposed"] <= 4 * ph["rounds"]
        outputs[mode] = choice["message"]["content"]
    assert len(set(outputs.values())) == 1, outputs


def is_plain(s: str) -> bool:
    return s.isascii() and s.isprintable()


def test_completions_endpoint_and_stop(server):
    body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 20}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion"
    text = out["choices"][0]["text"]
    assert out["choices"][0]["finish_reason"] == "length"
    # The tiny model writes random bytes. Stop on two printable ASCII characters past the
    # start (a stop string of U+FFFD could match a multi-byte character still being decoded).
    starts = [i for i in range(1, len(text) - 1) if is_plain(text[i : i + 2])]
    assert starts, repr(text)  # a prompt whose output offers such a stop string
    stop = text[starts[0] : starts[0] + 2]
    r2 = post(server, "/v1/completions", {**body, "stop": [stop]})
    assert r2.status_code == 200, r2.text
    c = r2.json()["choices"][0]
    # Generation ends at the stop string's first occurrence, which is cut off with what follows.
    assert c["finish_reason"] == "stop" and c["text"] == text[: text.index(stop)], (text, c)


def test_streaming_matches_non_streaming(server):
    plain = post(server, CHAT, chat_body(phoenix={"mode": "fixed:4"})).json()["choices"][0][
        "message"
    ]["content"]
    r = requests.post(
        server.url + CHAT,
        json=chat_body(
            stream=True, stream_options={"include_usage": True}, phoenix={"mode": "fixed:4"}
        ),
        stream=True,
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    assert (
        chunks[-1]["usage"]["completion_tokens"] > 0 and chunks[-1]["phoenix"]["arm"] == "draft:4"
    )


@pytest.mark.parametrize(
    "raw,status,param",
    [
        (b"{not json", 400, None),
        (b"[1,2]", 400, None),
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
        ({"model": "tiny", "messages": "hello"}, 400, "messages"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
        (
            {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages.0.role",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "  "}]}, 400, "messages"),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
            400,
            "max_tokens",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"},
            400,
            "max_tokens",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9},
            400,
            "max_tokens",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}, 400, "messages"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1},
            400,
            "temperature",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "phoenix": {"mode": "fixed:3"},
            },
            400,
            "phoenix.mode",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "phoenix": {"mode": "warp"},
            },
            400,
            "phoenix.mode",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "phoenix": {"speed": 1},
            },
            400,
            "phoenix.speed",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": [""]},
            400,
            "stop",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "n"),
    ],
)
def test_bad_input_gets_openai_error_and_server_keeps_serving(shared_server, raw, status, param):
    server = shared_server
    if isinstance(raw, bytes):
        r = requests.post(
            server.url + CHAT, data=raw, headers={"Content-Type": "application/json"}, timeout=10
        )
    else:
        r = post(server, CHAT, raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param
    assert post(server, CHAT, chat_body(max_tokens=4)).status_code == 200


def test_unknown_path_and_method(shared_server):
    server = shared_server
    assert requests.get(server.url + "/v1/nothing", timeout=5).status_code == 404
    assert requests.get(server.url + CHAT, timeout=5).status_code == 405


def test_api_key(tiny_models, monkeypatch):
    monkeypatch.setenv("PHX_TEST_KEY", "s3cret")
    app = create_app(lambda: tiny_core(tiny_models), api_key_env="PHX_TEST_KEY")
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        r = requests.post(s.url + CHAT, json=chat_body(), timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "s3cret" not in r.text
        r = requests.post(
            s.url + CHAT,
            json=chat_body(max_tokens=4),
            headers={"Authorization": "Bearer s3cret"},
            timeout=30,
        )
        assert r.status_code == 200


def test_concurrent_burst_gets_200s_and_429s_never_500(tiny_models):
    app = create_app(lambda: tiny_core(tiny_models), queue_size=2)
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        with ThreadPoolExecutor(12) as pool:
            rs = list(
                pool.map(
                    lambda i: requests.post(
                        s.url + CHAT,
                        json=chat_body(max_tokens=48, phoenix={"mode": "target"}),
                        timeout=120,
                    ),
                    range(12),
                )
            )
        codes = [r.status_code for r in rs]
        assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
        assert all(
            r.json()["error"]["type"] == "rate_limit_error" for r in rs if r.status_code == 429
        )
        texts = {r.json()["choices"][0]["message"]["content"] for r in rs if r.status_code == 200}
        assert len(texts) == 1  # same prompt, greedy: same answer, whoever went first
        # The queue drains: the server serves again afterwards.
        assert (
            requests.post(s.url + CHAT, json=chat_body(max_tokens=4), timeout=60).status_code == 200
        )


def test_client_disconnect_frees_the_slot(tiny_models):
    app = create_app(lambda: tiny_core(tiny_models), queue_size=1)
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        r = requests.post(
            s.url + CHAT,
            json=chat_body(max_tokens=800, stream=True, phoenix={"mode": "target"}),
            stream=True,
            timeout=60,
        )
        next(r.iter_lines())
        r.close()  # walk away mid-stream
        deadline = time.monotonic() + 30
        while True:
            r2 = requests.post(s.url + CHAT, json=chat_body(max_tokens=4), timeout=60)
            if r2.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r2.status_code == 200


def test_restart_keeps_bandit_state(tmp_path):
    """The app `serve` runs (`build_app`: state under <artifacts>/state), started three times on
    one workspace."""
    from pipeline.config import load_config
    from pipeline.server import build_app
    from pipeline.workspace import Workspace

    cfg, ws = load_config("configs/ci.yaml"), Workspace(tmp_path / "art")
    state = ws.state / "bandit.json"

    def serve_and_post(n: int) -> list[dict]:
        with ServerThread(build_app(cfg, ws)) as s:
            wait_http(s.url + "/health")
            model = requests.get(s.url + "/v1/models", timeout=5).json()["data"][0]["id"]
            out = []
            for _ in range(n):
                r = post(s, CHAT, {**chat_body(max_tokens=8), "model": model})
                assert r.status_code == 200, r.text
                out.append(r.json())
            return out

    serve_and_post(3)
    saved = json.loads(state.read_text())
    assert sum(saved["counts"].values()) == 3
    (body,) = serve_and_post(1)
    # The 4th decision continues the warm-up order (0, draft:2, draft:4, ngram:2, ...): state
    # was reloaded.
    assert body["phoenix"]["arm"] == "ngram:2"
    assert sum(json.loads(state.read_text())["counts"].values()) == 4
    state.write_text("garbage")
    serve_and_post(0)
    assert list(state.parent.glob("bandit.json.corrupt-*"))


def test_target_requests_are_batched_with_identical_output(tiny_models):
    app = create_app(lambda: tiny_core(tiny_models, mode="target", max_batch=4), queue_size=8)
    texts = [f"Write a function number {i}." for i in range(8)]
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        one_by_one = [
            post(s, CHAT, chat_body(t, max_tokens=20)).json()["choices"][0]["message"]["content"]
            for t in texts
        ]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda t: post(s, CHAT, chat_body(t, max_tokens=20)), texts))
        assert all(r.status_code == 200 for r in together)
        assert [r.json()["choices"][0]["message"]["content"] for r in together] == one_by_one
    assert app.state.phoenix.core.scheduler.batch.max_rows_seen > 1  # they shared steps


def test_stop_strings_are_held_back_until_final(tiny_models):
    """A suffix that may grow into a stop string is not emitted until it is settled."""
    from pipeline.serving.text import TextTracker

    tok = tiny_models[0]
    ids = list(tok("abc STOP def", add_special_tokens=False)["input_ids"])
    t = TextTracker(tok, ["STOP"])
    emitted = "".join(t.update(ids[:n]) for n in range(1, len(ids) + 1)) + t.rest()
    assert t.stopped and emitted == t.text == "abc "
    t = TextTracker(tok, ["STOP"])
    assert t.update(list(tok("abc ST", add_special_tokens=False)["input_ids"])) == "abc "
    assert not t.stopped and t.rest() == "ST"  # ended without the stop: the tail comes out


def test_a_bad_row_is_refused_alone(tiny_models):
    """A request that cannot join is refused before it joins; the loop serves the next one."""
    from pipeline.serving.request import Refused, Request, fixed

    core = tiny_core(tiny_models)
    ids = core.text_prompt_ids("def add(a, b):")
    for prompt, n, why in (
        ([], 4, "empty prompt"),
        (ids, 0, "max_tokens"),
        (ids * 999, 4, "fills"),
    ):
        req = Request(prompt, n, fixed("0"))
        core.submit(req)
        with pytest.raises(Refused, match=why):
            req.result(timeout=30)
    assert core.generate(Request(ids, 3, fixed("draft:2")), timeout=30).result.output_tokens == 3
    core.close()


def test_metrics_count_what_the_requests_did(tiny_models, tmp_path):
    """Scrape /metrics after requests whose counts the responses report."""
    from prometheus_client.parser import text_string_to_metric_families

    app = create_app(lambda: tiny_core(tiny_models, tmp_path / "bandit.json"), queue_size=4)
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        phs = [
            post(s, CHAT, chat_body(max_tokens=20, phoenix={"mode": m})).json()["phoenix"]
            for m in ("fixed:4", "fixed:2", "bandit", "target")
        ]
        admission = app.state.phoenix.admission
        admission.size = 0  # full: the next request is refused
        assert post(s, CHAT, chat_body()).status_code == 429
        admission.size = 4
        text = requests.get(s.url + "/metrics", timeout=5).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for x in family.samples:
            samples[(x.name, tuple(sorted(x.labels.items())))] = x.value

    def value(name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("phoenix:spec_decode_num_draft_tokens_total") == sum(p["proposed"] for p in phs)
    assert value("phoenix:spec_decode_num_accepted_tokens_total") == sum(p["accepted"] for p in phs)
    assert value("phoenix:spec_decode_num_drafts_total") == sum(
        p["proposed_per_position"][0] for p in phs if p["proposed"]
    )
    for pos in range(4):
        assert value(
            "phoenix:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)
        ) == sum(
            p["accepted_per_position"][pos] for p in phs if len(p["accepted_per_position"]) > pos
        )
    assert value("phoenix:bandit_arm_choices_total", arm=str(phs[2]["arm"])) == 1
    assert value("phoenix:request_rejected_total", reason="queue_full") == 1
    assert value("phoenix:e2e_request_latency_seconds_count") == 4
    assert value("phoenix:time_to_first_token_seconds_count") == 4
    assert value("phoenix:num_requests_running") == 0
    assert value("phoenix:generation_tokens_total") > 0


def test_start_up_heap_is_frozen_and_collections_are_timed_on_metrics(tiny_models):
    """Ready means the start-up heap is frozen (a full collection no longer walks the models'
    objects, `serving.heap`); every collection shows on /metrics by generation; shutdown gives
    the heap back to the collector and detaches the timer."""
    import gc

    from prometheus_client.parser import text_string_to_metric_families

    from pipeline.serving import heap

    cores = []
    app = create_app(lambda: cores.append(tiny_core(tiny_models)) or cores[-1])
    callbacks, holders = len(gc.callbacks), heap.holders()
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        assert heap.holders() == holders + 1
        walked = {id(o) for o in gc.get_objects()}  # what a full collection walks now
        assert id(cores[0]) not in walked and id(cores[0].scheduler) not in walked
        assert gc.get_freeze_count() > 10_000  # torch, transformers, the tiny models
        assert len(gc.callbacks) == callbacks + 1
        post(s, CHAT, chat_body(max_tokens=4))
        gc.collect()
        text = requests.get(s.url + "/metrics", timeout=5).text
    counts = {
        x.labels.get("generation"): x.value
        for family in text_string_to_metric_families(text)
        for x in family.samples
        if x.name == "phoenix:gc_pause_seconds_count"
    }
    assert counts.get("2", 0) >= 1, counts
    assert heap.holders() == holders  # let go: the last holder unfreezes
    assert (gc.get_freeze_count() == 0) == (holders == 0)
    assert len(gc.callbacks) == callbacks


def test_pard_modes_run_on_a_parallel_draft_and_are_refused_on_a_plain_one(tiny_models, caplog):
    """A draft naming a mask token serves pard:K with the target's own output; a plain draft's
    server drops the bandit's pard arm (a WARNING naming the draft and the key) and answers a
    pard request with a 400 listing the valid modes; started in a pard mode it refuses to load."""
    from pipeline.errors import ConfigError

    masked = copy.deepcopy(tiny_models[2])
    masked.config.pard_token = 5
    arms = ["0", "draft:2", "pard:2"]
    with ServerThread(create_app(lambda: tiny_core(tiny_models, mode="pard:2", arms=arms,
                                                   draft=masked))) as s:  # fmt: skip
        wait_http(s.url + "/health")
        plain = post(s, CHAT, chat_body(phoenix={"mode": "target"})).json()
        for mode in ("pard:2", "pard_2", None):
            body = chat_body(phoenix={"mode": mode}) if mode else chat_body()
            r = post(s, CHAT, body)
            assert r.status_code == 200, r.text
            assert r.json()["phoenix"]["arm"] == "pard:2"
            assert r.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    with caplog.at_level("WARNING"):
        core = tiny_core(tiny_models, mode="target", arms=arms)
    assert "pard:2 dropped" in caplog.text and "pard_token" in caplog.text
    core.scheduler.stop()
    with ServerThread(create_app(lambda: tiny_core(tiny_models, mode="target", arms=arms))) as s:
        wait_http(s.url + "/health")
        r = post(s, CHAT, chat_body(phoenix={"mode": "pard:2"}))
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "parallel drafting" in msg and "target, bandit, fixed:2" in msg, msg
    with pytest.raises(ConfigError, match="pard_token"):
        tiny_core(tiny_models, mode="pard:2", arms=arms)


def test_ngram_mode_needs_no_draft_and_bad_modes_name_the_valid_arms(tiny_models):
    """A server without a draft model serves ngram:K (and a bandit over 0 and ngram arms); an
    unknown strategy, an unconfigured length or a draft arm there is a 400 naming the arms."""

    def load():
        arms = ["0", "ngram:2", "ngram:4"]
        return tiny_core(tiny_models, mode="ngram:4", arms=arms, with_draft=False)

    with ServerThread(create_app(load)) as s:
        wait_http(s.url + "/health")
        plain = post(s, CHAT, chat_body(phoenix={"mode": "target"})).json()
        for mode in (None, "ngram:2", "ngram_4", "bandit"):
            body = chat_body(phoenix={"mode": mode}) if mode else chat_body()
            r = post(s, CHAT, body)
            assert r.status_code == 200, r.text
            ph = r.json()["phoenix"]
            assert ph["arm"] in ("0", "ngram:2", "ngram:4")
            assert r.json()["choices"][0]["message"] == plain["choices"][0]["message"]
        for mode, why in (
            ("lookahead:4", "unknown mode"),
            ("ngram:3", "not one of the configured arms"),
            ("fixed:2", "needs a draft model"),
        ):
            r = post(s, CHAT, chat_body(phoenix={"mode": mode}))
            assert r.status_code == 400, r.text
            msg = r.json()["error"]["message"]
            assert why in msg and "ngram:2, ngram:4" in msg, msg
