"""One window call's run: :class:`WindowFunction` replays the tokens an earlier call computed, computes the rest
once, and defers the shared part's backward to the window's last call (package docstring)."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from brcompile.runtime.stats import _record
from brcompile.runtime.tree import TokenArrays
from brcompile.runtime.window.plan import WindowPlan, _stored, _take, match, plan_window
from brcompile.runtime.window.store import (
    Window, WindowError, _add, _apply_to_grad, _deferred_backward, _leaf_state, _Piece, _Store,
)

__all__ = ["WindowFunction", "call_keys", "current_call", "finish_if_complete"]

# ------------------------------------------------------------------------------------------------- one call's run

#: the call's store and tree keys, set by the packed runtime around a streamed call (runtime/packed.py)
_CALL = threading.local()


@contextlib.contextmanager
def call_keys(store: _Store, per_token: Sequence[Tensor], mask: Optional[Tensor], tree) -> Any:
    """Let the trunk of this call see its window store, tree keys, key padding and packed tree (for matching)."""
    _CALL.value = (store, per_token, mask, tree)
    try:
        yield
    finally:
        _CALL.value = None


def current_call() -> Optional[tuple]:
    return getattr(_CALL, "value", None)


class WindowFunction(torch.autograd.Function):
    """A window call's trunk: replayed tokens from the store, new ones computed once (module docstring)."""

    @staticmethod
    def forward(ctx, graphs, store: _Store, call: tuple, n_ext: int, *inputs):
        ext, tree = inputs[:n_ext], TokenArrays(*inputs[n_ext:])
        per_token, mask, packed_tree = call
        store.check_versions(ext)
        cached, slots, reps = match(store, per_token, mask, packed_tree)
        _check_closed(tree.end, cached)
        plan = plan_window(tree.end, tree.segments, cached, slots, graphs.scan_depth)
        dev = tree.position.device
        dims = graphs.frontier_dims
        leaves = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, Tensor) else x for x in ext]
        new = plan.new_ids.to(dev)
        piece = None
        if new.numel():
            piece = _compute(graphs, store, plan, leaves, ext, tree, new)
        outs = _assemble(store, plan, piece, tree, dims, dev)
        if piece is not None:
            b = torch.div(_take(reps, new), per_token[0].shape[1], rounding_mode="floor") + store.rows
            store.slot_row.append(b.cpu())
            store.slot_t.append((_take(reps, new) % per_token[0].shape[1]).cpu())
            store.pieces.append(piece)
            store.window.peak_bytes = max(store.window.peak_bytes, store.window.kept_bytes)
        store.keys.append([k.detach() for k in per_token])
        B, L = per_token[0].shape[:2]
        store.masks.append(torch.ones(B, L, dtype=torch.bool, device=per_token[0].device) if mask is None
                           else mask.to(torch.bool))
        store.rows += int(B)
        store.forwards += 1
        store.replayed_tokens += int(plan.cached_ids.numel())
        store.computed_tokens += int(new.numel())
        _record(window_replayed_tokens=int(plan.cached_ids.numel()),
                **{"window_calls" if store.grad else "window_no_grad_calls": 1})
        ctx.store, ctx.plan, ctx.dims, ctx.piece = store, plan, dims, piece
        ctx.ext_ids = [id(x) for x in ext]
        ctx.used = False
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.used:
            raise WindowError("brcompile.window: a second backward through a window call (retain_graph=True or "
                              "torch.autograd.grad twice) is not supported; compile with mode='packed'")
        ctx.used = True
        store, plan, dims = ctx.store, ctx.plan, ctx.dims
        _check_accumulates(store, ctx.ext_ids)
        for f, (g, d) in enumerate(zip(grads, dims)):
            if g is None:
                continue
            if ctx.piece is not None:
                _add(ctx.piece.pending_frontier, f, g.index_select(d, plan.new_ids.to(g.device)), owned=True)
            if plan.cached_ids.numel():
                _scatter_to_pieces(store, f, g.index_select(d, plan.cached_ids.to(g.device)), plan.slots, d)
        store.backwards += 1
        n_in = len(ctx.ext_ids)
        w = store.window
        if not w.complete:
            return (None, None, None, None, *([None] * n_in), *([None] * len(TokenArrays._fields)))
        grads_by_id: dict[int, Tensor] = {}
        _record(windows=1)
        for st in w.stores.values():  # every graph's store of the window, in this last backward
            if st.pending:
                for key, g in _deferred_backward(st).items():
                    grads_by_id[key] = g if key not in grads_by_id else grads_by_id[key] + g
                st.done = True
        out = [grads_by_id.pop(i, None) for i in ctx.ext_ids]
        for st in w.stores.values():  # parameters this call does not read (another graph's): into .grad
            _apply_to_grad(st, {k: grads_by_id.pop(k) for k in list(grads_by_id) if k in st.versions})
        return (None, None, None, None, *out, *([None] * len(TokenArrays._fields)))


def _check_accumulates(store: _Store, ext_ids: Sequence[int]) -> None:
    """WindowError unless this backward accumulates into the ``.grad`` of every parameter the call read.

    A window defers the shared prefixes' parameter gradients to the backward of its last call, which puts them in
    ``.grad``: a ``torch.autograd.grad`` over a window call (or ``backward(inputs=...)`` leaving a parameter out)
    would return that call's gradients without them, a silently partial gradient. The engine says whether it will
    run a leaf's ``AccumulateGrad`` (torch.autograd.graph's own test for multi-grad hooks); under
    ``torch.autograd.grad`` it refuses to say, which is the answer too."""
    will_run = getattr(torch._C, "_will_engine_execute_node", None)
    if will_run is None:
        return
    for key in ext_ids:
        seen = store.versions.get(key)
        if seen is None or seen[0].grad_fn is not None:
            continue
        try:
            runs = will_run(torch.autograd.graph.get_gradient_edge(seen[0]).node)
        except RuntimeError:  # "... currently running autograd.grad()"
            runs = False
        if not runs:
            raise WindowError(
                "brcompile.window: torch.autograd.grad (or backward(inputs=...) without every parameter) over a "
                "call of a window: the shared prefixes' gradients reach .grad only, in the backward of the window's "
                "last call; call loss.backward() for each call, or run this loop outside brcompile.window")


def _check_closed(end: Tensor, cached: Tensor) -> None:
    """WindowError unless the replayed tokens are closed under ancestors (every stored token's ancestors were
    computed by the call that stored it, or earlier)."""
    from brcompile.backends.scan.paths import parent_from_end

    parent = parent_from_end(end.cpu())
    has = parent >= 0
    if bool((cached[has] & ~cached[parent[has]]).any()):
        raise WindowError("internal: a replayed token's ancestor was never computed")


def _compute(graphs, store: _Store, plan: WindowPlan, leaves: list, ext: Sequence, tree: TokenArrays,
             new: Tensor) -> _Piece:
    """Run the call's new tokens once with grad: the prefix graph when nothing is replayed, else the chunk
    against the replayed tokens' cached values (``tail_cache``: K/V, scan values, positions, each gathered along
    its token dim, ``TrunkGraphs.cache_dims``); their outputs become a piece of the store."""
    valid, position = _take(tree.valid, new), _take(tree.position, new)
    nf = len(graphs.frontier_dims)
    w = store.window
    activations = graphs.bytes_per_token * int(new.numel())
    recompute = store.grad and (graphs.recompute or (w.max_bytes is not None
                                                     and w.kept_bytes + activations > w.max_bytes))
    with torch.set_grad_enabled(store.grad):
        if not plan.cached_ids.numel():
            out = graphs.run_kept(graphs.prefix, *leaves, *tree, recompute=recompute)
        else:
            cache = [_stored(store.pieces, lambda p, j=j: p.kv_leaf[j], plan.slots, graphs.cache_dims[j])
                     for j in range(graphs.n_cached)]
            pre_valid = _stored(store.pieces, lambda p: p.valid, plan.slots, 0)
            pre_position = _stored(store.pieces, lambda p: p.position, plan.slots, 0)
            dev = tree.position.device
            chunk = TokenArrays(rep_row=_take(tree.rep_row, new), position=position, end=plan.end.to(dev),
                                valid=valid, all_valid=torch.ones_like(valid), segments=plan.segments.to(dev))
            out = graphs.run_kept(graphs.tail_cache, *leaves, *chunk, *cache, pre_valid, torch.ones_like(pre_valid),
                                  plan.cross.to(dev), pre_position, plan.ancestors.to(dev), recompute=recompute)
    out = tuple(out)
    frontier, kv = out[:nf], out[nf:]
    if recompute:
        store.recomputed_tokens += int(new.numel())
        _record(window_recomputed_tokens=int(new.numel()))
    outputs = sum(x.nbytes for x in out if isinstance(x, Tensor))
    return _Piece(frontier=frontier, kv=kv, kv_leaf=tuple(x.detach().requires_grad_(x.requires_grad) for x in kv),
                  leaves=leaves, ext_ids=[id(x) for x in ext], valid=valid.detach(), position=position.detach(),
                  start=store.slots, pending_frontier=[None] * nf, pending_kv=[None] * len(kv),
                  kept_bytes=outputs + (0 if recompute or not store.grad else activations),
                  leaf_state=tuple(_leaf_state(x) for x in leaves))


def _assemble(store: _Store, plan: WindowPlan, piece: Optional[_Piece], tree: TokenArrays, dims, dev) -> list:
    """The frontier at the call's N tokens: its new tokens' from ``piece``, the replayed ones' from the store."""
    n = tree.end.shape[0]
    outs = []
    for f, d in enumerate(dims):
        like = piece.frontier[f] if piece is not None else store.pieces[0].frontier[f]
        shape = list(like.shape)
        shape[d] = n
        o = like.new_empty(shape)
        if piece is not None:
            o.index_copy_(d, plan.new_ids.to(dev), piece.frontier[f].detach())
        if plan.cached_ids.numel():
            o.index_copy_(d, plan.cached_ids.to(dev),
                          _stored(store.pieces, lambda p, f=f: p.frontier[f].detach(), plan.slots, d))
        outs.append(o)
    return outs


def _scatter_to_pieces(store: _Store, f: int, g: Tensor, slots: Tensor, dim: int) -> None:
    """Add ``g`` (gradients at store ``slots`` along ``dim``) into each owning piece's pending frontier ``f``."""
    slots = slots.to(g.device)
    for p in store.pieces:
        hit = (slots >= p.start) & (slots < p.start + p.size)
        if not bool(hit.any()):
            continue
        sel = hit.nonzero().flatten()
        if p.pending_frontier[f] is None:
            shape = list(g.shape)
            shape[dim] = p.size
            p.pending_frontier[f] = g.new_zeros(shape)
        p.pending_frontier[f].index_add_(dim, slots[sel] - p.start, g.index_select(dim, sel))


def finish_if_complete(w: Window) -> None:
    """The window's deferred backward, into ``.grad``, when its last call ran without the trunk (the original
    graph, a batch sharing too little) and every window call's backward has arrived: no later backward carries it."""
    if not w.complete or not w.pending:
        return
    _record(windows=1)
    for st in w.stores.values():
        if st.pending:
            _apply_to_grad(st, _deferred_backward(st))
            st.done = True
