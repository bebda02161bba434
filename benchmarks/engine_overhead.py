"""Speculative-loop overhead: the target drafting for itself (every guess accepted), so any
slowdown against plain target generation is pure framework overhead.

    .venv/bin/python benchmarks/engine_overhead.py [--config configs/default.yaml] [--prompts 4]
        [--tokens 64] [--arms 2 4 8] [--hf]

Compares, on the same prompts in the same run: Phoenix's engine at arm 0 (target only) and at
each arm k, and with --hf transformers' own assisted generation (constant schedule, no
confidence threshold) and plain `generate`. Prints tokens/s, the ratio to target-only, and draft vs verify seconds per request.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pipeline import bench, models
from pipeline.config import load_config
from pipeline.speculative.engine import SpeculativeEngine
from pipeline.workspace import Workspace, read_jsonl


def loop_overhead(
    eng: SpeculativeEngine, prompts: list[list[int]], tokens: int, arms: list[int]
) -> dict:
    """Target-only and each self-draft arm on the same prompts: tokens/s over the whole run, and
    mean draft and verify seconds per request."""
    eng.generate(prompts[0], 0, 8)  # warm-up
    rows = {}
    for k in [0, *arms]:
        results = [eng.generate(ids, k, tokens) for ids in prompts]
        secs = sum(r.latency_s for r in results)
        rows["phoenix target-only" if k == 0 else f"phoenix fixed_{k} (self-draft)"] = {
            "arm": k,
            "tokens_per_second": sum(r.output_tokens for r in results) / secs,
            "draft_s_per_request": sum(r.draft_s for r in results) / len(results),
            "verify_s_per_request": sum(r.verify_s for r in results) / len(results),
            "acceptance": sum(r.accepted for r in results)
            / max(1, sum(r.proposed for r in results)),
        }
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--arms", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--hf", action="store_true", help="also time transformers' assisted generation")
    args = ap.parse_args()
    cfg = load_config(args.config)
    ws = Workspace(args.artifacts)
    pair = models.load_pair(cfg, ws, models.SELF)
    eng, tok, target = pair.engine, pair.tokenizer, pair.target
    rows_in = (
        read_jsonl(ws.test_file)[: args.prompts]
        if ws.test_file.exists()
        else [{"prompt": "Write a function to reverse a string."}] * args.prompts
    )
    prompts = bench.prompt_ids(cfg, tok, rows_in)
    rows = loop_overhead(eng, prompts, args.tokens, args.arms)
    if args.hf:
        target.generation_config.num_assistant_tokens_schedule = "constant"
        target.generation_config.assistant_confidence_threshold = 0.0

        def hf(name, k=None):
            kw = dict(max_new_tokens=args.tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            if k:
                target.generation_config.num_assistant_tokens = k
                kw["assistant_model"] = target
            toks = 0
            t0 = time.perf_counter()
            for ids in prompts:
                toks += int(target.generate(torch.tensor([ids]), **kw).shape[1] - len(ids))
            rows[name] = {"arm": k or 0, "tokens_per_second": toks / (time.perf_counter() - t0)}

        hf("transformers generate")
        for k in args.arms:
            hf(f"transformers assisted k={k} (self-draft)", k)
    base = rows["phoenix target-only"]["tokens_per_second"]
    print(
        f"{'run':44s} {'tok/s':>8s} {'vs target-only':>15s} {'draft s/req':>12s} {'verify s/req':>13s}"
    )
    for name, row in rows.items():
        tps = row["tokens_per_second"]
        d, v = row.get("draft_s_per_request"), row.get("verify_s_per_request")
        extra = f" {d:12.2f} {v:13.2f}" if d is not None else ""
        print(f"{name:44s} {tps:8.2f} {tps / base:14.2f}x{extra}")
    print(json.dumps({"runs": rows, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
