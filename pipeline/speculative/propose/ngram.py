"""Prompt lookup ("ngram:K"): the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n = max_n..1). No model pass, no cache to roll back; its time is
part of the step's."""

from __future__ import annotations

from . import Drafts


class NgramIndex:
    """Prompt lookup over one growing sequence. For every n-gram (n = 1..max_n) that has a
    token after it, the position of that token in its latest occurrence; `propose` looks up
    the sequence's last n tokens, longest n first. Updated incrementally: a step costs
    O(new tokens), not O(sequence)."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self.follower: dict[tuple[int, ...], int] = {}
        self.indexed = 1  # positions p < indexed have been registered as followers

    def _extend(self, seq: list[int]) -> None:
        for p in range(self.indexed, len(seq)):
            for n in range(1, min(self.max_n, p) + 1):
                self.follower[tuple(seq[p - n : p])] = p
        self.indexed = max(self.indexed, len(seq))

    def propose(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of seq's last n tokens (n from
        max_n down to 1); [] when none of them occurred before."""
        self._extend(seq)
        for n in range(min(self.max_n, len(seq) - 1), 0, -1):
            p = self.follower.get(tuple(seq[-n:]))
            if p is not None:
                return seq[p : p + k]
        return []


class NgramProposer:
    """Each row's own `NgramIndex` over its committed tokens (greedy guesses: a sampled row
    verifies them as a point-mass proposal, `sampling.verify` with q None)."""

    taps: tuple[int, ...] = ()

    def join(self, rows: list, states: list) -> float:
        for r in rows:
            r.ngram = NgramIndex()
        return 0.0

    def propose(self, rows: list) -> Drafts:
        tokens = [r.ngram.propose(r.seq, r.k_eff)[: r.k_eff] for r in rows]
        return Drafts(tokens, [[] for _ in rows], None)

    def accepted(self, row, length: int, states) -> None:
        pass  # it indexes committed tokens only

    def leave(self, row) -> None:
        pass
