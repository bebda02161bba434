"""Distilling on the workload (issue 61): EAGLE-3 heads trained on different data, their
acceptance measured on other workloads. A benchmark, not a test; resumable (finished parts kept).

    # HumanEval: the head trained on the base run's MBPP answers against one trained on those
    # plus HumanEval tasks 0-99 given as a `prompts` file; acceptance at eagle:2 on tasks 100-163
    # and on MBPP's held-out split (needs a finished `make demo` in --artifacts)
    .venv/bin/python -m benchmarks.workloads humaneval --artifacts artifacts

    # Multi-turn: benchmarks.mbpp_chat conversations, split -> distill (turn by turn) -> a head
    # on every turn's answers against one on the first turns' only; acceptance per turn on the
    # held-out conversations, their history the target's own answers (as a server would hold it)
    .venv/bin/python -m benchmarks.workloads multiturn --artifacts artifacts

Both heads of an experiment train for the same --steps (batch train.batch_size, the head's
learning rate, full), so the comparison is the data's, not the compute's. The `mbpp` head of the
HumanEval experiment is the base run's own head when it trained for --steps (the demo's: 256).
Acceptance: greedy, one request at a time in the step loop (`batch.generate`), accepted over
proposed guesses. Writes <artifacts>/perf/workloads/<experiment>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from benchmarks.common import environment, header, run_stage, write_results
from benchmarks.mbpp_chat import build as build_chats
from pipeline import data, models
from pipeline.config import load_config
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.batch import RowBatch, generate
from pipeline.teacher import history
from pipeline.workspace import Workspace, atomic_write_jsonl, read_jsonl


def head_settings(cfg, steps: int) -> list[str]:
    """The demo's head training (`Config.head_config`) for exactly `steps` steps."""
    return [
        "models.draft=eagle3", "models.head=null", "train.method=full", "train.objective=sft",
        f"train.learning_rate={cfg.train.head_learning_rate}", f"train.max_steps={steps}",
        "train.save_steps=100000",
    ]  # fmt: skip


def train_head(args, cfg, root: Path, steps: int, extra=()) -> Path:
    """A head trained in workspace `root` on its data/ and teacher/answers.jsonl."""
    model = root / "adapter" / "model"
    metrics = root / "adapter" / "metrics.json"
    if not (metrics.is_file() and json.loads(metrics.read_text()).get("global_steps") == steps):
        print(f"[{root.name}] training a head for {steps} steps", flush=True)
        sets = head_settings(cfg, steps) + list(extra) + list(args.set)
        run_stage("train", args.config, root, sets, root / "train.log", cache=args.cache)
    return model


def distill(args, root: Path, extra=()) -> None:
    print(f"[{root.name}] distilling what is not answered yet", flush=True)
    sets = ["distill.limit=null", *extra, *args.set]
    run_stage("distill", args.config, root, sets, root / "distill.log", cache=args.cache)


def acceptance(loaded, batch, prompts: list[list[int]], k: int, tokens: int) -> dict:
    acc = prop = 0
    outputs = []
    for ids in prompts:
        r = generate(loaded, ids, parse_arm(k), tokens, batch=batch)
        acc, prop = acc + r.accepted, prop + r.proposed
        outputs.append(r.token_ids)
    return {"acceptance": acc / prop if prop else None, "accepted": acc, "proposed": prop,
            "outputs": outputs}  # fmt: skip


def pair_for(cfg, base: Workspace, target, head: Path):
    pair = models.load_pair(cfg, base, str(head), share_target=target)
    return pair.models, RowBatch(pair.models, max_rows=1, limit=cfg.engine.max_context)


# --- HumanEval ---------------------------------------------------------------------------------
def humaneval(args, cfg, base: Workspace, out: Path) -> dict:
    a, b = args.he_train
    mix = out / "mbpp+humaneval"
    prompts_file = out / f"humaneval-{a}-{b}.prompts.jsonl"
    atomic_write_jsonl(prompts_file, ({"prompt": r["prompt"]} for r in data.humaneval(a, b)))
    he_rows, fmt = data.read_file(prompts_file)  # the user's path: a prompts file
    assert fmt == "prompts" and len(he_rows) == b - a
    answered = {r["task_id"] for r in read_jsonl(base.answers_file)}
    mbpp_rows = [r for r in read_jsonl(base.train_file) if r["task_id"] in answered]
    (mix / "data").mkdir(parents=True, exist_ok=True)
    (mix / "teacher").mkdir(parents=True, exist_ok=True)
    atomic_write_jsonl(mix / "data" / "train.jsonl", mbpp_rows + he_rows)
    shutil.copyfile(base.test_file, mix / "data" / "test.jsonl")
    if not (mix / "teacher" / "answers.jsonl").exists():
        shutil.copyfile(base.answers_file, mix / "teacher" / "answers.jsonl")
    distill(args, mix)
    heads = {
        "mbpp": base_head(args, cfg, base, out),
        "mbpp+humaneval": train_head(args, cfg, mix, args.mix_steps or args.steps),
    }
    target = models.load_pair(cfg, base, None)
    tok, kwargs = target.tokenizer, cfg.template_kwargs()
    sets = {
        f"humaneval {args.he_test[0]}-{args.he_test[1] - 1}": data.humaneval(*args.he_test),
        "mbpp held-out": read_jsonl(base.test_file),
    }
    ids = {n: [models.chat_prompt_ids(tok, data.bench_messages(r), kwargs) for r in rows]
           for n, rows in sets.items()}  # fmt: skip
    table = {}
    for name, head in heads.items():
        loaded, batch = pair_for(cfg, base, target, head)
        for s, prompts in ids.items():
            print(f"[{name}] {s}: {len(prompts)} prompts", flush=True)
            r = acceptance(loaded, batch, prompts, f"eagle:{args.k}", args.tokens)
            table[(name, s)] = {k: v for k, v in r.items() if k != "outputs"}
    return {
        "examples": {"mbpp": len(mbpp_rows), "mbpp+humaneval": len(mbpp_rows) + len(he_rows)},
        "rows": [{"head": h, "set": s, **v} for (h, s), v in table.items()],
    }


def base_head(args, cfg, base: Workspace, out: Path) -> Path:
    """The base run's own head when it trained for --steps, else one trained here on its data."""
    metrics = base.head().adapter / "metrics.json"
    if metrics.is_file() and json.loads(metrics.read_text()).get("global_steps") == args.steps:
        return base.head().merged
    root = out / "mbpp"
    for part in ("data", "teacher"):
        (root / part).mkdir(parents=True, exist_ok=True)
    for src, dst in ((base.train_file, "data/train.jsonl"), (base.test_file, "data/test.jsonl"),
                     (base.answers_file, "teacher/answers.jsonl")):  # fmt: skip
        shutil.copyfile(src, root / dst)
    return train_head(args, cfg, root, args.steps)


# --- multi-turn --------------------------------------------------------------------------------
def multiturn(args, cfg, base: Workspace, out: Path) -> dict:
    chats = out / "mbpp-chats.jsonl"
    n_train, n_test = args.conversations, args.test
    atomic_write_jsonl(chats, build_chats(Path(args.mbpp), n_train + n_test, system=True))
    shaped = [f"teacher.max_tokens={args.answer_tokens}", f"train.max_length={args.max_length}",
              f"engine.max_context={args.max_length}"]  # fmt: skip
    every = out / "every-turn"
    split = [f"data.source={chats}", "data.format=chat", f"data.train_size={n_train}",
             f"data.test_size={n_test}"]  # fmt: skip
    if not (every / "data" / "train.jsonl").exists():
        run_stage("split", args.config, every, split + list(args.set), every / "split.log")
    distill(args, every, ["distill.turns=all", *shaped])
    first = out / "first-turn"
    for part in ("data", "teacher"):
        (first / part).mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "test.jsonl"):
        shutil.copyfile(every / "data" / name, first / "data" / name)
    answers = read_jsonl(every / "teacher" / "answers.jsonl")
    atomic_write_jsonl(first / "teacher" / "answers.jsonl",
                       [r for r in answers if r.get("turn", 0) == 0])  # fmt: skip
    heads = {
        "first turns": train_head(args, cfg, first, args.steps, shaped),
        "every turn": train_head(args, cfg, every, args.steps, shaped),
    }
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(
        update={"max_context": args.max_length})})  # fmt: skip
    target = models.load_pair(cfg, base, None)
    tok, kwargs = target.tokenizer, cfg.template_kwargs()
    held = read_jsonl(every / "data" / "test.jsonl")
    rows, said = [], None  # the first head's outputs: every head sees the same history
    for name, head in heads.items():
        loaded, batch = pair_for(cfg, base, target, head)
        per_turn: dict[int, list[int]] = {}
        outputs = []
        for c, conv in enumerate(held):
            answers_c: list[str] = []
            for t in range(3):
                if said and t > len(said[c]):
                    break
                msgs = history(conv["messages"], t, said[c] if said else answers_c, "all")
                ids = models.chat_prompt_ids(tok, msgs, kwargs)
                if len(ids) + args.answer_tokens > args.max_length:
                    break  # past the context: this turn and later ones are not measured
                r = acceptance(loaded, batch, [ids], f"eagle:{args.k}", args.answer_tokens)
                answers_c.append(tok.decode(r["outputs"][0], skip_special_tokens=True))
                got = per_turn.setdefault(t, [0, 0])
                got[0], got[1] = got[0] + r["accepted"], got[1] + r["proposed"]
            outputs.append(answers_c)
            print(f"[{name}] conversation {c + 1}/{len(held)}", flush=True)
        said = said or outputs
        for t, (acc, prop) in sorted(per_turn.items()):
            rows.append({"head": name, "set": f"turn {t + 1}", "acceptance": acc / prop,
                         "accepted": acc, "proposed": prop})  # fmt: skip
        later = [per_turn[t] for t in per_turn if t >= 1]
        acc, prop = sum(x[0] for x in later), sum(x[1] for x in later)
        rows.append({"head": name, "set": "turns 2+", "acceptance": acc / prop, "accepted": acc,
                     "proposed": prop})  # fmt: skip
    return {"conversations": {"train": n_train, "test": len(held)}, "rows": rows}


def markdown(name: str, results: dict, env: dict, args) -> str:
    sets = list(dict.fromkeys(r["set"] for r in results["rows"]))
    heads = list(dict.fromkeys(r["head"] for r in results["rows"]))
    by = {(r["head"], r["set"]): r for r in results["rows"]}
    steps = f"{args.steps} head steps" + (f" ({args.mix_steps} mixed)" if args.mix_steps else "")
    lines = [header(env), f"{name}: eagle:{args.k} acceptance, greedy, {steps}",
             "", "| head | " + " | ".join(sets) + " |", "|---" * (len(sets) + 1) + "|"]  # fmt: skip
    for h in heads:
        cells = [f"{by[(h, s)]['acceptance']:.3f} ({by[(h, s)]['proposed']})" for s in sets]
        lines.append(f"| {h} | " + " | ".join(cells) + " |")
    if len(heads) == 2:
        a, b = heads
        diffs = [f"{s}: {by[(b, s)]['acceptance'] - by[(a, s)]['acceptance']:+.3f}" for s in sets]
        lines += ["", f"{b} minus {a}: " + ", ".join(diffs)]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("experiment", choices=["humaneval", "multiturn"])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--artifacts", default="artifacts")
    p.add_argument("--steps", type=int, default=256, help="head training steps, every head")
    p.add_argument("--mix-steps", type=int, help="humaneval: the mixed head's steps (--steps)")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=48, help="humaneval: tokens per prompt")
    p.add_argument("--he-train", type=int, nargs=2, default=[0, 100], metavar=("A", "B"))
    p.add_argument("--he-test", type=int, nargs=2, default=[100, 164], metavar=("A", "B"))
    p.add_argument("--mbpp", default=str(Path("..") / "shared" / "data" / "mbpp.jsonl"))
    p.add_argument("--conversations", type=int, default=64, help="multiturn: training side")
    p.add_argument("--test", type=int, default=16, help="multiturn: held-out conversations")
    p.add_argument("--answer-tokens", type=int, default=96, help="multiturn: tokens per answer")
    p.add_argument("--max-length", type=int, default=1024, help="multiturn: tokens per row")
    p.add_argument("--set", nargs="*", default=[], help="config overrides for every stage")
    args = p.parse_args()
    base = Workspace(Path(args.artifacts))
    args.cache = base.cache
    cfg = load_config(args.config, args.set)
    out = base.root / "perf" / "workloads"
    out.mkdir(parents=True, exist_ok=True)
    run = humaneval if args.experiment == "humaneval" else multiturn
    results = run(args, cfg, base, out)
    env = environment(cfg)
    results.update(environment=env, args={k: v for k, v in vars(args).items() if k != "cache"})
    results["args"]["cache"] = str(args.cache)
    text = markdown(args.experiment, results, env, args)
    write_results(out, args.experiment, results, text)


if __name__ == "__main__":
    main()
