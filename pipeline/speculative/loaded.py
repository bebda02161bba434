"""The loaded models and token ids the step loop runs over (built by `models.load_pair`)."""

from __future__ import annotations

from collections.abc import Sequence

from .arms import parallel_token
from .propose.draft_model import Drafter


def context_limit(*models) -> int | None:
    """The shortest `max_position_embeddings` of the models given (None: none says)."""
    limits = [getattr(m.config, "max_position_embeddings", None) for m in models if m is not None]
    return min((x for x in limits if x), default=None)


class Models:
    """A target, optional draft (`drafter`, pruned head `draft_token_ids`, the mask id
    `parallel_token` if trained for parallel drafting) and EAGLE-3 head, on one device.
    Invariants: vocabularies match the target's; `max_context` is the shortest."""

    def __init__(
        self,
        target,
        draft=None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        draft_token_ids: Sequence[int] | None = None,
        head=None,
    ):
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft vocab ({draft.config.vocab_size}) differs from target's "
                f"({target.config.vocab_size}): they must share a tokenizer"
            )
        if draft_token_ids is not None and draft is None:
            raise ValueError("a pruned draft head needs a draft")
        if head is not None and head.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the eagle3 head's vocabulary ({head.config.vocab_size}) is not the target's "
                f"({target.config.vocab_size})"
            )
        self.target = target
        self.draft = draft
        self.head = head
        self.eos_token_ids = set(eos_token_ids)
        self.pad_token_id = (
            pad_token_id if pad_token_id is not None else min(self.eos_token_ids, default=0)
        )
        self.device = next(target.parameters()).device
        self.max_context = context_limit(target, draft)
        self.drafter = Drafter(draft, draft_token_ids) if draft is not None else None
        self.parallel_token = None if draft is None else parallel_token(draft.config.to_dict())

    @property
    def draft_head_ids(self) -> list[int] | None:
        """The ids the draft's head scores; None: the full vocabulary (or no draft)."""
        return None if self.drafter is None else self.drafter.head_token_ids
