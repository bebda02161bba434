"""Where a training step's time goes (issue 17): the same SFT step three ways, on this machine.

    .venv/bin/python -m benchmarks.train_step [--artifacts artifacts] [--examples 48] [--steps 8]
    (needs <artifacts>/teacher/answers.jsonl: `make distill`)

1. trl-fused: TRL's SFTTrainer as the train stage used it before issue 17 (completion-only loss
   through TRL's fused LM head: on a CPU it scores every position, prompt and padding included,
   in tiles, recomputes them in backward, and also computes entropy and top-1 for its metrics);
2. phoenix: the train stage now (the same SFTTrainer; the LM head only on answer tokens);
3. plain: a bare PyTorch loop (full logits, cross-entropy with ignored prompt positions, AdamW).

Full fine-tuning of the configured draft, fp32, batch size train.batch_size, the same rows in the
same order. Prints the median seconds per optimizer step (the first two steps excluded) and
writes <artifacts>/perf/train_step.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline import distillation, models, specs
from pipeline.bench import environment
from pipeline.config import load_config
from pipeline.distillation import build_examples
from pipeline.train import pad_id
from pipeline.workspace import Workspace, atomic_write_json, read_jsonl


def step_times_trainer(cfg, ws, draft_ref, tok, rows, steps: int, phoenix: bool) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    model = models.load_model(draft_ref, "float32", "cpu")
    model.config.use_cache = False
    common = dict(
        output_dir=str(ws.root / "perf" / "train_step_ckpt"),
        max_steps=steps,
        per_device_train_batch_size=cfg.train.batch_size,
        learning_rate=cfg.train.learning_rate,
        logging_steps=1,
        save_strategy="no",
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    if phoenix:
        distillation.add_compact_head(model)
        args = SFTConfig(
            **common, dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False
        )
        trainer = distillation.make_trainer_class()(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            data_collator=distillation.Collator(pad_id(tok)),
        )
    else:
        plain = [{k: r[k] for k in ("input_ids", "completion_mask")} for r in rows]
        args = SFTConfig(**common, completion_only_loss=True, max_length=cfg.train.max_length)
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=Dataset.from_list(plain), processing_class=tok
        )
    trainer.add_callback(Clock())
    trainer.train()
    return times


def step_times_plain(cfg, draft_ref, tok, rows, steps: int) -> list[float]:
    model = models.load_model(draft_ref, "float32", "cpu")
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.learning_rate)
    collate = distillation.Collator(pad_id(tok))
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(rows), generator=g).tolist()
    times = []
    bs = cfg.train.batch_size
    for s in range(steps):
        idx = [order[(s * bs + i) % len(rows)] for i in range(bs)]
        b = collate([rows[i] for i in idx])
        labels = b["input_ids"].masked_fill(b["completion_mask"] == 0, -100)
        t0 = time.perf_counter()
        loss = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=labels
        ).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--examples", type=int, default=48)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    cfg = load_config(args.config)
    ws = Workspace(args.artifacts)
    _, draft_ref = specs.resolve_pair(cfg.models.target, cfg.models.draft, ws.models_cache)
    tok = models.load_tokenizer(draft_ref)
    answers = read_jsonl(ws.answers_file)[: args.examples]
    rows, _ = build_examples(answers, tok, cfg.template_kwargs(), cfg.train.max_length)
    results = {}
    for name in ("trl-fused", "phoenix", "plain"):
        if name == "plain":
            times = step_times_plain(cfg, draft_ref, tok, rows, args.steps)
        else:
            times = step_times_trainer(
                cfg, ws, draft_ref, tok, rows, args.steps, phoenix=name == "phoenix"
            )
        med = statistics.median(times[2:])
        results[name] = {"median_s": med, "steps_s": times}
        print(f"{name:10s} {med:6.2f} s/step  (steps: {' '.join(f'{t:.2f}' for t in times)})")
    out = {
        "environment": environment(cfg, "cpu"),
        "draft": cfg.models.draft,
        "examples": len(rows),
        "batch_size": cfg.train.batch_size,
        "tokens_per_row_mean": sum(len(r["input_ids"]) for r in rows) / len(rows),
        "answer_tokens_per_row_mean": sum(sum(r["completion_mask"]) for r in rows) / len(rows),
        "results": results,
    }
    (ws.root / "perf").mkdir(parents=True, exist_ok=True)
    atomic_write_json(ws.root / "perf" / "train_step.json", out)
    print(f"written {ws.root / 'perf' / 'train_step.json'} ({out['environment']['hardware']})")


if __name__ == "__main__":
    main()
