"""A decoder's flattened forward for the step loop, written out: the Llama family (Llama, Qwen2,
Qwen3, Mistral without a sliding window), as vLLM writes its own model code.

transformers' forward runs about forty small operations per layer around the matmuls, plus mask
and keyword plumbing; on a 2-core CPU a one-token step of SmolLM2-135M spent a third of its time
outside the matmuls. This forward does the same arithmetic in a handful of operations a layer:
one matmul for q, k and v together (their weights fused into one tensor, the model's own
parameters becoming views of it, so no memory is added), one for gate and up, fused RMSNorm
(`F.rms_norm`), rotary tables computed once per position, the keys and values written straight
into the rows' caches, and the rows' attention of `rows.py`. Linear layers take the matmul form
this CPU was measured to run faster at that many rows (`cpu.py`), when the loader chose one.

`LeanRunner.supports(model)` says whether a model fits; the others run through transformers'
own forward with `rows.rows_attention` (the same caches, the same plan, the same output).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .rows import ATTENTION, Plan, RowCache, attend

FAMILY = ("llama", "qwen2", "qwen3", "mistral")


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, choice) -> torch.Tensor:
    """x [T, in] @ w.T (+ b) in the form `choice` picked for T rows (None: F.linear)."""
    if choice is not None and choice.for_rows(x.shape[0]):
        rows = x.shape[0]
        x2 = torch.cat([x, x]) if rows == 1 else x
        y = torch.mm(w, x2.t()).t()[:rows]
        return y + b if b is not None else y
    return F.linear(x, w, b)


def _fuse(*mods: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linear layers of the same input; each layer's own
    parameter becomes a view of it (the same storage: nothing added, training unaffected)."""
    w = torch.cat([m.weight.detach() for m in mods])
    biases = [m.bias for m in mods]
    b = torch.cat([x.detach() for x in biases]) if all(x is not None for x in biases) else None
    i = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(w[i : i + n], requires_grad=False)
        if b is not None:
            m.bias = torch.nn.Parameter(b[i : i + n], requires_grad=False)
        i += n
    return w, b


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _pre(x, n1, qkv, qkv_b, qn, kn, cos, sin, eps: float, shape: tuple, choice):
    """A layer up to attention: norm, q/k/v in one matmul, q/k norms (Qwen3), rotary."""
    heads, kv_heads, d = shape
    t = x.shape[0]
    h = F.rms_norm(x, (x.shape[-1],), n1, eps)
    q, k, v = _linear(h, qkv, qkv_b, choice).split([heads * d, kv_heads * d, kv_heads * d], -1)
    q, k, v = q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)
    if qn is not None:
        q = F.rms_norm(q, (d,), qn.weight, qn.variance_epsilon)
        k = F.rms_norm(k, (d,), kn.weight, kn.variance_epsilon)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _post(x, out, o, n2, gu, gu_b, down, eps: float, choice):
    """A layer after attention: output projection, residual, norm, gated MLP, residual."""
    t = x.shape[0]
    x = x + _linear(out.reshape(t, -1), o.weight, o.bias, choice)
    h = F.rms_norm(x, (x.shape[-1],), n2, eps)
    g, u = _linear(h, gu, gu_b, choice).chunk(2, -1)
    return x + _linear(F.silu(g) * u, down.weight, down.bias, choice)


class LeanRunner:
    """The flattened forward of one Llama-family model over a `RowCache` (module docstring)."""

    @staticmethod
    def supports(model) -> bool:
        c = model.config
        body = getattr(model, "model", None)
        layers = getattr(body, "layers", None)
        if c.model_type not in FAMILY or layers is None or not len(layers):
            return False
        if any(t != "full_attention" for t in (getattr(c, "layer_types", None) or [])):
            return False  # a sliding window: transformers' forward
        if getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True):
            if c.model_type == "mistral":
                return False
        a = layers[0].self_attn
        return all(hasattr(a, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) and hasattr(
            body, "rotary_emb"
        )

    def __init__(self, model, limit: int):
        c = model.config
        body = model.model
        self.model = model
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.choice = getattr(model, "_phoenix_linears", None)
        self.layers = []
        for layer in body.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv, qkv_b = _fuse(a.q_proj, a.k_proj, a.v_proj)
            gu, gu_b = _fuse(mlp.gate_proj, mlp.up_proj)
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    qkv,
                    qkv_b,
                    getattr(a, "q_norm", None),
                    getattr(a, "k_norm", None),
                    a.o_proj,
                    layer.post_attention_layernorm.weight,
                    gu,
                    gu_b,
                    mlp.down_proj,
                )
            )
        self.embed_tokens = body.embed_tokens  # called as a module: its hooks run, as in HF
        self.embed = body.embed_tokens.weight
        self.norm = body.norm.weight
        self.head = model.get_output_embeddings()
        rot = body.rotary_emb
        pos = torch.arange(limit, dtype=torch.float, device=self.embed.device)
        freqs = pos[:, None] * rot.inv_freq.to(torch.float)[None]
        emb = torch.cat([freqs, freqs], -1)
        dtype = self.embed.dtype
        self.cos = (emb.cos() * rot.attention_scaling).to(dtype)  # [limit, head_dim]
        self.sin = (emb.sin() * rot.attention_scaling).to(dtype)
        self._pre, self._post = _pre, _post

    @property
    def compiled(self) -> bool:
        return self._pre is not _pre

    def compile(self, backend: str = "inductor", mode: str | None = None) -> None:
        """Run each layer's dense parts (norms, matmuls, rotary, MLP) through `torch.compile`,
        dynamic in the number of tokens; the cache write and the attention stay eager between
        them (as vLLM's piecewise graphs leave attention out)."""
        self._pre = torch.compile(_pre, dynamic=True, backend=backend, mode=mode)
        self._post = torch.compile(_post, dynamic=True, backend=backend, mode=mode)

    def uncompile(self) -> None:
        self._pre, self._post = _pre, _post

    @torch.inference_mode()
    def hidden(
        self, ids: torch.Tensor, cache: RowCache, plan: Plan, taps: Sequence[int] = (),
        tapped: list | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The final normed hidden states of the fed tokens, [T, hidden]; the cache gets their
        keys and values (the caller advances its lengths). `taps`: layers whose input (the
        residual stream, transformers' `hidden_states[i]`) is appended to `tapped`, in order
        (an EAGLE-3 head reads them)."""
        choice, eps, shape = self.choice, self.eps, (self.heads, self.kv_heads, self.head_dim)
        x = self.embed_tokens(ids)  # [T, hidden]
        cos = self.cos[plan.positions][:, None]  # [T, 1, head_dim]
        sin = self.sin[plan.positions][:, None]
        scale = self.head_dim**-0.5
        for i, (n1, qkv, qkv_b, qn, kn, o, n2, gu, gu_b, down) in enumerate(self.layers):
            tapped.extend([x] * taps.count(i))  # ascending layers: the taps sorted
            q, k, v = self._pre(x, n1, qkv, qkv_b, qn, kn, cos, sin, eps, shape, choice)
            keys, values = cache.write(i, k, v)
            out = attend(q, keys, values, plan, scale)  # [T, heads, head_dim]
            x = self._post(x, out, o, n2, gu, gu_b, down, eps, choice)
        return F.rms_norm(x, (x.shape[-1],), self.norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _linear(hidden, self.head.weight, self.head.bias, self.choice)


WARM_TOKENS = (1, 2, 3, 5, 9, 17, 33)  # every side of the matmul-form buckets (`cpu.BUCKETS`)


@torch.inference_mode()
def step_ms(model, tokens: int, repeat: int = 5) -> float:
    """Median milliseconds of a flattened forward of `tokens` tokens (hidden states and head)
    after a prefill of up to 64 tokens, in a scratch cache of its own."""
    from .rows import target_scores

    runner = getattr(model, "_phoenix_runner", None)
    limit = runner.cos.shape[0] if runner is not None else 4096
    prompt = max(1, min(64, limit - tokens))
    cache = RowCache(model, 1, prompt + tokens)
    slot = cache.alloc()
    target_scores(model, cache, [slot], [[0] * prompt])
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        target_scores(model, cache, [slot], [[0] * tokens])
        times.append(time.perf_counter() - t0)
        cache.crop(slot, prompt)
    return 1000 * sorted(times[1:])[repeat // 2]


def warm_up(model, tokens=WARM_TOKENS, on_shape=None) -> None:
    """Run a forward of each token count once (a compiled runner compiles what it needs now,
    not in a request). `on_shape(tokens, i, n, seconds)` reports each."""
    runner = getattr(model, "_phoenix_runner", None)
    limit = runner.cos.shape[0] if runner is not None else 4096
    tokens = [n for n in tokens if n < limit]  # a step longer than the context never runs
    for i, n in enumerate(tokens, 1):
        t0 = time.perf_counter()
        step_ms(model, n, repeat=1)
        if on_shape is not None:
            on_shape(n, i, len(tokens), time.perf_counter() - t0)


def prepare(model, limit: int, lean: bool = True) -> None:
    """Make `model` ready for flattened forwards up to `limit` positions: its lean runner
    (`runner.py`) where its architecture has one (and `lean`), else `rows_attention` as its
    attention (a plain forward of it still gets SDPA). Idempotent; the runner is kept on the
    model, so cores sharing a target share it."""
    runner = getattr(model, "_phoenix_runner", None)
    if lean and LeanRunner.supports(model):
        if runner is None or runner.cos.shape[0] < limit:
            with torch.inference_mode(False):  # the model's parameters stay plain tensors
                model._phoenix_runner = LeanRunner(model, limit)
        return
    model._phoenix_runner = None
    if getattr(model.config, "_attn_implementation", None) != ATTENTION:
        model.set_attn_implementation(ATTENTION)
