import json
import shutil
import subprocess
import sys

import pytest

from pipeline.report import aggregate, bandit_summary, build_rows, percentile, position_acceptance
from tests.conftest import CI, copy_workspace, wait_http
from tests.servers import ServerThread


def rec(draft, mode, i, arm, lat, toks, prop=0, acc=0, rounds=1, warmup=False, pos=None):
    pos = pos or ([], [])
    return {
        "draft": draft,
        "mode": mode,
        "prompt_index": i,
        "arm": arm,
        "latency_s": lat,
        "output_tokens": toks,
        "proposed": prop,
        "accepted": acc,
        "rounds": rounds,
        "warmup": warmup,
        "draft_s": 0.0,
        "verify_s": lat,
        "proposed_per_position": pos[0],
        "accepted_per_position": pos[1],
    }


def test_percentile_matches_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 95) == 5
    assert abs(percentile(list(range(1, 101)), 95) - 95.05) < 1e-9


def test_rows_speedup_and_acceptance():
    records = [
        rec("none", "target", 0, 0, 1.0, 10),
        rec("none", "target", 1, 0, 1.0, 10),
        rec("base", "fixed_4", 0, 4, 0.5, 10, prop=8, acc=6, rounds=2),
        rec("base", "fixed_4", 1, 4, 0.5, 10, prop=8, acc=2, rounds=2),
    ]
    rows = build_rows(records)
    target, fixed = rows
    assert (
        target["acceptance_rate"] is None
        and target["speedup"] == 1.0
        and target["arm_counts"] is None
    )
    assert fixed["tokens_per_second"] == 20.0 and fixed["speedup"] == 2.0
    assert fixed["acceptance_rate"] == 0.5 and fixed["mean_accepted_length"] == 2.0
    assert aggregate(records[:2])["p95_latency_s"] == 1.0


def test_position_acceptance_and_bandit_summary():
    records = [rec("none", "target", i, 0, 1.0, 10) for i in range(4)]
    records += [
        rec("base", "fixed_2", i, 2, 0.5, 10, prop=6, acc=3, pos=([3, 3], [2, 1])) for i in range(4)
    ]
    records += [
        rec("base", "bandit", 0, 0, 1.0, 10, warmup=True),
        rec("base", "bandit", 1, 2, 0.5, 10, warmup=True),
        rec("base", "bandit", 2, 2, 0.5, 10),
        rec("base", "bandit", 3, 0, 1.0, 10),
    ]
    assert position_acceptance(records)["base"] == [2 / 3, 1 / 3]
    s = bandit_summary(records, "base")
    assert s["warmup_requests"] == 2 and s["post_warmup_requests"] == 2
    assert s["best_single_arm"] == 2 and s["post_warmup_arm_counts"] == {"0": 1, "2": 1}
    # Post-warm-up: 20 tokens in 1.5 s; best arm on the same prompts: 20 tokens in 1.0 s.
    assert (
        abs(s["ratio_to_best_arm"] - (20 / 1.5) / 20) < 1e-9 and s["share_choosing_best_arm"] == 0.5
    )


def test_bench_ci_end_to_end(merged_ws, tmp_path, cli):
    """bench's command-line end-to-end test on the session's merged workspace (`main()` in
    this process; `make test-slow` runs the whole demo as a real process)."""
    art = copy_workspace(merged_ws, tmp_path / "art")
    sets = ["--set", "bench.prompts=8", "--set", "bench.max_new_tokens=8"]
    sets += ["--set", "engine.draft_vocab=64"]  # both drafts guess among 64 recorded tokens
    r = cli("bench", *CI, "--artifacts", str(art), *sets)
    assert r.returncode == 0, r.log[-3000:]
    bench = art / "bench"
    results = json.loads((bench / "results.json").read_text())
    assert results["lossless"] is True and results["mismatches"] == []
    assert {"device", "dtype", "threads", "torch", "transformers", "hardware"} <= set(
        results["environment"]
    )
    modes = {(row["draft"], row["mode"]) for row in results["rows"]}
    assert modes == {
        ("none", "target"),
        ("none", "ngram_4"),
        ("base", "fixed_4"),
        ("base", "bandit"),
        ("distilled", "fixed_4"),
        ("distilled", "bandit"),
    }
    for row in results["rows"]:
        assert row["requests"] == 8 and row["tokens_per_second"] > 0
        assert {
            "mean_latency_s",
            "p50_latency_s",
            "p95_latency_s",
            "acceptance_rate",
            "mean_accepted_length",
            "speedup",
            "arm_counts",
        } <= set(row)
        assert (row["acceptance_rate"] is None) == (row["mode"] == "target")
        assert (row["arm_counts"] is not None) == (row["mode"] == "bandit")
        if row["mode"] == "bandit":
            assert sum(row["arm_counts"].values()) == 8
    assert len(results["requests"]) == 6 * 8
    assert set(results["position_acceptance"]) == {"base", "distilled", "ngram (no draft)"}
    # The distilled draft was trained on this target's answers: it must agree with it more often.
    gain = results["distillation_gain"]["fixed_4"]
    assert gain["distilled"] > gain["base"]
    engine = results["engine"]
    for draft in ("base", "distilled"):
        assert engine[draft]["head_tokens"] == 64 and 0 < engine[draft]["heldout_coverage"] <= 1
    report = (bench / "report.md").read_text()
    assert "draft head 64 tokens covering" in report
    assert "| fixed_4 |" in report and "one run" in report and "Lossless: **yes**" in report
    for png in ("tokens_per_second.png", "bandit_arms.png", "acceptance_by_position.png"):
        assert (bench / png).read_bytes()[:4] == b"\x89PNG"


def test_bench_base_only_and_missing_distilled(merged_ws, tmp_path, cli, monkeypatch):
    art = tmp_path / "art"
    shutil.copytree(merged_ws, art, ignore=shutil.ignore_patterns("merged", "bench"))
    r = cli("bench", *CI, "--artifacts", art)
    assert r.returncode == 2 and "--draft base" in r.log
    # A head that is not built yet fails before any model is loaded, not after every row.
    from pipeline import bench

    loads = []
    real_load = bench.models.load_pair
    monkeypatch.setattr(
        bench.models, "load_pair", lambda *a, **k: loads.append(a) or real_load(*a, **k)
    )
    r = cli("bench", *CI, "--artifacts", art, "--draft", "base", "--set", "models.head=distilled")
    assert r.returncode == 2 and "models.head=distilled: no merged head" in r.log
    assert loads == [] and not (art / "bench").exists()
    sets = ["bench.prompts=3", "bench.fixed_arms=[2,8]", "bench.seed_bandit=true"]
    r = cli(
        "bench",
        *CI,
        "--artifacts",
        art,
        "--draft",
        "base",
        *[x for s in sets for x in ("--set", s)],
    )
    assert r.returncode == 0, r.log[-2000:]
    results = json.loads((art / "bench" / "results.json").read_text())
    assert [(x["draft"], x["mode"]) for x in results["rows"]] == [
        ("none", "target"),
        ("base", "fixed_2"),
        ("base", "fixed_8"),
        ("base", "bandit"),
        ("base", "bandit_seed"),
    ]
    # The seed's policy ran on the same prompts with its own fresh state, and is reported.
    seed = results["bandit_seed"]["base"]
    assert seed["warmup_requests"] + seed["post_warmup_requests"] == 3
    assert seed["arms_in_order"] == results["bandit"]["base"]["arms_in_order"][:3]
    assert (
        "Seed bandit (base draft; the seed's policy)" in (art / "bench" / "report.md").read_text()
    )


def test_sampled_protocol_checks_the_outputs_in_distribution(merged_ws, tmp_path, monkeypatch):
    """bench.temperature > 0: every mode samples, the rows report tokens/s, speedup and
    acceptance, and the outputs are checked in distribution; an acceptance rule that always
    accepts fails the check (exit 4 through VerificationError)."""
    from pipeline import bench
    from pipeline.config import load_config
    from pipeline.errors import VerificationError
    from pipeline.speculative import batch
    from pipeline.speculative.sampling import draw
    from pipeline.telemetry import NullTelemetry
    from pipeline.workspace import Workspace

    art = tmp_path / "art"
    shutil.copytree(merged_ws, art, ignore=shutil.ignore_patterns("bench"))
    sets = ["bench.prompts=2", "bench.drafts=[base]", "bench.fixed_arms=[draft:2]",
            "bench.temperature=0.8", "bench.top_k=12", "bench.distribution_prompts=1",
            "bench.distribution_samples=300"]  # fmt: skip
    cfg = load_config("configs/ci.yaml", sets)
    bench.run(cfg, Workspace(art), NullTelemetry())
    results = json.loads((art / "bench" / "results.json").read_text())
    assert results["protocol"]["temperature"] == 0.8 and results["lossless"] is True
    d = results["distribution"]
    assert {(c["draft"], c["arm"]) for c in d["comparisons"]} == {("base", "draft:2")}
    assert d["min_p_value"] > d["threshold"] and d["comparisons"][0]["proposed"] > 0
    row = next(x for x in results["rows"] if x["mode"] == "fixed_2")
    assert row["acceptance_rate"] is not None and row["speedup"] > 0
    report = (art / "bench" / "report.md").read_text()
    assert "sampled at temperature 0.8" in report and "Lossless in distribution: **yes**" in report

    def always_accept(drafts, q, p, g):
        return len(drafts), draw(p[len(drafts)], g)

    monkeypatch.setattr(batch, "verify", always_accept)
    with pytest.raises(VerificationError, match="not distributed as the target"):
        bench.run(cfg, Workspace(art), NullTelemetry())
    assert "Lossless in distribution: **NO**" in (art / "bench" / "report.md").read_text()


def test_lossless_violation_is_reported_and_fails(merged_ws, tmp_path, monkeypatch):
    """Corrupt the speculative path on purpose: the bench must notice, list it and exit 4."""
    from pipeline import bench
    from pipeline.config import load_config
    from pipeline.errors import VerificationError
    from pipeline.speculative.batch import Row
    from pipeline.telemetry import NullTelemetry
    from pipeline.workspace import Workspace

    art = tmp_path / "art"
    shutil.copytree(merged_ws, art, ignore=shutil.ignore_patterns("bench"))
    real = Row.result

    def corrupt(self, reason, queued_s=0.0):  # a speculative row's last token, wrong
        res = real(self, reason, queued_s)
        if self.arm.k > 0 and res.token_ids:
            res.token_ids[-1] = (res.token_ids[-1] + 1) % 200
        return res

    monkeypatch.setattr(Row, "result", corrupt)
    cfg = load_config("configs/ci.yaml", ["bench.prompts=2", "bench.drafts=[base]"])
    with pytest.raises(VerificationError, match="lossless check failed"):
        bench.run(cfg, Workspace(art), NullTelemetry())
    results = json.loads((art / "bench" / "results.json").read_text())
    assert results["lossless"] is False and results["mismatches"]
    assert "Lossless: **NO**" in (art / "bench" / "report.md").read_text()


def test_serving_load_sweeps_every_mode_and_names_the_bandits_arms(
    merged_ws, tmp_path, monkeypatch
):
    """benchmarks.serving_load against a running server (--url): every mode at every
    concurrency, the same prompts, the bandit's arms per point, the table, JSON and plot."""
    import sys

    from benchmarks import serving_load
    from pipeline.config import load_config
    from pipeline.server import build_app
    from pipeline.workspace import Workspace

    art = copy_workspace(merged_ws, tmp_path / "art")
    app = build_app(load_config("configs/ci.yaml"), Workspace(art))
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        argv = ["serving_load", "--config", "configs/ci.yaml", "--artifacts", str(art),
                "--url", s.url, "--clients", "1", "3", "--requests", "6", "--tokens", "8",
                "--rounds", "2", "--modes", "target", "fixed:2", "bandit"]  # fmt: skip
        monkeypatch.setattr(sys, "argv", argv)
        serving_load.main()
    out = json.loads((art / "perf" / "serving_load.json").read_text())
    modes = out["phoenix"]["modes"]
    assert set(modes) == {"target", "fixed:2", "bandit"}
    for points in modes.values():
        assert set(points) == {"1", "3"}
        for p in points.values():
            assert p["succeeded"] == p["requests"] == 6 and p["errors"] == 0
            assert p["tokens_per_second"] > 0 and p["p95_latency_s"] >= p["p50_latency_s"] > 0
    assert modes["target"]["1"]["arms"] == {"0": 6} and modes["fixed:2"]["3"]["arms"] == {
        "draft:2": 6
    }
    assert sum(modes["bandit"]["3"]["arms"].values()) == 6  # what the bandit chose there
    assert modes["target"]["3"]["rounds"] == 2  # interleaved: 6 requests, 3 clients a round
    assert modes["fixed:2"]["1"]["acceptance"] is not None  # from the server's own counters
    assert (art / "perf" / "serving_load.png").stat().st_size > 0
    md = (art / "perf" / "serving_load.md").read_text()
    assert "x** target-only" in md and "| phoenix | bandit | 3 |" in md
    # Each ratio with its rounds: the paired comparison of the same slices.
    bandit, target = modes["bandit"]["3"], modes["target"]["3"]
    assert len(bandit["round_tokens_per_second"]) == 2
    ratios = serving_load.round_ratios(bandit, target)
    assert min(ratios) <= bandit["tokens_per_second"] / target["tokens_per_second"] <= max(ratios)
    assert f"rounds {min(ratios):.2f}-{max(ratios):.2f}x" in md


def test_every_load_point_gets_its_rounds():
    """A round needs a request per client: a point gets `--rounds` times its clients at least
    (16 clients, 4 rounds: 64 requests, not 32), never fewer than `--requests`."""
    from benchmarks.serving_load import requests_per_point

    assert requests_per_point(32, 4, 16) == 64 and requests_per_point(32, 4, 4) == 32
    assert requests_per_point(6, 1, 3) == 6 and requests_per_point(64, 8, 16) == 128


def test_a_ratio_interval_over_rounds_is_students_t_on_the_log_ratios():
    """Rounds 1.1 and 1/1.1: geometric mean 1.0, half-width t(1) * sd / sqrt(2) on the logs
    (sd = sqrt(2) * log 1.1): exp(+-12.706 * log 1.1). Identical rounds: a zero-width interval
    at their value; one round: none; the worded spread carries the interval."""
    import math

    from benchmarks import serving_load

    mean, lo, hi = serving_load.interval([1.1, 1 / 1.1])
    assert mean == pytest.approx(1.0)
    assert (lo, hi) == pytest.approx((1.1**-12.706, 1.1**12.706))
    assert serving_load.interval([0.9] * 4) == pytest.approx((0.9, 0.9, 0.9))
    assert serving_load.interval([1.2]) is None
    ratios = [0.86, 0.95, 0.92, 1.0]
    mean, lo, hi = serving_load.interval(ratios)
    logs = [math.log(r) for r in ratios]
    m = sum(logs) / 4
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 3)
    assert mean == pytest.approx(math.exp(m)) and hi == pytest.approx(math.exp(m + 3.182 * sd / 2))
    assert hi < 1.0 + 0.05 and lo < mean < hi
    assert serving_load.spread(ratios).endswith(f"mean {mean:.2f}x (95%: {lo:.2f}-{hi:.2f})")


@pytest.mark.slow
def test_performance_benchmark_reports_both_figures(merged_ws, tmp_path):
    """benchmarks.performance end to end on the tiny models (a smoke run: figures exist and
    add up; their values are this machine's business, shown in its output)."""
    from tests.conftest import ROOT

    art = tmp_path / "art"
    shutil.copytree(merged_ws, art, ignore=shutil.ignore_patterns("bench", "teacher"))
    cmd = [sys.executable, "-m", "benchmarks.performance", "--config", "configs/ci.yaml"]
    cmd += ["--artifacts", str(art), "--teacher-prompts", "3", "--bench-prompts", "12"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    perf = json.loads((art / "perf" / "performance.json").read_text())
    one, many = perf["teacher"]["one_at_a_time"], perf["teacher"]["batched"]
    assert one["max_batch"] == 1 and many["max_batch"] > 1
    assert one["answers"] == many["answers"] == 3
    assert one["completion_tokens"] == many["completion_tokens"]  # same prompts, same answers
    assert perf["teacher"]["speedup"] == many["answers_per_minute"] / one["answers_per_minute"]
    band = perf["bandit"]
    assert band["prompts"] == 12 and band["lossless"] is True
    assert band["configured"]["explore"] == "plausible"  # bandit.policy, ci.yaml's default
    # 12 prompts, one warm-up pull for each of the 5 default arms
    assert band["seed"]["explore"] == "seed" and band["seed"]["post_warmup_requests"] == 12 - 5
    md = (art / "perf" / "performance.md").read_text()
    assert md in r.stdout and "| 1. local teacher" in md and "| seed (policy: seed)" in md


def _runner_up_corruption(monkeypatch, target_model):
    """Make every speculative output take the target's second choice at its first token: a
    real near-tie if the margin allows it, else a mismatch."""
    import torch

    from pipeline.speculative.batch import Row

    real = Row.result

    def runner_up(self, reason, queued_s=0.0):
        res = real(self, reason, queued_s)
        if self.arm.k > 0 and self.max_tokens > 16 and res.token_ids:  # measured, not warm-ups
            with torch.inference_mode():
                logits = target_model(input_ids=torch.tensor([self.prompt])).logits[0, -1]
            res.token_ids[0] = int(logits.topk(2).indices[1])
        return res

    monkeypatch.setattr(Row, "result", runner_up)


@pytest.mark.parametrize("margin", [0.0, 1e6])
def test_a_difference_is_a_near_tie_only_within_the_margin(
    merged_ws, tmp_path, monkeypatch, margin
):
    """bf16 can round a verify pass unlike one-token steps: a difference where the target's own
    scores are within `bench.lossless_margin` is reported, not failed; any other fails."""
    from pipeline import bench, models
    from pipeline.config import load_config
    from pipeline.errors import VerificationError
    from pipeline.telemetry import NullTelemetry
    from pipeline.workspace import Workspace

    art = tmp_path / "art"
    shutil.copytree(merged_ws, art, ignore=shutil.ignore_patterns("bench"))
    sets = ["bench.prompts=2", "bench.drafts=[base]", "bench.max_new_tokens=24"]
    cfg = load_config("configs/ci.yaml", [*sets, f"bench.lossless_margin={margin}"])
    target = models.load_pair(cfg, Workspace(art), None).target
    _runner_up_corruption(monkeypatch, target)
    if margin == 0.0:
        with pytest.raises(VerificationError, match="lossless_margin"):
            bench.run(cfg, Workspace(art), NullTelemetry())
    else:
        bench.run(cfg, Workspace(art), NullTelemetry())
    results = json.loads((art / "bench" / "results.json").read_text())
    assert results["identical"] is False
    if margin == 0.0:
        assert results["lossless"] is False and not results["near_ties"]
    else:
        ties = results["near_ties"]
        assert results["lossless"] is True and len(ties) >= 2  # fixed_4's 2, + bandit's k>0
        assert all(t["position"] == 0 and t["margin"] > 0 for t in ties)
        assert f"Near-ties ({len(ties)}," in (art / "bench" / "report.md").read_text()


def test_every_mode_is_warmed_up_first_then_the_modes_take_turns_prompt_by_prompt(
    merged_ws, tmp_path, monkeypatch
):
    """Warm-ups (16 tokens) for every run before any measured request; then prompt 0 through
    target, fixed_2 and the bandit, prompt 1 in the reverse order (drift falls on every mode
    alike: `bench.interleave`)."""
    from pipeline import bench
    from pipeline.config import load_config
    from pipeline.speculative.batch import Row
    from pipeline.telemetry import NullTelemetry
    from pipeline.workspace import Workspace

    calls = []
    real = Row.result

    def record(self, reason, queued_s=0.0):  # every request, as it finishes (one at a time)
        calls.append((self.arm.k, self.max_tokens))
        return real(self, reason, queued_s)

    monkeypatch.setattr(Row, "result", record)
    art = tmp_path / "art"
    shutil.copytree(merged_ws, art, ignore=shutil.ignore_patterns("bench"))
    sets = ["bench.prompts=2", "bench.drafts=[base]", "bench.fixed_arms=[2]"]
    bench.run(load_config("configs/ci.yaml", sets), Workspace(art), NullTelemetry())
    warm, n = 16, 32  # warm-ups are 16 tokens; ci.yaml measures 32
    # target, fixed_2, then every bandit arm (0, draft:2, draft:4, ngram:2, ngram:4)
    assert calls[:7] == [(0, warm), (2, warm)] + [(a, warm) for a in (0, 2, 4, 2, 4)]
    assert calls[7:9] == [(0, n), (2, n)] and calls[9][1] == n  # prompt 0: target, fixed_2, bandit
    assert calls[10][1] == n and calls[11:] == [(2, n), (0, n)]  # prompt 1: the other way
    assert len(calls) == 13


@pytest.mark.slow  # a script smoke run (7 s): make test-slow
def test_gpu_script_runs_on_the_cpu(tmp_path, mbpp_path):
    """benchmarks/gpu.sh --device cpu --quick: the GPU evidence script's own path, end to end
    (setup found, the engine benchmark splitting its workspace and timing generation eager and
    compiled, and the target drafting for itself), on the tiny CI pair."""
    out = tmp_path / "evidence"
    r = subprocess.run(
        ["bash", "benchmarks/gpu.sh", "--device", "cpu", "--quick", "--out", str(out),
         "--config", "configs/ci.yaml", "--merged", "none", "--set", "engine.backend=eager"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    summary = (out / "summary.txt").read_text()
    assert r.returncode == 0, summary + r.stderr[-2000:]
    assert "engine: exit 0" in summary, summary
    assert (out / "artifacts" / "data" / "test.jsonl").is_file()  # it split MBPP itself
    assert "bench: skipped" in summary
    engine = json.loads((out / "engine.json").read_text())
    rows = engine["generate"]
    assert set(rows) == {"target-only eager", "target-only compiled", "self-draft fixed_2 compiled"}
    assert all(r["identical_to_target_only"] and r["tokens_per_second"] > 0 for r in rows.values())
    assert rows["self-draft fixed_2 compiled"]["acceptance"] == 1.0  # every guess its own
    assert "| target-only compiled |" in (out / "engine.md").read_text()


def test_a_benched_draft_names_its_own_weights(tmp_path):
    """The report's draft header names what ran: the base spec, the merged draft, or the
    directory given (an exported EAGLE-3 head is not the workspace's merged draft)."""
    from pipeline.bench import draft_spec
    from pipeline.config import load_config
    from pipeline.workspace import Workspace

    cfg, ws = load_config("configs/ci.yaml", []), Workspace(tmp_path)
    head = str(tmp_path / "perf" / "eagle3" / "h" / "head")
    assert draft_spec(cfg, ws, "base") == cfg.models.draft
    assert draft_spec(cfg, ws, "distilled") == str(ws.merged)
    assert draft_spec(cfg, ws, head) == head


def test_serving_load_names_a_mode_the_server_refuses(merged_ws, tmp_path, monkeypatch):
    """A mode outside the server's configured arms gets 400 for every request: the sweep stops
    with the mode and the server's own message (it crashed formatting an empty point)."""
    import sys

    from benchmarks import serving_load
    from pipeline.config import load_config
    from pipeline.server import build_app
    from pipeline.workspace import Workspace

    art = copy_workspace(merged_ws, tmp_path / "art")
    app = build_app(load_config("configs/ci.yaml"), Workspace(art))
    with ServerThread(app) as s:
        wait_http(s.url + "/health")
        argv = ["serving_load", "--config", "configs/ci.yaml", "--artifacts", str(art),
                "--url", s.url, "--clients", "1", "--requests", "2", "--tokens", "4",
                "--rounds", "1", "--modes", "target", "ngram:7"]  # fmt: skip
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as exc:
            serving_load.main()
    message = str(exc.value)
    assert "mode ngram:7 at 1 client(s): all 2 requests failed" in message
    assert "not one of the configured arms" in message


def test_the_verdict_says_where_the_bandit_served_as_target_only():
    """A point where no bandit row guessed is target-only's computation: its line says so (the
    ratio is the run's drift); a point where rows guessed does not."""
    from benchmarks.serving_load import verdict

    def point(tps, share):
        return {"tokens_per_second": tps, "round_tokens_per_second": [tps, tps],
                "arms": {"eagle:2": 4}, "guessing_steps_share": share,
                "p95_latency_s": 1.0}  # fmt: skip

    modes = {"target": {4: point(100.0, None), 16: point(200.0, None)},
             "bandit": {4: point(110.0, 0.9), 16: point(198.0, 0.0)}}  # fmt: skip
    lines = verdict({"modes": modes}, {}, [4, 16])
    assert "no bandit row guessed" not in lines[0] and "**1.10x** target-only" in lines[0]
    assert "no bandit row guessed a token here" in lines[1] and "**0.99x**" in lines[1]
    modes["bandit"][4]["guessing_steps_share"] = None  # no counters: not known to be plain
    assert "no bandit row guessed" not in verdict({"modes": modes}, {}, [4])[0]


def test_bench_measures_every_prompt_set_and_reports_each(merged_ws, tmp_path, tiny_pair):
    """bench.sets: the held-out prompts (rendered as today: one user message) and a prompts file,
    each through the protocol and its own lossless check; results.json keeps the first set's
    figures at the top and every set's under "sets"; a report table per set and the plot."""
    from pipeline import bench, models
    from pipeline.config import load_config
    from pipeline.telemetry import NullTelemetry
    from pipeline.workspace import Workspace, read_jsonl

    art = tmp_path / "art"
    shutil.copytree(merged_ws, art, ignore=shutil.ignore_patterns("bench"))
    extra = tmp_path / "mine.jsonl"
    extra.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def add(a, b):", "Hi")))
    sets = ["bench.prompts=2", "bench.drafts=[base]", "bench.fixed_arms=[2]",
            "bench.max_new_tokens=8", "bench.warmup_requests=0", f"bench.sets=[heldout,{extra}]"]  # fmt: skip
    cfg = load_config("configs/ci.yaml", sets)
    bench.run(cfg, Workspace(art), NullTelemetry())
    results = json.loads((art / "bench" / "results.json").read_text())
    assert list(results["sets"]) == ["heldout", str(extra)] and results["lossless"] is True
    held, mine = results["sets"]["heldout"], results["sets"][str(extra)]
    assert results["rows"] == held["rows"] and results["requests"] == held["requests"]
    assert held["protocol"]["prompts"] == mine["protocol"]["prompts"] == 2
    for s in (held, mine):
        modes = [(r["draft"], r["mode"]) for r in s["rows"]]
        assert modes == [("none", "target"), ("base", "fixed_2"), ("base", "bandit")]
        fixed = next(r for r in s["rows"] if r["mode"] == "fixed_2")
        assert len(fixed["acceptance_per_position"]) == 2
        assert fixed["tokens_per_target_pass"] == 1 + fixed["mean_accepted_length"]
    # The held-out MBPP rows render to exactly the ids a single user message gives.
    tok = models.load_tokenizer(tiny_pair[0])
    rows = read_jsonl(Workspace(art).test_file)[:2]
    want = [models.user_prompt_ids(tok, r["prompt"], cfg.template_kwargs()) for r in rows]
    assert bench.prompt_ids(cfg, tok, rows) == want
    assert [q["prompt_tokens"] for q in held["requests"][:2]] == [len(w) for w in want]
    report = (art / "bench" / "report.md").read_text()
    assert "### heldout (2 prompts; lossless: **yes**)" in report
    assert f"### {extra} (2 prompts; lossless: **yes**)" in report
    assert "| base | fixed_2 |" in report and "tokens per target pass" in report
    assert (art / "bench" / "acceptance_by_set.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_url_sends_every_set_as_the_bench_renders_it(tmp_path):
    """bench --url over bench.sets: each row's request is its `data.bench_messages` (an MBPP row:
    its one user message), and remote.json keeps the first set's figures on top, each set's
    under "sets"."""
    from pipeline import loadtest
    from pipeline.config import load_config
    from pipeline.workspace import Workspace
    from tests.fake_openai import FakeOpenAI

    ws = Workspace(tmp_path / "art")
    ws.test_file.parent.mkdir(parents=True)
    ws.test_file.write_text("".join(json.dumps({"task_id": i, "prompt": f"task {i}"}) + "\n"
                                    for i in range(3)))  # fmt: skip
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"prompt": "hello"}) + "\n")
    cfg = load_config("configs/ci.yaml", ["bench.prompts=2", f"bench.sets=[heldout,{mine}]"])
    with FakeOpenAI() as fake:
        summary = loadtest.run_remote(cfg, ws, fake.url)
    sent = [b["messages"] for b in fake.chat_bodies]
    assert sent == [[{"role": "user", "content": p}] for p in ("task 0", "task 1", "hello")]
    remote = json.loads((ws.bench / "remote.json").read_text())
    assert list(remote["sets"]) == ["heldout", str(mine)] == list(summary["sets"])
    assert [s["prompts"] for s in remote["sets"].values()] == [2, 1]
    assert remote["requests"] == remote["sets"]["heldout"]["requests"] == 2
