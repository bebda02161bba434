"""Prompt lookup ("ngram:K"): no model pass, no cache; its time is part of the step's."""

from __future__ import annotations

from . import Drafts


class NgramIndex:
    """Latest follower position per n-gram (n <= max_n) of a growing sequence; O(new) a step."""

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
        """Up to k tokens after the latest earlier match of seq's last n tokens, longest n first."""
        self._extend(seq)
        for n in range(min(self.max_n, len(seq) - 1), 0, -1):
            p = self.follower.get(tuple(seq[-n:]))
            if p is not None:
                return seq[p : p + k]
        return []


class NgramProposer:
    """A `NgramIndex` per row; guesses are point masses (q None) for sampled rows."""

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
