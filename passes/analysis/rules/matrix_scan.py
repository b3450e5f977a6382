"""The matrix-affine recurrence along the token axis: ``matrix_scan(M, b, dim)`` (docs/ARCHITECTURE.md §3.6).

``matrix_scan(M [..., d, d], b [..., d, e], dim)`` is ``h_t = M_t @ h_{t-1} + b_t`` along batch dim ``dim``
(``h_{-1} = 0``) — what passes/canonical/scans/delta_rule.py makes of a chunked gated delta rule. Along the position dim of
TOKEN operands the dense value at (b, t) is the recurrence over columns 0..t of row b, i.e. over the tree path
of node ``index[b, t]`` (the rows holding a node agree on every column before it, §4): TOKEN, computed by
``brcompile::tree_matrix_scan(M, b, tree_parent(end), pos, impl)`` (``impl``: the backend's ``scan`` option).
Causal and row-independent: the invariant of docs/ARCHITECTURE.md §3.6 holds. Anything else (another dim, operands of different
layouts, a sliced or dense operand, a padding-free batch) is a dense fallback naming what failed;
``drop_padding`` is refused (a kept token's path skips the padding the dense recurrence reads), as for the
other tree scans (passes/analysis/rules/scan.py).
"""
from __future__ import annotations

import logging
from typing import Any

import torch.fx as fx

from brcompile.backends.scan import matrix as _ops
from brcompile.passes.analysis.axes import (
    AxesContext, Window, axis_rule, dense_fallback, example_value, get_axes, normalize_dim, token,
)
from brcompile.passes.analysis.rules.scan import _emit_parent, _path_problem, _refuse_dropped_padding

log = logging.getLogger(__name__)


def _args(node: fx.Node) -> tuple[Any, Any, Any]:
    args = list(node.args) + [None] * 3
    return node.kwargs.get("M", args[0]), node.kwargs.get("b", args[1]), node.kwargs.get("dim", args[2])


def emit_matrix_scan(pk, node: fx.Node):
    """``tree_matrix_scan(M, b, tree_parent(end), pos, impl)`` on the packed operands; ``impl`` is the
    backend's ``scan`` option."""
    _refuse_dropped_padding(pk, node, "matrix scan")
    M, b, _ = _args(node)
    return pk.graph.call_function(_ops.MATRIX_PATH_OPS[0], (pk.packed(M), pk.packed(b), _emit_parent(pk),
                                                            get_axes(node).pos, pk.options.scan))


@axis_rule(emit=emit_matrix_scan)
def matrix_scan(ctx: AxesContext, node: fx.Node):
    """``matrix_scan(M, b, dim)`` along the position dim of TOKEN ``M`` and ``b`` of one layout (the same row
    and position dims among the batch dims, whole windows): TOKEN with that layout (module docstring).
    Anything else: dense, named."""
    M, b, dim = _args(node)
    axes = [get_axes(x) for x in (M, b)]
    if not all(ax.is_token for ax in axes):
        return dense_fallback(ctx, node, "a matrix scan with an operand that is not a token value")
    ndim = example_value(node).dim()
    first = axes[0]
    if any(ax.local or (ax.ndim, ax.row, ax.pos) != (ndim, first.row, first.pos) for ax in axes):
        return dense_fallback(ctx, node, f"a matrix scan of token values with different layouts "
                                         f"({', '.join(str(ax) for ax in axes)})")
    if not isinstance(dim, int) or ndim < 3 or normalize_dim(dim, ndim - 2) != first.pos \
            or (first.row is not None and first.row >= ndim - 2):
        return dense_fallback(ctx, node, f"a matrix scan along dim {dim}, not the token positions ({first.pos})")
    if any(not ax.window.is_whole or type(ax.window) is not Window or ax.window != first.window for ax in axes):
        return dense_fallback(ctx, node, "a matrix scan along the positions of a sliced token value")
    problem = _path_problem(ctx, "matrix scan")
    if problem:
        return dense_fallback(ctx, node, problem)
    return token(ndim, first.row, first.pos, first.window)
