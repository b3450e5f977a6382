"""Attention scalars (scale, dropout probability) computed from graph inputs, specialised to their example values
under a guard."""
from __future__ import annotations

import numbers
import operator

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import hint
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.analysis.guards import scalar_equals
from brcompile.passes.analysis.rules.attention import sdpa_args
from brcompile.passes.spellings import arg
from brcompile.passes.canonical.attention.common import Canonical, set_sdpa_arg


def specialise_scalars(node: fx.Node, placeholders: list[fx.Node], values: dict, canon: Canonical) -> None:
    """Replace a node-valued ``dropout_p``/``scale`` of an SDPA node by its value, under a guard."""
    a = sdpa_args(node)
    for name in ("dropout_p", "scale"):
        arg = a[name]
        if not isinstance(arg, fx.Node):
            continue
        value, guard_src = scalar_value(arg, placeholders, values)
        if value is None:
            raise CannotReplay(Code.ATTENTION_SCALAR,
                               f"attention {name} is computed in the graph, not read from a scalar input",
                               node)
        pos, transform = guard_src
        what = f"attention {name} of {node.name}"
        expected = transform(value)
        canon.guards.append(scalar_equals(pos, value, f"{what} (input {placeholders[pos].name})"))
        set_sdpa_arg(node, name, expected)
        canon.notes.append(f"{node.name}: {name} specialised to {expected}")


def specialise_dropout(node: fx.Node, placeholders: list[fx.Node], values: dict, canon: Canonical) -> None:
    """A hidden-state dropout whose ``p`` is a scalar input (``dynamic=True``): its value, under a guard
    (the dropout rule then sees a number: identity at 0, refused otherwise)."""
    in_args = len(node.args) > 1
    p = node.args[1] if in_args else node.kwargs.get("p")
    training = arg(node, 2, "training", True)
    if not isinstance(p, fx.Node) or training is False:
        return  # a number, or an identity whatever p is
    value, src = scalar_value(p, placeholders, values)
    if value is None:
        return  # left to the dropout rule, which refuses a non-constant p
    pos, transform = src
    canon.guards.append(scalar_equals(pos, value, f"dropout p of {node.name} (input {placeholders[pos].name})"))
    if in_args:
        node.args = (node.args[0], transform(value)) + tuple(node.args[2:])
    else:
        node.kwargs = {**node.kwargs, "p": transform(value)}
    canon.notes.append(f"{node.name}: p specialised to {transform(value)}")


def scalar_value(arg: fx.Node, placeholders, values):
    """(value of the scalar input, (placeholder position, f)) for ``arg`` = ``x.item()``,
    ``1.0 / x.item()`` or a scalar placeholder ``x``; f maps the input's value to ``arg``'s."""
    ident = lambda v: v  # noqa: E731
    recip = lambda v: 1.0 / v  # noqa: E731
    f = ident
    n = arg
    if n.op == "call_function" and n.target is operator.truediv and n.args[0] == 1.0 and isinstance(
            n.args[1], fx.Node):
        f, n = recip, n.args[1]
    if n.op == "call_method" and n.target == "item" and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    if n.op != "placeholder" or n not in values:
        return None, None
    v = values[n]
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            return None, None
        v = v.item()
    v = hint(v)
    if not isinstance(v, numbers.Number):
        return None, None
    return v, (placeholders.index(n), f)
