"""A model's forward passes as the loop makes them: its KV cache, its step function, compiled.

A `ModelStep` holds one model, the function the loop calls it through (`fn(model, ids, cache,
*args)`: the target's scores, the draft's next token) and how its cache lives:
  - growing (`static_len=None`): a fresh `DynamicCache` per generation;
  - static: one `StaticCache` of `static_len` positions, preallocated on first use and reset
    for every generation; a rejected guess only moves its position back (`crop_to`), stale
    entries are masked and later overwritten. Needed to compile: the tensors keep their
    addresses and shapes.
`compile` routes feeds of at most `max_feed` tokens (one-token decode, a verify of k+1, the
draft's catch-up) through `torch.compile`; longer ones (prefill) stay eager. Engines over the
same target share its `ModelStep`: one cache and one compiled graph (they must not generate at
the same time). `warm_up` runs every shape a set of arms uses once, so a compiled engine has
compiled everything before it serves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, StaticCache


def crop_to(cache: DynamicCache | StaticCache, length: int) -> None:
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


def context_limit(*models) -> int | None:
    """The shortest `max_position_embeddings` of the models given (None: none says)."""
    limits = [getattr(m.config, "max_position_embeddings", None) for m in models if m is not None]
    return min((x for x in limits if x), default=None)


class ModelStep:
    """One model's forward pass for the loop (module docstring): `step(ids, cache, *more)`."""

    def __init__(self, model, fn: Callable, static_len: int | None = None, args: tuple = ()):
        self.model = model
        self.fn = fn
        self.args = args  # fixed trailing arguments of fn (the draft's pruned head)
        self.device = next(model.parameters()).device
        self.static_len = static_len
        self.max_feed = 0  # feeds up to this long run compiled; longer ones eager
        self._compiled: Callable | None = None
        self._cache: StaticCache | None = None

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def new_cache(self) -> DynamicCache | StaticCache:
        """An empty cache for one generation (the static one, reset)."""
        if self.static_len is None:
            return DynamicCache(config=self.model.config)
        if self._cache is None:
            self._cache = _static_cache(self.model, self.static_len)
        for layer in self._cache.layers:
            layer.cumulative_length.zero_()
        return self._cache

    @torch.inference_mode()
    def __call__(self, ids: list[int], cache, *more):
        fn = self._compiled if self._compiled is not None and len(ids) <= self.max_feed else self.fn
        inp = torch.tensor([ids], dtype=torch.long, device=self.device)
        return fn(self.model, inp, cache, *self.args, *more)

    def compile(self, max_feed: int, mode: str | None = None, backend: str = "inductor") -> None:
        """Run feeds of up to `max_feed` tokens compiled (a second call only raises the bound:
        one graph per step, shared by the engines over this model). `mode` is torch.compile's:
        None on a CPU, "reduce-overhead" for CUDA graphs."""
        if self.static_len is None:
            raise ValueError("compiled steps need static caches (static_len)")
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, mode=mode, backend=backend)
        self.max_feed = max(self.max_feed, max_feed)

    def uncompile(self) -> None:
        """Back to the eager function and a growing cache (after a compile that failed under
        `compile: auto`): eager, a static cache only costs attention over its whole length."""
        self._compiled, self.max_feed = None, 0
        self.static_len, self._cache = None, None


def warm_up_shapes(arms: Sequence[int], has_draft: bool) -> list[tuple[str, int]]:
    """Every (model, feed length) the compiled steps see with these arms (k values): one-token
    decode, each verify of k+1 and the shorter ones a budget's end makes (torch.compile makes a
    length dynamic once it has seen two), and the draft's catch-up of 1-2 tokens."""
    top = max(arms, default=0)
    shapes = [("target", n) for n in sorted({1, 2, 3, *(k + 1 for k in arms)}) if n <= top + 1]
    if has_draft and top > 0:
        shapes += [("draft", 1), ("draft", 2)]
    return shapes


def warm_up(
    target: ModelStep,
    draft: ModelStep | None,
    arms: Sequence[int],
    pad_id: int,
    on_shape: Callable[[str, int, int, int, float], None] | None = None,
) -> None:
    """Run each of `warm_up_shapes(arms)` once after a short eager prefill.
    `on_shape(model, length, i, n, seconds)` reports each."""
    shapes = warm_up_shapes(arms, draft is not None)
    for i, (which, n) in enumerate(shapes, 1):
        t0 = time.perf_counter()
        step = target if which == "target" else draft
        cache = step.new_cache()
        prefill = [pad_id] * (step.max_feed + 4)  # longer than any compiled feed: eager
        if which == "target":
            step(prefill, cache, 1)
            step([pad_id] * n, cache, n)
        else:
            step(prefill, cache)
            step([pad_id] * n, cache)
        if on_shape is not None:
            on_shape(which, n, i, len(shapes), time.perf_counter() - t0)
