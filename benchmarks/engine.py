"""Issue 16's engine figures, from one run on this machine (a benchmark, not a test).

    .venv/bin/python benchmarks/engine.py [--config configs/default.yaml] [--artifacts artifacts]
        [--prompts 4] [--tokens 64] [--steps 40] [--parts steps generate server] [--set k=v ...]
    (splits the workspace if it is not split yet; the distilled rows need `make merge`)

1. steps: the cost of one decoding step (one token fed, static vs growing cache as each engine
   uses it): the target, and the draft with its full and its pruned head (`engine.draft_vocab`),
   eager and compiled. Goal: draft / target <= 0.16.
2. generate: tokens/s of the engine on held-out prompts: target-only eager vs compiled, the
   target drafting for itself (fixed_4, every guess accepted: pure loop overhead; goal >= 0.90x)
   and the distilled draft at fixed_1/2/4 (pruned head), compiled, against compiled target-only.
3. server: `python -m pipeline serve` as users start it: time to /health 200 cold (empty compile
   cache) and warm (restarted), and target-only tokens/s through HTTP, eager vs compiled (one
   request at a time, server.max_batch=1, so requests take the engine). Goal: >= 1.4x eager.

Writes <artifacts>/perf/engine.json and engine.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

from pipeline import bench, models
from pipeline.bench import environment
from pipeline.config import load_config
from pipeline.speculative.engine import SpeculativeEngine, _crop_to
from pipeline.teacher import serve_command
from pipeline.workspace import Workspace, atomic_write_json, atomic_write_text, read_jsonl

PARTS = ("steps", "generate", "server")
BACKEND = ["inductor"]  # engine.backend of the run's config
GOALS = {"draft_target_ratio": 0.16, "server_compiled_speedup": 1.4, "self_draft_fixed_4": 0.90}


def step_ms(
    eng: SpeculativeEngine, which: str, prompt: list[int], steps: int, feed: int = 1
) -> float:
    """Median milliseconds of one step of the target (`feed` tokens: 1 = decode, k+1 = a
    verify) or the draft (one token), after a prefill; the cache is cut back after each step so
    every step sees the same length."""
    t_cache, d_cache = eng._new_caches(with_draft=which == "draft")
    cache = t_cache if which == "target" else d_cache
    run = (
        (lambda ids: eng._target(ids, cache, keep=len(ids)))
        if which == "target"
        else (lambda ids: eng._draft(ids, cache))
    )
    run(prompt)
    n = len(prompt)
    times = []
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    for i in range(steps + 3):
        sync()
        t0 = time.perf_counter()
        run(prompt[i % n : i % n + 1] * (feed if which == "target" else 1))
        sync()
        times.append(time.perf_counter() - t0)
        _crop_to(cache, n)
    return 1000 * sorted(times[3:])[len(times[3:]) // 2]  # median: robust to a noisy neighbour


def make_engine(pair, draft, static_len, subset, compiled, arms):
    eng = SpeculativeEngine(
        pair.target,
        draft,
        sorted(pair.engine.eos_token_ids),
        pair.tokenizer.pad_token_id,
        static_len=static_len,
        draft_token_ids=subset,
    )
    if compiled:
        t0 = time.perf_counter()
        cuda = eng.device.type == "cuda"
        eng.compile_steps(arms, mode="reduce-overhead" if cuda else None, backend=BACKEND[0])
        if not cuda:
            models.use_cpu_gqa()  # as models.compile_engine compiles for the server
        eng.warm_up(arms)
        print(f"  compiled arms {arms} in {time.perf_counter() - t0:.0f} s", flush=True)
    return eng


def head_subset(cfg, ws, pair, draft_ref) -> tuple[list[int], str]:
    vocab = pair.target.config.vocab_size
    n = min(cfg.engine.draft_vocab or 8192, vocab)
    try:
        ids = models.draft_token_ids(
            cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"draft_vocab": n})}),
            ws,
            draft_ref,
            vocab,
            sorted(pair.engine.eos_token_ids),
        )
        return ids, "recorded token counts"
    except Exception:  # noqa: BLE001 - no counts yet: the cost depends on the size alone
        return list(range(n)), "ids 0..N-1 (no recorded counts: cost only)"


def _full_head(cfg):
    """The config with engine.draft_vocab=0: engines here prune (or not) themselves."""
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"draft_vocab": 0})})


def part_steps(cfg, ws, args, prompt) -> dict:
    pair = models.load_pair(_full_head(cfg), ws, cfg.models.draft)
    subset, source = head_subset(cfg, ws, pair, pair.draft_ref)
    rows = {}
    for compiled in (False, True):
        static = cfg.engine.max_context if compiled else None
        tag = "compiled" if compiled else "eager"
        print(f"steps: {tag}", flush=True)
        full = make_engine(pair, pair.draft, static, None, compiled, [1, 4])
        pruned = make_engine(pair, pair.draft, static, subset, compiled, [1, 4])
        t = step_ms(full, "target", prompt, args.steps)
        v5 = step_ms(full, "target", prompt, args.steps, feed=5)
        df = step_ms(full, "draft", prompt, args.steps)
        dp = step_ms(pruned, "draft", prompt, args.steps)
        rows[tag] = {
            "target_ms": t,
            "draft_full_ms": df,
            "draft_pruned_ms": dp,
            "ratio_full": df / t,
            "ratio_pruned": dp / t,
            "target_verify5_ms": v5,
            "verify5_over_step": v5 / t,
        }
        print(f"  {rows[tag]}", flush=True)
    return {"head_tokens": len(subset), "head_source": source, "rows": rows}


def tok_s(eng, prompts, k, tokens) -> dict:
    eng.generate(prompts[0], k, 8)  # warm-up
    res = [eng.generate(p, k, tokens) for p in prompts]
    secs = sum(r.latency_s for r in res)
    prop = sum(r.proposed for r in res)
    return {
        "tokens_per_second": sum(r.output_tokens for r in res) / secs,
        "acceptance": sum(r.accepted for r in res) / prop if prop else None,
        "outputs": [r.token_ids for r in res],
    }


def part_generate(cfg, ws, args, prompts) -> dict:
    rows = {}
    static = cfg.engine.max_context
    tgt = models.load_pair(cfg, ws, None)
    print("generate: target-only eager / compiled", flush=True)
    rows["target-only eager"] = tok_s(
        make_engine(tgt, None, None, None, False, [0]), prompts, 0, args.tokens
    )
    k = args.self_draft
    selfd = make_engine(tgt, tgt.target if k else None, static, None, True, [0, k])
    rows["target-only compiled"] = tok_s(selfd, prompts, 0, args.tokens)
    if k:
        rows[f"self-draft fixed_{k} compiled"] = tok_s(selfd, prompts, k, args.tokens)
    if (ws.merged / "config.json").is_file():
        pair = models.load_pair(_full_head(cfg), ws, str(ws.merged), share_target=tgt)
        subset, _ = head_subset(cfg, ws, pair, str(ws.merged))
        print("generate: distilled draft, compiled, pruned head", flush=True)
        eng = make_engine(tgt, pair.draft, static, subset, True, [1, 2, 4])
        for k in (1, 2, 4):
            rows[f"distilled fixed_{k} compiled"] = tok_s(eng, prompts, k, args.tokens)
    base = rows["target-only compiled"]["tokens_per_second"]
    ref = rows["target-only eager"]["outputs"]
    for name, row in rows.items():
        row["ratio_to_compiled_target_only"] = row["tokens_per_second"] / base
        row["identical_to_target_only"] = row.pop("outputs") == ref
        print(f"  {name}: {row}", flush=True)
    return rows


def _serve(args, art: Path, overrides: list[str], log: Path):
    port = 8700 + os.getpid() % 200
    sets = [x for o in ["server.max_batch=1", *args.set, *overrides] for x in ("--set", o)]
    cmd = serve_command(args.config, art, port, "target", sets)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1)
    return proc, url, time.perf_counter() - t0


def _chat(url: str, model: str, text: str, tokens: int) -> int:
    msg = [{"role": "user", "content": text}]
    body = json.dumps(
        {"model": model, "messages": msg, "max_tokens": tokens, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def part_server(cfg, ws, args, texts) -> dict:
    out = {}
    # A private compile cache, emptied first: the cold start is really cold.
    cache = ws.root / "perf" / "compile-cache"
    shutil.rmtree(cache, ignore_errors=True)
    env_cache = ["engine.compile=false"], ["engine.compile=auto"], ["engine.compile=auto"]
    for label, overrides in zip(
        ("eager", "compiled cold", "compiled warm"), env_cache, strict=True
    ):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
        log = ws.root / "perf" / f"serve-{label.replace(' ', '-')}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        proc, url, ready = _serve(args, ws.root, overrides, log)
        try:
            model = cfg.models.served_name or cfg.models.target
            _chat(url, model, texts[0], 8)  # warm-up request
            t0 = time.perf_counter()
            n = sum(_chat(url, model, t, args.tokens) for t in texts)
            secs = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        out[label] = {"ready_s": ready, "tokens_per_second": n / secs, "tokens": n}
        print(f"server {label}: {out[label]}", flush=True)
    out["speedup"] = out["compiled warm"]["tokens_per_second"] / out["eager"]["tokens_per_second"]
    return out


def markdown(p: dict) -> str:
    env = p["environment"]
    lines = [
        "# Engine figures (issue 16)",
        "",
        f"{env['hardware']}, {env['threads']} threads, {env['dtype']}, torch {env['torch']}, "
        f"{env['date']}. Goals: {p['goals']}.",
        "",
    ]
    if "steps" in p:
        s = p["steps"]
        lines += [
            f"## One decoding step (median ms; pruned head: {s['head_tokens']} tokens, "
            f"{s['head_source']})",
            "",
            "| engine | target | draft, full head | draft, pruned head | ratio full | ratio pruned "
            "| target verify of 5 | verify 5 / step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for tag, r in s["rows"].items():
            lines.append(
                f"| {tag} | {r['target_ms']:.1f} | {r['draft_full_ms']:.1f} | "
                f"{r['draft_pruned_ms']:.1f} | {r['ratio_full']:.3f} | {r['ratio_pruned']:.3f} "
                f"| {r['target_verify5_ms']:.1f} | {r['verify5_over_step']:.2f} |"
            )
        lines.append("")
    if "generate" in p:
        lines += [
            "## Generation (engine, held-out prompts)",
            "",
            "| run | tokens/s | vs compiled target-only | acceptance | same output |",
            "|---|---|---|---|---|",
        ]
        for name, r in p["generate"].items():
            acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
            lines.append(
                f"| {name} | {r['tokens_per_second']:.1f} | "
                f"{r['ratio_to_compiled_target_only']:.2f}x | {acc} | "
                f"{'yes' if r['identical_to_target_only'] else 'NO'} |"
            )
        lines.append("")
    if "server" in p:
        sv = p["server"]
        lines += [
            "## Server, target-only through HTTP (one request at a time)",
            "",
            "| server | ready after (s) | tokens/s |",
            "|---|---|---|",
        ]
        for label in ("eager", "compiled cold", "compiled warm"):
            r = sv[label]
            lines.append(f"| {label} | {r['ready_s']:.0f} | {r['tokens_per_second']:.1f} |")
        lines += ["", f"Compiled / eager through the server: {sv['speedup']:.2f}x.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument(
        "--self-draft", type=int, default=4, help="generate: the self-draft arm (0: skip it)"
    )
    ap.add_argument(
        "--parts", nargs="+", choices=list(PARTS), default=list(PARTS), help="what to measure"
    )
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    args = ap.parse_args()
    cfg = load_config(args.config, args.set)
    BACKEND[0] = cfg.engine.backend
    ws = Workspace(args.artifacts)
    if not ws.test_file.is_file():  # a fresh workspace (gpu.sh): split it here
        from pipeline import split

        split.run(cfg, ws)
    torch.set_num_threads(os.cpu_count() or 1)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ws.compile_cache / "inductor"))
    rows = read_jsonl(ws.test_file)[: args.prompts]
    tok = models.load_tokenizer(models.resolve(cfg.models.target, ws.models_cache))
    prompts = bench.prompt_ids(cfg, tok, rows)
    out = {
        "environment": environment(cfg, models.pick_device(cfg.models.device)),
        "goals": GOALS,
        "args": vars(args),
    }
    perf = ws.root / "perf"
    perf.mkdir(parents=True, exist_ok=True)
    parts = {
        "steps": lambda: part_steps(cfg, ws, args, prompts[0]),
        "generate": lambda: part_generate(cfg, ws, args, prompts),
        "server": lambda: part_server(cfg, ws, args, [r["prompt"] for r in rows]),
    }
    for name in args.parts:
        out[name] = parts[name]()
        atomic_write_json(perf / "engine.json", out)  # each part kept as soon as it is done
    text = markdown(out)
    atomic_write_text(perf / "engine.md", text)
    print(text)


if __name__ == "__main__":
    main()
