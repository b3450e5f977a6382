"""The ATen level: a captured graph lowered to a functional, pre-dispatch ATen graph for the analysis.

Dynamo records the ops a model *wrote*: ``x /= s``, ``out[:, :, i] = v``, ``zeros_like(h).index_add_(…)``,
``torch.Tensor.addcmul``, a helper that spells ``F.normalize`` by hand. The analysis of this package reads a
graph through its rules (``passes/rules``) and its functionalisation (``passes/lower/functionalize.py``), and a
spelling or a write neither knows makes the graph fall back. This module gives the same graph at the level
``torch.export`` and AOTAutograd use for training:

1. :func:`lower` — ``aot_export_module(gm, fakes, trace_joint=False, pre_dispatch=True)`` on Dynamo's own fake
   inputs (so every symbolic size stays a symbol of the same shape environment). The result is *functional*
   (every in-place op and every write into a view is an out-of-place op: ``copy``, ``slice_scatter``,
   ``select_scatter``, ``index_put``; mutations of the graph's *inputs* would be extra outputs, and such a
   graph is refused) and *pre-dispatch* (still differentiable when run: ``aten.linear``, ``aten.matmul``,
   ``aten.softmax``, ``aten.layer_norm``, ``aten.scaled_dot_product_attention`` are kept, not decomposed into
   their kernels; a Python-level spelling is whichever ATen ops it ran).
2. :func:`respell` — every ATen op an op record lists (passes/ops/: its ``aten`` packets and ``respell``)
   is written as the one canonical torch-level call the rules and matchers read (``aten.slice.Tensor(x, d,
   a, b)`` → ``x[..., a:b]``, ``aten.embedding(W, ids)`` → ``F.embedding(ids, W)``, ``aten.view(x, s)`` →
   ``x.view(*s)``); identities of the lowering (``alias``, full slices, ``lift_fresh_copy`` of a tensor
   constant, a ``copy`` into a value of the same shape and dtype) are dropped. An ATen op not in the table stays as
   it is: it has no rule, so the analysis materialises its token operands (exact, nothing shared past it),
   as for any op without a rule. A zero-dimensional constant the export lifted (``_tensor_constantN``, what
   ``torch.tensor(v)`` traces to under its ``lift_fresh_copy``) is written back as ``torch.tensor(v)``, so a
   value made only from numbers stays a constant (GPT-Neo's mask value).

The lowered graph takes the same inputs in the same order, with the placeholders' names and metadata of
the captured graph, and returns the same outputs; the backend runs the analysis and the rewrite on it
when the captured graph itself is refused (``Options.level``, docs/ARCHITECTURE.md §3.0), and the original
captured graph stays the fallback.
"""
from __future__ import annotations

import contextlib
import logging
import re
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes.lower import checkpoint as checkpoints
from brcompile.passes.canonical.scans import linear as linear_scans
from brcompile.passes.analysis.axes import example_value
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.lower.functionalize import functionalize
from brcompile.passes.analysis.guards import scalar_equals
from brcompile.passes.meta import CHECKPOINT_INDEX, CHECKPOINT_REGION
from brcompile.passes.ops import record_for_packet, records
from brcompile.passes.ops.respell import DROP, END
from brcompile.passes.spellings import copy_graph_module

log = logging.getLogger(__name__)

aten = torch.ops.aten
__all__ = ["lower", "respell", "ATEN_SPELLINGS", "aten_spellings", "lower_and_respell", "aten_ops"]



def lower(gm: fx.GraphModule, example_inputs: Optional[Sequence] = None) -> tuple[fx.GraphModule, list]:
    """(the functional pre-dispatch ATen graph of ``gm``, its per-call guards) (step 1 of the module docstring),
    traced on the fake values Dynamo recorded for its placeholders. CannotReplay when it cannot be traced (the
    reason names the error) or when it writes into one of its inputs (a buffer, an argument).
    ``example_inputs`` (the call's inputs) give the values of scalar inputs read with ``.item()``
    (:func:`_specialise_items`); the guards hold them."""
    from torch._functorch.aot_autograd import aot_export_module
    from torch._guards import detect_fake_mode

    gm, guards = _specialise_items(gm, example_inputs)
    gm, regions = _inline_checkpoints(gm)
    _refuse_custom_backwards(gm)
    gm = _canonicalize_scans(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [example_value(p) for p in placeholders]
    if any(f is None for f in fakes):
        missing = next(p.name for p, f in zip(placeholders, fakes) if f is None)
        raise CannotReplay(Code.ATEN_LOWERING,
                           f"the ATen level needs the example value of every input; `{missing}` has none")
    fake_mode = detect_fake_mode(fakes)

    def export(g: fx.GraphModule):
        with (fake_mode if fake_mode is not None else contextlib.nullcontext()), _functorch_layers_kept():
            return aot_export_module(g, fakes, trace_joint=False, pre_dispatch=True)

    try:
        try:
            lowered, sig = export(gm)
        except Exception:
            # The export refuses some writes the Dynamo level proves pure (an in-place op on what a dropout at
            # p = 0 returned: "cannot mutate tensors with frozen storage", XLM's ``tensor *= mask``): once more
            # with them made out of place (passes/lower/functionalize.py), when there are any.
            pure = functionalize(gm)
            if pure is gm:
                raise
            lowered, sig = export(pure)
            gm = pure
    except Exception as e:  # the export's own refusal (data-dependent control flow, an unsupported HOP, ...)
        site = _vmap_site(gm)
        what = f"torch.vmap {site}: functorch batching is not traced by the pre-dispatch export; " if site else ""
        raise CannotReplay(Code.ATEN_LOWERING, f"the graph could not be lowered to ATen ({what}{type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})") from e
    by_export_name = dict(zip(sig.user_inputs, (p.name for p in placeholders)))  # the export's argN_1 -> gm's
    written = [*(by_export_name.get(n, n) for n in sig.user_inputs_to_mutate.values()),
               *sig.buffers_to_mutate.values(), *getattr(sig, "parameters_to_mutate", {}).values()]
    if written:
        raise CannotReplay(Code.INPUT_WRITE,
                           f"the graph writes into its input(s) {sorted(set(written))} (kept out of the ATen level)")
    if getattr(sig, "input_tokens", None) or getattr(sig, "output_tokens", None):
        raise CannotReplay(Code.SIDE_EFFECTS, "the graph has ops with side effects (effect tokens at the ATen level)")
    n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    if len(sig.user_outputs) != n_out:
        raise CannotReplay(Code.ATEN_LOWERING,
                           f"the ATen level has {len(sig.user_outputs)} outputs for the graph's {n_out}")
    out = _rebind_inputs(gm, lowered, sig)
    for n in out.graph.nodes:  # the checkpoint regions, back from the meta the export carried
        index = CHECKPOINT_INDEX.get(n)
        if index is not None:
            CHECKPOINT_REGION.set(n, regions[index])
    return out, guards


def _vmap_site(gm: fx.GraphModule) -> Optional[str]:
    """``in `fn` (file:line)`` of the first function the graph runs under ``torch.vmap`` (Dynamo's
    ``_vmap_increment_nesting`` ... ``_vmap_decrement_nesting``; HF Mamba's ``associative_scan`` in its generic
    mode vmaps its ``combine_fn``), the innermost frame of the user's code there; None when it runs no vmap.
    The pre-dispatch export fails on a batched value (``FunctionalTensor`` used outside its mode)."""
    inside = False
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name == "_vmap_increment_nesting":
            inside = True
        elif inside and name not in ("_add_batch_dim", "lazy_load_decompositions") and n.op == "call_function":
            frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', n.meta.get("stack_trace") or "")
            if frames:
                path, line, fn = frames[-1]
                return f"in `{fn}` ({path.rsplit('/', 1)[-1]}:{line})"
            return "in the graph"
    return None


def _refuse_custom_backwards(gm: fx.GraphModule) -> None:
    """CannotReplay at a custom ``torch.autograd.Function`` (Dynamo's ``autograd_function_apply``: a forward body
    and the user's backward). The pre-dispatch export inlines the forward under ``no_grad`` and keeps no
    backward: the lowered graph would compute the same values with the gradient through the Function cut off
    (or, were it kept differentiable, the derivative of the forward instead of the user's backward), a
    silently wrong gradient. The Dynamo level keeps the Function whole (it has no token-axis rule: its token
    operands are materialised and it runs densely with its own backward)."""
    hop = getattr(getattr(torch.ops, "higher_order", None), "autograd_function_apply", None)
    for n in gm.graph.nodes:
        if n.op == "call_function" and hop is not None and n.target is hop:
            raise CannotReplay(Code.CUSTOM_AUTOGRAD_FUNCTION,
                               f"a custom torch.autograd.Function ({_function_name(n)}) is in the graph: the ATen "
                               "lowering keeps its forward and drops its backward", n)


def _function_name(node: fx.Node) -> str:
    """The ``X`` of the ``X.apply(...)`` that made ``node`` (from its stack trace), else ``node``'s name."""
    calls = re.findall(r"([A-Za-z_][\w.]*)\.apply\(", node.meta.get("stack_trace") or "")
    return f"`{calls[-1]}`" if calls else f"`{node.name}`"


def _specialise_items(gm: fx.GraphModule, example_inputs: Optional[Sequence]):
    """(gm with every ``x.item()`` of a 0-dim tensor input replaced by its value in this call, the per-call
    guards ``scalar_equals`` holding each). Under ``dynamic=True`` Dynamo passes float module attributes and
    arguments (a norm's ``eps``, ``clip_eps``) as 0-dim tensor inputs read with ``.item()``: a data-dependent
    scalar the export cannot trace. The rewrite holds for that value, and a call with another runs the
    original graph (the Dynamo level does the same for the attention's scalars, passes/canonical/attention/)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    items = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "item" and len(n.args) == 1
             and n.args[0] in placeholders]
    if not items or example_inputs is None:
        return gm, []
    env: dict = {}
    new = copy_graph_module(gm, env)
    graph = new.graph
    guards = []
    for n in items:
        pos = placeholders.index(n.args[0])
        x = example_inputs[pos]
        if not (isinstance(x, torch.Tensor) and x.dim() == 0) or isinstance(x, torch.nn.Parameter):
            continue
        value = x.item()
        env[n].replace_all_uses_with(value)
        graph.erase_node(env[n])
        guards.append(scalar_equals(pos, value, f"scalar input {placeholders[pos].name} (read with .item())"))
    graph.lint()
    new.recompile()
    return new, guards


def _canonicalize_scans(gm: fx.GraphModule) -> fx.GraphModule:
    """gm (a copy, when it has one) with its affine associative scans as ``linear_scan`` nodes. The export
    cannot trace torch.vmap's levels functionally, and the inlined generic associative scan (HF Mamba's on
    CPU) runs its combine under vmap: passes/canonical/scans/linear.py proves each such region (or the scan HOP) on the
    captured graph's spelling and writes it as ``linear_scan(a, b, dim)``, which the export traces to
    ``brcompile::tree_linear_scan`` over the chain parent and the ``tree_linear_scan`` record
    (passes/ops/scan.py) writes back. A region not
    proved stays, and the export refuses it."""
    if not any(n.op == "call_function" and (n.target in linear_scans.VMAP_DATA or n.target is linear_scans.HOP)
               for n in gm.graph.nodes):
        return gm
    gm = copy_graph_module(gm)
    for note in linear_scans.canonicalize_linear_scans(gm):
        log.debug("ATen level, before the export: %s", note)
    return gm


@contextlib.contextmanager
def _functorch_layers_kept():
    """Leaves functorch's interpreter stack as it found it. A graph that runs vmap levels (functorch's
    ``_vmap_increment_nesting``, Zamba's) pushes layers while it is traced; a trace that stops inside one would
    leave it pushed, and Dynamo's guard on that stack would then fail on the very frame being compiled."""
    from torch._functorch.pyfunctorch import pop_dynamic_layer_stack

    def depth() -> int:
        return len(torch._C._functorch.get_interpreter_stack() or ())

    before = depth()
    try:
        yield
    finally:
        while depth() > before:
            pop_dynamic_layer_stack()


def _inline_checkpoints(gm: fx.GraphModule):
    """(gm with its activation-checkpoint bodies inlined, {index: CheckpointRegion}). The export cannot trace
    the checkpoint higher-order op functionally before dispatch, so its bodies are inlined and tagged
    (passes/lower/checkpoint.py) and each tag rides along in ``node.meta["custom"]``, which the export copies onto
    every ATen node it traces from that node (``torch.fx.traceback.preserve_node_meta``); :func:`lower` turns
    it back into the region tag, and the rewrite re-outlines the packed bodies as at the Dynamo level."""
    inlined = checkpoints.inline_checkpoints(gm)
    regions = {}
    if inlined is gm:
        return gm, regions
    for n in inlined.graph.nodes:
        r = checkpoints.region_of(n)
        if r is not None:
            regions[r.index] = r
            CHECKPOINT_INDEX.set(n, r.index)
    return inlined, regions


def _rebind_inputs(gm: fx.GraphModule, lowered: fx.GraphModule, sig) -> fx.GraphModule:
    """``lowered`` with gm's placeholders (names and metadata) in place of the export's user inputs, and its
    lifted parameters and buffers read back as ``get_attr`` of gm's attributes."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    ph_old = [n for n in lowered.graph.nodes if n.op == "placeholder"]
    ph_gm = [n for n in gm.graph.nodes if n.op == "placeholder"]
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    user = [n for n in ph_old if n.name not in lifted]
    if len(user) != len(ph_gm):
        raise CannotReplay(Code.ATEN_LOWERING, f"the ATen level has {len(user)} inputs for the graph's {len(ph_gm)}")
    for new_ph, old in zip(user, ph_gm):
        p = graph.placeholder(old.name, type_expr=old.type)
        p.meta.update(old.meta)
        env[new_ph] = p
    attrs: dict[str, Any] = {}
    for n in lowered.graph.nodes:
        if n.op == "placeholder":
            if n in env:
                continue
            target = lifted[n.name]
            attrs[target] = gm.get_parameter(target) if target in sig.inputs_to_parameters.values() \
                else gm.get_buffer(target)
            env[n] = graph.get_attr(target)
            env[n].meta.update(n.meta)
            continue
        if n.op == "get_attr":
            attrs[n.target] = getattr(lowered, n.target)
        env[n] = graph.node_copy(n, lambda a: env[a])
    root = torch.nn.Module()
    for name, value in attrs.items():
        _set_attr(root, name, value)
    return fx.GraphModule(root, graph, class_name="ATenGraph")


def _set_attr(root: torch.nn.Module, dotted: str, value: Any) -> None:
    *path, leaf = dotted.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, torch.nn.Module())
        mod = getattr(mod, p)
    if isinstance(value, torch.nn.Parameter):
        mod.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        mod.register_buffer(leaf, value)
    else:
        setattr(mod, leaf, value)


# --------------------------------------------------------------------------------------------------
# respelling: each ATen op written as its op record's torch-level call (passes/ops/)


def _tiles(n: fx.Node) -> Optional[tuple[list, int]]:
    """(the sources, dim d) when the last writes of the ``torch.slice_scatter`` chain ending at ``n`` (a respelled
    graph's node) write disjoint step-1 ranges along d that together cover d: whatever the written tensor held is
    overwritten, and the value is the ``cat`` of the sources in the order of their ranges (MLA's ``k =
    kv.new_empty(...); k[..., :n] = k_nope; k[..., n:] = k_pe``, ``out = zeros_like(o); out[..., :h] = a;
    out[..., h:] = b``). Else None."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    ev = example_value(n)
    if ev is None:
        return None
    pieces, cur = [], n
    while isinstance(cur, fx.Node) and cur.op == "call_function" and cur.target is torch.slice_scatter:
        x, src, d, start, end, step = cur.args
        d = d + ev.dim() if d < 0 else d
        if step not in (1, None) or (pieces and d != pieces[0][3]):
            return None
        start = 0 if start is None else start
        end = ev.shape[d] if end is None or (isinstance(end, int) and end >= END) else end
        pieces.append((src, start, end, d))
        tiles = _in_order(pieces, ev.shape[d], statically_known_true)
        if tiles is not None:
            return tiles, d
        cur = x
    return None


def _in_order(pieces: list, size: Any, known: Callable) -> Optional[list]:
    """The sources of ``pieces`` ((src, start, end, d)) sorted by start when their ranges follow each other from
    0 to ``size`` (each start provably the previous end), else None."""
    by_start = sorted(pieces, key=lambda p: (p[1] if isinstance(p[1], int) else float("inf")))
    pos = 0
    for _, start, end, _ in by_start:
        if not known(start == pos):
            return None
        pos = end
    return [p[0] for p in by_start] if known(pos == size) else None


def _fold_tiled_writes(gm: fx.GraphModule) -> None:
    """Every chain of writes that covers a dim of the written value (:func:`_tiles`) as its ``cat``; the
    writes (and what they wrote into) then go dead unless read elsewhere."""
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not torch.slice_scatter or (
                len(n.users) == 1 and next(iter(n.users)).target is torch.slice_scatter
                and next(iter(n.users)).args[0] is n):
            continue  # not a write, or not the last of its chain
        tiles = _tiles(n)
        if tiles is None:
            continue
        with graph.inserting_before(n):
            cat = graph.call_function(torch.cat, (tiles[0], tiles[1]))
        cat.meta.update(n.meta)
        n.replace_all_uses_with(cat)
    graph.eliminate_dead_code()


def aten_spellings() -> dict:
    """ATen op packet -> its respelling: every op record's ``aten`` packets (passes/ops/). An op not listed keeps
    its ATen target (no rule: materialised)."""
    return {p: r.respell for r in records() for p in r.aten if r.respell is not None}


#: Every ATen op family the analysis reads at the ATen level, and the torch-level call it is written as (a view of
#: the op records at import; :func:`respell` reads the records themselves).
ATEN_SPELLINGS: dict = aten_spellings()


def _lifted_scalar(gm: fx.GraphModule, n: fx.Node) -> Optional[torch.Tensor]:
    """The 0-dim tensor a ``get_attr`` of the export's lifted constants (``_tensor_constantN``: ``torch.tensor(False)``
    in the model) reads, else None. The respelling writes it back as ``torch.tensor(v)``, so two constants made
    alike are two alike calls (CPM-Ant builds its mask condition twice) and a number reads as one."""
    if n.op != "get_attr" or not n.target.startswith("_tensor_constant"):
        return None
    value = getattr(gm, n.target, None)
    if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter) or value.dim() != 0:
        return None
    return value


def _scalar_kwargs(t: torch.Tensor) -> dict:
    kw: dict = {"dtype": t.dtype}
    if t.device.type != "cpu":
        kw["device"] = t.device
    return kw


def respell(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (an ATen graph) with every ATen op an op record lists written as its torch-level call (step 2
    of the module docstring). Metadata (the fake values) is kept; a node replaced by one of its operands
    (an identity) disappears."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for n in gm.graph.nodes:
        scalar = _lifted_scalar(gm, n)
        if scalar is not None:
            env[n] = graph.create_node("call_function", torch.tensor, (scalar.item(),), _scalar_kwargs(scalar),
                                       name=n.name)
            env[n].meta.update(n.meta)
            continue
        packet = getattr(n.target, "overloadpacket", None) if n.op == "call_function" else None
        record = record_for_packet(packet) if packet is not None else None
        rule = record.respell if record is not None else None
        if rule is None:
            env[n] = graph.node_copy(n, lambda a: env[a])
            continue
        args = fx.map_arg(n.args, lambda a: env[a])
        kwargs = fx.map_arg(n.kwargs, lambda a: env[a])
        out = rule(n, args, kwargs)
        if out is DROP:
            continue
        if out is None:
            env[n] = graph.node_copy(n, lambda a: env[a])
        elif isinstance(out, tuple) and len(out) == 4 and out[0] in ("call_function", "call_method"):
            op, target, a, kw = out
            new = graph.create_node(op, target, tuple(a), dict(kw), name=n.name)
            new.meta.update(n.meta)
            if "val" in n.meta:
                new.meta["example_value"] = n.meta["val"]
            env[n] = new
        else:
            env[n] = out
    out = fx.GraphModule(gm, graph, class_name="ATenGraph")
    out.graph.eliminate_dead_code()
    _fold_tiled_writes(out)
    out.graph.lint()
    out.recompile()
    return out


def lower_and_respell(gm: fx.GraphModule, example_inputs: Optional[Sequence] = None) -> tuple[fx.GraphModule, list]:
    """:func:`lower` then :func:`respell`: (the graph the backend analyses at the ATen level, its per-call
    guards)."""
    lowered, guards = lower(gm, example_inputs)
    lowered = respell(lowered)
    log.debug("ATen level of the graph:\n%s", lowered.code)
    return lowered, guards


def aten_ops(gm: fx.GraphModule) -> list[str]:
    """The ATen ops left in a respelled graph (those without a torch-level spelling), for reports."""
    return sorted({str(n.target) for n in gm.graph.nodes
                   if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)})
