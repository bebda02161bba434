"""tune-vllm: measure vLLM with each speculation arm under load and learn its schedule.

    python -m pipeline tune-vllm --config FILE           # measure each k, learn the schedule

One vLLM per arm (`vllm.tune_ks`, `vllm.tune_ngram_ks`; 0: no speculation; a draft whose config
names a mask token, `pard_token`, also at each k of `vllm.tune_ks` drafting in one pass: `pard:K`),
swept over `vllm.tune_concurrency`; the schedule (`best_schedule`) is checked by a last sweep. Writes
<artifacts>/vllm/: tune.json, schedule.json (read by `serve --engine vllm`), report.md, a plot.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from pathlib import Path
from typing import Any

from . import loadtest
from .artifacts import weights_id
from .config import Config
from .vllm import (
    VllmServer,
    arm_config,
    command,
    draft_dir,
    method_for,
    parallel_draft,
    schedule_file,
    target_dir,
    vllm_python,
)
from .workspace import Workspace, atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)


# --- the schedule (pure) ---------------------------------------------------------------------
def best_schedule(table: dict[int, dict[int, float]], margin: float = 0.0) -> list[list[int]]:
    """`table[k][concurrency]` = tokens/s -> vLLM's `num_speculative_tokens_per_batch_size`,
    inclusive [first, last, k] ranges: at each c_i the fastest k (ties: the smaller), from c_i
    to c_(i+1) - 1 (first from 1), equal neighbours merged. A k > 0 must beat k = 0 by more
    than `margin` (a fraction)."""
    levels = sorted({c for row in table.values() for c in row})
    if not levels:
        raise ValueError("an empty sweep has no schedule")

    def pick(c: int) -> int:
        floor = table[0][c] * (1 + margin) if 0 in table and c in table[0] else -1.0
        paying = [k for k in sorted(table) if k == 0 or table[k].get(c, -1.0) > floor]
        return max(paying, key=lambda k: (table[k].get(c, -1.0), -k))

    choice = [pick(c) for c in levels]
    ranges: list[list[int]] = []
    for i, (c, k) in enumerate(zip(levels, choice, strict=True)):
        start = 1 if i == 0 else c
        end = levels[i + 1] - 1 if i + 1 < len(levels) else max(c, 1024)
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, k])
    return ranges


def k_for(schedule: list[list[int]], batch: int) -> int:
    """The k a schedule gives a batch size (past the last range: the last k)."""
    for start, end, k in schedule:
        if start <= batch <= end:
            return k
    return schedule[-1][2]


def choose_method(
    table: dict[str, dict[int, dict[int, float]]], margin: float = 0.0
) -> tuple[str, list[list[int]]]:
    """`table[strategy][k][c]` (each with k = 0) -> (strategy, schedule) whose schedule has the
    best mean ratio to no speculation over the concurrencies."""
    best = None
    for strategy, by_k in table.items():
        schedule = best_schedule(by_k, margin)
        levels = sorted(by_k[0])
        gain = sum(by_k[k_for(schedule, c)][c] / by_k[0][c] for c in levels) / len(levels)
        if best is None or gain > best[0]:
            best = (gain, strategy, schedule)
    return best[1], best[2]


def tune_arms(cfg: Config, draft: str) -> list[tuple[str, str | None, int, dict | None]]:
    """The arms tune-vllm measures, as (label, strategy, k, --speculative-config), every one
    built (and checked: a parallel draft's mask token, exit 2) before a vLLM starts: no
    speculation, the draft (or EAGLE-3 head) at each k of `vllm.tune_ks`, a draft whose config
    names a mask token (`pard_token`) also drafting each k in one pass (`pard:K`), prompt
    lookup at each k of `vllm.tune_ngram_ks`."""
    v = cfg.vllm
    kind = "eagle" if method_for("draft", draft) == "eagle3" else "draft"
    arms = [("0", None, 0)] + [(f"{kind}:{k}", "draft", k) for k in v.tune_ks if k]
    if kind == "draft" and parallel_draft(draft):
        arms += [(f"pard:{k}", "pard", k) for k in v.tune_ks if k]
    arms += [(f"ngram:{k}", "ngram", k) for k in v.tune_ngram_ks]
    return [(label, s, k, arm_config(s, draft, k)) for label, s, k in arms]


def tune(cfg: Config, ws: Workspace) -> dict[str, Any]:
    from . import drafts

    v = cfg.vllm
    vllm_python(cfg)  # exit 2 at once, saying how to install it
    served = drafts.resolve_served(cfg, ws)
    target, draft = target_dir(cfg, ws), draft_dir(cfg, ws, served)
    prompts = loadtest.held_out_prompts(ws)
    out_dir = ws.root / "vllm"
    arms = tune_arms(cfg, draft)
    results: dict[str, Any] = {"draft": served.describe(), "target": cfg.models.target,
                               "concurrency": v.tune_concurrency, "arms": {}}  # fmt: skip

    def sweep(label: str, spec: dict | None) -> dict:
        log_path = out_dir / f"vllm-{label.replace(':', '_')}.log"
        return measure(cfg, target, spec, log_path, prompts, label)

    for label, _, _, spec in arms:
        results["arms"][label] = sweep(label, spec)
        atomic_write_json(out_dir / "tune.json", results)  # each arm kept as it finishes

    def tps(label: str) -> dict[int, float]:
        return {c: results["arms"][label]["points"][c]["tokens_per_second"]
                for c in v.tune_concurrency}  # fmt: skip

    table = {
        strategy: {0: tps("0"), **{k: tps(label) for label, s, k, _ in arms if s == strategy}}
        for strategy in dict.fromkeys(s for _, s, _, _ in arms if s)
    }
    strategy, schedule = choose_method(table, v.tune_margin) if table else ("draft", [[1, 1024, 0]])
    top = max(r[2] for r in schedule)
    spec = arm_config(strategy, draft, top, schedule) if top else None
    results["schedule"] = {"strategy": strategy, "ranges": schedule}
    results["arms"]["schedule"] = sweep("schedule", spec)
    results["verdict"] = schedule_verdict(results)
    atomic_write_json(out_dir / "tune.json", results)
    learned = {
        "schedule": schedule,
        "strategy": strategy,
        "speculative_config": spec,
        "draft": draft,
        "draft_weights": weights_id(draft),
        "target": cfg.models.target,
        "command": shlex.join(command(cfg, "python", target, "0.0.0.0", 8000, spec)),
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    atomic_write_json(schedule_file(ws), learned)
    text = tune_report(results, learned)
    atomic_write_text(out_dir / "report.md", text)
    tune_plot(results, out_dir / "tokens_per_second.png")
    log.info("tune-vllm: report at %s\n%s", out_dir / "report.md", text)
    return {"schedule": json.dumps(schedule), "strategy": strategy}


def measure(
    cfg: Config, target: str, spec: dict | None, log_path: Path, prompts: list[str], label: str
) -> dict[str, Any]:
    """One vLLM server with `spec`, warmed at every concurrency (vLLM compiles a batch size on
    first use), then a sweep point per concurrency (>= `vllm.tune_prompts`, 2 per client)."""
    v = cfg.vllm
    with VllmServer(cfg, target, spec, log_path) as server:
        ep = loadtest.Endpoint(server.url)
        model = ep.model()
        for c in v.tune_concurrency:
            loadtest.sweep_point(ep, model, prompts[:c], c, 8)
        points = {}
        for c in v.tune_concurrency:
            batch = [prompts[i % len(prompts)] for i in range(max(v.tune_prompts, 2 * c))]
            points[c] = loadtest.sweep_point(
                ep, model, batch, c, v.tune_max_tokens, progress=f"vllm {label} c={c}"
            )
            log.info("vllm %s, %d clients: %.2f tokens/s", label, c,
                     points[c]["tokens_per_second"])  # fmt: skip
    return {"spec": spec, "ready_s": server.ready_s, "points": points}


def schedule_verdict(results: dict) -> dict[str, float] | None:
    """The schedule's smallest ratio over concurrencies to the best fixed arm and to k = 0."""
    arms = results["arms"]
    if "schedule" not in arms or "0" not in arms:
        return None
    fixed = {label: arm["points"] for label, arm in arms.items() if label != "schedule"}
    mine = arms["schedule"]["points"]

    def tps(points: dict, c) -> float:
        return points[c]["tokens_per_second"]

    cs = list(mine)
    return {
        "vs_best_fixed": min(tps(mine, c) / max(tps(p, c) for p in fixed.values()) for c in cs),
        "vs_no_speculation": min(tps(mine, c) / tps(fixed["0"], c) for c in cs),
    }


def tune_report(results: dict, learned: dict) -> str:
    from .bench import hardware

    cs = results["concurrency"]
    head = "| arm | " + " | ".join(f"{c} clients" for c in cs) + " |"
    lines = [
        "# vLLM speculation schedule",
        "",
        f"{hardware()}; {learned['measured']}; target `{results['target']}`, draft "
        f"`{learned['draft']}`. Aggregate output tokens/s (held-out prompts, streamed, greedy).",
        "",
        head,
        "|" + "---|" * (len(cs) + 1),
    ]
    base = results["arms"].get("0", {}).get("points", {})
    verdict = results.get("verdict")
    for label, arm in results["arms"].items():
        cells = []
        for c in cs:
            p = arm["points"][c]
            ratio = (
                f" ({p['tokens_per_second'] / base[c]['tokens_per_second']:.2f}x)" if base else ""
            )
            cells.append(f"{p['tokens_per_second']:.1f}{ratio}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Schedule: {learned['strategy']} (`num_speculative_tokens_per_batch_size`: "
        f"`{learned['schedule']}`; k = 0 everywhere: no speculation). Each arm's figures come "
        "after a warm-up at every concurrency.",
        "",
    ]
    if verdict:
        lines += [
            f"The schedule's own sweep: at every concurrency at least "
            f"{verdict['vs_best_fixed']:.2f}x the best fixed arm there and "
            f"{verdict['vs_no_speculation']:.2f}x no speculation.",
            "",
        ]
        if verdict["vs_no_speculation"] < 1:
            lines += [
                "Below 1.00x no speculation: a vLLM started with speculation runs its "
                "speculative path also where the schedule says k = 0 (with a draft model it "
                "still runs the draft over every new token), so a schedule cannot give the "
                "large batches back all of their speed. If the load is mostly in those "
                "ranges, serve without speculation (`serve --engine vllm --mode target`).",
                "",
            ]
    lines += ["Serve with it:", "", f"    {learned['command']}", ""]
    return "\n".join(lines)


def tune_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = results["concurrency"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, arm in results["arms"].items():
        ax.plot(cs, [arm["points"][c]["tokens_per_second"] for c in cs], marker="o",
                label=label, linewidth=2.5 if label == "schedule" else 1.2)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title("vLLM: tokens/s by speculation arm and load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
