"""The contract's numbers: how close "exact" is (docs/ARCHITECTURE.md §1).

The loss and every gradient equal the original graph's run eagerly up to floating-point reassociation —
relative error <= 1e-10 in float64 and <= 1e-5 in float32, where the relative error of a tensor is
``max |got - want| / max |want|``. The runtime's ``verify`` option and the test helpers (brcompile/testing.py)
read them from here.
"""
from __future__ import annotations

import math

import torch

__all__ = ["TOLERANCE", "rel_err"]

#: The contract's bound per dtype.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` (the absolute error when ``want`` is all zeros). NaN-aware: NaNs
    at the same places compare equal, a NaN anywhere else is an infinite error."""
    got, want = got.detach(), want.detach()
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    if nan_got.any() or nan_want.any():
        if not torch.equal(nan_got, nan_want):
            return math.inf
        got, want = torch.nan_to_num(got), torch.nan_to_num(want)
    if got.numel() == 0:
        return 0.0
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    return diff / scale if scale > 0 else diff
