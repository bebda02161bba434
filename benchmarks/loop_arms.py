"""The step loop in process (no server): 1 and 8 rows of one arm, the held-out prompts, 48 tokens.

    .venv/bin/python -m benchmarks.loop_arms

Prints per arm and row count: steps, wall seconds, tokens/s, mean step, and the loop's measured
step-cost curve ((tokens fed, ms) per size bucket) that the goodput policy predicts with. Needs
a workspace with the split (`make demo`, or `python -m pipeline split`).
"""

import time

import torch

from pipeline import models
from pipeline.bench import hardware
from pipeline.config import load_config
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.batch import RowBatch
from pipeline.workspace import Workspace, read_jsonl


def main() -> None:
    torch.set_num_threads(2)
    print(hardware())
    cfg = load_config("configs/default.yaml", [])
    ws = Workspace("artifacts")
    pair = models.load_pair(cfg, ws, None)
    tok = pair.tokenizer
    prompts = [
        models.chat_prompt_ids(tok, [{"role": "user", "content": r["prompt"]}], {})
        for r in read_jsonl(ws.test_file)[:16]
    ]
    for arm in ("0", "ngram:2", "ngram:4", "0"):
        for rows in (1, 8):
            b = RowBatch(pair.engine, max_rows=16)
            b.join([(i, prompts[i], 48, parse_arm(arm)) for i in range(rows)])
            steps = 0
            t0 = time.perf_counter()
            while b.rows:
                b.step()
                steps += 1
            wall = time.perf_counter() - t0
            curve = [(round(n, 1), round(1000 * s)) for n, s in b.cost.curve()]
            print(f"{arm:8s} rows {rows}: {steps} steps, {wall:.2f} s, {48 * rows / wall:.1f} tok/s, "
                  f"step {1000 * wall / steps:.0f} ms, curve {curve}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
