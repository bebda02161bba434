"""The step loop in process (no server): 1 and 8 rows of each arm, the held-out prompts, 48 tokens.

    .venv/bin/python -m benchmarks.loop_arms [--kept ROWS | --held ROWS | --feeds ROWS | --grid
        | --compile-pass | --slots | --pools] [--arms 0 ngram:4 eagle:4] [--set k=v ...]

Prints per arm and row count: steps, wall seconds, tokens/s, mean step, and the loop's measured
step-cost curve ((tokens fed, ms) per size bucket) that the goodput policy predicts with.
`--kept 4 --arms eagle:2`: 4 rows kept full over 16 prompts (one joins as one leaves), all plain,
all eagle:2 held back by the gate, all eagle:2 guessing, all eagle:2 capped per step by the
goodput policy's gate (with its predictions); tokens/s and the head's ms a step
(`--temperature 0.7`: sampled).
`--held 16 --arms 0 eagle:2 ngram:4`: 16 rows kept full over 32 requests (the 16 held-out prompts
twice), every row of an arm held back by the gate at every step (a bandit's rows where it does
not guess), the arms in turns over 4 rounds: tokens/s and the median step per arm, and each
arm's mean against the first's (what a row that carries an arm and does not guess costs).
`--feeds 16`: one target pass over 16 rows (their prompts read, a few steps made) by the tokens each
row is fed: all 1 (a plain step), one row 3 or 5 (one row guessing 2 or 4), four rows 3, all 2,
3 and 5; the median of 12 passes, the shapes alternated (what a batch's first guesses cost).
`--grid --arms eagle:4`: a step's time by rows (1-16) and how many of them guess.
`--compile-pass`: the target's pass compiled as `engine.compile` compiles it (the whole pass, one
graph; minutes) against eager, at 1 to 16 rows of 1 to 5 tokens: pass milliseconds and greedy
agreement (a shape the one warm graph could not take fails).
`--slots`: one target pass of a token a row at 4, 8 and 16 rows (200 positions each), the rows'
cache slots in order (read as a view) against permuted (copied out each layer), alternated.
`--pools`: a target pass on this thread alone, beside another thread that once ran a parallel
torch op and idles (its OpenMP pool alive: libgomp then stops spinning on these 2 cores), and
alone again after that thread ended.
Needs a workspace with the split (`make demo`, or `python -m pipeline split`).
`--set models.dtype=float32` (or bfloat16) pins the dtype; eagle:K arms need
`--set models.head=DIR` (an exported head), draft:K arms `--set server.draft=DIR`.
"""

import argparse
import time

import torch

from pipeline import compiling, models
from pipeline.bench import hardware
from pipeline.config import load_config
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.batch import RowBatch
from pipeline.workspace import Workspace, read_jsonl


def held(pair, prompts, arms: list[str], width: int = 16, n: int = 32, rounds: int = 4) -> None:
    """`width` rows kept full over `n` requests (the prompts in turn, 48 tokens each), every row
    of the arm held back by the gate at every step, for each of `arms` in turns (the order
    reversed every other round): tokens/s and median step per run, then each arm's mean
    tokens/s against the first arm's."""
    from statistics import mean, median

    arms = list(dict.fromkeys(arms))  # each arm once a round (the default list repeats "0")

    hold = lambda rows: [0] * len(rows)  # noqa: E731 - the gate caps every row at 0

    def run(arm: str, count: int) -> tuple[float, float]:
        b = RowBatch(pair.models, max_rows=max(16, width))
        todo, tokens, steps = list(range(count)), 0, []
        t0 = time.perf_counter()
        while todo or b.rows:
            while todo and len(b.rows) < width:
                i = todo.pop(0)
                for r in b.join([(i, prompts[i % len(prompts)], 48, parse_arm(arm))]):
                    r.adaptive = True
            s0 = time.perf_counter()
            finished = b.step(gate=hold)
            steps.append(time.perf_counter() - s0)
            tokens += sum(len(r.out) for r, _ in finished)
        return tokens / (time.perf_counter() - t0), 1000 * median(steps)

    run(arms[0], width)  # warm
    got: dict[str, list[float]] = {a: [] for a in arms}
    for rnd in range(rounds):
        for arm in arms if rnd % 2 == 0 else arms[::-1]:
            tps, ms = run(arm, n)
            got[arm].append(tps)
            print(f"round {rnd + 1}, {arm} held back: {tps:.1f} tok/s, median step {ms:.1f} ms",
                  flush=True)  # fmt: skip
    base = mean(got[arms[0]])
    for arm, v in got.items():
        print(f"{width} rows, {arm} held back: mean {mean(v):.1f} tok/s ({min(v):.1f}-{max(v):.1f}),"
              f" {mean(v) / base:.3f}x {arms[0]}", flush=True)  # fmt: skip


def feeds(pair, prompts, width: int = 16, repeat: int = 12) -> None:
    """One target pass over `width` rows by the tokens each row is fed (module docstring); each
    pass's rows cropped back after it, so every shape reads the same caches."""
    from statistics import median

    from pipeline.speculative.rows import target_logits

    b = RowBatch(pair.models, max_rows=max(16, width))
    b.join([(i, prompts[i % len(prompts)], 48, parse_arm("0")) for i in range(width)])
    for _ in range(3):
        b.step()
    tc = b._cache()
    rows = list(b.rows)
    slots = [r.tslot for r in rows]
    print(f"{width} rows at {min(tc.lengths[s] for s in slots)}-"
          f"{max(tc.lengths[s] for s in slots)} positions", flush=True)  # fmt: skip
    rest = lambda first: first + [1] * (width - len(first))  # noqa: E731
    shapes = {"all 1": [1] * width, "one 3": rest([3]), "one 5": rest([5]),
              "four 3": rest([3] * min(4, width)), "all 2": [2] * width,
              "all 3": [3] * width, "all 5": [5] * width}  # fmt: skip

    def once(sizes: list[int]) -> float:
        fed = [[r.seq[-1]] * n for r, n in zip(rows, sizes, strict=True)]
        lengths = [tc.lengths[s] for s in slots]
        t0 = time.perf_counter()
        with torch.inference_mode():
            target_logits(pair.models.target, tc, slots, fed)
        dt = time.perf_counter() - t0
        for s, n in zip(slots, lengths, strict=True):
            tc.crop(s, n)
        return dt

    times: dict[str, list[float]] = {k: [] for k in shapes}
    for rep in range(repeat):
        for k in shapes if rep % 2 == 0 else list(shapes)[::-1]:
            times[k].append(once(shapes[k]))
    base = median(times["all 1"])
    for k, v in times.items():
        print(f"{k}: {sum(shapes[k])} tokens fed, {1000 * median(v):.1f} ms "
              f"({median(v) / base:.2f}x all 1)", flush=True)  # fmt: skip


def kept(pair, cfg, prompts, arm: str, width: int = 4, n: int = 16,
         temperature: float = 0.0) -> None:  # fmt: skip
    """`width` rows kept full over `n` prompts (a new one joins as one leaves, as a loaded
    server's batch): all plain, all `arm` held back by the gate, all `arm` guessing, and all
    `arm` capped each step by the goodput policy's gate (`GoodputBandit.step_caps`, taught the
    acceptance a first guessing run saw, on the step curves every run adds to, as a server's
    batch keeps them); twice, the
    order reversed; sampled at `temperature` (seeded per prompt), else greedy. Per run:
    tokens/s, the proposals' (head or draft passes) mean milliseconds a step, and for the
    gated run the mean cap and what the policy predicted, at `width` rows, for each cap
    against none."""
    from pipeline.serving.policy import make_policy
    from pipeline.speculative.goodput import StepRow
    from pipeline.speculative.sampling import Sampling

    policy = make_policy(cfg.bandit, ["0", arm], policy="goodput")
    caps: list[float] = []
    gate_s: list[float] = []

    def gated(b: RowBatch):
        def gate(rows):
            t0 = time.perf_counter()
            if not b.cost.seen:
                return [r.k_eff for r in rows]
            draft = b.draft_cost.curve() if b.draft_cost.seen else None
            head = b.head_cost.curve() if b.head_cost.seen else None
            out = policy.may_guess(rows, b.cost.curve(len(rows)), draft, head)
            caps.extend(out)
            gate_s.append(time.perf_counter() - t0)
            return out

        return gate

    shared = RowBatch(pair.models, max_rows=16)  # one set of cost curves, as a server's

    def run(a: str, gate) -> tuple[float, float, RowBatch, list]:
        b = RowBatch(pair.models, max_rows=16)
        b.cost, b.draft_cost, b.head_cost = shared.cost, shared.draft_cost, shared.head_cost
        spent: list[float] = []
        inner = b._propose  # returns the seconds of the head's or the draft's passes
        b._propose = lambda rs, inner=inner: spent.append(inner(rs)) or spent[-1]
        todo, tokens, steps, done = list(range(n)), 0, 0, []
        step_gate = gate(b) if gate is gated else gate
        t0 = time.perf_counter()
        while todo or b.rows:
            while todo and len(b.rows) < width:
                i = todo.pop(0)
                how = Sampling(temperature=temperature, seed=i)
                for r in b.join([(i, prompts[i % len(prompts)], 48, parse_arm(a), how)]):
                    r.adaptive = True
            finished = b.step(gate=step_gate)
            tokens += sum(len(r.out) for r, _ in finished)
            done += [r for r, _ in finished]
            steps += 1
        return tokens / (time.perf_counter() - t0), 1000 * sum(spent) / steps, b, done

    held = lambda rows: [0] * len(rows)  # noqa: E731 - the gate holds every row back
    cases = [("plain", "0", None), (f"{arm} held back", arm, held), (f"{arm} guessing", arm, None),
             (f"{arm} gated", arm, gated)]  # fmt: skip
    run("0", None)  # warm
    *_, done = run(arm, None)  # the acceptance the gate is taught
    for r in done:
        res = r.result("length")
        policy.bandit.update(arm, 1.0, None, None,
                             positions=(res.eligible_per_position, res.proposed_per_position,
                                        res.accepted_per_position))  # fmt: skip
    for rnd in range(2):
        for name, a, gate in cases if rnd == 0 else cases[::-1]:
            caps.clear()
            gate_s.clear()
            tps, ms, b, _ = run(a, gate)
            line = f"{width} rows kept full, {name}: {tps:.1f} tok/s, proposals {ms:.2f} ms a step"
            if gate is gated:
                view = [StepRow(arm, parse_arm(arm).k, True, temperature=temperature)] * width
                draft = b.draft_cost.curve() if b.draft_cost.seen else None
                head = b.head_cost.curve() if b.head_cost.seen else None
                values, _ = policy.bandit.step_values(view, b.cost.curve(width), draft, head)
                line += (f", mean cap {sum(caps) / max(1, len(caps)):.2f}, the gate "
                         f"{1000 * sum(gate_s) / max(1, len(gate_s)):.2f} ms a step, predicted at {width}"
                         " rows: " + " ".join(f"cap {c} {v / values[0]:.3f}x"
                                              for c, v in enumerate(values)))  # fmt: skip
            print(line, flush=True)


def compile_pass(pair) -> None:
    """The target's pass compiled as the server compiles it (`LeanRunner.compile`: the whole pass
    as one graph, inductor's frozen weights and its own CPU GEMMs, warmed at the loop's shapes,
    `engine.compile`), against eager as the loop runs it, at a few (rows, tokens a row) shapes
    after ragged 200-token prefills: the seconds compiling and warming took (torch's compile
    caches as they are), then per shape the medians of 14 passes each way (alternated) and the
    greedy choices' agreement. Every compiled pass runs the one warm graph: a shape it could
    not take fails here (serving would run it eager)."""
    from statistics import median

    from pipeline.speculative.rows import RowCache, target_logits
    from pipeline.speculative.runner import warm_up

    model = pair.target
    run = getattr(model, "_phoenix_runner", None)
    if run is None:
        print("--compile-pass: the target has no lean runner (not a Llama-family model)")
        return
    if not run.compiled:
        t0 = time.perf_counter()
        run.compile()
        warm_up(model)
        print(f"compiled and warm in {time.perf_counter() - t0:.0f} s", flush=True)
    graph = run.graph
    run.stance = "fail_on_recompile"  # a pass the warm graph could not take raises
    cache = RowCache(model, 16, 512, capacity=512)

    def greedy(compiled: bool, slots, feeds) -> list[int]:
        run.graph = graph if compiled else None
        return target_logits(model, cache, slots, feeds).argmax(-1).tolist()

    try:
        for rows, n in ((1, 1), (1, 3), (1, 5), (2, 1), (4, 1), (8, 1), (8, 3), (16, 1), (16, 3)):
            cache.used = 0
            slots = [cache.alloc() for _ in range(rows)]
            greedy(False, slots, [[5] * (200 + r) for r in range(rows)])
            feeds = [[7] * n for _ in slots]
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            picks = {}
            for i in range(16):  # alternated, the order swapped every other pass
                order = ("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")
                for name in order:
                    for r, s in enumerate(slots):
                        cache.crop(s, 200 + r)
                    t0 = time.perf_counter()
                    picks[name] = greedy(name == "compiled", slots, feeds)
                    times[name].append(time.perf_counter() - t0)
            ms = {k: 1000 * median(v[2:]) for k, v in times.items()}
            agree = sum(a == b for a, b in zip(picks["eager"], picks["compiled"], strict=True))
            print(f"{rows} row(s) x {n} token(s): eager {ms['eager']:.1f} ms, compiled "
                  f"{ms['compiled']:.1f} ms ({ms['eager'] / ms['compiled']:.2f}x); greedy "
                  f"choices agree {agree}/{len(picks['eager'])}", flush=True)  # fmt: skip
    finally:
        run.graph, run.stance = graph, None


def slots(pair) -> None:
    """A target pass over rows whose cache slots are in order (`RowCache.plan` reads the cache
    as a view) against the same rows permuted (each layer's keys and values copied out): what
    keeping `RowBatch.rows` in slot order saves. Median of 25 passes each, alternated."""
    from statistics import median

    from pipeline.speculative.rows import RowCache, target_scores

    model = pair.models.target
    for n in (4, 8, 16):
        cache = RowCache(model, n, 1024)
        order = [cache.alloc() for _ in range(n)]
        target_scores(model, cache, order, [[5] * 200 for _ in order])
        permuted = [order[0], order[-1], *order[1:-1]]
        times: dict[str, list[float]] = {"in order": [], "permuted": []}
        for rep in range(30):
            for name, ss in (("in order", order), ("permuted", permuted)):
                t0 = time.perf_counter()
                target_scores(model, cache, ss, [[7] for _ in ss])
                if rep >= 5:
                    times[name].append(time.perf_counter() - t0)
                for s in ss:
                    cache.crop(s, 200)
        a, b = (1000 * median(times[k]) for k in ("in order", "permuted"))
        print(f"{n} rows: slots in order {a:.1f} ms, permuted {b:.1f} ms ({b / a:.2f}x)",
              flush=True)  # fmt: skip


def pools(pair, rounds: int = 3) -> None:
    """A step on this thread alone, and beside another thread that once ran a parallel torch
    op and now idles (it keeps its OpenMP pool while it lives: `serving.scheduler`), then
    alone again once it has ended; medians of 15 one-token and 5-token passes, `rounds` times."""
    import threading

    from pipeline.speculative.runner import step_ms

    def measure(label: str) -> None:
        one, five = step_ms(pair.target, 1, repeat=15), step_ms(pair.target, 5, repeat=15)
        print(f"{label}: 1 token {one:.1f} ms, 5 tokens {five:.1f} ms", flush=True)

    for _ in range(rounds):
        measure("alone")
        release, ready = threading.Event(), threading.Event()

        def idle(ready=ready, release=release) -> None:
            torch.ones(1 << 22).sum()  # one parallel region: this thread's pool exists now
            ready.set()
            release.wait()

        helper = threading.Thread(target=idle)
        helper.start()
        ready.wait()
        measure("beside an idle thread with a pool")
        release.set()
        helper.join()


def grid(pair, prompts, arm: str) -> None:
    """A step's time against rows and tokens fed: n rows (1, 2, 4, 8, 16), of which g guess
    with `arm` (0, 1, n/2, n) and the rest are plain; the median step (draft passes excepted,
    as StepCost times it) per cell. Whether the time is a function of tokens fed alone (what
    one curve assumes) or of rows too."""
    from statistics import median

    print("rows guessing fed_mean step_ms(median) steps", flush=True)
    for n in (1, 2, 4, 8, 16):
        for g in sorted({0, 1, n // 2, n}):
            b = RowBatch(pair.models, max_rows=16)
            b.join([(i, prompts[i], 48, parse_arm(arm if i < g else "0")) for i in range(n)])
            seen: list[tuple[int, int, float]] = []

            def observe(fed, sec, rows=None, b=b, seen=seen, inner=b.cost.observe):
                seen.append((len(b.rows), fed, sec))
                inner(fed, sec, rows)

            b.cost.observe = observe
            while b.rows:
                b.step()
            full = [(f, s) for rows, f, s in seen if rows == n][2:]  # all rows present
            if full:
                fed = sum(f for f, _ in full) / len(full)
                ms = 1000 * median(s for _, s in full)
                print(f"{n} {g} {fed:.1f} {ms:.1f} {len(full)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", nargs="+", default=["0", "ngram:2", "ngram:4", "0"])
    ap.add_argument(
        "--grid",
        action="store_true",
        help="step time against rows and tokens fed, the first of --arms guessing",
    )
    ap.add_argument("--slots", action="store_true", help="a pass with cache slots in order or not")
    ap.add_argument(
        "--compile-pass",
        action="store_true",
        help="the target's whole pass as one compiled graph, against eager",
    )
    ap.add_argument("--pools", action="store_true", help="a step beside another thread's pool")
    ap.add_argument(
        "--kept",
        type=int,
        metavar="ROWS",
        help="ROWS rows kept full over 16 prompts: plain, the first of --arms held back, guessing, gated",
    )
    ap.add_argument(
        "--held",
        type=int,
        metavar="ROWS",
        help="ROWS rows kept full, each of --arms held back in turns: what a held-back row costs",
    )
    ap.add_argument(
        "--feeds",
        type=int,
        metavar="ROWS",
        help="one target pass over ROWS rows by the tokens each is fed (a batch's first guesses)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="--kept: sample at this")
    ap.add_argument("--set", action="append", default=[], help="config key=value")
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(hardware())
    cfg = load_config("configs/default.yaml", args.set)
    ws = Workspace("artifacts")
    arms = [parse_arm(a) for a in args.arms]
    draft = None
    if any(a.needs_draft for a in arms):
        draft = cfg.server.draft if cfg.server.draft not in ("latest", "base") else str(ws.merged)
    elif any(a.needs_head for a in arms):
        draft = models.head_ref(cfg, ws)
    pair = models.load_pair(cfg, ws, draft)
    compiled = compiling.compile_engine(cfg, ws, pair)  # as the server does (engine.compile)
    print(f"dtype {pair.target.dtype}, compiled {compiled}, draft {draft}", flush=True)
    tok = pair.tokenizer
    prompts = [
        models.chat_prompt_ids(tok, [{"role": "user", "content": r["prompt"]}], {})
        for r in read_jsonl(ws.test_file)[:16]
    ]
    if args.grid:
        grid(pair, prompts, args.arms[0])
        return
    if args.slots:
        slots(pair)
        return
    if args.compile_pass:
        compile_pass(pair)
        return
    if args.pools:
        pools(pair)
        return
    if args.kept:
        kept(pair, cfg, prompts, args.arms[0], args.kept, temperature=args.temperature)
        return
    if args.feeds:
        feeds(pair, prompts, args.feeds)
        return
    if args.held:
        held(pair, prompts, args.arms, args.held)
        return
    for arm in args.arms:
        for rows in (1, 8):
            b = RowBatch(pair.models, max_rows=16)
            b.join([(i, prompts[i], 48, parse_arm(arm)) for i in range(rows)])
            heads = []  # the EAGLE-3 head's seconds per step (eagle arms)
            if parse_arm(arm).needs_head:
                b._propose = lambda rs, f=b._propose, h=heads: h.append(f(rs)) or h[-1]
            steps = 0
            t0 = time.perf_counter()
            while b.rows:
                b.step()
                steps += 1
            wall = time.perf_counter() - t0
            curve = [(round(n, 1), round(1000 * s)) for n, s in b.cost.curve()]
            head = f", head {1000 * sum(heads) / steps:.1f} ms a step" if any(heads) else ""
            print(f"{arm:8s} rows {rows}: {steps} steps, {wall:.2f} s, {48 * rows / wall:.1f} tok/s, "
                  f"step {1000 * wall / steps:.0f} ms{head}, curve {curve}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
