"""Target-only greedy decoding of a changing set of rows in one padded batch: continuous
batching, as the local teacher and the server's plain requests use it.

Rows are left-padded into one growing `DynamicCache` (`mask` marks the real positions); new rows
are prefilled apart and merged in at a step boundary, finished rows leave at once. Output is each
row's target-only greedy output (tested against `SpeculativeEngine.generate` at arm 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .engine import GenerationResult, SpeculativeEngine


@dataclass
class _Row:
    """One request in a `TargetBatch`: the caller's key, its budget, and its output so far."""

    key: object
    max_new_tokens: int
    prompt_tokens: int
    start: float
    out: list[int] = field(default_factory=list)
    first_at: float | None = None


class TargetBatch:
    """Target-only greedy decoding of a changing set of rows: the batching local teacher.

    `add` prefills new rows (left-padded) and merges them into the running batch at a step
    boundary; `step` commits one token per row and returns the rows that finished, which leave
    the batch at once (on a CPU a step costs about in proportion to its rows). So requests that
    arrive while a batch runs join it instead of waiting for its longest answer. Invariant between
    calls: `mask` is as wide as the cache, and `logits` holds each row's next-token scores."""

    def __init__(self, engine: SpeculativeEngine):
        self.engine = engine
        self.model = engine.target
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.rows: list[_Row] = []

    @property
    def active(self) -> int:
        return len(self.rows)

    def keys(self) -> list:
        return [row.key for row in self.rows]

    def drop(self, predicate: Callable[[object], bool]) -> list:
        """Remove the rows whose key satisfies `predicate` (callers that left); returns their
        keys. The other rows go on unchanged."""
        flags = [predicate(row.key) for row in self.rows]  # once: a flag may flip meanwhile
        gone = [row.key for row, f in zip(self.rows, flags, strict=True) if f]
        if gone:
            self._select([i for i, f in enumerate(flags) if not f])
        return gone

    def _select(self, keep: list[int]) -> None:
        """Keep only the rows at `keep` (cache, mask, scores and bookkeeping alike)."""
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.mask = self.logits = None
            return
        sel = torch.tensor(keep, device=self.engine.device)
        self.cache.batch_select_indices(sel)
        self.mask = self.mask[sel]
        self.logits = self.logits[sel]

    @staticmethod
    def check_row(prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        if not prompt_ids or max_new_tokens < 1:
            raise ValueError("a row needs a non-empty prompt and max_new_tokens >= 1")

    @property
    def joinable(self) -> bool:
        """Whether rows can join now: an empty batch, or plain growing caches (a sliding-window
        cache could not be left-padded)."""
        return self.cache is None or all(type(x) is DynamicLayer for x in self.cache.layers)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache):
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    @torch.inference_mode()
    def add(self, items: Sequence[tuple[object, tuple[Sequence[int], int]]]) -> None:
        """Add rows `(key, (prompt_ids, max_new_tokens))`; keys come back from `step`."""
        if not items:
            return
        for _, (p, n) in items:
            self.check_row(p, n)
        dev = self.engine.device
        now = time.perf_counter()
        prompts = [list(p) for _, (p, _) in items]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.engine.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache)
        rows = [_Row(key, n, len(p), now) for (key, (p, n)) in items]
        if not self.rows:
            self.cache, self.mask, self.logits, self.rows = cache, mask, logits, rows
            return
        if not self.joinable:
            raise ValueError("this model's cache cannot take rows into a running batch")
        width = max(self.mask.shape[1], mask.shape[1])
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(mask, width)])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)])
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)])
        self.logits = torch.cat([self.logits, logits])
        self.rows += rows

    @torch.inference_mode()
    def step(self) -> list[tuple[object, GenerationResult]]:
        """Commit one token to every row; returns `(key, result)` for the rows that finished."""
        if not self.rows:
            return []
        eos = self.engine.eos_token_ids
        nxt = self.logits.argmax(-1).tolist()
        keep, finished = [], []
        for i, row in enumerate(self.rows):
            if nxt[i] in eos:
                finished.append((row, "stop"))
                continue
            row.out.append(nxt[i])
            if row.first_at is None:
                row.first_at = time.perf_counter()
            if len(row.out) < row.max_new_tokens:
                keep.append(i)
            else:
                finished.append((row, "length"))
        now = time.perf_counter()
        results = [
            (
                row.key,
                GenerationResult(
                    token_ids=row.out,
                    arm="0",
                    finish_reason=reason,
                    latency_s=now - row.start,
                    draft_s=0.0,
                    verify_s=now - row.start,
                    prompt_tokens=row.prompt_tokens,
                    rounds=len(row.out),
                    first_token_s=row.first_at - row.start if row.first_at else None,
                ),
            )
            for row, reason in finished
        ]
        if len(keep) < len(self.rows):
            self._select(keep)
            if not keep:
                return results
        dev = self.engine.device
        step = torch.tensor([[nxt[i]] for i in keep], dtype=torch.long, device=dev)
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(keep), 1))], dim=1)
        self.logits = self._forward(
            step, self.mask, self.mask.sum(-1, keepdim=True) - 1, self.cache
        )
        return results


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad dim 1 (a mask) or dim -2 (cached keys/values) on the left to `width`."""
    dim = 1 if t.dim() == 2 else -2
    extra = width - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def generate_batch(
    engine: SpeculativeEngine, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]
) -> list[GenerationResult]:
    """Target-only greedy generation of several prompts as one batch; results in prompt order."""
    batch = TargetBatch(engine)
    batch.add(list(enumerate(zip(prompts, max_new_tokens, strict=True))))
    done: dict = {}
    while batch.active:
        done.update(batch.step())
    return [done[i] for i in range(len(prompts))]
