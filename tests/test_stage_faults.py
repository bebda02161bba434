"""Stage faults (issue 13): overlapping runs on one workspace, and a full disk.

The full disk is real: a small tmpfs mounted for the test (root is needed to mount; where it is
not available the test says so and skips).
"""

import json
import logging
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import CI, ROOT
from tests.fake_openai import FakeOpenAI


def fake_teacher(url: str, limit: int) -> list[str]:
    return [
        "--set",
        f"teacher.url={url}",
        "--set",
        "teacher.model=fake",
        "--set",
        "teacher.concurrency=4",
        "--set",
        f"distill.limit={limit}",
    ]


def answer_rows(path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == len({r["task_id"] for r in rows}), "an answer was written twice"
    return rows


def split_into(cli, art, cache) -> None:
    assert cli("split", *CI, "--artifacts", art, "--cache", cache).returncode == 0


def test_overlapping_distills_answer_each_prompt_once(tmp_path, mbpp_path, model_cache, cli):
    """A cron job overlapping a manual run: the second exits 6 naming the first; every answer
    is asked for and written once. (The first is distill's command-line end-to-end run.)"""
    art = tmp_path / "art"
    split_into(cli, art, model_cache)
    with FakeOpenAI(delay_s=0.2) as fake:
        args = ["distill", *CI, "--artifacts", str(art), *fake_teacher(fake.url, 40)]
        first = subprocess.Popen(
            [sys.executable, "-m", "pipeline", *args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 60
            while not (art / "phoenix.lock").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            second = cli(*args)
            assert first.poll() is None, "the first run ended before the overlap was tried"
            assert second.returncode == 6, second.log[-2000:]
            assert f"distill (pid {first.pid}" in second.log
            assert first.wait(120) == 0, first.stderr.read()[-2000:]
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        assert len(answer_rows(art / "teacher" / "answers.jsonl")) == 40
        assert fake.calls["chat"] == 40
    assert json.loads((art / "teacher" / "summary.json").read_text())["answers"] == 40
    assert (art / "teacher" / "config.yaml").is_file()
    assert not (art / "phoenix.lock").exists()


@pytest.fixture
def small_volume(tmp_path):
    vol = tmp_path / "vol"
    vol.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(vol)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield vol
    finally:
        subprocess.run(["umount", "-l", str(vol)], check=False)


def fill(vol, leave: int) -> None:
    """Take all the volume's free space but `leave` bytes."""
    need = shutil.disk_usage(vol).free - leave
    with open(vol / "filler", "ab") as f:
        while need > 0:
            n = min(need, 1 << 16)
            f.write(b"\0" * n)
            need -= n


def unfill(vol) -> None:
    (vol / "filler").unlink(missing_ok=True)


def one_error_line(caplog) -> str:
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert errors[0].exc_info is None  # one line, no traceback
    return errors[0].getMessage()


def test_full_disk_keeps_what_was_written_and_says_what_to_do(
    small_volume, tmp_path, mbpp_path, model_cache, caplog, cli
):
    art = small_volume / "art"
    common = ["--artifacts", str(art), "--cache", str(model_cache)]
    split_into(cli, art, model_cache)

    # distill: the disk fills after a few answers
    with FakeOpenAI() as fake:
        distill = ["distill", *CI, *common, *fake_teacher(fake.url, 60)]
        fill(small_volume, 12 * 1024)
        caplog.clear()
        assert cli(*distill).returncode == 1
        msg = one_error_line(caplog)
        kept = answer_rows(art / "teacher" / "answers.jsonl")
        assert 0 < len(kept) < 60
        assert "disk full" in msg and "answers.jsonl" in msg and f"{len(kept)} answers" in msg
        unfill(small_volume)
        assert cli(*distill).returncode == 0
        assert len(answer_rows(art / "teacher" / "answers.jsonl")) == 60

    # train: room for one checkpoint (about 0.7 MB), not two
    train = ["train", *CI, *common, "--set", "train.save_steps=2", "--set", "train.max_steps=6"]
    fill(small_volume, 1200 * 1024)
    caplog.clear()
    assert cli(*train).returncode == 1
    msg = one_error_line(caplog)
    ckpts = art / "adapter" / "checkpoints"
    assert "disk full" in msg and "checkpoint-2 is kept" in msg, msg
    unfill(small_volume)
    caplog.clear()
    assert cli(*train).returncode == 0
    assert "resuming from" in caplog.text and "checkpoint-2" in caplog.text
    assert (art / "adapter" / "metrics.json").exists() and (ckpts / "checkpoint-6").is_dir()

    # merge: nothing half-written is left, and nothing was published
    merge = ["merge", *CI, *common]
    fill(small_volume, 64 * 1024)
    caplog.clear()
    assert cli(*merge).returncode == 1
    msg = one_error_line(caplog)
    assert "disk full" in msg and "merged" in msg
    assert not (art / "merged").exists() and not list(art.glob(".merged.*"))
    assert not (art / "registry").exists()
    unfill(small_volume)
    assert cli(*merge).returncode == 0
    assert (art / "merged" / "model.safetensors").exists()
