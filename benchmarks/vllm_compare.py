"""Phoenix next to vLLM on the same machine, target, draft and prompts.

    .venv/bin/python -m benchmarks.vllm_compare [--config configs/default.yaml]
        [--artifacts artifacts] [--parts teacher fidelity serving] [--answers 16] [--prompts 24]
    (needs `make demo` for the merged draft and `make vllm`; `serving` reads tune-vllm's sweep)

1. teacher: the first --answers training prompts answered by vLLM and by Phoenix's local
   teacher (the same target, fp32, greedy, teacher.max_tokens): how many answers are identical
   token for token, where the first difference falls in the others, and how close the
   target's call is there (its logit gap between the two tokens).
2. fidelity: the served draft's acceptance at k=2 and k=4 on the first --prompts held-out
   prompts (bench.max_new_tokens): Phoenix's step loop (`batch.generate`, one request at a time;
   full head, as vLLM runs the draft; and the configured pruned head) against vLLM's own
   counters over the same requests.
3. serving: aggregate tokens/s at 1 and 8 clients, the same held-out prompts: Phoenix's server
   in target mode and in its best speculative mode (bandit), beside vLLM without speculation
   and with its best fixed k, read from <artifacts>/vllm/tune.json (run tune-vllm first).
4. zero (not in the default parts): vLLM without speculation beside prompt lookup whose schedule
   gives k = 0 from batch size 2 up, over vllm.tune_concurrency: what k = 0 costs inside a
   speculative vLLM.
Writes <artifacts>/perf/vllm_compare.json and .md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import environment, header, server, table, write_results
from pipeline import drafts, loadtest, models, vllm, vllm_tune
from pipeline.config import load_config
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.batch import RowBatch, generate
from pipeline.workspace import Workspace, read_jsonl


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first token index where two answers part (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def part_teacher(cfg, ws: Workspace, args) -> dict:
    rows = read_jsonl(ws.train_file)[: args.answers]
    target = vllm.target_dir(cfg, ws)
    with vllm.VllmServer(cfg, target, None, ws.root / "perf" / "vllm-teacher.log") as srv:
        ep = loadtest.Endpoint(srv.url)
        model = ep.model()
        theirs = []
        for r in rows:
            body = {"model": model, "messages": [{"role": "user", "content": r["prompt"]}],
                    "max_tokens": cfg.teacher.max_tokens, "temperature": 0,
                    "return_token_ids": True,
                    "chat_template_kwargs": cfg.template_kwargs()}  # fmt: skip
            out = ep.session.post(srv.url + "/v1/chat/completions", json=body, timeout=600).json()
            theirs.append(out["choices"][0]["token_ids"])
    local = ws.root / "perf" / "vllm-compare-local"
    mine = {}
    answers = local / "teacher" / "answers.jsonl"
    if not answers.exists():
        from benchmarks.common import run_stage

        (local / "data").mkdir(parents=True, exist_ok=True)
        (local / "data" / "train.jsonl").write_text(ws.train_file.read_text())
        run_stage("distill", args.config, local, [f"distill.limit={args.answers}"],
                  cache=ws.cache)  # fmt: skip
    for a in read_jsonl(answers):
        mine[a["task_id"]] = a["completion_token_ids"]
    pair = models.load_pair(cfg, ws, None)
    eos = set(models.eos_ids(pair.tokenizer, pair.target))
    # vLLM's token_ids end with the end-of-turn token where Phoenix's do not: compare the answers.
    theirs = [t[:-1] if t and t[-1] in eos else t for t in theirs]
    diffs = [first_difference(mine[r["task_id"]], t) for r, t in zip(rows, theirs, strict=True)]
    # Where two answers part, how close the target's own call is: its logit for Phoenix's token
    # minus its logit for vLLM's, one unpadded fp32 forward pass over the shared prefix.
    gaps = []
    for r, t, d in zip(rows, theirs, diffs, strict=True):
        if d is None or d >= min(len(t), len(mine[r["task_id"]])):
            continue
        ours = mine[r["task_id"]]
        ids = models.user_prompt_ids(pair.tokenizer, r["prompt"], cfg.template_kwargs()) + ours[:d]
        with torch.no_grad():
            logits = pair.target(torch.tensor([ids])).logits[0, -1].float()
        gaps.append(round(float(logits[ours[d]] - logits[t[d]]), 4))
    return {
        "answers": len(rows),
        "identical": sum(d is None for d in diffs),
        "first_difference_at": [d for d in diffs if d is not None],
        "logit_gap_at_difference": gaps,
    }


def part_fidelity(cfg, ws: Workspace, args) -> dict:
    served = drafts.resolve_served(cfg, ws)
    draft = vllm.draft_dir(cfg, ws, served)
    tok = models.load_tokenizer(vllm.target_dir(cfg, ws))
    prompts = loadtest.held_out_prompts(ws, args.prompts)
    ids = [models.user_prompt_ids(tok, p, cfg.template_kwargs()) for p in prompts]
    n = cfg.bench.max_new_tokens
    target = models.load_pair(cfg, ws, None)
    out = {"draft": draft, "prompts": len(prompts), "max_new_tokens": n, "k": {}}
    heads = {"full head": True, "pruned head": False} if cfg.engine.draft_vocab else {"": True}
    pairs = {name: models.load_pair(cfg, ws, draft, share_target=target, full_head=full,
                                    head_dir=None)  # draft:K only: no head beside it
             for name, full in heads.items()}  # fmt: skip
    loops = {name: RowBatch(pair.models, max_rows=1, limit=cfg.engine.max_context)
             for name, pair in pairs.items()}  # fmt: skip
    for k in (2, 4):
        row = {}
        for name, loop in loops.items():
            res = [generate(loop.models, p, parse_arm(k), n, batch=loop) for p in ids]
            prop = sum(r.proposed for r in res)
            row[f"phoenix {name}".strip()] = sum(r.accepted for r in res) / prop if prop else None
        spec = vllm.speculative_config("draft_model", draft, k)
        with vllm.VllmServer(cfg, vllm.target_dir(cfg, ws), spec,
                             ws.root / "perf" / f"vllm-k{k}.log") as srv:  # fmt: skip
            ep = loadtest.Endpoint(srv.url)
            model = ep.model()
            ep.chat(model, prompts[0], 8)  # warm-up
            point = loadtest.sweep_point(ep, model, prompts, 1, n)
        row["vllm"] = point["acceptance"]
        row["vllm_per_position"] = point["per_position"]
        out["k"][k] = row
        print(f"fidelity k={k}: {row}", flush=True)
    return out


def part_serving(cfg, ws: Workspace, args) -> dict:
    tune_file = ws.root / "vllm" / "tune.json"
    if not tune_file.is_file():
        raise SystemExit(f"{tune_file} is missing: run `python -m pipeline tune-vllm` first")
    tune = json.loads(tune_file.read_text())
    prompts = loadtest.held_out_prompts(ws)
    rows = {}
    for mode in ("target", "bandit"):
        log = ws.root / "perf" / f"serve-{mode}.log"
        with server(args.config, ws.root, mode, ["traffic.capture=false"], log) as (url, _):
            ep = loadtest.Endpoint(url)
            model = ep.model()
            ep.chat(model, prompts[0], 8)
            rows[f"phoenix {mode}"] = {
                c: loadtest.sweep_point(
                    ep, model, prompts[: max(16, 2 * c)], c, 48, loadtest.NO_CAPTURE
                )["tokens_per_second"]  # fmt: skip
                for c in (1, 8)
            }
    arms = {label: arm for label, arm in tune["arms"].items() if label != "schedule"}
    for c in (1, 8):
        best = max((a for a in arms if a != "0"),
                   key=lambda a, c=c: arms[a]["points"][str(c)]["tokens_per_second"])  # fmt: skip
        rows.setdefault("vllm, no speculation", {})[c] = arms["0"]["points"][str(c)][
            "tokens_per_second"
        ]
        rows.setdefault("vllm, best fixed arm", {})[c] = (
            f"{arms[best]['points'][str(c)]['tokens_per_second']:.1f} ({best})"
        )
    return {"rows": rows, "vllm_from": str(tune_file)}


def part_zero(cfg, ws: Workspace, args) -> dict:
    """Is k = 0 inside a speculative vLLM the same as no speculation? vLLM without speculation,
    then prompt lookup (no model to run) with the schedule k=4 at batch size 1 and 0 above,
    each measured as tune-vllm measures an arm."""
    prompts = loadtest.held_out_prompts(ws)
    arms = {"no speculation": None,
            "ngram, [[1, 1, 4], [2, 1024, 0]]":
                vllm.speculative_config("ngram", None, 4, [[1, 1, 4], [2, 1024, 0]])}  # fmt: skip
    rows = {}
    for i, (label, spec) in enumerate(arms.items()):
        log = ws.root / "perf" / f"vllm-zero-{i}.log"
        arm = vllm_tune.measure(cfg, vllm.target_dir(cfg, ws), spec, log, prompts, label)
        rows[label] = {c: p["tokens_per_second"] for c, p in arm["points"].items()}
        print(f"zero: {label}: {rows[label]}", flush=True)
    return {"rows": rows}


def markdown(p: dict) -> str:
    lines = ["# Phoenix next to vLLM", "", header(p["environment"]) + ".", ""]
    if "teacher" in p:
        t = p["teacher"]
        text = f"Teacher: {t['identical']} of {t['answers']} answers identical token for token"
        if t["first_difference_at"]:
            text += (
                f"; the others part at tokens {t['first_difference_at']}, where the target's "
                f"logit for Phoenix's token minus its logit for vLLM's is "
                f"{t['logit_gap_at_difference']} (near zero: a near-tie that fp32 arithmetic "
                "in two engines may round either way; large: a real disagreement)"
            )
        lines += [text + " (the end-of-turn token aside: vLLM reports it, Phoenix does not).", ""]
    if "fidelity" in p:
        f = p["fidelity"]
        names = [n for n in next(iter(f["k"].values())) if n != "vllm_per_position"]
        lines += table(
            ["k", *names],
            [
                [k, *("-" if r[n] is None else f"{r[n]:.3f}" for n in names)]
                for k, r in f["k"].items()
            ],
        )
        lines.append("")
    if "serving" in p:
        s = p["serving"]["rows"]
        lines += table(
            ["server", "1 client, tokens/s", "8 clients, tokens/s"],
            [
                [name, *(v if isinstance(v, str) else f"{v:.1f}" for v in row.values())]
                for name, row in s.items()
            ],  # fmt: skip
        )
    if "zero" in p:
        rows = p["zero"]["rows"]
        levels = list(next(iter(rows.values())))
        lines += ["", "k = 0 inside a speculative vLLM, aggregate tokens/s:", ""]
        lines += table(
            ["vLLM", *(f"{c} clients" for c in levels)],
            [[name, *(f"{row[c]:.1f}" for c in levels)] for name, row in rows.items()],
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--parts", nargs="+", default=["teacher", "fidelity", "serving"])
    ap.add_argument("--answers", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    cfg = load_config(args.config, args.set)
    ws = Workspace(args.artifacts)
    out = {"environment": environment(cfg)}
    perf = Path(args.artifacts) / "perf"
    parts = {"teacher": part_teacher, "fidelity": part_fidelity, "serving": part_serving,
             "zero": part_zero}  # fmt: skip
    for name in args.parts:
        out[name] = parts[name](cfg, ws, args)
        write_results(perf, "vllm_compare", out, markdown(out))


if __name__ == "__main__":
    main()
