"""What a k+1-token verify costs in matmuls on this CPU: SmolLM2-135M's linear layers (random
weights of the same shapes; the cost does not depend on the values) at 1, 2, 5 and 9 rows.

    .venv/bin/python -m benchmarks.matmul_rows [--threads 2] [--repeat 20]

Prints, per row count, median milliseconds of:
  - all of the target's linears once (30 layers x 7, plus the 49,152 x 576 head), `F.linear`:
    the floor of one decoding step in fp32, whatever the compiler does around it;
  - the head alone three ways: `F.linear` (x @ W.T), the engine's skinny form (W @ x.T), and
    blocked (the head split into 8,192-row blocks, every row per block).
Speculation assumes a verify of k+1 rows costs about one row (weights are streamed once).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pipeline.bench import hardware
from pipeline.speculative.cpu import median_ms

HIDDEN, INTER, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152


@torch.inference_mode()
def measure(rows: int, weights: list[torch.Tensor], head: torch.Tensor, repeat: int) -> str:
    xs = {n: torch.randn(rows, n) for n in (HIDDEN, INTER)}
    x = xs[HIDDEN]
    blocks = head.split(8192)
    layers = median_ms(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], repeat, warm=3)
    plain = median_ms(lambda: F.linear(x, head), repeat, warm=3)
    skinny = median_ms(lambda: torch.mm(head, x.t()).t().contiguous(), repeat, warm=3)
    blocked = median_ms(lambda: torch.cat([F.linear(x, b) for b in blocks], 1), repeat, warm=3)
    return f"| {rows} | {layers + plain:.1f} | {plain:.1f} | {skinny:.1f} | {blocked:.1f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)]
    layer += [(INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    weights = [torch.randn(*s) for _ in range(LAYERS) for s in layer]
    head = torch.randn(VOCAB, HIDDEN)
    print(f"{hardware()}, {args.threads} threads, fp32, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip
    print("| rows | all linears, F.linear | head F.linear | head W @ x.T | head blocked |")
    print("|---|---|---|---|---|")
    for rows in (1, 2, 5, 9):
        print(measure(rows, weights, head, args.repeat))


if __name__ == "__main__":
    main()
