"""EAGLE-3 heads (the model: `speculative/eagle3.py`): the target's states cached, the head
trained on them, exported in the speculators format vLLM loads, and loaded back.

    states   per position: the three aux layers' hidden states, the target's greedy next token
             and its `KD_TOP` most likely (log-probabilities), in shards of `SHARD` rows (bf16),
             keyed by the target's weights, the rows' tokens and the format (`states_key`)
    train    the training-time test, step j weighted 0.8^j, on the answer positions within the
             head's vocabulary: sft on the greedy tokens, kd on the top-N renormalised
    export   config.json (`speculators_model_type: eagle3`) + model.safetensors (`llama_eagle3`)
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .speculative.eagle3 import Eagle3Head
from .speculative.eagle3_config import Eagle3Config, config_from_target, default_aux_layers
from .workspace import atomic_write_json, make_temp_dir

log = logging.getLogger(__name__)

SHARD = 32  # rows per cached shard
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
STEP_WEIGHT = 0.8  # EAGLE-3's loss weight per training-time-test step
KD_TOP = 20  # the target's most likely next tokens cached per position (kd's distribution)
STATES_FORMAT = "aux+greedy+top20"  # in the cache key: a cache of another layout is recomputed


def states_key(target_weights: str, rows: list[dict], aux: tuple[int, ...]) -> str:
    """Keyed by the target's weights hash, the rows' tokens and the layers read."""
    h = hashlib.sha256(target_weights.encode())
    h.update(json.dumps([list(aux), STATES_FORMAT]).encode())
    for r in rows:
        h.update(json.dumps([r["input_ids"], r["completion_mask"]]).encode())
    return h.hexdigest()[:16]


@torch.no_grad()
def target_states(
    target, rows: list[dict], aux: tuple[int, ...], pad_id: int
) -> list[dict[str, torch.Tensor]]:
    """One padded batch through the target -> per row: aux states [T, 3H] (bf16), greedy [T],
    top_ids / top_logp [T, KD_TOP] (bf16)."""
    t = max(len(r["input_ids"]) for r in rows)
    dev = next(target.parameters()).device
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    out = target(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=True)
    hs = torch.cat([out.hidden_states[a] for a in aux], dim=-1)
    greedy = out.logits.argmax(-1)
    top = torch.log_softmax(out.logits.float(), dim=-1).topk(min(KD_TOP, out.logits.shape[-1]))
    return [
        {"aux": hs[i, :n].to(torch.bfloat16).cpu(), "greedy": greedy[i, :n].cpu(),
         "top_ids": top.indices[i, :n].to(torch.int32).cpu(),
         "top_logp": top.values[i, :n].to(torch.bfloat16).cpu()}
        for i, n in enumerate(len(r["input_ids"]) for r in rows)
    ]  # fmt: skip


def cache_states(
    target,
    rows: list[dict],
    aux: tuple[int, ...],
    pad_id: int,
    folder: Path,
    batch: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> list[Path]:
    """Every row's states in shards under `folder`; a finished shard is kept, not recomputed."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for s in range(0, len(rows), SHARD):
        path = folder / f"shard-{s // SHARD:05d}.pt"
        shards.append(path)
        if path.is_file():
            if progress:
                progress(min(s + SHARD, len(rows)), len(rows))
            continue
        part = rows[s : s + SHARD]
        order = sorted(range(len(part)), key=lambda i: len(part[i]["input_ids"]))
        states: list[dict | None] = [None] * len(part)
        for b in range(0, len(order), batch):
            idx = order[b : b + batch]
            got = target_states(target, [part[i] for i in idx], aux, pad_id)
            for i, st in zip(idx, got, strict=True):
                states[i] = st
        data = [
            {**st, "ids": torch.tensor(r["input_ids"]), "mask": torch.tensor(r["completion_mask"])}
            for st, r in zip(states, part, strict=True)
        ]
        tmp = path.with_suffix(".tmp")
        torch.save(data, tmp)
        tmp.replace(path)
        if progress:
            progress(min(s + SHARD, len(rows)), len(rows))
    return shards


def load_shards(shards: list[Path]) -> list[dict]:
    return [row for p in shards for row in torch.load(p, weights_only=True)]


def init_from_target(head: Eagle3Head, target) -> None:
    """The layer from the target's last (MLP, norms, attention's hidden half), lm_head from its
    head rows, norm from its final norm; `fc` the mean of the three depths."""
    c = head.config
    last = target.model.layers[-1]
    layer = head.layers[0]
    h = c.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(last.self_attn, name).weight
            getattr(layer.self_attn, name).weight.zero_()
            getattr(layer.self_attn, name).weight[:, h:].copy_(w)
            getattr(layer.self_attn, name).weight[:, :h].copy_(w * 0.1)
        layer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
        layer.input_layernorm.weight.copy_(last.input_layernorm.weight)
        layer.hidden_norm.weight.copy_(last.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        head.norm.weight.copy_(target.model.norm.weight)
        eye = torch.eye(h) / 3
        head.fc.weight.copy_(torch.cat([eye, eye, eye], dim=1))
        out = target.get_output_embeddings().weight
        head.lm_head.weight.copy_(out[head.target_ids])


def new_head(target, vocab_ids: list[int], aux: tuple[int, ...] | None, init: bool = True):
    c = config_from_target(target.config, len(vocab_ids), aux)
    head = Eagle3Head(c, target.get_input_embeddings())
    head.set_vocab(vocab_ids)
    if init:
        init_from_target(head, target)
    return head


def _batch(rows: list[dict], top: int = 0) -> tuple[torch.Tensor, ...]:
    """Padded ids, aux, greedy, mask [B, T(, 3H)], top_ids, top_logp [B, T, top]."""
    t = max(len(r["ids"]) for r in rows)
    b = len(rows)
    ids = torch.zeros(b, t, dtype=torch.long)
    aux = torch.zeros(b, t, rows[0]["aux"].shape[-1])
    greedy = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    top_ids = torch.zeros(b, t, top, dtype=torch.long)
    top_logp = torch.full((b, t, top), -math.inf)
    for i, r in enumerate(rows):
        n = len(r["ids"])
        ids[i, :n], aux[i, :n], greedy[i, :n] = r["ids"], r["aux"].float(), r["greedy"]
        mask[i, :n] = r["mask"].bool()
        if top:
            top_ids[i, :n] = r["top_ids"][:, :top].long()
            top_logp[i, :n] = r["top_logp"][:, :top].float()
    return ids, aux, greedy, mask, top_ids, top_logp


def kd_targets(top_ids: torch.Tensor, top_logp: torch.Tensor, index: torch.Tensor):
    """(draft indices [..., N], probabilities [..., N]): the top-N renormalised over the ids the
    head can propose, 0 elsewhere."""
    d = index[top_ids]
    p = torch.where(d >= 0, top_logp.exp(), torch.zeros(()))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    return d.clamp_min(0), p


def ttt_loss(
    head: Eagle3Head, rows: list[dict], steps: int, index: torch.Tensor, top: int = 0
) -> tuple[torch.Tensor, list[float]]:
    """The weighted loss of a batch and each step's greedy accuracy. Step j's query t is
    labelled `greedy[t+j+1]` where that token is an answer token within the head's vocabulary;
    `top` > 0 (kd): cross-entropy on the top-`top` (`kd_targets`) instead."""
    ids, aux, greedy, mask, top_ids, top_logp = _batch(rows, top)
    outs = head.ttt_logits(ids, aux, steps, score=False)  # scored below where labelled
    b, t = ids.shape
    total = torch.zeros(())
    accs = []
    for j, normed in enumerate(outs):
        src = torch.arange(t) + j + 1  # the position whose greedy token is the label
        ok = src < t
        src = src.clamp(max=t - 1)
        label_t = greedy[:, src]
        nxt = (src + 1).clamp(max=t - 1)
        valid = ok[None] & (src + 1 < t)[None] & mask[:, nxt]
        label = index[label_t]
        valid = valid & (label >= 0)
        if not valid.any():
            accs.append(float("nan"))
            continue
        lg = head.lm_head(normed[valid]).float()
        lb = label[valid]
        if top:
            d, p = kd_targets(top_ids[:, src][valid], top_logp[:, src][valid], index)
            loss = -(p * lg.log_softmax(-1).gather(-1, d)).sum(-1).mean()
        else:
            loss = F.cross_entropy(lg, lb)
        total = total + STEP_WEIGHT**j * loss
        accs.append(float((lg.argmax(-1) == lb).float().mean()))
    return total, accs


def train_head(
    head: Eagle3Head,
    rows: list[dict],
    epochs: float,
    lr: float,
    batch_size: int,
    steps: int,
    seed: int = 0,
    on_step: Callable[[int, int, float, list[float]], None] | None = None,
    top: int = 0,
) -> dict[str, Any]:
    """AdamW over the cached rows (the embedding frozen), cosine after a warm-up -> figures."""
    g = torch.Generator().manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    per_epoch = math.ceil(len(rows) / batch_size)
    total = max(1, round(per_epoch * epochs))
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)),
    )
    index = head.draft_index()
    head.train()
    t0 = time.perf_counter()
    first = last = None
    step = 0
    last_accs: list[float] = []
    while step < total:
        order = torch.randperm(len(rows), generator=g).tolist()
        for s in range(0, len(order), batch_size):
            if step >= total:
                break
            batch = [rows[i] for i in order[s : s + batch_size]]
            loss, accs = ttt_loss(head, batch, steps, index, top)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            value = loss.item()
            first = value if first is None else first
            last, last_accs = value, accs
            if on_step:
                on_step(step, total, value, accs)
    head.eval()
    return {
        "steps": step,
        "epochs": step / per_epoch,
        "runtime_s": time.perf_counter() - t0,
        "first_loss": first,
        "last_loss": last,
        "last_step_accuracy": last_accs,
    }


# -- the speculators format ------------------------------------------------------------------


def export(head: Eagle3Head, folder: Path, verifier: str, architectures: list[str]) -> None:
    """`folder` as speculators saves an Eagle3 speculator. `verifier`: the target's name/path."""
    from safetensors.torch import save_file

    c = head.config
    layer = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": False,  # vLLM's default when absent is True: always written
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "tie_word_embeddings": False,
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 4,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": verifier, "architectures": list(architectures)},
        },
        "phoenix": {"head": c.to_dict()},
        "dtype": "float32",
    }
    tmp = make_temp_dir(folder.parent, f".{folder.name}-")
    tensors = {
        k: v.detach().contiguous().cpu() for k, v in head.state_dict().items() if k != "inv_freq"
    }
    if c.draft_vocab_size == c.vocab_size:  # vLLM refuses the maps with the full vocabulary
        tensors.pop("d2t")
        tensors.pop("t2d")
    # speculators' loader leaves a missing embed_tokens uninitialised: write the target's.
    tensors["embed_tokens.weight"] = head._embed[0].weight.detach().float().contiguous().cpu()
    save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    atomic_write_json(tmp / CONFIG_NAME, config)
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    tmp.replace(folder)


UNSUPPORTED = {
    "norm_before_residual": True,
    "norm_before_fc": True,
    "fc_norm": True,
    "norm_output": True,
}  # speculators' variants this head does not implement


def config_of(config: dict, target) -> Eagle3Config:
    """An exported `config.json`'s head config (Phoenix's block, else speculators' keys);
    raises ValueError naming a variant flag this head does not implement."""
    odd = [k for k, v in UNSUPPORTED.items() if bool(config.get(k, False)) == v]
    if odd:
        raise ValueError(f"eagle3 variants {odd} (true) are not implemented by Phoenix's head")
    if "phoenix" in config:
        return Eagle3Config.from_dict(config["phoenix"]["head"])
    layer = config["transformer_layer_config"]
    n = target.config.num_hidden_layers
    aux = config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(n)
    rope = layer.get("rope_parameters") or {}
    heads = layer["num_attention_heads"]
    return Eagle3Config(
        hidden_size=layer["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        intermediate_size=layer["intermediate_size"],
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
        vocab_size=layer.get("vocab_size", target.config.vocab_size),
        draft_vocab_size=config.get("draft_vocab_size") or target.config.vocab_size,
        aux_layer_ids=tuple(sorted(aux)),
        max_position_embeddings=layer.get("max_position_embeddings", 4096),
        target_layers=n,
    )


def load_head(folder: str | Path, target, verifier: str | None = None) -> Eagle3Head:
    """An exported head on the target's embeddings; ValueError if made for another verifier."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / CONFIG_NAME).read_text())
    made_for = config.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    if verifier is not None and made_for != verifier:
        raise ValueError(
            f"the eagle3 head {folder} was trained for the verifier {made_for!r}, "
            f"but the target is {verifier!r}"
        )
    c = config_of(config, target)
    if c.hidden_size != target.config.hidden_size or c.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"the eagle3 head {folder} has hidden {c.hidden_size} / vocab {c.vocab_size}; the "
            f"target {target.config.hidden_size} / {target.config.vocab_size}"
        )
    head = Eagle3Head(c, target.get_input_embeddings())
    state = load_file(str(folder / WEIGHTS_NAME))
    state.pop("embed_tokens.weight", None)  # the target's own serves (the same rows)
    if "d2t" not in state:  # the full vocabulary: identity maps
        state["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    head.load_state_dict(state, strict=False)
    missing = set(head.state_dict()) - set(state) - {"inv_freq"}
    if missing:
        raise ValueError(f"the eagle3 head {folder} lacks {sorted(missing)}")
    return head.to(next(target.parameters()).dtype).eval()


# -- the merge stage's check and card ---------------------------------------------------------


@torch.no_grad()
def head_logits(head: Eagle3Head, target, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The head's first-guess logits at every position of each prompt (teacher-forced)."""
    from .speculative.eagle3 import HeadCache

    out = []
    dev = next(target.parameters()).device
    for p in prompts:
        o = target(input_ids=torch.tensor([p], device=dev), output_hidden_states=True)
        aux = torch.cat([o.hidden_states[a] for a in head.config.aux_layer_ids], dim=-1)
        logits, _ = head.forward_step(
            torch.tensor([p[1:]], device=dev), head.fuse(aux[:, :-1]), 0, HeadCache()
        )
        out.append(logits.float().cpu())
    return out


def vllm_command(target: str, head_dir: str, k: int = 4) -> str:
    spec = json.dumps({"method": "eagle3", "model": head_dir, "num_speculative_tokens": k})
    return f"python -m vllm.entrypoints.openai.api_server --model {target} --speculative-config '{spec}'"


def vllm_caveat(aux_layers) -> str | None:
    """Why vLLM cannot serve a head (it taps each layer once: no repeated aux layer), or None."""
    if len(set(aux_layers)) == len(aux_layers):
        return None
    return (f"vLLM cannot serve this head: it fuses target layers {list(aux_layers)}, and vLLM "
            "reads each layer once (three distinct layers: a target of 3 or more)")  # fmt: skip
