"""EAGLE-3 heads against the cut draft (issue 31): train a head on the teacher's answers, export
it in the speculators format, and measure held-out acceptance beside a merged draft. A benchmark,
not a test.

    .venv/bin/python -m benchmarks.eagle3_head --artifacts artifacts --answers 128 \
        [--epochs 4] [--lr 1e-3] [--ttt 4] [--kd N] [--k 4] [--prompts 50] [--tokens 48] \
        [--drafts artifacts/merged] [--name h128]

The target's hidden states over every training prompt + answer are computed once and cached
under <artifacts>/eagle3/ (keyed by the target's weights and the answers' tokens). The head is
exported to <artifacts>/perf/eagle3/<name>/head/. Acceptance, greedy at fixed k on the first
--prompts held-out prompts for --tokens tokens:
  - a draft (a merged directory or spec): in the step loop (`batch.generate`, eager);
  - the head: its rounds replayed on the target's own greedy output (the head's `propose` with
    the target's hidden states of the committed tokens, read from one forward over prompt +
    output; the guesses checked against the target's tokens). Greedy output does not depend on
    the guesses, so this is the round sequence an eagle:K row of the step loop runs (its first
    step feeds the prompt's last token; K capped by the budget), with the target's hidden
    states from one pass instead of from each verify pass (bf16/fp32 rounding apart).
Per row: acceptance, per position, tokens per target pass ((accepted + rounds) / rounds), the
step costs (ms; the head's: one token after the prompt, cache held; a draft's and the target's:
one token after a 64-token prefill, `common.draft_step_ms` and `runner.step_ms`) and the
training time.
Writes <artifacts>/perf/eagle3_head.json and .md (rows of earlier runs kept by name).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import draft_step_ms, environment, header, write_results
from pipeline import distillation, eagle3, models, specs, train
from pipeline.artifacts import weights_id
from pipeline.bench import prompt_ids
from pipeline.config import load_config
from pipeline.speculative.arms import PLAIN, parse_arm
from pipeline.speculative.batch import RowBatch, generate
from pipeline.speculative.eagle3 import HeadCache
from pipeline.speculative.runner import step_ms
from pipeline.teacher import load_all_answers
from pipeline.workspace import Workspace, read_jsonl


def training_rows(cfg, ws: Workspace, tok, n: int | None, extra: int) -> list[dict]:
    rows = load_all_answers(ws.answers_file)
    main = [r for (_, _, j), r in rows.items() if j == 0][:n]
    tasks = {r["task_id"] for r in main}
    answers = main + [r for (t, j), r in rows.items() if 1 <= j <= extra and t in tasks]
    built, _ = distillation.build_examples(
        answers, tok, cfg.template_kwargs(), cfg.train.max_length
    )
    return built


def head_ms(head, prompt: list[int], aux: torch.Tensor, steps: int = 30) -> float:
    """Median ms of one head step (one token) after reading the prompt."""
    cache = HeadCache()
    n = len(prompt) - 1
    with torch.no_grad():
        _, pre = head.forward_step(torch.tensor([prompt[1:]]), head.fuse(aux[:n])[None], 0, cache)
        times = []
        for _ in range(steps + 3):
            t0 = time.perf_counter()
            head.forward_step(torch.tensor([[prompt[-1]]]), pre[:, -1:], n, cache)
            times.append(time.perf_counter() - t0)
            cache.crop(n)
    times = sorted(times[3:])
    return 1000 * times[len(times) // 2]


def figures(acc: int, prop: int, rounds: int, pos_acc: list, pos_prop: list) -> dict:
    """Acceptance, tokens per target pass ((accepted + rounds) / rounds) and per position."""
    return {
        "acceptance": acc / prop if prop else None,
        "accepted": acc,
        "proposed": prop,
        "rounds": rounds,
        "tokens_per_pass": (acc + rounds) / rounds if rounds else None,
        "per_position": [a / n if n else None for a, n in zip(pos_acc, pos_prop, strict=True)],
    }


def replay(head, target, batch: RowBatch, prompts: list[list[int]], k: int, tokens: int,
           aux_ids) -> dict:  # fmt: skip
    """The head's rounds on the target's greedy output (`batch`: the target's step loop)."""
    acc = prop = rounds = out_tokens = 0
    pos_acc, pos_prop = [0] * k, [0] * k
    for p in prompts:
        y = generate(batch.models, p, PLAIN, tokens, batch=batch).token_ids
        seq = p + y
        with torch.no_grad():
            o = target(input_ids=torch.tensor([seq]), output_hidden_states=True)
        aux = torch.cat([o.hidden_states[a][0] for a in aux_ids], dim=-1).float()
        cache = HeadCache()
        m = len(p) - 1  # the step loop's first step feeds the prompt's last token
        while m < len(seq) - 1:
            kk = min(k, tokens - (m + 1 - len(p)) - 1, len(seq) - 1 - m)  # its budget caps k
            guesses = head.propose(seq[: m + 1], aux[:m], cache, kk) if kk > 0 else []
            a = 0
            while a < kk and guesses[a] == seq[m + 1 + a]:
                a += 1
            for i in range(kk):
                pos_prop[i] += 1
                pos_acc[i] += i < a
            acc, prop, rounds = acc + a, prop + kk, rounds + 1
            m += a + 1
        out_tokens += len(y)
    return {**figures(acc, prop, rounds, pos_acc, pos_prop), "output_tokens": out_tokens}


def engine_row(batch: RowBatch, prompts, k, tokens) -> dict:
    """A draft model at draft:k in the step loop (`batch`), one request at a time."""
    acc = prop = rounds = 0
    pos_acc, pos_prop = [0] * k, [0] * k
    for p in prompts:
        r = generate(batch.models, p, parse_arm(k), tokens, batch=batch)
        acc, prop, rounds = acc + r.accepted, prop + r.proposed, rounds + r.rounds
        for i, (a, n) in enumerate(
            zip(r.accepted_per_position, r.proposed_per_position, strict=True)
        ):
            pos_acc[i] += a
            pos_prop[i] += n
    return figures(acc, prop, rounds, pos_acc, pos_prop)


def table(rows: list[dict], k: int) -> str:
    head = (
        "| row | kind | answers | train s | acceptance k=4 | tokens / target pass | "
        + " | ".join(f"pos {i + 1}" for i in range(k))
        + " | step ms (draft / target) |"
    )
    lines = [head, "|" + "---|" * (6 + k)]
    for r in rows:
        m = r["measured"]
        pos = " | ".join("-" if x is None else f"{x:.3f}" for x in m["per_position"])
        ts = "" if r.get("train_s") is None else f"{r['train_s']:.0f}"
        lines.append(
            f"| {r['name']} | {r['kind']} | {r.get('answers', '')} | {ts} | "
            f"**{m['acceptance']:.3f}** | {m['tokens_per_pass']:.2f} | {pos} | "
            f"{r['draft_ms']:.1f} / {r['target_ms']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--answers", type=int, default=None, help="first N prompts' answers")
    ap.add_argument("--extra", type=int, default=0, help="extra samples per prompt to use")
    ap.add_argument("--epochs", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--ttt", type=int, default=4, help="training-time-test steps")
    ap.add_argument("--kd", type=int, default=0, help="kd on the target's top N (0: sft)")
    ap.add_argument("--aux", type=int, nargs=3, default=None)
    ap.add_argument("--no-init", action="store_true", help="random head (no target init)")
    ap.add_argument("--name", default=None)
    ap.add_argument("--skip-train", action="store_true", help="measure an exported head")
    ap.add_argument("--drafts", nargs="*", default=[])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = load_config(args.config, ["engine.compile=false", "models.dtype=float32"])
    ws = Workspace(args.artifacts)
    pair = models.load_pair(cfg, ws, None)
    target, tok = pair.target, pair.tokenizer
    tref = specs.resolve(cfg.models.target, ws.models_cache)
    test = prompt_ids(cfg, tok, read_jsonl(ws.test_file)[: args.prompts])
    limit = cfg.engine.max_context
    loop = RowBatch(pair.models, max_rows=1, limit=limit)  # the target alone, as the server runs it
    rows = []
    if not args.skip_train or args.name:
        name = args.name or f"eagle3-{args.answers or 'all'}"
        out = ws.root / "perf" / "eagle3" / name
        export_dir = out / "head"
        if args.skip_train:
            head = eagle3.load_head(export_dir, target)
            meta = json.loads((out / "train.json").read_text())
        else:
            built = training_rows(cfg, ws, tok, args.answers, args.extra)
            counts = {}
            for r in built:
                for t, m in zip(r["input_ids"], r["completion_mask"], strict=True):
                    counts[t] = counts.get(t, 0) + m
            ranked = [[t, n] for t, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n]
            vocab = models.top_tokens(
                ranked, cfg.engine.draft_vocab or target.config.vocab_size,
                target.config.vocab_size, sorted(pair.models.eos_token_ids),
            )  # fmt: skip
            head = eagle3.new_head(target, vocab, args.aux, init=not args.no_init)
            aux_ids = head.config.aux_layer_ids
            key = eagle3.states_key(weights_id(tref) or tref, built, aux_ids)
            t0 = time.perf_counter()
            shards = eagle3.cache_states(
                target, built, aux_ids, train.pad_id(tok), ws.root / "eagle3" / f"states-{key}",
                progress=lambda i, n: print(f"\rstates {i}/{n}", end="", flush=True),
            )  # fmt: skip
            states_s = time.perf_counter() - t0
            data = eagle3.load_shards(shards)
            print(f"\n{len(data)} rows, states {states_s:.0f} s; training", flush=True)

            def on_step(s, n, loss, accs):
                if s % 10 == 0 or s == n:
                    a = " ".join(f"{x:.2f}" for x in accs)
                    print(f"\rstep {s}/{n} loss {loss:.3f} acc {a}", end="", flush=True)

            fit = eagle3.train_head(
                head, data, args.epochs, args.lr, args.batch_size, args.ttt, on_step=on_step,
                top=args.kd,
            )  # fmt: skip
            print(flush=True)
            eagle3.export(
                head, export_dir, models.verifier_name(cfg, tref), list(target.config.architectures)
            )
            meta = {
                **fit,
                "states_s": states_s,
                "rows": len(data),
                "answers": args.answers,
                "extra": args.extra,
                "ttt": args.ttt,
                "kd_top": args.kd or None,
                "lr": args.lr,
                "init": not args.no_init,
                "aux": list(aux_ids),
            }
            (out / "train.json").write_text(json.dumps(meta, indent=1))
            head = eagle3.load_head(
                export_dir, target, models.verifier_name(cfg, tref)
            )  # what vLLM gets
        aux_ids = head.config.aux_layer_ids
        m = replay(head, target, loop, test, args.k, args.tokens, aux_ids)
        with torch.no_grad():
            o = target(input_ids=torch.tensor([test[0]]), output_hidden_states=True)
        aux0 = torch.cat([o.hidden_states[a][0] for a in aux_ids], dim=-1)
        rows.append({
            "name": name, "kind": "eagle3 (replayed)", "answers": meta.get("rows"),
            "train_s": meta["runtime_s"] + meta.get("states_s", 0.0), "train": meta,
            "measured": m, "draft_ms": head_ms(head, test[0], aux0),
            "target_ms": step_ms(target, 1, repeat=30),
        })  # fmt: skip
        print(f"{name}: acceptance {m['acceptance']:.3f}, {m['tokens_per_pass']:.2f} tokens/pass")
    for spec in args.drafts:
        dp = models.load_pair(
            cfg, ws, spec, share_target=pair, full_head=spec.startswith("cut:"), head_dir=None
        )  # draft:K only: no head beside it
        m = engine_row(RowBatch(dp.models, max_rows=1, limit=limit), test, args.k, args.tokens)
        rows.append({
            "name": spec, "kind": "draft (engine)", "measured": m,
            "draft_ms": draft_step_ms(dp.models.drafter, 30),  # prepared by its batch
            "target_ms": step_ms(target, 1, repeat=30),
        })  # fmt: skip
        print(f"{spec}: acceptance {m['acceptance']:.3f}, {m['tokens_per_pass']:.2f} tokens/pass")
    perf = ws.root / "perf"
    earlier = perf / "eagle3_head.json"
    names = {r["name"] for r in rows}
    if earlier.exists():
        rows = [r for r in json.loads(earlier.read_text())["rows"] if r["name"] not in names] + rows
    env = environment(cfg)
    out = {"environment": env, "prompts": args.prompts, "tokens": args.tokens, "k": args.k,
           "rows": rows}  # fmt: skip
    md = (
        f"# EAGLE-3 heads and drafts\n\n{header(env)}. Held-out: {args.prompts} prompts x "
        f"{args.tokens} tokens, greedy, fixed k={args.k}; fp32, eager.\n\n{table(rows, args.k)}\n"
    )
    write_results(perf, "eagle3_head", out, md)
    print(Path(perf / "eagle3_head.md").read_text())


if __name__ == "__main__":
    main()
