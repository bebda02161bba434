"""The EAGLE-3 head ("eagle:K"): guesses from the target's hidden states, which every target
pass returns for its rows (`taps`: the head's layers). Each row reads the states of what it
committed since its last turn, then all rows draft their k_eff tokens together, one head pass
per position (`Eagle3Head.draft_many`), greedy or drawn (a sampled row keeps each guess's
distribution, over the target's vocabulary, for verify)."""

from __future__ import annotations

import time

import torch

from ..eagle3 import HeadCache
from ..sampling import draw, probabilities_of
from . import Drafts, full_distribution, steady


class EagleProposer:
    """`propose.Proposer` over one `eagle3.Eagle3Head`. `cost` (a `cost.StepCost`) times each
    head pass against its rows: the rows' reads of their states are one pass over them all,
    then each shared pass; a catch-up read (a first turn, a row the gate held back) is the
    row's own, not a guess's price, and is left out."""

    def __init__(self, head, vocab: int, cost):
        self.head = head
        self.taps = tuple(head.config.aux_layer_ids)
        self.vocab = vocab
        self.cost = cost

    def join(self, rows: list, states: list) -> float:
        for r, s in zip(rows, states, strict=True):
            r.hcache, r.aux_new = HeadCache(), ([s] if s is not None else [])
        return 0.0

    def accepted(self, row, length: int, states) -> None:
        if row.hcache is not None and states is not None:  # the states of last + accepted
            row.aux_new.append(states)

    def leave(self, row) -> None:
        row.hcache, row.aux_new = None, []

    def propose(self, rows: list) -> Drafts:
        """Each row's guesses; a row with no target state yet (a one-token prompt before its
        first step) guesses nothing. The time is split equally among the rows that drafted."""
        tokens: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        seconds = [0.0] * len(rows)
        going = [i for i, r in enumerate(rows) if r.hcache is not None and r.aux_new]
        if not going:
            return Drafts(tokens, qs, seconds)
        start = time.perf_counter()
        jobs, steadies = [], []
        for i in going:
            r = rows[i]
            fresh = torch.cat(r.aux_new) if len(r.aux_new) > 1 else r.aux_new[0]
            steadies.append(steady(r, fresh.shape[0]))
            r.aux_new = []
            jobs.append((r.seq, fresh, r.hcache, r.k_eff, self._chooser(r, qs[i])))

        def timed(n: int, seconds: float, read: bool) -> None:
            if not read or all(steadies):
                self.cost.observe(n, seconds)

        for i, drafts in zip(going, self.head.draft_many(jobs, on_pass=timed), strict=True):
            tokens[i] = drafts
        dt = time.perf_counter() - start
        for i in going:
            seconds[i] = dt / len(going)
        return Drafts(tokens, qs, seconds)

    def _chooser(self, row, qs: list):
        """How a row's guess is picked from the head's scores: greedy (None), or drawn with the
        row's generator, its distribution kept in `qs`."""
        if row.sampling.greedy:
            return None
        ids = self.head.target_ids

        def choose(scores):
            q = probabilities_of([scores], [row.sampling])[0]
            qs.append(full_distribution(q, ids, self.vocab))
            return draw(q, row.gen)

        return choose
