"""The batching local teacher and the bandit against their goals, from one run on this machine.

    .venv/bin/python -m benchmarks.performance [--config configs/default.yaml]
        [--artifacts artifacts] [--teacher-prompts 16] [--bench-prompts N] [--parts teacher bandit]
    (or: make perf; needs `make merge` first: the bandit part benches the distilled draft)

1. Batching local teacher: distil the same training prompts twice, each into a fresh workspace
   under <artifacts>/perf/: one at a time (server.max_batch=1) and batched (the config's
   server.max_batch); local-teacher start-up is inside both. Answers/min come from each distill
   summary. Goal: >= 3x.
2. Bandit: the bench with the distilled draft on the held-out prompts (all of them by default):
   every single arm, the configured bandit, and the seed's (policy: seed). Goal: the
   configured bandit's post-warm-up tokens/s >= 0.95x the best single arm on the same prompts.
(The speculative loop's own overhead, the target drafting for itself, is `benchmarks.engine`'s
generate part.)

Writes <artifacts>/perf/performance.json and performance.md (the bench's own report and plots
in <artifacts>/perf/bench/).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from benchmarks.common import environment, header, run_stage, write_results
from pipeline import bench
from pipeline.config import load_config
from pipeline.telemetry import NullTelemetry
from pipeline.workspace import Workspace

GOALS = {"teacher_speedup": 3.0, "bandit_ratio": 0.95}


class _PerfWorkspace(Workspace):
    """The user's workspace (split, merged draft, model cache), with the bench writing elsewhere."""

    def __init__(self, root: Path, out: Path):
        super().__init__(root)
        self._out = out

    @property
    def bench(self) -> Path:
        return self._out


def _distill(args, out: Path, n: int, overrides: list[str]) -> dict:
    sets = [f"distill.limit={n}", *overrides]
    cache = Path(args.artifacts) / "cache"
    for stage in ("split", "distill"):
        run_stage(stage, args.config, out, sets, out / "performance.log", cache)
    return json.loads((Workspace(out).teacher / "summary.json").read_text())


def part_teacher(args, cfg, perf: Path) -> dict:
    runs = {}
    for name, batch in (("one_at_a_time", 1), ("batched", cfg.server.max_batch)):
        out = perf / f"teacher-{name}"
        if out.exists():
            shutil.rmtree(out)  # a fresh workspace: every prompt is answered in this run
        s = _distill(args, out, args.teacher_prompts, [f"server.max_batch={batch}"])
        runs[name] = {
            "max_batch": batch,
            "answers": s["answered_this_run"],
            "elapsed_s": s["elapsed_s_this_run"],
            "answers_per_minute": s["answers_per_minute_this_run"],
            "tokens_per_second": s["tokens_per_second_this_run"],
            "completion_tokens": s["completion_tokens"],
        }
    one, many = runs["one_at_a_time"], runs["batched"]
    return {**runs, "speedup": many["answers_per_minute"] / one["answers_per_minute"]}


def part_bandit(args, cfg, ws: Workspace, perf: Path) -> dict:
    arms = [a for a in cfg.bandit.arms if a != "0"]  # every arm alone (target always runs)
    bcfg = load_config(
        args.config,
        [
            f"bench.prompts={args.bench_prompts if args.bench_prompts else 'null'}",
            "bench.drafts=[distilled]",
            f"bench.fixed_arms={json.dumps(arms)}",
            "bench.seed_bandit=true",
        ],
    )
    bench_ws = _PerfWorkspace(ws.root, perf / "bench")
    bench.run(bcfg, bench_ws, NullTelemetry())
    results = json.loads(bench_ws.bench_results.read_text())
    keep = (
        "post_warmup_requests",
        "post_warmup_arm_counts",
        "post_warmup_tokens_per_second",
        "best_single_arm",
        "single_arm_tokens_per_second_same_prompts",
        "ratio_to_best_arm",
        "share_choosing_best_arm",
    )
    return {
        "prompts": results["protocol"]["prompts"],
        "max_new_tokens": results["protocol"]["max_new_tokens"],
        "lossless": results["lossless"],
        "configured": {
            "explore": cfg.bandit.policy,
            **{k: results["bandit"]["distilled"][k] for k in keep},
        },
        "seed": {"explore": "seed", **{k: results["bandit_seed"]["distilled"][k] for k in keep}},
    }


def markdown(p: dict) -> str:
    teach, band = p.get("teacher"), p.get("bandit")
    met = lambda x, goal: "yes" if x >= goal else "no"  # noqa: E731
    lines = [
        "# Phoenix performance: the batching teacher and the bandit",
        "",
        f"{header(p['environment'])}. All figures from this one run.",
        "",
        "| figure | measured | goal | met |",
        "|---|---|---|---|",
    ]
    if teach:
        x, goal = teach["speedup"], GOALS["teacher_speedup"]
        lines.append(
            f"| 1. local teacher answers/min, batched / one at a time | {x:.2f}x | >= {goal:.1f}x "
            f"| {met(x, goal)} |"
        )
    if band:
        b, goal = band["configured"], GOALS["bandit_ratio"]
        lines.append(
            f"| 2. bandit (policy: {b['explore']}) tokens/s / best single arm, post-warm-up | "
            f"{b['ratio_to_best_arm']:.2f}x | >= {goal:.2f}x | {met(b['ratio_to_best_arm'], goal)} |"
        )
    if teach:
        lines += [
            "",
            f"## 1. Batching local teacher ({teach['batched']['answers']} training prompts, the same "
            "in both runs, start-up included)",
            "",
            "| run | max_batch | elapsed (s) | answers/min | tokens/s |",
            "|---|---|---|---|---|",
        ]
        for name in ("one_at_a_time", "batched"):
            r = teach[name]
            lines.append(
                f"| {name.replace('_', ' ')} | {r['max_batch']} | {r['elapsed_s']:.1f} | "
                f"{r['answers_per_minute']:.2f} | {r['tokens_per_second']:.1f} |"
            )
    if band:
        lines += [
            "",
            f"## 2. Bandit ({band['prompts']} held-out prompts, {band['max_new_tokens']} tokens, "
            f"distilled draft; lossless: {'yes' if band['lossless'] else 'NO'})",
            "",
            "| policy | post-warm-up requests | tokens/s | best single arm (tokens/s) | ratio | "
            "chose best arm | arm counts |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in ("configured", "seed"):
            r = band[name]
            best = r["single_arm_tokens_per_second_same_prompts"][str(r["best_single_arm"])]
            lines.append(
                f"| {name} (policy: {r['explore']}) | {r['post_warmup_requests']} | "
                f"{r['post_warmup_tokens_per_second']:.2f} | arm {r['best_single_arm']} "
                f"({best:.2f}) | {r['ratio_to_best_arm']:.2f}x | "
                f"{100 * r['share_choosing_best_arm']:.0f}% | {r['post_warmup_arm_counts']} |"
            )
        lines += ["", "The bench's full report and plots: `bench/report.md`."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--teacher-prompts", type=int, default=16)
    ap.add_argument(
        "--bench-prompts", type=int, default=None, help="default: every held-out prompt"
    )
    ap.add_argument(
        "--parts",
        nargs="+",
        choices=["teacher", "bandit"],
        default=["teacher", "bandit"],
        help="measure only these (default: both)",
    )
    args = ap.parse_args()
    cfg = load_config(args.config)
    ws = Workspace(args.artifacts)
    if not ws.test_file.exists() or not (ws.merged / "config.json").is_file():
        sys.exit(
            f"performance: needs a split and a distilled draft in {ws.root}: run make merge first"
        )
    perf = ws.root / "perf"
    perf.mkdir(parents=True, exist_ok=True)
    out = {"environment": environment(cfg), "goals": GOALS}
    if "teacher" in args.parts:
        print("== 1. batching local teacher", flush=True)
        out["teacher"] = part_teacher(args, cfg, perf)
    if "bandit" in args.parts:
        print("== 2. bandit", flush=True)
        out["bandit"] = part_bandit(args, cfg, ws, perf)
    write_results(perf, "performance", out, markdown(out))


if __name__ == "__main__":
    main()
