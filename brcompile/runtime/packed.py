"""Per call: build the prefix tree of the batch, gate, run the packed graph, the streaming trunk or the original."""
from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from torch.utils._pytree import tree_leaves

from brcompile.codes import Code
from brcompile.runtime import tree as tree_mod
from brcompile.contract import TOLERANCE, rel_err
from brcompile.runtime.plan import ReplayPlan
from brcompile.runtime.stats import _record, record_original_call, record_whole_call
from brcompile.runtime import window
from brcompile.runtime.context_parallel import count_once
from brcompile.runtime.streaming import StreamingRuntime
from brcompile.runtime.tree import PackedTree, build_sequence_tree, build_tree, row_keys, rows_agree

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CallRecord:
    replayed: bool
    tree_stats: Optional[dict]
    reason: Optional[str] = None
    mode: str = "packed"  # "packed" or "replay" (streaming) for a replayed call
    schedule: Optional[dict] = None  # the streaming chunk schedule (brcompile.runtime.streaming.ReplaySchedule.summary)
    code: Optional[Code] = None  # the refusal code of a call that ran the original graph (brcompile/codes.py)


# --------------------------------------------------------------------------------------------------
# provenance: a dense [B, L, ...] output that a packed graph materialised (packed[index]) carries its tree
#
# A graph whose keys are float [B, L, D] values (per-block graphs, inputs_embeds) merges positions whose keys
# agree bitwise. Its forward is then exact; its gradient with respect to such a key is the sum over each
# node's positions, placed at the node's representative position. Upstream parameters receive the original
# gradient when positions merged by value are the same function of them: an embedding lookup of equal ids,
# or the output of a previous replayed graph. The provenance path makes the second case hold by construction
# (the next graph merges exactly the positions that share a packed token), and it skips the hashing.


_PROVENANCE: dict[int, tuple] = {}  # id(tensor) -> (weakref to it, its _version when tagged, tree)
_PROVENANCE_LOCK = threading.Lock()


def tag_provenance(t: Any, tree: PackedTree) -> None:
    """Remember that dense ``t`` was read from packed data through ``tree.index``: positions sharing a node
    hold the same packed token (bitwise equal values, and the same function of everything upstream)."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2 or tuple(t.shape[:2]) != tree.batch_shape:
        return
    key = id(t)

    def _forget(_ref, key=key):
        with _PROVENANCE_LOCK:
            entry = _PROVENANCE.get(key)
            if entry is not None and entry[0] is _ref:
                del _PROVENANCE[key]

    with _PROVENANCE_LOCK:
        _PROVENANCE[key] = (weakref.ref(t, _forget), t._version, tree)


def provenance_of(t: Any) -> Optional[PackedTree]:
    """The tree ``t`` was materialised through, if ``t`` is that very tensor, unmodified since (same
    version counter); else None."""
    if not isinstance(t, torch.Tensor):
        return None
    with _PROVENANCE_LOCK:
        entry = _PROVENANCE.get(id(t))
    if entry is None or entry[0]() is not t or entry[1] != t._version:
        return None
    return entry[2]


def _reused_tree(per_token: Sequence[Any], key_padding: Optional[torch.Tensor] = None) -> Optional[PackedTree]:
    """A tree to reuse without hashing: the provenance tree of a key, when every other key without that
    provenance agrees with it exactly (:func:`brcompile.runtime.tree.rows_agree`); None to build one. The reused
    tree's ``valid`` is this graph's key padding: all True without one; with one (a mask from outside the
    graph, the same at every block), it must give every packed token one value (:func:`_node_validity`)."""
    trees = [provenance_of(x) for x in per_token]
    B, L = tuple(per_token[0].shape[:2])
    tree = next((t for t in trees if t is not None and t.batch_shape == (B, L)
                 and t.index.device == per_token[0].device), None)
    if tree is None:
        return None
    others = [x for x, t in zip(per_token, trees) if t is not tree]
    if others and not rows_agree(tree, others):
        return None
    if key_padding is not None:
        valid = _node_validity(tree, key_padding)
        if valid is None:
            return None
        return dataclasses.replace(tree, valid=valid,
                                   stats=dataclasses.replace(tree.stats, valid_tokens=int(valid.sum())))
    if tree.stats.valid_tokens != B * L:
        tree = dataclasses.replace(tree, valid=torch.ones_like(tree.valid),
                                   stats=dataclasses.replace(tree.stats, valid_tokens=B * L))
    return tree


def _node_validity(tree: PackedTree, key_padding: torch.Tensor) -> Optional[torch.Tensor]:
    """``v[k]``: the key padding of packed token k's positions, when they all agree (``kp[b, t] ==
    v[index[b, t]]`` everywhere) and none was dropped; else None."""
    index = tree.index
    if tuple(key_padding.shape) != tuple(index.shape) or bool((index < 0).any()):
        return None
    kp = key_padding.to(device=index.device, dtype=torch.bool)
    v = torch.zeros(tree.num_tokens, dtype=torch.bool, device=index.device)
    v[index.reshape(-1)] = kp.reshape(-1)
    return v if torch.equal(v[index], kp) else None


#: ``verify=True`` bounds on the relative error of a packed graph's outputs, by dtype: reassociation only.
VERIFY_TOLERANCE = {**TOLERANCE, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _describe_key(x: Any) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"{list(x.shape)} {str(x.dtype).replace('torch.', '')}"


class _OwnInputs:
    """The original graph called with a call's own inputs only (the computed keys after them dropped)."""

    def __init__(self, original: Callable, inputs: int):
        self.original = original
        self.inputs = inputs

    def __call__(self, *args):
        return self.original(*args[:self.inputs])


class PackedRuntime:
    """The callable the backend returns for a rewritten graph, built from its :class:`ReplayPlan` (packed mode;
    streaming mode through the plan's :class:`StreamingRuntime` when it has one).

    Each call checks the rewrite's per-call guards (``passes.guards``), builds the prefix tree of the tree
    inputs, and runs the packed graph when the guards hold and the batch shares enough
    (``dedup_ratio >= min_dedup``), else the original graph, recording why. A padding-free graph (the plan's
    ``sequences``: the position ids' argument position) gets the tree over the sequences packed
    into its rows (:func:`brcompile.runtime.tree.build_sequence_tree`), never one reused by provenance.
    A graph whose keys it computes itself (the plan's ``keys``: CPM-Ant's prompt ids joined to the input ids,
    passes/canonical/keys.py) gets them evaluated on each call's inputs and passed after them, at the
    placeholders the analysis gave them; the original graph, on a fallback or for ``verify``, gets the call's
    own inputs.
    """

    def __init__(self, plan: ReplayPlan):
        self.plan = plan
        self.keys = plan.keys
        self.original = plan.original if plan.keys is None else _OwnInputs(plan.original, plan.keys.inputs)
        self.verify = plan.verify  # compare the first replayed call's outputs with the original graph's (pending)
        self.verify_failed: Optional[str] = None  # set when that comparison failed: every call runs the original
        self.strict = plan.strict
        self.guards = plan.guards
        self.packed = plan.packed  # the runner: the compiled graph, or the eager one once compiling it failed
        self.eager_packed = plan.eager_packed
        self.tree_positions = plan.tree_positions
        self.key_padding = plan.key_padding
        self.min_dedup = plan.min_dedup
        self.calls: list[CallRecord] = []
        self.max_calls_logged = plan.max_calls_logged
        self.last_tree: Optional[PackedTree] = None
        self.liveness = plan.liveness
        self.streaming: Optional[StreamingRuntime] = plan.streaming
        self.token_outputs = plan.token_outputs
        self.sequences = plan.sequences
        self.rows = plan.rows
        self.written = plan.written
        self.last_tree_source: Optional[str] = None  # "built" (hash + verify) or "provenance" (reused)
        self.cp = plan.context_parallel  # brcompile/runtime/context_parallel.py ContextParallel, or None

    def _log_call(self, make: Callable[[], CallRecord]) -> None:
        """Keep the record ``make()`` builds, for the first ``max_calls_logged`` calls (built only then)."""
        if len(self.calls) < self.max_calls_logged:
            self.calls.append(make())

    def __call__(self, *args):
        if self.keys is not None:
            args = (*args, *self.keys(args))
        if self.cp is not None:  # whatever runs, the gradient of what every rank computes whole is counted once
            return count_once(self._call(args, None), self.cp.group)
        # a cross-call window counts every grad-mode call of the graph, whatever it runs (runtime/window/)
        store = None if self.streaming is None else self.streaming.enter_window(args)
        if store is None:
            return self._call(args, None)
        forwards = store.forwards
        try:
            return self._call(args, store)
        finally:
            if store.forwards == forwards:  # the call did not run through the window: its last call may be this
                window.finish_if_complete(store.window)

    def _call(self, args: tuple, store):
        """One call (``store``: its cross-call window store, or None)."""
        if self.verify_failed is not None:
            return self._original(args, Code.VERIFY_FAILED, self.verify_failed)
        for guard in self.guards:
            if not guard.padding_only:
                reason = guard(args)
                if reason is not None:
                    return self._original(args, guard.code, reason)
        per_token = [args[i] for i in self.tree_positions]
        if self.rows:
            per_token = row_keys(per_token)
        mask = None if self.key_padding is None else self.key_padding(args)
        needed, live = self._liveness(args, per_token, mask)
        # an assumption about the outputs at padded positions only is moot on a call that computes none of them
        pads_out = needed is not None and mask is not None and not bool((needed & ~mask.to(torch.bool)).any())
        for guard in self.guards:
            if guard.padding_only and not pads_out:
                reason = guard(args)
                if reason is not None:
                    return self._original(args, guard.code, reason)
        tree, source = self._tree(args, per_token, mask, needed, live)
        st = tree.stats
        if st.executed_tokens == 0:
            return self._original(args, Code.NOTHING_NEEDED, "no position of the batch is needed (every one is "
                                                             "padding or has loss weight 0)", st)
        cp_whole = None if self.cp is None else self.cp.why_whole(args, st.executed_tokens, self.written)
        split = self.cp is not None and cp_whole is None  # context parallel: this rank runs its piece of the tokens
        if cp_whole is not None:
            record_whole_call(cp_whole)
            log.debug("branch_replay call runs whole on every rank [%s]: %s", Code.CP_CALL, cp_whole)
        if st.dedup_ratio < self.min_dedup and store is None and not split:  # in a window, shared with the others
            return self._original(args, Code.SHARES_TOO_LITTLE,
                                  f"batch shares too little: dedup {st.dedup_ratio:.2f} < min_dedup {self.min_dedup}",
                                  st)
        tree_args = tree.graph_args()
        if self.verify:
            self.verify = False
            reason = self._verify(args, tree_args)
            if reason is not None:
                self.verify_failed = reason
                log.warning("branch_replay [%s]: %s", Code.VERIFY_FAILED, reason)
                return self._original(args, Code.VERIFY_FAILED, reason, st)
        if store is not None and (source != "built" or self.sequences is not None or self.rows):
            store = None  # a window matches calls by the rows' keys: a tree over packed sequences or rows is not
        why_packed = None if self.streaming is None or store is not None else self.streaming.choose(tree)
        if why_packed is not None:
            log.debug("branch_replay call runs packed, not streamed: %s", why_packed)
        streamed = self.streaming is not None and why_packed is None
        snapshot = self._snapshot(args)
        try:
            if split:
                streamed = False
                out = self.cp.outer(*self.cp.inputs(args), *tree_args)
            elif streamed:
                with window.call_keys(store, per_token, mask, tree):  # a window matches the call by its keys
                    out = self.streaming.outer(*args, *tree_args)
            else:
                out = self._run_packed(args, tree_args)
        except window.WindowError:
            raise  # a window used against its contract (a parameter written mid-window): the user's to fix
        except Exception as e:
            self._restore(args, snapshot)  # the original graph makes the call's one write
            return self._failed(e, "context-parallel" if split else "streaming" if streamed else "packed", st, args)
        if split:
            cut = self.cp.trunk.last
            _record(replayed_calls=1, context_parallel_calls=1, logical_tokens=st.logical_tokens,
                    executed_tokens=st.executed_tokens, live_tokens=max(st.live_tokens, 0), dead_tokens=st.dead_tokens,
                    context_parallel_tokens=cut.tokens if cut is not None else 0)
            self._log_call(lambda: CallRecord(True, self._tree_record(st, per_token, source), mode="context_parallel",
                                              schedule=None if cut is None else cut.summary()))
        elif streamed:
            schedule = self.streaming.trunk.last_schedule
            _record(replayed_calls=1, streamed_calls=1, logical_tokens=st.logical_tokens,
                    executed_tokens=st.executed_tokens, live_tokens=max(st.live_tokens, 0),
                    dead_tokens=st.dead_tokens)
            self._log_call(lambda: CallRecord(True, self._tree_record(st, per_token, source), mode="replay",
                                              schedule=None if schedule is None else schedule.summary()))
        else:
            _record(replayed_calls=1, logical_tokens=st.logical_tokens, executed_tokens=st.executed_tokens,
                    live_tokens=max(st.live_tokens, 0), dead_tokens=st.dead_tokens)
            self._log_call(lambda: CallRecord(True, self._tree_record(st, per_token, source)))
        log.debug("branch_replay %s call: %s (tree %s)", "streaming" if streamed else "packed", st, source)
        self._tag_outputs(out, tree)
        return out

    def _liveness(self, args: Sequence[Any], per_token: list, mask: Optional[torch.Tensor]):
        """(needed, live) ``[B, L]`` bool masks of this call (passes/analysis/liveness.py), or (None, None) without a
        liveness plan. Read once per call from the per-call values the plan names (masks, labels)."""
        if self.liveness is None:
            return None, None
        key = per_token[0]
        B, L = key.shape[0], key.shape[1]
        live = self.liveness.live(args, B, L, mask, key.device)
        return self.liveness.needed(live, mask), live

    def _snapshot(self, args: Sequence[Any]) -> list:
        """Copies of the inputs the graph writes into (none for most graphs)."""
        return [args[i].detach().clone() for i in self.written]

    def _restore(self, args: Sequence[Any], snapshot: list) -> None:
        """The written inputs back to ``snapshot`` (:meth:`_snapshot`)."""
        with torch.no_grad():
            for i, v in zip(self.written, snapshot):
                args[i].copy_(v)

    def _original(self, args: Sequence[Any], code: Code, reason: str, st=None):
        """This call runs the original graph; the refusal (``code``: the rule broken, ``reason``: how) is
        counted and logged."""
        record_original_call(code, reason)
        self._log_call(lambda: CallRecord(False, None if st is None else st.to_dict(), reason, code=code))
        log.debug("branch_replay call falls back [%s]: %s", code, reason)
        return self.original(*args)

    def _tree(self, args: Sequence[Any], per_token: list, mask: Optional[torch.Tensor],
              needed: Optional[torch.Tensor] = None, live: Optional[torch.Tensor] = None) -> tuple[PackedTree, str]:
        """The call's tree and where it came from: reused by provenance (``"provenance"``), or built from the
        keys (``"built"``: over the packed sequences of a padding-free graph, whose guard checked the
        position ids, else over the rows), the positions nobody needs left out (``needed``)."""
        narrowed = needed is not None and not bool(needed.all())
        reuse = self.sequences is None and not narrowed
        tree = _reused_tree(per_token, mask) if reuse else None
        source = "built" if tree is None else "provenance"
        if tree is None and self.sequences is not None:
            tree = build_sequence_tree(per_token, args[self.sequences])
        elif tree is None:
            tree = build_tree(per_token, attention_mask=mask)
        if needed is not None:
            tree = tree_mod.drop_positions(tree, needed, live)
        self.last_tree, self.last_tree_source = tree, source
        return tree, source

    def _run_packed(self, args: Sequence[Any], tree_args: Sequence[Any]):
        """The packed graph on this call; if compiling it fails (not strict), it runs uncompiled from then on."""
        try:
            return self.packed(*args, *tree_args)
        except torch._dynamo.exc.BackendCompilerFailed:
            if self.strict or self.eager_packed is None:
                raise
            log.warning("branch_replay: compiling the packed graph failed; running it uncompiled", exc_info=True)
            self.packed = self.eager_packed
            return self.packed(*args, *tree_args)

    def _verify(self, args: Sequence[Any], tree_args: Sequence[Any]) -> Optional[str]:
        """``verify=True``: run the original and the packed graph forward on this call (no grad, the same RNG
        state) and compare every output and every input the graph writes into (each run starts from the same
        snapshot of those, restored afterwards): floating ones within :data:`VERIFY_TOLERANCE` of their dtype
        (``rel_err``), others equal. None when they agree, else the reason (with both values of the first
        scalar output that differs: the loss, for a loss function)."""
        run = self.eager_packed or self.packed
        devices = [a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda]
        before = self._snapshot(args)  # a written input is compared like an output, then restored
        with torch.no_grad():
            with torch.random.fork_rng(devices=devices):
                want = self.original(*args)
            want_written = self._snapshot(args)
            self._restore(args, before)
            with torch.random.fork_rng(devices=devices):
                got = run(*args, *tree_args)
            got_written = self._snapshot(args)
            self._restore(args, before)
        want_l, got_l = tree_leaves(want) + want_written, tree_leaves(got) + got_written
        if len(want_l) != len(got_l):
            return f"verify=True: the packed graph returned {len(got_l)} outputs, the original {len(want_l)}"
        for i, (w, g) in enumerate(zip(want_l, got_l)):
            if not isinstance(w, torch.Tensor):
                continue
            if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
                return f"verify=True: output {i} differs in kind, shape or dtype from the original graph's"
            if w.is_floating_point():
                err = rel_err(g, w)
                tol = VERIFY_TOLERANCE.get(w.dtype, 1e-2)
                if not err <= tol:  # NaN fails too
                    both = f" (original {w.item():.10g}, packed {g.item():.10g})" if w.numel() == 1 else ""
                    return (f"verify=True: output {i} of the packed graph differs from the original graph's by "
                            f"{err:.2e} relative (bound {tol:.0e} for {str(w.dtype).replace('torch.', '')})"
                            f"{both}; every call of this graph runs the original")
            elif not torch.equal(g, w):
                return f"verify=True: integer/bool output {i} of the packed graph differs from the original graph's"
        return None

    def _failed(self, e: Exception, what: str, st, args):
        """A packed (or streaming) forward that raised: a bug of the rewrite that the compile-time checks
        missed. The original graph runs (its own errors, if any, are the user's), recording why; in strict
        mode the error is raised."""
        if self.strict:
            raise e
        reason = f"internal error running the {what} graph: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("branch_replay [%s]: %s; running the original graph", Code.INTERNAL_ERROR, reason, exc_info=True)
        return self._original(args, Code.INTERNAL_ERROR, reason, st)

    def _tag_outputs(self, out, tree: PackedTree) -> None:
        """Outputs read densely from packed values carry the tree (provenance), unless positions were left out
        of it or the tree is over packed sequences (a graph over rows must not reuse it)."""
        if tree.packed_sequences:
            return
        if self.token_outputs and isinstance(out, (tuple, list)) and not tree.stats.dead_tokens:
            for i in self.token_outputs:
                if i < len(out):
                    tag_provenance(out[i], tree)

    def _tree_record(self, st, per_token, source: str) -> dict:
        """The call's tree stats plus its keys (shape, dtype) and where the tree came from."""
        d = st.to_dict()
        d["keys"] = [_describe_key(x) for x in per_token]
        d["source"] = source
        return d


class FallbackRuntime:
    """The callable for a graph that could not be rewritten: the original graph, counted — as a fallback, or,
    for a graph with nothing to share (``unshared``: passes/refusals.py ``NothingToShare``), as an unshared call."""

    def __init__(self, original: Callable, code: Code, reason: str, unshared: bool = False):
        self.original = original
        self.code = code  # the graph's refusal code (brcompile/codes.py)
        self.reason = reason
        self.unshared = unshared

    def __call__(self, *args):
        record_original_call(self.code, self.reason, unshared=self.unshared)
        return self.original(*args)

