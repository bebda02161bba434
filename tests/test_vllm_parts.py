"""vLLM as a part, without vLLM: the schedule Phoenix learns, the counters it reads, and what a
user sees when vLLM is missing or will not start (a stand-in program that fails on purpose).
The tests against real vLLM servers are tests/test_vllm.py (`make test-vllm`)."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline import loadtest, vllm, vllm_tune
from pipeline.errors import ConfigError
from pipeline.metrics import Metrics
from pipeline.serving.heap import GCPauses

VLLM_EXPOSITION = textwrap.dedent(
    """\
    # HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
    # TYPE vllm:spec_decode_num_drafts_total counter
    vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
    vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 10.0
    # TYPE vllm:spec_decode_num_draft_tokens_total counter
    vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 80.0
    # TYPE vllm:spec_decode_num_accepted_tokens_total counter
    vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
    # TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 15.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 9.0
    # TYPE vllm:num_requests_running gauge
    vllm:num_requests_running{engine="0",model_name="m"} 0.0
    """
)


def test_the_schedule_takes_the_best_k_per_batch_size_range():
    table = {
        0: {1: 17.1, 2: 30.0, 4: 52.0, 8: 94.7, 16: 120.0},
        2: {1: 20.6, 2: 33.0, 4: 50.0, 8: 58.7, 16: 60.0},
        4: {1: 15.6, 2: 34.0, 4: 45.0, 8: 44.5, 16: 50.0},
    }
    schedule = vllm_tune.best_schedule(table)
    assert schedule == [[1, 1, 2], [2, 3, 4], [4, 1024, 0]]
    assert [vllm_tune.k_for(schedule, b) for b in (1, 2, 3, 4, 9, 5000)] == [2, 4, 4, 0, 0, 0]
    tie = {0: {1: 5.0}, 2: {1: 5.0}}
    assert vllm_tune.best_schedule(tie) == [[1, 1024, 0]]  # a tie: the smaller
    ngram = {0: table[0], 4: {1: 18.0, 2: 31.0, 4: 50.0, 8: 60.0, 16: 80.0}}
    assert vllm_tune.choose_method({"draft": table, "ngram": ngram}) == ("draft", schedule)
    slow = {k: {c: t / 2 for c, t in row.items()} for k, row in table.items() if k}
    assert vllm_tune.choose_method({"draft": {0: table[0], **slow}, "ngram": ngram}) == (
        "ngram",
        [[1, 3, 4], [4, 1024, 0]],
    )
    spec = vllm.speculative_config("draft_model", "d", 4, schedule)
    assert spec["num_speculative_tokens"] == 4 and spec["num_speculative_tokens_per_batch_size"]
    assert vllm.speculative_config("draft_model", "d", 0) is None
    assert vllm.speculative_config("ngram", None, 4)["method"] == "ngram"
    lookup = vllm.speculative_config("ngram", None, 2, [[1, 1, 2], [2, 1024, 0]])
    assert lookup["num_speculative_tokens_per_batch_size"] == [[1, 1, 2], [2, 1024, 0]]


def draft_with(folder: Path, **keys) -> str:
    """A draft directory holding only a config.json: a 300-token vocabulary plus `keys`."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 300, **keys}))
    return str(folder)


def test_a_parallel_arm_is_vllms_draft_model_drafting_in_parallel(tmp_path):
    """pard:K -> vLLM's draft_model with `parallel_drafting`, the mask id read where vLLM 0.32
    reads it (`pard_token`, else `ptd_token_id`); draft:K and ngram:K are as before."""
    draft = draft_with(tmp_path / "pard", pard_token=16)
    assert vllm.arm_config("pard", draft, 4) == {
        "method": "draft_model", "model": draft, "num_speculative_tokens": 4,
        "parallel_drafting": True,
    }  # fmt: skip
    assert vllm.arm_config("draft", draft, 2) == vllm.speculative_config("draft_model", draft, 2)
    assert "parallel_drafting" not in vllm.arm_config("draft", draft, 2)
    assert vllm.arm_config("pard", draft, 0) is None and vllm.arm_config(None, draft, 0) is None
    assert vllm.arm_config("ngram", None, 3)["method"] == "ngram"
    scheduled = vllm.arm_config("pard", draft, 4, [[1, 3, 4], [4, 1024, 0]])
    assert scheduled["parallel_drafting"] and scheduled["num_speculative_tokens_per_batch_size"]
    assert vllm.mask_token(draft) == 16 and vllm.parallel_draft(draft)
    ptd = draft_with(tmp_path / "ptd", ptd_token_id=299)
    assert vllm.mask_token(ptd) == 299 and vllm.arm_config("pard", ptd, 2)["parallel_drafting"]
    same = draft_with(tmp_path / "same", mask_token_id=16, pard_token=16)
    assert vllm.mask_token(same) == 16  # vLLM reads mask_token_id first: the same id
    assert [vllm.parallel_k(m) for m in ("pard:1", "pard:16", "bandit", "fixed:4", None)] == [
        1, 16, None, None, None,
    ]  # fmt: skip


def test_tune_vllm_measures_a_pard_draft_also_drafting_in_parallel(tmp_path):
    """tune-vllm's arms: a draft naming a mask token also as pard:K at each k of
    vllm.tune_ks; one without, as before; a broken one refused before any vLLM starts."""
    from pipeline.config import load_config

    cfg = load_config("configs/ci.yaml", ["vllm.tune_ks=[0,2,4]", "vllm.tune_ngram_ks=[3]"])
    pard = draft_with(tmp_path / "pard", pard_token=16)
    arms = vllm_tune.tune_arms(cfg, pard)
    assert [a[0] for a in arms] == ["0", "draft:2", "draft:4", "pard:2", "pard:4", "ngram:3"]
    assert arms[0][3] is None and arms[4][3] == vllm.arm_config("pard", pard, 4)
    assert "parallel_drafting" not in arms[2][3] and arms[4][3]["parallel_drafting"]
    plain = draft_with(tmp_path / "plain")
    assert [a[0] for a in vllm_tune.tune_arms(cfg, plain)] == ["0", "draft:2", "draft:4", "ngram:3"]
    other = draft_with(tmp_path / "other", mask_token_id=5, pard_token=16)
    with pytest.raises(ConfigError, match="vLLM reads the mask id from `mask_token_id`"):
        vllm_tune.tune_arms(cfg, other)


def test_a_draft_vllm_cannot_draft_in_parallel_with_is_refused_naming_it(tmp_path):
    plain = draft_with(tmp_path / "plain")
    assert not vllm.parallel_draft(plain) and not vllm.parallel_draft(str(tmp_path / "none"))
    assert vllm.arm_config("draft", plain, 2) is not None  # sequential drafting needs none
    cases = [
        (plain, ["has no mask token", "`pard_token`", plain]),
        (draft_with(tmp_path / "big", pard_token=300), ["`pard_token` = 300", "vocab_size=300"]),
        (draft_with(tmp_path / "neg", ptd_token_id=-1), ["`ptd_token_id` = -1"]),
        (draft_with(tmp_path / "text", pard_token="<mask>"), ["'<mask>' is not a token id"]),
        (draft_with(tmp_path / "other", mask_token_id=5, pard_token=16),
         ["vLLM reads the mask id from `mask_token_id` = 5 before `pard_token` = 16"]),
        (draft_with(tmp_path / "dflash", dflash_config={"mask_token_id": 7}, pard_token=16),
         ["`dflash_config.mask_token_id` = 7"]),
        (str(tmp_path / "missing"), ["cannot be read"]),
    ]  # fmt: skip
    for draft, words in cases:
        with pytest.raises(ConfigError) as err:
            vllm.arm_config("pard", draft, 2)
        assert err.value.exit_code == 2 and draft in str(err.value)
        assert all(w in str(err.value) for w in words), str(err.value)
    for bad in ("pard:0", "pard:17", "pard:x", "pard:"):
        with pytest.raises(ConfigError, match="pard:K with K an integer in 1..16"):
            vllm.parallel_k(bad)


def test_serve_engine_vllm_pard_without_a_mask_token_exits_2_before_vllm_starts(cli, tmp_path):
    """`serve --engine vllm --mode pard:2` with the base draft (a cut of the target: no
    `pard_token`): exit 2 naming the draft directory and the key; vLLM (a stand-in that would
    print "loading the model") never runs."""
    python = stand_in_vllm(tmp_path)
    art = tmp_path / "art"
    r = cli("serve", "--engine", "vllm", "--config", "configs/ci.yaml", "--artifacts", art,
            "--set", f"vllm.python={python}", "--port", "0", "--mode", "pard:2")  # fmt: skip
    assert r.returncode == 2, r.log
    draft = next((art / "cache").rglob("cut-*"))  # the materialised base draft
    assert f"draft {draft} has no mask token" in r.log and "`pard_token`" in r.log
    assert "loading the model" not in r.log and not (art / "vllm" / "serve.log").exists()
    r = cli("serve", "--engine", "vllm", "--config", "configs/ci.yaml", "--artifacts", art,
            "--set", f"vllm.python={python}", "--port", "0", "--mode", "pard:99")  # fmt: skip
    assert r.returncode == 2 and "pard:K with K an integer in 1..16" in r.log


def test_serving_load_checks_its_vllm_arms_before_anything_runs(tmp_path):
    """`serving_load --vllm 0 draft:2 pard:2`: each arm's --speculative-config, built before
    Phoenix's sweep; a pard arm on a draft without a mask token stops it there, naming both."""
    import argparse

    from benchmarks import serving_load
    from pipeline.config import load_config
    from pipeline.workspace import Workspace

    cfg, ws = load_config("configs/ci.yaml", []), Workspace(tmp_path / "art")
    arms = serving_load.vllm_arms(argparse.Namespace(vllm=["0", "draft:2"]), cfg, ws)
    draft = arms["specs"]["draft:2"]["model"]
    assert arms["specs"] == {"0": None, "draft:2": vllm.speculative_config("draft_model", draft, 2)}
    with pytest.raises(SystemExit) as stop:
        serving_load.vllm_arms(argparse.Namespace(vllm=["0", "pard:2"]), cfg, ws)
    assert str(stop.value).startswith(f"--vllm pard:2: draft {draft} has no mask token")
    config = json.loads((Path(draft) / "config.json").read_text())
    (Path(draft) / "config.json").write_text(json.dumps({**config, "pard_token": 3}))
    arms = serving_load.vllm_arms(argparse.Namespace(vllm=["pard:2"]), cfg, ws)
    assert arms["specs"]["pard:2"]["parallel_drafting"] is True


def test_a_win_within_the_margin_is_not_worth_speculating():
    table = {0: {1: 36.2, 2: 66.6, 8: 158.5}, 1: {1: 35.9, 2: 68.5, 8: 172.0}}
    assert vllm_tune.best_schedule(table) == [[1, 1, 0], [2, 1024, 1]]
    assert vllm_tune.best_schedule(table, margin=0.03) == [[1, 7, 0], [8, 1024, 1]]  # 68.5: +2.9%
    assert vllm_tune.best_schedule(table, margin=0.10) == [[1, 1024, 0]]


def test_the_verdict_compares_the_schedule_with_every_fixed_arm():
    def arm(*tps):
        return {"points": {c: {"tokens_per_second": t} for c, t in zip((1, 8), tps, strict=True)}}

    results = {"arms": {"0": arm(36.0, 160.0), "ngram:2": arm(40.0, 130.0)}}
    assert vllm_tune.schedule_verdict(results) is None  # no schedule sweep yet
    results["arms"]["schedule"] = arm(42.0, 152.0)
    verdict = vllm_tune.schedule_verdict(results)
    assert verdict == {"vs_best_fixed": 152.0 / 160.0, "vs_no_speculation": 152.0 / 160.0}
    results["arms"]["schedule"] = arm(38.0, 161.0)
    assert vllm_tune.schedule_verdict(results)["vs_best_fixed"] == 38.0 / 40.0


def test_spec_counters_read_vllm_and_phoenix_names_alike():
    got = loadtest.spec_counters(VLLM_EXPOSITION)
    assert got == {"drafts": 20.0, "draft_tokens": 80.0, "accepted": 30.0,
                   "per_pos": {0: 15.0, 1: 9.0}}  # fmt: skip
    acc = loadtest.acceptance_between(None, got)
    assert acc["acceptance"] == 30 / 80 and acc["mean_acceptance_length"] == 1 + 30 / 20
    assert acc["per_position"] == [15 / 20, 9 / 20]
    m = Metrics(queue_depth=lambda: 0, running=lambda: 0)
    m.num_drafts.inc(4)
    m.num_draft_tokens.inc(8)
    m.num_accepted_tokens.inc(5)
    m.accepted_per_pos.labels(position="0").inc(3)
    mine = loadtest.spec_counters(m.exposition().decode())
    assert mine == {"drafts": 4.0, "draft_tokens": 8.0, "accepted": 5.0, "per_pos": {0: 3.0}}
    assert loadtest.acceptance_between(got, got)["acceptance"] is None  # nothing moved
    assert loadtest.spec_counters("# nothing\n") is None
    # Phoenix's full garbage collections (`serving.heap`), timed off the collector's thread.
    pauses = GCPauses()
    m = Metrics(queue_depth=lambda: 0, running=lambda: 0, gc_pauses=pauses)
    m.num_drafts.inc(1)
    for generation, seconds in [(2, 0.25), *[(0, 0.001)] * 20_000, (2, 0.5)]:
        pauses._callback("start", {"generation": generation})
        pauses._start -= seconds
        pauses._callback("stop", {"generation": generation})
    got = loadtest.spec_counters(m.exposition().decode())
    # Full collections are kept apart: 20,000 young ones between two reads do not drop them.
    assert got["gc_full"] == 2 and abs(got["gc_full_s"] - 0.75) < 0.01
    assert not pauses.young and not pauses.full


def test_rounds_of_a_point_pool_their_requests_clocks_and_counters():
    """An interleaved point (`loadtest.interleaved`) pools its rounds: tokens over the summed
    wall clocks, latencies together, the counters' moves added (not the last reading's)."""

    def req(tokens, latency, arm="ngram:2", rows=2, rounds=10, guessed=5):
        return {"status": 200, "tokens": tokens, "latency_s": latency, "ttft_s": 0.1,
                "arm": arm, "why": "exploited", "rows": rows, "rounds": rounds,
                "guess_rounds": guessed}  # fmt: skip

    def counters(drafts, tokens, accepted, first):
        return {"drafts": drafts, "draft_tokens": tokens, "accepted": accepted,
                "per_pos": {0: first}}  # fmt: skip

    one = {"clients": 2, "results": [req(10, 1.0), req(10, 2.0)], "wall_s": 2.0,
           "before": counters(0, 0, 0, 0), "after": counters(4, 8, 4, 3)}  # fmt: skip
    two = {"clients": 2, "results": [req(20, 3.0, "0"), req(20, 4.0)], "wall_s": 4.0,
           "before": counters(100, 200, 50, 40), "after": counters(104, 216, 54, 42)}  # fmt: skip
    p = loadtest.summarise([one, two])
    assert p["requests"] == p["succeeded"] == 4 and p["output_tokens"] == 60
    assert p["tokens_per_second"] == 60 / 6.0
    assert p["round_tokens_per_second"] == [20 / 2.0, 40 / 4.0]  # each round's own
    assert p["acceptance"] == 8 / 24 and p["per_position"] == [5 / 8]
    assert p["arms"] == {"0": 1, "ngram:2": 3} and p["speculated_because"] == {"exploited": 3}
    assert p["p95_latency_s"] > p["p50_latency_s"]
    # The guessing requests (arm 0 not among them): the rows they joined, steps they guessed.
    one["results"][0].update(rows=4, guess_rounds=0)
    p = loadtest.summarise([one, two])
    assert p["guessing_joined_rows"] == (4 + 2 + 2) / 3
    assert p["guessing_steps_share"] == (0 + 5 + 5) / 30
    assert p["guessing_cap"] is None  # no positions reported
    two["results"][1]["eligible_per_position"] = [5, 3]  # capped at 1 in 2 of its 5 steps
    assert loadtest.summarise([one, two])["guessing_cap"] == 8 / 5
    assert p["gc_full"] is None  # no collections reported
    one["after"]["gc_full"], one["after"]["gc_full_s"] = 1.0, 0.5
    two["before"]["gc_full"], two["before"]["gc_full_s"] = 1.0, 0.5
    two["after"]["gc_full"], two["after"]["gc_full_s"] = 3.0, 0.75
    p = loadtest.summarise([one, two])
    assert p["gc_full"] == 1 + 2 and p["gc_full_s"] == 0.5 + 0.25
    one["after"] = None  # a server without counters
    assert loadtest.summarise([one, two])["acceptance"] is None


def test_without_vllm_tune_and_serve_exit_2_saying_make_vllm(cli, tmp_path):
    for stage in (("tune-vllm",), ("serve", "--engine", "vllm")):
        r = cli(*stage, "--config", "configs/ci.yaml", "--artifacts", tmp_path,
                "--set", f"vllm.python={sys.executable}")  # fmt: skip
        assert r.returncode == 2, r.log
        assert "make vllm" in r.log and "has no vllm module" in r.log
    r = cli("tune-vllm", "--config", "configs/ci.yaml", "--artifacts", tmp_path,
            "--set", f"vllm.python={tmp_path / 'nowhere' / 'python'}")  # fmt: skip
    assert r.returncode == 2 and "make vllm" in r.log


def test_a_vllm_that_fails_to_start_is_quoted_and_leaves_no_process(cli, tmp_path, mbpp_path):
    """A stand-in `vllm` whose server starts a child, prints, and dies: exit 1 with its last
    lines, and nothing of its process group left."""
    python = stand_in_vllm(tmp_path)
    art = tmp_path / "art"
    assert cli("split", "--config", "configs/ci.yaml", "--artifacts", art).returncode == 0
    r = cli("serve", "--engine", "vllm", "--config", "configs/ci.yaml", "--artifacts", art,
            "--set", f"vllm.python={python}", "--port", "0", "--mode", "target")  # fmt: skip
    assert r.returncode == 1, r.log
    assert "vLLM exited with 3 before it was ready" in r.log
    assert "another tokenizer than the target" in r.log  # vLLM's own words, quoted
    pid = int(r.log.split("engine core pid ")[1].split()[0])
    assert not running(pid), "vLLM's child process outlived it"


def stand_in_vllm(tmp_path: Path) -> Path:
    """An interpreter whose `vllm.entrypoints.openai.api_server` starts a child, prints (its
    first line: "INFO loading the model") and exits 3."""
    fake = tmp_path / "fake"
    server = fake / "vllm" / "entrypoints" / "openai"
    server.mkdir(parents=True)
    for d in (fake / "vllm", fake / "vllm" / "entrypoints", server):
        (d / "__init__.py").write_text("")
    (server / "api_server.py").write_text(
        textwrap.dedent(
            """\
            import subprocess, sys, time
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            print("INFO loading the model", flush=True)
            print(f"engine core pid {child.pid}", flush=True)
            time.sleep(1)
            print("ValueError: this draft has another tokenizer than the target", flush=True)
            sys.exit(3)
            """
        )
    )
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def running(pid: int, wait_s: float = 5.0) -> bool:
    """Whether `pid` still runs (a zombie waiting for its reaper does not)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.05)
    return True
