"""Exactness checks shared by the tests, the examples and anyone verifying branch_replay on their model.

The contract (docs/ARCHITECTURE.md §1): the loss and every gradient equal the original graph's run eagerly up to
floating-point reassociation — relative error <= 1e-10 in float64 and <= 1e-5 in float32, where the
relative error of a tensor is ``max |got - want| / max |want|``.
"""
from __future__ import annotations

import torch

from brcompile.contract import TOLERANCE, rel_err

__all__ = ["TOLERANCE", "assert_exact", "assert_subtree_ranges", "rel_err"]

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
