"""Fine-tune the draft on the teacher's answers (distillation): LoRA by default, or full.

    python -m pipeline train --config configs/default.yaml [--force]     (or: make train)

Multi-GPU (DDP, FSDP, DeepSpeed):
    accelerate launch --config_file configs/accelerate/ddp.yaml -m pipeline train --config FILE

Reads <artifacts>/teacher/answers.jsonl; writes <artifacts>/adapter/: checkpoints/, model/ (the
adapter, or full weights), train_log.jsonl and metrics.json (written last: a finished run).

train.parallel=K (PARD, `pard`): the rows also carry mask blocks and the draft learns to guess K
tokens in one pass; the mask id (`models.parallel_token`) is saved as the draft config's
`pard_token` (what vLLM reads) and in metrics.json. With LoRA the mask's embedding row stays as
the base has it (frozen; the adapted layers learn to read it); full fine-tuning trains it too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from . import distillation, models, pard, specs
from .config import Config
from .errors import ConfigError, InputError
from .teacher import load_all_answers
from .workspace import (
    Workspace,
    atomic_write_json,
    atomic_write_jsonl,
    make_temp_dir,
    read_jsonl,
    sha256_file,
)

log = logging.getLogger(__name__)


def train_inputs(cfg: Config, ws: Workspace) -> dict[str, Any]:
    """What a finished run depends on; a change means training again from scratch."""
    return {
        "answers_sha256": sha256_file(ws.answers_file),
        "draft": cfg.models.draft,
        "target": cfg.models.target,
        # The head's own keys are its config's epochs and learning_rate (Config.head_config).
        "train": cfg.train.model_dump(mode="json", exclude={"head_epochs", "head_learning_rate"}),
        "template_kwargs": cfg.template_kwargs(),
    }


def _process_state():
    """accelerate's view of this process (told `cpu=True` without CUDA, else every rank is main)."""
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def training_answers(cfg: Config, ws: Workspace) -> list[dict]:
    """Each prompt's main answers (every answered turn), then its extra samples
    1..`distill.extra_samples`; only prompts on the split's training side (a rerun of split on
    grown data never trains on what is now held out)."""
    rows = load_all_answers(ws.answers_file)
    if ws.train_file.exists():
        side = {int(r["task_id"]) for r in read_jsonl(ws.train_file)}
        rows = {k: r for k, r in rows.items() if k[0] in side}
    answers = [r for (_, _, j), r in rows.items() if j == 0]
    if not answers:
        raise InputError(f"{ws.answers_file} has no answers to training-side prompts")
    n = cfg.distill.extra_samples
    return answers + [r for (_, _, j), r in rows.items() if 1 <= j <= n]


def run(cfg: Config, ws: Workspace, force: bool = False) -> dict[str, Any]:
    if not ws.answers_file.exists():
        raise InputError(
            f"{ws.answers_file} is missing: run the distill stage first (make distill)"
        )
    answers = training_answers(cfg, ws)
    inputs = train_inputs(cfg, ws)
    metrics_file = ws.adapter / "metrics.json"
    inputs_file = ws.adapter / "inputs.json"
    if metrics_file.exists() and not force:
        done = json.loads(metrics_file.read_text())
        if done.get("inputs") == inputs:
            msg = "train: already finished for these inputs (%s); use --force to train again"
            log.info(msg, metrics_file)
            return done
    previous = json.loads(inputs_file.read_text()) if inputs_file.exists() else None
    if force or previous != inputs:
        if ws.adapter.exists() and _process_state().is_main_process:
            log.info("train: inputs changed or --force: starting over in %s", ws.adapter)
            shutil.rmtree(ws.adapter)
    if _process_state().is_main_process:
        atomic_write_json(inputs_file, inputs)
    if cfg.models.draft.strip() == "eagle3":  # a head over the target's states, not TRL
        return _train_eagle3(cfg, ws, answers, inputs)
    return _train(cfg, ws, answers, inputs)


def _install_model(ws: Workspace, tmp: Path) -> None:
    """A finished model directory into <ws>/adapter/model, replacing an earlier one."""
    final = ws.adapter / "model"
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def _unreachable(cfg: Config, exc: Exception) -> InputError:
    url = cfg.teacher.url
    teacher = "the local teacher" if url == "local" else f"the teacher at {url}"
    return InputError(
        f"train.objective={cfg.train.objective} needs the target's distribution, but the "
        f"target's weights ({cfg.models.target}) could not be loaded ({type(exc).__name__}: "
        f"{exc}); to learn from {teacher} instead, set train.objective=kd, "
        "train.kd_source=teacher and train.top_logprobs=N (N <= 20), then rerun distill"
    )


def _load_teacher(cfg: Config, target_ref: str, dtype: str, device: str):
    """The target, frozen, for kd/on_policy."""
    try:
        teacher = models.load_model(target_ref, dtype, device)
    except Exception as exc:
        raise _unreachable(cfg, exc) from exc
    teacher.eval().requires_grad_(False)
    return teacher


def _precompute_top(teacher, rows: list[dict], k: int, pad_id: int, device: str) -> dict:
    """The target's top-k at every answer token of every row (one pass of the target)."""
    from tqdm import tqdm

    collate = distillation.Collator(pad_id)
    out = {}
    for i in tqdm(range(0, len(rows), 8), desc=f"target top-{k}", unit="batch"):
        chunk = rows[i : i + 8]
        b = {key: v.to(device) for key, v in collate(chunk).items()}
        at = distillation.shifted(b["completion_mask"])
        logits = distillation.teacher_logits(teacher, b["input_ids"], b["attention_mask"], at)
        ids, logp = distillation.top_k_sparse(logits, k)
        ids, logp = ids.cpu(), logp.cpu()
        start = 0
        for r in chunk:
            n = int(sum(r["completion_mask"][1:]))
            out[r["row"]] = (ids[start : start + n], logp[start : start + n])
            start += n
    return out


def last_complete_checkpoint(ckpt_dir: Path) -> str | None:
    """The newest checkpoint; one without `trainer_state.json` (written last) is removed."""
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

    t = cfg.train
    source = cfg.kd_source()
    with _process_state().main_process_first():  # one materialises the draft, others reuse it
        try:
            target_ref, draft_ref = specs.resolve_pair(
                cfg.models.target, cfg.models.draft, ws.models_cache
            )
        except Exception as exc:
            if source != "target":
                raise
            raise _unreachable(cfg, exc) from exc
    tok = models.load_tokenizer(draft_ref)
    on_gpu = torch.cuda.is_available() and cfg.models.device in ("auto", "cuda")
    dtype, device = ("bfloat16", "cuda") if on_gpu else ("float32", "cpu")
    model = models.load_model(draft_ref, dtype, device)
    model.config.use_cache = False
    distillation.add_compact_head(model)  # before PEFT wraps it
    width = t.top_logprobs if source == "teacher" else None
    rows, sparse = distillation.build_examples(
        answers, tok, cfg.template_kwargs(), t.max_length, width, t.include_reasoning
    )
    if not rows:
        raise InputError("no usable training examples: every prompt exceeds train.max_length")
    teacher, sparse, precompute_s = _target_side(cfg, target_ref, tok, rows, sparse, dtype, device)
    ckpt_dir = ws.adapter / "checkpoints"
    fed = _parallel_rows(cfg, tok, model, rows)
    trainer = _make_trainer(cfg, model, tok, fed, teacher, sparse, ckpt_dir, on_gpu)
    resume = last_complete_checkpoint(ckpt_dir)
    if resume:
        log.info("train: resuming from %s", resume)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    how = f" ({t.divergence}, target distribution from the {source})" if source else ""
    log.info("train: %s, objective %s%s, %d examples, %d trainable of %d parameters",
             t.method, t.objective, how, len(rows), trainable, total)  # fmt: skip
    result = trainer.train(resume_from_checkpoint=resume)
    if not trainer.is_world_process_zero():
        return {}
    history = [h for h in trainer.state.log_history if "loss" in h]
    atomic_write_jsonl(ws.adapter / "train_log.jsonl", history)
    counted = _save_draft(ws, trainer.model, tok, rows, draft_ref)
    matches = [h["teacher_match"] for h in history if "teacher_match" in h]
    metrics = {
        "method": t.method,
        "objective": t.objective,
        "kd_source": source,
        "teacher_match_last": matches[-1] if matches else None,
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
        "target_top_s": precompute_s,  # the target's top-N, computed before the first step
        "trainable_parameters": trainable,
        "total_parameters": total,
        "device": "cuda" if on_gpu else "cpu",
        "world_size": trainer.args.world_size,
        **_parallel_fields(cfg, model, history),
        **_inputs_fields(inputs),
    }
    atomic_write_json(ws.adapter / "metrics.json", metrics)
    log.info("train: done: loss %s -> %s over %d steps",
             metrics["first_loss"], metrics["last_loss"], metrics["global_steps"])  # fmt: skip
    return metrics


def _parallel_rows(cfg: Config, tok, model, rows: list[dict]) -> list[dict]:
    """The rows the trainer sees: with train.parallel, each with its mask blocks (`pard`), the
    mask id set as `model.config.pard_token` (saved with the draft); else `rows` as they are."""
    t = cfg.train
    if not t.parallel:
        return rows
    try:
        mask_id = models.parallel_token(tok, model.config, t.mask_token)
    except ConfigError as exc:
        raise ConfigError(f"train.mask_token={t.mask_token}: {exc}") from exc
    model.config.pard_token = mask_id
    fed = pard.parallel_rows(rows, t.parallel, t.parallel_keep, mask_id, t.seed)
    masks = sum(len(p["input_ids"]) - len(r["input_ids"]) for p, r in zip(fed, rows, strict=True))
    log.info("train: parallel K=%d, mask token %d (%r), %d mask positions over %d rows",
             t.parallel, mask_id, tok.convert_ids_to_tokens(mask_id), masks, len(rows))  # fmt: skip
    return fed


def _parallel_fields(cfg: Config, model, history: list[dict]) -> dict[str, Any]:
    """metrics.json's record of parallel training: K, the mask id (merge sets it as the merged
    config's `pard_token`), the masks' last greedy agreement with their labels."""
    if not cfg.train.parallel:
        return {"parallel": 0, "mask_token": None}
    matches = [h["parallel_match"] for h in history if "parallel_match" in h]
    return {
        "parallel": cfg.train.parallel,
        "mask_token": model.config.pard_token,
        "parallel_match_last": matches[-1] if matches else None,
    }


def _target_side(
    cfg: Config, target_ref: str, tok, rows: list[dict], sparse: dict, dtype: str, device: str
) -> tuple[Any, dict, float]:
    """(teacher, sparse, seconds): with kd_source target, the frozen target, or for kd over its
    top-N that top-N computed once (no teacher then). Otherwise (None, sparse, 0)."""
    t = cfg.train
    if cfg.kd_source() != "target":
        return None, sparse, 0.0
    teacher = _load_teacher(cfg, target_ref, dtype, device)
    if not (t.top_logprobs and t.objective == "kd"):
        return teacher, sparse, 0.0
    t0 = time.perf_counter()
    sparse = _precompute_top(teacher, rows, t.top_logprobs, pad_id(tok), device)
    return None, sparse, time.perf_counter() - t0


def _make_trainer(
    cfg: Config, model, tok, rows: list[dict], teacher, sparse: dict, ckpt_dir: Path, on_gpu: bool
):
    """The DistillTrainer over the rows, checkpointing into `ckpt_dir` (LoRA: a PEFT config)."""
    from datasets import Dataset
    from trl import SFTConfig

    t = cfg.train
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
        dataset_kwargs={"skip_prepare_dataset": True},  # rows come tokenised, with masks
        remove_unused_columns=False,  # the collator needs prompt_len and row
        bf16=on_gpu,  # TRL defaults bf16=True and gradient checkpointing on: both off on the CPU
        gradient_checkpointing=False,
        use_cpu=not on_gpu,
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    return distillation.make_trainer_class()(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=peft_config,
        data_collator=distillation.Collator(pad_id(tok)),
        objective=t.objective,
        divergence=t.divergence,
        teacher=teacher,
        sparse=sparse or None,
        top_k=t.top_logprobs,
        on_policy={
            "ratio": t.on_policy_ratio,
            "max_new_tokens": t.on_policy_tokens,
            "temperature": t.on_policy_temperature,
            "eos": models.eos_ids(tok, model),
        },
    )


def _save_draft(ws: Workspace, model, tok, rows: list[dict], draft_ref: str) -> dict:
    """The draft (or adapter), tokenizer and token counts into <ws>/adapter/model -> counts."""
    tmp = make_temp_dir(ws.adapter, ".model.")
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        counted = models.write_token_counts(  # draft_vocab's (plus the starting draft's own)
            tmp / models.TOKEN_COUNTS, rows, start_from=Path(draft_ref)
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _install_model(ws, tmp)
    return counted


def _inputs_fields(inputs: dict) -> dict[str, Any]:
    """metrics.json's record of what the run depended on (`train_inputs`) and its hash."""
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return {"inputs": inputs, "inputs_hash": digest}


def _train_eagle3(cfg: Config, ws: Workspace, answers: list[dict], inputs: dict) -> dict[str, Any]:
    """models.draft=eagle3: states, head, export to <ws>/adapter/model, metrics.json last."""
    import torch

    from . import eagle3

    t = cfg.train
    ref, tok, target = models.load_target_for_head(cfg, ws)
    rows, _ = distillation.build_examples(
        answers, tok, cfg.template_kwargs(), t.max_length, include_reasoning=t.include_reasoning
    )
    if not rows:
        raise InputError("no usable training examples: every prompt exceeds train.max_length")
    tmp = make_temp_dir(ws.adapter, ".model.")
    try:
        counted = models.write_token_counts(tmp / models.TOKEN_COUNTS, rows)
        vocab_n = cfg.engine.draft_vocab or target.config.vocab_size
        eos = models.eos_ids(tok, target)
        vocab = models.top_tokens(counted["counts"], vocab_n, target.config.vocab_size, eos)
        torch.manual_seed(t.seed)
        head = eagle3.new_head(target, vocab, tuple(t.eagle3_layers) if t.eagle3_layers else None)
        aux = head.config.aux_layer_ids
        data, states_s = _head_states(ws, ref, tok, target, rows, aux)
        top = (t.top_logprobs or eagle3.KD_TOP) if t.objective == "kd" else 0
        fit, history = _fit_head(cfg, head, data, top)
        eagle3.export(head, tmp / "head", models.verifier_name(cfg, ref),
               list(target.config.architectures or []))  # fmt: skip
        for name in (eagle3.CONFIG_NAME, eagle3.WEIGHTS_NAME):
            (tmp / "head" / name).replace(tmp / name)
        (tmp / "head").rmdir()
        tok.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _install_model(ws, tmp)
    atomic_write_jsonl(ws.adapter / "train_log.jsonl", history)
    metrics = {
        "method": "eagle3",
        "objective": t.objective,
        "kd_source": "target" if top else None,
        "kd_top": top or None,
        "base_draft": "eagle3",
        "target": ref,
        "aux_layers": list(aux),
        "ttt_steps": t.ttt_steps,
        "draft_vocab": head.config.draft_vocab_size,
        "examples": len(rows),
        "completion_tokens": counted["tokens"],
        "global_steps": fit["steps"],
        "first_loss": fit["first_loss"],
        "last_loss": fit["last_loss"],
        "last_step_accuracy": fit["last_step_accuracy"],
        "runtime_s": fit["runtime_s"],
        "states_s": states_s,
        "trainable_parameters": sum(p.numel() for p in head.parameters()),
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "device": str(next(target.parameters()).device),
        **_inputs_fields(inputs),
    }
    atomic_write_json(ws.adapter / "metrics.json", metrics)
    log.info("train: eagle3 done: loss %.3f -> %.3f over %d steps (%.0f s)",
             fit["first_loss"], fit["last_loss"], fit["steps"], fit["runtime_s"])  # fmt: skip
    return metrics


def _head_states(
    ws: Workspace, ref: str, tok, target, rows: list[dict], aux: tuple[int, ...]
) -> tuple[list[dict], float]:
    """The target's states over every row (cached under <ws>/cache/eagle3/) and their seconds."""
    from tqdm import tqdm

    from . import eagle3
    from .artifacts import weights_id

    key = eagle3.states_key(weights_id(ref) or ref, rows, aux)
    folder = ws.cache / "eagle3" / f"states-{key}"
    t0 = time.perf_counter()
    with tqdm(total=len(rows), desc="target hidden states", unit="answer") as bar:
        shards = eagle3.cache_states(
            target, rows, aux, pad_id(tok), folder,
            progress=lambda i, _n: bar.update(i - bar.n),
        )  # fmt: skip
    states_s = time.perf_counter() - t0
    data = eagle3.load_shards(shards)
    log.info("train: eagle3 head over layers %s, %d rows, states in %s (%.0f s)",
             list(aux), len(data), folder, states_s)  # fmt: skip
    return data, states_s


def _fit_head(cfg: Config, head, data: list[dict], top: int) -> tuple[dict, list[dict]]:
    """The head trained for train.max_steps, else train.epochs -> (figures, per-step log)."""
    import math

    from tqdm import tqdm

    from . import eagle3

    t = cfg.train
    per_epoch = math.ceil(len(data) / t.batch_size)
    total = t.max_steps if t.max_steps > 0 else max(1, round(per_epoch * t.epochs))
    history: list[dict] = []
    with tqdm(total=total, desc="train eagle3", unit="step") as bar:

        def on_step(step, _n, loss, accs):
            history.append({"step": step, "loss": loss, "accuracy": accs})
            bar.set_postfix(loss=f"{loss:.3f}", acc1=f"{accs[0]:.2f}")
            bar.update(1)

        fit = eagle3.train_head(
            head, data, total / per_epoch, t.learning_rate, t.batch_size, t.ttt_steps,
            seed=t.seed, on_step=on_step, top=top,
        )  # fmt: skip
    return fit, history


def pad_id(tok) -> int:
    """The id batches are padded with (end-of-text where a tokenizer has no pad token)."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
