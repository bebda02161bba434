"""EAGLE-3 draft head (pure torch; files: `pipeline/eagle3.py`, config: `eagle3_config.py`).

Layout as vllm-project/speculators saves it and vLLM's `llama_eagle3` serves: `fc` fuses the
target's hidden states at three depths (`aux_layer_ids`, inputs of those layers; 3H -> H); one
Llama layer attends over `[input_layernorm(embed(next)); hidden_norm(hidden)]` (2H), residual =
hidden; `norm` and `lm_head` over `draft_vocab_size` ids (`d2t`: draft id -> target id offset,
`t2d`: target ids the head can propose). The embeddings are the target's, frozen, not saved.

Drafting with x_0..x_m committed and target states g_0..g_{m-1}: position t reads
(x_{t+1}, fc(g_t)); its output at m-1 scores guess d_1; guess j+1 reads (d_j, the head's own
pre-norm output). The cache holds committed positions only (`HeadCache.crop` after a round).
Training (`ttt_logits`) is EAGLE-3's training-time test: step j reads step j-1's output with
exactly the attention drafting sees at guess j+1, so positions 2..k are trained too.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .eagle3_config import Eagle3Config
from .sampling import greedy_ids


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(2 * h, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=False)


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        h, i = c.hidden_size, c.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """The one decoder layer, named as speculators saves it (`layers.0.*`)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class HeadCache:
    """One sequence's keys/values [1, kv heads, length, head dim], in buffers grown by doubling."""

    def __init__(self):
        self.k: torch.Tensor | None = None  # [1, kv heads, capacity, head dim]
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append [1, kv heads, new, head dim]; returns all positions (views until next append)."""
        start, end = self.length, self.length + k.shape[2]
        if self.k is None or end > self.k.shape[2]:
            cap = max(end, 2 * (0 if self.k is None else self.k.shape[2]), 64)
            with torch.inference_mode(False):  # plain tensors, written in or out of that mode
                grown = [t.new_empty(*t.shape[:2], cap, t.shape[3]) for t in (k, v)]
            for new, old in zip(grown, (self.k, self.v), strict=True):
                if old is not None:
                    new[:, :, :start] = old[:, :, :start]
            self.k, self.v = grown
        self.k[:, :, start:end], self.v[:, :, start:end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


def _no_duck_shapes():
    """Trace without duck sizing (equal sizes at trace time, e.g. 4 states and 4 heads, would be
    tied and recompile later); a no-op where torch's private config lacks it."""
    config = getattr(torch.fx.experimental, "_config", None)
    if config is None or not hasattr(config, "use_duck_shape"):
        return contextlib.nullcontext()
    return config.patch(use_duck_shape=False)


class Eagle3Head(nn.Module):
    """The head. `embed`: the target's input embedding module (frozen, shared, not saved)."""

    def __init__(self, c: Eagle3Config, embed: nn.Module | None = None):
        super().__init__()
        self.config = c
        h = c.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.layers = nn.ModuleList([Layer(c)])
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        d = c.head_dim
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv, persistent=False)
        self._embed = [embed]  # a list: not a submodule, so neither trained nor saved
        self._dense: tuple[Callable, Callable, Callable] | None = None  # `compile`

    # -- the vocabulary ---------------------------------------------------------------------
    def set_vocab(self, target_ids: list[int]) -> None:
        """The target ids the head proposes, ascending; `d2t`/`t2d` as speculators store them."""
        ids = torch.tensor(sorted(set(target_ids)), dtype=torch.long)
        if len(ids) != self.config.draft_vocab_size:
            raise ValueError(f"{len(ids)} ids for a head of {self.config.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def target_ids(self) -> torch.Tensor:
        """Draft id -> target id."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def draft_index(self) -> torch.Tensor:
        """Target id -> draft id, -100 where the head cannot propose it."""
        out = torch.full((self.config.vocab_size,), -100, dtype=torch.long, device=self.d2t.device)
        out[self.target_ids] = torch.arange(len(self.d2t), device=self.d2t.device)
        return out

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self._embed[0]
        if e is None:
            raise RuntimeError("the eagle3 head has no embedding: attach the target's")
        with torch.no_grad():  # the target's, frozen: no gradient into its 49k rows
            return e(ids).to(self.fc.weight.dtype)

    # -- the layer, in parts ----------------------------------------------------------------
    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, d] at positions pos [B, T]."""
        freqs = pos.to(torch.float32)[..., None] * self.inv_freq  # [B, T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, d]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return x * cos + rotate_half(x) * sin

    def _qkv(self, emb: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        """Queries, keys, values [B, heads, T, d] (RoPE applied) and the residual."""
        c, layer = self.config, self.layers[0]
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        b, t, _ = x.shape
        a = layer.self_attn
        q = a.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return self._rope(q, pos), self._rope(k, pos), v, hidden

    def _out(self, attn: torch.Tensor, residual: torch.Tensor, score: bool = True):
        """attn [B, heads, T, d] -> (logits [B, T, V_d], or normed hidden if not `score`;
        pre-norm hidden [B, T, H])."""
        layer = self.layers[0]
        b, _, t, _ = attn.shape
        h = layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1)) + residual
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        normed = self.norm(h)
        return (self.lm_head(normed) if score else normed), h

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        rep = self.config.num_attention_heads // self.config.num_key_value_heads
        return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's three hidden states [.., 3H] -> the head's hidden [.., H]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    # -- compiled drafting ------------------------------------------------------------------
    @property
    def compiled(self) -> bool:
        return self._dense is not None

    def compile(self, backend: str = "inductor", mode: str | None = None) -> None:
        """`torch.compile` drafting's dense parts (`fuse`, `_qkv`, `_out`), dynamic in rows and
        tokens; cache append and attention stay eager, training too. Sizes of 1 are their own
        graphs: `warm_up` runs each."""
        self._dense = tuple(
            torch.compile(f, dynamic=True, backend=backend, mode=mode)
            for f in (self.fuse, self._qkv, self._out)
        )

    def uncompile(self) -> None:
        self._dense = None

    def _parts(self) -> tuple[Callable, Callable, Callable]:
        return self._dense or (self.fuse, self._qkv, self._out)

    @torch.inference_mode()  # as the step loop drafts (compiled graphs guard on the mode)
    def warm_up(self, rows: int = 2) -> None:
        """Draft from scratch caches in every shape drafting uses (1 or `rows` rows, reads of
        one or several states), so a compiled head compiles now, not in a request."""
        aux = torch.zeros(7, 3 * self.config.hidden_size, dtype=self.fc.weight.dtype)
        with _no_duck_shapes():  # a size that happens to equal another is not tied to it
            self.draft_many([([0] * 8, aux, HeadCache(), 3, None)])
            jobs = [([0] * 8, aux, HeadCache(), 3, None) for _ in range(rows)]
            self.draft_many(jobs)
            self.draft_many([(s + [0], aux[:1], c, 3, None) for s, _, c, _, _ in jobs])
            self.draft_many([(jobs[0][0] + [0, 0], aux[:1], jobs[0][2], 3, None)])  # one state

    @torch.inference_mode()
    def step_ms(self, context: int = 64, repeat: int = 30) -> float:
        """Median ms of a one-row guess after `context` states in a scratch cache."""
        dev, dtype = self.fc.weight.device, self.fc.weight.dtype
        _, pre = self.forward_step(
            torch.zeros(1, context, dtype=torch.long, device=dev),
            self.fuse(torch.zeros(context, 3 * self.config.hidden_size, dtype=dtype))[None],
            0,
            cache := HeadCache(),
        )
        times = []
        for _ in range(repeat + 3):
            t0 = time.perf_counter()
            self.forward_step(torch.zeros(1, 1, dtype=torch.long, device=dev), pre[:, -1:],
                              context, cache)  # fmt: skip
            times.append(time.perf_counter() - t0)
            cache.crop(context)
        times = sorted(times[3:])
        return 1000 * times[len(times) // 2]

    # -- drafting ---------------------------------------------------------------------------
    def forward_step(
        self, ids: torch.Tensor, hidden: torch.Tensor, start: int, cache: HeadCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions start..start+T-1: ids [1, T], hidden [1, T, H] (fused target's or the head's).
        Appends to `cache`; returns logits [1, T, V_d] and pre-norm outputs [1, T, H]."""
        t = ids.shape[1]
        pos = torch.arange(start, start + t, device=ids.device)[None]
        _, qkv, out = self._parts()
        q, k, v, residual = qkv(self.embed(ids), hidden, pos)
        return out(self._attend(q, k, v, cache), residual)

    @torch.no_grad()
    def propose(
        self, seq: list[int], aux: torch.Tensor, cache: HeadCache, k: int, choose=None
    ) -> list[int]:
        """`draft` given all target states `aux` [>= m, 3H] of x_0..x_{m-1}."""
        m = len(seq) - 1
        return self.draft(seq, aux[cache.length : m], cache, k, choose)

    @torch.no_grad()
    def draft(
        self, seq: list[int], fresh: torch.Tensor, cache: HeadCache, k: int, choose=None
    ) -> list[int]:
        """k guesses (target ids) after committed `seq` x_0..x_m. `fresh` [m - cache.length >= 1,
        3H]: target states the cache has not read; the cache ends cut back to committed positions.
        `choose(draft-vocab logits) -> draft index` picks a guess (default greedy)."""
        return self.draft_many([(seq, fresh, cache, k, choose)])[0]

    @torch.no_grad()
    def draft_many(
        self, jobs: list[tuple], on_pass: Callable[[int, float, bool], None] | None = None
    ) -> list[list[int]]:
        """`draft` for jobs (seq, fresh, cache, k, choose): one read pass over all, then one shared
        head pass per guess position over the jobs still drafting. `on_pass(rows, seconds, read)`
        times each pass (read True for the first)."""
        dev, tids = self.fc.weight.device, self.target_ids
        outs: list[list[int]] = []
        chain: list[tuple[int, torch.Tensor]] = []  # (job, the head's last pre-norm output)
        t0 = time.perf_counter()
        logits, pre = self._read_rows(jobs)
        for i, (_, _, _, k, choose) in enumerate(jobs):
            outs.append([self._pick(logits[i], choose, tids)])  # (a pick syncs a device)
            if k > 1:
                chain.append((i, pre[i : i + 1]))
        if on_pass:
            on_pass(len(jobs), time.perf_counter() - t0, True)
        while chain:
            t0 = time.perf_counter()
            ids = torch.tensor([[outs[i][-1]] for i, _ in chain], device=dev)
            hidden = torch.cat([h for _, h in chain])
            caches = [jobs[i][2] for i, _ in chain]
            if len(chain) == 1:
                logits, pre = self.forward_step(ids, hidden, caches[0].length, caches[0])
            else:
                logits, pre = self._step_rows(ids, hidden, caches)
            going = []
            for row, (i, _) in enumerate(chain):
                outs[i].append(self._pick(logits[row, -1], jobs[i][4], tids))
                if len(outs[i]) < jobs[i][3]:
                    going.append((i, pre[row : row + 1, -1:]))
            if on_pass:
                on_pass(len(chain), time.perf_counter() - t0, False)
            chain = going
        for seq, _, cache, _, _ in jobs:
            cache.crop(len(seq) - 1)
        return outs

    def _attend(self, q, k, v, cache: HeadCache) -> torch.Tensor:
        """Causal attention of one sequence's new positions [1, heads, T, d] over its cache."""
        k_all, v_all = cache.append(k, v)
        t, s = q.shape[2], k_all.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)

    def _read_rows(self, jobs: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
        """Read every job's fresh states in one pass (dense parts flattened, attention per row).
        Returns logits at each row's last position [rows, V_d] and pre-norm outputs [rows, 1, H]."""
        dev = self.fc.weight.device
        fuse, qkv, out = self._parts()
        ids: list[int] = []
        pos: list[int] = []
        sizes: list[int] = []
        for seq, fresh, cache, _, _ in jobs:
            m, have = len(seq) - 1, cache.length
            if fresh.shape[0] != m - have or m - have < 1:
                raise ValueError(
                    f"head cache at {have} of {m} positions, {fresh.shape[0]} new states"
                )
            ids += seq[have + 1 : m + 1]
            pos += range(have, m)
            sizes.append(m - have)
        fresh = [j[1].to(dev) for j in jobs]
        hidden = fuse(fresh[0] if len(fresh) == 1 else torch.cat(fresh))[None]
        ids_t = torch.tensor([ids], device=dev)
        q, k, v, residual = qkv(self.embed(ids_t), hidden, torch.tensor([pos], device=dev))
        parts, start = [], 0
        for (_, _, cache, _, _), t in zip(jobs, sizes, strict=True):
            rows = slice(start, start + t)
            parts.append(self._attend(q[:, :, rows], k[:, :, rows], v[:, :, rows], cache))
            start += t
        attn = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        normed, pre = out(attn, residual, False)
        last = torch.tensor(list(itertools.accumulate(sizes)), device=dev) - 1
        return self.lm_head(normed[0, last]), pre[0, last][:, None]

    @staticmethod
    def _pick(scores: torch.Tensor, choose, tids: torch.Tensor) -> int:
        return int(tids[int(greedy_ids(scores)) if choose is None else choose(scores)])

    def _step_rows(
        self, ids: torch.Tensor, hidden: torch.Tensor, caches: list[HeadCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One position of R sequences: ids [R, 1], hidden [R, 1, H]; caches padded to longest."""
        starts = [c.length for c in caches]
        pos = torch.tensor(starts, device=ids.device)[:, None]
        _, qkv, out = self._parts()
        q, k, v, residual = qkv(self.embed(ids), hidden, pos)
        longest = max(starts) + 1
        r, heads, _, d = k.shape
        keys, values = k.new_zeros(r, heads, longest, d), v.new_zeros(r, heads, longest, d)
        mask = torch.zeros(r, 1, 1, longest, dtype=torch.bool, device=ids.device)
        for row, c in enumerate(caches):
            kk, vv = c.append(k[row : row + 1], v[row : row + 1])
            n = kk.shape[2]
            keys[row, :, :n], values[row, :, :n], mask[row, ..., :n] = kk[0], vv[0], True
        # `enable_gqa`: no per-head copies of keys/values (docs/measurements.md).
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return out(attn, residual)

    # -- training ---------------------------------------------------------------------------
    def ttt_logits(
        self, ids: torch.Tensor, aux: torch.Tensor, steps: int, score: bool = True
    ) -> list[torch.Tensor]:
        """Training-time test. ids [B, T], aux [B, T, 3H] (target states after each token).
        Step j's query t reads x_{t+1+j} and (j > 0) step j-1's output at t; at position t+j it
        attends to step 0's keys <= t plus steps 1..j's keys at t. Returns per step logits
        [B, T, V_d], query t scoring the token at t+j+2 (caller masks positions past T), or with
        `score` False the normed hidden states."""
        b, t = ids.shape
        dev = ids.device
        nxt = torch.cat([ids[:, 1:], ids[:, -1:].expand(b, steps)], dim=1)  # x_{t+1}, padded
        base = torch.arange(t, device=dev)[None].expand(b, t)
        hidden = self.fuse(aux)
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        scale = 1.0 / math.sqrt(self.config.head_dim)
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        outs = []
        for j in range(steps):
            q, k, v, residual = self._qkv(self.embed(nxt[:, j : j + t]), hidden, base + j)
            k, v = self._expand(k), self._expand(v)
            if j == 0:
                k0, v0 = k, v
                scores = (q @ k0.transpose(-1, -2)) * scale
                scores = scores.masked_fill(~causal, float("-inf"))
                attn = scores.softmax(-1) @ v0
            else:
                keys.append((k, v))
                s0 = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
                diag = torch.stack([(q * ki).sum(-1) * scale for ki, _ in keys], dim=-1)
                p = torch.cat([s0, diag], dim=-1).softmax(-1)
                attn = p[..., :t] @ v0
                for i, (_, vi) in enumerate(keys):
                    attn = attn + p[..., t + i, None] * vi
            logits, pre = self._out(attn, residual, score)
            outs.append(logits)
            hidden = pre
        return outs
