"""Replay a bench run through the bandit policies, over many bandit seeds, without the models.

    .venv/bin/python -m benchmarks.bandit_replay artifacts/perf/bench/results.json [--seeds 200]
        [--draft distilled] [--config configs/default.yaml] [--arms 0 draft:2 ngram:2]
        [--out replay.json]

A bench run with every arm as a fixed mode (as `make perf` runs it) measured each arm's latency,
output tokens and acceptance on every prompt. A fresh bandit of each policy (seed: uniform
exploration; plausible; contextual), with the config's bandit settings and drift guard, walks
the prompts in the bench's order (`replay` below: records in, figures out, no models). The figure is the bench's:
post-warm-up tokens/s against the best single arm on the same prompts. One live bench run is
one seed; this shows the mean and the worst seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.serving.policy import make_bandit, make_guard
from pipeline.speculative.arms import canonical
from pipeline.speculative.bandit import Context, EpsilonGreedy
from pipeline.speculative.guard import DriftGuard

POLICIES = ("seed", "plausible", "contextual")


def load_table(results: dict, draft: str) -> dict[str, dict[int, dict]]:
    """arm -> prompt index -> record, from a bench's single-arm runs: target and ngram_K (no
    draft) and this draft's fixed_K."""
    table: dict[str, dict[int, dict]] = {}
    for r in results["requests"]:
        if r["draft"] in (draft, "none") and not r["mode"].startswith("bandit"):
            table.setdefault(str(r["arm"]), {})[r["prompt_index"]] = r
    return table


def replay(table: dict, arms: list[str], bandit: EpsilonGreedy, guard: DriftGuard | None) -> dict:
    """One walk: ratio to the best single arm on the post-warm-up prompts, the share of
    post-warm-up choices of that arm, and the drift guard's fallbacks."""
    post, fallbacks = [], 0
    for i in sorted(table[arms[0]]):
        ctx = Context(table[arms[0]][i].get("prompt_tokens", 0), 0)
        if guard is not None and guard.hold():
            arm, exploited, warm = "0", False, False
        else:
            d = bandit.choose(ctx)
            arm, exploited, warm = d.arm, not (d.explored or d.warmup), d.warmup
        r = table[arm][i]
        tps = r["output_tokens"] / r["latency_s"]
        acc = r["accepted"] / r["proposed"] if r["proposed"] else None
        bandit.update(arm, tps, ctx, acc, r["latency_s"])
        if guard is not None:
            ev = guard.observe(arm == "0", exploited, tps)
            fallbacks += bool(ev and ev["event"] == "fallback")
        if not warm:
            post.append((i, arm))
    idx = [i for i, _ in post]

    def tps_of(pairs):
        return sum(table[a][i]["output_tokens"] for i, a in pairs) / sum(
            table[a][i]["latency_s"] for i, a in pairs
        )

    single = {a: tps_of([(i, a) for i in idx]) for a in arms}
    best = max(single, key=single.get)
    return {
        "ratio": tps_of(post) / single[best],
        "best_share": sum(a == best for _, a in post) / len(post),
        "fallbacks": fallbacks,
        "best_arm": best,
        "to_target": tps_of(post) / single["0"] if "0" in single else None,
    }


def summarise(runs: list[dict]) -> dict:
    """Mean, worst and 10th-percentile ratio over seeds (`runs[s]`: seed s's replay)."""
    ratios = sorted(r["ratio"] for r in runs)
    worst = min(range(len(runs)), key=lambda s: runs[s]["ratio"])
    return {
        "ratio_mean": statistics.mean(ratios),
        "ratio_min": ratios[0],
        "worst_seed": worst,
        "ratio_p10": ratios[len(ratios) // 10],
        "best_arm_share_mean": statistics.mean(r["best_share"] for r in runs),
        "to_target_mean": statistics.mean(r["to_target"] for r in runs)
        if all(r["to_target"] is not None for r in runs)
        else None,
        "fallbacks_mean": statistics.mean(r["fallbacks"] for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--draft", default="distilled")
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--out", help="also write the summary as JSON here")
    ap.add_argument(
        "--arms", nargs="+", help="replay these arms (default: the bench's bandit arms)"
    )
    args = ap.parse_args()
    results = json.loads(Path(args.results).read_text())
    cfg = load_config(args.config)
    table = load_table(results, args.draft)
    wanted = canonical(args.arms or results["protocol"]["bandit_arms"])
    missing = [a for a in wanted if a not in table]
    if missing:
        sys.exit(f"no single-arm run for arms {missing} in {args.results}: bench every arm first")
    prompts = len(table[wanted[0]])
    print(
        f"{prompts} prompts, arms {wanted}, {args.seeds} seeds; {results['environment']['hardware']}"
    )
    print(
        f"{'policy':11s} {'ratio mean':>10s} {'worst':>6s} {'p10':>6s} {'best-arm share':>15s} "
        f"{'x target':>9s} {'fallbacks':>9s}"
    )
    out = {}
    for policy in POLICIES:
        b = cfg.bandit
        runs = [
            replay(table, wanted, make_bandit(b, wanted, policy, s), make_guard(b))
            for s in range(args.seeds)
        ]
        o = out[policy] = summarise(runs)
        to_t = f"{o['to_target_mean']:.3f}" if o["to_target_mean"] is not None else "-"
        print(
            f"{policy:11s} {o['ratio_mean']:10.3f} {o['ratio_min']:6.3f} {o['ratio_p10']:6.3f} "
            f"{o['best_arm_share_mean']:15.2f} {to_t:>9s} {o['fallbacks_mean']:9.2f}"
            f"   (worst: seed {o['worst_seed']})"
        )
    summary = {
        "results": args.results,
        "seeds": args.seeds,
        "prompts": prompts,
        "arms": wanted,
        "hardware": results["environment"]["hardware"],
        "policies": out,
    }
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
