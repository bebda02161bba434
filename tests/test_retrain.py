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
from pipeline.workspace import workspace_lock
from tests.conftest import ROOT, run_cli

# Small and fast; the gate's margin is set per test so it does not hinge on training quality.
RT = ["--set", "distill.limit=40", "--set", "bench.prompts=4", "--set", "train.max_steps=6"]
PROMOTE = ["--set", "retrain.min_gain=-1"]


def retrain(root, *extra):
    return run_cli("retrain", "--config", "configs/ci.yaml", "--artifacts", str(root), *RT, *extra)


def runs_of(root):
    return sorted(p.name for p in (root / "runs").iterdir())


@pytest.fixture(scope="module")
def promoted(tmp_path_factory):
    from tests.conftest import MBPP

    if not MBPP.is_file():
        pytest.skip("MBPP not present")
    root = tmp_path_factory.mktemp("rt")
    r = retrain(root, *PROMOTE)
    assert r.returncode == 0, r.stderr[-3000:]
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
    assert not (run / "cache").exists()  # models are cached once per artifacts root


def test_rerunning_a_finished_run_skips_every_stage(promoted, tmp_path):
    root = tmp_path / "rt"
    shutil.copytree(promoted, root, symlinks=True)
    (run_id,) = runs_of(root)
    before = (root / "runs" / run_id / "merged" / "model.safetensors").stat().st_mtime_ns
    r = retrain(root, *PROMOTE, "--resume", run_id)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("is up to date: skipped") == 5 and "nothing to do" in r.stderr
    assert (root / "runs" / run_id / "merged" / "model.safetensors").stat().st_mtime_ns == before
    assert runs_of(root) == [run_id]


def test_gate_refuses_a_draft_that_does_not_beat_the_promoted_one(promoted, tmp_path):
    root = tmp_path / "rt"
    shutil.copytree(promoted, root, symlinks=True)
    (first,) = runs_of(root)
    time.sleep(1.1)  # run ids are UTC seconds
    r = retrain(root, "--set", "retrain.min_gain=0.5")
    assert r.returncode == 5, r.stderr[-2000:]
    assert "not promoted" in r.stderr and f"promoted run {first}" in r.stderr
    second = [x for x in runs_of(root) if x != first][0]
    gate = json.loads((root / "runs" / second / "gate.json").read_text())
    assert gate["promoted"] is False and gate["baseline"] == f"promoted run {first}"
    assert os.readlink(root / "current") == f"runs/{first}"  # current kept
    assert len(list((root / "registry" / "phoenix-draft").glob("v*"))) == 1  # nothing pushed
    assert json.loads((root / "runs" / second / "run.json").read_text())["status"] == "rejected"


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


def test_two_concurrent_runs_yield_one_lock_held_exit(tmp_path, mbpp_path):
    root = tmp_path / "rt"
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline",
            "retrain",
            "--config",
            "configs/ci.yaml",
            "--artifacts",
            str(root),
            *RT,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (root / "phoenix.lock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        r = retrain(root)
        assert r.returncode == 6 and f"pid {first.pid}" in r.stderr
        assert time.monotonic() - t0 < 30  # at once, not after the first finishes
    finally:
        first.kill()
        first.wait()


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
