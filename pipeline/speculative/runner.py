"""The lean runner: a flattened forward for the Llama family (Llama, Qwen2, Qwen3, Mistral
without a sliding window), the same arithmetic as transformers' in a few ops a layer: fused
q/k/v and gate/up matmuls (the model's parameters become views: no memory added), `F.rms_norm`,
rotary tables per position, keys/values written into the rows' caches, `rows.attend`. Linears
use `cpu.py`'s measured matmul form when the loader chose one. Other models run transformers'
forward with `rows.rows_attention` (same caches, same output).

Compiled, the whole pass is one `torch.compile` graph (`_Pass`) dynamic in every size; sizes of
1 are padded (`RowCache.padded`). Only full passes in slot order take it; once warm, a shape it
cannot take runs eager (`stance`). Rationale and costs: docs/serving.md, docs/measurements.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .rows import ATTENTION, Plan, RowCache, attend

log = logging.getLogger(__name__)

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
    """One weight (and bias) for several linears of one input; their parameters become views."""
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


def _forward(embed_tokens, layers, norm, cos_t, sin_t, eps, shape, choice, ids, cache, plan,
             taps, tapped):  # fmt: skip
    """The pass (`LeanRunner.hidden`) over the runner's weights (eager) or a `_Pass`'s."""
    x = embed_tokens(ids)  # [T, hidden]
    cos = cos_t[plan.positions][:, None]  # [T, 1, head_dim]
    sin = sin_t[plan.positions][:, None]
    scale = shape[2] ** -0.5
    for i, (n1, qkv, qkv_b, qn, kn, o, n2, gu, gu_b, down) in enumerate(layers):
        tapped.extend([x] * taps.count(i))  # ascending layers: the taps sorted
        q, k, v = _pre(x, n1, qkv, qkv_b, qn, kn, cos, sin, eps, shape, choice)
        keys, values = cache.write(i, k, v)
        out = attend(q, keys, values, plan, scale)  # [T, heads, head_dim]
        x = _post(x, out, o, n2, gu, gu_b, down, eps, choice)
    return F.rms_norm(x, (x.shape[-1],), norm, eps)


class _Pass(torch.nn.Module):
    """A runner's pass as a module whose parameters are the runner's weights (shared), so
    inductor can freeze them and autotune its GEMMs. No `cpu.py` matmul form; head stays eager."""

    def __init__(self, run: LeanRunner):
        super().__init__()
        self.embed_tokens = run.embed_tokens
        self.blocks = torch.nn.ModuleList()
        for layer in run.layers:
            block = torch.nn.Module()
            for name, t in zip(_LAYER, layer, strict=True):
                if isinstance(t, torch.nn.Module):
                    block.add_module(name, t)
                elif t is not None:
                    block.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
            self.blocks.append(block)
        self.norm = torch.nn.Parameter(run.norm, requires_grad=False)
        self.register_buffer("cos", run.cos, persistent=False)
        self.register_buffer("sin", run.sin, persistent=False)
        self.eps, self.shape = run.eps, run.shape

    def forward(self, ids, cache, plan, taps, tapped):
        layers = [tuple(getattr(b, n, None) for n in _LAYER) for b in self.blocks]
        return _forward(self.embed_tokens, layers, self.norm, self.cos, self.sin, self.eps,
                        self.shape, None, ids, cache, plan, taps, tapped)  # fmt: skip


_LAYER = ("n1", "qkv", "qkv_b", "qn", "kn", "o", "n2", "gu", "gu_b", "down")


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
        self.shape = (self.heads, self.kv_heads, self.head_dim)
        self.graph: torch.nn.Module | None = None  # the compiled pass (`compile`)
        self._cached: torch.nn.Module | None = None  # the same, running cached graphs only
        # None (serving): warm graphs only, other shapes eager, on this thread alone (stances
        # are process-wide). Else the stance to call under: "default" compiles (`warm_up`),
        # "fail_on_recompile" (tests) fails a pass the warm graph cannot take.
        self.stance: str | None = None
        self.graph_passes = 0  # passes given to the compiled pass (tests count them)
        self.options: dict = {}  # inductor's settings while it compiles (`warm_up`)
        self.warm_taps: set[tuple[int, ...]] = set()  # the taps `warm_up` compiled for
        self.tried = False  # `compiling.compile_engine` decided this runner (compiled or eager)

    @property
    def compiled(self) -> bool:
        return self.graph is not None

    def compile(self, backend: str = "inductor") -> None:
        """Compile the whole pass as one dynamic graph (`_Pass`); other passes run eager."""
        self.options = {}
        if backend == "inductor" and self.embed.device.type == "cpu":
            self.options = {"freezing": True, "max_autotune": True,
                            "max_autotune_gemm_backends": "CPP,ATEN"}  # fmt: skip
        # All runners' graphs are entries of one `_Pass.forward` (torch's default limit is 8).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.graph = torch.compile(_Pass(self), dynamic=True, backend=backend)
        self._cached = torch._dynamo.run(self.graph)
        self.warm_taps = set()

    def uncompile(self) -> None:
        """Back to eager (the compiled code stays in torch's cache until the process ends)."""
        self.graph = self._cached = None
        self.warm_taps = set()

    @torch.inference_mode()
    def hidden(
        self, ids: torch.Tensor, cache: RowCache, plan: Plan, taps: Sequence[int] = (),
        tapped: list | None = None, graph: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Final normed hidden states [T, hidden]; the cache gets their keys/values (the caller
        advances lengths). Inputs of layers `taps` (transformers' `hidden_states[i]`) are
        appended to `tapped` in order. `graph`: through the compiled pass (plan padded)."""
        if graph and self.graph is not None:
            self.graph_passes += 1
            if self.stance is None:
                return self._cached(ids, cache, plan, tuple(taps), tapped)
            with torch.compiler.set_stance(self.stance):
                return self.graph(ids, cache, plan, tuple(taps), tapped)
        return _forward(self.embed_tokens, self.layers, self.norm, self.cos, self.sin, self.eps,
                        self.shape, self.choice, ids, cache, plan, taps, tapped)  # fmt: skip

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _linear(hidden, self.head.weight, self.head.bias, self.choice)


# (rows, tokens a row) warmed before serving: step, verify, steps, prefill, verifies.
WARM = ((1, 1), (2, 3), (3, 1), (1, 40), (3, 5))


@torch.inference_mode()
def step_ms(model, tokens: int, repeat: int = 5) -> float:
    """Median ms of a forward of `tokens` tokens after a <= 64-token prefill, in a scratch cache."""
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


@torch.inference_mode()
def warm_up(model, taps: Sequence[Sequence[int]] = ((),), on_shape=None) -> None:
    """Compile a compiled runner now, not in a request: its pass at each `WARM` shape with each
    set of `taps`, in scratch; `on_shape(label, i, n, seconds)` reports each. Eager: no-op."""
    runner = getattr(model, "_phoenix_runner", None)
    if runner is None or not runner.compiled:
        return
    limit = min(runner.cos.shape[0], 64)
    shapes = [(r, n, t) for t in taps for r, n in WARM if 8 + r + n <= limit]  # `_warm`'s widths
    if not shapes:
        return
    cache = RowCache(model, max(r for r, _, _ in shapes), limit)
    stance = runner.stance
    try:
        # Inductor's settings must hold while dynamo traces too, so they wrap the calls.
        runner.stance = "default"  # compiling allowed (serving: not)
        # Specialised floats: a symbolic norm epsilon compiled every graph twice (measurements.md).
        with (torch._inductor.config.patch(runner.options),
              torch._dynamo.config.patch(specialize_float=True)):  # fmt: skip
            _warm(model, cache, shapes, on_shape)
        runner.stance = "fail_on_recompile"  # each set of taps: the graph is there (else raise)
        _warm(model, cache, [(r, n, t) for r, n, t in shapes if (r, n) == WARM[1]])
    finally:
        runner.stance = stance
    runner.warm_taps |= {tuple(t) for t in taps}


def _warm(model, cache, shapes, on_shape=None) -> None:
    from .rows import target_logits

    for i, (rows, n, t) in enumerate(shapes, 1):
        t0 = time.perf_counter()
        cache.used = 0
        slots = [cache.alloc() for _ in range(rows)]
        target_logits(model, cache, slots, [[0] * (8 + r) for r in range(rows)], t)  # ragged
        target_logits(model, cache, slots, [[0] * n for _ in slots], t)
        if on_shape is not None:
            label = f"{rows} row(s) x {n} token(s)" + (f", taps {list(t)}" if t else "")
            on_shape(label, i, len(shapes), time.perf_counter() - t0)


def prepare(model, limit: int, lean: bool = True) -> None:
    """Ready `model` for flattened forwards up to `limit` positions: a lean runner if supported
    and `lean`, else `rows_attention`. Idempotent; kept on the model, so cores share it."""
    runner = getattr(model, "_phoenix_runner", None)
    if lean and LeanRunner.supports(model):
        if runner is None or runner.cos.shape[0] < limit:
            if runner is not None and runner.compiled:  # a longer context than it was built for
                log.warning("a compiled runner for %d positions replaced by an eager one for %d: "
                            "compile for the longest context used", runner.cos.shape[0], limit)  # fmt: skip
            with torch.inference_mode(False):  # the model's parameters stay plain tensors
                model._phoenix_runner = LeanRunner(model, limit)
        return
    model._phoenix_runner = None
    if getattr(model.config, "_attn_implementation", None) != ATTENTION:
        model.set_attn_implementation(ATTENTION)
