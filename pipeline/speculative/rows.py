"""Per-row KV caches that diverge, and one flattened forward over many rows: the representation
the step loop (`batch.py`) runs on.

Cache: **per-row positions in one padded cache**. Every layer keeps one key and one value tensor
of shape `[rows, kv_heads, capacity, head_dim]`; a request owns one row (a slot) and its valid
positions are always the prefix `[0, length)` of that row. Rows accept different numbers of
tokens, so after a verify each row just sets its own length back (`crop`): the rejected guesses'
entries stay where they are, invisible, and the next feed overwrites them. Nothing moves on a
rollback. Slots stay packed (`0 .. used-1`): when a row leaves, the last row is copied into its
slot (its valid prefix, every layer), so a forward over all rows, fed in slot order, reads plain
views (`RowBatch` keeps its rows in that order); rows fed in any other order are gathered, a
copy of every layer's keys and values (docs/measurements.md: `benchmarks.loop_arms --slots`).

Forward: **flattened, as vLLM's**. The rows' feeds (each its own length: a plain row 1 token, a
verify k+1, a joiner its prompt) are concatenated into one sequence of T tokens, each with its
own position, so the linear layers (nearly all of the cost) run on exactly T rows, with no
padding for ragged feeds. Only attention sees rows: `rows_attention`, registered with
transformers as the attention implementation "phoenix_rows", scatters each token's key and
value into its row at its position, lays the queries out as `[rows, longest feed]`, and attends
each row over its own prefix (a mask lets feed token j of row b see columns `<= length_b + j`),
with grouped-query heads folded into the query length so keys and values are never copied per
head. A model run without a plan (training, a plain forward) attends with SDPA.

Memory: `2 x layers x (rows + 1) x kv_heads x capacity x head_dim` numbers per model (the one
spare row pads a compiled pass: `RowCache.padded`); capacity grows by doubling (a copy) up to
one column past the engine's context limit (SmolLM2-135M, fp32: 46 KB a position per row).
Attention reads each row's columns up to the longest row of the step (`width`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .sampling import greedy_ids

ATTENTION = "phoenix_rows"


@dataclass
class Plan:
    """One flattened forward: which row and position each fed token has, and the layout the
    attention uses. Built by `RowCache.plan`; shared by every layer of the forward."""

    slots: torch.Tensor  # [R] the rows fed, in order
    token_slot: torch.Tensor  # [T] each token's row (cache slot)
    positions: torch.Tensor  # [T] each token's position in its row
    flat: torch.Tensor  # [T] each token's place in the [R * longest] query layout
    mask: torch.Tensor  # [R, 1, groups * longest, width] additive, grouped-query heads folded
    longest: int
    width: int
    view: tuple[int, int] | None  # (first slot, count) when the rows are contiguous slots


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: Plan, scale: float):
    """Each fed token attends over its own row's prefix. `q`: [T, heads, head_dim]; `keys`,
    `values`: the fed rows' caches, [R, kv_heads, width, head_dim]. Returns [T, heads,
    head_dim]. The queries are laid out as [rows, longest feed] with grouped-query heads folded
    into the query length, so one SDPA call serves every row and no key is copied per head."""
    t, heads, d = q.shape
    r, kv, width, _ = keys.shape
    groups, longest = heads // kv, plan.longest
    padded = q.new_zeros(r * longest, heads, d)
    padded[plan.flat] = q
    # [R, longest, kv, groups, d] -> [R, kv, groups * longest, d]: one kv head's query rows
    q = padded.view(r, longest, kv, groups, d).permute(0, 2, 3, 1, 4).reshape(r, kv, -1, d)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.mask, scale=scale)
    out = out.view(r, kv, groups, longest, d).permute(0, 3, 1, 2, 4).reshape(r * longest, heads, d)
    return out[plan.flat]


def rows_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """`attend` as a transformers attention implementation (module docstring). `query`: [1,
    heads, T, head_dim]; `key`, `value`: what `RowCache.update` returned. Returns [1, T, heads,
    head_dim]. Without a plan (a plain forward of the same model): SDPA."""
    plan: Plan | None = kw.pop("phoenix_plan", None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout,
                                      scaling, **kw)  # fmt: skip
    return attend(query[0].transpose(0, 1), key, value, plan, scaling).unsqueeze(0), None


AttentionInterface.register(ATTENTION, rows_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # a plain forward's mask: SDPA's


class RowCache(Cache):
    """Per-row positions in a padded cache (module docstring). Not thread-safe: the step loop's
    thread is its only user."""

    def __init__(self, model, rows: int, limit: int, capacity: int = 256):
        super().__init__(layers=[])
        c = model.config
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.kv_heads = c.num_key_value_heads
        self.groups = c.num_attention_heads // c.num_key_value_heads
        self.n_layers = c.num_hidden_layers
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.rows = rows
        self.limit = limit
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._grow(capacity)
        self.lengths = [0] * (rows + 1)  # valid positions per slot (and the spare's: `padded`)
        self.used = 0  # slots 0..used-1 hold rows
        self._plan: Plan | None = None  # bound for one forward

    # -- slots ----------------------------------------------------------------------------------
    def alloc(self) -> int:
        if self.used >= self.rows:
            raise RuntimeError(f"all {self.rows} cache rows are in use")
        slot = self.used
        self.used += 1
        self.lengths[slot] = 0
        return slot

    @torch.inference_mode()  # a copy between rows, nothing for autograd to record
    def release(self, slot: int) -> int | None:
        """Free `slot`. The last row moves into it; returns the slot it moved from (None when
        `slot` was the last)."""
        last = self.used - 1
        self.used -= 1
        if slot == last:
            return None
        n = self.lengths[last]
        for t in (*self.keys, *self.values):
            t[slot, :, :n] = t[last, :, :n]
        self.lengths[slot] = n
        return last

    def crop(self, slot: int, length: int) -> None:
        """Keep the first `length` positions of a row (a rejected guess only shortens it)."""
        self.lengths[slot] = min(self.lengths[slot], length)

    @torch.inference_mode(False)  # plain tensors: a compiled pass writes them (`padded`)
    def _grow(self, capacity: int) -> None:
        # One column past the limit: a step's width (at most the limit) never fills the cache,
        # so its keys are always a strided slice (a compiled pass guards on which).
        capacity = min(max(capacity, self.capacity), self.limit + 1)
        if capacity <= self.capacity:
            return
        shape = (self.rows + 1, self.kv_heads, capacity, self.head_dim)  # + the spare row

        def bigger(old: torch.Tensor | None) -> torch.Tensor:
            t = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old is not None:
                t[:, :, : old.shape[2]] = old
            torch._dynamo.mark_dynamic(t, 0)  # a compiled pass: one graph for every cache's
            torch._dynamo.mark_dynamic(t, 2)  # rows and capacity (it grows)
            return t

        old_k = self.keys or [None] * self.n_layers
        old_v = self.values or [None] * self.n_layers
        self.keys = [bigger(t) for t in old_k]
        self.values = [bigger(t) for t in old_v]
        self.capacity = capacity

    # -- one forward ----------------------------------------------------------------------------
    def plan(self, slots: Sequence[int], feeds: Sequence[Sequence[int]]) -> Plan:
        """Bind a flattened forward that feeds each of `slots` its tokens at its own length."""
        dev = self.device
        starts = [self.lengths[s] for s in slots]
        sizes = [len(f) for f in feeds]
        longest = max(sizes)
        width = max(s + n for s, n in zip(starts, sizes, strict=True))
        if width > self.limit:
            raise ValueError(f"a row would pass the cache's {self.limit} positions")
        if width >= self.capacity:
            want = max(width + 1, 2 * self.capacity)
            self._grow(self.limit + 1 if want >= self.limit else want)  # not 512, then 513
        token_row = torch.repeat_interleave(torch.arange(len(slots)), torch.tensor(sizes))
        offset = torch.cat([torch.arange(n) for n in sizes])
        positions = torch.tensor(starts)[token_row] + offset
        # Feed token j of row b sees its row's columns <= start_b + j (nothing of another row).
        last = torch.tensor(starts)[:, None] + torch.arange(longest)  # [R, longest]
        allowed = torch.arange(width)[None, None, :] <= last[:, :, None]  # [R, longest, width]
        mask = torch.zeros(allowed.shape, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        mask = mask[:, None].expand(-1, self.groups, -1, -1).reshape(len(slots), 1, -1, width)
        first = slots[0]
        contiguous = list(slots) == list(range(first, first + len(slots)))
        self._plan = Plan(
            slots=torch.tensor(list(slots), device=dev),
            token_slot=torch.tensor(list(slots))[token_row].to(dev),
            positions=positions.to(dev),
            flat=(token_row * longest + offset).to(dev),
            mask=mask.to(dev),
            longest=longest,
            width=width,
            view=(first, len(slots)) if contiguous else None,
        )
        return self._plan

    def padded(self, slots: Sequence[int], feeds: Sequence[Sequence[int]]):
        """The rows and feeds of a pass the compiled pass (`runner._Pass`) can take, or None.
        It takes a pass over every row in slot order; torch specialises its graphs on sizes of
        1, so where such a pass has one row or feeds one token a row, the spare slot (the first
        free one: the rows stay a plain view) joins it with two tokens of its own at positions
        0 and 1. It is free, so they overwrite nothing; its length stays 0 (the caller advances
        only the rows it fed). One graph then serves every step, with no recompile."""
        if list(slots) != list(range(self.used)):
            return None
        if len(slots) >= 2 and max(len(f) for f in feeds) >= 2:
            return list(slots), list(feeds)
        self.lengths[self.used] = 0
        return [*slots, self.used], [*feeds, [0, 0]]

    def advance(self, slots: Sequence[int], fed: Sequence[int]) -> None:
        """After the forward: each row now holds its fed tokens."""
        for s, n in zip(slots, fed, strict=True):
            self.lengths[s] += n

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """transformers' cache call: `write` of [1, kv_heads, T, head_dim] states."""
        return self.write(layer_idx, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))

    def write(self, layer_idx: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Write the fed tokens' keys and values ([T, kv_heads, head_dim]) into their rows;
        return the fed rows' caches up to the step's width ([R, kv_heads, width, head_dim])."""
        p = self._plan
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[p.token_slot, :, p.positions] = k_new.to(k.dtype)
        v[p.token_slot, :, p.positions] = v_new.to(v.dtype)
        w = p.width
        if p.view is not None:
            a, n = p.view
            return k[a : a + n, :, :w], v[a : a + n, :, :w]
        return k.index_select(0, p.slots)[:, :, :w], v.index_select(0, p.slots)[:, :, :w]

    # Asked by some model code; the explicit positions and the plan make the rest unused.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths[: self.used], default=0)

    @property
    def is_compileable(self) -> bool:
        return False


def _flat(feeds: Sequence[Sequence[int]], device) -> torch.Tensor:
    return torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=device)


def _hidden(model, cache: RowCache, slots, feeds, taps: Sequence[int] = ()):
    """One flattened forward over the rows: the final hidden states of every fed token
    [T, hidden], through the model's lean runner (`runner.py`) when it has one, else through
    transformers' forward with `rows_attention`. The cache advances. With `taps` (layer ids):
    also those layers' inputs, concatenated [T, len(taps) * hidden] (an EAGLE-3 head's)."""
    runner = getattr(model, "_phoenix_runner", None)
    padded = cache.padded(slots, feeds) if runner is not None and runner.compiled else None
    plan = cache.plan(*(padded or (slots, feeds)))
    ids = _flat(padded[1] if padded else feeds, cache.device)
    tapped: list[torch.Tensor] = []
    if runner is not None:
        hidden = runner.hidden(ids, cache, plan, taps, tapped, graph=padded is not None)
        if padded is not None:  # the spare row's tokens, last, dropped
            real = sum(len(f) for f in feeds)
            hidden, tapped = hidden[:real], [t[:real] for t in tapped]
    else:
        out = model.base_model(
            input_ids=ids[None],
            position_ids=plan.positions[None],
            attention_mask=plan.mask,  # 4-D: passed through as is (rows_attention uses the plan)
            cache=cache,
            use_cache=True,
            phoenix_plan=plan,
            output_hidden_states=bool(taps),
        )
        hidden = out.last_hidden_state[0]
        tapped = [out.hidden_states[i][0] for i in sorted(taps)] if taps else []
    cache.advance(slots, [len(f) for f in feeds])
    if taps:
        return hidden, torch.cat(tapped, dim=-1)
    return hidden


def _head(model, hidden: torch.Tensor) -> torch.Tensor:
    runner = getattr(model, "_phoenix_runner", None)
    return runner.logits(hidden) if runner is not None else model.get_output_embeddings()(hidden)


@torch.inference_mode()
def target_logits(
    model, cache: RowCache, slots: Sequence[int], feeds: Sequence[Sequence[int]],
    taps: Sequence[int] = (),
):  # fmt: skip
    """Feed each row its tokens; returns the target's logits after every fed token, the rows'
    feeds one after another ([sum of feed lengths, vocab]); with `taps`, (logits, the tapped
    layers' inputs [sum of feed lengths, len(taps) * hidden])."""
    if taps:
        hidden, tapped = _hidden(model, cache, slots, feeds, taps)
        return _head(model, hidden), tapped
    return _head(model, _hidden(model, cache, slots, feeds))


def split_rows(flat: list, feeds: Sequence[Sequence[int]]) -> list[list]:
    """A flattened per-token list cut back into one list per row."""
    out, i = [], 0
    for f in feeds:
        out.append(flat[i : i + len(f)])
        i += len(f)
    return out


@torch.inference_mode()
def target_scores(
    model, cache: RowCache, slots: Sequence[int], feeds: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Feed each row its tokens; returns each row's greedy choice after every fed token."""
    return split_rows(greedy_ids(target_logits(model, cache, slots, feeds)).tolist(), feeds)


@torch.inference_mode()
def prefill(
    model, cache: RowCache, slots: Sequence[int], feeds: Sequence[Sequence[int]],
    taps: Sequence[int] = (),
):  # fmt: skip
    """Feed each row its tokens for the cache only (no scores: the next step feeds the last
    token). Rows with nothing to feed are left alone. With `taps`: returns (hidden, the tapped
    layers' inputs) of the rows fed, their feeds one after another (else None)."""
    pairs = [(s, f) for s, f in zip(slots, feeds, strict=True) if f]
    if pairs:
        return _hidden(model, cache, [s for s, _ in pairs], [f for _, f in pairs], taps)
    return None


@torch.inference_mode()
def draft_scores(
    model,
    cache: RowCache,
    slots: Sequence[int],
    feeds: Sequence[Sequence[int]],
    head: torch.Tensor | None,
) -> torch.Tensor:
    """The draft's logits for each row's next token after its feed ([rows, V]); with `head`
    (rows of the output embedding for a pruned vocabulary) only those tokens are scored, in
    the head's order ([rows, len(head)])."""
    hidden = _hidden(model, cache, slots, feeds)
    ends = torch.tensor([len(f) for f in feeds]).cumsum(0) - 1
    h = hidden[ends.to(hidden.device)]
    return _head(model, h) if head is None else F.linear(h, head)
