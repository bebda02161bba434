"""The step loop against today's serving paths, in process (no HTTP), on the embedded default.

For each concurrency c, `c` client threads send the same held-out prompts in the same order
(each `--tokens` new tokens) through:
  - `loop`: `speculative.scheduler.StepLoop` (one batch for every arm) with every request on
    one arm (`0`, `ngram:K`, `draft:K`);
  - `today`: what `ServingCore` does now: arm 0 through the target batcher (`TargetBatch`),
    a speculative arm through `engine.generate` under one lock, one request at a time.
Aggregate output tokens/s per (path, arm, concurrency), and every loop output is checked
against target-only greedy decoding. The draft is `models.draft` as resolved here (after
`make merge`: pass `--draft artifacts/merged`; otherwise the undistilled cut).

    .venv/bin/python -m benchmarks.step_loop --clients 1 4 8 --prompts 8 --tokens 32
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.common import environment, header, table, write_results
from pipeline import bench, models
from pipeline.config import load_config
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.batch import TargetBatch
from pipeline.speculative.scheduler import Job, StepLoop
from pipeline.workspace import Workspace, read_jsonl


def drive(prompts, clients: int, send) -> tuple[float, list]:
    """`clients` threads share the prompts in order; returns (seconds, results in order)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:  # hands the prompts out in order
        out = list(pool.map(send, prompts))
    return time.perf_counter() - t0, out


class Today:
    """Today's ServingCore paths: plain rows batched, a speculative request under the lock."""

    def __init__(self, engine, max_rows: int):
        self.engine, self.lock = engine, threading.Lock()
        self.max_rows = max_rows

    def plain_all(self, prompts, clients, tokens):
        """Plain requests arrive `clients` at a time; the batch keeps `clients` rows running."""
        t0 = time.perf_counter()
        waiting = list(enumerate(prompts))
        done = {}
        b = TargetBatch(self.engine)
        while waiting or b.active:
            room = min(clients, self.max_rows) - b.active
            b.add([(i, (p, tokens)) for i, p in waiting[:room]])
            waiting = waiting[room:]
            done.update(b.step())
        return time.perf_counter() - t0, [done[i] for i in range(len(prompts))]

    def spec(self, arm, tokens):
        def send(p):
            with self.lock:
                return self.engine.generate(p, arm.k, tokens, strategy=arm.strategy)

        return send


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--draft", default=None, help="a draft spec (default models.draft)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--arms", nargs="+", default=["0", "ngram:4", "draft:2"])
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    args = ap.parse_args()
    cfg = load_config(args.config, [*args.set, "engine.compile=false", "engine.draft_vocab=0"])
    ws = Workspace(args.artifacts)
    if not ws.test_file.is_file():
        from pipeline import split

        split.run(cfg, ws)
    torch.set_num_threads(os.cpu_count() or 1)
    pair = models.load_pair(cfg, ws, args.draft or cfg.models.draft)
    eng = pair.engine
    rows = read_jsonl(ws.test_file)[: args.prompts]
    prompts = bench.prompt_ids(cfg, pair.tokenizer, rows)
    refs = [eng.generate(p, 0, args.tokens).token_ids for p in prompts]  # also warms up
    loop = StepLoop(eng, max_rows=max(args.clients))
    today = Today(eng, max(args.clients))
    results = []
    for arm_text in args.arms:
        arm = parse_arm(arm_text)
        for c in args.clients:
            secs, out = drive(prompts, c, lambda p, arm=arm: loop.submit(Job(p, args.tokens, arm)))
            exact = all(r.token_ids == ref for r, ref in zip(out, refs, strict=True))
            toks = sum(r.output_tokens for r in out)
            results.append(
                {
                    "path": "loop",
                    "arm": arm_text,
                    "clients": c,
                    "tokens_per_s": toks / secs,
                    "exact": exact,
                    "acceptance": _acc(out),
                }  # fmt: skip
            )
            if arm.k == 0:
                secs, out = today.plain_all(prompts, c, args.tokens)
            else:
                secs, out = drive(prompts, c, today.spec(arm, args.tokens))
            toks = sum(r.output_tokens for r in out)
            results.append(
                {
                    "path": "today",
                    "arm": arm_text,
                    "clients": c,
                    "tokens_per_s": toks / secs,
                    "exact": None,
                    "acceptance": _acc(out),
                }  # fmt: skip
            )
            print(results[-2], results[-1], flush=True)
    env = environment(cfg)
    out = {"environment": env, "args": vars(args), "draft": pair.draft_ref, "results": results}
    md = ["# Step loop vs today's paths", "", header(env) + ".", "",
          f"{args.prompts} held-out prompts, {args.tokens} new tokens, eager, full draft head.", ""]  # fmt: skip
    by = {(r["path"], r["arm"], r["clients"]): r for r in results}
    md += table(
        ["arm", "clients", "today tok/s", "loop tok/s", "loop / today", "loop exact", "acceptance"],
        [
            [
                a,
                c,
                f"{by['today', a, c]['tokens_per_s']:.1f}",
                f"{by['loop', a, c]['tokens_per_s']:.1f}",
                f"{by['loop', a, c]['tokens_per_s'] / by['today', a, c]['tokens_per_s']:.2f}x",
                by["loop", a, c]["exact"],
                by["loop", a, c]["acceptance"],
            ]  # fmt: skip
            for a in args.arms
            for c in args.clients
        ],
    )
    write_results(ws.root / "perf", "step_loop", out, "\n".join(md) + "\n")


def _acc(out) -> str:
    p = sum(r.proposed for r in out)
    return f"{sum(r.accepted for r in out) / p:.3f}" if p else "-"


if __name__ == "__main__":
    main()
