"""The EAGLE-3 head ("eagle:K"): rows read the target states (`taps`) committed since their last
turn, then draft together (`Eagle3Head.draft_many`)."""

from __future__ import annotations

import time

import torch

from ..eagle3 import HeadCache
from ..sampling import draw, probabilities_of
from . import Drafts, full_distribution, steady


class EagleProposer:
    """`Proposer` over an `Eagle3Head`; `cost` times head passes (catch-up reads left out)."""

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
        """Guesses per row (none before its first target state); time split among drafting rows."""
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
        """None (greedy), or a draw with the row's generator that keeps its q in `qs`."""
        if row.sampling.greedy:
            return None
        ids = self.head.target_ids

        def choose(scores):
            q = probabilities_of([scores], [row.sampling])[0]
            qs.append(full_distribution(q, ids, self.vocab))
            return draw(q, row.gen)

        return choose
