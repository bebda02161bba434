"""A parallel draft's training rows (PARD): mask blocks after the real tokens, their attention.

A draft guesses K tokens in one pass by reading its context plus K-1 copies of a mask token:
its logits at the last real token and at mask j (1..K-1) are guesses 1..K. Training shows it
exactly that, for many contexts in one row. Per kept anchor t (a real position whose next
token is an answer token) the row gets masks (t, 1), ..., (t, d) after all its real tokens:

    mask (t, j): position id t + j, label the real token at t + 1 + j;
                 attends to the real tokens 0..t and to masks (t, 1..j), itself included.
    real i:      position id i, label the real token at i + 1 (where that is an answer token);
                 plain causal attention (no real token ever sees a mask): depth 0 is SFT.

A block stops at the first position that is not an answer token (d <= K-1), so every mask has
a label. With anchor(i) = i and depth(i) = 0 for real tokens, and (t, j) for masks, query q
attends to key k iff (k real and anchor(k) <= anchor(q)) or (k a mask, anchor(k) = anchor(q)
and depth(k) <= depth(q)): what the draft computes at inference over [x_0..x_t, m x j].
Real tokens are cut at train.max_length (build_examples); the blocks come on top.
"""

from __future__ import annotations

import random

import torch

IGNORE = -100  # a position with no label


def block_sizes(completion_mask: list[int], k: int) -> list[int]:
    """Per real position t: the depth of its mask block (0: none). t is an anchor iff token
    t + 1 is an answer token; its block runs while t + 1 + j is one too, at most k - 1 deep."""
    n = len(completion_mask)
    sizes = [0] * n
    run = 0  # answer tokens from i onwards, counted from the end
    for i in range(n - 1, -1, -1):
        run = run + 1 if completion_mask[i] else 0
        if i >= 1:
            sizes[i - 1] = min(k - 1, max(run - 1, 0))
    return sizes


def parallel_row(row: dict, k: int, mask_id: int, anchors: list[int]) -> dict:
    """One SFT row (input_ids, completion_mask, row) -> its parallel row: input_ids,
    position_ids, anchor, depth, targets (the labels; IGNORE: none) and row, with the masks of
    each of `anchors` (in that order) after the real tokens."""
    ids, comp = row["input_ids"], row["completion_mask"]
    n = len(ids)
    sizes = block_sizes(comp, k)
    labels = [ids[i + 1] if i + 1 < n and comp[i + 1] else IGNORE for i in range(n)]
    out = {
        "input_ids": list(ids),
        "position_ids": list(range(n)),
        "anchor": list(range(n)),
        "depth": [0] * n,
        "targets": labels,
        "row": row["row"],
    }
    for t in anchors:
        for j in range(1, sizes[t] + 1):
            out["input_ids"].append(mask_id)
            out["position_ids"].append(t + j)
            out["anchor"].append(t)
            out["depth"].append(j)
            out["targets"].append(ids[t + 1 + j])
    return out


def parallel_rows(rows: list[dict], k: int, keep: float, mask_id: int, seed: int) -> list[dict]:
    """Every row with mask blocks for a share `keep` of its anchors (at least one where it has
    any), drawn from `random.Random(seed)` in row order: the same rows, the same blocks."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        sizes = block_sizes(row["completion_mask"], k)
        anchors = [t for t, d in enumerate(sizes) if d]
        if keep < 1 and anchors:
            anchors = sorted(rng.sample(anchors, max(1, round(keep * len(anchors)))))
        out.append(parallel_row(row, k, mask_id, anchors))
    return out


def block_attention(anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """[L] anchors and depths of one row -> [L, L] bool, query x key (True: attends)."""
    real_k = (depth == 0)[None, :]
    before = anchor[None, :] <= anchor[:, None]
    same_block = (anchor[None, :] == anchor[:, None]) & (depth[None, :] <= depth[:, None])
    return (real_k & before) | (~real_k & same_block)


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Parallel rows, right-padded -> input_ids, position_ids, targets (the labels), depth
    [B, L] and the
    4-D bool attention_mask [B, 1, L, L]; a pad position attends only to itself (no row of the
    mask is empty) and nothing attends to it."""
    n = max(len(r["input_ids"]) for r in rows)
    b = len(rows)
    ids = torch.full((b, n), pad_id, dtype=torch.long)
    pos = torch.zeros((b, n), dtype=torch.long)
    labels = torch.full((b, n), IGNORE, dtype=torch.long)
    depth = torch.zeros((b, n), dtype=torch.long)
    att = torch.eye(n, dtype=torch.bool).repeat(b, 1, 1, 1)  # [B, 1, L, L]
    for i, r in enumerate(rows):
        m = len(r["input_ids"])
        ids[i, :m] = torch.tensor(r["input_ids"])
        pos[i, :m] = torch.tensor(r["position_ids"])
        labels[i, :m] = torch.tensor(r["targets"])
        depth[i, :m] = torch.tensor(r["depth"])
        att[i, 0, :m, :m] = block_attention(torch.tensor(r["anchor"]), depth[i, :m])
    return {
        "input_ids": ids,
        "position_ids": pos,
        "attention_mask": att,
        "targets": labels,  # not "labels": the Trainer reads that name itself
        "depth": depth,
        "row": torch.tensor([r["row"] for r in rows]),
    }


def model_mask(att: torch.Tensor, model) -> torch.Tensor:
    """The 4-D bool mask as the model's attention takes it as-is (transformers passes a 4-D
    mask through untouched): SDPA a bool mask; eager adds it to the scores, so 0 / the dtype's
    minimum. Other attention kernels take no arbitrary mask."""
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl == "sdpa":
        return att
    if impl == "eager":
        dtype = model.get_input_embeddings().weight.dtype
        zero = torch.zeros((), dtype=dtype, device=att.device)
        return torch.where(att, zero, torch.finfo(dtype).min)
    raise ValueError(f"parallel training needs sdpa or eager attention, not {impl}")


def labelled_logits(model, b: dict[str, torch.Tensor], mask: torch.Tensor):
    """(logits [n, vocab], labels [n], depths [n]) at every labelled position of a collated
    batch, through the compact head (`distillation.add_compact_head`); `mask`: `model_mask`."""
    at = b["targets"] != IGNORE
    logits = model(
        input_ids=b["input_ids"], attention_mask=mask, position_ids=b["position_ids"], logits_at=at
    )
    return logits, b["targets"][at], b["depth"][at]
