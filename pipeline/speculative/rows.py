"""Per-row KV caches that diverge: the representation the step loop (`scheduler.py`) runs on.

Representation: **per-row positions in one padded cache**. Every layer keeps one key and one
value tensor of shape `[rows, kv_heads, capacity, head_dim]`; a request owns one row (a slot)
and its valid positions are always the prefix `[0, length)` of that row. A forward feeds every
row its own tokens at its own offset (`length .. length + n`), right-padded to the longest feed
of the batch: the keys and values of the fed tokens are scattered into each row at its own
positions, and a 4-D mask lets feed token j of row b see columns `<= length_b + j` only (its
own prefix; nothing of another row, nothing stale). Rows accept different numbers of tokens, so
after a verify each row just sets its own length back (`crop`): the rejected guesses' entries
stay where they are, invisible, and the next feed overwrites them. Nothing moves on a rollback.

Slots stay packed (`0 .. used-1`): when a row leaves, the last row is copied into its slot (one
row's valid prefix, every layer), so a forward over all rows reads plain views of the tensors.
A forward over some rows only (the draft rows still drafting at a later position) gathers them.

Memory: `2 x layers x rows x kv_heads x capacity x head_dim` numbers per model. Capacity grows
by doubling (a copy) up to the engine's context limit plus a small pad for the ragged feed; on
the embedded default (SmolLM2-135M: 30 layers, 3 kv heads of 64, fp32) a position costs 46 KB per
row, so 16 rows at 512 positions hold 377 MB, the 6-layer draft a fifth of that. Attention reads
each row's columns up to the longest row of the step (`width`), not the whole capacity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

FEED_PAD = 16  # capacity beyond the context limit: the padding of a ragged feed writes there


class RowCache(Cache):
    """Per-row positions in a padded cache (module docstring). Not thread-safe: the step loop's
    thread is its only user."""

    def __init__(self, model, rows: int, limit: int, capacity: int = 256):
        super().__init__(layers=[])
        c = model.config
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.kv_heads = c.num_key_value_heads
        self.n_layers = c.num_hidden_layers
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.rows = rows
        self.limit = limit + FEED_PAD
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._grow(min(capacity, self.limit))
        self.lengths = [0] * rows  # valid positions per slot
        self.used = 0  # slots 0..used-1 hold rows
        self._index: torch.Tensor | None = None  # bound for one forward: slots fed
        self._pos: torch.Tensor | None = None  # [B, F] positions written
        self._view: tuple[int, int] | None = None  # (first slot, count) when contiguous
        self._width = 0

    # -- slots ----------------------------------------------------------------------------------
    def alloc(self) -> int:
        if self.used >= self.rows:
            raise RuntimeError(f"all {self.rows} cache rows are in use")
        slot = self.used
        self.used += 1
        self.lengths[slot] = 0
        return slot

    @torch.inference_mode()  # the tensors are made inside it (a forward grows them)
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

    def _grow(self, capacity: int) -> None:
        capacity = min(max(capacity, self.capacity), self.limit)
        if capacity <= self.capacity:
            return
        shape = (self.rows, self.kv_heads, capacity, self.head_dim)

        def bigger(old: torch.Tensor | None) -> torch.Tensor:
            t = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old is not None:
                t[:, :, : old.shape[2]] = old
            return t

        old_k = self.keys or [None] * self.n_layers
        old_v = self.values or [None] * self.n_layers
        self.keys = [bigger(t) for t in old_k]
        self.values = [bigger(t) for t in old_v]
        self.capacity = capacity

    # -- one forward ----------------------------------------------------------------------------
    def bind(self, slots: Sequence[int], feed_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a forward feeding `feed_len` positions (padded) to each of `slots` at its own
        length. Returns (position ids [B, F], additive mask [B, 1, F, width])."""
        starts = torch.tensor([self.lengths[s] for s in slots], device=self.device)
        width = int(starts.max()) + feed_len
        if width > self.limit:
            raise ValueError(f"a row would pass the cache's {self.limit} positions")
        if width > self.capacity:
            self._grow(max(width, 2 * self.capacity))
        pos = starts[:, None] + torch.arange(feed_len, device=self.device)
        cols = torch.arange(width, device=self.device)
        allowed = cols[None, None, :] <= pos[:, :, None]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        first = slots[0]
        contiguous = list(slots) == list(range(first, first + len(slots)))
        self._view = (first, len(slots)) if contiguous else None
        self._index = torch.tensor(list(slots), device=self.device)
        self._pos, self._width = pos, width
        return pos, mask[:, None]

    def advance(self, slots: Sequence[int], fed: Sequence[int]) -> None:
        """After the forward: each row now holds its real fed tokens (padding excluded)."""
        for s, n in zip(slots, fed, strict=True):
            self.lengths[s] += n

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        idx = self._index[:, None]
        k[idx, :, self._pos] = key_states.transpose(1, 2).to(k.dtype)
        v[idx, :, self._pos] = value_states.transpose(1, 2).to(v.dtype)
        w = self._width
        if self._view is not None:
            a, n = self._view
            return k[a : a + n, :, :w], v[a : a + n, :, :w]
        return k.index_select(0, self._index)[:, :, :w], v.index_select(0, self._index)[:, :, :w]

    # Asked by some model code; the 4-D mask and explicit positions make the rest unused.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths[: self.used], default=0)

    @property
    def is_compileable(self) -> bool:
        return False


def pad_feeds(feeds: Sequence[Sequence[int]], pad_id: int, device) -> torch.Tensor:
    width = max(len(f) for f in feeds)
    ids = torch.full((len(feeds), width), pad_id, dtype=torch.long)
    for i, f in enumerate(feeds):
        ids[i, : len(f)] = torch.tensor(list(f), dtype=torch.long)
    return ids.to(device)


@torch.inference_mode()
def target_scores(
    model, cache: RowCache, slots: Sequence[int], feeds: Sequence[Sequence[int]], pad_id: int
) -> list[list[int]]:
    """Feed each row its tokens; returns each row's greedy choice after every fed token."""
    ids = pad_feeds(feeds, pad_id, cache.device)
    pos, mask = cache.bind(slots, ids.shape[1])
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
        logits_to_keep=ids.shape[1],
    ).logits  # fmt: skip
    cache.advance(slots, [len(f) for f in feeds])
    preds = logits.argmax(-1).tolist()
    return [p[: len(f)] for p, f in zip(preds, feeds, strict=True)]


@torch.inference_mode()
def prefill(
    model, cache: RowCache, slots: Sequence[int], feeds: Sequence[Sequence[int]], pad_id: int
) -> None:
    """Feed each row its tokens for the cache only (no scores: the next step feeds the last
    token). Rows with nothing to feed are left alone."""
    pairs = [(s, f) for s, f in zip(slots, feeds, strict=True) if f]
    if not pairs:
        return
    slots, feeds = [s for s, _ in pairs], [f for _, f in pairs]
    ids = pad_feeds(feeds, pad_id, cache.device)
    pos, mask = cache.bind(slots, ids.shape[1])
    base = getattr(model, "base_model", model)
    base(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    cache.advance(slots, [len(f) for f in feeds])


@torch.inference_mode()
def draft_next(
    model,
    cache: RowCache,
    slots: Sequence[int],
    feeds: Sequence[Sequence[int]],
    pad_id: int,
    head: torch.Tensor | None,
    head_ids: torch.Tensor | None,
) -> list[int]:
    """The draft's greedy next token for each row after its feed; with `head` (rows of the
    output embedding for `head_ids`) only those tokens are scored."""
    ids = pad_feeds(feeds, pad_id, cache.device)
    pos, mask = cache.bind(slots, ids.shape[1])
    hidden = model.base_model(
        input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True
    ).last_hidden_state
    cache.advance(slots, [len(f) for f in feeds])
    last = torch.tensor([len(f) - 1 for f in feeds], device=cache.device)
    h = hidden[torch.arange(len(feeds), device=cache.device), last]
    if head is None:
        return model.get_output_embeddings()(h).argmax(-1).tolist()
    return head_ids[F.linear(h, head).argmax(-1)].tolist()
