"""Draft arms: how a request drafts. Pure. `0`: the target alone; `draft:K` (also `K`,
`fixed:K`): the draft model guesses K tokens, a pass each; `pard:K`: the same draft trained for
parallel drafting guesses K in one pass; `ngram:K`: prompt lookup (the K tokens after the latest
earlier match of the last 3, 2 or 1 tokens); `eagle:K`: an EAGLE-3 head. `str(arm)` is
the arm's id everywhere (config, bandit state, bench, responses, metrics).
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("draft", "pard", "ngram", "eagle")
MAX_K = 16  # a verify pass of K+1 tokens; beyond this nothing pays


@dataclass(frozen=True)
class Arm:
    strategy: str  # "none" (k = 0) | "draft" | "pard" | "ngram" | "eagle"
    k: int

    def __str__(self) -> str:
        return "0" if self.k == 0 else f"{self.strategy}:{self.k}"

    @property
    def name(self) -> str:
        """The bench row and transaction name: target, fixed_K (the draft model), ngram_K."""
        if self.k == 0:
            return "target"
        return f"fixed_{self.k}" if self.strategy == "draft" else f"{self.strategy}_{self.k}"

    @property
    def needs_draft(self) -> bool:
        return self.strategy == "draft" and self.k > 0

    @property
    def needs_head(self) -> bool:
        return self.strategy == "eagle" and self.k > 0

    @property
    def needs_parallel(self) -> bool:
        """A draft model trained for parallel drafting (its config names a mask token)."""
        return self.strategy == "pard" and self.k > 0


PLAIN = Arm("none", 0)
FORMS = "0, draft:K (also K or fixed:K), pard:K, ngram:K, eagle:K"


def parse_arm(value: int | str | Arm) -> Arm:
    """Parse an arm (`FORMS`, 1 <= K <= MAX_K); ValueError naming the valid forms."""
    if isinstance(value, Arm):
        return value
    if isinstance(value, bool):
        raise ValueError(f"bad arm {value!r}: use {FORMS}")
    text = str(value).strip()
    strategy, sep, k_text = text.partition(":")
    if not sep:
        strategy, k_text = "draft", text
    if strategy == "fixed":
        strategy = "draft"
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown draft strategy in arm {value!r}: use {FORMS}")
    try:
        k = int(k_text)
    except ValueError:
        raise ValueError(f"bad arm {value!r}: K must be an integer ({FORMS})") from None
    if k == 0:  # no guesses: the same arm whatever the strategy
        return PLAIN
    if not 1 <= k <= MAX_K:
        raise ValueError(f"bad arm {value!r}: K must be in 1..{MAX_K} ({FORMS})")
    return Arm(strategy, k)


PARALLEL_KEYS = ("pard_token", "ptd_token_id")  # where a draft names its mask id, in vLLM's order


def parallel_token(config: dict) -> int | None:
    """The mask id a draft's config (config.json as a dict) names for `pard:K`
    (`PARALLEL_KEYS`), else None; ValueError, naming the key, if it is not an id in
    [0, vocab_size)."""
    for key in PARALLEL_KEYS:
        value, vocab = config.get(key), config.get("vocab_size")
        if value is None:
            continue
        ints = isinstance(value, int) and not isinstance(value, bool) and isinstance(vocab, int)
        if not (ints and 0 <= value < vocab):
            raise ValueError(
                f"`{key}` = {value!r} is not a token id in its vocabulary [0, vocab_size={vocab})"
            )
        return value
    return None


def usable(value, has_draft: bool, has_head: bool = False, has_parallel: bool = False) -> bool:
    """Whether an engine with (or without) a draft model, an EAGLE-3 head and a draft trained for
    parallel drafting can run the arm."""
    a = parse_arm(value)
    return ((has_draft or not a.needs_draft) and (has_head or not a.needs_head)
            and (has_parallel or not a.needs_parallel))  # fmt: skip


def canonical(values) -> list[str]:
    """Canonical ids of a list of arms, in order."""
    return [str(parse_arm(v)) for v in values]
