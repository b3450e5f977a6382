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
2. :func:`respell` — every ATen op in :data:`ATEN_SPELLINGS` (a bounded table: one entry per ATen op family)
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
import operator
import re
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from brcompile.backends.scan.op import linear_scan
from brcompile.passes.lower import checkpoint as checkpoints
from brcompile.passes.canonical.scans import linear as linear_scans
from brcompile.passes.analysis.axes import example_value
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.lower.functionalize import functionalize, writes_inverse_permutation
from brcompile.passes.analysis.guards import scalar_equals
from brcompile.passes.meta import CHECKPOINT_INDEX, CHECKPOINT_REGION
from brcompile.passes.spellings import copy_graph_module

log = logging.getLogger(__name__)

aten = torch.ops.aten
__all__ = ["lower", "respell", "ATEN_SPELLINGS", "lower_and_respell", "aten_ops"]

#: ``aten.slice``'s default end: "to the end of the dim".
_END = 2 ** 63 - 1
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}
_DROP = object()  # a respelling's answer for a node that is left out


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
    ``brcompile::tree_linear_scan`` over the chain parent and :func:`_chain_scan` writes back. A region not
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
# respelling: one canonical torch-level call per ATen op family

#: (op, target, args, kwargs) of the torch-level call, or an fx.Node / value the ATen node is replaced by.
Spelled = Any
Respell = Callable[[fx.Node, tuple, dict], Spelled]


#: keyword arguments that do not change a value (a layout or memory hint): dropped by every respelling
_HINTS = frozenset({"layout", "pin_memory", "memory_format", "non_blocking", "sparse_grad"})


def _kwargs(kwargs: dict, keep: tuple) -> Optional[dict]:
    """The keyword arguments kept (``keep``), or None when one that is neither kept nor a hint is there (the
    node then stays an ATen op: a respelling never drops an argument that changes the value)."""
    if any(k not in keep and k not in _HINTS for k in kwargs):
        return None
    return {k: v for k, v in kwargs.items() if k in keep}


def _fn(target, keep: tuple = ()) -> Respell:
    """``torch.<name>(*args)``: the same positional arguments; keyword arguments in ``keep`` are kept."""
    def respell(node, args, kwargs):
        kw = _kwargs(kwargs, keep)
        return None if kw is None else ("call_function", target, args, kw)
    return respell


def _method(name: str, star: bool = False, keep: tuple = ()) -> Respell:
    """``x.<name>(*args)``; ``star``: the second argument is a size list spread out (``x.view(*size)``)."""
    def respell(node, args, kwargs):
        kw = _kwargs(kwargs, keep)
        a = (args[0], *args[1]) if star else args
        return None if kw is None else ("call_method", name, tuple(a), kw)
    return respell


def _factory(target, op: str = "call_function") -> Respell:
    """A factory (``arange``, ``zeros``, ``full``, ``*_like``, ``scalar_tensor``; with ``op="call_method"`` the
    methods ``x.new_zeros(size)`` / ``new_ones`` / ``new_full(size, v)``, a fill in x's dtype and device unless
    given): layout and pin_memory dropped (the defaults: strided, unpinned), dtype and device kept."""
    def respell(node, args, kwargs):
        kw = {k: v for k, v in kwargs.items() if k in ("dtype", "device") and v is not None}
        return op, target, args, kw
    return respell


def _bound(node: fx.Node, args: tuple, kwargs: dict) -> dict:
    """Every argument of an ATen node by its schema name, defaults filled in."""
    out = {}
    for i, a in enumerate(node.target._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _identity(node, args, kwargs):
    return args[0]


def _dropped(node, args, kwargs):
    """``_assert_tensor_metadata`` (a no-op ``.to(dtype)``): a check of dtype and device, which the trace fixed
    and the packed value shares."""
    return _DROP


def _whole(start: Any, end: Any, step: Any) -> bool:
    """Whether ``aten.slice``'s ``start:end:step`` keeps the whole dim (0 or None, to ``_END`` or None, step 1)."""
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= _END)) and step in (1, None)


def _index_tuple(d: int, entry: Any) -> tuple:
    return (*([slice(None)] * d), entry)


def _slice(node, args, kwargs):
    """``aten.slice(x, d, start, end, step)`` → ``x[:, …, start:end:step]`` (the identity when it keeps the dim)."""
    b = _bound(node, args, kwargs)
    x, d, start, end, step = b["self"], b["dim"], b.get("start"), b.get("end"), b.get("step", 1)
    ndim = example_value(x).dim()
    d = d + ndim if d < 0 else d
    if _whole(start, end, step):
        return x
    start = None if start in (0, None) else start
    end = None if end is None or (isinstance(end, int) and end >= _END) else end
    step = None if step in (1, None) else step
    return "call_function", operator.getitem, (x, _index_tuple(d, slice(start, end, step))), {}


def _select(node, args, kwargs):
    """``aten.select(x, d, i)`` → ``x[:, …, i]``."""
    x, d, i = args
    ndim = example_value(x).dim()
    return "call_function", operator.getitem, (x, _index_tuple(d + ndim if d < 0 else d, i)), {}


def _index(node, args, kwargs):
    """``aten.index(x, [i0, None, i2])`` → ``x[i0, :, i2]``."""
    x, indices = args
    return "call_function", operator.getitem, (x, tuple(slice(None) if i is None else i for i in indices)), {}


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
        end = ev.shape[d] if end is None or (isinstance(end, int) and end >= _END) else end
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


def _slice_scatter(node, args, kwargs):
    """``aten.slice_scatter(x, src, d, start, end, step)``; a write of the whole of x is ``src`` itself (writes
    that cover a dim become a ``cat`` after the respelling: :func:`_fold_tiled_writes`)."""
    b = _bound(node, args, kwargs)
    x, src, d, start, end, step = b["self"], b["src"], b["dim"], b.get("start"), b.get("end"), b.get("step", 1)
    ev_x, ev_src = example_value(x), example_value(src)
    if _whole(start, end, step) and ev_x is not None and ev_src is not None and ev_x.shape == ev_src.shape and ev_x.dtype == ev_src.dtype:
        return src
    return "call_function", torch.slice_scatter, (x, src, d, start, end, step), {}


def _copy(node, args, kwargs):
    """Functional ``aten.copy(dst, src)``: src broadcast to dst's shape in dst's dtype — src itself when it has
    both already; otherwise it stays ``aten.copy`` (no rule: materialised)."""
    dst, src = args[:2]
    ev_d, ev_s = example_value(dst), example_value(src)
    if ev_d is not None and ev_s is not None and ev_d.shape == ev_s.shape and ev_d.dtype == ev_s.dtype:
        return src
    return None


def _index_put(node, args, kwargs):
    """Functional ``aten.index_put(inv, [p], arange(n))`` into ``inv = empty_like(p)``, p a permutation:
    ``argsort(p)``, the inverse permutation (MoE dispatch; passes/lower/functionalize.py's proof); ``x[mask] = v``
    (``index_put(x, [mask], v)``, a bool mask of x's shape, one value) is ``masked_fill(x, mask, v)``. Any other
    indexed write stays ATen (no rule: materialised)."""
    b = _bound(node, args, kwargs)
    indices, x, values = b["indices"], b["self"], b["values"]
    if b["accumulate"] or len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    if writes_inverse_permutation(x, indices[0], values):
        return "call_function", torch.argsort, (indices[0],), {}
    ev_x, ev_m, ev_v = example_value(x), example_value(indices[0]), example_value(values)
    if ev_x is not None and ev_m is not None and ev_m.dtype == torch.bool and ev_m.shape == ev_x.shape \
            and ev_v is not None and ev_v.dim() == 0:
        return "call_function", torch.masked_fill, (x, indices[0], values), {}
    return None


def _to(node, args, kwargs):
    """``aten.to`` (``.dtype``, ``.device``, ``.dtype_layout``) / ``aten._to_copy`` → ``x.to(dtype)``, or x itself
    without a dtype (the graph is functional: a copy is the value); a move to another device, or ``to.other``,
    stays ATen."""
    b = _bound(node, args, kwargs)
    x, dtype, device = b.get("self"), b.get("dtype"), b.get("device")
    ev = example_value(x)
    if "other" in b or ev is None or (device is not None and torch.device(device) != ev.device):
        return None
    if dtype is None or dtype == ev.dtype:
        return x
    return "call_method", "to", (x, dtype), {}


def _softmax(fn) -> Respell:
    def respell(node, args, kwargs):
        x, dim = args[:2]
        dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
        return "call_function", fn, (x, dim), ({"dtype": dtype} if dtype is not None else {})
    return respell


def _embedding(node, args, kwargs):
    """``aten.embedding(W, ids, padding_idx, scale_grad_by_freq, sparse)`` → ``F.embedding(ids, W, ...)``: the
    arguments that change the gradient (padding row, frequency scaling, sparse) are kept."""
    b = _bound(node, args, kwargs)
    weight, ids, pad = b["weight"], b["indices"], b["padding_idx"]
    kw = {"padding_idx": pad} if pad not in (-1, None) else {}
    kw.update({k: True for k in ("scale_grad_by_freq", "sparse") if b[k]})
    return "call_function", F.embedding, (ids, weight), kw


def _layer_norm(node, args, kwargs):
    a = _bound(node, args, kwargs)
    return "call_function", F.layer_norm, (a["input"], a["normalized_shape"], a["weight"], a["bias"], a["eps"]), {}


def _dropout(node, args, kwargs):
    b = _bound(node, args, kwargs)
    return "call_function", F.dropout, (b["input"], b["p"]), {"training": b["train"]}


def _sdpa(node, args, kwargs):
    return "call_function", F.scaled_dot_product_attention, args, dict(kwargs)


def _einsum(node, args, kwargs):
    eq, ops = args[:2]
    return "call_function", torch.einsum, (eq, *ops), {}


def _gelu(node, args, kwargs):
    approx = kwargs.get("approximate", "none")
    return "call_function", F.gelu, args[:1], ({"approximate": approx} if approx != "none" else {})


def _pad(node, args, kwargs):
    """``aten.constant_pad_nd(x, pad, v)`` / ``aten.pad(x, pad, mode, v)`` → ``F.pad``."""
    b = _bound(node, args, kwargs)
    if node.target is aten.constant_pad_nd.default:
        x, pad, value = b["self"], b["pad"], b["value"]
        return "call_function", F.pad, (x, pad), ({"value": value} if value != 0 else {})
    x, pad, mode, value = b["self"], b["pad"], b["mode"], b.get("value")
    kw = {"mode": mode} if mode != "constant" else {}
    if value not in (None, 0):
        kw["value"] = value
    return "call_function", F.pad, (x, pad), kw


def _cross_entropy(node, args, kwargs):
    b = _bound(node, args, kwargs)
    x, target, weight, reduction = b["self"], b["target"], b["weight"], b["reduction"]
    ignore_index, smoothing = b["ignore_index"], b["label_smoothing"]
    kw = {"reduction": _REDUCTION[reduction]}
    if weight is not None:
        kw["weight"] = weight
    if ignore_index != -100:
        kw["ignore_index"] = ignore_index
    if smoothing:
        kw["label_smoothing"] = smoothing
    return "call_function", F.cross_entropy, (x, target), kw


def _conv1d(node, args, kwargs):
    return "call_function", F.conv1d, args, {}


def _squeeze(node, args, kwargs):
    if len(args) == 1:
        return "call_method", "squeeze", args, {}
    x, dims = args[:2]
    if isinstance(dims, (list, tuple)):
        dims = dims[0] if len(dims) == 1 else tuple(dims)
    return "call_method", "squeeze", (x, dims), {}


def _reduction(target) -> Respell:
    """``aten.sum.dim_IntList(x, dims, keepdim, dtype=)`` → ``torch.sum(x, dims, keepdim, dtype=)``."""
    def respell(node, args, kwargs):
        kw = {"dtype": kwargs["dtype"]} if kwargs.get("dtype") is not None else {}
        return "call_function", target, args, kw
    return respell


def _add_sub(target) -> Respell:
    """``aten.add(a, b, alpha=c)`` → ``a + b`` when c is 1, else ``torch.add(a, b, alpha=c)``."""
    def respell(node, args, kwargs):
        alpha = kwargs.get("alpha", 1)
        if alpha == 1:
            return "call_function", target, args[:2], {}
        return "call_function", torch.add if target is operator.add else torch.sub, args[:2], {"alpha": alpha}
    return respell


def _div(node, args, kwargs):
    mode = kwargs.get("rounding_mode")
    if mode is None:
        return "call_function", operator.truediv, args[:2], {}
    return "call_function", torch.div, args[:2], {"rounding_mode": mode}


def _vector_norm(node, args, kwargs):
    """``aten.linalg_vector_norm(x, ord, dim, keepdim, dtype=)`` → ``torch.linalg.vector_norm`` (the same)."""
    b = _bound(node, args, kwargs)
    kw = {"dtype": b["dtype"]} if b.get("dtype") is not None else {}
    return "call_function", torch.linalg.vector_norm, (b["self"], b["ord"], b["dim"], b["keepdim"]), kw


def _chain_scan(node, args, kwargs):
    """``brcompile::tree_linear_scan(a, b, arange(-1, n - 1), dim)`` with n the length of ``dim`` — the tree
    of one chain per row, what the dense ``linear_scan(a, b, dim)`` traces to (backends/scan/op.py) —
    → ``linear_scan(a, b, dim)``; on any other parent (or impl) it stays the op."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    orig = _bound(node, node.args, node.kwargs)
    parent, dim, impl = orig["parent"], orig["dim"], orig["impl"]
    if impl != "auto" or not isinstance(parent, fx.Node) or parent.target not in (aten.arange.start,
                                                                                   aten.arange.start_step):
        return None
    start, step = parent.args[0], (parent.args[2] if len(parent.args) > 2 else 1)
    ev_a, ev_b, ev_p = example_value(orig["a"]), example_value(orig["b"]), example_value(parent)
    if start != -1 or step != 1 or ev_a is None or ev_b is None or ev_p is None or ev_p.dim() != 1:
        return None
    n = torch.broadcast_shapes(ev_a.shape, ev_b.shape)[dim]
    if not statically_known_true(ev_p.shape[0] == n):
        return None
    b = _bound(node, args, kwargs)
    return "call_function", linear_scan, (b["a"], b["b"], dim), {}


def _packet_table() -> dict:
    """ATen op packet -> respelling (see :data:`ATEN_SPELLINGS`)."""
    t: dict = {
        # identities of the lowering
        aten.alias: _identity, aten.lift_fresh_copy: _identity, aten.detach: _method("detach"),
        aten.copy: _copy, aten._assert_tensor_metadata: _dropped,
        # arithmetic and comparisons
        aten.add: _add_sub(operator.add), aten.sub: _add_sub(operator.sub), aten.mul: _fn(operator.mul),
        aten.div: _div, aten.rsub: _fn(torch.rsub, keep=("alpha",)), aten.neg: _fn(operator.neg),
        aten.pow: _fn(torch.pow), aten.remainder: _fn(torch.remainder), aten.fmod: _fn(torch.fmod),
        aten.floor_divide: _fn(torch.floor_divide),
        aten.eq: _fn(torch.eq), aten.ne: _fn(torch.ne), aten.lt: _fn(torch.lt), aten.le: _fn(torch.le),
        aten.gt: _fn(torch.gt), aten.ge: _fn(torch.ge),
        aten.maximum: _fn(torch.maximum), aten.minimum: _fn(torch.minimum),
        aten.max: _fn(torch.max), aten.min: _fn(torch.min),
        aten.clamp: _fn(torch.clamp), aten.clamp_min: _method("clamp_min"), aten.clamp_max: _method("clamp_max"),
        aten.where: _fn(torch.where), aten.masked_fill: _fn(torch.masked_fill),
        aten.logical_and: _fn(torch.logical_and), aten.logical_or: _fn(torch.logical_or),
        aten.logical_not: _fn(torch.logical_not), aten.bitwise_and: _fn(operator.and_),
        aten.bitwise_or: _fn(operator.or_), aten.bitwise_not: _fn(operator.invert),
        aten.lerp: _fn(torch.lerp), aten.atan2: _fn(torch.atan2),
        aten.addcmul: _fn(torch.addcmul, keep=("value",)), aten.addcdiv: _fn(torch.addcdiv, keep=("value",)),
        # unary math
        **{getattr(aten, n): _fn(getattr(torch, n)) for n in (
            "exp", "exp2", "expm1", "log", "log1p", "log2", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh",
            "sigmoid", "abs", "sign", "square", "reciprocal", "erf", "floor", "ceil", "round", "trunc", "relu",
            "isnan", "isinf", "isfinite", "nan_to_num", "real", "imag", "polar", "complex")},
        aten.silu: _fn(F.silu), aten.gelu: _gelu, aten.softplus: _fn(F.softplus),
        aten.log_sigmoid: _fn(F.logsigmoid),
        aten.dropout: _dropout,
        # casts and copies
        aten.to: _to, aten._to_copy: _to, aten.type_as: _method("type_as"), aten.clone: _method("clone"),
        aten.contiguous: _method("contiguous"),
        # layout
        # (a view of a packed value may not be one of the dense value: strides differ; reshape is the same
        # values wherever the view is valid)
        aten.view: _method("reshape", star=True), aten.reshape: _method("reshape", star=True),
        aten._unsafe_view: _method("reshape", star=True), aten.expand: _method("expand", star=True),
        aten.permute: _method("permute", star=True), aten.repeat: _method("repeat", star=True),
        aten.transpose: _method("transpose"), aten.t: _method("t"), aten.unsqueeze: _method("unsqueeze"),
        aten.squeeze: _squeeze, aten.flatten: _method("flatten"), aten.unflatten: _method("unflatten"),
        aten.movedim: _method("movedim"), aten.expand_as: _method("expand_as"),
        aten.view_as: _method("view_as"), aten.reshape_as: _method("reshape_as"),
        aten.view_as_complex: _fn(torch.view_as_complex), aten.view_as_real: _fn(torch.view_as_real),
        aten.repeat_interleave: _fn(torch.repeat_interleave, keep=("dim", "output_size")),
        aten.slice: _slice, aten.select: _select, aten.index: _index,
        aten.slice_scatter: _slice_scatter, aten.select_scatter: _fn(torch.select_scatter),
        aten.cat: _fn(torch.cat), aten.stack: _fn(torch.stack),
        aten.split: _method("split"), aten.split_with_sizes: _method("split"), aten.chunk: _method("chunk"),
        aten.unbind: _method("unbind"),
        aten.gather: _fn(torch.gather), aten.scatter: _fn(torch.scatter, keep=("reduce",)),
        aten.scatter_add: _fn(torch.scatter_add),
        aten.embedding: _embedding, aten.index_put: _index_put,
        # reductions, norms, scans
        aten.sum: _reduction(torch.sum), aten.mean: _reduction(torch.mean), aten.amax: _fn(torch.amax),
        aten.amin: _fn(torch.amin), aten.prod: _reduction(torch.prod), aten.logsumexp: _fn(torch.logsumexp),
        aten.argmax: _fn(torch.argmax), aten.argmin: _fn(torch.argmin), aten.topk: _fn(torch.topk),
        aten.sort: _fn(torch.sort, keep=("stable", "dim", "descending")),
        aten.argsort: _fn(torch.argsort, keep=("stable", "dim", "descending")), aten.histc: _fn(torch.histc),
        aten.linalg_vector_norm: _vector_norm, aten.cumsum: _reduction(torch.cumsum), aten.softmax: _softmax(F.softmax),
        aten.log_softmax: _softmax(F.log_softmax), aten.layer_norm: _layer_norm, aten.rms_norm: _fn(torch.rms_norm),
        aten.cross_entropy_loss: _cross_entropy,
        # contractions, convolutions, attention
        aten.linear: _fn(F.linear), aten.matmul: _fn(torch.matmul), aten.mm: _fn(torch.mm), aten.bmm: _fn(torch.bmm),
        aten.addmm: _fn(torch.addmm, keep=("beta", "alpha")), aten.baddbmm: _fn(torch.baddbmm, keep=("beta", "alpha")),
        aten.einsum: _einsum, aten.conv1d: _conv1d, aten.constant_pad_nd: _pad, aten.pad: _pad,
        aten.scaled_dot_product_attention: _sdpa,
        # factories
        aten.arange: _factory(torch.arange), aten.zeros: _factory(torch.zeros), aten.ones: _factory(torch.ones),
        aten.full: _factory(torch.full), aten.scalar_tensor: _factory(torch.scalar_tensor),
        aten.zeros_like: _factory(torch.zeros_like), aten.ones_like: _factory(torch.ones_like),
        aten.full_like: _factory(torch.full_like), aten.empty_like: _factory(torch.empty_like),
        aten.new_zeros: _factory("new_zeros", "call_method"), aten.new_ones: _factory("new_ones", "call_method"),
        aten.new_full: _factory("new_full", "call_method"),
        aten.tril: _fn(torch.tril), aten.triu: _fn(torch.triu),
        # the aliases torch keeps as ATen ops of their own (torch.concatenate, torch.swapaxes, torch.multiply, ...)
        aten.concatenate: _fn(torch.cat), aten.concat: _fn(torch.cat), aten.swapaxes: _method("transpose"),
        aten.swapdims: _method("transpose"), aten.moveaxis: _method("movedim"),
        aten.multiply: _fn(operator.mul), aten.divide: _div, aten.true_divide: _div,
        aten.subtract: _add_sub(operator.sub), aten.negative: _fn(operator.neg), aten.absolute: _fn(torch.abs),
        aten.clip: _fn(torch.clamp), aten.arctan2: _fn(torch.atan2), aten.fix: _fn(torch.trunc),
        aten.greater: _fn(torch.gt), aten.greater_equal: _fn(torch.ge), aten.less: _fn(torch.lt),
        aten.less_equal: _fn(torch.le), aten.not_equal: _fn(torch.ne),
        aten.__and__: _fn(operator.and_), aten.__or__: _fn(operator.or_), aten.__xor__: _fn(operator.xor),
        aten.bitwise_xor: _fn(operator.xor), aten.logical_xor: _fn(torch.logical_xor),
        # brcompile's own ops, as the dense functions the scan canonicalisations wrote traced them
        torch.ops.brcompile.tree_linear_scan: _chain_scan,
    }
    return t


#: Every ATen op family the analysis reads at the ATen level, and the torch-level call it is written as.
#: An op not listed keeps its ATen target (no rule: materialised).
ATEN_SPELLINGS: dict = _packet_table()


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
    """``gm`` (an ATen graph) with every op of :data:`ATEN_SPELLINGS` written as its torch-level call (step 2
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
        rule = ATEN_SPELLINGS.get(packet) if packet is not None else None
        if rule is None:
            env[n] = graph.node_copy(n, lambda a: env[a])
            continue
        args = fx.map_arg(n.args, lambda a: env[a])
        kwargs = fx.map_arg(n.kwargs, lambda a: env[a])
        out = rule(n, args, kwargs)
        if out is _DROP:
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
