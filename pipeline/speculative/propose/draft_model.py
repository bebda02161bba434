"""The draft model ("draft:K"): a same-tokenizer LM, one batched pass per draft position. Its
`RowCache` holds a prefix of each row's sequence; a step's first pass catches rows up."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..rows import RowCache, draft_scores, prefill
from ..runner import prepare
from ..sampling import draw, greedy_ids, probabilities_of
from . import Drafts, full_distribution, steady


class Drafter:
    """A draft model and, with `token_ids`, a pruned head scoring only those ids (a copied slice;
    the model is unchanged, so it may be shared). Verification uses the full vocabulary."""

    def __init__(self, model, token_ids: Sequence[int] | None = None):
        self.model = model
        self.head: torch.Tensor | None = None  # [len(ids), hidden] rows of the output head
        self.head_ids: torch.Tensor | None = None  # [len(ids)] the ids they score
        if token_ids is not None:
            ids = torch.tensor(sorted(set(int(t) for t in token_ids)), dtype=torch.long)
            vocab = model.config.vocab_size
            if len(ids) == 0 or int(ids.max()) >= vocab or int(ids.min()) < 0:
                raise ValueError(
                    f"draft head subset must be ids in [0, {vocab}), got {len(ids)} ids"
                )
            self.head_ids = ids.to(next(model.parameters()).device)
            self.head = model.get_output_embeddings().weight.detach()[self.head_ids].clone()

    @property
    def head_token_ids(self) -> list[int] | None:
        """The ids the head scores; None: the full vocabulary."""
        return None if self.head_ids is None else self.head_ids.tolist()


class DraftModelProposer:
    """`Proposer` over a `Drafter` (`rows` rows, `limit` positions); `cost` times steady passes."""

    taps: tuple[int, ...] = ()

    def __init__(self, drafter: Drafter, rows: int, limit: int, vocab: int, cost, lean=True):
        self.drafter = drafter
        self.vocab = vocab  # the target's: a sampled row's q is over it
        self.cost = cost
        prepare(drafter.model, limit, lean)
        self.cache = RowCache(drafter.model, rows, limit)
        self._by_slot: dict[int, object] = {}

    def adopt(self, rows: list) -> None:
        """Take over rows from another draft (empty cache rows; they catch up on next proposal)."""
        for r in rows:
            r.dslot = self.cache.alloc()
            self._by_slot[r.dslot] = r

    def join(self, rows: list, states: list) -> float:
        t0 = time.perf_counter()
        self.adopt(rows)
        prefill(self.drafter.model, self.cache, [r.dslot for r in rows],
                [r.seq[:-1] for r in rows])  # fmt: skip
        return time.perf_counter() - t0

    def accepted(self, row, length: int, states) -> None:
        self.cache.crop(row.dslot, length)

    def leave(self, row) -> None:
        if row.dslot is None:  # its join failed before it had a cache row here
            return
        del self._by_slot[row.dslot]
        moved = self.cache.release(row.dslot)
        if moved is not None:
            r = self._by_slot.pop(moved)
            r.dslot = row.dslot
            self._by_slot[r.dslot] = r
        row.dslot = None

    def propose(self, rows: list) -> Drafts:
        """One pass per position over rows short of k_eff; each pass's time split equally."""
        order = sorted(range(len(rows)), key=lambda i: rows[i].dslot)  # the cache as a view
        tokens: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        seconds = [0.0] * len(rows)
        active = order
        feeds = [rows[i].seq[self.cache.lengths[rows[i].dslot] :] for i in order]
        step = 0
        while active:
            picks, dt, shared = self._pass([rows[i] for i in active], feeds, qs, active, step)
            for i, tok in zip(active, picks, strict=True):
                tokens[i].append(tok)
                seconds[i] += dt / len(active) + (0.0 if rows[i].sampling.greedy else shared)
            step += 1
            active = [i for i in active if rows[i].k_eff > step]
            feeds = [[tokens[i][-1]] for i in active]
        return Drafts(tokens, qs, seconds)

    def _pass(self, active: list, feeds: list, qs: list, index: list[int], step: int):
        """One pass: (picks, seconds, each sampled row's draw seconds); sampled q's go to `qs`."""
        d = self.drafter
        t0 = time.perf_counter()
        scores = draft_scores(d.model, self.cache, [r.dslot for r in active], feeds, d.head)
        best = greedy_ids(scores)
        picks = (best if d.head_ids is None else d.head_ids[best]).tolist()
        dt = time.perf_counter() - t0
        if step > 0 or all(steady(r, len(f)) for r, f in zip(active, feeds, strict=True)):
            self.cost.observe(len(active), dt)
        r0 = time.perf_counter()
        sampled = [j for j, r in enumerate(active) if not r.sampling.greedy]
        dists = probabilities_of(
            [scores[j] for j in sampled], [active[j].sampling for j in sampled]
        )
        for j, q in zip(sampled, dists, strict=True):
            pick = draw(q, active[j].gen)
            picks[j] = pick if d.head_ids is None else int(d.head_ids[pick])
            qs[index[j]].append(full_distribution(q, d.head_ids, self.vocab))
        shared = (time.perf_counter() - r0) / max(1, len(sampled))
        return picks, dt, shared
