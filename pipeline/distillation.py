"""What the draft learns: the training rows (`build_examples`) and the objectives' losses.

    sft        cross-entropy on the teacher's answer tokens
    kd         the target's next-token distribution at every answer position: dense, or its
               top-N (a teacher endpoint's `top_logprobs`, or the local target cut to N)
    on_policy  the target's distribution on the draft's own continuations (GKD, DistillSpec)
               in a share `train.on_policy_ratio` of batches; kd on the answers in the rest
    parallel   (train.parallel, with sft) rows carrying mask blocks (`pard`): one cross-entropy
               over the real next tokens and the masks' labels together

Divergence of the draft's q from the target's p: forward_kl KL(p||q), reverse_kl KL(q||p),
tv (total variation) or jsd (Jensen-Shannon, beta 0.5). The LM head runs only on scored positions.
"""

from __future__ import annotations

import math
import random
import types
from typing import Any

import torch
import torch.nn.functional as F

from . import models, pard
from .errors import InputError

DIVERGENCES = ("forward_kl", "reverse_kl", "tv", "jsd")


# --- losses (pure tensor functions) ------------------------------------------------------------
def _p_times_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum exp(a) * (a - b) over the last axis, with 0 * anything = 0 (a = -inf buckets)."""
    return torch.where(a > -math.inf, a.exp() * (a - b), a.new_zeros(())).sum(-1)


def divergence(t_logp: torch.Tensor, s_logp: torch.Tensor, kind: str, beta: float = 0.5):
    """Per-row divergence of log-probabilities t (teacher) and s (student), [rows, buckets]
    (-inf: an unused bucket)."""
    if kind == "forward_kl":
        return _p_times_diff(t_logp, s_logp)
    if kind == "reverse_kl":
        return _p_times_diff(s_logp, t_logp)
    if kind == "tv":
        return 0.5 * (t_logp.exp() - s_logp.exp()).abs().sum(-1)
    if kind == "jsd":
        m = torch.logaddexp(t_logp + math.log(beta), s_logp + math.log(1 - beta))
        return beta * _p_times_diff(t_logp, m) + (1 - beta) * _p_times_diff(s_logp, m)
    raise ValueError(f"unknown divergence {kind!r}; expected one of {DIVERGENCES}")


def _with_rest(top_logp: torch.Tensor) -> torch.Tensor:
    """Append the bucket 'every other token' (1 - the listed mass) to top-N log-probabilities."""
    rest = (1 - top_logp.exp().sum(-1, keepdim=True)).clamp(min=1e-6).log()
    return torch.cat([top_logp, rest], -1)


def sparse_divergence(
    s_logits: torch.Tensor, ids: torch.Tensor, t_logp: torch.Tensor, kind: str
) -> torch.Tensor:
    """Divergence against a teacher's top-N `ids`/`t_logp` (-inf: no entry) plus a rest bucket;
    the student's distribution is folded onto the same N + 1 buckets."""
    s_all = F.log_softmax(s_logits.float(), -1)
    valid = t_logp > -math.inf
    s_top = torch.where(valid, s_all.gather(-1, ids), torch.full_like(t_logp, -math.inf))
    return divergence(_with_rest(t_logp), _with_rest(s_top), kind)


def dense_divergence(s_logits: torch.Tensor, t_logits: torch.Tensor, kind: str) -> torch.Tensor:
    return divergence(
        F.log_softmax(t_logits.float(), -1), F.log_softmax(s_logits.float(), -1), kind
    )


def top_k_sparse(t_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids and log-probabilities (what `top_logprobs: k` returns)."""
    logp, ids = F.log_softmax(t_logits.float(), -1).topk(k, -1)
    return ids, logp


# --- compact LM head ---------------------------------------------------------------------------
def add_compact_head(model) -> None:
    """`model(..., logits_at=mask)` -> logits [n, vocab] of the positions where `mask` [B, T]
    is true, the head run on no other; without it, the original forward. Patch before PEFT."""
    original = model.forward

    def forward(self, *args, logits_at=None, **kwargs):
        if logits_at is None:
            return original(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.get_decoder()(*args, **kwargs).last_hidden_state
        return self.get_output_embeddings()(hidden[logits_at])

    model.forward = types.MethodType(forward, model)


def shifted(mask: torch.Tensor) -> torch.Tensor:
    """Token mask -> the positions that predict those tokens (one to the left)."""
    out = torch.zeros_like(mask, dtype=torch.bool)
    out[:, :-1] = mask[:, 1:].bool()
    return out


@torch.no_grad()
def teacher_logits(teacher, input_ids, attention_mask, at, position_ids=None) -> torch.Tensor:
    hidden = teacher.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).last_hidden_state
    return teacher.get_output_embeddings()(hidden[at])


# --- batches ---------------------------------------------------------------------------------
class Collator:
    """Right-padded rows -> input_ids, attention_mask, completion_mask, prompt_len, row; parallel
    rows (`pard.parallel_rows`) -> `pard.collate`'s batch (a 4-D mask, position ids, labels)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if "anchor" in rows[0]:
            return pard.collate(rows, self.pad_id)
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), n), self.pad_id, dtype=torch.long)
        att = torch.zeros((len(rows), n), dtype=torch.long)
        comp = torch.zeros((len(rows), n), dtype=torch.long)
        for i, r in enumerate(rows):
            k = len(r["input_ids"])
            ids[i, :k] = torch.tensor(r["input_ids"])
            att[i, :k] = 1
            comp[i, :k] = torch.tensor(r["completion_mask"])
        return {
            "input_ids": ids,
            "attention_mask": att,
            "completion_mask": comp,
            "prompt_len": torch.tensor([r["completion_mask"].index(1) for r in rows]),
            "row": torch.tensor([r["row"] for r in rows]),
        }


def stack_sparse(rows: list[list[list]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position [[id, logprob], ...] -> (ids, logp) [n, width], padded with id 0 at -inf."""
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    logp = torch.full((len(rows), width), -math.inf)
    for i, entries in enumerate(rows):
        for j, (tid, lp) in enumerate(entries[:width]):
            ids[i, j] = int(tid)
            logp[i, j] = float(lp)
    return ids, logp


# --- the trainer -------------------------------------------------------------------------------
def make_trainer_class():
    """The SFTTrainer subclass (built lazily: importing TRL costs seconds)."""
    from trl import SFTTrainer

    class DistillTrainer(SFTTrainer):
        """TRL's SFTTrainer with Phoenix's objectives. `teacher`: the target model; `sparse`:
        per row, (ids, logp) per answer token when the teacher's top-N came with the answers."""

        def __init__(
            self,
            *args,
            objective: str = "sft",
            divergence: str = "forward_kl",
            teacher=None,
            sparse: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
            top_k: int | None = None,
            on_policy: dict[str, Any] | None = None,
            **kwargs,
        ):
            super().__init__(*args, **kwargs)
            self.model_accepts_loss_kwargs = False  # the loss is a per-batch mean
            self.objective = objective
            self.divergence_kind = divergence
            self.teacher = teacher
            self.sparse = sparse
            self.top_k = top_k
            self.on_policy = on_policy or {}
            self._rng = random.Random(self.args.seed)
            self.pad_id = self.data_collator.pad_id

        def _answers_loss(self, model, b) -> tuple[torch.Tensor, torch.Tensor]:
            if "targets" in b:  # train.parallel: rows with mask blocks
                loss, match, masks = parallel_loss(model, b, self.accelerator.unwrap_model(model))
                if masks is not None:
                    self._metrics["train" if model.training else "eval"]["parallel_match"].append(
                        masks
                    )
                return loss, match
            at = shifted(b["completion_mask"])
            labels = b["input_ids"][:, 1:][b["completion_mask"][:, 1:].bool()]
            logits = model(
                input_ids=b["input_ids"], attention_mask=b["attention_mask"], logits_at=at
            )
            if self.objective == "sft":
                loss = F.cross_entropy(logits.float(), labels)
            elif self.sparse is not None:
                ids, logp = gather_sparse(self.sparse, b["row"], logits.device)
                loss = sparse_divergence(logits, ids, logp, self.divergence_kind).mean()
            else:
                t = teacher_logits(self.teacher, b["input_ids"], b["attention_mask"], at)
                loss = teacher_divergence(logits, t, self.top_k, self.divergence_kind)
            return loss, (logits.argmax(-1) == labels).float().mean()

        def _on_policy_loss(self, model, b) -> tuple[torch.Tensor, torch.Tensor]:
            draft = self.accelerator.unwrap_model(model)
            out, full_att, mask = draft_rollout(draft, b, self.pad_id, self.on_policy)
            pos = (full_att.cumsum(-1) - 1).clamp(min=0)
            at = shifted(mask)
            logits = model(input_ids=out, attention_mask=full_att, position_ids=pos, logits_at=at)
            t = teacher_logits(self.teacher, out, full_att, at, position_ids=pos)
            match = (logits.argmax(-1) == t.argmax(-1)).float().mean()
            return teacher_divergence(logits, t, self.top_k, self.divergence_kind), match

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            mode = "train" if model.training else "eval"
            policy_batch = self.objective == "on_policy" and model.training
            if policy_batch and self._rng.random() < self.on_policy["ratio"]:
                loss, match = self._on_policy_loss(model, inputs)
                self._metrics[mode]["on_policy_batches"].append(1.0)
            else:
                loss, match = self._answers_loss(model, inputs)
                if self.objective == "on_policy":
                    self._metrics[mode]["on_policy_batches"].append(0.0)
            # Greedy agreement with the teacher on the scored tokens: the acceptance proxy.
            self._metrics[mode]["teacher_match"].append(match.item())
            return (loss, None) if return_outputs else loss

    return DistillTrainer


def parallel_loss(model, b: dict, unwrapped) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """sft over a parallel batch (`pard.collate`): one cross-entropy over the real next tokens
    and the masks' labels -> (loss, the real tokens' greedy agreement, the masks' (None: no
    mask in the batch)). `unwrapped`: `model` out of its DDP wrapper (config readable)."""
    logits, labels, depth = pard.labelled_logits(
        model, b, pard.model_mask(b["attention_mask"], unwrapped)
    )
    hit = logits.argmax(-1) == labels
    masks = hit[depth > 0].float().mean().item() if bool((depth > 0).any()) else None
    return F.cross_entropy(logits.float(), labels), hit[depth == 0].float().mean(), masks


def teacher_divergence(s_logits, t_logits, top_k: int | None, kind: str) -> torch.Tensor:
    """Mean divergence from the target's logits: over its top_k + a rest bucket, or dense."""
    if top_k:
        ids, logp = top_k_sparse(t_logits, top_k)
        return sparse_divergence(s_logits, ids, logp, kind).mean()
    return dense_divergence(s_logits, t_logits, kind).mean()


def gather_sparse(
    sparse: dict[int, tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's rows' stored (ids, logp) per answer token, concatenated in row order."""
    parts = [sparse[int(r)] for r in rows]
    return (
        torch.cat([p[0] for p in parts]).to(device),
        torch.cat([p[1] for p in parts]).to(device),
    )


def draft_rollout(
    draft, b: dict[str, torch.Tensor], pad_id: int, on_policy: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft continues each prompt without gradients (its train mode restored). Returns
    sequences [B, prompt + new], their attention mask, and the mask of the new tokens kept (up
    to and including each row's end-of-turn)."""
    ids, att = _left_padded_prompts(b, pad_id)
    was_training = draft.training
    draft.eval()
    sample = on_policy["temperature"] > 0
    with torch.no_grad():
        out = draft.generate(
            input_ids=ids,
            attention_mask=att,
            max_new_tokens=on_policy["max_new_tokens"],
            do_sample=sample,
            temperature=on_policy["temperature"] if sample else None,
            top_p=None,
            top_k=None,
            pad_token_id=pad_id,
            eos_token_id=on_policy["eos"],
            use_cache=True,
        )
    draft.train(was_training)
    new = out[:, ids.shape[1] :]
    done = torch.zeros(new.shape[0], dtype=torch.bool, device=new.device)
    keep = torch.zeros_like(new, dtype=torch.bool)
    for j in range(new.shape[1]):  # each row's tokens up to and including its end-of-turn
        keep[:, j] = ~done
        done |= torch.isin(new[:, j], torch.tensor(on_policy["eos"], device=new.device))
    full_att = torch.cat([att, keep.long()], 1)
    mask = torch.cat([torch.zeros_like(att), keep.long()], 1)
    return out, full_att, mask


def _left_padded_prompts(b: dict[str, torch.Tensor], pad_id: int):
    lens = b["prompt_len"].tolist()
    n = max(lens)
    ids = torch.full((len(lens), n), pad_id, dtype=torch.long, device=b["input_ids"].device)
    att = torch.zeros_like(ids)
    for i, k in enumerate(lens):
        ids[i, n - k :] = b["input_ids"][i, :k]
        att[i, n - k :] = 1
    return ids, att


# --- teacher logprobs as token ids ------------------------------------------------------------
def token_id_map(tokenizer) -> dict[str, int]:
    """Token text (as OpenAI-compatible servers print it) -> id; texts several ids decode to
    are left out (`token_to_id` reads vLLM's `token_id:N` form)."""
    seen: dict[str, int] = {}
    clash: set[str] = set()
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        if text in seen:
            clash.add(text)
        else:
            seen[text] = i
    for text in clash:
        del seen[text]
    return seen


def token_to_id(token: str, ids: dict[str, int]) -> int | None:
    if token.startswith("token_id:"):
        try:
            return int(token[len("token_id:") :])
        except ValueError:
            return None
    return ids.get(token)


# --- the training rows -------------------------------------------------------------------------
def build_examples(
    answers: list[dict],
    tokenizer,
    template_kwargs: dict,
    max_length: int,
    logprobs_width: int | None = None,
    include_reasoning: bool = False,
) -> tuple[list[dict], dict[int, tuple]]:
    """Training rows: the prompt as the server renders it, then the teacher's answer, the
    completion mask over exactly the teacher's tokens (plus end-of-turn when it stopped by
    itself). A conversation's turns (answers sharing task_id and sample, in turn order) share
    one row while each turn's rendered history extends the row so far (the chat template's own
    output: user and system tokens weigh 0, every answer's 1); where the template renders an
    earlier turn otherwise, the turn starts a row of its own. With `logprobs_width`, the answer
    tokens are those its stored logprobs name, and the second result maps row -> (ids, logp)
    per answer token (an appended end-of-turn is a plain label)."""
    eos = tokenizer.eos_token_id
    id_map = token_id_map(tokenizer) if logprobs_width else None
    rows, sparse = [], {}

    def emit(ids: list[int], mask: list[int], tops: list | None) -> None:
        ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask) == 0:
            return  # the prompt alone fills max_length: nothing to learn from
        if tops is not None:
            sparse[len(rows)] = stack_sparse(tops[: sum(mask)], logprobs_width)
        rows.append({"input_ids": ids, "completion_mask": mask, "row": len(rows)})

    for turns in _conversations(answers):
        ids: list[int] = []
        mask: list[int] = []
        tops: list | None = [] if logprobs_width else None
        for a in turns:
            p_ids = prompt_ids(a, tokenizer, template_kwargs)
            if not ids or p_ids[: len(ids)] != ids:
                if ids:
                    emit(ids, mask, tops)
                ids, mask, tops = [], [], [] if logprobs_width else None
            mask += [0] * (len(p_ids) - len(ids))
            ids = list(p_ids)
            c_ids, c_tops = answer_ids(a, tokenizer, id_map, include_reasoning)
            # vLLM's token_ids end with the end-of-turn token, Phoenix's teacher's do not: one each.
            stop = [eos] if a.get("finish_reason") == "stop" and c_ids[-1:] != [eos] else []
            ids += c_ids + stop
            mask += [1] * (len(c_ids) + len(stop))
            if tops is not None:
                tops += c_tops + [[[eos, 0.0]] for _ in stop]
        emit(ids, mask, tops)
    return rows, sparse


def _conversations(answers: list[dict]) -> list[list[dict]]:
    """Answers grouped by (task_id, sample) in first-seen order, each group by turn."""
    groups: dict[tuple, list[dict]] = {}
    for a in answers:
        groups.setdefault((a.get("task_id"), a.get("sample", 0)), []).append(a)
    return [sorted(g, key=lambda a: a.get("turn", 0)) for g in groups.values()]


def prompt_ids(a: dict, tokenizer, template_kwargs: dict) -> list[int]:
    """What the server saw for this answer: captured traffic carries its rendered prompt; a
    conversation's turn its history; an MBPP answer its one user message."""
    if a.get("prompt_token_ids"):
        return list(a["prompt_token_ids"])
    messages = a.get("messages") or [{"role": "user", "content": a["prompt"]}]
    return models.chat_prompt_ids(tokenizer, messages, template_kwargs)


def answer_ids(
    a: dict, tokenizer, id_map: dict | None, include_reasoning: bool
) -> tuple[list[int], list]:
    """The answer's tokens (the teacher's own ids where it sent them) and, with `id_map`, its
    top-N per token. A teacher's reasoning (`reasoning`) is trained on only with
    `include_reasoning`, as `<think>` ... `</think>` before the answer (Qwen3's form); the
    teacher's ids then cover both, so the text is tokenized instead."""
    reasoning = a.get("reasoning")
    if id_map is not None:
        if reasoning:
            raise InputError(
                f"answer task_id {a['task_id']} carries the teacher's reasoning, whose stored "
                "logprobs do not cover it: use train.objective=sft, or a teacher without it"
            )
        return _logprob_targets(a, tokenizer, id_map)
    if reasoning and include_reasoning:
        text = f"<think>\n{reasoning}\n</think>\n\n{a['completion']}"
        return tokenizer(text, add_special_tokens=False)["input_ids"], []
    if a.get("completion_token_ids") is not None and not reasoning:
        return list(a["completion_token_ids"]), []
    return tokenizer(a["completion"], add_special_tokens=False)["input_ids"], []


def _logprob_targets(a: dict, tokenizer, id_map: dict[str, int]) -> tuple[list[int], list[list]]:
    """The answer's ids and top-N [[id, logprob], ...] per token; the ids must spell the answer."""
    lps = a.get("completion_logprobs")
    if not lps:
        raise InputError(
            f"answer task_id {a['task_id']} has no stored logprobs, which train.objective=kd "
            "with train.kd_source=teacher needs: rerun distill (it asks the teacher again)"
        )
    ids = [token_to_id(tok, id_map) for tok, _, _ in lps]
    if None in ids or tokenizer.decode(ids) != a["completion"]:
        raise InputError(
            f"answer task_id {a['task_id']}: its stored logprob tokens do not match the answer's "
            f"tokens in the draft's tokenizer (token {ids.index(None) if None in ids else '-'} "
            "unknown, or the decoded text differs): the teacher's tokenizer must be the draft's"
        )
    tops = [
        [[i, lp] for i, lp in ((token_to_id(t, id_map), lp) for t, lp in top) if i is not None]
        for _, _, top in lps
    ]
    return ids, tops
