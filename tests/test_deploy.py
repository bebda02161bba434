"""The scheduler examples in deploy/ keep Phoenix's exit codes (make would turn them into 2)."""

import json
import shlex
import socket
import subprocess
import sys

import yaml

from tests.conftest import ROOT


def tiny(args: list[str], artifacts) -> list[str]:
    """The example's own command line, pointed at the tiny CI config and a test workspace."""
    out = []
    for a in args:
        a = a.replace("configs/qwen3.yaml", "configs/ci.yaml").replace(
            "/data/phoenix", str(artifacts)
        )
        out.append(sys.executable if a in ("python", ".venv/bin/python") else a)
    return out


def run_example(args: list[str], cli):
    """The example's command is `python -m pipeline retrain ...`: its exit code is main()'s."""
    assert args[1:4] == ["-m", "pipeline", "retrain"], "the example must call python, not make"
    return cli(*args[3:])


def test_crontab_example_passes_lock_held_through_as_6(tmp_path, cli):
    line = next(
        x
        for x in (ROOT / "deploy" / "crontab.example").read_text().splitlines()
        if x and not x.startswith("#")
    )
    command = line.split(" && ")[-1].split(" >>")[0]  # after cd and the env file, before the log
    args = tiny(shlex.split(command), tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "phoenix.lock").write_text(
            json.dumps({"pid": holder.pid, "host": socket.gethostname(), "job": "retrain"})
        )
        r = run_example(args, cli)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 6, r.log[-2000:]


def test_k8s_cronjob_passes_teacher_unavailable_through_as_3(tmp_path, cli):
    job = yaml.safe_load((ROOT / "deploy" / "k8s-cronjob.yaml").read_text())
    container = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    args = tiny(container["command"] + container["args"], tmp_path)
    # Inject the failure: a teacher that is not there, and little patience for it.
    args = [
        a if not a.startswith("--set=teacher.url=") else "--set=teacher.url=http://127.0.0.1:9/v1"
        for a in args
    ]
    args += ["--set", "teacher.ready_timeout_s=1", "--set", "distill.limit=2"]
    r = run_example(args, cli)
    assert r.returncode == 3, r.log[-2000:]
    assert "not ready" in r.log
