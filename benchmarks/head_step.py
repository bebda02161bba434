"""The EAGLE-3 head's step against the target's, eager and compiled (issue 31: a head step
<= 0.08 of a target step, compiled). A benchmark, not a test.

    .venv/bin/python -m benchmarks.head_step --artifacts artifacts [--head DIR] \
        [--dtypes float32 bfloat16] [--backend inductor]

The target is the config's, run as the step loop runs it: its lean runner (`runner.step_ms`: a
one-token forward, hidden states and head, after a 64-token prefill). The head is an exported one
(`--head`) or a new one from the target over `engine.draft_vocab` ids: its cost does not depend on
its weights. Its step (`Eagle3Head.step_ms`) is one guess of one row after reading 64 states. Both
are timed eager, then compiled as `engine.compile` compiles them (`LeanRunner.compile`,
`Eagle3Head.compile`, each warmed first); medians of 30. Writes <artifacts>/perf/head_step.json
and .md.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import environment, header, table, write_results
from pipeline import eagle3, models
from pipeline.config import load_config
from pipeline.speculative.runner import prepare, step_ms, warm_up
from pipeline.workspace import Workspace

CONTEXT = 64  # runner.step_ms's prefill


def measure(cfg, ws: Workspace, head_dir: str | None, dtype: str, backend: str) -> dict:
    cfg = load_config(cfg, [f"models.dtype={dtype}", "engine.compile=false"])
    pair = models.load_pair(cfg, ws, None)
    target = pair.target
    if head_dir:
        head = eagle3.load_head(head_dir, target)
    else:
        n = cfg.engine.draft_vocab or target.config.vocab_size
        head = eagle3.new_head(target, list(range(n)), None)
    head = head.to(next(target.parameters()).dtype).eval()
    prepare(target, cfg.engine.max_context)
    row = {"dtype": dtype, "draft_vocab": head.config.draft_vocab_size}
    row["target_eager_ms"] = step_ms(target, 1, repeat=30)
    row["head_eager_ms"] = head.step_ms(CONTEXT)
    target._phoenix_runner.compile(backend=backend)
    warm_up(target)
    head.compile(backend=backend)
    head.warm_up()
    row["target_compiled_ms"] = step_ms(target, 1, repeat=30)
    row["head_compiled_ms"] = head.step_ms(CONTEXT)
    target._phoenix_runner.uncompile()
    for kind in ("eager", "compiled"):
        row[f"ratio_{kind}"] = row[f"head_{kind}_ms"] / row[f"target_{kind}_ms"]
    # The goal's figure: the compiled head against the target as the loop would run it
    # (compiled where that measured faster, as engine.compile=auto keeps it).
    row["ratio_goal"] = row["head_compiled_ms"] / min(
        row["target_compiled_ms"], row["target_eager_ms"]
    )
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--head", default=None, help="an exported head (default: a new one)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()
    torch.manual_seed(0)
    ws = Workspace(args.artifacts)
    rows = [measure(args.config, ws, args.head, d, args.backend) for d in args.dtypes]
    env = environment(load_config(args.config))
    lines = table(
        ["dtype", "target eager ms", "target compiled ms", "head eager ms",
         "head compiled ms", "head / target eager", "head / target compiled",
         "compiled head / the target's faster"],
        [[r["dtype"], f"{r['target_eager_ms']:.2f}", f"{r['target_compiled_ms']:.2f}",
          f"{r['head_eager_ms']:.2f}", f"{r['head_compiled_ms']:.2f}",
          f"{r['ratio_eager']:.3f}", f"{r['ratio_compiled']:.3f}",
          f"**{r['ratio_goal']:.3f}**"] for r in rows],
    )  # fmt: skip
    md = (
        f"# The EAGLE-3 head's step against the target's\n\n{header(env)}. One token after "
        f"{CONTEXT} positions, medians of 30; head: {args.head or 'new, from the target'} "
        f"({rows[0]['draft_vocab']} draft ids); backend {args.backend}.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    write_results(ws.root / "perf", "head_step", {"environment": env, "rows": rows}, md)


if __name__ == "__main__":
    main()
