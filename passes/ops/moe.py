"""Mixture-of-experts routing and dispatch: top-k, one-hot, scatters, arg-extrema, sorts, counts, grouped products.

Their token-axis rules (passes/analysis/rules/moe.py) prove routing per token and the sort-based dispatch over
flattened tokens (token-local regions).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brcompile.passes.ops.registry import register_op
from brcompile.passes.ops.respell import fn

aten = torch.ops.aten

register_op("topk", spellings=(torch.topk, "topk"), aten=(aten.topk,), respell=fn(torch.topk), axes="topk")
register_op("one_hot", spellings=(F.one_hot,), axes="one_hot")
register_op("scatter", spellings=(torch.scatter, "scatter"), aten=(aten.scatter,),
            respell=fn(torch.scatter, keep=("reduce",)), axes="scatter")
register_op("scatter_add", spellings=(torch.scatter_add, "scatter_add"), aten=(aten.scatter_add,),
            respell=fn(torch.scatter_add), axes="scatter")
for _name in ("argmax", "argmin"):
    register_op(_name, spellings=(getattr(torch, _name), _name), aten=(getattr(aten, _name),),
                respell=fn(getattr(torch, _name)), axes="argmax")
for _name in ("sort", "argsort"):
    register_op(_name, spellings=(getattr(torch, _name), _name), aten=(getattr(aten, _name),),
                respell=fn(getattr(torch, _name), keep=("stable", "dim", "descending")), axes="sort")
register_op("histc", spellings=(torch.histc, "histc"), aten=(aten.histc,), respell=fn(torch.histc), axes="histc")
#: torch's ``_grouped_mm`` / ``F.grouped_mm`` where this build has them, and the transformers fallback custom op by
#: its qualified name (matched by name: the library defining it need not be loaded)
register_op("grouped_mm", spellings=tuple(t for t in (getattr(torch, "_grouped_mm", None),
                                                      getattr(F, "grouped_mm", None)) if t is not None)
            + ("transformers::grouped_mm_fallback",), axes="grouped_mm")
