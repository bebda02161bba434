"""The parallel draft ("pard:K", PARD): the draft model, trained to fill mask tokens
(`train.parallel`), guesses K tokens in one batched pass. Each row feeds the tokens its cache
lacks, then K-1 copies of the mask id; the scores at its last real token and at the masks are its
K guesses. The masks' keys are cropped after the pass, so the cache holds only real tokens.

A sampled row draws guess j from the pass's distribution at position j alone (it does not see
guesses 1..j-1); that `q` goes to verification, so the output stays distributed as the
target's (`sampling.verify` needs only the distribution each guess was drawn from)."""

from __future__ import annotations

import time

from ..rows import draft_scores
from ..sampling import draw, greedy_ids, probabilities_of
from . import Drafts, full_distribution, steady
from .draft_model import Drafter, DraftModelProposer


class ParallelProposer(DraftModelProposer):
    """`Proposer` over a `Drafter` whose model fills `mask_id` (its config's `pard_token`);
    `cost` times steady passes against rows."""

    def __init__(self, drafter: Drafter, mask_id: int, rows: int, limit: int, vocab: int, cost,
                 lean=True):  # fmt: skip
        super().__init__(drafter, rows, limit, vocab, cost, lean)
        self.mask_id = mask_id

    def propose(self, rows: list) -> Drafts:
        """One pass over every row; its time split equally among them."""
        d, cache = self.drafter, self.cache
        order = sorted(rows, key=lambda r: r.dslot)  # the cache as a view
        real = [r.seq[cache.lengths[r.dslot] :] for r in order]
        feeds = [f + [self.mask_id] * (r.k_eff - 1) for f, r in zip(real, order, strict=True)]
        t0 = time.perf_counter()
        scores = draft_scores(d.model, cache, [r.dslot for r in order], feeds, d.head,
                              [r.k_eff for r in order])  # fmt: skip
        for r in order:  # the masks' keys out: the cache holds the row's sequence
            cache.crop(r.dslot, len(r.seq))
        best = greedy_ids(scores)
        picks = (best if d.head_ids is None else d.head_ids[best]).tolist()
        dt = time.perf_counter() - t0
        if all(steady(r, len(f)) for r, f in zip(order, real, strict=True)):
            self.cost.observe(len(order), dt)
        out: dict[int, tuple[list[int], list, float]] = {}
        at = 0
        for r in order:
            r0 = time.perf_counter()
            tokens, qs = picks[at : at + r.k_eff], []
            if not r.sampling.greedy:
                (dists,) = probabilities_of([scores[at : at + r.k_eff]], [r.sampling])
                for j, q in enumerate(dists):
                    pick = draw(q, r.gen)
                    tokens[j] = pick if d.head_ids is None else int(d.head_ids[pick])
                    qs.append(full_distribution(q, d.head_ids, self.vocab))
            at += r.k_eff
            out[id(r)] = (tokens, qs, dt / len(order) + time.perf_counter() - r0)
        return Drafts(*([out[id(r)][i] for r in rows] for i in range(3)))
