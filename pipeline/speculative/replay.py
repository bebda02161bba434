"""Replay a bench run through a bandit, without the models. Pure: records in, figures out.

A bench run with every arm as a fixed mode measured each arm's latency, output tokens and
acceptance on every prompt (`load_table`). A fresh bandit (and drift guard) walks the prompts in
the bench's order; when it picks arm a for prompt i it gets what arm a measured on prompt i
(tokens/s as the reward, weighted by latency as the server weighs it; the prompt's length and
the arm's acceptance as context). The figure is the bench's: post-warm-up tokens/s against the
best single arm on the same prompts. `benchmarks/bandit_replay.py` runs it over many seeds.
"""

from __future__ import annotations

import statistics

from .bandit import Context, EpsilonGreedy
from .guard import DriftGuard


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
