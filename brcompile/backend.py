"""The ``branch_replay`` torch.compile backend: analyse -> rewrite -> runtime callable.

``torch.compile(fn, backend="branch_replay")`` (entry point) or ``torch.compile(fn,
backend=brcompile.backend(min_dedup=1.2))``. Every captured graph gets a frozen :class:`GraphRecord`
(rewritten or not, why not, the packed graph's code, materialisations); ``brcompile.explain`` reads them.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch
import torch.fx as fx

from brcompile import runtime
from brcompile.passes.axes import CannotReplay
from brcompile.passes.pack import PackOptions, analyse, build_packed_graph

log = logging.getLogger(__name__)


COMPILERS = ("inductor", "aot_eager", "eager")


@dataclasses.dataclass(frozen=True)
class Options:
    """Backend options (``torch.compile(..., options={...})`` or ``brcompile.backend(**options)``).

    min_dedup: run the original graph for a batch whose logical/executed token ratio is below this.
    attention: tree-attention implementation: "auto" (triton on CUDA, cpu otherwise), "cpu",
        "reference", "triton".
    compiler: how the packed graph runs: "inductor" (compiled once with dynamic shapes: one compile
        serves every batch), "aot_eager" (AOTAutograd, no codegen), or "eager" (the FX graph as is).
    """

    min_dedup: float = 1.05
    attention: str = "auto"
    compiler: str = "inductor"

    def __post_init__(self):
        if self.compiler not in COMPILERS:
            raise ValueError(f"compiler={self.compiler!r}; choose one of {COMPILERS}")
        if self.attention not in ("auto", "cpu", "reference", "triton"):
            raise ValueError(f"attention={self.attention!r}; choose auto, cpu, reference or triton")
        if not self.min_dedup >= 1.0:
            raise ValueError(f"min_dedup={self.min_dedup} must be >= 1")

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "Options":
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise TypeError(f"unknown branch_replay option(s) {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class GraphRecord:
    """What the backend did with one captured graph."""

    graph_id: int
    rewritten: bool
    reason: Optional[str]
    failed_node: Optional[str]
    original_code: str
    packed_code: Optional[str]
    tree_inputs: tuple[str, ...] = ()
    masks: tuple[str, ...] = ()
    materialisations: tuple[tuple[str, str, int, str], ...] = ()  # (node, user, numel, reason)
    lazy_gathers: tuple[str, ...] = ()
    runtime: Any = dataclasses.field(default=None, compare=False, repr=False)


class BranchReplayBackend:
    """A torch.compile backend object that keeps a record per captured graph."""

    def __init__(self, **options):
        self.options = Options.from_dict(options)
        self.records: list[GraphRecord] = []

    def __call__(self, gm: fx.GraphModule, example_inputs, options: Optional[dict] = None):
        opts = self.options
        if options:
            opts = Options.from_dict({**dataclasses.asdict(self.options), **options})
        import brcompile.backends.ops  # noqa: F401  (registers brcompile::tree_attention)

        gid = len(self.records)
        original = gm.forward
        try:
            an = analyse(gm, example_inputs, training=torch.is_grad_enabled())
            packed = build_packed_graph(an, PackOptions(attention=opts.attention))
        except CannotReplay as e:
            return self._fallback(gid, gm, str(e), e.node_name)
        except Exception as e:  # a bug in a pass must never produce a wrong number: run the original
            log.warning("branch_replay: internal error while rewriting graph %d; running it unchanged",
                        gid, exc_info=True)
            return self._fallback(gid, gm, f"internal error: {type(e).__name__}: {e}", None)
        run_packed = packed.forward if opts.compiler == "eager" else torch.compile(
            packed, backend=opts.compiler, dynamic=True)
        rt = runtime.ReplayRuntime(original, run_packed, an.tree_input_positions,
                                   an.keypad_position, opts.min_dedup, eager_packed=packed.forward)
        rec = GraphRecord(
            gid, True, None, None, gm.code, packed.code,
            tree_inputs=tuple(p.name for p in an.tree_inputs),
            masks=tuple(f"{a.name}: {info}" for a, info in an.masks.items()),
            materialisations=tuple((m.node.name, m.user.name, m.numel, m.reason)
                                   for m in an.materialisations),
            lazy_gathers=tuple(n.name for n in an.lazy_gathers),
            runtime=rt,
        )
        self.records.append(rec)
        runtime.record_graph(True)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("branch_replay graph %d before:\n%s", gid, gm.code)
            log.debug("branch_replay graph %d after:\n%s", gid, packed.code)
        return rt

    def _fallback(self, gid: int, gm: fx.GraphModule, reason: str, node: Optional[str]):
        rt = runtime.FallbackRuntime(gm.forward, reason)
        self.records.append(GraphRecord(gid, False, reason, node, gm.code, None, runtime=rt))
        runtime.record_graph(False, reason)
        return rt


_DEFAULT = BranchReplayBackend()


def branch_replay(gm: fx.GraphModule, example_inputs, options: Optional[dict] = None):
    """The entry-point backend (``backend="branch_replay"``); records go to the default backend."""
    return _DEFAULT(gm, example_inputs, options)


def backend(**options) -> BranchReplayBackend:
    """A backend object with options: ``torch.compile(fn, backend=brcompile.backend(min_dedup=1.5))``."""
    return BranchReplayBackend(**options)


def default_backend() -> BranchReplayBackend:
    return _DEFAULT
