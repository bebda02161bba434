"""Replay a bench run through bandit policies, over many bandit seeds, without the models.

    .venv/bin/python benchmarks/bandit_replay.py artifacts/perf/bench/results.json [--seeds 200]
        [--draft distilled]

A bench run with every arm as a fixed mode (as `make perf` runs it) measured each arm's latency
and output tokens on every prompt. Here a fresh bandit walks the prompts in the bench's order;
when it picks arm a for prompt i, it gets the measured (latency, tokens) of arm a on prompt i as
its reward (tokens/s). The figure is the bench's: post-warm-up tokens/s against the best single
arm on the same prompts. One live bench run is one seed; this shows the spread over seeds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from pipeline.speculative.bandit import EpsilonGreedy


def load_table(results: dict, draft: str) -> dict[int, dict[int, tuple[float, int]]]:
    """arm -> prompt index -> (latency_s, output_tokens), from the target and fixed_K runs."""
    table: dict[int, dict[int, tuple[float, int]]] = {}
    for r in results["requests"]:
        if r["mode"] == "target" or (r["draft"] == draft and r["mode"].startswith("fixed_")):
            table.setdefault(r["arm"], {})[r["prompt_index"]] = (r["latency_s"], r["output_tokens"])
    return table


def replay(table: dict, arms: list[int], explore: str, seed: int, **kw) -> tuple[float, float]:
    """(ratio to the best single arm, share of post-warm-up choices of that arm) for one seed."""
    bandit = EpsilonGreedy(arms, random.Random(seed), explore=explore, **kw)
    post = []
    for i in sorted(table[arms[0]]):
        d = bandit.choose()
        lat, tok = table[d.arm][i]
        bandit.update(d.arm, tok / lat)
        if not d.warmup:
            post.append((i, d.arm))
    idx = [i for i, _ in post]

    def tps(pairs):
        return sum(table[a][i][1] for i, a in pairs) / sum(table[a][i][0] for i, a in pairs)

    single = {a: tps([(i, a) for i in idx]) for a in arms}
    best = max(single, key=single.get)
    return tps(post) / single[best], sum(a == best for _, a in post) / len(post)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--draft", default="distilled")
    ap.add_argument("--seeds", type=int, default=200)
    args = ap.parse_args()
    results = json.loads(open(args.results).read())
    table = load_table(results, args.draft)
    arms = [a for a in results["protocol"]["bandit_arms"] if a in table]
    missing = set(results["protocol"]["bandit_arms"]) - set(arms)
    if missing:
        raise SystemExit(f"no fixed run for arms {sorted(missing)}: bench every arm first")
    print(f"{'policy':10s} {'ratio mean':>10s} {'min':>6s} {'p10':>6s} {'best-arm share':>15s}")
    out = {}
    for explore in ("uniform", "plausible"):
        runs = [replay(table, arms, explore, s) for s in range(args.seeds)]
        ratios = sorted(r for r, _ in runs)
        out[explore] = {
            "ratio_mean": statistics.mean(ratios),
            "ratio_min": ratios[0],
            "ratio_p10": ratios[len(ratios) // 10],
            "best_arm_share_mean": statistics.mean(s for _, s in runs),
        }
        o = out[explore]
        print(
            f"{explore:10s} {o['ratio_mean']:10.3f} {o['ratio_min']:6.3f} {o['ratio_p10']:6.3f} "
            f"{o['best_arm_share_mean']:15.2f}"
        )
    print(json.dumps({"seeds": args.seeds, "prompts": len(table[arms[0]]), "policies": out}))


if __name__ == "__main__":
    main()
