import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from pipeline.errors import TeacherUnavailable
from pipeline.teacher import load_answers
from pipeline.teacher_client import (
    RetryBudget,
    TeacherClient,
    TeacherRequestError,
    retry_after_seconds,
)
from tests.conftest import CI, ROOT, copy_workspace, run_cli
from tests.fake_openai import FakeOpenAI, canned_answer

MSG = [{"role": "user", "content": "Write f."}]


def test_slow_boot_then_ready():
    with FakeOpenAI(health_503=2, models_empty=1) as fake:
        TeacherClient(fake.url).wait_ready("fake", timeout_s=30)
        assert fake.calls["health"] == 3 and fake.calls["models"] == 2


def test_no_health_route_goes_straight_to_models():
    with FakeOpenAI(no_health=True) as fake:
        TeacherClient(fake.url).wait_ready("fake", timeout_s=10)
        assert fake.calls["models"] == 1


def test_model_never_listed_times_out_naming_what_is_served():
    with FakeOpenAI(model="other-model") as fake:
        with pytest.raises(TeacherUnavailable) as e:
            TeacherClient(fake.url).wait_ready("fake", timeout_s=1.5)
        assert "other-model" in str(e.value) and "not ready" in str(e.value)


def test_nothing_listening_times_out_with_last_status():
    with pytest.raises(TeacherUnavailable, match="ConnectionError"):
        TeacherClient("http://127.0.0.1:9/v1").wait_ready("fake", timeout_s=1)


def test_auth_failure_fails_at_once():
    with FakeOpenAI(auth="right") as fake:
        t0 = time.monotonic()
        with pytest.raises(TeacherRequestError, match="401"):
            TeacherClient(fake.url, api_key="wrong").wait_ready("fake", timeout_s=30)
        assert time.monotonic() - t0 < 5
        TeacherClient(fake.url, api_key="right").wait_ready("fake", timeout_s=5)


def test_429_with_retry_after_is_honoured():
    with FakeOpenAI(chat_429=2, retry_after="0.3") as fake:
        t0 = time.monotonic()
        answer, retries = TeacherClient(fake.url).chat("fake", MSG, 16)
        assert retries == 2 and time.monotonic() - t0 >= 0.6
        assert answer.completion == canned_answer("Write f.") and answer.completion_tokens == 7


def test_dropped_connections_and_malformed_bodies_are_retried():
    with FakeOpenAI(drop=2, malformed=1) as fake:
        answer, retries = TeacherClient(fake.url, backoff_cap_s=0.05).chat("fake", MSG, 16)
        assert retries == 3 and answer.finish_reason == "stop"


def test_400_is_not_retried_and_carries_the_message():
    with FakeOpenAI(bad_request_for="Write") as fake:
        with pytest.raises(TeacherRequestError, match="prompt rejected by policy"):
            TeacherClient(fake.url).chat("fake", MSG, 16)
        assert fake.calls["chat"] == 1


def test_retry_limits():
    with FakeOpenAI(chat_429=10, retry_after="0") as fake:
        with pytest.raises(TeacherUnavailable, match="after 3 retries"):
            TeacherClient(fake.url, max_retries=3).chat("fake", MSG, 16)
        with pytest.raises(TeacherUnavailable):
            TeacherClient(fake.url, max_retries=50, budget=RetryBudget(2)).chat("fake", MSG, 16)


def test_retry_after_parsing():
    assert retry_after_seconds("2") == 2.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0


def test_torn_last_line_is_cut(tmp_path):
    f = tmp_path / "answers.jsonl"
    f.write_text('{"task_id": 1, "completion": "a"}\n{"task_id": 2, "compl')
    rows = load_answers(f)
    assert list(rows) == [1] and f.read_text() == '{"task_id": 1, "completion": "a"}\n'


def write_config(tmp_path, url, **teacher):
    cfg = {
        "teacher": {
            "url": url,
            "model": "fake",
            "max_tokens": 16,
            "ready_timeout_s": 20,
            **teacher,
        },
        "data": {"train_size": 40, "test_size": 10},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def rows_of(art):
    return [json.loads(x) for x in (art / "teacher" / "answers.jsonl").read_text().splitlines()]


def test_distill_needs_split_first(tmp_path, cli):
    r = cli("distill", *CI, "--artifacts", tmp_path)
    assert r.returncode == 2 and "run the split stage first" in r.log


def test_distill_against_remote_teacher_with_limit_and_summary(tmp_path, mbpp_path, cli):
    art = tmp_path / "art"
    with FakeOpenAI(chat_429=1, retry_after="0") as fake:
        cfg = write_config(tmp_path, fake.url, concurrency=4)
        assert cli("split", "--config", cfg, "--artifacts", art).returncode == 0
        r = cli("distill", "--config", cfg, "--artifacts", art, "--set", "distill.limit=12")
        assert r.returncode == 0, r.log
    rows = rows_of(art)
    train = [json.loads(x) for x in (art / "data" / "train.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in rows] != [] and sorted(r["task_id"] for r in rows) == sorted(
        t["task_id"] for t in train[:12]
    )
    assert all(r["completion"] == canned_answer(r["prompt"]) for r in rows)
    assert {
        "task_id",
        "prompt",
        "completion",
        "finish_reason",
        "completion_tokens",
        "model",
        "latency_s",
    } <= set(rows[0])
    summary = json.loads((art / "teacher" / "summary.json").read_text())
    assert summary["answers"] == 12 and summary["retries"] == 1 and summary["truncated"] == 0
    assert (art / "teacher" / "config.yaml").is_file()


@pytest.mark.slow
def test_distill_killed_mid_run_resumes_without_loss_or_duplicates(tmp_path, mbpp_path):
    art = tmp_path / "art"
    with FakeOpenAI(delay_s=0.15) as fake:
        cfg = write_config(tmp_path, fake.url)
        assert run_cli("split", "--config", str(cfg), "--artifacts", str(art)).returncode == 0
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipeline",
                "distill",
                "--config",
                str(cfg),
                "--artifacts",
                str(art),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        answers = art / "teacher" / "answers.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            not answers.exists() or len(answers.read_text().splitlines()) < 8
        ):
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with open(answers, "a") as f:  # as if killed mid-write
            f.write('{"task_id": 99999, "compl')
        kept = {r["prompt"] for r in rows_of_safe(answers)}
        assert 8 <= len(kept) < 40
        time.sleep(0.5)  # let the killed run's in-flight request land on the server
        asked_before = len(fake.chat_prompts)
        r = run_cli("distill", "--config", str(cfg), "--artifacts", str(art))
        assert r.returncode == 0, r.stderr
        asked_again = fake.chat_prompts[asked_before:]
    rows = rows_of(art)
    ids = [r["task_id"] for r in rows]
    train = [
        json.loads(x)["task_id"] for x in (art / "data" / "train.jsonl").read_text().splitlines()
    ]
    assert len(ids) == len(set(ids)) == 40 and set(ids) == set(train)
    # Only the missing ones were asked again, each once.
    assert len(asked_again) == 40 - len(kept) and not set(asked_again) & kept
    assert json.loads((art / "teacher" / "summary.json").read_text())["answers"] == 40


def rows_of_safe(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def test_distill_with_local_teacher_ci_config(distilled_ws, tmp_path, cli):
    """The local teacher: the session's distilled workspace (conftest.distilled_ws) was answered
    by a `python -m pipeline serve` process that distill started and stopped."""
    art = distilled_ws
    summary = json.loads((art / "teacher" / "summary.json").read_text())
    assert summary["concurrency"] >= 16  # enough in flight to fill the local teacher's batches
    assert summary["teacher"] == "local" and summary["answered_this_run"] == 100
    rows = rows_of(art)
    assert len(rows) == 100 and all("completion_token_ids" in r for r in rows)
    assert all(r["completion_tokens"] == len(r["completion_token_ids"]) for r in rows)
    # The local server was stopped: nothing listens or runs any more.
    out = subprocess.run(["pgrep", "-f", f"pipeline serve.*{art}"], capture_output=True, text=True)
    assert out.stdout.strip() == ""
    # A finished run is not repeated: nothing to do, no server started.
    art = copy_workspace(distilled_ws, tmp_path / "art")
    r = cli("distill", *CI, "--artifacts", art, "--set", "distill.limit=100")
    assert (
        r.returncode == 0
        and "0 answers to go" in r.log
        and "starting the local teacher" not in r.log
    )


def test_the_local_teacher_gets_the_context_its_longest_prompt_needs(distilled_ws):
    """The local teacher's context is the longest prompt (as its server templates it) plus
    teacher.max_tokens where that exceeds engine.max_context (the 500-prompt run on the
    embedded default stopped at a 400: 273 + 256 > 512); its config stays eager, full-headed
    and uncaptured."""
    from pipeline import models, specs
    from pipeline.config import load_config
    from pipeline.teacher import local_context, local_teacher_config
    from pipeline.workspace import Workspace, read_jsonl

    ws = Workspace(distilled_ws)
    rows = read_jsonl(ws.train_file)[:20]
    prompts, turns = [r["prompt"] for r in rows], {r["task_id"]: [0] for r in rows}
    cfg = load_config("configs/ci.yaml", ["engine.max_context=64", "engine.compile=auto"])
    tok = models.load_tokenizer(specs.resolve(cfg.models.target, ws.models_cache))
    longest = max(len(models.user_prompt_ids(tok, p, cfg.template_kwargs())) for p in prompts)
    assert longest + cfg.teacher.max_tokens > 64  # the case that failed
    need = local_context(cfg, ws, rows, turns)
    assert need == longest + cfg.teacher.max_tokens
    roomy = load_config("configs/ci.yaml", ["engine.max_context=4096"])
    assert local_context(roomy, ws, rows, turns) == 4096  # never below the engine's
    local = local_teacher_config(cfg, need)
    assert local.engine.max_context == need and local.engine.compile == "false"
    assert local.engine.draft_vocab == 0 and local.traffic.capture is False
    assert local_teacher_config(cfg).engine.max_context == 64


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_distill_leaves_no_local_server(tmp_path, mbpp_path, sig):
    art = tmp_path / "art"
    assert run_cli("split", "--config", "configs/ci.yaml", "--artifacts", str(art)).returncode == 0
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline",
            "distill",
            "--config",
            "configs/ci.yaml",
            "--artifacts",
            str(art),
            "--set",
            "distill.limit=300",
            "--set",
            "teacher.max_tokens=200",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "stderr.log", "w"),  # a file, not a pipe: a full pipe would stall it
    )
    answers = art / "teacher" / "answers.jsonl"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (
        answers.exists() and answers.read_text().count("\n") >= 2
    ):
        time.sleep(0.1)
    server = subprocess.run(
        ["pgrep", "-f", f"pipeline serve.*{art}"], capture_output=True, text=True
    ).stdout.split()
    assert len(server) == 1
    proc.send_signal(sig)
    proc.wait(timeout=60)
    err = (tmp_path / "stderr.log").read_text()
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "interrupted" in err
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and os.path.exists(f"/proc/{server[0]}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{server[0]}"), "local teacher outlived the stage"
    # What was written is intact: every line is a whole row.
    assert all(line.endswith("}") for line in answers.read_text().splitlines())


def test_what_is_sent_to_the_teacher(tmp_path, mbpp_path, cli):
    """The request body a vLLM / SGLang teacher sees: the model, greedy, the configured budget,
    and Qwen3's thinking switch off."""
    art = tmp_path / "art"
    with FakeOpenAI() as fake:
        cfg = write_config(tmp_path, fake.url, max_tokens=77, enable_thinking=False)
        assert cli("split", "--config", cfg, "--artifacts", art).returncode == 0
        r = cli("distill", "--config", cfg, "--artifacts", art, "--set", "distill.limit=3")
        assert r.returncode == 0, r.log
        bodies = list(fake.chat_bodies)
    assert len(bodies) == 3
    for body in bodies:
        assert body["model"] == "fake" and body["temperature"] == 0 and body["max_tokens"] == 77
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
        assert body["messages"][0]["role"] == "user" and body["messages"][0]["content"]


def test_extra_samples_are_asked_once_each_seeded_and_kept_apart(tmp_path, mbpp_path, cli):
    """distill.extra_samples: beside each main answer (greedy, first), N answers sampled at
    distill.sample_temperature with a seed per task and sample; a rerun asks for none again,
    and raising N asks only for the new ones. The main answers stay what load_answers reads."""
    from pipeline.teacher import load_all_answers

    art = tmp_path / "art"
    with FakeOpenAI() as fake:
        cfg = write_config(tmp_path, fake.url)
        assert cli("split", "--config", cfg, "--artifacts", art).returncode == 0
        sets = ["--set", "distill.limit=3", "--set", "distill.extra_samples=2",
                "--set", "distill.sample_temperature=0.6"]  # fmt: skip
        assert cli("distill", "--config", cfg, "--artifacts", art, *sets).returncode == 0
        first = list(fake.chat_bodies)
        assert cli("distill", "--config", cfg, "--artifacts", art, *sets).returncode == 0
        assert len(fake.chat_bodies) == len(first) == 9  # 3 main + 3 x 2 samples; none again
        more = [*sets[:2], "--set", "distill.extra_samples=3"]
        assert cli("distill", "--config", cfg, "--artifacts", art, *more).returncode == 0
        assert len(fake.chat_bodies) == 12  # only the third sample of each prompt
    main = [b for b in first if b["temperature"] == 0]
    sampled = [b for b in first if b["temperature"] == 0.6]
    assert len(main) == 3 and "seed" not in main[0] and len(sampled) == 6
    assert len({b["seed"] for b in sampled}) == 6
    answers = art / "teacher" / "answers.jsonl"
    assert len(load_answers(answers)) == 3
    assert sorted(j for _, _, j in load_all_answers(answers)) == [
        0,
        0,
        0,
        1,
        1,
        1,
        2,
        2,
        2,
        3,
        3,
        3,
    ]
    summary = json.loads((art / "teacher" / "summary.json").read_text())
    assert summary["answers"] == 3 and summary["extra_samples"] == 9
    from pipeline.config import load_config
    from pipeline.train import training_answers
    from pipeline.workspace import Workspace

    for n, rows in ((0, 3), (2, 9), (3, 12)):
        got = training_answers(load_config(cfg, [f"distill.extra_samples={n}"]), Workspace(art))
        assert len(got) == rows and [a.get("sample", 0) for a in got[:3]] == [0, 0, 0]


def test_thinking_switch_not_sent_when_unset(tmp_path, mbpp_path, cli):
    art = tmp_path / "art"
    with FakeOpenAI() as fake:
        cfg = write_config(tmp_path, fake.url, enable_thinking=None)
        assert cli("split", "--config", cfg, "--artifacts", art).returncode == 0
        r = cli("distill", "--config", cfg, "--artifacts", art, "--set", "distill.limit=1")
        assert r.returncode == 0, r.log
        assert "chat_template_kwargs" not in fake.chat_bodies[0]


def test_url_without_v1_fails_at_once_suggesting_it():
    with FakeOpenAI() as fake:
        root = fake.url.removesuffix("/v1")
        t0 = time.monotonic()
        with pytest.raises(TeacherRequestError, match=f"teacher.url={root}/v1"):
            TeacherClient(root).wait_ready("fake", timeout_s=30)
        assert time.monotonic() - t0 < 5  # not after the readiness timeout
