"""Replay a bench run through the bandit policies, over many bandit seeds, without the models.

    .venv/bin/python -m benchmarks.bandit_replay artifacts/perf/bench/results.json [--seeds 200]
        [--draft distilled] [--config configs/default.yaml] [--arms 0 draft:2 ngram:2]
        [--out replay.json]

A bench run with every arm as a fixed mode (as `make perf` runs it) measured each arm's latency,
output tokens and acceptance on every prompt. A fresh bandit of each policy (seed: uniform
exploration; plausible; contextual), with the config's bandit settings and drift guard, walks
the prompts in the bench's order (`pipeline/speculative/replay.py`). The figure is the bench's:
post-warm-up tokens/s against the best single arm on the same prompts. One live bench run is
one seed; this shows the mean and the worst seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.serving.policy import make_bandit, make_guard
from pipeline.speculative.arms import canonical
from pipeline.speculative.replay import load_table, replay, summarise

POLICIES = ("seed", "plausible", "contextual")


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
