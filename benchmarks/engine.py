"""The engine's figures: what a step costs, what the loop costs, what the server delivers.

    .venv/bin/python -m benchmarks.engine [--config configs/default.yaml] [--artifacts artifacts]
        [--prompts 4] [--tokens 64] [--steps 40] [--self-draft 2 4 8] [--hf]
        [--parts steps generate server] [--set k=v ...]
    (splits the workspace if it is not split yet; the distilled rows need `make merge`)

1. steps: one decoding step as the step loop runs it (one token fed after a 64-token prefill:
   `runner.step_ms`) of the target, and one draft pass with its full and its pruned head
   (`engine.draft_vocab`; `common.draft_step_ms`), eager and compiled (`compiling.compile_engine`
   with engine.compile=true); and the target's verify of 5 tokens. Goal: draft / target <= 0.16.
2. generate: tokens/s of the step loop (`batch.generate`, one request at a time) on held-out
   prompts: target-only eager vs compiled; the target drafting for itself at each `--self-draft`
   arm (every guess accepted: pure loop overhead; goal fixed_4 >= 0.90x); the distilled draft at
   fixed_1/2/4 (pruned head), compiled; with `--hf`, transformers' own `generate` and assisted
   generation (self-draft, constant schedule), eager. Ratios against compiled target-only; every
   output checked against it.
3. server: `python -m pipeline serve` as users start it: time to /health 200 cold (empty compile
   cache) and warm (restarted), and target-only tokens/s through HTTP, eager vs compiled (one
   request at a time, server.max_batch=1, so requests take the engine). Goal: >= 1.4x eager.

Writes <artifacts>/perf/engine.json and engine.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from dataclasses import replace

import torch

from benchmarks.common import (
    chat,
    draft_step_ms,
    environment,
    header,
    served_model,
    server,
    table,
    write_results,
)
from pipeline import bench, compiling, models, specs
from pipeline.config import load_config
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.batch import RowBatch, generate
from pipeline.speculative.loaded import Models
from pipeline.speculative.propose.draft_model import Drafter
from pipeline.speculative.runner import prepare, step_ms
from pipeline.workspace import Workspace, atomic_write_json, read_jsonl

PARTS = ("steps", "generate", "server")
GOALS = {"draft_target_ratio": 0.16, "server_compiled_speedup": 1.4, "self_draft_fixed_4": 0.90}


def compile_pair(args, ws, pair) -> None:
    """Compile a pair's models as the server does (`compiling.compile_engine`), whatever the
    config says (engine.compile=true: a compile failure is an error, not eager)."""
    cfg = load_config(args.config, [*args.set, "engine.compile=true"])
    t0 = time.perf_counter()
    compiling.compile_engine(cfg, ws, pair)
    print(f"  compiled in {time.perf_counter() - t0:.0f} s", flush=True)


def head_subset(cfg, ws, pair, draft_ref) -> tuple[list[int], str]:
    vocab = pair.target.config.vocab_size
    n = min(cfg.engine.draft_vocab or 8192, vocab)
    eos = sorted(pair.models.eos_token_ids)
    try:
        return models.draft_token_ids(cfg, ws, draft_ref, vocab, eos, n), "recorded token counts"
    except Exception:  # noqa: BLE001 - no counts yet: the cost depends on the size alone
        return list(range(n)), "ids 0..N-1 (no recorded counts: cost only)"


def part_steps(cfg, ws, args) -> dict:
    pair = models.load_pair(cfg, ws, cfg.models.draft, full_head=True, head_dir=None)
    if pair.draft is None:
        raise SystemExit(f"steps: models.draft={cfg.models.draft} is not a draft model")
    subset, source = head_subset(cfg, ws, pair, pair.draft_ref)
    full, pruned = Drafter(pair.draft), Drafter(pair.draft, subset)
    for m in (pair.target, pair.draft):
        prepare(m, cfg.engine.max_context)
    rows = {}
    for tag in ("eager", "compiled"):
        print(f"steps: {tag}", flush=True)
        if tag == "compiled":
            compile_pair(args, ws, pair)
        t = step_ms(pair.target, 1, args.steps)
        v5 = step_ms(pair.target, 5, args.steps)
        df = draft_step_ms(full, args.steps)
        dp = draft_step_ms(pruned, args.steps)
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


def tok_s(cfg, loaded: Models, prompts, k, tokens) -> dict:
    """Tokens/s of the step loop over the whole run (warm-up excluded), one request at a time
    at arm `draft:k`, draft and verify seconds per request, acceptance, and the outputs (to
    check against target-only)."""
    arm = parse_arm(k)
    batch = RowBatch(loaded, max_rows=1, limit=cfg.engine.max_context)
    generate(loaded, prompts[0], arm, 8, batch=batch)  # warm-up
    res = [generate(loaded, p, arm, tokens, batch=batch) for p in prompts]
    secs = sum(r.latency_s for r in res)
    prop = sum(r.proposed for r in res)
    return {
        "tokens_per_second": sum(r.output_tokens for r in res) / secs,
        "acceptance": sum(r.accepted for r in res) / prop if prop else None,
        "draft_s_per_request": sum(r.draft_s for r in res) / len(res),
        "verify_s_per_request": sum(r.verify_s for r in res) / len(res),
        "outputs": [r.token_ids for r in res],
    }


def hf_tok_s(pair, prompts, k, tokens) -> dict:
    """transformers' `generate` (k=0) or assisted generation with the target as its own
    assistant (k tokens, constant schedule, no confidence threshold), greedy."""
    target, tok = pair.target, pair.tokenizer
    gen = target.generation_config
    gen.num_assistant_tokens_schedule, gen.assistant_confidence_threshold = "constant", 0.0
    kw = dict(max_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    if k:
        gen.num_assistant_tokens = k
        kw["assistant_model"] = target
    out, t0 = [], time.perf_counter()
    for ids in prompts:
        seq = target.generate(torch.tensor([ids], device=pair.models.device), **kw)[0]
        out.append(seq[len(ids) :].tolist())
    secs = time.perf_counter() - t0
    eos = pair.models.eos_token_ids
    out = [o[: next((i for i, t in enumerate(o) if t in eos), len(o))] for o in out]
    return {"tokens_per_second": sum(map(len, out)) / secs, "acceptance": None, "outputs": out}


def part_generate(cfg, ws, args, prompts) -> dict:
    rows = {}
    tgt = models.load_pair(cfg, ws, None)
    arms = [k for k in args.self_draft if k > 0]
    print("generate: target-only eager / compiled, self-draft", flush=True)
    rows["target-only eager"] = tok_s(cfg, tgt.models, prompts, 0, args.tokens)
    selfd = models.load_pair(cfg, ws, models.SELF, share_target=tgt) if arms else tgt
    compile_pair(args, ws, selfd)
    rows["target-only compiled"] = tok_s(cfg, selfd.models, prompts, 0, args.tokens)
    for k in arms:
        rows[f"self-draft fixed_{k} compiled"] = tok_s(cfg, selfd.models, prompts, k, args.tokens)
    if args.hf:
        print("generate: transformers generate / assisted (self-draft), eager", flush=True)
        rows["transformers generate"] = hf_tok_s(tgt, prompts, 0, args.tokens)
        for k in arms:
            rows[f"transformers assisted k={k} (self-draft)"] = hf_tok_s(
                tgt, prompts, k, args.tokens
            )
    if (ws.merged / "config.json").is_file():
        pair = models.load_pair(cfg, ws, str(ws.merged), share_target=tgt, full_head=True,
                                head_dir=None)  # fmt: skip
        subset, _ = head_subset(cfg, ws, pair, str(ws.merged))
        eos, pad = sorted(tgt.models.eos_token_ids), tgt.tokenizer.pad_token_id
        pair = replace(pair, models=Models(tgt.target, pair.draft, eos, pad, subset))
        print("generate: distilled draft, compiled, pruned head", flush=True)
        compile_pair(args, ws, pair)
        for k in (1, 2, 4):
            rows[f"distilled fixed_{k} compiled"] = tok_s(cfg, pair.models, prompts, k, args.tokens)
    base = rows["target-only compiled"]["tokens_per_second"]
    ref = rows["target-only eager"]["outputs"]
    for name, row in rows.items():
        row["ratio_to_compiled_target_only"] = row["tokens_per_second"] / base
        row["identical_to_target_only"] = row.pop("outputs") == ref
        print(f"  {name}: {row}", flush=True)
    return rows


def part_server(cfg, ws, args, texts) -> dict:
    out = {}
    # A private compile cache, emptied first: the cold start is really cold.
    cache = ws.root / "perf" / "compile-cache"
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")  # the servers inherit it
    runs = {
        "eager": ["engine.compile=false"],
        "compiled cold": ["engine.compile=auto"],
        "compiled warm": ["engine.compile=auto"],
    }
    for label, overrides in runs.items():
        log = ws.root / "perf" / f"serve-{label.replace(' ', '-')}.log"
        sets = ["server.max_batch=1", *args.set, *overrides]
        with server(args.config, ws.root, "target", sets, log) as (url, ready):
            model = served_model(url)["id"]
            chat(url, model, texts[0], 8)  # warm-up request
            t0 = time.perf_counter()
            n = sum(chat(url, model, t, args.tokens)["usage"]["completion_tokens"] for t in texts)
            secs = time.perf_counter() - t0
        out[label] = {"ready_s": ready, "tokens_per_second": n / secs, "tokens": n}
        print(f"server {label}: {out[label]}", flush=True)
    out["speedup"] = out["compiled warm"]["tokens_per_second"] / out["eager"]["tokens_per_second"]
    return out


def markdown(p: dict) -> str:
    lines = ["# Engine figures", "", f"{header(p['environment'])}. Goals: {p['goals']}.", ""]
    if "steps" in p:
        s = p["steps"]
        lines += [
            f"## One decoding step (median ms; pruned head: {s['head_tokens']} tokens, "
            f"{s['head_source']})",
            "",
            *table(
                [
                    "engine",
                    "target",
                    "draft, full head",
                    "draft, pruned head",
                    "ratio full",
                    "ratio pruned",
                    "target verify of 5",
                    "verify 5 / step",
                ],  # fmt: skip
                [
                    [
                        tag,
                        f"{r['target_ms']:.1f}",
                        f"{r['draft_full_ms']:.1f}",
                        f"{r['draft_pruned_ms']:.1f}",
                        f"{r['ratio_full']:.3f}",
                        f"{r['ratio_pruned']:.3f}",
                        f"{r['target_verify5_ms']:.1f}",
                        f"{r['verify5_over_step']:.2f}",
                    ]  # fmt: skip
                    for tag, r in s["rows"].items()
                ],
            ),
            "",
        ]
    if "generate" in p:
        rows = []
        for name, r in p["generate"].items():
            acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
            split = (
                f"{r['draft_s_per_request']:.2f} / {r['verify_s_per_request']:.2f}"
                if "draft_s_per_request" in r
                else ""
            )
            rows.append([name, f"{r['tokens_per_second']:.1f}",
                         f"{r['ratio_to_compiled_target_only']:.2f}x", acc, split,
                         "yes" if r["identical_to_target_only"] else "NO"])  # fmt: skip
        lines += [
            "## Generation (held-out prompts)",
            "",
            *table(
                [
                    "run",
                    "tokens/s",
                    "vs compiled target-only",
                    "acceptance",
                    "draft / verify s per request",
                    "same output",
                ],
                rows,
            ),  # fmt: skip
            "",
        ]
    if "server" in p:
        sv = p["server"]
        lines += [
            "## Server, target-only through HTTP (one request at a time)",
            "",
            *table(
                ["server", "ready after (s)", "tokens/s"],
                [
                    [k, f"{sv[k]['ready_s']:.0f}", f"{sv[k]['tokens_per_second']:.1f}"]
                    for k in ("eager", "compiled cold", "compiled warm")
                ],  # fmt: skip
            ),
            "",
            f"Compiled / eager through the server: {sv['speedup']:.2f}x.",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument(
        "--self-draft", type=int, nargs="*", default=[2, 4, 8], help="generate: self-draft arms"
    )
    ap.add_argument("--hf", action="store_true", help="generate: also transformers' own")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    args = ap.parse_args()
    cfg = load_config(args.config, args.set)
    ws = Workspace(args.artifacts)
    if not ws.test_file.is_file():  # a fresh workspace (gpu.sh): split it here
        from pipeline import split

        split.run(cfg, ws)
    torch.set_num_threads(os.cpu_count() or 1)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ws.compile_cache / "inductor"))
    rows = read_jsonl(ws.test_file)[: args.prompts]
    tok = models.load_tokenizer(specs.resolve(cfg.models.target, ws.models_cache))
    prompts = bench.prompt_ids(cfg, tok, rows)
    out = {"environment": environment(cfg), "goals": GOALS, "args": vars(args)}
    perf = ws.root / "perf"
    perf.mkdir(parents=True, exist_ok=True)
    parts = {
        "steps": lambda: part_steps(cfg, ws, args),
        "generate": lambda: part_generate(cfg, ws, args, prompts),
        "server": lambda: part_server(cfg, ws, args, [r["prompt"] for r in rows]),
    }
    for name in args.parts:
        out[name] = parts[name]()
        atomic_write_json(perf / "engine.json", out)  # each part kept as soon as it is done
    write_results(perf, "engine", out, markdown(out))


if __name__ == "__main__":
    main()
