"""The window, its per-graph stores and their pieces, and the deferred backward (package docstring)."""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from brcompile.runtime.stats import _record

log = logging.getLogger(__name__)

__all__ = ["HISTORY", "Window", "WindowError", "active_window", "call_identity", "closed_windows", "window"]


class WindowError(RuntimeError):
    """A window whose deferred backward cannot run as declared (the message names the fix)."""


# ------------------------------------------------------------------------------------------------------ the store

@dataclasses.dataclass
class _Piece:
    """What one call computed: its tokens' graph outputs (frontier, K/V) with their autograd graph, the
    stand-ins later calls read, and the gradients that have reached them so far."""

    frontier: tuple  # trunk outputs the outer graph reads, at this piece's tokens (graph kept)
    kv: tuple  # the cached values at this piece's tokens (graph kept): every attention's K and V, every tree
    #            scan's values (state, path sum, conv input), every cached position (TrunkGraphs.cache_dims)
    kv_leaf: tuple  # detached stand-ins of kv that later calls read (their .grad-free leaves)
    leaves: list  # the parameter stand-ins this piece's graph was built on
    ext_ids: list  # id() of the call's real inputs behind ``leaves``
    valid: Tensor
    position: Tensor
    start: int  # first store slot
    pending_frontier: list
    pending_kv: list
    kept_bytes: int = 0  # outputs, plus activations unless recomputed (Window.kept_bytes)
    leaf_state: tuple = ()  # (version, storage bytes) of each tensor leaf when the piece was computed

    def check_leaves(self) -> None:
        """WindowError if a tensor this piece's graph was built on was written or freed since (a sharded
        data-parallel wrapper that frees or reuses its unsharded parameters between calls): its backward would
        read other values than its forward did."""
        for x, state in zip(self.leaves, self.leaf_state):
            if state is not None and _leaf_state(x) != state:
                raise WindowError(
                    "brcompile.window: a parameter an earlier call of the window computed with was written or freed "
                    "before the window's deferred backward (e.g. FSDP resharding: its unsharded parameters do not "
                    "live across calls); keep the parameters unsharded across the window, or run without a window")

    @property
    def size(self) -> int:
        return int(self.valid.shape[0])


class _Store:
    """One graph's part of a window: the rows it saw, the pieces it computed, which calls are done."""

    def __init__(self, window: "Window", grad: bool = True):
        self.window = window
        self.grad = grad  # grad-mode calls (pieces keep their graphs for the deferred backward), or no-grad ones
        self.keys: list[list[Tensor]] = []  # per call: its tree keys [B, L, ...]
        self.masks: list[Tensor] = []  # per call: its key padding [B, L] (all True without one)
        self.rows = 0
        self.slot_row: list[Tensor] = []  # per piece: the window row of each slot's representative
        self.slot_t: list[Tensor] = []  # ... and its position
        self.pieces: list[_Piece] = []
        self.versions: dict[int, tuple] = {}  # id(input) -> (the tensor, its version when first read)
        self.seen = 0  # calls of the graph in the window (streamed or not: a call may run the original graph)
        self.final = False  # the window's last call of this graph was made (calls reached, or ``last()`` said so)
        self.forwards = 0  # of those, calls whose trunk ran through the window
        self.backwards = 0  # ... and whose backward has arrived
        self.done = False
        self.replayed_tokens = 0
        self.computed_tokens = 0
        self.recomputed_tokens = 0  # of the computed, those whose piece recomputes its activations in backward

    @property
    def slots(self) -> int:
        return sum(p.size for p in self.pieces)

    @property
    def pending(self) -> bool:
        """Whether some call of this window still waits for the deferred backward."""
        return self.grad and bool(self.pieces) and not self.done

    def reset(self) -> None:
        """Forget every row and piece (a no-grad store whose parameters changed: its values are stale)."""
        self.keys, self.masks, self.slot_row, self.slot_t, self.pieces = [], [], [], [], []
        self.rows = 0
        self.versions.clear()


    def check_versions(self, ext: Sequence) -> None:
        """WindowError if an input the pieces were computed from was written since (an optimizer step, a
        parameter update by hand) while their backward is pending."""
        if not self.grad and any(isinstance(x, Tensor) and id(x) in self.versions
                                 and self.versions[id(x)] != (x, x._version) for x in ext):
            log.debug("brcompile.window: a parameter changed between no-grad calls; their store starts over")
            self.reset()
        for x in ext:
            if isinstance(x, Tensor) and (x.requires_grad or not self.grad):
                seen = self.versions.get(id(x))
                if seen is None:
                    self.versions[id(x)] = (x, x._version)
                elif seen[0] is x and seen[1] != x._version and self.pending:
                    raise _written_mid_window(self.window)


def _written_mid_window(window: "Window") -> WindowError:
    """The error for a parameter written while a window's backward is pending (a write a store saw itself, or a
    call whose inputs match a pending store's at other versions, :meth:`Window._written`)."""
    return WindowError("brcompile.window: a parameter was written while the window's shared prefixes still wait for "
                       "their backward; run optimizer.step() (or change parameters) only after the backward of the "
                       f"window's last call (the window ends {window.declared})")


# ------------------------------------------------------------------------------------------------------ the window

#: CPU tensors up to this many elements that need no gradient are compared by value (the numbers Dynamo wraps as
#: 0-d tensors per call)
_BY_VALUE = 64


def _unversioned(ident: tuple) -> tuple:
    """A :func:`call_identity` without the tensors' version counters."""
    return tuple(x[:2] if x[0] == "t" else x for x in ident)


def call_identity(inputs: Sequence) -> tuple:
    """What a window compares, call to call, of the trunk's inputs besides the tree keys: a tensor (a parameter,
    a buffer, a table) by identity and version counter (a write makes another store), a small CPU tensor that
    needs no gradient and anything else (a number Dynamo passed in) by value. A parameter is always compared by
    identity, so a write to one is seen as such however small it is. Conservative: a large table recomputed each
    call is another tensor, so such calls share within themselves only."""
    out = []
    for x in inputs:
        if isinstance(x, Tensor):
            if x.device.type == "cpu" and x.numel() <= _BY_VALUE and not x.requires_grad:
                out.append(("v", x.dtype, tuple(x.shape), tuple(x.detach().flatten().tolist())))
            else:
                out.append(("t", id(x), x._version))
        else:
            out.append(("v", repr(x)))
    return tuple(out)


#: the summaries (:meth:`Window.summary`) of the last windows closed, oldest first, each with its number
#: (``closed``): explain() shows those its run closed
HISTORY: collections.deque = collections.deque(maxlen=64)
_CLOSED = [0]

_ACTIVE: Optional["Window"] = None
_ACTIVE_LOCK = threading.Lock()
_HOOK = None


class Window:
    """The grad-mode calls of each streamed graph, up to an optimizer step, that share their prefixes
    (:func:`window`): ``calls`` of them, or up to the call during which ``last()`` returns True."""

    def __init__(self, calls: Optional[int] = None, last: Optional[Callable[[], bool]] = None,
                 max_bytes: Optional[int] = None):
        if calls is None and last is None:
            raise ValueError("brcompile.window(): say where the window ends: calls=N (the micro-batches of one "
                             "optimizer step) or last=<callable true during the last micro-batch>")
        if calls is not None and calls < 1:
            raise ValueError(f"brcompile.window(calls={calls}): a window holds at least one call")
        self.calls = calls
        self.last = last
        self.max_bytes = max_bytes
        self.peak_bytes = 0  # the most bytes the window kept at once (:attr:`kept_bytes` after each new piece)
        self.stores: dict[int, _Store] = {}
        self.warned = False

    @property
    def declared(self) -> str:
        """Where the window ends, in the user's terms (for messages)."""
        return f"after calls={self.calls}" if self.calls is not None else "at the call during which last() is true"

    def enter_call(self, trunk: Any, grad: bool = True, inputs: Sequence = ()) -> Optional[_Store]:
        """Count one call of the graph whose streaming trunk is ``trunk``; its store in this window (one per trunk
        code, ``TrunkGraphs.window_key``: a graph Dynamo recompiled on a guard shares its copy's; and per grad
        mode), or None once the window's last grad-mode call of the graph was made (the call then shares within
        itself only). No-grad calls (old and reference log-probs) share forward across the whole window: they
        neither count towards its end nor wait for a backward. ``inputs``: what the trunk reads besides the tree
        keys (:func:`call_identity`): calls that differ in them (another model of the same code, a buffer written
        in between) never share a store."""
        # one store per trunk code (recompiled copies share it), grad mode and trunk inputs
        ident = call_identity(inputs)
        key = (trunk.graphs.window_key or id(trunk), grad, ident)
        st = self.stores.get(key)
        if st is None:
            self._written(key)
            st = self.stores[key] = _Store(self, grad)
            st.pinned = [x for x in inputs if isinstance(x, Tensor)]  # their ids stay theirs while the window lives
        if not grad:
            st.seen += 1
            return st
        if st.final:
            if not self.warned:
                self.warned = True
                log.warning("brcompile.window: a grad-mode call of a graph after the window's last one (the window "
                            "ends %s); the extra calls share within themselves only", self.declared)
            return None
        st.seen += 1
        st.final = (self.calls is not None and st.seen >= self.calls) or (self.last is not None and bool(self.last()))
        return st

    def _written(self, key: tuple) -> None:
        """A store for the same trunk inputs at other versions (a parameter or buffer written since): WindowError
        while that store's backward is pending; a stale no-grad store is dropped."""
        unversioned = _unversioned(key[2])
        for other in [k for k in self.stores if k[:2] == key[:2] and _unversioned(k[2]) == unversioned]:
            if self.stores[other].pending:
                raise _written_mid_window(self)
            if not key[1]:
                del self.stores[other]

    @property
    def complete(self) -> bool:
        """Every graph made its last call of the window and every window call's backward arrived: the deferred
        backward may run."""
        return all(st.final and st.backwards == st.forwards for st in self.stores.values() if st.grad)

    @property
    def pending(self) -> bool:
        return any(st.pending for st in self.stores.values())

    @property
    def kept_bytes(self) -> int:
        """Bytes the window's pieces keep: their outputs (frontier, K/V) and, for a pending grad-mode piece not
        recomputed, its activations (the trunk's bytes per token times its tokens)."""
        return sum(p.kept_bytes for st in self.stores.values() if not st.done for p in st.pieces)

    def stats(self) -> dict:
        """Per window: calls and rows seen, tokens replayed from the store, computed and recomputed (over every
        graph), whether a backward is pending and the bytes kept for it."""
        sts = self.stores.values()
        return {"calls": max((st.seen for st in sts if st.grad), default=0),
                "no_grad_calls": max((st.seen for st in sts if not st.grad), default=0),
                "rows": sum(st.rows for st in sts),
                "replayed_tokens": sum(st.replayed_tokens for st in sts),
                "computed_tokens": sum(st.computed_tokens for st in sts),
                "recomputed_tokens": sum(st.recomputed_tokens for st in sts),
                "pending": self.pending, "kept_bytes": self.kept_bytes}

    def __enter__(self) -> "Window":
        global _ACTIVE
        with _ACTIVE_LOCK:
            if _ACTIVE is not None:
                raise WindowError("brcompile.window: windows do not nest (one is already open)")
            _ACTIVE = self
        _install_step_hook()
        return self

    def summary(self) -> dict:
        """What the window did, for explain(): where it ends, :meth:`stats` and the peak bytes it kept."""
        return {"ends": self.declared, **self.stats(), "peak_bytes": self.peak_bytes}

    def __exit__(self, kind, value, tb) -> None:
        global _ACTIVE
        with _ACTIVE_LOCK:
            _ACTIVE = None
        if self.stores:
            _CLOSED[0] += 1
            HISTORY.append({"closed": _CLOSED[0], **self.summary()})
        stores = [st for st in self.stores.values() if st.pending]
        self.stores.clear()  # never hold a window's activations past its end
        if kind is not None:
            return
        missing = [st for st in stores if st.backwards != st.forwards]
        if missing:
            raise WindowError(
                "brcompile.window: the window closed before the backward of its calls: the gradients of its "
                f"shared prefixes were never applied (the window ends {self.declared}; call loss.backward() for each "
                "call inside the window)")
        if stores and torch.distributed.is_available() and torch.distributed.is_initialized():
            raise WindowError(
                "brcompile.window: the window closed before its last call was made (the window ends "
                f"{self.declared}): its shared prefixes' gradients could not run inside the last backward, where "
                "DDP/FSDP synchronise them; declare the number of calls each compiled graph gets in the window")
        if stores:
            _record(windows=1)
        for st in stores:  # fewer calls than declared (or a recompiled graph took some): apply the rest here
            log.warning("brcompile.window: a graph was called %d times in the window, which ends %s; its shared "
                        "prefixes' backward runs at the window's end, into .grad", st.seen, self.declared)
            _apply_to_grad(st, _deferred_backward(st))
            st.done = True


def window(calls: Optional[int] = None, *, last: Optional[Callable[[], bool]] = None,
           max_bytes: Optional[int] = None) -> Window:
    """Declare a cross-call window: the grad-mode calls of each compiled graph up to an optimizer step, e.g. the
    micro-batches of one step. Its end is ``calls`` (the number of calls each graph gets) or ``last`` (a callable
    that is true during the window's last call, read at each call: HF's Trainer and accelerate set
    ``GradientState().sync_gradients`` so)::

        with brcompile.window(calls=len(micro_batches)):
            for mb in micro_batches:
                loss_fn(model, **mb).backward()
        optimizer.step()

    Shared prefixes are computed once, forward and backward, across those calls (graphs compiled with
    ``mode="replay"`` or ``"auto"``); the shared part's backward runs inside the last call's backward.

    ``max_bytes`` bounds what the window keeps for that backward: a call whose new tokens' activations would take
    the kept bytes past it keeps only their outputs (frontier and K/V) and recomputes their forward, with grad, in
    the deferred backward (exact: the same values; one more forward of those tokens). ``stats()`` reports the
    recomputed tokens."""
    return Window(calls, last, max_bytes)


def closed_windows() -> int:
    """How many windows that saw a call have closed in this process (the last ``closed`` in :data:`HISTORY`)."""
    return _CLOSED[0]


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
                          f"call's backward (the window ends {w.declared})")


def _leaf_state(x) -> Optional[tuple]:
    """(version, storage bytes) of a tensor, None for anything else (Piece.check_leaves)."""
    return (x._version, x.untyped_storage().nbytes()) if isinstance(x, Tensor) else None


def _add(acc: list, i: int, g: Optional[Tensor], owned: bool = False) -> None:
    """``acc[i] += g`` in place into a buffer the accumulator owns (``g`` itself when ``owned``: a tensor nothing
    else holds; else a copy of the first gradient, which the engine may share)."""
    if g is None:
        return
    if acc[i] is None:
        acc[i] = g if owned else g.clone()
    else:
        acc[i].add_(g)


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
    for p in pieces:
        p.check_leaves()
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
