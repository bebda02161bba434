"""Benchmark arithmetic (pure: records in, rows out), the Markdown report and the plots."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _counts(arms) -> dict[str, int]:
    return {str(a): n for a, n in sorted(Counter(arms).items())}


def aggregate(records: list[dict]) -> dict[str, Any]:
    """One row from the per-request records of one (draft, mode) run."""
    n = len(records)
    lat = [r["latency_s"] for r in records]
    tokens = sum(r["output_tokens"] for r in records)
    proposed = sum(r["proposed"] for r in records)
    accepted = sum(r["accepted"] for r in records)
    rounds = sum(r["rounds"] for r in records)
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "mean_latency_s": sum(lat) / len(lat) if lat else math.nan,
        "p50_latency_s": percentile(lat, 50),
        "p95_latency_s": percentile(lat, 95),
        # Aggregate throughput: all tokens over all time (long answers weigh more, as in serving).
        "tokens_per_second": tokens / sum(lat) if lat and sum(lat) > 0 else 0.0,
        "acceptance_rate": accepted / proposed if proposed else None,
        # Draft tokens accepted per target verification pass (each pass also commits one token).
        "mean_accepted_length": accepted / rounds if proposed and rounds else None,
        # Tokens each target verification pass commits: 1 + accepted per pass (1: target-only).
        "tokens_per_target_pass": (rounds + accepted) / rounds if rounds else None,
        "draft_s_per_request": sum(r["draft_s"] for r in records) / n if n else 0.0,
        "verify_s_per_request": sum(r["verify_s"] for r in records) / n if n else 0.0,
    }


def build_rows(records: list[dict]) -> list[dict]:
    """Rows for every (draft, mode) in first-seen order, with speedup against target-only."""
    order: list[tuple[str, str]] = []
    for r in records:
        if (r["draft"], r["mode"]) not in order:
            order.append((r["draft"], r["mode"]))
    rows = []
    for draft, mode in order:
        recs = [r for r in records if r["draft"] == draft and r["mode"] == mode]
        row = {"draft": draft, "mode": mode, **aggregate(recs), "arm_counts": None}
        row["acceptance_per_position"] = _per_position([r for r in recs if r["proposed"]])
        if mode.startswith("bandit"):
            row["arm_counts"] = _counts(r["arm"] for r in recs)
        rows.append(row)
    base = next((r["tokens_per_second"] for r in rows if r["mode"] == "target"), None)
    for row in rows:
        row["speedup"] = row["tokens_per_second"] / base if base else None
    return rows


def position_acceptance(records: list[dict]) -> dict[str, list[float]]:
    """Per proposer (the draft's name, "<draft>: eagle3 head", "<draft>: parallel", or "ngram (no
    draft)"): the share of proposals accepted at each draft position."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        if not r["proposed"]:
            continue
        strategy = str(r.get("arm") or "").partition(":")[0]
        if strategy == "ngram" or r["draft"] == "none":
            label = "ngram (no draft)"
        elif strategy == "eagle":
            label = f"{r['draft']}: eagle3 head"
        elif strategy == "pard":
            label = f"{r['draft']}: parallel"
        else:
            label = r["draft"]
        groups.setdefault(label, []).append(r)
    return {label: _per_position(recs) for label, recs in groups.items()}


def _per_position(records: list[dict]) -> list[float]:
    """The share of proposals accepted at each draft position over `records` ([]: none)."""
    width = max((len(r["proposed_per_position"]) for r in records), default=0)
    prop, acc = [0] * width, [0] * width
    for r in records:
        pairs = zip(r["proposed_per_position"], r["accepted_per_position"], strict=True)
        for i, (p, a) in enumerate(pairs):
            prop[i] += p
            acc[i] += a
    return [a / p if p else 0.0 for a, p in zip(acc, prop, strict=True)]


def bandit_summary(records: list[dict], draft: str, mode: str = "bandit") -> dict[str, Any] | None:
    """The bandit run `mode` after its warm-up, against the best single arm on the same prompts."""
    bandit = [r for r in records if r["draft"] == draft and r["mode"] == mode]
    if not bandit:
        return None
    post = [r for r in bandit if not r["warmup"]]
    singles: dict[str, dict[int, dict]] = {}  # arm -> prompt index -> record
    for r in records:  # target and ngram_K ran without a draft ("none"), fixed_K with this one
        if r["draft"] in (draft, "none") and not r["mode"].startswith("bandit"):
            singles.setdefault(r["arm"], {})[r["prompt_index"]] = r
    idx = [r["prompt_index"] for r in post]

    def tps(recs):
        t = sum(r["latency_s"] for r in recs)
        return sum(r["output_tokens"] for r in recs) / t if t > 0 else 0.0

    same = {
        a: tps([by[i] for i in idx])
        for a, by in singles.items()
        if idx and all(i in by for i in idx)
    }
    best_arm = max(same, key=same.get) if same else None
    post_tps = tps(post) if post else None
    return {
        "warmup_requests": len(bandit) - len(post),
        "post_warmup_requests": len(post),
        "warmup_arms": [r["arm"] for r in bandit if r["warmup"]],
        "post_warmup_arm_counts": _counts(r["arm"] for r in post),
        "post_warmup_tokens_per_second": post_tps,
        "single_arm_tokens_per_second_same_prompts": {str(a): v for a, v in sorted(same.items())},
        "best_single_arm": best_arm,
        "ratio_to_best_arm": post_tps / same[best_arm]
        if post_tps and best_arm is not None and same[best_arm]
        else None,
        "share_choosing_best_arm": (sum(r["arm"] == best_arm for r in post) / len(post))
        if post and best_arm is not None
        else None,
        "arms_in_order": [r["arm"] for r in bandit],
        "fallback_requests": sum(bool(r.get("fallback")) for r in bandit),
    }


def _arm_order(arm: str) -> tuple[str, int]:
    """0 first, then each strategy by K."""
    strategy, _, k = arm.partition(":")
    return ("", 0) if not k else (strategy, int(k))


def _fmt(x, digits=2, pct=False):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{100 * x:.1f}%" if pct else f"{x:.{digits}f}"


def _bandit_lines(title: str, b: dict) -> list[str]:
    best = b["single_arm_tokens_per_second_same_prompts"].get(str(b["best_single_arm"]))
    return [
        f"## {title}",
        "",
        f"- Warm-up ({b['warmup_requests']} requests, every arm in turn): arms {b['warmup_arms']}.",
        f"- After warm-up ({b['post_warmup_requests']} requests): arm counts "
        f"{b['post_warmup_arm_counts']}.",
        f"- Post-warm-up tokens/s {_fmt(b['post_warmup_tokens_per_second'])} vs best single arm "
        f"(arm {b['best_single_arm']}, same prompts) {_fmt(best)}: ratio "
        f"**{_fmt(b['ratio_to_best_arm'])}x**; {_fmt(b['share_choosing_best_arm'], pct=True)} of "
        "post-warm-up requests chose the best arm."
        + (
            f" The drift guard served {b['fallback_requests']} of them plain (fallback)."
            if b.get("fallback_requests")
            else ""
        ),
        "",
    ]


def engine_line(engine: dict) -> str:
    """How the engines ran: compiled or eager, and each pruned draft head's coverage."""
    parts = []
    for name, row in engine.items():
        if not isinstance(row, dict):
            continue
        text = (
            f"{'target' if name == 'none' else name}: {'compiled' if row['compiled'] else 'eager'}"
        )
        if row.get("head_tokens"):
            cov = row.get("heldout_coverage")
            text += f", draft head {row['head_tokens']} tokens" + (
                f" covering {cov:.1%} of the held-out answers' tokens" if cov is not None else ""
            )
        parts.append(text)
    return f"Engine (engine.compile={engine['compile']}): " + "; ".join(parts) + "."


def _decoding(results: dict) -> str:
    p = results["protocol"]
    t = p.get("temperature") or 0
    if not t:
        return "greedy"
    cuts = f", top_p {p['top_p']}" if p.get("top_p", 1) < 1 else ""
    cuts += f", top_k {p['top_k']}" if p.get("top_k") else ""
    return f"sampled at temperature {t}{cuts} (seeded by prompt)"


def _distribution_lines(ok: bool, d: dict) -> list[str]:
    """The sampled protocol's check: per arm, the smallest p-value over prompts and positions."""
    worst: dict[tuple, float] = {}
    for c in d["comparisons"]:
        key = (c["draft"], c["arm"])
        worst[key] = min(worst.get(key, 1.0), c["p_value"])
    lines = [
        f"Lossless in distribution: **{'yes' if ok else 'NO'}** (the first {d['tokens']} tokens of "
        f"{d['samples']} sampled generations per arm on {d['prompts']} prompts against as many "
        f"target-only ones, chi-square two-sample test per position; a comparison fails below "
        f"{d['threshold']:.1e}, family-wise {d['alpha']}).",
        "",
        "| draft | arm | smallest p-value |",
        "|---|---|---|",
    ]
    lines += [f"| {dr} | {arm} | {p:.3g} |" for (dr, arm), p in worst.items()]
    return [*lines, ""]


def markdown(results: dict) -> str:
    lines = _header_lines(results) + _lossless_lines(results)
    if results.get("engine"):
        lines += [engine_line(results["engine"]), ""]
    lines += _draft_tables(results)
    lines += _gain_lines(results.get("distillation_gain") or {})
    policy = results["protocol"].get("bandit_policy", "seed")
    runs = [("Bandit", f"policy: {policy}", results.get("bandit") or {})]
    runs.append(("Seed bandit", "the seed's policy", results.get("bandit_seed") or {}))
    for title, policy, per_draft in runs:
        for draft, b in per_draft.items():
            if b:
                lines += _bandit_lines(f"{title} ({draft} draft; {policy})", b)
    lines += _position_lines(results.get("position_acceptance") or {})
    if not results["lossless"]:
        lines += ["## Mismatches", ""] + [f"- {m}" for m in results["mismatches"]] + [""]
    lines += _near_tie_lines(results)
    lines += _set_lines(results.get("sets") or {})
    lines += ["Plots: `tokens_per_second.png`, `bandit_arms.png`, `acceptance_by_position.png`"
              + (", `acceptance_by_set.png`." if results.get("sets") else ".")]  # fmt: skip
    return "\n".join([*lines, ""])


def _header_lines(results: dict) -> list[str]:
    env = results["environment"]
    first = next(iter(results.get("sets") or {}), "heldout")  # the set the tables measure
    first = "held-out" if first == "heldout" else f"`{first}`"
    return [
        "# Phoenix benchmark",
        "",
        f"Hardware: {env['hardware']}; device {env['device']}, {env['dtype']}, {env['threads']} threads; "
        f"torch {env['torch']}, transformers {env['transformers']}. Date: {env['date']}.",
        f"Protocol: {results['protocol']['prompts']} {first} prompts, "
        f"{_decoding(results)}, batch size 1, max_new_tokens {results['protocol']['max_new_tokens']}, "
        f"{results['protocol']['warmup_requests']} warm-up request(s) per run excluded, the "
        "modes taking turns prompt by prompt. All numbers are from one run on this machine.",
        "",
    ]


def _lossless_lines(results: dict) -> list[str]:
    """The lossless verdict: in distribution (the sampled protocol) or token for token."""
    dist = results.get("distribution")
    if dist:
        return _distribution_lines(results["lossless"], dist)
    return [
        f"Lossless: **{'yes' if results['lossless'] else 'NO'}** (every speculative output "
        f"{'equals' if results['lossless'] else 'must equal'} the target-only output token "
        "for token"
        + (
            f"; {len(results['near_ties'])} near-ties within bench.lossless_margin, listed below)."
            if results.get("near_ties")
            else ")."
        ),
        "",
    ]


def _draft_tables(results: dict) -> list[str]:
    """One table of modes per draft; the rows that need no draft (target, ngram_K) in each."""
    lines: list[str] = []
    free = [r for r in results["rows"] if r["draft"] == "none"]
    for draft in results["drafts"]:
        rows = free + [r for r in results["rows"] if r["draft"] == draft]
        lines += [
            f"## Draft: {draft} (`{results['draft_models'][draft]}`)",
            "",
            "| mode | mean latency (s) | p50 (s) | p95 (s) | tokens/s | acceptance | speedup |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['mode']} | {_fmt(r['mean_latency_s'])} | {_fmt(r['p50_latency_s'])} | "
                f"{_fmt(r['p95_latency_s'])} | {_fmt(r['tokens_per_second'])} | "
                f"{_fmt(r['acceptance_rate'], pct=True)} | {_fmt(r['speedup'])}x |"
            )
        lines.append("")
    return lines


def _gain_lines(gains: dict) -> list[str]:
    if not gains:
        return []
    lines = ["## Acceptance gain from distillation", "", "| mode | base | distilled | gain |"]
    lines.append("|---|---|---|---|")
    for mode, g in gains.items():
        lines.append(
            f"| {mode} | {_fmt(g['base'], pct=True)} | {_fmt(g['distilled'], pct=True)} | "
            f"{_fmt(g['gain'], pct=True)} |"
        )
    return [*lines, ""]


def _position_lines(pos: dict) -> list[str]:
    if not pos:
        return []
    longest = max(len(v) for v in pos.values())
    lines = [
        "## Acceptance by draft position",
        "",
        "| draft | " + " | ".join(f"pos {i + 1}" for i in range(longest)) + " |",
        "|---|" + "---|" * longest,
    ]
    for draft, v in pos.items():
        lines.append(f"| {draft} | " + " | ".join(_fmt(x, pct=True) for x in v) + " |")
    return [*lines, ""]


def _set_lines(sets: dict) -> list[str]:
    """A table per prompt set: per mode tokens/s, speedup, acceptance, tokens per target pass,
    and acceptance at each draft position. The tables above are the first set's."""
    if not sets:
        return []
    lines = ["## Acceptance by prompt set", ""]
    if len(sets) > 1:
        names = ", ".join(f"{n} ({s['protocol']['prompts']} prompts)" for n, s in sets.items())
        lines += [f"Sets: {names}; the tables above are the first one's.", ""]
    for name, s in sets.items():
        rows = s["rows"]
        width = max((len(r.get("acceptance_per_position") or []) for r in rows), default=0)
        verdict = "yes" if s["lossless"] else "NO"
        lines += [
            f"### {name} ({s['protocol']['prompts']} prompts; lossless: **{verdict}**)",
            "",
            "| draft | mode | tokens/s | speedup | acceptance | tokens per target pass |"
            + "".join(f" pos {i + 1} |" for i in range(width)),
            "|---|---|---|---|---|---|" + "---|" * width,
        ]
        for r in rows:
            pos = list(r.get("acceptance_per_position") or [])
            cells = [_fmt(x, pct=True) for x in pos] + ["-"] * (width - len(pos))
            lines.append(
                f"| {r['draft']} | {r['mode']} | {_fmt(r['tokens_per_second'])} | "
                f"{_fmt(r['speedup'])}x | {_fmt(r['acceptance_rate'], pct=True)} | "
                f"{_fmt(r.get('tokens_per_target_pass'))} |" + "".join(f" {c} |" for c in cells)
            )
        lines.append("")
    return lines


def _near_tie_lines(results: dict) -> list[str]:
    ties = results.get("near_ties") or []
    if not ties:
        return []
    return (
        [
            f"## Near-ties ({len(ties)}, within bench.lossless_margin {results['lossless_margin']})",
            "",
            "Outputs that left the target-only output where the target's own scores for the two "
            "tokens were within the margin (half-precision rounding), not counted as failures:",
            "",
        ]
        + [
            f"- {t['draft']}/{t['mode']} prompt {t['prompt_index']}, token {t['position']}: "
            f"margin {t['margin']:.4f}"
            for t in ties
        ]
        + [""]
    )


def write_plots(results: dict, records: list[dict], out: Path) -> list[str]:
    """The plots (bandit and positions only where there is data) into `out` -> file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = [_plot_throughput(plt, results, out)]
    written.append(_plot_bandit(plt, results, records, out))
    written.append(_plot_positions(plt, results.get("position_acceptance") or {}, out))
    written.append(_plot_sets(plt, results.get("sets") or {}, out))
    return [name for name in written if name]


def _plot_sets(plt, sets: dict, out: Path) -> str | None:
    """Acceptance by arm (a row of results: draft and mode), one bar per prompt set."""
    arms = list(dict.fromkeys((r["draft"], r["mode"]) for s in sets.values() for r in s["rows"]
                              if r["acceptance_rate"] is not None))  # fmt: skip
    if not arms:
        return None
    one_draft = len({d for d, _ in arms if d != "none"}) <= 1
    labels = [m if one_draft or d == "none" else f"{d} {m}" for d, m in arms]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(arms) * len(sets)), 4))
    width = 0.8 / len(sets)
    for j, (name, s) in enumerate(sets.items()):
        rate = {(r["draft"], r["mode"]): r["acceptance_rate"] for r in s["rows"]}
        vals = [rate.get(a) or 0.0 for a in arms]
        ax.bar([i + j * width for i in range(len(arms))], vals, width, label=name)
    ax.set_xticks([i + width * (len(sets) - 1) / 2 for i in range(len(arms))], labels)
    ax.set_ylabel("share of draft tokens accepted")
    ax.set_ylim(0, 1)
    return _save(plt, fig, ax, "Acceptance by prompt set and arm", out / "acceptance_by_set.png")


def _plot_throughput(plt, results: dict, out: Path) -> str:
    rows = results["rows"]
    target = next((r for r in rows if r["mode"] == "target"), None)
    fig, ax = plt.subplots(figsize=(8, 4))
    modes = list(dict.fromkeys(r["mode"] for r in rows if r["mode"] != "target"))
    width = 0.8 / max(1, len(results["drafts"]))
    for j, draft in enumerate(results["drafts"]):
        # ngram_K rows need no draft: the same bar for every draft (the first row of a mode).
        tps = {
            r["mode"]: r["tokens_per_second"] for r in rows[::-1] if r["draft"] in (draft, "none")
        }
        vals = [tps.get(m, 0) for m in modes]
        ax.bar([i + j * width for i in range(len(modes))], vals, width, label=f"{draft} draft")
    if target:
        ax.axhline(target["tokens_per_second"], color="black", linestyle="--", label="target only")
    ax.set_xticks([i + width * (len(results["drafts"]) - 1) / 2 for i in range(len(modes))], modes)
    ax.set_ylabel("output tokens/s")
    return _save(plt, fig, ax, "Throughput by mode and draft", out / "tokens_per_second.png")


def _plot_bandit(plt, results: dict, records: list[dict], out: Path) -> str | None:
    bandit = [
        (d, m)
        for d in results["drafts"]
        for m in ("bandit", "bandit_seed")
        if any(r["draft"] == d and r["mode"] == m for r in records)
    ]
    if not bandit:
        return None
    fig, axes = plt.subplots(
        len(bandit), 1, figsize=(8, 2.6 * len(bandit)), sharex=True, squeeze=False
    )
    for ax, (draft, mode) in zip(axes[:, 0], bandit, strict=True):
        recs = [r for r in records if r["draft"] == draft and r["mode"] == mode]
        colors = [
            "tab:grey" if r["warmup"] else ("tab:orange" if r["explored"] else "tab:blue")
            for r in recs
        ]
        names = sorted({str(r["arm"]) for r in recs} | {"0"}, key=_arm_order)
        ys = [names.index(str(r["arm"])) for r in recs]
        ax.step(range(1, len(recs) + 1), ys, where="mid", color="lightgrey", zorder=1)
        ax.scatter(range(1, len(recs) + 1), ys, c=colors, zorder=2, s=25)
        ax.axvline(sum(r["warmup"] for r in recs) + 0.5, color="grey", linestyle=":")
        ax.set_ylabel(f"{draft} {mode}: arm")
        ax.set_yticks(range(len(names)), names)
    axes[0, 0].set_title(
        "Bandit: arm per request (grey: warm-up, orange: explored, blue: exploited)"
    )
    axes[-1, 0].set_xlabel("request (dotted line: end of warm-up)")
    fig.tight_layout()
    fig.savefig(out / "bandit_arms.png", dpi=110)
    plt.close(fig)
    return "bandit_arms.png"


def _plot_positions(plt, pos: dict, out: Path) -> str | None:
    if not pos:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for draft, v in pos.items():
        ax.plot(range(1, len(v) + 1), v, marker="o", label=f"{draft} draft")
    ax.set_xlabel("draft position")
    ax.set_ylabel("share accepted")
    ax.set_ylim(0, 1)
    return _save(plt, fig, ax, "Acceptance by draft position", out / "acceptance_by_position.png")


def _save(plt, fig, ax, title: str, path: Path) -> str:
    """Title and legend on `ax`, `fig` written to `path` and closed; the file's name."""
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
