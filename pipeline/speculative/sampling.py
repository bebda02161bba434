"""Speculative sampling, lossless in distribution, and the target's logprobs. Pure torch.

`probabilities` applies temperature, then top-k, then top-p (as vLLM) to both models alike.
Temperature 0 is greedy and never comes here. `verify` (Leviathan et al.; Chen et al. 2023):
guesses d_1..d_k were drawn from q_i (a point mass for prompt lookup); the target gave
p_1..p_(k+1). d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); the first rejection
is replaced by a draw from normalised max(0, p_i - q_i); all accepted: a bonus from p_(k+1). Each
committed token is distributed exactly as the target's own sample. Each row draws with its own
`torch.Generator` (seeded by `Sampling.seed`, so a seeded request is reproducible).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # a temperature this small is greedy (vLLM's threshold)


@dataclass(frozen=True)
class Sampling:
    """How one request draws its tokens, and what it reports of them."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int | None = None
    logprobs: int | None = None  # None: none; n: the chosen token's logprob and the top n

    def __post_init__(self):
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature {self.temperature} is outside [0, 2]")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} is outside (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} is below 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs {self.logprobs} is outside [0, {MAX_TOP_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self, device="cpu") -> torch.Generator | None:
        """The row's own generator (None when greedy: nothing is drawn)."""
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        return g


GREEDY = Sampling()


def greedy_ids(scores: torch.Tensor) -> torch.Tensor:
    """Argmax over the last axis in float32: same ids as bf16, faster on CPU (measurements.md)."""
    return scores.float().argmax(-1)


def probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """float32 distribution per row of `logits` [..., V]: temperature, top_k, then the smallest
    set reaching top_p (the most likely token always stays)."""
    x = logits.float() / s.temperature
    if 0 < s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        drop = (p.cumsum(-1) - p) >= s.top_p  # the mass before this token already reaches top_p
        drop[..., 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return torch.softmax(x, dim=-1)


def probabilities_of(logits: Sequence[torch.Tensor], samplings: Sequence[Sampling]) -> list:
    """`probabilities` for many rows ([n_i, V] each), alike samplings in one call."""
    out: list = [None] * len(logits)
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samplings):
        groups.setdefault((s.temperature, s.top_k, s.top_p), []).append(i)
    for members in groups.values():
        s = samplings[members[0]]
        sizes = [logits[i].shape[0] if logits[i].dim() > 1 else 1 for i in members]
        flat = torch.cat([logits[i].reshape(n, -1) for i, n in zip(members, sizes, strict=True)])
        for i, part in zip(members, probabilities(flat, s).split(sizes), strict=True):
            out[i] = part if logits[i].dim() > 1 else part[0]
    return out


def draw(probs: torch.Tensor, g: torch.Generator | None) -> int:
    """One token from unnormalised `probs` [V] by inverse CDF (faster than multinomial);
    probability-0 tokens are never drawn."""
    cdf = probs.float().cumsum(0)
    u = torch.rand((), generator=g)
    i = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if i >= len(cdf):  # u * total rounded onto the last step: the last token that has mass
        i = int(torch.nonzero(probs > 0)[-1])
    return i


def verify(
    drafts: Sequence[int], q: torch.Tensor | None, p: torch.Tensor, g: torch.Generator | None
) -> tuple[int, int]:
    """One row's round (module docstring): q [k, V] or None (point masses), p [k + 1, V].
    Returns (accepted m, next token: the residual draw at m, or the bonus from p[k])."""
    for i, d in enumerate(drafts):
        pd = float(p[i, d])
        qd = 1.0 if q is None else float(q[i, d])
        u = float(torch.rand((), generator=g))
        if u * qd < pd:
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # only by rounding: p and q agree where p lives
            residual = p[i]
        return i, draw(residual, g)
    k = len(drafts)
    return k, draw(p[k], g)


def top_logprobs(
    logits: torch.Tensor, chosen: Sequence[int], n: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Raw logprobs (before temperature or cuts, as vLLM) of each chosen token and the top `n`:
    logits [len(chosen), V] -> [(logprob, [(token, logprob), ...n]), ...]."""
    if not len(chosen):
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(-1, torch.tensor(list(chosen), device=lp.device)[:, None])[:, 0].tolist()
    if n > 0:
        vals, ids = torch.topk(lp, n, dim=-1)
        tops = [
            list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)
        ]
    else:
        tops = [[] for _ in chosen]
    return list(zip(picked, tops, strict=True))


def chi_square(a: Sequence, b: Sequence) -> tuple[float, float]:
    """Two-sample chi-square homogeneity test -> (statistic, p); expected counts < 5 pooled."""
    cats = sorted(set(a) | set(b), key=repr)
    ca = dict.fromkeys(cats, 0)
    cb = dict(ca)
    for x in a:
        ca[x] += 1
    for x in b:
        cb[x] += 1
    na, nb = len(a), len(b)
    table, pool_a, pool_b = [], 0, 0
    for c in cats:
        tot = ca[c] + cb[c]
        if min(na, nb) * tot / (na + nb) < 5:
            pool_a, pool_b = pool_a + ca[c], pool_b + cb[c]
        else:
            table.append((ca[c], cb[c]))
    if pool_a + pool_b:
        table.append((pool_a, pool_b))
    if len(table) < 2:
        return 0.0, 1.0
    stat = 0.0
    for oa, ob in table:
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    df = len(table) - 1
    p = torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                torch.tensor(stat / 2.0, dtype=torch.float64))  # fmt: skip
    return stat, float(p)
