"""Splits that keep their input whole: the whole piece read as the input itself (docs/ARCHITECTURE.md §3.1).

transformers 5.25's scan wrappers (``mamba_scan_forward``, ``mamba2_scan_forward``, the gated delta rules of
Qwen3-Next / Kimi-Linear, ...) split every input of the chunked scan at the positions a cache keeps for
sequential decoding:

    chunked_x, sequential_x = torch.tensor_split(x, [seq_len - num_intermediate_recurrent_states], dim=1)

Without a cache the split is at ``seq_len``: ``chunked_x`` is all of ``x`` and ``sequential_x`` is empty (read
by a loop that runs zero times). The token-axis rules refuse a split along a token dim, and the scan
recognisers (passes/canonical/scans/linear.py, passes/canonical/scans/ssd.py, passes/canonical/scans/delta_rule.py) would see the piece, not
``x``. :func:`drop_identity_splits` reads each ``getitem`` of the whole piece as ``x`` itself (the piece is a
view of ``x`` with its shape and values; the graph is functional here, so no write can tell them apart).
The other pieces, when read, keep the split (then refused as before). A piece is whole when the split's
boundaries along ``dim`` are each 0 or at least the extent (provably, for symbolic sizes): ``tensor_split``
at such indices or into 1 section, ``split`` with a size of at least the extent or with sizes that are the
extent and zeros, ``chunk`` into 1.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from brcompile.passes.analysis.axes import example_value
from brcompile.passes.spellings import SPLITS

__all__ = ["drop_identity_splits", "whole_piece"]

_SIZE_KWARGS = ("indices_or_sections", "indices", "sections", "tensor_indices_or_sections",
                "split_size_or_sections", "split_size", "split_sizes", "chunks")


def _known(cond: Any) -> bool:
    return bool(cond) if isinstance(cond, bool) else statically_known_true(cond)


def _int(v: Any) -> Any:
    """An int or SymInt (an FX node's example value), else None."""
    v = example_value(v) if isinstance(v, fx.Node) else v
    return v if isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool) else None


def _ints(v: Any) -> Optional[list]:
    if not isinstance(v, (list, tuple)):
        return None
    out = [_int(e) for e in v]
    return None if any(e is None for e in out) else out


def whole_piece(node: fx.Node) -> Optional[int]:
    """The index of the piece of split/chunk ``node`` that is its whole input, or None."""
    kind = SPLITS.get(node.target) if node.op in ("call_function", "call_method") else None
    if kind is None or not node.args:
        return None
    x = example_value(node.args[0])
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    sizes = node.args[1] if len(node.args) > 1 else next((node.kwargs[k] for k in _SIZE_KWARGS if k in node.kwargs),
                                                         None)
    dim = _int(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0))
    if sizes is None or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        return None
    n = x.shape[dim]
    if _known(n == 0):
        return None
    count = _int(sizes)
    if kind == "chunk" or (kind == "tensor_split" and count is not None):
        return 0 if count is not None and _known(count == 1) else None
    if kind == "split" and count is not None:
        return 0 if _known(count >= n) else None
    parts = _ints(sizes)
    if parts is None:
        return None
    if kind == "split":  # sizes: one is the extent, the others 0
        whole = [i for i, s in enumerate(parts) if _known(s == n)]
        return whole[0] if len(whole) == 1 and all(_known(s == 0) for i, s in enumerate(parts) if i != whole[0]) \
            else None
    bounds = []  # tensor_split at indices: each boundary 0 or at least the extent (clamped to it)
    for i in parts:
        if _known(i == 0):
            bounds.append(0)
        elif _known(i >= n):
            bounds.append(1)
        else:
            return None
    edges = [0, *bounds, 1]
    whole = [j for j in range(len(edges) - 1) if edges[j] == 0 and edges[j + 1] == 1]
    return whole[0] if len(whole) == 1 else None


def drop_identity_splits(gm: fx.GraphModule) -> int:
    """Read every ``getitem`` of a split's whole piece as the split's input (module docstring), in place;
    splits left unread are erased. Returns the number of pieces replaced."""
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        j = whole_piece(node)
        if j is None:
            continue
        for u in list(node.users):
            if (u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                    and u.args[1] in (j, j - len(example_value(node) or ()))):
                u.replace_all_uses_with(node.args[0])
                graph.erase_node(u)
                done += 1
        if not node.users:
            graph.erase_node(node)
    if done:
        graph.lint()
        gm.recompile()
    return done
