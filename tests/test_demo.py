"""The whole pipeline as a user runs it: `python -m pipeline demo` (configs/ci.yaml)."""

import json

import pytest

from tests.conftest import CI, run_cli


@pytest.mark.slow
def test_demo_runs_every_stage_under_one_lock(tmp_path, mbpp_path):
    art = tmp_path / "art"
    r = run_cli("demo", *CI, "--artifacts", str(art), "--set", "bench.prompts=12")
    assert r.returncode == 0, r.stderr[-3000:]
    for stage in ("split", "distill", "train", "merge", "bench"):
        assert f"=== demo: {stage} ===" in r.stderr
    results = json.loads((art / "bench" / "results.json").read_text())
    assert results["lossless"] is True and (art / "bench" / "report.md").is_file()
    assert (art / "merged" / "publish.json").is_file() and not (art / "phoenix.lock").exists()
