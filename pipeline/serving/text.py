"""Text and stop strings: token ids to the text a client may see, a step at a time. Pure."""

from __future__ import annotations


class TextTracker:
    """Incremental detokenisation with stop strings: emits only text that is final."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.emitted = 0
        self.text = ""
        self.stopped = False
        self._ends: list[int] = []  # the length of the text of the first j + 1 tokens
        self._covered = 0

    def update(self, ids: list[int]) -> str:
        """Feed the full output so far; returns the new final text (may be empty)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in self.stops:
            pos = text.find(s)
            if pos != -1:
                text = text[:pos]
                self.stopped = True
        self.text = text
        safe = len(text)
        if not self.stopped:
            if text.endswith("\ufffd"):  # a multi-byte character split across tokens
                safe = len(text.rstrip("\ufffd"))
            for s in self.stops:  # hold back a suffix that may grow into a stop string
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if text[:safe].endswith(s[:n]):
                        safe -= n
                        break
        delta = text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta

    def covered(self, ids: list[int]) -> int:
        """How many of the output's first tokens spell only text already emitted: the tokens
        whose logprobs may go out with it."""
        while len(self._ends) < len(ids):
            j = len(self._ends)
            self._ends.append(len(self.tokenizer.decode(ids[: j + 1], skip_special_tokens=True)))
        n = self._covered
        while n < len(ids) and self._ends[n] <= self.emitted:
            n += 1
        self._covered = n
        return n

    def rest(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
