"""Which distillation moves acceptance (issue 17): drafts trained on the same answers for the same
wall-clock budget, then measured in the step loop on held-out prompts. A benchmark, not a test.

    # measure drafts that exist (specs or merged directories)
    .venv/bin/python -m benchmarks.acceptance --artifacts artifacts --drafts cut:4 artifacts/merged

    # train every arm, then measure them all (resumable: finished arms are reused)
    .venv/bin/python -m benchmarks.acceptance --artifacts artifacts --train \
        [--arms sft@4 kd@4 kd-top20@4 on-policy@4 sft@6 ...] [--answers 96] [--budget-s 240] \
        [--prompts 16] [--tokens 48] [--k 4]

An arm is `<objective>[-top20][-<divergence>][@<cut layers>]`: sft, kd (dense: the target's full
distribution), kd-top20 (its top 20, as a remote teacher returns them), on-policy, kd-tv, ...;
without @N the config's draft. The README's table came from `--arms sft kd kd-top20 on-policy
sft@6` when the config's draft was cut:4. Rows of earlier runs stay in acceptance.json unless
measured again, so a later `--arms X` adds its row to the table.
Each arm trains in its own workspace (<artifacts>/perf/acceptance/<arm>/) on the first --answers
teacher answers of <artifacts>/teacher/answers.jsonl, full fine-tuning at the config's learning
rate, with max_steps set so that it trains for --budget-s seconds (the seconds per step come from
a 4-step calibration run of the same arm). Then: merge, and in the step loop (`batch.generate`,
one request at a time, eager, the config's pruned head) greedy generation at fixed k on the
held-out prompts: acceptance overall and per draft position, and the draft's and the target's
step costs (one token after a 64-token prefill: `common.draft_step_ms`, `runner.step_ms`).
Writes <artifacts>/perf/acceptance.json and .md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from benchmarks.common import draft_step_ms, environment, header, run_stage, write_results
from pipeline import models
from pipeline.bench import prompt_ids
from pipeline.config import load_config
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.batch import RowBatch, generate
from pipeline.speculative.runner import step_ms
from pipeline.workspace import Workspace, atomic_write_json, atomic_write_text, read_jsonl

DEFAULT_ARMS = ["sft@4", "kd@4", "kd-top20@4", "on-policy@4", "sft@6", "kd-top20@6"]


def arm_settings(arm: str) -> list[str]:
    """`kd-top20-tv@6` -> --set overrides."""
    name, _, cut = arm.partition("@")
    parts = name.split("-")
    objective = {"sft": "sft", "kd": "kd", "on": "on_policy"}[parts[0]]
    rest = parts[2:] if parts[0] == "on" else parts[1:]
    sets = [f"train.objective={objective}", "train.kd_source=target"]
    for p in rest:
        if p.startswith("top"):
            sets.append(f"train.top_logprobs={int(p[3:])}")
        else:
            sets.append(
                f"train.divergence={p.replace('fkl', 'forward_kl').replace('rkl', 'reverse_kl')}"
            )
    if cut:
        sets.append(f"models.draft=cut:{int(cut)}")
    return sets


def prepare(ws: Workspace, arm_root: Path, answers: int, shared_cache: Path) -> None:
    """The arm's workspace: the same split and the first `answers` teacher answers."""
    arm_ws = Workspace(arm_root)
    if arm_ws.answers_file.exists():
        return
    shutil.copytree(ws.data, arm_ws.data, dirs_exist_ok=True)
    arm_ws.teacher.mkdir(parents=True, exist_ok=True)
    rows = ws.answers_file.read_text().splitlines(keepends=True)[:answers]
    atomic_write_text(arm_ws.answers_file, "".join(rows))
    arm_ws.cache.mkdir(parents=True, exist_ok=True)
    if not (arm_ws.cache / "models").exists():
        (arm_ws.cache / "models").symlink_to(shared_cache.resolve())  # converted models, once


def train_arm(args, ws: Workspace, arm: str) -> dict:
    root = ws.root / "perf" / "acceptance" / arm
    prepare(ws, root, args.answers, ws.models_cache)
    arm_ws = Workspace(root)
    done = root / "arm.json"
    if done.exists():
        return json.loads(done.read_text())
    log = root / "arm.log"
    sets = arm_settings(arm) + ["train.method=full", "train.save_steps=100000", *args.set]
    print(f"[{arm}] calibrating ({' '.join(sets)})", flush=True)
    run_stage("train", args.config, root, sets + ["train.max_steps=4"], log)
    cal = json.loads((arm_ws.adapter / "metrics.json").read_text())
    per_step = cal["runtime_s"] / cal["global_steps"]
    steps = max(1, int((args.budget_s - cal.get("target_top_s", 0.0)) / per_step))
    print(f"[{arm}] {per_step:.2f} s/step -> {steps} steps", flush=True)
    t0 = time.perf_counter()
    run_stage("train", args.config, root, sets + [f"train.max_steps={steps}"], log)
    metrics = json.loads((arm_ws.adapter / "metrics.json").read_text())
    run_stage("merge", args.config, root, sets + ["publish.target=none"], log)
    row = {
        "arm": arm,
        "settings": sets,
        "steps": metrics["global_steps"],
        "epochs": metrics["global_steps"] * args.batch_size / metrics["examples"],
        "calibrated_s_per_step": per_step,
        "train_s": metrics["runtime_s"] + metrics.get("target_top_s", 0.0),
        "target_top_s": metrics.get("target_top_s", 0.0),
        "stage_wall_s": time.perf_counter() - t0,
        "first_loss": metrics["first_loss"],
        "last_loss": metrics["last_loss"],
        "teacher_match_last": metrics.get("teacher_match_last"),
        "examples": metrics["examples"],
        "merged": str(arm_ws.merged),
        "draft": next(s.split("=", 1)[1] for s in sets if s.startswith("models.draft="))
        if any(s.startswith("models.draft=") for s in sets)
        else None,
    }
    atomic_write_json(done, row)
    return row


def measure(cfg, ws: Workspace, target, spec: str, args, full_head: bool = False) -> dict:
    """Acceptance at fixed k on the held-out prompts, overall and per position, and the
    draft's step cost (eager, one token, the config's pruned head unless `full_head`)."""
    pair = models.load_pair(
        cfg, ws, spec, share_target=target, full_head=full_head, head_dir=None
    )  # draft:K only: no head beside it
    loaded, arm = pair.models, parse_arm(args.k)
    batch = RowBatch(loaded, max_rows=1, limit=cfg.engine.max_context)
    ids = prompt_ids(cfg, target.tokenizer, read_jsonl(ws.test_file)[: args.prompts])
    acc = prop = 0
    pos_acc = [0] * args.k
    pos_prop = [0] * args.k
    for p in ids:
        r = generate(loaded, p, arm, args.tokens, batch=batch)
        acc, prop = acc + r.accepted, prop + r.proposed
        for i, (a, n) in enumerate(
            zip(r.accepted_per_position, r.proposed_per_position, strict=True)
        ):
            pos_acc[i] += a
            pos_prop[i] += n
    draft_ms = draft_step_ms(loaded.drafter, 30)  # its models prepared by the batch
    target_ms = step_ms(loaded.target, 1, repeat=30)
    return {
        "acceptance": acc / prop if prop else None,
        "accepted": acc,
        "proposed": prop,
        "per_position": [a / n if n else None for a, n in zip(pos_acc, pos_prop, strict=True)],
        "draft_step_ms": draft_ms,
        "target_step_ms": target_ms,
    }


def table(rows: list[dict], k: int) -> str:
    head = (
        f"| arm | draft | steps (epochs) | train s | acceptance k={k} | gain over base | "
        + " | ".join(f"pos {i + 1}" for i in range(k))
        + " | draft step ms | last train match |"
    )
    lines = [head, "|" + "---|" * (8 + k)]
    for r in rows:
        m = r["measured"]
        pos = " | ".join("-" if x is None else f"{x:.3f}" for x in m["per_position"])
        gain = "" if r.get("gain") is None else f"{r['gain']:+.3f}"
        steps = "" if "steps" not in r else f"{r['steps']} ({r['epochs']:.1f})"
        train_s = "" if "train_s" not in r else f"{r['train_s']:.0f}"
        match = "" if r.get("teacher_match_last") is None else f"{r['teacher_match_last']:.3f}"
        lines.append(
            f"| {r['arm']} | {r['draft_spec']} | {steps} | {train_s} | "
            f"**{m['acceptance']:.3f}** | {gain} | {pos} | {m['draft_step_ms']:.1f} | {match} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--drafts", nargs="*", default=[], help="draft specs or directories")
    ap.add_argument("--train", action="store_true", help="train the --arms first")
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS)
    ap.add_argument("--answers", type=int, default=96)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--set", action="append", default=[], help="extra key=value for every arm")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    # Acceptance does not depend on compiling; the step loop stays eager here (no compile waits).
    cfg = load_config(args.config, ["engine.compile=false"])
    ws = Workspace(args.artifacts)
    args.batch_size = load_config(args.config, args.set).train.batch_size
    trained = [train_arm(args, ws, arm) for arm in args.arms] if args.train else []
    target = models.load_pair(cfg, ws, None)
    rows = []
    bases: dict[str, float] = {}
    for spec in args.drafts + sorted({r["draft"] or cfg.models.draft for r in trained}):
        if spec in bases:
            continue
        # A base draft has no recorded token counts of its own: full head.
        m = measure(cfg, ws, target, spec, args, full_head=spec.startswith("cut:"))
        bases[spec] = m["acceptance"]
        rows.append(
            {"arm": "base" if spec.startswith("cut:") else spec, "draft_spec": spec, "measured": m}
        )
        print(f"{spec}: acceptance {m['acceptance']:.3f} at k={args.k}", flush=True)
    for r in trained:
        spec = r["draft"] or cfg.models.draft
        m = measure(cfg, ws, target, r["merged"], args)
        gain = m["acceptance"] - bases[spec] if spec in bases else None
        rows.append({**r, "draft_spec": spec, "measured": m, "gain": gain})
        print(
            f"{r['arm']}: acceptance {m['acceptance']:.3f} ({gain:+.3f}) at k={args.k}", flush=True
        )
    perf = ws.root / "perf"
    earlier = perf / "acceptance.json"
    if args.train and earlier.exists():  # arms measured by an earlier run stay in the table
        measured = {(r["arm"], r["draft_spec"]) for r in rows}
        kept = [
            r
            for r in json.loads(earlier.read_text())["rows"]
            if (r["arm"], r["draft_spec"]) not in measured
        ]
        rows = kept + rows
    env = environment(cfg)
    out = {
        "environment": env,
        "budget_s": args.budget_s if args.train else None,
        "answers": args.answers,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "k": args.k,
        "rows": rows,
    }
    md = (
        f"# Acceptance by distillation arm\n\n{header(env)}. {args.answers} teacher answers, "
        f"{args.budget_s:.0f} s of training per arm, held-out: {args.prompts} prompts x "
        f"{args.tokens} tokens at fixed k={args.k} (engine, eager).\n\n{table(rows, args.k)}\n"
    )
    write_results(perf, "acceptance", out, md)


if __name__ == "__main__":
    main()
