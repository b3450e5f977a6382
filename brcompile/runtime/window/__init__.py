"""Cross-call windows (docs/ARCHITECTURE.md §7.1): a prefix shared by calls of one window is computed once, forward
and backward, whichever calls its rows arrive in.

A **window** is the calls of each streamed graph between two optimizer steps, declared by :func:`window`
(``with brcompile.window(calls=N):`` around a gradient-accumulation loop, or ``last=`` a predicate of the last
call; ``BranchReplayCallback`` opens one per optimizer step). Inside it, each call of a graph with a streaming
split (``mode="replay"``/``"auto"``, passes/emit/split.py, a ``tail_cache``) runs its trunk through
:class:`WindowFunction` instead of :class:`~brcompile.runtime.streaming.ReplayFunction`.

The package: ``store`` (the window, its stores and pieces, the deferred backward), ``plan`` (matching a call's
tokens against the store and cutting its tree there), ``function`` (one call's run: :class:`WindowFunction`).


forward
    The call's packed tokens are matched against every token an earlier call of the window computed: two tokens
    are the same node iff their rows agree on every tree key up to them (one exact prefix tree over all the
    window's rows so far, ``build_tree``). The matched ones (an ancestor-closed set: a prefix of the call's tree)
    are **replayed** from the window's store: their frontier values and their cached values (every attention's
    K/V, every tree scan's per-token state or taps, cached positions), gathered, never recomputed. The others run
    once, with grad, as one chunk against that cache (``tail_cache``: the tail graph that also returns its own
    cached values; its scans start from the stored states of their replayed ancestors, ``WindowPlan.ancestors``);
    the first call of a window runs the prefix graph on all of its tokens. What they
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
rows), or with ``max_bytes`` / a checkpointed model only its outputs (recomputed in that backward).
"""
from brcompile.runtime.window.function import (
    WindowFunction, call_keys, current_call, finish_if_complete,
)
from brcompile.runtime.window.plan import WindowPlan, match, plan_window
from brcompile.runtime.window.store import (
    HISTORY, Window, WindowError, active_window, call_identity, closed_windows, window,
)

__all__ = ["HISTORY", "Window", "WindowError", "WindowFunction", "WindowPlan", "active_window", "call_identity",
           "call_keys", "closed_windows", "current_call", "finish_if_complete", "match", "plan_window", "window"]
