"""``brcompile::read_packed``: dense reads of packed values (docs/ARCHITECTURE.md §6).

A packed graph computes each prefix-tree node once, ``[N, ...]``; the dense side of the graph (the loss,
anything the analysis could not keep packed) reads it back at every logical position ``(b, t)`` through the
tree's ``index[b, t]``. ``index == -1`` marks a position that ``drop_padding=True`` left out of the tree:
the read gives 0 there, and a nonzero gradient flowing back there raises ``DroppedPositionGradError``.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["DroppedPositionGradError", "check_dropped_grad", "dropped_grads_unchecked", "read_packed"]

_CHECKING = [True]  # False inside dropped_grads_unchecked()


class DroppedPositionGradError(RuntimeError):
    """A nonzero gradient reached a dense position that :func:`drop_padding` left out of the tree.

    Dropped positions read as 0 in the packed graph; their true values (the model's outputs at padding)
    were never computed, so a loss that depends on them has no exact gradient."""


# ---------------------------------------------------------------------------------------------------------
# dense reads of packed values: index -1 reads 0, and no gradient may flow there


@contextlib.contextmanager
def dropped_grads_unchecked():
    """Within the block a gradient at a left-out position is not checked: for measuring the FLOPs of a packed
    graph's backward under a gradient of ones (brcompile/tools/explain.py), never for training."""
    _CHECKING.append(False)
    try:
        yield
    finally:
        _CHECKING.pop()


def check_dropped_grad(grad: Tensor, dropped: Tensor, where: str) -> None:
    """Raise DroppedPositionGradError unless ``grad`` is exactly 0 at every dropped position.

    ``dropped``: bool, the leading dims of ``grad`` (one entry per dense position); ``grad`` may have
    trailing dims (a position counts once however many of its entries are nonzero; NaN counts). One host
    synchronisation, plus one more when some position is dropped."""
    if not _CHECKING[-1]:
        return
    n_dropped = int(dropped.sum())
    if n_dropped == 0:
        return
    at_dropped = grad[dropped].reshape(n_dropped, -1)
    bad = int((at_dropped != 0).any(dim=1).sum())
    if bad:
        raise DroppedPositionGradError(
            f"{where}: the gradient is nonzero at {bad} of the {n_dropped} padded position(s) that "
            f"drop_padding=True left out of the tree; the loss reads padded positions: multiply by the mask "
            f"(attention/completion mask) or use drop_padding=False")


def read_packed(data: Tensor, index: Tensor, cols: Optional[Tensor] = None) -> Tensor:
    """Dense reads of packed rows, 0 where ``index`` is -1 (a position drop_padding left out).

    Without ``cols``: ``out[i] = data[index[i]]`` for ``data [N, ...]`` (shape ``index.shape +
    data.shape[1:]``). With ``cols`` (``index.shape + (J,)``, int64) and ``data [N, V]``:
    ``out[i, j] = data[index[i], cols[i, j]]``. Backward (in ``data``): a scatter-add over the kept
    positions, after checking that the gradient is exactly 0 at every dropped one
    (DroppedPositionGradError otherwise). Registered as ``brcompile::read_packed`` (opaque to Inductor,
    so the check runs inside a compiled backward too)."""
    return torch.ops.brcompile.read_packed(data, index, cols)


def _check_read_args(data: Tensor, index: Tensor, cols: Optional[Tensor]) -> None:
    """Shapes and dtypes of read_packed (fake-tensor safe)."""
    if index.dtype != torch.int64:
        raise TypeError(f"read_packed: index must be int64, got {index.dtype}")
    if data.dim() < 1:
        raise ValueError("read_packed: data must have a leading packed-token dim")
    if cols is not None:
        if cols.dtype != torch.int64 or data.dim() != 2 or cols.dim() != index.dim() + 1 \
                or cols.shape[:-1] != index.shape:
            raise ValueError(f"read_packed: cols must be int64 of shape index.shape + (J,) with data [N, V]; "
                             f"got data {tuple(data.shape)}, index {tuple(index.shape)}, cols "
                             f"{tuple(cols.shape)} {cols.dtype}")


def _read_shape(data: Tensor, index: Tensor, cols: Optional[Tensor]) -> tuple:
    return tuple(cols.shape) if cols is not None else tuple(index.shape) + tuple(data.shape[1:])


def _safe_indices(index: Tensor, cols: Optional[Tensor]) -> tuple:
    """(kept, rows[, cols]): the mask of kept positions and indices that are in range everywhere (row 0,
    column 0 at dropped positions)."""
    kept = index >= 0
    rows = index.clamp(min=0)
    if cols is None:
        return kept, (rows,)
    return kept, (rows.unsqueeze(-1).expand_as(cols), torch.where(kept.unsqueeze(-1), cols, 0))


@torch.library.custom_op("brcompile::read_packed", mutates_args=())
def _read_packed_op(data: Tensor, index: Tensor, cols: Optional[Tensor]) -> Tensor:
    """See :func:`read_packed`."""
    _check_read_args(data, index, cols)
    shape = _read_shape(data, index, cols)
    if data.shape[0] == 0:  # every position dropped: nothing to read
        return data.new_zeros(shape)
    kept, where = _safe_indices(index, cols)
    out = data[where]
    return out.masked_fill_(~kept.reshape(kept.shape + (1,) * (out.dim() - kept.dim())), 0)


@_read_packed_op.register_fake
def _read_packed_fake(data, index, cols):
    _check_read_args(data, index, cols)
    return data.new_empty(_read_shape(data, index, cols))


@torch.library.custom_op("brcompile::read_packed_backward", mutates_args=())
def _read_packed_backward_op(grad: Tensor, index: Tensor, cols: Optional[Tensor],
                             data_shape: Sequence[int]) -> Tensor:
    """d(read_packed)/d(data) for the upstream ``grad``: checks the dropped positions, then
    ``ddata[index[i](, cols[i, j])] += grad[i(, j)]`` (accumulating: a token read by several positions
    sums their gradients), as one ``index_add_`` over rows (with ``cols``: over the flat ``[N * V]`` entries
    ``index * V + cols``); a dropped position adds its gradient, checked to be 0, to row 0."""
    check_dropped_grad(grad, index < 0, "read_packed backward")
    out = grad.new_zeros(data_shape)
    if out.shape[0] == 0 or grad.numel() == 0:
        return out
    _, where = _safe_indices(index, cols)
    if cols is None:
        return out.index_add_(0, where[0].flatten(), grad.reshape((-1,) + tuple(out.shape[1:])))
    flat = (where[0] * out.shape[1] + where[1]).flatten()
    return out.view(-1).index_add_(0, flat, grad.flatten()).view(out.shape)


@_read_packed_backward_op.register_fake
def _read_packed_backward_fake(grad, index, cols, data_shape):
    return grad.new_empty(data_shape)


def _read_packed_setup(ctx, inputs, output):
    data, index, cols = inputs
    ctx.save_for_backward(index, cols)
    ctx.data_shape = list(data.shape)


def _read_packed_grad(ctx, grad):
    index, cols = ctx.saved_tensors
    return torch.ops.brcompile.read_packed_backward(grad, index, cols, ctx.data_shape), None, None


torch.library.register_autograd("brcompile::read_packed", _read_packed_grad, setup_context=_read_packed_setup)
