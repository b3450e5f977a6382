"""``brcompile::gather_tokens``: context parallelism's one collective (docs/ARCHITECTURE.md §7.2).

Under ``context_parallel`` the packed token axis (depth-first order) is cut into contiguous pieces, one per rank
of the group: rank ``i`` holds tokens ``[o_i, o_i + sizes[i])`` with ``o_i = sizes[0] + … + sizes[i-1]``. A value
computed per token is held in pieces, ``x_i`` (``sizes[i]`` entries along ``dim``) on rank ``i``.

    gather_tokens(x_i, like, sizes, dim, group) = concat(x_0, …, x_{R-1})[:P]   along dim, P = like.shape[0]

the first P tokens of the whole axis: the K/V of every token before the rank's own (``P = o_r``: a tree query's
keys are its ancestors, which in depth-first order all come before it), or the whole axis (``P = N``: the frontier
the replicated outer graph reads).

The gradient is a partial sum on every rank (the context-parallel contract: the group's sum is the gradient).
The whole-axis gradient is the sum of the ranks' gradients ``g_j`` [P]; rank i's piece of it is

    dx_i = sum_j g_j[o_i : o_i + sizes[i]]      (entries past P are 0)

one reduce-scatter (sum) over the group. Both collectives are torch's functional collectives (gloo on CPU, NCCL on
CUDA), inside an opaque custom op with a fake impl, so the op sits in a graph ``torch.compile`` compiles.

Every rank of the group must call it, in the same order: forward and backward are collectives. A compiler may
reorder independent ops, and the ranks' graphs differ where shapes are specialised (rank 0 gathers 0 tokens), so
the order is made a data dependency: each gather takes the previous one's ``done`` (a 0-dim tensor; the first takes
any tensor) and returns its own, and its backward returns a zero gradient for ``after``, which the previous gather's
backward then reads: forward in program order, backward in reverse, whatever the scheduler does.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["exchange_tokens", "gather_tokens"]


def gather_tokens(x: Tensor, like: Tensor, sizes: Tensor, dim: int, group: str,
                  after: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(the first ``like.shape[0]`` tokens of the group's whole token axis along ``dim``, ``done``) (module
    docstring); ``sizes``: int64 [R] tokens per rank (on the CPU), ``group``: the process group's name, ``after``:
    the previous gather's ``done`` (None: ``sizes``)."""
    return torch.ops.brcompile.gather_tokens(x, like, sizes, dim, group, sizes if after is None else after)


def _funcol():
    import torch.distributed._functional_collectives as fc

    return fc


def _rank(group: str) -> int:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_rank(_resolve_process_group(group))


def _check(x: Tensor, like: Tensor, sizes: Tensor, dim: int) -> None:
    """Shapes and dtypes (fake-tensor safe)."""
    if sizes.dtype != torch.int64 or sizes.dim() != 1:
        raise ValueError(f"gather_tokens: sizes must be int64 [R], got {sizes.dtype} {tuple(sizes.shape)}")
    if not 0 <= dim < x.dim() or like.dim() < 1:
        raise ValueError(f"gather_tokens: dim={dim} out of range for x {tuple(x.shape)}, or like is a scalar")


def _out_shape(x: Tensor, tokens, dim: int) -> list:
    """``x``'s shape with ``tokens`` along ``dim``."""
    shape = list(x.shape)
    shape[dim] = tokens
    return shape


def _done(x: Tensor) -> Tensor:
    """The 0-dim ``done`` of a gather (module docstring), in ``x``'s dtype so that it carries a gradient."""
    return x.new_zeros(()) if x.is_floating_point() else torch.zeros((), dtype=torch.float32, device=x.device)


@torch.library.custom_op("brcompile::gather_tokens", mutates_args=())
def _gather_tokens(x: Tensor, like: Tensor, sizes: Tensor, dim: int, group: str,
                   after: Tensor) -> tuple[Tensor, Tensor]:
    """See :func:`gather_tokens`."""
    _check(x, like, sizes, dim)
    counts = sizes.tolist()
    width, p = max(counts), int(like.shape[0])
    rows = x.movedim(dim, 0)
    padded = rows.new_zeros((width, *rows.shape[1:]))
    padded[:rows.shape[0]] = rows
    fc = _funcol()
    gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor  # the name of torch >= 2.13
    whole = fc.wait_tensor(gather(padded.contiguous(), 0, group))  # [R * width, ...]
    pieces = [whole[i * width:i * width + c] for i, c in enumerate(counts)]
    return torch.cat(pieces)[:p].movedim(0, dim).contiguous(), _done(x)


@_gather_tokens.register_fake
def _gather_tokens_fake(x, like, sizes, dim, group, after):
    _check(x, like, sizes, dim)
    return x.new_empty(_out_shape(x, like.shape[0], dim)), _done(x)


@torch.library.custom_op("brcompile::gather_tokens_backward", mutates_args=())
def _gather_tokens_backward(grad: Tensor, grad_done: Optional[Tensor], x: Tensor, after: Tensor, sizes: Tensor,
                            dim: int, group: str) -> tuple[Tensor, Tensor]:
    """(``dx``, ``d after``) of :func:`gather_tokens` (module docstring: one reduce-scatter, sum; ``d after`` zero,
    the order's dependency); ``x`` and ``after`` give their shapes, ``grad_done`` (the next gather's zero) orders
    this backward after that gather's."""
    counts = sizes.tolist()
    width, r = max(counts), _rank(group)
    rows = grad.movedim(dim, 0)
    whole = rows.new_zeros((len(counts) * width, *rows.shape[1:]))
    start = 0
    for i, c in enumerate(counts):
        stop = min(start + c, rows.shape[0])
        if stop > start:
            whole[i * width:i * width + stop - start] = rows[start:stop]
        start += c
    fc = _funcol()
    scatter = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor  # torch >= 2.13's name
    mine = fc.wait_tensor(scatter(whole.contiguous(), "sum", 0, group))  # [width, ...]
    return mine[:counts[r]].movedim(0, dim).contiguous().to(x.dtype), torch.zeros_like(after)


@_gather_tokens_backward.register_fake
def _gather_tokens_backward_fake(grad, grad_done, x, after, sizes, dim, group):
    return torch.empty_like(x), torch.empty_like(after)


def _setup(ctx, inputs, output):
    x, like, sizes, dim, group, after = inputs
    ctx.save_for_backward(x, sizes, after)
    ctx.dim, ctx.group, ctx.tokens = dim, group, like.shape[0]


def _backward(ctx, grad, grad_done):
    x, sizes, after = ctx.saved_tensors
    if not x.is_floating_point():
        return None, None, None, None, None, None
    if grad is None:  # the tokens unused, the order still kept: every rank runs the collective
        grad = x.new_zeros(_out_shape(x, ctx.tokens, ctx.dim))
    dx, dafter = torch.ops.brcompile.gather_tokens_backward(grad, grad_done, x, after, sizes, ctx.dim, ctx.group)
    return dx, None, None, None, None, dafter if after.is_floating_point() else None


_gather_tokens.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------------------------------------
# exchange_tokens: each rank receives only the earlier tokens its queries see


def exchange_tokens(x: Tensor, like: Tensor, send_index: Tensor, send_sizes: Tensor, recv_sizes: Tensor, dim: int,
                    group: str, after: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(``x`` at the tokens this rank needs from the others, in their global order, ``done``).

    Rank q sends rank r the tokens of its piece that r needs: ``x_q[send_index]`` cut by ``send_sizes`` (local ids,
    rank by rank); rank r receives ``recv_sizes[q]`` tokens from each q, in rank order, which is their global order
    (the pieces are contiguous and in rank order): ``like.shape[0] = sum(recv_sizes)`` tokens. One all-to-all; the
    backward is the reverse all-to-all, each token's gradient summed over the ranks it was sent to
    (``index_add`` at ``send_index``). ``after``/``done`` order the collectives as for :func:`gather_tokens`."""
    return torch.ops.brcompile.exchange_tokens(x, like, send_index, send_sizes, recv_sizes, dim, group,
                                               send_sizes if after is None else after)


def _all_to_all(rows: Tensor, out_sizes: list, in_sizes: list, group: str) -> Tensor:
    fc = _funcol()
    return fc.wait_tensor(fc.all_to_all_single(rows.contiguous(), out_sizes, in_sizes, group))


@torch.library.custom_op("brcompile::exchange_tokens", mutates_args=())
def _exchange_tokens(x: Tensor, like: Tensor, send_index: Tensor, send_sizes: Tensor, recv_sizes: Tensor, dim: int,
                     group: str, after: Tensor) -> tuple[Tensor, Tensor]:
    """See :func:`exchange_tokens`."""
    rows = x.movedim(dim, 0).index_select(0, send_index.to(x.device))
    got = _all_to_all(rows, recv_sizes.tolist(), send_sizes.tolist(), group)
    if got.shape[0] != like.shape[0]:
        raise ValueError(f"exchange_tokens: received {got.shape[0]} tokens for {like.shape[0]}")
    return got.movedim(0, dim).contiguous(), _done(x)


@_exchange_tokens.register_fake
def _exchange_tokens_fake(x, like, send_index, send_sizes, recv_sizes, dim, group, after):
    _check(x, like, send_sizes, dim)
    return x.new_empty(_out_shape(x, like.shape[0], dim)), _done(x)


@torch.library.custom_op("brcompile::exchange_tokens_backward", mutates_args=())
def _exchange_tokens_backward(grad: Tensor, grad_done: Optional[Tensor], x: Tensor, after: Tensor,
                              send_index: Tensor, send_sizes: Tensor, recv_sizes: Tensor, dim: int,
                              group: str) -> tuple[Tensor, Tensor]:
    """(``dx``, ``d after``) of :func:`exchange_tokens`: the reverse all-to-all, summed at ``send_index``."""
    back = _all_to_all(grad.movedim(dim, 0), send_sizes.tolist(), recv_sizes.tolist(), group)
    rows = x.movedim(dim, 0)
    dx = torch.zeros(rows.shape, dtype=grad.dtype, device=grad.device).index_add_(0, send_index.to(grad.device), back)
    return dx.movedim(0, dim).contiguous().to(x.dtype), torch.zeros_like(after)


@_exchange_tokens_backward.register_fake
def _exchange_tokens_backward_fake(grad, grad_done, x, after, send_index, send_sizes, recv_sizes, dim, group):
    return torch.empty_like(x), torch.empty_like(after)


def _exchange_setup(ctx, inputs, output):
    x, like, send_index, send_sizes, recv_sizes, dim, group, after = inputs
    ctx.save_for_backward(x, after, send_index, send_sizes, recv_sizes)
    ctx.dim, ctx.group, ctx.tokens = dim, group, like.shape[0]


def _exchange_backward(ctx, grad, grad_done):
    x, after, send_index, send_sizes, recv_sizes = ctx.saved_tensors
    if not x.is_floating_point():
        return (None,) * 8
    if grad is None:  # the tokens unused, the order still kept: every rank runs the collective
        grad = x.new_zeros(_out_shape(x, ctx.tokens, ctx.dim))
    dx, dafter = torch.ops.brcompile.exchange_tokens_backward(grad, grad_done, x, after, send_index, send_sizes,
                                                              recv_sizes, ctx.dim, ctx.group)
    return dx, None, None, None, None, None, None, dafter if after.is_floating_point() else None


_exchange_tokens.register_autograd(_exchange_backward, setup_context=_exchange_setup)
