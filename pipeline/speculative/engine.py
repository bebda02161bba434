"""Greedy speculative decoding: the draft guesses k tokens, the target checks them in one pass.

The engine knows models and token ids; it knows nothing of HTTP, Sentry or files. Timing and
counts come back in the result, and callers record them.

Invariant kept by the loop (`seq` = prompt + committed output):
  - the target's KV cache holds seq[:-1]; the last committed token is still to be fed;
  - the draft's KV cache holds some prefix of seq (it catches up on its next turn).
One round with arm k: the draft feeds what it lacks and proposes d1..dk greedily; the target
feeds [seq[-1], d1..dk] once and yields its own greedy choice p1..p(k+1) at every position. The
longest prefix with d_i == p_i is accepted, and p(m+1) (the target's correction, or a bonus
token when all k matched) is committed too. Both caches are then cropped to what is valid. Every
committed token is the target's own greedy choice, so the output equals target-only greedy
decoding for every k (arm 0 runs the same loop with no draft work at all).
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# CPU only: a linear layer over 2..SKINNY_MAX_ROWS rows (a verify pass, a draft's catch-up, a
# nearly drained teacher batch) runs as `W @ x.T`. MKL's sgemm for `x @ W.T` at 2-8 rows took
# about twice the time of one row here (SmolLM2-135M: 57 ms of matmuls for 5 rows against 29 ms
# for one); `W @ x.T` took 22-34 ms for 2-5 rows. One row (plain decoding) keeps the gemv path.
SKINNY_MAX_ROWS = 8


@dataclass
class GenerationResult:
    token_ids: list[int]
    arm: int
    finish_reason: str  # "stop" (end-of-turn token or caller's stop) | "length"
    latency_s: float
    draft_s: float
    verify_s: float
    prompt_tokens: int
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    first_token_s: float | None = None  # from the start to the first committed token

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.latency_s if self.latency_s > 0 else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


@dataclass
class _State:
    """One generation's running state: `seq` = prompt + committed output, the two caches, and
    the counts the result reports."""

    seq: list[int]
    t_cache: DynamicCache
    d_cache: DynamicCache | None
    proposed_pos: list[int]
    accepted_pos: list[int]
    out: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0


def _skinny_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if 2 <= rows <= SKINNY_MAX_ROWS and not torch.is_grad_enabled():
        y = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.contiguous().view(*x.shape[:-1], self.weight.shape[0])
    return F.linear(x, self.weight, self.bias)


def use_skinny_linears(model: torch.nn.Module) -> int:
    """Route the model's CPU linear layers through `_skinny_linear_forward` (inference only:
    with grad enabled they stay plain `F.linear`). Idempotent; returns how many were patched."""
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and mod.weight.device.type == "cpu":
            if getattr(mod.forward, "__func__", None) is not _skinny_linear_forward:
                mod.forward = types.MethodType(_skinny_linear_forward, mod)
            n += 1
    return n


def _crop_to(cache: DynamicCache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5: a negative count of tokens to drop


class SpeculativeEngine:
    """A target and an optional same-tokenizer draft, both on one device, greedy decoding."""

    def __init__(
        self, target, draft=None, eos_token_ids: Sequence[int] = (), pad_token_id: int | None = None
    ):
        self.target = target
        self.draft = draft
        self.eos_token_ids = set(eos_token_ids)
        self.pad_token_id = (
            pad_token_id if pad_token_id is not None else min(self.eos_token_ids, default=0)
        )
        self.device = next(target.parameters()).device
        if self.device.type == "cpu":
            for m in (target, draft):
                if m is not None:
                    use_skinny_linears(m)
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft vocab ({draft.config.vocab_size}) differs from target's "
                f"({target.config.vocab_size}): they must share a tokenizer"
            )
        limits = [getattr(m.config, "max_position_embeddings", None) for m in (target, draft) if m]
        self.max_context = min(x for x in limits if x) if any(limits) else None

    @torch.inference_mode()
    def _forward(self, model, ids: list[int], cache: DynamicCache, keep: int) -> torch.Tensor:
        inp = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = model(input_ids=inp, cache=cache, use_cache=True, logits_to_keep=keep)
        return out.logits[0]

    def generate(
        self,
        prompt_ids: Sequence[int],
        k: int,
        max_new_tokens: int,
        on_tokens: Callable[[list[int]], None] | None = None,
        should_stop: Callable[[list[int]], bool] | None = None,
    ) -> GenerationResult:
        """Generate greedily with arm k (0 = target only). `on_tokens` sees each round's new
        tokens; `should_stop(output_so_far)` ends generation early (stop strings, disconnects)."""
        if k < 0:
            raise ValueError("k must be >= 0")
        if k > 0 and self.draft is None:
            raise ValueError(f"arm {k} needs a draft model; this engine has none")
        if not prompt_ids:
            raise ValueError("empty prompt")
        start = time.perf_counter()
        st = _State(
            seq=list(prompt_ids),
            t_cache=DynamicCache(config=self.target.config),
            d_cache=DynamicCache(config=self.draft.config) if k > 0 else None,
            proposed_pos=[0] * k,
            accepted_pos=[0] * k,
        )
        n_prompt = len(st.seq)
        t0 = time.perf_counter()
        if n_prompt > 1:  # prefill: the target's cache holds seq[:-1]
            self._forward(self.target, st.seq[:-1], st.t_cache, keep=1)
        st.verify_s += time.perf_counter() - t0

        finish = "length"
        first_token_s = None
        while len(st.out) < max_new_tokens:
            k_eff = min(k, max_new_tokens - len(st.out) - 1)
            if self.max_context is not None:
                if len(st.seq) >= self.max_context:
                    break
                k_eff = max(0, min(k_eff, self.max_context - len(st.seq) - 1))
            new, eos = self.speculative_round(st, k_eff)
            if first_token_s is None:
                first_token_s = time.perf_counter() - start
            if new and on_tokens is not None:
                on_tokens(new)
            if eos or (should_stop is not None and should_stop(st.out)):
                finish = "stop"
                break

        return GenerationResult(
            token_ids=st.out,
            arm=k,
            finish_reason=finish,
            latency_s=time.perf_counter() - start,
            draft_s=st.draft_s,
            verify_s=st.verify_s,
            prompt_tokens=n_prompt,
            proposed=st.proposed,
            accepted=st.accepted,
            rounds=st.rounds,
            proposed_per_position=st.proposed_pos,
            accepted_per_position=st.accepted_pos,
            first_token_s=first_token_s,
        )

    def speculative_round(self, st: _State, k: int) -> tuple[list[int], bool]:
        """One round: the draft proposes k tokens, the target scores [last, d1..dk] in one pass,
        the longest agreeing prefix plus the target's own next token is committed, and both
        caches are cut back to what is valid. Returns (committed tokens, hit end-of-turn)."""
        drafts: list[int] = []
        if k > 0:
            t0 = time.perf_counter()
            feed = st.seq[st.d_cache.get_seq_length() :]  # the draft catches up first
            for _ in range(k):
                logits = self._forward(self.draft, feed, st.d_cache, keep=1)
                feed = [int(logits[-1].argmax())]
                drafts.append(feed[0])
            st.draft_s += time.perf_counter() - t0

        t0 = time.perf_counter()
        logits = self._forward(self.target, [st.seq[-1], *drafts], st.t_cache, keep=k + 1)
        preds = logits.argmax(dim=-1).tolist()
        st.verify_s += time.perf_counter() - t0

        m = 0
        while m < k and drafts[m] == preds[m]:
            m += 1
        new = drafts[:m] + [preds[m]]
        st.rounds += 1
        st.proposed += k
        st.accepted += m
        for i in range(k):
            st.proposed_pos[i] += 1
            st.accepted_pos[i] += i < m
        # Keep only what is valid: seq + accepted drafts (the new last token is pending).
        _crop_to(st.t_cache, len(st.seq) + m)
        if st.d_cache is not None:
            _crop_to(st.d_cache, len(st.seq) + m)

        eos = False
        for i, tok in enumerate(new):
            if tok in self.eos_token_ids:
                new, eos = new[:i], True
                break
        st.seq.extend(new)
        st.out.extend(new)
        return new, eos

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]
    ) -> list[GenerationResult]:
        """Target-only greedy generation of several prompts as one left-padded batch (see
        `TargetBatch`); results in prompt order."""
        batch = TargetBatch(self)
        batch.add(list(enumerate(zip(prompts, max_new_tokens, strict=True))))
        done: dict = {}
        while batch.active:
            done.update(batch.step())
        return [done[i] for i in range(len(prompts))]


@dataclass
class _Row:
    """One request in a `TargetBatch`: the caller's key, its budget, and its output so far."""

    key: object
    max_new_tokens: int
    prompt_tokens: int
    start: float
    out: list[int] = field(default_factory=list)
    first_at: float | None = None


class TargetBatch:
    """Target-only greedy decoding of a changing set of rows: the batching local teacher.

    `add` prefills new rows (left-padded) and merges them into the running batch at a step
    boundary; `step` commits one token per row and returns the rows that finished, which leave
    the batch at once (on a CPU a step costs about in proportion to its rows). So requests that
    arrive while a batch runs join it instead of waiting for its longest answer. Invariant between
    calls: `mask` is as wide as the cache, and `logits` holds each row's next-token scores."""

    def __init__(self, engine: SpeculativeEngine):
        self.engine = engine
        self.model = engine.target
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.rows: list[_Row] = []

    @property
    def active(self) -> int:
        return len(self.rows)

    def keys(self) -> list:
        return [row.key for row in self.rows]

    def drop(self, predicate: Callable[[object], bool]) -> list:
        """Remove the rows whose key satisfies `predicate` (callers that left); returns their
        keys. The other rows go on unchanged."""
        flags = [predicate(row.key) for row in self.rows]  # once: a flag may flip meanwhile
        gone = [row.key for row, f in zip(self.rows, flags, strict=True) if f]
        if gone:
            self._select([i for i, f in enumerate(flags) if not f])
        return gone

    def _select(self, keep: list[int]) -> None:
        """Keep only the rows at `keep` (cache, mask, scores and bookkeeping alike)."""
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.mask = self.logits = None
            return
        sel = torch.tensor(keep, device=self.engine.device)
        self.cache.batch_select_indices(sel)
        self.mask = self.mask[sel]
        self.logits = self.logits[sel]

    @staticmethod
    def check_row(prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        if not prompt_ids or max_new_tokens < 1:
            raise ValueError("a row needs a non-empty prompt and max_new_tokens >= 1")

    @property
    def joinable(self) -> bool:
        """Whether rows can join now: an empty batch, or plain growing caches (a sliding-window
        cache could not be left-padded)."""
        return self.cache is None or all(type(x) is DynamicLayer for x in self.cache.layers)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache):
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    @torch.inference_mode()
    def add(self, items: Sequence[tuple[object, tuple[Sequence[int], int]]]) -> None:
        """Add rows `(key, (prompt_ids, max_new_tokens))`; keys come back from `step`."""
        if not items:
            return
        for _, (p, n) in items:
            self.check_row(p, n)
        dev = self.engine.device
        now = time.perf_counter()
        prompts = [list(p) for _, (p, _) in items]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.engine.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache)
        rows = [_Row(key, n, len(p), now) for (key, (p, n)) in items]
        if not self.rows:
            self.cache, self.mask, self.logits, self.rows = cache, mask, logits, rows
            return
        if not self.joinable:
            raise ValueError("this model's cache cannot take rows into a running batch")
        width = max(self.mask.shape[1], mask.shape[1])
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(mask, width)])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)])
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)])
        self.logits = torch.cat([self.logits, logits])
        self.rows += rows

    @torch.inference_mode()
    def step(self) -> list[tuple[object, GenerationResult]]:
        """Commit one token to every row; returns `(key, result)` for the rows that finished."""
        if not self.rows:
            return []
        eos = self.engine.eos_token_ids
        nxt = self.logits.argmax(-1).tolist()
        keep, finished = [], []
        for i, row in enumerate(self.rows):
            if nxt[i] in eos:
                finished.append((row, "stop"))
                continue
            row.out.append(nxt[i])
            if row.first_at is None:
                row.first_at = time.perf_counter()
            if len(row.out) < row.max_new_tokens:
                keep.append(i)
            else:
                finished.append((row, "length"))
        now = time.perf_counter()
        results = [
            (
                row.key,
                GenerationResult(
                    token_ids=row.out,
                    arm=0,
                    finish_reason=reason,
                    latency_s=now - row.start,
                    draft_s=0.0,
                    verify_s=now - row.start,
                    prompt_tokens=row.prompt_tokens,
                    rounds=len(row.out),
                    first_token_s=row.first_at - row.start if row.first_at else None,
                ),
            )
            for row, reason in finished
        ]
        if len(keep) < len(self.rows):
            self._select(keep)
            if not keep:
                return results
        dev = self.engine.device
        step = torch.tensor([[nxt[i]] for i in keep], dtype=torch.long, device=dev)
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(keep), 1))], dim=1)
        self.logits = self._forward(
            step, self.mask, self.mask.sum(-1, keepdim=True) - 1, self.cache
        )
        return results


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad dim 1 (a mask) or dim -2 (cached keys/values) on the left to `width`."""
    dim = 1 if t.dim() == 2 else -2
    extra = width - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)
