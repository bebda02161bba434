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

Draft strategies (`strategy`): "draft" (the draft model, as above) or "ngram" (prompt lookup,
`NgramIndex`: the tokens that followed the latest earlier occurrence of the sequence's last n
tokens; no model pass, no draft cache). A round with no n-gram match is a plain step. The target's
verification is the same for both, so both are lossless.

Two cost cutters, neither of which changes a committed token:
  - static caches (`static_len`): both caches are preallocated once per engine; a rejected
    guess moves the cache position back (stale entries are masked and later overwritten). With
    `compile_steps` the short feeds (one-token decode, the verify of k+1, the draft's catch-up)
    run through `torch.compile`d step functions; prefill stays eager.
  - a pruned draft head (`draft_token_ids`): the draft scores only a subset of the vocabulary
    (the most frequent tokens of its training answers). A token outside the subset is simply
    never guessed; verification always uses the target's full vocabulary.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer

# CPU only: a linear layer over 2..SKINNY_MAX_ROWS rows (a verify pass, a draft's catch-up, a
# nearly drained teacher batch) runs as `W @ x.T`. MKL's sgemm for `x @ W.T` at 2-8 rows took
# about twice the time of one row here (SmolLM2-135M: 57 ms of matmuls for 5 rows against 29 ms
# for one); `W @ x.T` took 22-34 ms for 2-5 rows. One row (plain decoding) keeps the gemv path.
SKINNY_MAX_ROWS = 8


@dataclass
class GenerationResult:
    token_ids: list[int]
    arm: str  # the arm's id: "0", "draft:K", "ngram:K" (arms.Arm)
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


class NgramIndex:
    """Prompt lookup over a growing sequence. For every n-gram (n = 1..max_n) that has a token
    after it, the position of that token in its latest occurrence; `propose` looks up the
    sequence's last n tokens, longest n first. Updated incrementally (`extend`), so a round
    costs O(new tokens), not O(sequence)."""

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self.follower: dict[tuple[int, ...], int] = {}
        self.indexed = 1  # positions p < indexed have been registered as followers

    def extend(self, seq: list[int]) -> None:
        for p in range(self.indexed, len(seq)):
            for n in range(1, min(self.max_n, p) + 1):
                self.follower[tuple(seq[p - n : p])] = p
        self.indexed = max(self.indexed, len(seq))

    def propose(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of seq's last n tokens (n from
        max_n down to 1); [] when none of them occurred before."""
        self.extend(seq)
        for n in range(min(self.max_n, len(seq) - 1), 0, -1):
            p = self.follower.get(tuple(seq[-n:]))
            if p is not None:
                return seq[p : p + k]
        return []


@dataclass
class _State:
    """One generation's running state: `seq` = prompt + committed output, the two caches, and
    the counts the result reports."""

    seq: list[int]
    t_cache: DynamicCache | StaticCache
    d_cache: DynamicCache | StaticCache | None
    proposed_pos: list[int]
    accepted_pos: list[int]
    ngram: NgramIndex | None = None  # the n-gram strategy's index (None: the draft model)
    out: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0


def _skinny_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    # Compiled, the bound would only cost a recompile at 9 rows (arm 8's verify).
    top = rows if torch.compiler.is_compiling() else SKINNY_MAX_ROWS
    if 2 <= rows <= top and not torch.is_grad_enabled():
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


def _crop_to(cache: DynamicCache | StaticCache, length: int) -> None:
    """Keep the first `length` positions. A static cache only moves its position back."""
    extra = int(cache.get_seq_length()) - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5: a negative count of tokens to drop


def _static_cache(model, length: int) -> StaticCache:
    """A preallocated batch-1 cache of `length` positions, initialised now (outside any compiled
    region, so its tensors keep fixed addresses)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    p = next(model.parameters())
    with torch.inference_mode(False):  # plain tensors: the loop moves positions outside it
        cache = StaticCache(config=c, max_cache_len=length)
        cache.early_initialization(1, c.num_key_value_heads, head_dim, p.dtype, p.device)
    return cache


def target_logits(model, inp: torch.Tensor, cache, keep: int) -> torch.Tensor:
    """The target's scores for the last `keep` positions of one fed row."""
    return model(input_ids=inp, cache=cache, use_cache=True, logits_to_keep=keep).logits[0]


def draft_token(model, inp: torch.Tensor, cache, head, head_ids) -> torch.Tensor:
    """The draft's greedy next token after one fed row; with `head` (rows of the output
    embedding for `head_ids`) only those tokens are scored."""
    if head is None:
        return (
            model(input_ids=inp, cache=cache, use_cache=True, logits_to_keep=1)
            .logits[0, -1]
            .argmax()
        )
    hidden = model.base_model(input_ids=inp, cache=cache, use_cache=True).last_hidden_state
    # No .item() (a graph break), and not torch.take (inductor cannot lower it on a CPU).
    return head_ids.index_select(0, F.linear(hidden[0, -1], head).argmax().view(1))[0]


def _reset(cache: StaticCache) -> None:
    for layer in cache.layers:
        layer.cumulative_length.zero_()


class SpeculativeEngine:
    """A target and an optional same-tokenizer draft, both on one device, greedy decoding."""

    def __init__(
        self,
        target,
        draft=None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        static_len: int | None = None,
        draft_token_ids: Sequence[int] | None = None,
        share_target: SpeculativeEngine | None = None,
    ):
        """`static_len`: preallocated caches of that many positions (needed to compile);
        `draft_token_ids`: prune the draft's head to these ids; `share_target`: an engine over
        the same target whose static cache and compiled target step this one reuses (engines
        that share must not generate at the same time)."""
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
        self._model_context = min(x for x in limits if x) if any(limits) else None
        self.static_len: int | None = None
        self.max_context = self._model_context
        if static_len is not None:
            self.static_len = min(static_len, self._model_context or static_len)
            self.max_context = self.static_len
        self._t_cache: StaticCache | None = None  # static caches, made on first use
        self._d_cache: StaticCache | None = None
        self._draft_ids: torch.Tensor | None = None
        self._draft_head: torch.Tensor | None = None
        if draft_token_ids is not None:
            self.prune_draft_head(draft_token_ids)
        self._target_step, self._draft_step = target_logits, draft_token
        self.compiled = False
        self.max_feed = 0  # feeds up to this long use the step functions; longer ones: eager
        # The engine that owns the target's cache: the root of a chain of sharers, so an engine
        # built over a swapped-in draft does not keep every earlier draft alive.
        self._shared = getattr(share_target, "_shared", None) or share_target
        if share_target is not None:
            if share_target.target is not target or share_target.static_len != self.static_len:
                raise ValueError("share_target: another target, or another static cache length")
            self._target_step = share_target._target_step

    def prune_draft_head(self, token_ids: Sequence[int]) -> None:
        """Score draft guesses only over `token_ids` (a slice of the draft's output head, made
        here; the draft model itself is not changed, so it may be shared or be the target)."""
        if self.draft is None:
            raise ValueError("a pruned draft head needs a draft")
        ids = torch.tensor(sorted(set(int(t) for t in token_ids)), dtype=torch.long)
        vocab = self.draft.config.vocab_size
        if len(ids) == 0 or int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise ValueError(f"draft head subset must be ids in [0, {vocab}), got {len(ids)} ids")
        weight = self.draft.get_output_embeddings().weight
        self._draft_ids = ids.to(self.device)
        self._draft_head = weight.detach()[self._draft_ids].clone()

    @property
    def draft_head_ids(self) -> list[int] | None:
        """The ids the draft's head scores; None: the full vocabulary."""
        return None if self._draft_ids is None else self._draft_ids.tolist()

    def compile_steps(
        self, arms: Sequence[int], mode: str | None = None, backend: str = "inductor"
    ) -> None:
        """Run the short feeds of these arms (one-token decode, each verify of k+1, the draft's
        catch-up) through `torch.compile`d step functions; prefill stays eager. Needs static
        caches. Each shape compiles on first use (`warm_up` triggers them all). `mode` is
        torch.compile's: None on a CPU, "reduce-overhead" to capture CUDA graphs."""
        if self.static_len is None:
            raise ValueError("compiled steps need static caches (static_len)")
        self.max_feed = max(arms, default=0) + 1
        if self._shared is not None and self._shared.compiled:
            self._target_step = self._shared._target_step
            self.max_feed = max(self.max_feed, self._shared.max_feed)
        else:
            self._target_step = torch.compile(target_logits, mode=mode, backend=backend)
        self._draft_step = torch.compile(draft_token, mode=mode, backend=backend)
        self.compiled = True

    def uncompile(self) -> None:
        """Back to eager step functions and growing caches (after a compile that failed under
        `compile: auto`): eager, a static cache only costs attention over its whole length."""
        self._target_step, self._draft_step = target_logits, draft_token
        self.compiled = False
        self.max_feed = 0
        self.static_len, self.max_context = None, self._model_context
        self._t_cache = self._d_cache = None

    def _new_caches(self, with_draft: bool):
        if self.static_len is None:
            t = DynamicCache(config=self.target.config)
            d = DynamicCache(config=self.draft.config) if with_draft else None
            return t, d
        if self._t_cache is None:
            if self._shared is not None:
                self._shared._new_caches(with_draft=False)
                self._t_cache = self._shared._t_cache
            else:
                self._t_cache = _static_cache(self.target, self.static_len)
        _reset(self._t_cache)
        if not with_draft:
            return self._t_cache, None
        if self._d_cache is None:
            self._d_cache = _static_cache(self.draft, self.static_len)
        _reset(self._d_cache)
        return self._t_cache, self._d_cache

    def warm_up_shapes(self, arms: Sequence[int]) -> list[tuple[str, int]]:
        """Every (model, feed length) the step functions see with these arms: one-token
        decode, each verify of k+1 and the shorter ones a budget's end makes (torch.compile
        makes a length dynamic once it has seen two), and the draft's catch-up of 1-2 tokens."""
        top = max(arms, default=0)
        shapes = [("target", n) for n in sorted({1, 2, 3, *(k + 1 for k in arms)}) if n <= top + 1]
        if self.draft is not None and top > 0:
            shapes += [("draft", 1), ("draft", 2)]
        return shapes

    @torch.inference_mode()
    def warm_up(
        self,
        arms: Sequence[int],
        on_shape: Callable[[str, int, int, int, float], None] | None = None,
    ) -> None:
        """Run each of `warm_up_shapes(arms)` once after a short eager prefill, so a compiled
        engine compiles everything before it serves. `on_shape(model, length, i, n, seconds)`
        reports each."""
        shapes = self.warm_up_shapes(arms)
        prefill = [self.pad_token_id] * (self.max_feed + 4)  # longer than any step: eager
        for i, (which, n) in enumerate(shapes, 1):
            t0 = time.perf_counter()
            t_cache, d_cache = self._new_caches(with_draft=which == "draft")
            if which == "target":
                self._target(prefill, t_cache, keep=1)
                self._target([self.pad_token_id] * n, t_cache, keep=n)
            else:
                self._draft(prefill, d_cache)
                self._draft([self.pad_token_id] * n, d_cache)
            if on_shape is not None:
                on_shape(which, n, i, len(shapes), time.perf_counter() - t0)

    def _feed(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def _target(self, ids: list[int], cache, keep: int) -> torch.Tensor:
        step = self._target_step if len(ids) <= self.max_feed else target_logits
        return step(self.target, self._feed(ids), cache, keep)

    @torch.inference_mode()
    def _draft(self, ids: list[int], cache) -> int:
        step = self._draft_step if len(ids) <= self.max_feed else draft_token
        return int(step(self.draft, self._feed(ids), cache, self._draft_head, self._draft_ids))

    def generate(
        self,
        prompt_ids: Sequence[int],
        k: int,
        max_new_tokens: int,
        on_tokens: Callable[[list[int]], None] | None = None,
        should_stop: Callable[[list[int]], bool] | None = None,
        strategy: str = "draft",
    ) -> GenerationResult:
        """Generate greedily with k guesses per round (0 = target only) from `strategy` ("draft":
        the draft model; "ngram": prompt lookup). `on_tokens` sees each round's new tokens;
        `should_stop(output_so_far)` ends generation early (stop strings, disconnects)."""
        if k < 0:
            raise ValueError("k must be >= 0")
        if strategy not in ("draft", "ngram"):
            raise ValueError(f"unknown draft strategy {strategy!r}: draft or ngram")
        use_draft = k > 0 and strategy == "draft"
        if use_draft and self.draft is None:
            raise ValueError(f"arm draft:{k} needs a draft model; this engine has none")
        if not prompt_ids:
            raise ValueError("empty prompt")
        start = time.perf_counter()
        t_cache, d_cache = self._new_caches(with_draft=use_draft)
        st = _State(
            seq=list(prompt_ids),
            t_cache=t_cache,
            d_cache=d_cache,
            proposed_pos=[0] * k,
            accepted_pos=[0] * k,
            ngram=NgramIndex() if k > 0 and strategy == "ngram" else None,
        )
        n_prompt = len(st.seq)
        t0 = time.perf_counter()
        if n_prompt > 1:  # prefill: the target's cache holds seq[:-1]
            self._target(st.seq[:-1], st.t_cache, keep=1)
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
            arm="0" if k == 0 else f"{strategy}:{k}",
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
        """One round: the draft (or the n-gram index) proposes up to k tokens, the target scores
        [last, d1..dk] in one pass, the longest agreeing prefix plus the target's own next token
        is committed, and the caches are cut back to what is valid. Returns (committed tokens,
        hit end-of-turn)."""
        drafts: list[int] = []
        if k > 0 and st.ngram is not None:
            t0 = time.perf_counter()
            drafts = st.ngram.propose(st.seq, k)
            k = len(drafts)  # no match: a plain step
            st.draft_s += time.perf_counter() - t0
        elif k > 0:
            t0 = time.perf_counter()
            feed = st.seq[int(st.d_cache.get_seq_length()) :]  # the draft catches up first
            for _ in range(k):
                feed = [self._draft(feed, st.d_cache)]
                drafts.append(feed[0])
            st.draft_s += time.perf_counter() - t0

        t0 = time.perf_counter()
        logits = self._target([st.seq[-1], *drafts], st.t_cache, keep=k + 1)
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
                    arm="0",
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
