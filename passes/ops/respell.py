"""Respelling builders: how an op record writes an ATen op back as the torch-level call the rules read.

A respelling is ``respell(node, args, kwargs)`` for an ATen node (``args`` / ``kwargs`` already mapped into the
new graph) and answers one of: ``(op, target, args, kwargs)``, the torch-level call; a node or value that
replaces it (an identity of the lowering); :data:`DROP` (the node is left out); None (it stays the ATen op: no
rule reads it, so the analysis materialises its token operands). A respelling never drops an argument that
changes the value (:func:`kwargs_kept`). passes/lower/aten.py applies them (``respell``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["DROP", "END", "Respell", "bound", "factory", "fn", "identity", "index_tuple", "kwargs_kept", "method",
           "torch_fns", "whole"]

#: (op, target, args, kwargs) of the torch-level call, or an fx.Node / value the ATen node is replaced by.
Respell = Callable[[Any, tuple, dict], Any]

#: ``aten.slice``'s default end: "to the end of the dim".
END = 2 ** 63 - 1
DROP = object()  # a respelling's answer for a node that is left out

#: keyword arguments that do not change a value (a layout or memory hint): dropped by every respelling
_HINTS = frozenset({"layout", "pin_memory", "memory_format", "non_blocking", "sparse_grad"})


def torch_fns(*names: str) -> tuple:
    """``torch.<name>`` callables that exist in this torch build (aliases come and go between versions)."""
    out = []
    for name in names:
        obj: Any = torch
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        out.append(obj)
    return tuple(out)


def kwargs_kept(kwargs: dict, keep: tuple) -> Optional[dict]:
    """The keyword arguments kept (``keep``), or None when one that is neither kept nor a hint is there (the
    node then stays an ATen op: a respelling never drops an argument that changes the value)."""
    if any(k not in keep and k not in _HINTS for k in kwargs):
        return None
    return {k: v for k, v in kwargs.items() if k in keep}


def fn(target, keep: tuple = ()) -> Respell:
    """``torch.<name>(*args)``: the same positional arguments; keyword arguments in ``keep`` are kept."""
    def respell(node, args, kwargs):
        kw = kwargs_kept(kwargs, keep)
        return None if kw is None else ("call_function", target, args, kw)
    return respell


def method(name: str, star: bool = False, keep: tuple = ()) -> Respell:
    """``x.<name>(*args)``; ``star``: the second argument is a size list spread out (``x.view(*size)``)."""
    def respell(node, args, kwargs):
        kw = kwargs_kept(kwargs, keep)
        a = (args[0], *args[1]) if star else args
        return None if kw is None else ("call_method", name, tuple(a), kw)
    return respell


def factory(target, op: str = "call_function") -> Respell:
    """A factory (``arange``, ``zeros``, ``full``, ``*_like``, ``scalar_tensor``; with ``op="call_method"`` the
    methods ``x.new_zeros(size)`` / ``new_ones`` / ``new_full(size, v)``, a fill in x's dtype and device unless
    given): layout and pin_memory dropped (the defaults: strided, unpinned), dtype and device kept."""
    def respell(node, args, kwargs):
        kw = {k: v for k, v in kwargs.items() if k in ("dtype", "device") and v is not None}
        return op, target, args, kw
    return respell


def identity(node, args, kwargs):
    """The operand itself (``alias``, ``lift_fresh_copy``: the graph is functional, a copy is the value)."""
    return args[0]


def bound(node, args: tuple, kwargs: dict) -> dict:
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


def whole(start: Any, end: Any, step: Any) -> bool:
    """Whether ``aten.slice``'s ``start:end:step`` keeps the whole dim (0 or None, to :data:`END` or None,
    step 1)."""
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= END)) and step in (1, None)


def index_tuple(d: int, entry: Any) -> tuple:
    """The index ``[:, …, entry]`` with ``entry`` at dim d."""
    return (*([slice(None)] * d), entry)
