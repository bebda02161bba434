"""`server.draft`: serve serves the draft you built (latest), or base, or a named one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import requests

from pipeline import artifacts, drafts
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.workspace import Workspace, read_jsonl
from tests.conftest import CI, wait_http
from tests.servers import ServerThread

CHAT = "/v1/chat/completions"


def cfg_with(draft: str = "latest"):
    return load_config("configs/ci.yaml", [f"server.draft={draft}"])


def fake_model(folder: Path, verified: bool = True, when: float | None = None) -> Path:
    """A directory that reads as a model: a real config.json, a weights file, and (verified)
    the phoenix.json merge writes after its check."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(os.urandom(64))
    if verified:
        (folder / "phoenix.json").write_text(json.dumps({"method": "full"}))
        if when is not None:
            os.utime(folder / "phoenix.json", (when, when))
    return folder


def registry_version(art: Path, version: str, when: float) -> Path:
    folder = fake_model(art / "registry" / "phoenix-draft" / version, when=when)
    (folder / "phoenix-version.json").write_text(json.dumps({"version": version}))
    (folder.parent / "latest.json").write_text(json.dumps({"version": version}))
    return folder


def test_latest_is_promoted_else_newest_verified_merged_else_base(tmp_path, caplog):
    ws = Workspace(tmp_path)
    cfg = cfg_with()
    served = drafts.resolve_served(cfg, ws)
    assert (served.source, served.spec) == ("base", "cut:1")
    assert "make demo" in caplog.text  # the warning says how to build a distilled draft

    fake_model(ws.merged, verified=False)  # merge did not finish its check: not served
    assert drafts.resolve_served(cfg, ws).source == "base"
    (ws.merged / "phoenix.json").write_text("{}")
    os.utime(ws.merged / "phoenix.json", (1000, 1000))
    served = drafts.resolve_served(cfg, ws)
    assert (served.source, served.spec) == ("merged", str(ws.merged))

    newer = registry_version(tmp_path, "v0002-b", when=2000)
    served = drafts.resolve_served(cfg, ws)
    assert (served.source, served.spec, served.version) == ("registry", str(newer), "v0002-b")
    os.utime(ws.merged / "phoenix.json", (3000, 3000))  # merged again since
    assert drafts.resolve_served(cfg, ws).source == "merged"

    run = tmp_path / "runs" / "r1"
    fake_model(run / "merged")
    (run / "gate.json").write_text(json.dumps({"published": {"version": "v0001-r1"}}))
    os.symlink("runs/r1", tmp_path / "current")
    served = drafts.resolve_served(cfg, ws)
    assert (served.source, served.spec, served.version) == (
        "promoted",
        str(run / "merged"),
        "v0001-r1",
    )
    assert drafts.resolve_served(cfg_with("base"), ws).spec == "cut:1"


def test_named_drafts_and_what_is_wrong_with_them(tmp_path):
    ws = Workspace(tmp_path)
    v1 = registry_version(tmp_path, "v0001-a", when=1000)
    served = drafts.resolve_served(cfg_with("v0001"), ws)
    assert (served.source, served.spec, served.version) == ("explicit", str(v1), "v0001-a")
    assert drafts.resolve_served(cfg_with(str(v1)), ws).version == "v0001-a"

    with pytest.raises(ConfigError, match="v0007.*versions there: v0001-a"):
        drafts.resolve_served(cfg_with("v0007"), ws)
    with pytest.raises(ConfigError, match="nope/missing-dir: no such directory"):
        drafts.resolve_served(cfg_with(str(tmp_path / "nope" / "missing-dir")), ws)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match=f"{empty} holds no weights"):
        drafts.resolve_served(cfg_with(str(empty)), ws)
    broken = fake_model(tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=f"draft {broken} cannot be loaded"):
        drafts.resolve_served(cfg_with(str(broken)), ws)
    # latest pointing at a broken promoted run is an error too, never a silent base draft
    os.symlink("runs/gone", tmp_path / "current")
    with pytest.raises(ConfigError, match="points at run gone"):
        drafts.resolve_served(cfg_with(), ws)


def test_acceptance_is_named_only_for_the_exact_weights_benched(tmp_path):
    ws = Workspace(tmp_path)
    fake_model(ws.merged)
    sha = artifacts.weights_id(ws.merged)
    results = {
        "draft_weights": {"base": "0" * 64, "distilled": sha},
        "rows": [
            {"draft": "base", "mode": "fixed_4", "acceptance_rate": 0.05},
            {"draft": "distilled", "mode": "fixed_2", "acceptance_rate": 0.5},
            {"draft": "distilled", "mode": "fixed_4", "acceptance_rate": 0.25},
        ],
    }
    ws.bench.mkdir()
    ws.bench_results.write_text(json.dumps(results))
    served = drafts.resolve_served(cfg_with(), ws)
    assert (served.acceptance, served.acceptance_mode) == (0.25, "fixed_4")
    assert "held-out acceptance 0.250 at fixed_4" in served.sentence()
    (ws.merged / "model.safetensors").write_bytes(os.urandom(64))  # trained again, not benched
    served = drafts.resolve_served(cfg_with(), ws)
    assert served.acceptance is None and "no bench result" in served.sentence()


def test_a_missing_or_unloadable_draft_exits_2_naming_it(cli, tmp_path):
    res = cli(*CI, "--artifacts", str(tmp_path), "serve", "--set", "server.draft=/no/such/draft")
    assert res.returncode == 2 and "/no/such/draft" in res.log
    broken = fake_model(tmp_path / "broken")
    (broken / "config.json").write_text("[]")
    res = cli(*CI, "--artifacts", str(tmp_path), "serve", "--set", f"server.draft={broken}")
    assert res.returncode == 2 and f"draft {broken} cannot be loaded" in res.log


def served_acceptance(url: str, prompt: str) -> list[int]:
    r = requests.post(
        url + CHAT,
        json={
            "model": "tiny:layers=2,hidden=64,seed=0",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24,
            "phoenix": {"mode": "fixed:4"},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    ph = r.json()["phoenix"]
    assert "token_ids" not in ph  # per-token ids only when asked for
    return ph["accepted_per_position"]


def expected_acceptance(cfg, ws, draft_spec: str, prompt: str) -> list[int]:
    """The same request run in this process on a named draft: the served draft's fingerprint."""
    from pipeline import models
    from pipeline.speculative.arms import parse_arm
    from pipeline.speculative.batch import generate

    pair = models.load_pair(cfg, ws, draft_spec)
    ids = models.user_prompt_ids(pair.tokenizer, prompt, cfg.template_kwargs())
    return generate(pair.models, ids, parse_arm("draft:4"), 24).accepted_per_position


def test_serve_with_defaults_serves_the_merged_draft(merged_ws, tmp_path, caplog):
    """The app `serve` runs (`build_app`) with the config's defaults after merge: the merged
    draft, by its id in /v1/models and by its acceptance; `base` and an explicit path serve what
    they name. (`python -m pipeline serve` itself runs in tests/test_online.py.)"""
    import logging

    from pipeline.server import build_app

    ws = Workspace(merged_ws)
    cfg = load_config("configs/ci.yaml")
    prompts = [r["prompt"] for r in read_jsonl(ws.test_file)[:3]]
    merged = [expected_acceptance(cfg, ws, str(ws.merged), p) for p in prompts]
    base = [expected_acceptance(cfg, ws, cfg.models.draft, p) for p in prompts]
    assert merged != base  # the fingerprint tells the two drafts apart

    caplog.set_level(logging.INFO)
    with ServerThread(build_app(cfg, ws)) as s:
        wait_http(s.url + "/health", timeout=60)
        entry = requests.get(s.url + "/v1/models", timeout=10).json()["data"][0]
        draft = entry["metadata"]["draft"]
        assert draft["spec"] == str(ws.merged) and draft["source"] == "merged"
        assert draft["version"].startswith("v0001-")  # merge pushed it to the local registry
        assert entry["metadata"]["target"] == cfg.models.target
        assert [served_acceptance(s.url, p) for p in prompts] == merged
    assert f"with draft {ws.merged} (latest: the newest verified merged draft" in caplog.text

    copy = shutil.copytree(ws.merged, tmp_path / "my-draft")
    for choice, spec, want in (("base", "cut:1", base), (str(copy), str(copy), merged)):
        app = build_app(cfg_with(choice), ws)
        with ServerThread(app) as s:
            wait_http(s.url + "/health", timeout=60)
            info = requests.get(s.url + "/v1/models", timeout=10).json()
            assert info["data"][0]["metadata"]["draft"]["spec"] == spec
            assert [served_acceptance(s.url, p) for p in prompts] == want


def test_token_ids_only_when_asked(merged_ws):
    from pipeline.server import build_app

    with ServerThread(build_app(cfg_with("base"), Workspace(merged_ws), mode="target")) as s:
        wait_http(s.url + "/health", timeout=60)
        body = {
            "model": "tiny:layers=2,hidden=64,seed=0",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
        }
        plain = requests.post(s.url + CHAT, json=body, timeout=30).json()
        asked = requests.post(
            s.url + CHAT, json={**body, "phoenix": {"token_ids": True}}, timeout=30
        ).json()
        assert "token_ids" not in plain["phoenix"]
        ids = asked["phoenix"]["token_ids"]
        assert len(ids) == asked["usage"]["completion_tokens"] > 0
        assert all(isinstance(t, int) for t in ids)


def test_demo_ends_with_the_three_lines_a_user_needs(tmp_path, monkeypatch):
    """serve, a request the served model answers (the curl's body is valid JSON for this
    config), and the report; a key set in the environment is named, never printed."""
    import argparse
    import shlex

    from pipeline.__main__ import next_steps

    monkeypatch.setenv("PHOENIX_API_KEY", "do-not-print-me")
    cfg = load_config("configs/default.yaml")
    args = argparse.Namespace(config="configs/default.yaml", artifacts="artifacts")
    text = next_steps(cfg, Workspace("artifacts"), args)
    lines = [x.strip() for x in text.strip().splitlines()]
    assert lines[1].startswith("make serve    #") and "report: artifacts/bench/report.md" in lines
    curl = shlex.split(lines[2])
    assert curl[:3] == ["curl", "-s", "http://127.0.0.1:8000/v1/chat/completions"]
    body = json.loads(curl[curl.index("-d") + 1])
    assert body["model"] == "embedded:smollm2-135m-instruct" and body["messages"]
    assert "Bearer $PHOENIX_API_KEY" in lines[2] and "do-not-print-me" not in text
    other = argparse.Namespace(config="configs/ci.yaml", artifacts=str(tmp_path))
    text = next_steps(load_config("configs/ci.yaml"), Workspace(tmp_path), other)
    assert f"make serve CONFIG=configs/ci.yaml ARTIFACTS={tmp_path}" in text


def test_a_head_trained_beside_the_draft_is_benched_and_the_faster_kind_served(
    distilled_ws, tmp_path, cli, caplog
):
    """models.head=distilled: train and merge build the cut draft and an EAGLE-3 head beside it
    (under head/, published under its own registry name); the bench measures both kinds; serve
    serves the one whose best fixed arm the bench measured faster and says which figures
    decided (the other kind when the figures are the other way round); both, the bandit
    choosing, before any bench of these weights."""
    import logging

    from pipeline.server import build_app
    from tests.conftest import copy_workspace

    art = copy_workspace(distilled_ws, tmp_path / "art")
    over = ["models.head=distilled", "distill.limit=100", "train.epochs=1", "train.head_epochs=1",
            "train.ttt_steps=2", "bench.prompts=8", "bench.fixed_arms=[draft:2,eagle:2]",
            "bandit.arms=[0,draft:2,eagle:2]"]  # fmt: skip
    sets = ["--config", "configs/ci.yaml", "--artifacts", str(art)]
    sets += [x for o in over for x in ("--set", o)]
    for stage in ("train", "merge"):
        r = cli(stage, *sets)
        assert r.returncode == 0, (stage, r.log[-2000:])
    ws, cfg = Workspace(art), load_config("configs/ci.yaml", over)
    head = ws.head().merged
    assert artifacts.is_verified(ws.merged) and artifacts.is_verified(head)
    assert json.loads((head / "config.json").read_text())["speculators_model_type"] == "eagle3"
    for name in ("phoenix-draft", "phoenix-draft-eagle3"):
        assert (art / "registry" / name / "latest.json").is_file(), name

    served = drafts.resolve_served(cfg, ws)  # no bench yet: both, the bandit chooses
    assert (served.spec, served.head) == (str(ws.merged), str(head)) and "no bench" in served.why

    r = cli("bench", *sets)
    assert r.returncode == 0, r.log[-2000:]
    results = json.loads(ws.bench_results.read_text())
    assert results["lossless"] and results["head_weights"] == artifacts.weights_id(head)
    rows = {q["mode"]: q for q in results["rows"] if q["draft"] == "distilled"}
    assert {"fixed_2", "eagle_2", "bandit"} <= rows.keys()

    def chosen(fast: str, slow: str) -> str:
        served = drafts.resolve_served(cfg, ws)
        assert served.head is None, served
        assert f"{rows[fast]['mode']} at {rows[fast]['speedup']:.2f}x" in served.why
        assert f"{rows[slow]['mode']} at {rows[slow]['speedup']:.2f}x" in served.why
        return served.spec

    head_won = rows["eagle_2"]["tokens_per_second"] > rows["fixed_2"]["tokens_per_second"]
    fast, slow = ("eagle_2", "fixed_2") if head_won else ("fixed_2", "eagle_2")
    assert chosen(fast, slow) == str(head if head_won else ws.merged)
    # The same weights with the figures the other way round: the other kind.
    rows[fast]["tokens_per_second"], rows[slow]["tokens_per_second"] = (
        rows[slow]["tokens_per_second"], rows[fast]["tokens_per_second"])  # fmt: skip
    ws.bench_results.write_text(json.dumps(results))
    assert chosen(slow, fast) == str(ws.merged if head_won else head)

    caplog.set_level(logging.INFO)
    with ServerThread(build_app(cfg, ws)) as s:  # serves what resolve_served chose, and says why
        wait_http(s.url + "/health", timeout=60)
        info = requests.get(s.url + "/v1/models", timeout=10).json()["data"][0]["metadata"]
        assert info["draft"]["spec"] == str(ws.merged if head_won else head)
        body = {"model": cfg.models.target, "max_tokens": 8,
                "messages": [{"role": "user", "content": "Write a function."}]}  # fmt: skip
        assert requests.post(s.url + CHAT, json=body, timeout=60).status_code == 200
        # The figures flip back: the other kind now wins, but a running server keeps its kind.
        rows[fast]["tokens_per_second"], rows[slow]["tokens_per_second"] = (
            rows[slow]["tokens_per_second"], rows[fast]["tokens_per_second"])  # fmt: skip
        ws.bench_results.write_text(json.dumps(results))
        out = requests.post(s.url + "/admin/reload-draft", timeout=60).json()
        assert out["reloaded"] is False and "restart the server" in out["reason"], out
        info = requests.get(s.url + "/v1/models", timeout=10).json()["data"][0]["metadata"]
        assert info["draft"]["spec"] == str(ws.merged if head_won else head)
    assert "the bench of" in caplog.text and "target-only" in caplog.text

    with pytest.raises(ConfigError, match="models.head=distilled"):
        load_config("configs/ci.yaml", ["models.head=distilled", "models.draft=eagle3"])


def test_the_bench_prior_takes_only_requests_of_the_served_weights(tmp_path):
    """`drafts.bench_prior` sums the bench's per-position counts per strategy (the rounds that
    could guess at a position: `eligible_per_position` where given, else every round), keeping
    draft rows only of the served draft's weights and eagle rows only of the served head's, for
    the target the bench ran; a bench of another target, or none, gives no prior."""
    import json

    from pipeline.artifacts import weights_id
    from pipeline.config import load_config
    from pipeline.drafts import ServedDraft, bench_prior
    from pipeline.workspace import Workspace

    ws = Workspace(tmp_path / "art")
    draft, head = tmp_path / "draft", tmp_path / "head"
    for d, text in ((draft, b"draft"), (head, b"head")):
        d.mkdir()
        (d / "model.safetensors").write_bytes(text)
        (d / "config.json").write_text("{}")
    cfg = load_config("configs/default.yaml", [])
    served = ServedDraft(str(draft), "merged", head=str(head))
    assert bench_prior(cfg, ws, served) is None  # no bench yet

    def req(arm, label, prop, acc, rounds=10, elig=None):
        return {"arm": arm, "draft": label, "guess_rounds": rounds, "rounds": rounds,
                "eligible_per_position": elig, "proposed_per_position": prop,
                "accepted_per_position": acc}  # fmt: skip

    results = {
        "target_model": cfg.models.target,
        "protocol": {"temperature": 0.0},
        "environment": {"date": "2026-12-05 10:00 UTC"},
        "draft_weights": {"distilled": weights_id(draft), "other": "elsewhere"},
        "head_weights": weights_id(head),
        "requests": [
            req("0", "none", [], []),
            req("ngram:4", "none", [4, 4, 3, 3], [2, 1, 1, 0]),
            req("draft:4", "distilled", [10, 10, 10, 10], [5, 3, 2, 1]),
            req("draft:4", "other", [10, 10, 10, 10], [9, 9, 9, 9]),  # another draft's weights
            req("eagle:2", "distilled", [10, 9], [6, 3]),
            # its budget's last rounds could not guess at positions 3 and 4
            req("eagle:4", "distilled", [10, 10, 9, 8], [7, 4, 2, 1], elig=[10, 10, 9, 9]),
        ],
    }
    ws.bench_results.parent.mkdir(parents=True)
    ws.bench_results.write_text(json.dumps(results))
    prior, where = bench_prior(cfg, ws, served)
    assert "2026-12-05 10:00 UTC" in where
    assert prior["draft"] == ([10.0] * 4, [10.0] * 4, [5.0, 3.0, 2.0, 1.0])
    assert prior["eagle"] == (
        [20.0, 20.0, 9.0, 9.0],
        [20.0, 19.0, 9.0, 8.0],
        [13.0, 7.0, 2.0, 1.0],
    )
    assert prior["ngram"][2] == [2.0, 1.0, 1.0, 0.0]
    # the head served alone: its rows count, the draft's do not
    prior, _ = bench_prior(cfg, ws, ServedDraft(str(head), "merged"))
    assert set(prior) == {
        "ngram"
    }  # head dir without an eagle3 config: taken as a draft of other weights
    results["target_model"] = "another/target"
    ws.bench_results.write_text(json.dumps(results))
    assert bench_prior(cfg, ws, served) is None
    assert (
        bench_prior(
            load_config("configs/default.yaml", ["bandit.bench_prior_rounds=0"]), ws, served
        )
        is None
    )
