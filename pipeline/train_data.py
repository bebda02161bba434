"""The training rows: each answer's prompt + completion tokenised with a completion mask, and,
for kd from a teacher endpoint, the teacher's sparse top-N distribution at each answer token.
"""

from __future__ import annotations

from . import distillation, models
from .errors import InputError


def build_examples(
    answers: list[dict],
    tokenizer,
    template_kwargs: dict,
    max_length: int,
    logprobs_width: int | None = None,
) -> tuple[list[dict], dict[int, tuple]]:
    """Pre-tokenised prompt+completion rows with a completion mask: the loss sees exactly the
    teacher's tokens (its own ids when the teacher reported them), plus end-of-turn only when
    the teacher stopped by itself (an answer cut at max_tokens gets none).

    With `logprobs_width` (kd from the teacher's stored top_logprobs) the answer's tokens are
    the ones its logprobs name, and the second result holds, per row, the teacher's sparse
    distribution at each answer token: (ids, logprobs) tensors; the end-of-turn the teacher
    reports no logprobs for is learnt as a plain label."""
    eos = tokenizer.eos_token_id
    id_map = distillation.token_id_map(tokenizer) if logprobs_width else None
    rows, sparse = [], {}
    for a in answers:
        p_ids = a.get("prompt_token_ids") or models.user_prompt_ids(
            tokenizer, a["prompt"], template_kwargs
        )  # captured traffic carries its rendered prompt
        c_ids = a.get("completion_token_ids")
        tops = None
        if logprobs_width:
            c_ids, tops = _logprob_targets(a, tokenizer, id_map)
        if c_ids is None:
            c_ids = tokenizer(a["completion"], add_special_tokens=False)["input_ids"]
        c_ids = list(c_ids)
        # vLLM's token_ids end with the end-of-turn token, Phoenix's teacher's do not: one each.
        stop = [eos] if a.get("finish_reason") == "stop" and c_ids[-1:] != [eos] else []
        c_ids += stop
        ids = (p_ids + c_ids)[:max_length]
        mask = ([0] * len(p_ids) + [1] * len(c_ids))[:max_length]
        if sum(mask) == 0:
            continue  # prompt alone fills max_length: nothing to learn from
        if tops is not None:
            tops = (tops + [[[eos, 0.0]] for _ in stop])[: sum(mask)]
            sparse[len(rows)] = distillation.stack_sparse(tops, logprobs_width)
        rows.append({"input_ids": ids, "completion_mask": mask, "row": len(rows)})
    return rows, sparse


def _logprob_targets(a: dict, tokenizer, id_map: dict[str, int]) -> tuple[list[int], list[list]]:
    """The answer's token ids and top-N [[id, logprob], ...] per token from its stored logprobs,
    checked against the answer: the tokens must spell it."""
    lps = a.get("completion_logprobs")
    if not lps:
        raise InputError(
            f"answer task_id {a['task_id']} has no stored logprobs, which train.objective=kd "
            "with train.kd_source=teacher needs: rerun distill (it asks the teacher again)"
        )
    ids = [distillation.token_to_id(tok, id_map) for tok, _, _ in lps]
    if None in ids or tokenizer.decode(ids) != a["completion"]:
        raise InputError(
            f"answer task_id {a['task_id']}: its stored logprob tokens do not match the answer's "
            f"tokens in the draft's tokenizer (token {ids.index(None) if None in ids else '-'} "
            "unknown, or the decoded text differs): the teacher's tokenizer must be the draft's"
        )
    tops = [
        [
            [i, lp]
            for i, lp in ((distillation.token_to_id(t, id_map), lp) for t, lp in top)
            if i is not None
        ]
        for _, _, top in lps
    ]
    return ids, tops


def pad_id(tok) -> int:
    """The id batches are padded with (end-of-text where a tokenizer has no pad token)."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
