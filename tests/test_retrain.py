import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from pipeline.errors import LockHeld
from pipeline.workspace import new_run_id, workspace_lock
from tests.conftest import ROOT, run_main

# The killed-run test's settings (ci.yaml); the gate's margin is set per test.
RT = ["--set", "distill.limit=40", "--set", "bench.prompts=3", "--set", "train.max_steps=6"]
RT += ["--set", "bench.max_new_tokens=8"]
PROMOTE = ["--set", "retrain.min_gain=-1"]


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    """Retrain's settings for this module: the tiny Qwen3 pair (configs/ci-qwen3.yaml: q/k
    norms, tied embeddings, the enable_thinking switch, a separate draft, LoRA) and a remote
    teacher (Phoenix's server for the tiny Qwen3 target, here in a thread, as vLLM would serve
    the real one): the code paths a Qwen3 user hits, end to end. (The local teacher, a child
    process, is conftest.distilled_ws's; retrain with it: the killed-run test below.)"""
    from pipeline.config import load_config
    from pipeline.server import build_app
    from pipeline.workspace import Workspace
    from tests.conftest import wait_http
    from tests.servers import ServerThread

    ws = Workspace(tmp_path_factory.mktemp("qwen3-teacher"))
    with ServerThread(build_app(load_config("configs/ci-qwen3.yaml"), ws, mode="target")) as s:
        wait_http(s.url + "/health", timeout=60)
        yield ["--config", "configs/ci-qwen3.yaml", "--set", f"teacher.url={s.url}/v1"]


def runs_of(root):
    return sorted(p.name for p in (root / "runs").iterdir())


@pytest.fixture(scope="module")
def promoted(tmp_path_factory, rt):
    """retrain through the command line's `main()`, promoted (the gate's margin is -1); as a
    real process it runs in test-slow (killed and resumed)."""
    from tests.conftest import MBPP

    if not MBPP.is_file():
        pytest.skip("MBPP not present")
    root = tmp_path_factory.mktemp("rt")
    assert run_main("retrain", "--artifacts", root, *rt, *PROMOTE) == 0
    return root


def test_a_run_completes_and_is_promoted(promoted):
    (run_id,) = runs_of(promoted)
    run = promoted / "runs" / run_id
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "promoted" and all(v == "done" for v in info["stages"].values())
    assert list(info["stages"]) == ["split", "distill", "train", "merge", "bench"]
    assert os.readlink(promoted / "current") == f"runs/{run_id}"
    versions = list((promoted / "registry" / "phoenix-draft").glob("v*"))
    assert len(versions) == 1 and run_id in versions[0].name
    for stage in info["stages"]:
        manifest = json.loads((run / "manifests" / f"{stage}.json").read_text())
        assert manifest["outputs"] and all(manifest["outputs"].values())
    assert not (promoted / "phoenix.lock").exists()
    # Qwen3 paths: the teacher rendered prompts with thinking off; LoRA was merged; lossless.
    from pipeline import models

    tok = models.load_tokenizer(str(run / "merged"))
    answer = json.loads((run / "teacher" / "answers.jsonl").read_text().splitlines()[0])
    off = models.user_prompt_ids(tok, answer["prompt"], {"enable_thinking": False})
    assert answer["prompt_tokens"] == len(off) > len(models.user_prompt_ids(tok, answer["prompt"]))
    assert json.loads((run / "adapter" / "metrics.json").read_text())["method"] == "lora"
    assert json.loads((run / "merged" / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"
    ]
    assert json.loads((run / "bench" / "results.json").read_text())["lossless"] is True
    assert not (run / "cache").exists()  # models are cached once per artifacts root


def test_rerunning_a_finished_run_skips_every_stage(promoted, tmp_path, cli, rt):
    root = tmp_path / "rt"
    shutil.copytree(promoted, root, symlinks=True)
    (run_id,) = runs_of(root)
    before = (root / "runs" / run_id / "merged" / "model.safetensors").stat().st_mtime_ns
    r = cli("retrain", "--artifacts", root, *rt, *PROMOTE, "--resume", run_id)
    assert r.returncode == 0, r.log[-2000:]
    assert r.log.count("is up to date: skipped") == 5 and "nothing to do" in r.log
    assert (root / "runs" / run_id / "merged" / "model.safetensors").stat().st_mtime_ns == before
    assert runs_of(root) == [run_id]


def test_gate_refuses_a_draft_that_does_not_beat_the_promoted_one(promoted, tmp_path, cli, rt):
    """A second run whose stages are all done (a copy of the first: same acceptance) meets a
    gate that wants +0.5: exit 5, `current` and the registry stay."""
    root = tmp_path / "rt"
    shutil.copytree(promoted, root, symlinks=True)
    (first,) = runs_of(root)
    second = new_run_id()
    shutil.copytree(root / "runs" / first, root / "runs" / second)
    info_file = root / "runs" / second / "run.json"
    info = json.loads(info_file.read_text())
    info_file.write_text(json.dumps({**info, "run_id": second, "status": "running"}))
    r = cli("retrain", "--artifacts", root, *rt, "--set", "retrain.min_gain=0.5")
    assert r.returncode == 5, r.log[-2000:]
    assert r.log.count("is up to date: skipped") == 5  # resumed the unfinished run, no work
    assert "not promoted" in r.log and f"promoted run {first}" in r.log
    gate = json.loads((root / "runs" / second / "gate.json").read_text())
    assert gate["promoted"] is False and gate["baseline"] == f"promoted run {first}"
    assert os.readlink(root / "current") == f"runs/{first}"  # current kept
    assert len(list((root / "registry" / "phoenix-draft").glob("v*"))) == 1  # nothing pushed
    assert json.loads(info_file.read_text())["status"] == "rejected"


@pytest.mark.slow
def test_killed_run_resumes_at_the_failed_stage_and_clears_the_stale_lock(tmp_path, mbpp_path):
    root = tmp_path / "rt"
    cmd = [
        sys.executable,
        "-m",
        "pipeline",
        "retrain",
        "--config",
        "configs/ci.yaml",
        "--artifacts",
        str(root),
        *RT,
        *PROMOTE,
        "--set",
        "distill.limit=300",
        "--set",
        "teacher.max_tokens=64",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    answers = None
    while time.monotonic() < deadline:
        found = (
            list((root / "runs").glob("*/teacher/answers.jsonl"))
            if (root / "runs").exists()
            else []
        )
        if found and found[0].read_text().count("\n") >= 10:
            answers = found[0]
            break
        time.sleep(0.1)
    assert answers is not None
    os.kill(proc.pid, signal.SIGKILL)  # mid-distill, lock left behind
    proc.wait()
    assert (root / "phoenix.lock").exists()
    kept = answers.read_text().count("\n")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "clearing a stale lock" in r.stderr and "resuming run" in r.stderr
    (run_id,) = runs_of(root)
    info = json.loads((root / "runs" / run_id / "run.json").read_text())
    assert info["stages"]["split"] == "skipped" and info["stages"]["distill"] == "done"
    assert info["status"] == "promoted"
    rows = [json.loads(x) for x in answers.read_text().splitlines()]
    assert len(rows) == 300 == len({r["task_id"] for r in rows}) and kept >= 10


def test_a_second_run_exits_6_at_once_naming_the_holder(tmp_path, cli, rt):
    """A retrain while another job holds the artifacts root (a live process on this host)."""
    root = tmp_path / "rt"
    root.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (root / "phoenix.lock").write_text(
            json.dumps(
                {"pid": holder.pid, "host": socket.gethostname(), "job": "retrain", "run_id": "r1"}
            )
        )
        r = cli("retrain", "--artifacts", root, *rt)
        assert r.returncode == 6 and f"retrain (pid {holder.pid}" in r.log and "run r1" in r.log
        assert not (root / "runs").exists()  # nothing started
    finally:
        holder.kill()
        holder.wait()


def test_lock_is_exclusive_across_processes_and_reentrant_within_one(tmp_path):
    lock = tmp_path / "phoenix.lock"
    with workspace_lock(lock, "retrain", "a"):
        with workspace_lock(lock, "bench"):  # retrain's own stages: no self-deadlock
            assert json.loads(lock.read_text())["job"] == "retrain"
        assert lock.exists()  # still held by the outer block
    assert not lock.exists()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:  # a live holder in another process
        lock.write_text(
            json.dumps(
                {"pid": other.pid, "host": socket.gethostname(), "job": "distill", "started": "t"}
            )
        )
        with pytest.raises(LockHeld, match=f"distill \\(pid {other.pid}"):
            with workspace_lock(lock, "train"):
                pass
    finally:
        other.kill()
        other.wait()
    with workspace_lock(lock, "train"):  # its holder is gone: cleared and taken
        assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_the_qwen3_pair_trains_merges_and_serves_an_eagle3_head(tmp_path, cli, rt):
    """configs/qwen3-eagle3.yaml's path in miniature: the tiny Qwen3 target (q/k norms, tied
    embeddings, thinking off) gets an EAGLE-3 head from a remote teacher's answers; merge
    exports it for vLLM naming Qwen3's architecture; the bench serves it, lossless."""
    from tests.conftest import MBPP

    if not MBPP.is_file():
        pytest.skip("MBPP not present")
    art = ["--artifacts", tmp_path / "art", *rt, "--set", "models.draft=eagle3"]
    art += ["--set", "train.method=full", "--set", "train.ttt_steps=2", "--set", "train.epochs=1"]
    for stage in ("split", "distill", "train", "merge"):
        r = cli(stage, *art)
        assert r.returncode == 0, (stage, r.log[-2000:])
    merged = tmp_path / "art" / "merged"
    cfg = json.loads((merged / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
    r = cli("bench", *art, "--set", "bench.fixed_arms=[eagle:2]",
            "--set", "bandit.arms=[0,eagle:2]")  # fmt: skip
    assert r.returncode == 0, r.log[-2000:]
    results = json.loads((tmp_path / "art" / "bench" / "results.json").read_text())
    assert results["lossless"] is True
    assert any(q["mode"] == "eagle_2" and q["proposed"] for q in results["requests"])


def test_a_run_retrains_the_draft_model_alone_beside_a_distilled_head(tmp_path):
    """configs/default.yaml trains a head beside the draft (models.head=distilled); a retrain run
    (MBPP or traffic) retrains and benches the draft model alone, so its bench does not look
    for a head the run never built."""
    from pipeline.config import load_config
    from pipeline.retrain import run_config

    for data in ("mbpp", "traffic"):
        cfg = load_config("configs/default.yaml", [f"retrain.data={data}"])
        assert cfg.trains_head()
        run = run_config(cfg, tmp_path)
        assert run.models.head is None and run.models.draft == cfg.models.draft
        assert "base" in run.bench.drafts
