"""Cross-call windows (docs/ARCHITECTURE.md §7.1): a prefix shared by calls of one window is computed once, forward
and backward, whichever calls its rows arrive in.

A **window** is ``calls`` grad-mode calls of each streamed graph between two optimizer steps, declared by
:func:`window` (``with brcompile.window(calls=N):`` around a gradient-accumulation loop). Inside it, each call of
a graph with a streaming split (``mode="replay"``/``"auto"``, passes/emit/split.py, attention-only trunk) runs its
trunk through :class:`WindowFunction` instead of :class:`~brcompile.runtime.streaming.ReplayFunction`:

forward
    The call's packed tokens are matched against every token an earlier call of the window computed: two tokens
    are the same node iff their rows agree on every tree key up to them (one exact prefix tree over all the
    window's rows so far, ``build_tree``). The matched ones (an ancestor-closed set: a prefix of the call's tree)
    are **replayed** from the window's store: their frontier values and their K/V, gathered, never recomputed.
    The others run once, with grad, as one chunk against that cache (``tail_cache``: the tail graph that also
    returns its own K/V); the first call of a window runs the prefix graph on all of its tokens. What they
    compute (their graph, frontier and K/V) becomes a new **piece** of the store, which later calls read.
backward
    A call's backward only accumulates the gradients that reach its trunk outputs into the pieces that produced
    them (its own new tokens', and the replayed ones' pieces). When the backward of the window's last call
    arrives, the pieces' own backward runs once, newest piece first: each piece's graph is pulled with (its
    accumulated frontier gradients, its accumulated K/V gradients), which adds the K/V gradients of the older
    pieces it attended and the parameter gradients; those are returned as that call's input gradients, so they
    land in ``.grad`` inside that backward, as one dense backward of all the window's rows would put them.

Exactness: each node is a function of its key path and the parameters only, so every row's trunk outputs are the
ones its own dense run computes; every gradient contribution is computed once and summed (reassociation only).
Parameters must not change inside a window: a write to one (its version counter) or an optimizer step while a
window's backward is pending raises :class:`WindowError`, which names the fix — never a silently missing gradient.
Memory: every piece's activations stay until the window's last backward (the window's distinct tokens, not its
rows).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from brcompile.runtime.stats import _record
from brcompile.runtime.tree import TokenArrays, build_tree

log = logging.getLogger(__name__)

__all__ = ["Window", "WindowError", "WindowFunction", "active_window", "plan_window", "window"]

#: the K/V token dim of tree attention's [H, N, D] operands
_KV_DIM = -2


class WindowError(RuntimeError):
    """A window whose deferred backward cannot run as declared (the message names the fix)."""


# ------------------------------------------------------------------------------------------------------- the plan

@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """One call's split into replayed tokens (``cached_ids``, their store slots) and a chunk of new ones."""

    cached_ids: Tensor  # [C] packed ids (of the call's tree) replayed from the store, ascending
    slots: Tensor  # [C] their store slots
    new_ids: Tensor  # [n] packed ids computed by this call, ascending
    end: Tensor  # [n] chunk-local subtree ends
    segments: Tensor  # [s, 3] chunk-local segments
    cross: Tensor  # [X, 4] (q_start, q_stop, k_start, k_stop): chunk queries x cache-local keys
    ancestors: Tensor  # [0, n]: no scans in a window's trunk


def plan_window(end: Tensor, segments: Tensor, cached: Tensor, slots: Tensor) -> WindowPlan:
    """Cut a call's tree into its replayed part ``cached`` (bool [N], ancestor-closed: within each segment a
    prefix ``[s0, c)``) and the chunk of the rest, as streaming cuts prefix and tails (runtime/streaming.py
    ``plan_replay``), but at any token. With ``b`` = cache-local ids (``before[k]`` replayed tokens before k) and
    ``bn`` = chunk-local ids: a segment's new part ``[c, s1)`` is the chunk segment ``(bn[c], bn[s1], bn[e])``;
    its replayed part ``[s0, c)`` is an ancestor chain of every chunk token in ``[c, e)``: the cross row
    ``(bn[c], bn[e], b[s0], b[c])``. ``slots``: the store slot of every token (-1 for new ones)."""
    from brcompile.runtime.streaming import count_before  # streaming imports this module

    end, segments, cached = end.cpu(), segments.cpu(), cached.cpu()
    before, bn = count_before(cached), count_before(~cached)
    s0, s1, e = segments[:, 0], segments[:, 1], segments[:, 2]
    c = s0 + (before[s1] - before[s0])
    if bool(((bn[s1] - bn[c]) != (s1 - c)).any()):
        raise WindowError("internal: the replayed tokens are not a prefix of each segment")
    new_ids = (~cached).nonzero().flatten()
    part = c < s1
    seg = torch.stack([bn[c[part]], bn[s1[part]], bn[e[part]]], 1)
    rows = (c > s0) & (bn[e] > bn[c])
    cross = torch.stack([bn[c[rows]], bn[e[rows]], before[s0[rows]], before[c[rows]]], 1)
    cached_ids = cached.nonzero().flatten()
    return WindowPlan(cached_ids, slots.cpu()[cached_ids], new_ids, bn[end[new_ids]], seg, cross,
                      torch.empty(0, new_ids.shape[0], dtype=torch.int64))


# ------------------------------------------------------------------------------------------------------ the store

@dataclasses.dataclass
class _Piece:
    """What one call computed: its tokens' graph outputs (frontier, K/V) with their autograd graph, the
    stand-ins later calls read, and the gradients that have reached them so far."""

    frontier: tuple  # trunk outputs the outer graph reads, at this piece's tokens (graph kept)
    kv: tuple  # every attention's K and V at this piece's tokens (graph kept)
    kv_leaf: tuple  # detached stand-ins of kv that later calls attend (their .grad-free leaves)
    leaves: list  # the parameter stand-ins this piece's graph was built on
    ext_ids: list  # id() of the call's real inputs behind ``leaves``
    valid: Tensor
    position: Tensor
    start: int  # first store slot
    pending_frontier: list
    pending_kv: list

    @property
    def size(self) -> int:
        return int(self.valid.shape[0])


class _Store:
    """One graph's part of a window: the rows it saw, the pieces it computed, which calls are done."""

    def __init__(self, window: "Window"):
        self.window = window
        self.calls = window.calls
        self.keys: list[list[Tensor]] = []  # per call: its tree keys [B, L, ...]
        self.masks: list[Tensor] = []  # per call: its key padding [B, L] (all True without one)
        self.rows = 0
        self.slot_row: list[Tensor] = []  # per piece: the window row of each slot's representative
        self.slot_t: list[Tensor] = []  # ... and its position
        self.pieces: list[_Piece] = []
        self.versions: dict[int, tuple] = {}  # id(input) -> (the tensor, its version when first read)
        self.seen = 0  # calls of the graph in the window (streamed or not: a call may run the original graph)
        self.forwards = 0  # of those, calls whose trunk ran through the window
        self.backwards = 0  # ... and whose backward has arrived
        self.done = False
        self.replayed_tokens = 0
        self.computed_tokens = 0

    @property
    def slots(self) -> int:
        return sum(p.size for p in self.pieces)

    @property
    def pending(self) -> bool:
        """Whether some call of this window still waits for the deferred backward."""
        return bool(self.pieces) and not self.done


    def check_versions(self, ext: Sequence) -> None:
        """WindowError if an input the pieces were computed from was written since (an optimizer step, a
        parameter update by hand) while their backward is pending."""
        for x in ext:
            if isinstance(x, Tensor) and x.requires_grad:
                seen = self.versions.get(id(x))
                if seen is None:
                    self.versions[id(x)] = (x, x._version)
                elif seen[0] is x and seen[1] != x._version and self.pending:
                    raise WindowError(
                        "brcompile.window: a parameter was written while the window's shared prefixes still wait "
                        "for their backward; run optimizer.step() (or change parameters) only after the backward "
                        f"of the window's last call (the window was declared with calls={self.calls})")


# ------------------------------------------------------------------------------------------------------ the window

_ACTIVE: Optional["Window"] = None
_ACTIVE_LOCK = threading.Lock()
_HOOK = None


class Window:
    """``calls`` grad-mode calls of each streamed graph that share their prefixes (:func:`window`)."""

    def __init__(self, calls: int):
        if calls < 1:
            raise ValueError(f"brcompile.window(calls={calls}): a window holds at least one call")
        self.calls = calls
        self.stores: dict[int, _Store] = {}
        self.warned = False

    def enter_call(self, trunk: Any) -> Optional[_Store]:
        """Count one grad-mode call of the graph whose streaming trunk is ``trunk``; its store in this window (one
        per trunk code, ``TrunkGraphs.window_key``: a graph Dynamo recompiled on a guard shares its copy's), or
        None once the declared calls are made (the call then shares within itself only)."""
        key = trunk.graphs.window_key or id(trunk)  # one store per trunk code: recompiled copies share it
        st = self.stores.get(key)
        if st is None:
            st = self.stores[key] = _Store(self)
        if st.seen >= self.calls:
            if not self.warned:
                self.warned = True
                log.warning("brcompile.window: more grad-mode calls of a graph than the window's calls=%d; the "
                            "extra calls share within themselves only", self.calls)
            return None
        st.seen += 1
        return st

    @property
    def complete(self) -> bool:
        """Every graph called the declared number of times and every window call's backward arrived: the
        deferred backward may run."""
        return all(st.seen >= self.calls and st.backwards == st.forwards for st in self.stores.values())

    @property
    def pending(self) -> bool:
        return any(st.pending for st in self.stores.values())

    def stats(self) -> dict:
        """Per window: calls made, tokens replayed from the store and tokens computed (over every graph)."""
        return {"calls": max((st.seen for st in self.stores.values()), default=0),
                "replayed_tokens": sum(st.replayed_tokens for st in self.stores.values()),
                "computed_tokens": sum(st.computed_tokens for st in self.stores.values()),
                "pending": self.pending}

    def __enter__(self) -> "Window":
        global _ACTIVE
        with _ACTIVE_LOCK:
            if _ACTIVE is not None:
                raise WindowError("brcompile.window: windows do not nest (one is already open)")
            _ACTIVE = self
        _install_step_hook()
        return self

    def __exit__(self, kind, value, tb) -> None:
        global _ACTIVE
        with _ACTIVE_LOCK:
            _ACTIVE = None
        stores = [st for st in self.stores.values() if st.pending]
        self.stores.clear()  # never hold a window's activations past its end
        if kind is not None:
            return
        missing = [st for st in stores if st.backwards != st.forwards]
        if missing:
            raise WindowError(
                "brcompile.window: the window closed before the backward of its calls: the gradients of its "
                f"shared prefixes were never applied (declared calls={self.calls}; call loss.backward() for each "
                "call inside the window)")
        if stores and torch.distributed.is_available() and torch.distributed.is_initialized():
            raise WindowError(
                "brcompile.window: the window closed before its declared calls were made (calls="
                f"{self.calls}): its shared prefixes' gradients could not run inside the last backward, where "
                "DDP/FSDP synchronise them; declare the number of calls each compiled graph gets in the window")
        for st in stores:  # fewer calls than declared (or a recompiled graph took some): apply the rest here
            log.warning("brcompile.window: a graph was called %d of the declared %d times in the window; its shared "
                        "prefixes' backward runs at the window's end, into .grad", st.seen, self.calls)
            _apply_to_grad(st, _deferred_backward(st))
            st.done = True


def window(calls: int) -> Window:
    """Declare a cross-call window: the next ``calls`` grad-mode calls of each compiled graph, e.g. the
    micro-batches of one optimizer step::

        with brcompile.window(calls=len(micro_batches)):
            for mb in micro_batches:
                loss_fn(model, **mb).backward()
        optimizer.step()

    Shared prefixes are computed once, forward and backward, across those calls (graphs compiled with
    ``mode="replay"`` or ``"auto"``); the shared part's backward runs inside the last call's backward."""
    return Window(calls)


def active_window() -> Optional[Window]:
    """The open window, if any."""
    return _ACTIVE


def _install_step_hook() -> None:
    """Once per process: torch.optim's global step pre-hook refuses a step while a window's backward is pending."""
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK = register_optimizer_step_pre_hook(_refuse_pending_step)


def _refuse_pending_step(optimizer, args, kwargs) -> None:
    w = _ACTIVE
    if w is not None and w.pending:
        raise WindowError("brcompile.window: optimizer.step() while the window's shared prefixes still wait for their "
                          "backward (it runs in the backward of the window's last call); step after the last "
                          f"call's backward (the window was declared with calls={w.calls})")


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


def _padded(x: Tensor, L: int, fill=0) -> Tensor:
    """``x`` [B, l, ...] padded with ``fill`` to [B, L, ...]."""
    if x.shape[1] == L:
        return x
    pad = x.new_full((x.shape[0], L - x.shape[1], *x.shape[2:]), fill)
    return torch.cat([x, pad], 1)


def match(store: _Store, per_token: Sequence[Tensor], mask: Optional[Tensor], tree) -> tuple[Tensor, Tensor, Tensor]:
    """(cached [N] bool, slots [N], reps [N]) for the call's packed tokens: which were computed by an earlier call
    of the window (and where they are stored); ``reps`` the flat (b·L + t) representative of each token. One exact
    prefix tree over the window's rows so far and the call's (``build_tree``): equal node <=> equal key path."""
    B, L = int(per_token[0].shape[0]), int(per_token[0].shape[1])
    m = torch.ones(B, L, dtype=torch.bool, device=per_token[0].device) if mask is None else mask.to(torch.bool)
    flat = tree.index.reshape(-1)
    keep = flat >= 0
    reps = torch.empty(tree.num_tokens, dtype=torch.int64, device=flat.device)
    reps[flat[keep]] = torch.arange(flat.numel(), device=flat.device)[keep]
    n = tree.num_tokens
    if not store.pieces:
        return torch.zeros(n, dtype=torch.bool), torch.full((n,), -1, dtype=torch.int64), reps
    Lw = max([L] + [k[0].shape[1] for k in store.keys])
    keys = [torch.cat([_padded(k[i], Lw) for k in store.keys] + [_padded(per_token[i], Lw)])
            for i in range(len(per_token))]
    masks = torch.cat([_padded(x, Lw, False) for x in store.masks] + [_padded(m, Lw, False)])
    combined = build_tree(keys, attention_mask=masks)
    slot_of = torch.full((combined.num_tokens,), -1, dtype=torch.int64)
    stored = combined.index[torch.cat(store.slot_row), torch.cat(store.slot_t)].cpu()
    slot_of[stored] = torch.arange(stored.shape[0])
    b, t = (reps // L).cpu(), (reps % L).cpu()
    slots = slot_of[combined.index[store.rows + b, t].cpu()]
    return slots >= 0, slots, reps


def _take(x: Tensor, ids: Tensor, dim: int = 0) -> Tensor:
    return x.index_select(dim, ids.to(x.device))


def _stored(pieces: Sequence[_Piece], get, slots: Tensor, dim: int) -> Tensor:
    """The store's values ``get(piece)`` at ``slots`` (pieces concatenated along ``dim`` in slot order)."""
    parts = [get(p) for p in pieces]
    whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    return _take(whole, slots, dim)


class WindowFunction(torch.autograd.Function):
    """A window call's trunk: replayed tokens from the store, new ones computed once (module docstring)."""

    @staticmethod
    def forward(ctx, graphs, store: _Store, call: tuple, n_ext: int, *inputs):
        ext, tree = inputs[:n_ext], TokenArrays(*inputs[n_ext:])
        per_token, mask, packed_tree = call
        store.check_versions(ext)
        cached, slots, reps = match(store, per_token, mask, packed_tree)
        _check_closed(tree.end, cached)
        plan = plan_window(tree.end, tree.segments, cached, slots)
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
        store.keys.append([k.detach() for k in per_token])
        B, L = per_token[0].shape[:2]
        store.masks.append(torch.ones(B, L, dtype=torch.bool, device=per_token[0].device) if mask is None
                           else mask.to(torch.bool))
        store.rows += int(B)
        store.forwards += 1
        store.replayed_tokens += int(plan.cached_ids.numel())
        store.computed_tokens += int(new.numel())
        _record(window_calls=1, window_replayed_tokens=int(plan.cached_ids.numel()))
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
        for f, (g, d) in enumerate(zip(grads, dims)):
            if g is None:
                continue
            if ctx.piece is not None:
                _add(ctx.piece.pending_frontier, f, g.index_select(d, plan.new_ids.to(g.device)))
            if plan.cached_ids.numel():
                _scatter_to_pieces(store, f, g.index_select(d, plan.cached_ids.to(g.device)), plan.slots, d)
        store.backwards += 1
        n_in = len(ctx.ext_ids)
        w = store.window
        if not w.complete:
            return (None, None, None, None, *([None] * n_in), *([None] * len(TokenArrays._fields)))
        grads_by_id: dict[int, Tensor] = {}
        for st in w.stores.values():  # every graph's store of the window, in this last backward
            if st.pending:
                for key, g in _deferred_backward(st).items():
                    grads_by_id[key] = g if key not in grads_by_id else grads_by_id[key] + g
                st.done = True
        out = [grads_by_id.pop(i, None) for i in ctx.ext_ids]
        for st in w.stores.values():  # parameters this call does not read (another graph's): into .grad
            _apply_to_grad(st, {k: grads_by_id.pop(k) for k in list(grads_by_id) if k in st.versions})
        return (None, None, None, None, *out, *([None] * len(TokenArrays._fields)))


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
    against the replayed tokens' K/V (``tail_cache``); their outputs become a piece of the store."""
    valid, position = _take(tree.valid, new), _take(tree.position, new)
    nf = len(graphs.frontier_dims)
    with torch.enable_grad():
        if not plan.cached_ids.numel():
            out = graphs.prefix(*leaves, *tree)
        else:
            cache = [_stored(store.pieces, lambda p, j=j: p.kv_leaf[j], plan.slots, _KV_DIM)
                     for j in range(graphs.n_cached)]
            pre_valid = _stored(store.pieces, lambda p: p.valid, plan.slots, 0)
            pre_position = _stored(store.pieces, lambda p: p.position, plan.slots, 0)
            dev = tree.position.device
            chunk = TokenArrays(rep_row=_take(tree.rep_row, new), position=position, end=plan.end.to(dev),
                                valid=valid, all_valid=torch.ones_like(valid), segments=plan.segments.to(dev))
            out = graphs.tail_cache(*leaves, *chunk, *cache, pre_valid, torch.ones_like(pre_valid),
                                    plan.cross.to(dev), pre_position, plan.ancestors.to(dev))
    out = tuple(out)
    frontier, kv = out[:nf], out[nf:]
    return _Piece(frontier=frontier, kv=kv, kv_leaf=tuple(x.detach().requires_grad_(x.requires_grad) for x in kv),
                  leaves=leaves, ext_ids=[id(x) for x in ext], valid=valid.detach(), position=position.detach(),
                  start=store.slots, pending_frontier=[None] * nf, pending_kv=[None] * len(kv))


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


def _add(acc: list, i: int, g: Optional[Tensor]) -> None:
    if g is not None:
        acc[i] = g if acc[i] is None else acc[i] + g


def _scatter_to_pieces(store: _Store, f: int, g: Tensor, slots: Tensor, dim: int) -> None:
    """Add ``g`` (gradients at store ``slots`` along ``dim``) into each owning piece's pending frontier ``f``."""
    slots = slots.to(g.device)
    for p in store.pieces:
        hit = (slots >= p.start) & (slots < p.start + p.size)
        if not bool(hit.any()):
            continue
        sel = hit.nonzero().flatten()
        shape = list(g.shape)
        shape[dim] = p.size
        part = g.new_zeros(shape).index_add_(dim, slots[sel] - p.start, g.index_select(dim, sel))
        _add(p.pending_frontier, f, part)


def finish_if_complete(w: Window) -> None:
    """The window's deferred backward, into ``.grad``, when its last call ran without the trunk (the original
    graph, a batch sharing too little) and every window call's backward has arrived: no later backward carries it."""
    if not w.complete:
        return
    for st in w.stores.values():
        if st.pending:
            _apply_to_grad(st, _deferred_backward(st))
            st.done = True


def _apply_to_grad(store: _Store, grads: dict[int, Tensor]) -> None:
    """Add deferred gradients (by id of the parameter) into the parameters' ``.grad`` (a window that ended
    without its last call's backward carrying them)."""
    for key, g in grads.items():
        x = store.versions[key][0]
        x.grad = g.detach().clone() if x.grad is None else x.grad + g


def _deferred_backward(store: _Store) -> dict[int, Tensor]:
    """Each piece's backward once, newest first: its graph pulled with its accumulated frontier and K/V gradients,
    adding into older pieces' K/V gradients (the K/V it attended) and into the parameters' (returned by id of the
    real input)."""
    grads: dict[int, Tensor] = {}
    pieces = store.pieces
    for i in range(len(pieces) - 1, -1, -1):
        p = pieces[i]
        outs, gouts = [], []
        for t, g in [*zip(p.frontier, p.pending_frontier), *zip(p.kv, p.pending_kv)]:
            if g is not None and isinstance(t, Tensor) and t.requires_grad:
                outs.append(t)
                gouts.append(g)
        if not outs:
            continue
        wrt_ext = [k for k, x in enumerate(p.leaves) if isinstance(x, Tensor) and x.requires_grad]
        older = [(q, j) for q in range(i) for j, x in enumerate(pieces[q].kv_leaf) if x.requires_grad]
        got = torch.autograd.grad(outs, [p.leaves[k] for k in wrt_ext] + [pieces[q].kv_leaf[j] for q, j in older],
                                  gouts, allow_unused=True)
        for k, g in zip(wrt_ext, got[:len(wrt_ext)]):
            if g is not None:
                key = p.ext_ids[k]
                grads[key] = g if key not in grads else grads[key] + g
        for (q, j), g in zip(older, got[len(wrt_ext):]):
            _add(pieces[q].pending_kv, j, g)
    for p in pieces:  # free the window's graphs
        p.frontier = p.kv = p.kv_leaf = ()
        p.leaves = []
    return grads
