"""What one full garbage collection costs a server, before and after its start-up heap is frozen.

    .venv/bin/python -m benchmarks.gc_heap [--config configs/default.yaml] [--artifacts artifacts]
        [--set engine.compile=auto] [--set KEY=VALUE]

Builds the server's core as `make serve` does (`serving.core.build_core`: the target, the served
draft and head, compiled per `engine.compile`, calibrated), with the server's modules imported,
then times three full collections (`gc.collect()`: each holds the GIL, so every row of the step
loop waits it out), freezes the heap as the server does before /health turns 200
(`serving.heap.freeze`), and times three more. Writes <artifacts>/perf/gc_heap.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

from benchmarks.common import environment, header, table, write_results
from pipeline.config import load_config
from pipeline.drafts import resolve_served
from pipeline.serving import heap
from pipeline.serving.core import build_core
from pipeline.workspace import Workspace


def collections(n: int = 3) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        gc.collect()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--set", action="append", default=[], help="config key=value")
    args = ap.parse_args()
    cfg = load_config(args.config, args.set)
    ws = Workspace(Path(args.artifacts))
    import pipeline.server  # noqa: F401 - the server's modules are part of its heap

    t0 = time.perf_counter()
    core = build_core(cfg, ws, resolve_served(cfg, ws))
    loaded_s = time.perf_counter() - t0
    try:
        tracked = len(gc.get_objects())
        before = collections()
        frozen, _ = heap.freeze()
        after = collections()
        left = len(gc.get_objects())
    finally:
        heap.release()
        core.close()
    env = environment(cfg)
    env["dtype"] = str(core.pair.target.dtype).removeprefix("torch.")  # `auto`: what it chose
    results = {
        "environment": env,
        "sets": args.set,
        "compiled": core.compiled,
        "loaded_s": loaded_s,
        "tracked": tracked,
        "full_collection_s": before,
        "frozen": frozen,
        "tracked_after": left,
        "full_collection_frozen_s": after,
    }
    ms = ", ".join
    md = [
        f"# A full garbage collection, before and after the heap is frozen\n\n"
        f"{header(results['environment'])}\n",
        f"The server's core ({'compiled' if core.compiled else 'eager'}; "
        f"{' '.join(args.set) or 'config as is'}), built in {loaded_s:.0f} s.\n",
        *table(
            ["heap", "objects a collection walks", "full collection, ms (three)"],
            [
                ["as loaded", tracked, ms(f"{1000 * s:.1f}" for s in before)],
                [f"frozen ({frozen} objects)", left, ms(f"{1000 * s:.1f}" for s in after)],
            ],
        ),
        "",
    ]
    write_results(ws.root / "perf", "gc_heap", results, "\n".join(md))


if __name__ == "__main__":
    main()
