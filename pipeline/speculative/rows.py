"""Per-row KV caches that diverge, and one flattened forward over many rows (`batch.py`'s).

Cache: each layer keeps keys and values `[rows + 1 spare, kv_heads, capacity, head_dim]`; a
request owns a slot whose valid positions are always the prefix `[0, length)`. Rollback only
shortens the length (`crop`); nothing moves. Slots stay packed (`0 .. used-1`: a leaving row's
slot takes the last row), so a pass over all rows in slot order reads views, not copies.
Capacity grows by doubling up to one column past the context limit.

Forward, flattened as vLLM's: the rows' ragged feeds are one sequence of T tokens with their
own positions, so linears run on exactly T rows. Only attention sees rows (`attend`, registered
with transformers as "phoenix_rows"): feed token j of row b sees its row's columns
`<= length_b + j`. Without a plan (training, a plain forward) it is SDPA.
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
    """One flattened forward's token rows, positions and attention layout (`RowCache.plan`)."""

    slots: torch.Tensor  # [R] the rows fed, in order
    token_slot: torch.Tensor  # [T] each token's row (cache slot)
    positions: torch.Tensor  # [T] each token's position in its row
    flat: torch.Tensor  # [T] each token's place in the [R * longest] query layout
    mask: torch.Tensor  # [R, 1, groups * longest, width] additive, grouped-query heads folded
    longest: int
    width: int
    view: tuple[int, int] | None  # (first slot, count) when the rows are contiguous slots


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: Plan, scale: float):
    """Each fed token attends over its own row's prefix: q [T, heads, d], keys/values
    [R, kv_heads, width, d] -> [T, heads, d]. One SDPA call, queries as [R, kv, groups *
    longest] so no key is copied per head."""
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
    """`attend` as a transformers attention: query [1, heads, T, d] -> [1, T, heads, d]; no
    plan: SDPA."""
    plan: Plan | None = kw.pop("phoenix_plan", None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout,
                                      scaling, **kw)  # fmt: skip
    return attend(query[0].transpose(0, 1), key, value, plan, scaling).unsqueeze(0), None


AttentionInterface.register(ATTENTION, rows_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # a plain forward's mask: SDPA's


class RowCache(Cache):
    """Per-row positions in a padded cache (module docstring). Not thread-safe."""

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
        """Free `slot`, moving the last row into it; returns the slot moved from (None: none)."""
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
        """(slots, feeds) the compiled pass can take, or None: a pass over every row in slot
        order. Where it has one row or one token a row (sizes of 1 specialise a graph), the
        free spare slot joins with two tokens of its own; its length stays 0."""
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
        """Write [T, kv_heads, d] into the rows; returns the fed rows' [R, kv_heads, width, d]."""
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
    """One flattened forward: final hidden states [T, hidden] (lean runner, else transformers);
    the cache advances. With `taps`: also those layers' inputs [T, len(taps) * hidden]."""
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
    """Logits after every fed token [sum of feeds, vocab]; with `taps`, (logits, tapped inputs)."""
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
    """Feed rows for the cache only; empty feeds are skipped. Returns None if nothing was fed,
    else `_hidden`'s result (with `taps`: (hidden, tapped inputs) of the rows fed)."""
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
    last: Sequence[int] | None = None,
) -> torch.Tensor:
    """Draft logits after each row's feed [rows, V]; with a pruned `head`, [rows, len(head)].
    With `last`: after each row's final `last[i]` fed tokens, in order [sum(last), V]."""
    hidden = _hidden(model, cache, slots, feeds)
    ends = torch.tensor([len(f) for f in feeds]).cumsum(0)
    if last is None:
        at = ends - 1
    else:
        at = torch.cat([torch.arange(e - n, e) for e, n in zip(ends.tolist(), last, strict=True)])
    h = hidden[at.to(hidden.device)]
    return _head(model, h) if head is None else F.linear(h, head)
