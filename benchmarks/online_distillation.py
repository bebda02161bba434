"""Online distillation under drift (issue 19): a draft distilled on one family of MBPP tasks
serves another, retrains on the traffic it captured, and is swapped into the running server
while requests are in flight. A benchmark, not a test.

    .venv/bin/python -m benchmarks.online_distillation --config configs/default.yaml \
        --artifacts DIR [--initial 64] [--traffic 112] [--fresh 24] [--clients 24]

The split. All 974 MBPP problems, in task-id order shuffled with seed 42, are cut by family:
the shifted family is string and text manipulation (the problem mentions "string",
"character", "word", "vowel", "uppercase", "lowercase", "palindrome" or "sentence"); the
initial draft is distilled on problems that mention none of those (numbers, lists, tuples,
matrices, geometry). Why: the two families share the task format and the target model, so what
changes is the content (string methods, text vocabulary), the drift a served draft meets when
its users' tasks move; a split by position in the file would shift nothing. The shifted family
gives --fresh prompts that are never served (the acceptance measured before and after) and
--traffic prompts that the clients send (195 shifted problems in all).

Everything lives under DIR/online/, its own artifacts root:
 1. initial: the first --initial problems of the first family -> runs/initial: distill (the
    local teacher), train, merge; `current` points at it, as a promoted retrain run would.
 2. serve: `python -m pipeline serve` (traffic.capture on, server.draft latest, polling off:
    the swap happens on POST /admin/reload-draft at a chosen moment).
 3. before: acceptance at fixed:4 over the fresh shifted prompts, through the server.
 4. traffic: --clients concurrent clients send the traffic prompts (target mode, so the server
    batches them; greedy decoding returns the same tokens in every mode, so the captured
    labels are the ones a speculative mode would have returned). The server captures them.
 5. retrain: `python -m pipeline retrain --set retrain.data=traffic`: no teacher calls;
    training continues from the promoted draft on the captured answers; the gate compares new
    and promoted drafts on the newest held-out traffic; the winner becomes `current`.
 6. swap: --clients clients keep sending traffic prompts (bandit mode, so the draft is in
    use); once /health admits >= 20 requests, POST /admin/reload-draft; every client goes on
    until the swap has been answered and it has had one more reply.
 7. after: acceptance at fixed:4 over the same fresh prompts.
Writes DIR/online/results.json and report.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import requests

from benchmarks.common import run_stage, served_model, server
from pipeline.artifacts import point_current
from pipeline.bench import hardware
from pipeline.config import load_config
from pipeline.split import load_source, make_prompt
from pipeline.workspace import atomic_write_json, atomic_write_jsonl, atomic_write_text

SHIFTED = (
    "string",
    "character",
    "word",
    "vowel",
    "uppercase",
    "lowercase",
    "palindrome",
    "sentence",
)


def families(cfg) -> tuple[list[dict], list[dict]]:
    rows, _, _ = load_source(cfg)
    ordered = sorted(rows, key=lambda r: r["task_id"])
    random.Random(cfg.data.seed).shuffle(ordered)
    shifted = [r for r in ordered if any(w in r["text"].lower() for w in SHIFTED)]
    first = [r for r in ordered if not any(w in r["text"].lower() for w in SHIFTED)]
    return first, shifted


def example(r: dict) -> dict:
    return {"task_id": r["task_id"], "prompt": make_prompt(r), "text": r["text"]}


def pipeline(stage: str, args, root: Path, sets: list[str], log: Path) -> float:
    return run_stage(stage, args.config, root, sets, log, cache=args.online / "cache")[1]


class Client:
    def __init__(self, url: str, model: str, max_tokens: int):
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.sent = self.failed = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def ask(
        self, prompt: str, mode: str, max_tokens: int | None = None, capture: bool = True
    ) -> dict | None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens or self.max_tokens,
            "phoenix": {"mode": mode, "capture": capture},
        }
        with self.lock:
            self.sent += 1
        try:
            r = requests.post(self.url + "/v1/chat/completions", json=body, timeout=900)
            if r.status_code == 200:
                return r.json()
            problem = f"HTTP {r.status_code}: {r.text[:200]}"
        except requests.RequestException as exc:
            problem = repr(exc)
        with self.lock:
            self.failed += 1
            self.errors.append(problem)
        return None


def acceptance(client: Client, prompts: list[str], tokens: int) -> dict:
    acc = prop = 0
    per_pos = [0, 0, 0, 0]
    for p in prompts:
        res = client.ask(p, "fixed:4", tokens, capture=False)  # measuring, not traffic
        if res is None:
            continue
        ph = res["phoenix"]
        acc += ph["accepted"]
        prop += ph["proposed"]
        per_pos = [a + b for a, b in zip(per_pos, ph["accepted_per_position"], strict=False)]
    return {
        "acceptance": acc / prop if prop else None,
        "accepted": acc,
        "proposed": prop,
        "accepted_per_position": per_pos,
        "prompts": len(prompts),
    }


def run_clients(client: Client, prompts: list[str], clients: int, mode: str) -> float:
    todo = list(prompts)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                p = todo.pop(0)
            client.ask(p, mode)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def swap_under_load(
    client: Client, url: str, prompts: list[str], clients: int, max_tokens: int
) -> dict:
    """Clients loop over `prompts` (bandit mode); at >= 20 admitted, ask for the reload; each
    client stops after its first reply that began after the reload was answered."""
    swapped_at: list[float] = []
    stop = threading.Event()
    counter = iter(range(10**9))

    def worker() -> None:
        while True:
            started = time.monotonic()
            client.ask(prompts[next(counter) % len(prompts)], "bandit", max_tokens)
            if swapped_at and started > swapped_at[0]:
                return
            if stop.is_set():
                return

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    admitted, deadline = 0, time.monotonic() + 600
    while time.monotonic() < deadline:
        admitted = requests.get(url + "/health", timeout=30).json().get("admitted", 0)
        if admitted >= 20:
            break
        time.sleep(0.05)
    t0 = time.perf_counter()
    r = requests.post(url + "/admin/reload-draft", timeout=900)
    seconds = time.perf_counter() - t0
    after = requests.get(url + "/health", timeout=30).json().get("admitted", 0)
    swapped_at.append(time.monotonic())
    for t in threads:
        t.join(timeout=1800)
    stop.set()
    return {
        "status": r.status_code,
        "reply": r.json(),
        "admitted_at_reload": admitted,
        "admitted_after_reload": after,
        "request_seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--initial", type=int, default=64, help="initial draft: problems distilled")
    ap.add_argument("--traffic", type=int, default=160, help="shifted prompts served as traffic")
    ap.add_argument("--fresh", type=int, default=24, help="shifted prompts never served")
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of traffic requests")
    ap.add_argument("--eval-tokens", type=int, default=64, help="max_tokens when measuring")
    ap.add_argument("--epochs", type=int, default=2, help="train.epochs of the initial draft")
    ap.add_argument("--retrain-epochs", type=int, default=3, help="train.epochs on the traffic")
    ap.add_argument("--swap-tokens", type=int, default=48, help="max_tokens while swapping")
    args = ap.parse_args()
    args.online = Path(args.artifacts) / "online"
    args.online.mkdir(parents=True, exist_ok=True)
    log = args.online / "pipeline.log"
    cfg = load_config(args.config)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    first, shifted = families(cfg)
    fresh = shifted[: args.fresh]
    served = shifted[args.fresh : args.fresh + args.traffic]
    if len(served) < args.traffic:
        sys.exit(f"only {len(shifted)} shifted problems: lower --traffic or --fresh")
    common = [
        "engine.compile=false",  # acceptance is what this measures; compiling costs minutes
        f"train.epochs={args.epochs}",
        f"teacher.max_tokens={args.tokens}",
        "publish.target=none",
    ]

    # 1. the initial draft, on the first family
    initial = args.online / "runs" / "initial"
    if not (initial / "merged" / "phoenix.json").is_file():
        (initial / "data").mkdir(parents=True, exist_ok=True)
        atomic_write_jsonl(
            initial / "data" / "train.jsonl", [example(r) for r in first[: args.initial]]
        )
        atomic_write_jsonl(initial / "data" / "test.jsonl", [example(r) for r in first[-4:]])
        sets = [*common, f"distill.limit={args.initial}"]
        for stage in ("distill", "train", "merge"):
            timings[f"initial_{stage}_s"] = pipeline(stage, args, initial, sets, log)
    point_current(args.online, "initial")
    (args.online / "runs" / "initial" / "run.json").write_text(json.dumps({"status": "promoted"}))

    # 2. the server
    sets = [*common, "traffic.capture=true", "server.reload_poll_s=0", "server.queue_size=64"]
    log_file, cache = args.online / "server.log", args.online / "cache"
    with server(args.config, args.online, "bandit", sets, log_file, cache) as (url, _ready):
        model = served_model(url)
        draft_before = model["metadata"]["draft"]
        client = Client(url, model["id"], args.tokens)
        fresh_prompts = [make_prompt(r) for r in fresh]

        # 3. before
        t0 = time.perf_counter()
        before = acceptance(client, fresh_prompts, args.eval_tokens)
        timings["before_s"] = time.perf_counter() - t0
        print(f"acceptance before: {before['acceptance']:.4f}", flush=True)

        # 4. traffic
        traffic_prompts = [make_prompt(r) for r in served]
        timings["traffic_s"] = run_clients(client, traffic_prompts, args.clients, "target")

        # 5. retrain on what was captured
        # The gate's bench: target and fixed:4 rows for both drafts (and their bandit rows).
        sets = [*common, "retrain.data=traffic", "retrain.min_gain=0.0", "bench.fixed_arms=[4]"]
        sets.append(f"train.epochs={args.retrain_epochs}")  # the later --set wins
        rc, timings["retrain_s"] = run_stage(
            "retrain", args.config, args.online, sets, log, allow=(0, 5)
        )
        runs = sorted(d for d in (args.online / "runs").iterdir() if d.name != "initial")
        gate = json.loads((runs[-1] / "gate.json").read_text()) if runs else None
        print(f"retrain exit {rc}; gate: {gate and gate['reason']}", flush=True)

        # 6. swap while traffic is in flight
        t0 = time.perf_counter()
        swap = swap_under_load(client, url, traffic_prompts, args.clients, args.swap_tokens)
        timings["swap_phase_s"] = time.perf_counter() - t0
        draft_after = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["metadata"]

        # 7. after
        t0 = time.perf_counter()
        after = acceptance(client, fresh_prompts, args.eval_tokens)
        timings["after_s"] = time.perf_counter() - t0
        metrics = requests.get(url + "/metrics", timeout=10).text

    captured = sum(1 for p in (args.online / "traffic").glob("traffic-*.jsonl") for _ in open(p))
    results = {
        "acceptance_before": before["acceptance"],
        "acceptance_after": after["acceptance"],
        "acceptance_gain": (after["acceptance"] or 0) - (before["acceptance"] or 0),
        "requests_sent": client.sent,
        "requests_failed": client.failed,
        "reload_seconds": swap["reply"].get("seconds"),
        "reload_paused_generation_s": swap["reply"].get("paused_s"),
        "in_flight_at_reload": swap["admitted_at_reload"],
        "swap": swap,
        "before": before,
        "after": after,
        "draft_before": draft_before,
        "draft_after": draft_after["draft"],
        "retrain_exit": rc,
        "gate": gate,
        "captured_records": captured,
        "split": {
            "shifted_words": SHIFTED,
            "first_family": len(first),
            "shifted_family": len(shifted),
            "initial": args.initial,
            "traffic": len(served),
            "fresh": len(fresh),
            "seed": cfg.data.seed,
        },
        "settings": vars(args) | {"online": str(args.online)},
        "timings_s": timings,
        "total_s": time.perf_counter() - t_start,
        "errors": client.errors[:10],
        "machine": hardware(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "draft_metrics": [
            line for line in metrics.splitlines() if "draft_" in line and not line.startswith("#")
        ],
    }
    atomic_write_json(args.online / "results.json", results)
    report = "\n".join(
        [
            f"# Online distillation ({results['date']}, {results['machine']})",
            "",
            f"- acceptance at fixed:4 on {len(fresh)} fresh shifted prompts: "
            f"{before['acceptance']:.4f} before, {after['acceptance']:.4f} after "
            f"({results['acceptance_gain']:+.4f})",
            f"- requests: {client.sent} sent, {client.failed} failed; {swap['admitted_at_reload']} "
            f"in flight when the reload was asked",
            f"- reload: {results['reload_seconds']} s (generation paused "
            f"{results['reload_paused_generation_s']} s)",
            f"- gate: {gate and gate['reason']}",
            f"- total {results['total_s'] / 60:.1f} min: "
            + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()),
        ]
    )
    atomic_write_text(args.online / "report.md", report + "\n")
    print(report)


if __name__ == "__main__":
    main()
