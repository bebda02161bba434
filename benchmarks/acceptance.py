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
    target = models.load_pair(cfg, ws, None)
    ids = prompt_ids(cfg, target.tokenizer, read_jsonl(ws.test_file)[: args.prompts])
    for spec in args.drafts:
        eng = models.load_pair(cfg, ws, spec, share_target=target).engine
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
