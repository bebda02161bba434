"""What a round of K guesses costs: the draft model guessing one token a pass (`draft:K`) against
the same draft guessing K in one pass (`pard:K`, issue 62's goal: <= 0.35x). A benchmark, not a
test.

    .venv/bin/python -m benchmarks.draft_cost --artifacts artifacts [--rows 1 8] [--k 4] \
        [--rounds 8] [--steps 12]

The served draft (`drafts.resolve_served`; it must name a mask token, `train.parallel`) runs in
the step loop as served: `rows` held-out prompts join one batch with one arm, and each step's
proposal time (`RowBatch._propose`, every row guessing K: the time the step spends drafting) is
recorded for `steps` steps. Arms alternate round by round; a round's ratio is the medians' of
its two runs; the ratio over rounds comes with its 95% interval. Greedy; the engine's dtype.
Writes <artifacts>/perf/draft_cost.json and .md.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import environment, header, table, write_results
from benchmarks.serving_load import interval
from pipeline import data, drafts, models
from pipeline.config import load_config
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.batch import RowBatch
from pipeline.workspace import Workspace


def drafting_ms(pair, prompts: list[list[int]], arm: str, steps: int) -> float:
    """Median milliseconds per row of a step's proposals, over steps where every row guessed
    its full K (a fresh batch of `len(prompts)` rows, each asking for plenty of tokens)."""
    a = parse_arm(arm)
    batch = RowBatch(pair.models, max_rows=len(prompts))
    batch.join([(i, p, 4 * steps * (a.k + 1), a) for i, p in enumerate(prompts)])
    timed, seen = batch._propose, []

    def propose(rows):
        seconds = timed(rows)
        if len(rows) == len(prompts) and all(r.k_eff == a.k for r in rows):
            seen.append(seconds / len(rows))
        return seconds

    batch._propose = propose
    batch.step()  # the first proposal catches each row's draft cache up: not a steady round
    seen.clear()
    while len(seen) < steps and len(batch.rows) == len(prompts):
        batch.step()
    if not seen:
        raise RuntimeError(f"{arm}: no step with every row guessing {a.k}")
    return 1000 * statistics.median(seen)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.sets)
    ws = Workspace(args.artifacts)
    served = drafts.resolve_served(cfg, ws, "latest")
    pair = models.load_pair(cfg, ws, served.spec, head_dir=None)
    if pair.models.parallel_token is None:
        raise SystemExit(f"{served.spec}: its config names no pard_token (train.parallel)")
    texts = [data.bench_messages(r) for r in data.load_set("heldout", ws)]
    arms = (f"draft:{args.k}", f"pard:{args.k}")
    results = {"environment": environment(cfg), "draft": served.label, "k": args.k, "rows": {}}
    lines = []
    for n in args.rows:
        prompts = [models.chat_prompt_ids(pair.tokenizer, texts[i % len(texts)],
                                          cfg.template_kwargs()) for i in range(n)]  # fmt: skip
        runs: dict[str, list[float]] = {a: [] for a in arms}
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                runs[arm].append(drafting_ms(pair, prompts, arm, args.steps))
        ratios = [p / d for d, p in zip(runs[arms[0]], runs[arms[1]], strict=True)]
        mean, lo, hi = interval(ratios) or (ratios[0], ratios[0], ratios[0])
        results["rows"][str(n)] = {"runs_ms": runs, "ratio": mean, "interval": [lo, hi]}
        lines.append([n, f"{statistics.median(runs[arms[0]]):.2f}",
                      f"{statistics.median(runs[arms[1]]):.2f}",
                      f"{mean:.2f}x ({lo:.2f}-{hi:.2f})"])  # fmt: skip
    md = [f"# Drafting cost of a round of {args.k} guesses, per row", "",
          header(results["environment"]), "",
          *table(["rows", f"{arms[0]} ms/row", f"{arms[1]} ms/row",
                  "pard / draft (95% interval)"], lines), "",
          f"{args.rounds} interleaved rounds, each the median of {args.steps} steps; draft "
          f"{served.label}."]  # fmt: skip
    write_results(ws.root / "perf", "draft_cost", results, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
