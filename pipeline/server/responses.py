"""OpenAI response bodies and SSE chunks of one request, from its `CoreResult`: each carries
`usage` (with the draft's accepted/rejected prediction tokens) and a `phoenix` object."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ..serving.request import CoreResult


class TokenText:
    """A logprob entry's token name: its decoded text, or vLLM's `token_id:N` (exact) when asked."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def text(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


@dataclass
class Reply:
    """Builds the OpenAI response bodies and SSE chunks of one request."""

    model: str
    kind: str  # "chat" | "text"
    n_prompt: int
    token_ids: bool = False  # asked for with phoenix.token_ids
    tokens: TokenText | None = None  # how a logprob entry names its token
    id: str = ""
    created: int = 0

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self._streamed = 0  # characters of text sent in chunks so far
        self.created = int(time.time())

    def envelope(self, choices: list[dict], chunk: bool = True, **extra) -> dict:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    @staticmethod
    def sse(obj: dict) -> str:
        return "data: " + json.dumps(obj) + "\n\n"

    def logprobs(self, entries: list | None, offset: int = 0) -> dict | None:
        """OpenAI's logprobs for (token, logprob, top) entries: chat's `content`, or completions'
        four lists (`offset`: text before them). None when not asked (a chunk: when empty)."""
        if entries is None:
            return None
        name = self.tokens.text
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": name(t),
                        "logprob": lp,
                        "bytes": list(name(t).encode("utf-8")),
                        "top_logprobs": [
                            {"token": name(a), "logprob": v, "bytes": list(name(a).encode("utf-8"))}
                            for a, v in top
                        ],
                    }
                    for t, lp, top in entries
                ]
            }
        tokens = [name(t) for t, _, _ in entries]
        offsets = []
        for t, _, _ in entries:  # where each token's text starts in the answer
            offsets.append(offset)
            offset += len(self.tokens.tokenizer.decode([t]))
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{name(a): v for a, v in top} for _, _, top in entries],
            "text_offset": offsets,
        }

    def chunk(
        self, text: str | None, logprobs: list | None, finish: str | None, role: bool = False
    ) -> str:
        lp = self.logprobs(logprobs or None, self._streamed)
        self._streamed += len(text or "")
        if self.kind == "chat":
            delta = (
                {"role": "assistant", "content": ""}
                if role
                else ({"content": text} if text else {})
            )
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            if lp is not None:
                choice["logprobs"] = lp
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}
        return self.sse(self.envelope([choice]))

    def body(self, res: CoreResult) -> dict:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": res.text},
                "finish_reason": res.finish_reason,
                "logprobs": self.logprobs(res.logprobs),
            }
        else:
            choice = {
                "index": 0,
                "text": res.text,
                "finish_reason": res.finish_reason,
                "logprobs": self.logprobs(res.logprobs),
            }
        rec = res.record()
        ph = phoenix_of(rec)
        if self.token_ids and not res.stopped_by_string:  # the exact ids, for distillation
            ph["token_ids"] = res.result.token_ids
        return self.envelope([choice], chunk=False, usage=usage_of(rec, self.n_prompt), phoenix=ph)


def usage_of(rec: dict, n_prompt: int) -> dict:
    """The OpenAI usage object of a request's record (`CoreResult.record()`)."""
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": rec["output_tokens"],
        "total_tokens": n_prompt + rec["output_tokens"],
        "completion_tokens_details": {
            "accepted_prediction_tokens": rec["accepted"],
            "rejected_prediction_tokens": rec["proposed"] - rec["accepted"],
        },
    }


# The response's `phoenix` object: these fields of the request's record.
PHOENIX_FIELDS = (
    "mode", "arm", "proposed", "accepted", "rounds", "acceptance", "tokens_per_second",
    "latency_s", "draft_s", "verify_s", "accepted_per_position", "proposed_per_position",
    "explored", "warmup", "probe", "fallback", "deferred", "guard_event", "epsilon", "goodput",
    "batch_rows", "queued_s", "rows", "guess_rounds", "eligible_per_position",
)  # fmt: skip


def phoenix_of(rec: dict) -> dict:
    return {k: rec[k] for k in PHOENIX_FIELDS}
