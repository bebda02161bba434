"""CPU matmul shapes that decoding needs, chosen by measuring this CPU: the loader applies them.

A decoding step runs every linear layer over a few rows (1 for a plain step, k+1 for a verify,
one per running request in a batch). BLAS libraries pick their kernel by shape, and at a few
rows the pick can be far from the memory bound, differently per CPU model (on one, `x @ W.T` at
2-8 rows took twice one row's time; on another, one row took longer than two through `W @ x.T`:
docs/measurements.md, `benchmarks/matmul_rows.py`). So nothing is assumed: `choose_linears` times both forms on the model's own weights, per bucket
of rows (1, 2, 3-4, 5-8, 9-16, 17-32), in the model's dtype, and `use_linears` routes the model's
linear layers through the faster one per bucket (`W @ x.T` is fed two rows at least: one row
would take the gemv path again). Past 32 rows, and with grad enabled (training), layers stay
plain. The result (`LinearChoice`) is logged by the loader.
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
    """Route the model's CPU linear layers through `choice` (inference only). Idempotent;
    returns how many layers it routes."""
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
    """Time `x @ W.T` against `W @ x.T` on the model's own linear weights (those of its first
    `layers` blocks and its output head: its shapes, its dtype) at each bucket's row count;
    the median of `repeat` runs after one warm-up. About a second on SmolLM2-135M."""
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
    """Milliseconds of the model's first `layers` blocks' linears plus its head, summed over a
    plain step, a 4-guess verify and a 16-row batch (`PROBE_ROWS`), each at its faster form, in
    float32 and in bfloat16 (the weights converted for the probe only)."""
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
