"""Measured step costs (`StepCost`) and the prices the policy reads off them. Pure; rows are read
only through their counters. A curve is ((n, seconds), ...) ascending in n: a target pass
against tokens fed, a draft or head pass against its rows.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence


class StepCost:
    """A step's time against its size `n` (tokens fed, or rows drafted for). Pure.

    `curve()`: decayed mean (n, seconds) per size bucket, piecewise linear; `curve(rows)` the
    same for steps of that many rows, extended by the all-rows curve. `coefficients()`: a
    least-squares a + b * n over every step, which `shares` a step among its rows."""

    BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    BUCKET_DECAY = 0.9  # a bucket follows its own recent steps (the machine's load changes)

    def __init__(self, a: float = 1.0, b: float = 0.0, decay: float = 0.995):
        self.prior = (a, b)
        self.decay = decay
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.buckets: dict[int, list[float]] = {}  # bucket -> [weight, weight * n, weight * s]
        self.by_rows: dict[int, dict[int, list[float]]] = {}  # rows bucket -> the same

    @classmethod
    def bucket(cls, n: float) -> int:
        return cls.BUCKETS[max(0, bisect_right(cls.BUCKETS, n) - 1)]  # the last: open

    def observe(self, n: int, seconds: float, rows: int | None = None) -> None:
        d = self.decay
        self.sw = d * self.sw + 1
        self.sx = d * self.sx + n
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + n * n
        self.sxy = d * self.sxy + n * seconds
        keys = [(self.buckets, self.bucket(n))]
        if rows is not None:  # by exact size up to 64: a row's few guesses are a point apart
            table = self.by_rows.setdefault(self.bucket(rows), {})
            keys.append((table, int(n) if n <= 64 else self.bucket(n)))
        k = self.BUCKET_DECAY
        for table, key in keys:
            w = table.setdefault(key, [0.0, 0.0, 0.0])
            w[0], w[1], w[2] = k * w[0] + 1, k * w[1] + n, k * w[2] + seconds

    @property
    def seen(self) -> bool:
        return self.sw > 0

    @staticmethod
    def _points(table: dict[int, list[float]]) -> tuple[tuple[float, float], ...]:
        """Each bucket's weighted means, made non-decreasing in n by pooling adjacent violators."""
        points = [(w[1] / w[0], w[2] / w[0], w[0]) for _, w in sorted(table.items())]
        blocks: list[list[float]] = []  # [mean seconds, weight, points pooled]
        for _, y, w in points:
            blocks.append([y, w, 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                y2, w2, c2 = blocks.pop()
                b = blocks[-1]
                b[0], b[1], b[2] = (b[0] * b[1] + y2 * w2) / (b[1] + w2), b[1] + w2, b[2] + c2
        pooled = [b[0] for b in blocks for _ in range(int(b[2]))]
        return tuple((x, y) for (x, _, _), y in zip(points, pooled, strict=True))

    def curve(self, rows: int | None = None) -> tuple[tuple[float, float], ...]:
        """Measured (n, seconds) points, ascending. With `rows`: steps of that many rows, continued
        past the largest by the all-rows curve's increments and below the smallest in proportion
        to it (none of that many rows: the all-rows curve)."""
        every = self._points(self.buckets)
        own = self._points(self.by_rows.get(self.bucket(rows), {})) if rows else ()
        if not own:
            return every
        (x0, y0), (x1, y1) = own[0], own[-1]
        low, high = step_seconds(every, x0), step_seconds(every, x1)
        below = [(x, y0 * min(1.0, step_seconds(every, x) / low) if low > 0 else y0)
                 for x, _ in every if x < x0]  # fmt: skip
        beyond = [(x, y1 + max(0.0, step_seconds(every, x) - high)) for x, _ in every if x > x1]
        return tuple(below) + own + tuple(beyond)

    def coefficients(self) -> tuple[float, float]:
        """(a, b). Until the steps seen vary in size: their mean time as a, b = 0."""
        var = self.sw * self.sxx - self.sx * self.sx
        if self.sw >= 4 and var > 1e-9 * max(1.0, self.sw * self.sxx):
            b = (self.sw * self.sxy - self.sx * self.sy) / var
            a = (self.sy - b * self.sx) / self.sw
            if a > 0 and b >= 0:
                return a, b
        return (self.sy / self.sw, 0.0) if self.sw > 0 else self.prior

    def shares(self, fed: Sequence[int]) -> list[float]:
        """Each row's fraction of a step that fed these token counts (they sum to 1)."""
        a, b = self.coefficients()
        n = len(fed)
        parts = [a / n + b * f for f in fed]
        total = sum(parts)
        return [p / total for p in parts] if total > 0 else [1 / n] * n


def step_seconds(curve: tuple[tuple[float, float], ...], n: float) -> float:
    """Seconds of a pass of size `n` on a curve: linear between points, the first's below it, and
    past the last the larger of the last slope and proportional time (never assumed cheap)."""
    if not curve:
        raise ValueError("no measured points")
    (x0, y0) = curve[0]
    if n <= x0:
        return y0
    for (x1, y1), (x2, y2) in zip(curve, curve[1:], strict=False):
        if n <= x2:
            return y1 + (y2 - y1) * (n - x1) / max(x2 - x1, 1e-9)
    xl, yl = curve[-1]
    proportional = yl * n / max(xl, 1e-9)
    if len(curve) == 1:
        return proportional
    xp, yp = curve[-2]
    return max(proportional, yl + max(0.0, (yl - yp) / max(xl - xp, 1e-9)) * (n - xl))


def per_step(rows) -> tuple[float, float]:
    """(fed, committed) per step summed over `rows`, by each row's means (unstepped: k + 1, 1)."""
    fed = tokens = 0.0
    for r in rows:
        n = r.rounds
        fed += 1 + (r.proposed / n if n else r.arm.k)
        tokens += 1 + (r.accepted / n if n else 0.0)
    return fed, tokens


def shared_passes(curve, guesses) -> float:
    """Seconds of the batched passes (one per position over rows still guessing) for `guesses`."""
    ks = sorted((g for g in guesses if g > 0), reverse=True)
    seconds = done = 0.0
    for m in range(len(ks), 0, -1):  # the passes over m rows: up to the m-th longest guess
        passes = ks[m - 1] - done
        if passes > 0:
            seconds += passes * step_seconds(curve, m)
            done = ks[m - 1]
    return seconds


def guessing_share(r) -> float:
    """Share of a row's steps it guessed in so far (unstepped: 1)."""
    return min(1.0, r.guess_rounds / r.rounds) if r.rounds else 1.0


def head_rows(rows) -> float:
    """EAGLE-3 rows sharing the head's passes, each weighted by `guessing_share`."""
    return sum(guessing_share(r) for r in rows if r.hcache is not None)


def drafting_seconds(rows, draft_cost, head_cost, parallel_cost=None) -> float:
    """Seconds a step of `rows` spends on proposals (`shared_passes` per draft / head curve, one
    pass over the guessing parallel-draft rows; None curve: 0; prompt lookup free), each row at
    its mean guesses (unstepped: k)."""

    def guesses(r) -> float:
        return r.proposed / r.rounds if r.rounds else float(r.arm.k)

    seconds = 0.0
    if head_cost:
        seconds += shared_passes(head_cost, [guesses(r) for r in rows if r.hcache is not None])
    drafting = [r for r in rows if r.dslot is not None]
    if draft_cost:
        seconds += shared_passes(draft_cost,
                                 [guesses(r) for r in drafting if r.arm.strategy == "draft"])  # fmt: skip
    if parallel_cost:
        seconds += shared_passes(parallel_cost,
                                 [min(1.0, guesses(r)) for r in drafting if r.arm.strategy == "pard"])  # fmt: skip
    return seconds


def added_passes(curve, rows: float, passes: float) -> float:
    """Seconds one more row adds to `passes` passes over `rows` others (a fraction interpolates)."""

    def grown(n: int) -> float:
        return step_seconds(curve, n + 1) - (step_seconds(curve, n) if n else 0.0)

    lo = int(rows)
    w = rows - lo
    return passes * max(0.0, (1 - w) * grown(lo) + (w * grown(lo + 1) if w else 0.0))
