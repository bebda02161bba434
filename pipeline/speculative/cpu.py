"""CPU matmul forms for decoding's few-row linears, measured on this CPU (docs/serving.md).

`choose_linears` times `x @ W.T` against `W @ x.T` on the model's own weights per bucket of
rows; `use_linears` routes its linears through the faster form per bucket. Past 32 rows and
with grad enabled (training), layers stay plain.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BUCKETS = (1, 2, 4, 8, 16, 32)  # rows up to each bound share a choice


@dataclass(frozen=True)
class LinearChoice:
    """Per bucket of rows (`BUCKETS`): True where `W @ x.T` beat `x @ W.T` here."""

    transposed: tuple[bool, ...]
    ms: tuple[tuple[float, float], ...] = ()  # (x @ W.T, W @ x.T) per bucket, what was timed

    def for_rows(self, rows: int) -> bool:
        for bound, transposed in zip(BUCKETS, self.transposed, strict=False):
            if rows <= bound:  # a plain loop: torch.compile traces it (bisect it cannot)
                return transposed
        return False

    def describe(self) -> str:
        parts = []
        for bound, (plain, wxt), t in zip(BUCKETS, self.ms, self.transposed, strict=False):
            parts.append(f"<={bound} rows {'W@x.T' if t else 'x@W.T'} ({plain:.1f}/{wxt:.1f} ms)")
        return ", ".join(parts)


ALWAYS = LinearChoice(tuple(True for _ in BUCKETS))  # tests: the transposed form everywhere


def _transposed(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x2.shape[0]
    if rows == 1:  # one row: BLAS would take its gemv path again (a stride-0 copy is slow too)
        x2 = torch.cat([x2, x2])
    return torch.mm(weight, x2.t()).t()[:rows]


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if torch.is_grad_enabled() or not self._phoenix_choice.for_rows(rows):
        return F.linear(x, self.weight, self.bias)
    y = _transposed(x.reshape(rows, x.shape[-1]), self.weight)
    if self.bias is not None:
        y = y + self.bias
    return y.contiguous().view(*x.shape[:-1], self.weight.shape[0])


def use_linears(model: torch.nn.Module, choice: LinearChoice) -> int:
    """Route the model's CPU linears through `choice` (inference only). Idempotent; returns how
    many."""
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and mod.weight.device.type == "cpu":
            mod._phoenix_choice = choice
            if getattr(mod.forward, "__func__", None) is not _forward:
                mod.forward = types.MethodType(_forward, mod)
            n += 1
    return n


@torch.inference_mode()
def choose_linears(model: torch.nn.Module, layers: int = 4, repeat: int = 3) -> LinearChoice:
    """Time both forms on the first `layers` blocks' linears and the head, per bucket (median of
    `repeat` after a warm-up)."""
    weights = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
    per_layer = max(1, (len(weights) - 1) // _n_layers(model))
    sample = [*weights[: per_layer * layers], weights[-1]]  # the last: the output head
    transposed, ms = [], []
    for rows in BUCKETS:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in sample}

        def plain(xs=xs):
            for w in sample:
                F.linear(xs[w.shape[1]], w)

        def wxt(xs=xs):
            for w in sample:
                _transposed(xs[w.shape[1]], w)

        a, b = median_ms(plain, repeat), median_ms(wxt, repeat)
        transposed.append(b < a)
        ms.append((a, b))
    return LinearChoice(tuple(transposed), tuple(ms))


def _n_layers(model) -> int:
    return getattr(getattr(model, "config", None), "num_hidden_layers", 1) or 1


def median_ms(fn, repeat: int, warm: int = 1) -> float:
    """Median milliseconds of `repeat` calls of `fn`, after `warm` calls."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


PROBE_ROWS = (1, 5, 16)  # a plain step, a 4-guess verify, a full batch


@torch.inference_mode()
def probe_dtypes(model: torch.nn.Module, layers: int = 4, repeat: int = 3) -> dict[str, float]:
    """{dtype: ms} of the first `layers` blocks' linears and head over `PROBE_ROWS`, each at its
    faster form, in float32 and bfloat16 (weights converted for the probe only)."""
    weights = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
    per_layer = max(1, (len(weights) - 1) // _n_layers(model))
    sample = [*weights[: per_layer * layers], weights[-1]]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        ws = [w.detach().to(dtype) for w in sample]
        total = 0.0
        for rows in PROBE_ROWS:
            xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in ws}
            plain = median_ms(lambda xs=xs, ws=ws: [F.linear(xs[w.shape[1]], w) for w in ws],
                               repeat)  # fmt: skip
            wxt = median_ms(lambda xs=xs, ws=ws: [_transposed(xs[w.shape[1]], w) for w in ws],
                             repeat)  # fmt: skip
            total += min(plain, wxt)
        out[str(dtype).replace("torch.", "")] = total
    return out
