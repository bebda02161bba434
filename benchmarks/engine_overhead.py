"""Speculative-loop overhead: the target drafting for itself (every guess accepted), so any
slowdown against plain target generation is pure framework overhead.

    .venv/bin/python benchmarks/engine_overhead.py [--config configs/default.yaml] [--prompts 4]
        [--tokens 64] [--arms 2 4 8] [--hf]

Compares, on the same prompts in the same run: Phoenix's engine at arm 0 (target only) and at
each arm k, and with --hf transformers' own assisted generation (constant schedule, no
confidence threshold) and plain `generate`. Prints tokens/s and the ratio to target-only.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pipeline import models
from pipeline.config import load_config
from pipeline.spec.core import eos_ids
from pipeline.spec.engine import SpecEngine
from pipeline.workspace import Workspace, read_jsonl


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
    ref = models.resolve(cfg.models.target, ws.models_cache)
    tok = models.load_tokenizer(ref)
    target = models.load_model(ref, cfg.models.dtype, cfg.models.device)
    eng = SpecEngine(target, target, eos_ids(tok, target))
    texts = (
        [r["prompt"] for r in read_jsonl(ws.test_file)[: args.prompts]]
        if ws.test_file.exists()
        else ["Write a function to reverse a string."] * args.prompts
    )
    prompts = [models.user_prompt_ids(tok, t) for t in texts]
    eng.generate(prompts[0], 0, 8)  # warm-up

    rows = {}

    def record(name, fn):
        toks = secs = 0.0
        for ids in prompts:
            t0 = time.perf_counter()
            n = fn(ids)
            secs += time.perf_counter() - t0
            toks += n
        rows[name] = toks / secs

    record("phoenix target-only", lambda ids: eng.generate(ids, 0, args.tokens).output_tokens)
    for k in args.arms:
        record(
            f"phoenix fixed_{k} (self-draft)",
            lambda ids, k=k: eng.generate(ids, k, args.tokens).output_tokens,
        )
    if args.hf:
        target.generation_config.num_assistant_tokens_schedule = "constant"
        target.generation_config.assistant_confidence_threshold = 0.0

        def hf(ids, k=None):
            inp = torch.tensor([ids])
            kw = dict(max_new_tokens=args.tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            if k:
                target.generation_config.num_assistant_tokens = k
                kw["assistant_model"] = target
            return int(target.generate(inp, **kw).shape[1] - len(ids))

        record("transformers generate", hf)
        for k in args.arms:
            record(f"transformers assisted k={k} (self-draft)", lambda ids, k=k: hf(ids, k))
    base = rows["phoenix target-only"]
    print(f"{'run':44s} {'tok/s':>8s} {'vs target-only':>15s}")
    for name, tps in rows.items():
        print(f"{name:44s} {tps:8.2f} {tps / base:14.2f}x")
    print(json.dumps({"tokens_per_second": rows, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
