"""Serving under load: Phoenix's server in every mode, and vLLM beside it, from 1 to 16 clients.

    .venv/bin/python -m benchmarks.serving_load [--config configs/default.yaml]
        [--artifacts artifacts] [--clients 1 2 4 8 16] [--requests 32] [--tokens 48]
        [--modes target fixed:4 ngram:4 bandit] [--rounds 4]
        [--vllm 0 draft:2 ngram:4 eagle:3 pard:4] [--set KEY=VALUE]

Needs `make demo` (or split, distill, train, merge) for the held-out prompts and the merged draft;
`--vllm` needs `make vllm` (the vLLM tier; nothing is started without the flag's arms); `--url`
measures a Phoenix server already running (another build, say) instead of starting one.

One Phoenix server (`python -m pipeline serve`, as `make serve` starts it; `--set` passes config
overrides to it, e.g. `engine.compile=false`) serves every mode: each request names its mode
(`phoenix.mode`), so all modes share one engine, one warm-up and one bandit. The bandit starts
fresh (the workspace's saved state is set aside and put back after). Phoenix, and then each vLLM
arm (a vLLM server per arm, the same target and draft), is warmed at every concurrency c (c
requests of 8 tokens, outside every figure; Phoenix's in target mode, so the bandit learns only
from measured requests), then the same held-out prompts in the same order (`--requests`, at
least `--rounds` per client, so every point gets its rounds) go out as streamed chat requests
(`--no-stream`: plain ones, as the openai client sends by default), c at a time, greedy,
`--tokens` each, opted out of traffic capture. The modes of one concurrency are interleaved:
the requests in `--rounds` slices (each at least c long), every mode serving a slice before the
next, the order reversed every other round, so the machine's drift falls on each mode alike.
Per point (the rounds pooled): aggregate output tokens/s over the wall
clock, p50/p95 latency and time to first token, acceptance from the server's own counters, and for
Phoenix the arms that served the requests (the bandit's choices at that concurrency).

Writes <artifacts>/perf/serving_load.{json,md,png}: a table per engine, the bandit's ratios to
target-only and to the best single mode at each concurrency (each with its rounds' range and the
95% interval of their mean, `interval`), and tokens/s against concurrency,
one line per mode and engine.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import time
from pathlib import Path

from benchmarks.common import environment, header, server, table, write_results
from pipeline import loadtest, models, vllm
from pipeline.config import load_config
from pipeline.drafts import resolve_served
from pipeline.errors import ConfigError
from pipeline.serving import heap
from pipeline.workspace import Workspace

NO_CAPTURE = {"capture": False}


def sweep(ep, model, prompts, args, extra, label) -> dict[int, dict]:
    """One mode: `sweep_modes` with it alone."""
    return sweep_modes(ep, model, prompts, args, {label: extra})[label]


def sweep_modes(
    ep, model, prompts, args, extras: dict[str, dict | None], warm: list | None = None
) -> dict[str, dict]:
    """Warm every concurrency (with each of `warm`'s request fields, default every mode's),
    then one point per concurrency and mode, the modes of a concurrency interleaved in
    `--rounds` rounds (`loadtest.interleaved`: on these VMs the same plain work measured 0.88x
    and 1.25x of itself minutes apart, so modes run one after the other compare the machine's
    moments as much as the modes); the same prompts, in order."""
    for extra in extras.values() if warm is None else warm:
        for c in args.clients:
            loadtest.sweep_point(ep, model, prompts[:c], c, 8, extra, stream=args.stream)
    points: dict[str, dict] = {label: {} for label in extras}
    for c in args.clients:
        n = requests_per_point(args.requests, args.rounds, c)
        batch = [prompts[i % len(prompts)] for i in range(n)]
        got = loadtest.interleaved(ep, model, batch, c, args.tokens, extras, args.rounds,
                                   stream=args.stream)  # fmt: skip
        for label, p in got.items():
            if not p["succeeded"]:  # say why (a mode the server refuses), not a TypeError
                raise SystemExit(f"serving_load: mode {label} at {c} client(s): all {p['requests']} "
                                 f"requests failed, e.g. {p['error_examples'][0]}")  # fmt: skip
            if p["errors"]:
                print(f"{label} c={c}: {p['errors']} requests failed, e.g. {p['error_examples'][:1]}",
                      flush=True)  # fmt: skip
            points[label][c] = p
            print(f"{label} c={c}: {p['tokens_per_second']:.2f} tok/s, p95 "
                  f"{p['p95_latency_s']:.2f} s, arms {p['arms']}", flush=True)  # fmt: skip
    return points


def requests_per_point(requests: int, rounds: int, clients: int) -> int:
    """`requests`, or more where that is fewer than `rounds` (at least 2) per client: a round
    needs a request per client, and 16 clients at 32 requests got 2 rounds, whose interval
    (0.5-2.1) told nothing."""
    return max(requests, max(2, rounds) * clients)


def sampled(args) -> dict:
    """The sampled protocol's request fields (`--temperature` > 0); greedy: none."""
    return {"temperature": args.temperature} if args.temperature > 0 else {}


def phoenix_sweep(args, cfg, ws) -> dict:
    prompts = loadtest.held_out_prompts(ws)
    state = ws.state / "bandit.json"
    aside = state.with_name("bandit.json.serving_load")
    if state.exists():
        shutil.move(state, aside)
    started = (
        server(args.config, ws.root, "bandit", args.set, ws.root / "perf" / "serve.log")
        if args.url is None
        else contextlib.nullcontext((args.url, 0.0))
    )
    try:
        with started as (url, ready_s):
            ep = loadtest.Endpoint(url)
            model = ep.model()
            extras = {mode: {"phoenix": {**NO_CAPTURE, "mode": mode}, **sampled(args)}
                      for mode in args.modes}  # fmt: skip
            # The engine is warmed by target-only requests: warming in bandit mode taught the
            # bandit its first acceptance figures from 8-token openings of answers, not from
            # the requests it is measured on.
            target = {"phoenix": {**NO_CAPTURE, "mode": "target"}, **sampled(args)}
            modes = sweep_modes(ep, model, prompts, args, extras, warm=[target])
    finally:
        state.unlink(missing_ok=True)
        if aside.exists():
            shutil.move(aside, state)
    return {"ready_s": ready_s, "modes": modes}


def served_dtype(log_path: Path, cfg) -> str:
    """The Phoenix server's dtype as its log states it (`models.dtype: auto`: what the probe
    chose), else the config's."""
    import re

    try:
        found = re.findall(r"models\.dtype=auto: (\w+) on this CPU", log_path.read_text())
    except OSError:
        found = []
    return f"{found[-1]} (auto)" if found else cfg.models.dtype


def vllm_arms(args, cfg, ws) -> dict:
    """`--vllm` arms -> their --speculative-config, every one checked before anything starts
    (pard:K: the draft guessing K in one pass, its mask token checked; exit with the reason)."""
    served = resolve_served(cfg, ws)
    draft = vllm.draft_dir(cfg, ws, served)
    head = models.head_ref(cfg, ws)  # eagle:K: the EAGLE-3 head beside the draft (models.head)
    spec_of = {}
    for arm in args.vllm:
        strategy, _, k = arm.partition(":")
        if strategy == "eagle" and not head:
            raise SystemExit("--vllm eagle:K serves models.head: set it (--set models.head=DIR)")
        proposer = head if strategy == "eagle" else draft
        try:
            spec_of[arm] = vllm.arm_config(
                "draft" if strategy == "eagle" else strategy, proposer, int(k or 0)
            )
        except ConfigError as exc:
            raise SystemExit(f"--vllm {arm}: {exc}") from None
    return {"draft": served.describe(), "specs": spec_of}


def vllm_sweep(args, cfg, ws, arms: dict) -> dict:
    prompts = loadtest.held_out_prompts(ws)
    target = vllm.target_dir(cfg, ws)
    out = {}
    for arm, spec in arms["specs"].items():
        log_path = ws.root / "perf" / f"vllm-{arm.replace(':', '_')}.log"
        with vllm.VllmServer(cfg, target, spec, log_path) as srv:
            ep = loadtest.Endpoint(srv.url)
            model = ep.model()
            out[arm] = sweep(ep, model, prompts, args, sampled(args), f"vllm {arm}")
    return {"draft": arms["draft"], "arms": out}


def round_ratios(a: dict, b: dict) -> list[float]:
    """Point `a`'s tokens/s over point `b`'s, round by round: two modes of one concurrency serve
    the same slice of prompts one after the other in every round (`loadtest.interleaved`), so
    each round is a paired comparison, and their spread is how far the pooled ratio can be read."""
    ra, rb = a.get("round_tokens_per_second") or [], b.get("round_tokens_per_second") or []
    return [x / y for x, y in zip(ra, rb, strict=False) if y > 0]


# Student's t, two-sided 95%, by degrees of freedom (1-30); past 30, 2.04 (its value at 30).
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
       2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
       2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def interval(ratios: list[float]) -> tuple[float, float, float] | None:
    """The rounds' geometric mean ratio and its 95% interval (Student's t over the rounds'
    log ratios: each round a paired comparison of the same prompts); None under 2 rounds.
    An interval that holds 1.0 cannot tell the two modes apart at these rounds."""
    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = T95[min(n - 1, len(T95)) - 1] * sd / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def spread(ratios: list[float]) -> str:
    """`rounds 0.94-1.06x, 3 of 4 >= 1, mean 0.99x (95%: 0.93-1.05)`: the per-round range of
    a ratio, and its interval (`interval`) where there are 2 rounds or more (empty: no rounds)."""
    if not ratios:
        return ""
    at_least = sum(r >= 1.0 for r in ratios)
    out = f"rounds {min(ratios):.2f}-{max(ratios):.2f}x, {at_least} of {len(ratios)} >= 1"
    if (ci := interval(ratios)) is not None:
        out += f", mean {ci[0]:.2f}x (95%: {ci[1]:.2f}-{ci[2]:.2f})"
    return out


def verdict(phoenix: dict, peers: dict, clients: list[int]) -> list[str]:
    """The issue's goals against what was measured (only those this run can speak to). Each
    ratio to target-only and to the best mode comes with its per-round range and interval
    (`spread`): a pooled 0.98x whose rounds run from 0.90x to 1.06x is the machine's noise, not
    a verdict."""
    modes = phoenix["modes"]

    def tps(points, c):
        return points[c]["tokens_per_second"]

    lines = []
    if "bandit" in modes and "target" in modes:
        for c in clients:
            best = max(modes, key=lambda m: tps(modes[m], c) if m != "bandit" else -1)
            b, t = tps(modes["bandit"], c), tps(modes["target"], c)
            vs_t = spread(round_ratios(modes["bandit"][c], modes["target"][c]))
            vs_b = spread(round_ratios(modes["bandit"][c], modes[best][c]))
            top = tps(modes[best], c)
            # No step of the bandit's rows guessed (or it gave every request plain): it ran
            # target-only's computation, and its ratio is how far the run's slices of identical
            # work drift apart (`loop_arms --held`). Unknown (no counters) is not "none".
            point = modes["bandit"][c]
            share = point.get("guessing_steps_share")
            plain = share is None and set(point["arms"]) <= {"0"}
            same = "" if not (share == 0 or plain) else (
                "; no bandit row guessed a token here: it served as target-only does, so this "
                "ratio is the run's drift between identical work")  # fmt: skip
            lines.append(
                f"- {c} client(s): bandit {b:.2f} tok/s = **{b / t:.2f}x** target-only "
                f"({vs_t or 'no rounds'}), **{b / top:.2f}x** the best single mode ({best}, "
                f"{top:.2f}; {vs_b or 'no rounds'}); arms {modes['bandit'][c]['arms']}{same}"
            )
        if 8 in clients:
            pb, pt = modes["bandit"][8]["p95_latency_s"], modes["target"][8]["p95_latency_s"]
            lines.append(f"- p95 latency at 8 clients: bandit {pb:.2f} s, target-only {pt:.2f} s")
    if peers:
        arms = peers["arms"]
        spec = [a for a in arms if a != "0"]
        if spec and "bandit" in modes and 1 in clients:
            best = max(spec, key=lambda a: tps(arms[a], 1))
            lines.append(
                f"- 1 client: Phoenix bandit {tps(modes['bandit'], 1):.2f} vs vLLM's best "
                f"speculative arm {best} {tps(arms[best], 1):.2f} tok/s"
            )
        if "0" in arms and "target" in modes and 8 in clients:
            p, v = tps(modes["target"], 8), tps(arms["0"], 8)
            lines.append(f"- 8 clients, no speculation: Phoenix {p:.2f} vs vLLM {v:.2f} tok/s "
                         f"= **{p / v:.2f}x**")  # fmt: skip
    return lines


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = [(f"phoenix {m}", pts, "-") for m, pts in results["phoenix"]["modes"].items()]
    lines += [
        (f"vllm {a}", pts, "--") for a, pts in results.get("vllm", {}).get("arms", {}).items()
    ]
    for label, pts, style in lines:
        cs = sorted(pts, key=int)
        ax.plot(cs, [pts[c]["tokens_per_second"] for c in cs], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(results["clients"], [str(c) for c in results["clients"]])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title("Serving under load", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def guessing(p: dict) -> str:
    """The bandit's guessing requests at a point: the mean rows of the batch they joined, the
    share of their steps the per-step gate let them guess, and how many tokens it let them
    guess in those steps (the mean of their caps, each at most what the row's budget left)."""
    rows, share, cap = (p.get(k) for k in ("guessing_joined_rows", "guessing_steps_share",
                                           "guessing_cap"))  # fmt: skip
    if rows is None:
        return "-"
    out = f"{rows:.1f} rows" + (f", {share:.0%}" if share is not None else "")
    return out + (f", {cap:.1f} a step" if cap is not None else "")


def gcs(p: dict) -> str:
    """The server's full garbage collections during a point, and the seconds they held it."""
    if p.get("gc_full") is None:
        return "-"
    return f"{p['gc_full']:.0f} ({p['gc_full_s']:.2f})"


def markdown(results: dict) -> str:
    env = results["environment"]
    out = [f"# Serving under load\n\n{header(env)}\n",
           f"{results['requests']} requests per point (at least one per client a round), "
           f"{results['tokens']} tokens each, {'streamed' if results['stream'] else 'unstreamed'}, "
           + (f"sampled at temperature {results['temperature']}"
              if results.get("temperature") else "greedy") + "; "
           f"config {results['config']} {' '.join(results['sets'])}; Phoenix "
           + (f"at {results['url']} (already running)" if results.get("url") else
              f"ready after {results['phoenix']['ready_s']:.0f} s") + ".\n"]  # fmt: skip
    head = ["engine", "mode", "clients", "tok/s", "p50 s", "p95 s", "TTFT p50 s", "acceptance",
            "arms", "speculated because", "guessing rows: joined at, steps guessed, tokens a step",
            "full GCs (s)"]  # fmt: skip
    rows = []
    engines = [("phoenix", results["phoenix"]["modes"])]
    if "vllm" in results:
        engines.append(("vllm", results["vllm"]["arms"]))
    for engine, modes in engines:
        for mode, pts in modes.items():
            for c in sorted(pts, key=int):
                p = pts[c]
                acc = p.get("acceptance")
                rows.append([engine, mode, c, f"{p['tokens_per_second']:.2f}",
                             f"{p['p50_latency_s']:.2f}", f"{p['p95_latency_s']:.2f}",
                             "-" if p["p50_ttft_s"] is None else f"{p['p50_ttft_s']:.2f}",
                             "-" if acc is None else f"{acc:.3f}",
                             ", ".join(f"{a}: {n}" for a, n in p.get("arms", {}).items()) or "-",
                             ", ".join(f"{a}: {n}" for a, n in
                                       p.get("speculated_because", {}).items()) or "-",
                             guessing(p), gcs(p)])  # fmt: skip
    out += table(head, rows)
    out += ["", "Against the goals:", "", *results["verdict"], ""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4,
                    help="interleave the modes of a concurrency in this many rounds (A B, B A, ...; "
                         "at most requests / clients)")  # fmt: skip
    ap.add_argument("--modes", nargs="+", default=["target", "fixed:4", "ngram:4", "bandit"])
    ap.add_argument(
        "--vllm",
        nargs="*",
        default=[],
        help="vLLM arms: 0, draft:K, ngram:K, eagle:K (models.head), pard:K (a parallel draft)",
    )
    ap.add_argument("--set", action="append", default=[], help="config override for the server")
    ap.add_argument("--url", help="measure this running Phoenix server instead of starting one")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (0: greedy, the default)")  # fmt: skip
    ap.add_argument(
        "--no-stream", dest="stream", action="store_false",
        help="plain (unstreamed) requests, as the openai client sends by default: no TTFT",
    )  # fmt: skip
    args = ap.parse_args()
    cfg = load_config(args.config, args.set)
    ws = Workspace(args.artifacts)
    heap.freeze()  # the clients' process too: a full collection here would stall their reads
    t0 = time.perf_counter()
    results = {"environment": environment(cfg), "config": args.config, "sets": args.set,
               "clients": args.clients, "requests": args.requests, "tokens": args.tokens,
               "stream": args.stream, "url": args.url,
               "temperature": args.temperature}  # fmt: skip
    vllm_specs = vllm_arms(args, cfg, ws) if args.vllm else None  # checked before Phoenix runs
    results["phoenix"] = phoenix_sweep(args, cfg, ws)
    if not args.url:  # the dtype the server ran (models.dtype: auto is its start-up probe's)
        results["environment"]["dtype"] = served_dtype(ws.root / "perf" / "serve.log", cfg)
    if args.vllm:
        results["vllm"] = vllm_sweep(args, cfg, ws, vllm_specs)
    results["verdict"] = verdict(results["phoenix"], results.get("vllm", {}), args.clients)
    results["seconds"] = time.perf_counter() - t0
    folder = ws.root / "perf"
    write_results(folder, "serving_load", results, markdown(results))
    plot(results, folder / "serving_load.png")
    print(f"plot: {folder / 'serving_load.png'}")


if __name__ == "__main__":
    main()
