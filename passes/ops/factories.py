"""New tensors and their sizes: ``arange`` (token positions), constant fills, triangles, ``size``.

``arange(L)`` along the positions becomes the tree's positions (rule ``arange``, passes/analysis/rules/positions.py);
a size read of a token dim becomes N (rule ``size``). The other factories make constants.
"""
from __future__ import annotations

import torch

from brcompile.passes.ops.registry import register_op
from brcompile.passes.ops.respell import factory, fn

aten = torch.ops.aten

register_op("arange", spellings=(torch.arange,), aten=(aten.arange,), respell=factory(torch.arange), axes="arange")
register_op("size", spellings=("size", aten.sym_size.int), axes="size")
for _name in ("zeros", "ones", "full", "scalar_tensor"):
    register_op(_name, aten=(getattr(aten, _name),), respell=factory(getattr(torch, _name)))
for _name in ("tril", "triu"):
    register_op(_name, aten=(getattr(aten, _name),), respell=fn(getattr(torch, _name)))
