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

    def rest(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
