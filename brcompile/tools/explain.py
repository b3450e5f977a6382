"""Reports: what was rewritten, why something fell back, logical vs executed tokens, predicted FLOPs.

``brcompile.explain(fn, *args)`` compiles ``fn`` with a recording branch_replay backend, calls it once and
returns an :class:`ExplainReport`: ``print(report)`` gives plain-text tables, ``report.print()`` the same
tables with rich when it is installed (rich stays optional), ``report.to_dict()`` a JSON-serialisable dict.
``from brcompile.tools.explain import recording``; ``with recording() as rec: ...`` records every ``torch.compile``
inside the block (``python -m brcompile explain script.py`` runs a script that way); ``rec.report()`` then.
(``brcompile.tools.explain`` itself is the function: import the module's other names with ``from brcompile.tools.explain``.)

Per captured graph: rewritten or fell back (the node and the reason), the tree inputs, each attention's
mask, materialisations (packed values turned dense, with their sizes), lazy gathers, fused read-outs, the
brcompile nodes of the packed graph (tree attention, packed gathers, ...) and the packed graph's code.

Per call: rows, logical positions B*L vs executed tokens N, the dedup ratio, tree depth and segments, and
(``measure=True``, the first ``measure_calls`` calls of each graph) the FLOPs and the bytes autograd saves
for backward of one forward+backward, counted by running the *eager* graphs once more on the call's inputs
(:func:`brcompile.tools.measure.measure_fwd_bwd`; the compiled code computes the same graphs):

    dense   = FlopCounterMode over the original (captured) graph: its forward, and its backward (gradient
              of ones for every output that requires grad) w.r.t. every input that requires grad
    packed  = the same over the packed graph, on the call's tree
    limit   = (dense - dense_attention) * N / (B*L) + packed_attention

``packed_attention`` is brcompile::tree_attention's registered formula: every visible (query, key) pair of
the tree once, per query head 4D forward + 10D backward (D the head width). Dense attention is torch's SDPA
formula over the whole s_q x s_k score matrix (no causal discount). Everything but attention (projections,
MLP, LM head) costs the same per position, so over N tokens it costs N/(B*L) of the dense run: the limit is
the cost of computing each distinct tree node once. Only matmul-like ops and attention are counted, as torch's
flop counter does. Bytes saved for backward: distinct storages packed by ``saved_tensors_hooks`` during the
forward, storages of inputs that require grad (parameters) excluded. A graph whose writes are all into fresh
values (HF's ``out[:, :, i] = ...`` into a ``zeros_like``) is measured as its functionalized copy
(passes/lower/functionalize.py: the same values, no write); a graph that mutates its inputs in place is not re-run
(the measurement would apply the mutation again); its calls say so.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from brcompile import runtime
from brcompile.backend import BranchReplayBackend, GraphRecord, branch_replay
from brcompile.backends.read_packed.op import dropped_grads_unchecked
from brcompile.passes.analysis.axes import is_inplace
from brcompile.passes.lower.functionalize import functionalize
from brcompile.runtime.window import HISTORY, closed_windows
from brcompile.tools.measure import limit_flops, measure_fwd_bwd
from brcompile.tools.report import (  # re-exported: the report's tables and renderers are read from here too
    LIMIT_FORMULA, MAX_CALL_ROWS, Code, ExplainReport, Table, code_value, fmt_bytes, fmt_count, fmt_flops, fmt_int,
    fmt_ratio, print_blocks, render_rich, render_text, rich_available, text_table,
)

log = logging.getLogger(__name__)

__all__ = ["ExplainReport", "LIMIT_FORMULA", "MAX_CALL_ROWS", "Code", "RecordingBackend", "Table", "drop_cache_entries",
           "explain", "fmt_bytes", "fmt_count", "fmt_flops", "fmt_int", "fmt_ratio", "mutating_node", "print_blocks",
           "recording", "render_rich", "render_text", "rich_available", "stats_delta", "text_table"]


def mutating_node(gm: fx.GraphModule) -> Optional[str]:
    """The first node of ``gm`` that may mutate a tensor in place (:func:`brcompile.passes.analysis.axes.is_inplace`),
    formatted; None when there is none. A graph that mutates is not re-run to measure it."""
    for n in gm.graph.nodes:
        if n.op in ("call_method", "call_function") and is_inplace(n):
            return n.format_node()
    return None


def _cuda_devices(args: Sequence[Any]) -> list[int]:
    return sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})


class _LoggedRuntime:
    """The callable a :class:`RecordingBackend` returns: runs the backend's runtime, then logs the call.

    Nothing of the runtime is replaced or patched: the call is read from the runtime's own records (its call
    log, ``last_tree``) and from the ``brcompile.stats()`` counters around the call; the cost re-runs the
    runtime's eager graphs (``original``, ``eager_packed`` on the call's tree)."""

    def __init__(self, owner: "RecordingBackend", graph_id: int, rt: Callable):
        self.owner, self.graph_id, self.rt = owner, graph_id, rt
        self.measured = 0

    def __call__(self, *args):
        calls = getattr(self.rt, "calls", None)
        n_logged = len(calls) if calls is not None else 0
        before = runtime.stats()
        out = self.rt(*args)
        entry = self._entry(calls, n_logged, stats_delta(before, runtime.stats()))
        if self.owner.measure and self.measured < self.owner.measure_calls:
            self.measured += 1
            entry["cost"] = self._cost(args, entry)
        self.owner.calls.append(entry)
        return out

    def _entry(self, calls, n_logged: int, delta: runtime.Stats) -> dict:
        if calls is not None and len(calls) > n_logged:
            c = calls[-1]
            return {"graph_id": self.graph_id, "replayed": bool(c.replayed), "reason": c.reason,
                    "code": code_value(getattr(c, "code", None)), "tree": c.tree_stats,
                    "mode": getattr(c, "mode", "packed"),
                    "schedule": getattr(c, "schedule", None)}
        # a runtime without a call log (the original graph) or past its last logged call: the counters
        replayed = delta.replayed_calls > 0
        tree = getattr(self.rt, "last_tree", None)
        reason, code = None, None
        if not replayed:
            reason = next(iter(delta.fallback_reasons), None) or getattr(
                self.rt, "reason", "the runtime ran the original graph")
            code = next(iter(delta.fallback_codes), None) or next(iter(delta.unshared_codes), None) or getattr(
                self.rt, "code", None)
        return {"graph_id": self.graph_id, "replayed": replayed, "reason": reason, "code": code_value(code),
                "tree": None if tree is None or not replayed else tree.stats.to_dict(),
                "mode": "replay" if delta.streamed_calls else "packed"}

    def _packed_args(self, args: tuple) -> Optional[tuple]:
        """The packed graph's arguments of the last call: the call's arguments, then the tree's
        (``PackedTree.graph_args``, as the runtime passes them); None without a tree."""
        tree = getattr(self.rt, "last_tree", None)
        if tree is None:
            return None
        return (*args, *tree.graph_args())

    def _cost(self, args: tuple, entry: dict) -> dict:
        """FLOPs and bytes saved for backward of the eager original graph and, for a replayed (packed-mode)
        call, of the eager packed graph on the same tree; the limit (module docstring)."""
        original = getattr(self.rt, "original", None)
        if original is None:
            return {"skipped": "the runtime has no original graph to re-run"}
        gm = getattr(original, "__self__", None)
        if isinstance(gm, fx.GraphModule) and mutating_node(gm) is not None:
            gm = functionalize(gm)  # writes into fresh values made pure: the same values, nothing mutated
            original = gm.forward
        mutation = mutating_node(gm) if isinstance(gm, fx.GraphModule) else None
        if mutation is not None:
            return {"skipped": f"the graph mutates a tensor in place (`{mutation}`); it is not run again"}
        eager_packed = getattr(self.rt, "eager_packed", None)
        packed_args = None
        if entry["replayed"] and entry.get("mode", "packed") == "packed" and eager_packed is not None:
            packed_args = self._packed_args(args)
        try:
            with torch.random.fork_rng(devices=_cuda_devices(args)):
                dense = measure_fwd_bwd(original, args)
                with dropped_grads_unchecked():  # a gradient of ones reaches the left-out positions too
                    packed = None if packed_args is None else measure_fwd_bwd(eager_packed, packed_args)
        except Exception as e:  # a diagnostic must never break the user's run
            log.warning("explain: measuring graph %d failed", self.graph_id, exc_info=True)
            return {"skipped": f"measuring failed: {type(e).__name__}: {e}"}
        cost = {"backward": dense.backward, "dense_flops": dense.flops,
                "dense_attention_flops": dense.attention_flops, "dense_saved_bytes": dense.saved_bytes}
        if packed is not None:
            cost.update(packed_flops=packed.flops, packed_attention_flops=packed.attention_flops,
                        packed_saved_bytes=packed.saved_bytes)
            tree = entry.get("tree")
            if tree and tree.get("logical_tokens"):
                cost["limit_flops"] = limit_flops(dense, tree["logical_tokens"], tree["executed_tokens"],
                                                  packed.attention_flops)
        return cost


class _Bound:
    """A torch.compile backend: ``RecordingBackend.compile_with(backend, ...)`` for one given backend."""

    def __init__(self, owner: "RecordingBackend", backend: BranchReplayBackend):
        self.owner, self.backend = owner, backend

    def __call__(self, gm: fx.GraphModule, example_inputs, options: Optional[dict] = None):
        return self.owner.compile_with(self.backend, gm, example_inputs, options)


class RecordingBackend:
    """A torch.compile backend that compiles with a :class:`BranchReplayBackend` and logs every call of every
    graph it returns (tree stats; with ``measure``, the predicted cost of the first ``measure_calls`` calls
    of each graph). ``report()`` gives the :class:`ExplainReport` of everything since it was created."""

    def __init__(self, backend: Optional[BranchReplayBackend] = None, *, measure: bool = True,
                 measure_calls: int = 4):
        self.backend = backend if backend is not None else BranchReplayBackend()
        self.measure = measure
        self.measure_calls = measure_calls
        self.graphs: list[GraphRecord] = []
        self.calls: list[dict] = []
        self.left_alone: collections.Counter = collections.Counter()
        self.dropped_options: list[str] = []
        self._stats_before = runtime.stats()
        self._windows_before = closed_windows()

    def __call__(self, gm: fx.GraphModule, example_inputs, options: Optional[dict] = None):
        return self.compile_with(self.backend, gm, example_inputs, options)

    def compile_with(self, backend: BranchReplayBackend, gm: fx.GraphModule, example_inputs,
                     options: Optional[dict] = None):
        """Compiles ``gm`` with ``backend``; the graph's record joins this recording, numbered in order."""
        n = len(backend.records)
        rt = backend(gm, example_inputs, options)
        if len(backend.records) != n + 1:
            raise RuntimeError(f"{type(backend).__name__} kept {len(backend.records) - n} records for one graph")
        rec = backend.records[-1]
        gid = len(self.graphs)
        self.graphs.append(rec if rec.graph_id == gid else dataclasses.replace(rec, graph_id=gid))
        return _LoggedRuntime(self, gid, rt)

    def redirect(self, kwargs: dict, take_over_default: bool = True) -> dict:
        """``torch.compile`` keyword arguments with the backend replaced by this recording when it is
        branch_replay (by name, function or object) or, with ``take_over_default``, the default "inductor"
        (its ``mode``/``options`` are Inductor's, so they are dropped). Other backends are left alone."""
        kwargs = dict(kwargs)
        be = kwargs.get("backend", "inductor")
        if isinstance(be, (RecordingBackend, _Bound)):
            return kwargs
        if isinstance(be, BranchReplayBackend):
            kwargs["backend"] = _Bound(self, be)
        elif be is branch_replay or (isinstance(be, str) and be == "branch_replay"):
            kwargs["backend"] = self
        elif isinstance(be, str) and be == "inductor" and take_over_default:
            dropped = {k: kwargs.pop(k) for k in ("mode", "options") if kwargs.get(k) is not None}
            if dropped:
                self.dropped_options.append(f"{dropped}")
            kwargs["backend"] = self
        else:
            self.left_alone[be if isinstance(be, str) else getattr(be, "__name__", type(be).__name__)] += 1
        return kwargs

    def report(self, result: Any = None) -> ExplainReport:
        notes = [f"torch.compile(backend={name!r}) left alone x{n}" for name, n in self.left_alone.items()]
        notes += [f"Inductor settings dropped (the graph compiled with branch_replay): {d}"
                  for d in self.dropped_options]
        return ExplainReport(list(self.graphs), list(self.calls), stats_delta(self._stats_before, runtime.stats()),
                             result, notes, [w for w in HISTORY if w["closed"] > self._windows_before])


def stats_delta(before: runtime.Stats, after: runtime.Stats) -> runtime.Stats:
    """The counters accumulated between two ``brcompile.stats()`` snapshots (every numeric and Counter field;
    other fields as in ``after``)."""
    delta = {}
    for f in dataclasses.fields(runtime.Stats):
        a, b = getattr(after, f.name), getattr(before, f.name)
        if isinstance(a, collections.Counter):
            delta[f.name] = a - b
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            delta[f.name] = a - b
        else:
            delta[f.name] = a
    return runtime.Stats(**delta)


@contextlib.contextmanager
def recording(backend: Optional[BranchReplayBackend] = None, *, measure: bool = True, measure_calls: int = 4,
              take_over_default: bool = True):
    """Within the block, ``torch.compile`` (also ``nn.Module.compile``) compiles with branch_replay and records:
    calls that name branch_replay, and with ``take_over_default`` those using the default backend; other
    backends are left alone (and listed in the report). Yields the :class:`RecordingBackend`.

        from brcompile.tools.explain import recording

        with recording() as rec:
            train_step()                 # calls torch.compile(...) somewhere
        rec.report().print()
    """
    rec = RecordingBackend(backend, measure=measure, measure_calls=measure_calls)
    real_compile = torch.compile

    def compile_with_recording(model=None, **kwargs):
        return real_compile(model, **rec.redirect(kwargs, take_over_default))

    compile_with_recording.__doc__ = real_compile.__doc__
    compile_with_recording.__wrapped__ = real_compile
    torch.compile = compile_with_recording
    try:
        yield rec
    finally:
        torch.compile = real_compile


def explain(fn, *args, backend: Optional[BranchReplayBackend] = None, measure: bool = True,
            **kwargs) -> ExplainReport:
    """Compile ``fn`` with a recording branch_replay backend (``backend``'s options, or the defaults), call it
    once on ``args``/``kwargs`` and report (see the module docstring; ``report.result`` is fn's result).

    ``measure`` re-runs the eager original and packed graphs of each call once, forward and backward, to
    count FLOPs and the bytes saved for backward (no ``.grad`` is touched).

    It leaves nothing behind: Dynamo is not reset (the caller's compiled functions keep their code), the
    capture is static (``dynamic=False``: no shape history of earlier compiles makes it symbolic), and
    the Dynamo cache entries compiled for the report are dropped from the code objects (``fn``'s and any
    frame Dynamo compiled on its own after a graph break), so a later ``torch.compile`` of the same
    function never meets them.
    """
    rec = RecordingBackend(backend, measure=measure)
    try:
        result = torch.compile(fn, backend=rec, dynamic=False)(*args, **kwargs)
    finally:
        drop_cache_entries(rec)
    return rec.report(result)


def _compiled_by(entry: Any, owner: RecordingBackend) -> bool:
    """Whether a Dynamo cache entry was compiled by ``owner`` (directly, or a backend it is bound to)."""
    be = getattr(entry, "backend", None)
    be = getattr(be, "compiler_fn", be)  # torch.compile wraps a backend in a _TorchCompileWrapper
    return be is owner or (isinstance(be, _Bound) and be.owner is owner)


def drop_cache_entries(owner: RecordingBackend) -> int:
    """Drops the Dynamo cache entries compiled by ``owner`` from every code object Dynamo has compiled;
    returns how many. A code object whose entries are all ``owner``'s is reset; on one that also holds
    other entries only ``owner``'s are invalidated (as Dynamo does when a guarded object dies: the entry
    never matches again and releases its backend). Best effort on Dynamo's internals: logs, never raises."""
    try:
        from torch._dynamo import convert_frame
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.guards import DeletedGuardManagerWrapper

        codes = [ref() for ref in (*convert_frame.input_codes.seen, *convert_frame.output_codes.seen)]
    except Exception:  # an internal API that moved: nothing is dropped
        log.warning("explain: cannot list Dynamo's code objects; its cache entries stay", exc_info=True)
        return 0
    dropped = 0
    for code in {id(c): c for c in codes if c is not None}.values():
        try:
            entries = _debug_get_cache_entry_list(code)
            ours = [e for e in entries if _compiled_by(e, owner)]
            if not ours:
                continue
            if len(ours) == len(entries):
                torch._C._dynamo.eval_frame.reset_code(code)
            else:
                for e in ours:
                    e.guard_manager.extra_state.invalidate(
                        e, DeletedGuardManagerWrapper("dropped by brcompile.tools.explain"))
            dropped += len(ours)
        except Exception:
            log.warning("explain: cannot drop the cache entries of %s", code, exc_info=True)
    return dropped
