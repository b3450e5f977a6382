"""Exactness checks shared by the tests, the examples and anyone verifying branch_replay on their model.

The contract (docs/ARCHITECTURE.md §1): the loss and every gradient equal the original graph's run eagerly up to
floating-point reassociation — relative error <= 1e-10 in float64 and <= 1e-5 in float32, where the
relative error of a tensor is ``max |got - want| / max |want|``.
"""
from __future__ import annotations

import math

import torch

__all__ = ["TOLERANCE", "assert_exact", "assert_subtree_ranges", "rel_err"]

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


def assert_exact(got: torch.Tensor, want: torch.Tensor, dtype, what: str) -> None:
    """Raise AssertionError unless ``got`` has ``want``'s shape and ``rel_err(got, want)`` is within the
    bound of ``dtype`` (a torch dtype from :data:`TOLERANCE`, or a float tolerance)."""
    tol = TOLERANCE[dtype] if isinstance(dtype, torch.dtype) else float(dtype)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def assert_subtree_ranges(parent: list[int], end: list[int]) -> None:
    """Brute force over all pairs: packed token k is an ancestor-or-self of q (following ``parent``)
    iff ``k <= q < end[k]`` — the DFS-range property tree attention relies on (docs/ARCHITECTURE.md §4)."""
    n = len(parent)
    ancestors = []
    for q in range(n):
        chain, k = set(), q
        while k != -1:
            chain.add(k)
            k = parent[k]
        ancestors.append(chain)
    for k in range(n):
        for q in range(n):
            assert (k <= q < end[k]) == (k in ancestors[q]), f"end[{k}]={end[k]} wrong for q={q}"
