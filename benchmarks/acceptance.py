"""Greedy acceptance of one or more drafts against the target on held-out prompts (fixed k).

    .venv/bin/python benchmarks/acceptance.py --artifacts artifacts --drafts cut:4 artifacts/merged \
        [--prompts 8] [--tokens 48] [--k 4]

Used to choose the embedded default's draft and training settings (see the README).
"""

from __future__ import annotations

import argparse

from pipeline import models
from pipeline.bench import prompt_ids
from pipeline.config import load_config
from pipeline.spec.core import eos_ids
from pipeline.spec.engine import SpecEngine
from pipeline.workspace import Workspace, read_jsonl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--drafts", nargs="+", required=True, help="draft specs or directories")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    cfg = load_config(args.config)
    ws = Workspace(args.artifacts)
    target_ref = models.resolve(cfg.models.target, ws.models_cache)
    tok = models.load_tokenizer(target_ref)
    target = models.load_model(target_ref, "float32", "cpu")
    ids = prompt_ids(cfg, tok, read_jsonl(ws.test_file)[: args.prompts])
    for spec in args.drafts:
        ref = models.resolve(spec, ws.models_cache, target_ref=target_ref)
        eng = SpecEngine(target, models.load_model(ref, "float32", "cpu"), eos_ids(tok, target))
        acc = prop = toks = 0
        secs = 0.0
        for p in ids:
            r = eng.generate(p, args.k, args.tokens)
            acc, prop, toks, secs = (
                acc + r.accepted,
                prop + r.proposed,
                toks + r.output_tokens,
                secs + r.latency_s,
            )
        print(
            f"{spec}: acceptance {acc / prop:.3f} ({acc}/{prop}) at k={args.k}, {toks / secs:.2f} tokens/s"
        )


if __name__ == "__main__":
    main()
