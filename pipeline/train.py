"""Fine-tune the draft on the teacher's answers (distillation): LoRA by default, or full.

    python -m pipeline train --config configs/default.yaml [--force]     (or: make train)

Multi-GPU (DDP, FSDP, DeepSpeed):
    accelerate launch --config_file configs/accelerate/ddp.yaml -m pipeline train --config FILE

Reads <artifacts>/teacher/answers.jsonl; writes <artifacts>/adapter/: checkpoints/ (resume
points), model/ (the adapter, or full weights with train.method=full), train_log.jsonl (loss per
step) and metrics.json (written last: its presence marks a finished run).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from . import models
from .config import Config
from .errors import InputError
from .workspace import (
    Workspace,
    atomic_write_json,
    atomic_write_jsonl,
    make_temp_dir,
    read_jsonl,
    sha256_file,
)

log = logging.getLogger(__name__)


def build_examples(
    answers: list[dict], tokenizer, template_kwargs: dict, max_length: int
) -> list[dict]:
    """Pre-tokenised prompt+completion rows with a completion mask: the loss sees exactly the
    teacher's tokens (its own ids when the teacher reported them), plus end-of-turn only when
    the teacher stopped by itself (an answer cut at max_tokens gets none)."""
    eos = tokenizer.eos_token_id
    rows = []
    for a in answers:
        p_ids = models.user_prompt_ids(tokenizer, a["prompt"], template_kwargs)
        c_ids = a.get("completion_token_ids")
        if c_ids is None:
            c_ids = tokenizer(a["completion"], add_special_tokens=False)["input_ids"]
        c_ids = list(c_ids) + ([eos] if a.get("finish_reason") == "stop" else [])
        ids = (p_ids + c_ids)[:max_length]
        mask = ([0] * len(p_ids) + [1] * len(c_ids))[:max_length]
        if sum(mask) == 0:
            continue  # prompt alone fills max_length: nothing to learn from
        rows.append({"input_ids": ids, "completion_mask": mask})
    return rows


def train_inputs(cfg: Config, ws: Workspace) -> dict[str, Any]:
    """What a finished run depends on; a change means training again from scratch."""
    return {
        "answers_sha256": sha256_file(ws.answers_file),
        "draft": cfg.models.draft,
        "target": cfg.models.target,
        "train": cfg.train.model_dump(mode="json"),
        "template_kwargs": cfg.template_kwargs(),
    }


def _process_state():
    """accelerate's view of this process (main or not) under torchrun / accelerate launch. On a
    machine without CUDA it must be told so (`cpu=True`), or every rank believes it is the main
    process and they race to materialise the draft."""
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def run(cfg: Config, ws: Workspace, force: bool = False) -> dict[str, Any]:
    if not ws.answers_file.exists():
        raise InputError(
            f"{ws.answers_file} is missing: run the distill stage first (make distill)"
        )
    answers = read_jsonl(ws.answers_file)
    if not answers:
        raise InputError(f"{ws.answers_file} has no answers")
    inputs = train_inputs(cfg, ws)
    metrics_file = ws.adapter / "metrics.json"
    inputs_file = ws.adapter / "inputs.json"
    if metrics_file.exists() and not force:
        done = json.loads(metrics_file.read_text())
        if done.get("inputs") == inputs:
            log.info(
                "train: already finished for these inputs (%s); use --force to train again",
                metrics_file,
            )
            return done
    previous = json.loads(inputs_file.read_text()) if inputs_file.exists() else None
    if force or previous != inputs:
        if ws.adapter.exists() and _process_state().is_main_process:
            log.info("train: inputs changed or --force: starting over in %s", ws.adapter)
            shutil.rmtree(ws.adapter)
    if _process_state().is_main_process:
        atomic_write_json(inputs_file, inputs)
    return _train(cfg, ws, answers, inputs)


def last_complete_checkpoint(ckpt_dir: Path) -> str | None:
    """The newest checkpoint to resume from. The Trainer writes `trainer_state.json` last, so a
    checkpoint without it was cut short (a crash, a full disk): it is removed, never resumed."""
    from transformers.trainer_utils import get_last_checkpoint

    if not ckpt_dir.is_dir():
        return None
    for d in ckpt_dir.glob("checkpoint-*"):
        if d.is_dir() and not (d / "trainer_state.json").exists():
            log.warning("train: removing %s: an incomplete checkpoint", d)
            shutil.rmtree(d)
    return get_last_checkpoint(str(ckpt_dir))


def _train(cfg: Config, ws: Workspace, answers: list[dict], inputs: dict) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    t = cfg.train
    with _process_state().main_process_first():  # one materialises the draft, others reuse it
        _, draft_ref = models.resolve_pair(cfg.models.target, cfg.models.draft, ws.models_cache)
    tok = models.load_tokenizer(draft_ref)
    on_gpu = torch.cuda.is_available() and cfg.models.device in ("auto", "cuda")
    model = models.load_model(
        draft_ref, "bfloat16" if on_gpu else "float32", "cuda" if on_gpu else "cpu"
    )
    model.config.use_cache = False
    rows = build_examples(answers, tok, cfg.template_kwargs(), t.max_length)
    if not rows:
        raise InputError("no usable training examples: every prompt exceeds train.max_length")
    dataset = Dataset.from_list(rows)
    peft_config = None
    if t.method == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=t.lora_r,
            lora_alpha=t.lora_alpha,
            lora_dropout=t.lora_dropout,
            target_modules=t.target_modules,
            task_type="CAUSAL_LM",
        )
    ckpt_dir = ws.adapter / "checkpoints"
    args = SFTConfig(
        output_dir=str(ckpt_dir),
        num_train_epochs=t.epochs,
        max_steps=t.max_steps,
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.grad_accum,
        learning_rate=t.learning_rate,
        warmup_steps=t.warmup_ratio,  # transformers 5: a float < 1 is a ratio of all steps
        lr_scheduler_type="cosine",
        max_length=t.max_length,
        seed=t.seed,
        logging_steps=1,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=2,
        completion_only_loss=True,
        bf16=on_gpu,  # TRL defaults bf16=True and gradient checkpointing on: both off on the CPU
        gradient_checkpointing=False,
        use_cpu=not on_gpu,
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tok, peft_config=peft_config
    )
    resume = last_complete_checkpoint(ckpt_dir)
    if resume:
        log.info("train: resuming from %s", resume)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    log.info(
        "train: %s, %d examples, %d trainable of %d parameters",
        t.method,
        len(rows),
        trainable,
        total,
    )
    result = trainer.train(resume_from_checkpoint=resume)
    if not trainer.is_world_process_zero():
        return {}
    history = [h for h in trainer.state.log_history if "loss" in h]
    atomic_write_jsonl(ws.adapter / "train_log.jsonl", history)
    tmp = make_temp_dir(ws.adapter, ".model.")
    try:
        trainer.model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        counted = models.write_token_counts(tmp / models.TOKEN_COUNTS, rows)  # draft_vocab's
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = ws.adapter / "model"
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    metrics = {
        "method": t.method,
        "base_draft": draft_ref,
        "examples": len(rows),
        "completion_tokens": counted["tokens"],
        "distinct_completion_tokens": len(counted["counts"]),
        "global_steps": trainer.state.global_step,
        "resumed_from": resume,
        "train_loss": result.training_loss,
        "first_loss": history[0]["loss"] if history else None,
        "last_loss": history[-1]["loss"] if history else None,
        "runtime_s": result.metrics.get("train_runtime"),
        "trainable_parameters": trainable,
        "total_parameters": total,
        "device": "cuda" if on_gpu else "cpu",
        "world_size": trainer.args.world_size,
        "inputs": inputs,
        "inputs_hash": hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16],
    }
    atomic_write_json(ws.adapter / "metrics.json", metrics)
    log.info(
        "train: done: loss %s -> %s over %d steps",
        metrics["first_loss"],
        metrics["last_loss"],
        metrics["global_steps"],
    )
    return metrics
