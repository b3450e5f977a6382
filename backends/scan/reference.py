"""Oracles of the tree scans (tests, benchmarks): token by token, or one masked matmul, straight from the
preorder property ``j is an ancestor-or-self of k  <=>  j <= k < end[j]``."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["reference_cumsum", "reference_causal_conv1d", "reference_linear_scan", "reference_matrix_scan"]


def reference_cumsum(x: Tensor, end: Tensor, dim: int) -> Tensor:
    """Oracle, O(N²): ``out[k] = sum_j [j <= k < end[j]] x[j]`` along ``dim`` as one masked matmul."""
    n = end.shape[0]
    ids = torch.arange(n, device=end.device)
    anc = (ids[None, :] <= ids[:, None]) & (ids[:, None] < end[None, :])  # [k, j]
    xm = x.movedim(dim, -1)
    return (xm.to(torch.float64) @ anc.to(torch.float64).T).to(x.dtype).movedim(-1, dim)


def reference_causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], end: Tensor) -> Tensor:
    """Oracle: the ancestors of k ordered by depth (``j <= k < end[j]``), read the last W of them and apply
    the dense conv's taps token by token."""
    n = end.shape[0]
    W = weight.shape[2]
    out = torch.zeros_like(x)
    for k in range(n):
        path = [j for j in range(k + 1) if int(end[j]) > k]  # ancestors-or-self, root first
        for i in range(W):
            if i < len(path):
                out[:, :, k] += weight[:, 0, W - 1 - i] * x[:, :, path[-1 - i]]
        if bias is not None:
            out[:, :, k] += bias
    return out


def reference_linear_scan(a: Tensor, b: Tensor, end: Tensor, dim: int) -> Tensor:
    """Oracle: token by token in preorder (a parent comes before its children), ``h[k] = a[k] * h[p] + b[k]``
    with p the deepest proper ancestor of k (``j < k < end[j]``), ``h[k] = b[k]`` at a root."""
    shape = torch.broadcast_shapes(a.shape, b.shape)
    am, bm = a.expand(shape).movedim(dim, 0), b.expand(shape).movedim(dim, 0)
    h: list[Tensor] = []
    for k in range(end.shape[0]):
        anc = [j for j in range(k) if int(end[j]) > k]
        h.append(am[k] * h[anc[-1]] + bm[k] if anc else bm[k])
    return torch.stack(h).movedim(0, dim)


def reference_matrix_scan(M: Tensor, b: Tensor, end: Tensor, dim: int) -> Tensor:
    """Oracle: token by token in preorder (a parent comes before its children), ``h[k] = M[k] @ h[p] + b[k]``
    with p the deepest proper ancestor of k (``j < k < end[j]``), ``h[k] = b[k]`` at a root."""
    Mm, bm = M.movedim(dim, 0), b.movedim(dim, 0)
    h: list[Tensor] = []
    for k in range(end.shape[0]):
        anc = [j for j in range(k) if int(end[j]) > k]
        h.append(Mm[k] @ h[anc[-1]] + bm[k] if anc else bm[k])
    return torch.stack(h).movedim(0, dim)
