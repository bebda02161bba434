"""Draft arms: a strategy and a length. Pure: parsing and names, no models.

An arm says how a request drafts:
  - `0`        no drafting (the target alone);
  - `draft:K`  the draft model guesses K tokens per round (the seed's arms, written `K` or
               `fixed:K` too);
  - `ngram:K`  prompt lookup: the K tokens that followed the latest earlier occurrence of the
               last n tokens (n = 3, 2, 1) in prompt + output; free, no model pass;
  - `eagle:K`  an EAGLE-3 head guesses K tokens from the target's own hidden states (the
               step loop only: it reads them from each verify pass).
An arm's canonical text (`str(arm)`) is its id everywhere: config, bandit state, bench records,
responses, metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("draft", "ngram", "eagle")
MAX_K = 16  # a verify pass of K+1 tokens; beyond this nothing pays


@dataclass(frozen=True)
class Arm:
    strategy: str  # "none" (k = 0) | "draft" | "ngram" | "eagle"
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


PLAIN = Arm("none", 0)
FORMS = "0, draft:K (also K or fixed:K), ngram:K, eagle:K"


def parse_arm(value: int | str | Arm) -> Arm:
    """An arm from config or a request: 0, K (= draft:K), draft:K, fixed:K, ngram:K, with
    1 <= K <= MAX_K. Raises ValueError naming the valid forms."""
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


def usable(value, has_draft: bool, has_head: bool = False) -> bool:
    """Whether an engine with (or without) a draft model and an EAGLE-3 head can run the arm."""
    a = parse_arm(value)
    return (has_draft or not a.needs_draft) and (has_head or not a.needs_head)


def canonical(values) -> list[str]:
    """Canonical ids of a list of arms, in order."""
    return [str(parse_arm(v)) for v in values]
