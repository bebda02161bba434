"""A CPU matmul shape that verify passes need: the loader applies it to the models it loads.

A linear layer over 2..SKINNY_MAX_ROWS rows (a verify pass, a draft's catch-up, a nearly drained
teacher batch) runs as `W @ x.T`. MKL's sgemm for `x @ W.T` at 2-8 rows took about twice the time
of one row on the AMD EPYC these figures come from (SmolLM2-135M: 57 ms of matmuls for 5 rows
against 29 ms for one); `W @ x.T` took 22-34 ms for 2-5 rows (`benchmarks/matmul_rows.py`). One
row (plain decoding) keeps the gemv path; with grad enabled (training) layers stay plain.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

SKINNY_MAX_ROWS = 8


def _skinny_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    # Compiled, the bound would only cost a recompile at 9 rows (arm 8's verify).
    top = rows if torch.compiler.is_compiling() else SKINNY_MAX_ROWS
    if 2 <= rows <= top and not torch.is_grad_enabled():
        y = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.contiguous().view(*x.shape[:-1], self.weight.shape[0])
    return F.linear(x, self.weight, self.bias)


def use_skinny_linears(model: torch.nn.Module) -> int:
    """Route the model's CPU linear layers through `_skinny_linear_forward` (inference only).
    Idempotent; returns how many were patched."""
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and mod.weight.device.type == "cpu":
            if getattr(mod.forward, "__func__", None) is not _skinny_linear_forward:
                mod.forward = types.MethodType(_skinny_linear_forward, mod)
            n += 1
    return n
