"""Soundness check of a packed graph: it must work for every packed token count N.

A packed graph computes TOKEN values on ``[1, N, ...]`` data for whatever N the batch's tree has. A rewrite
that left a batch-sized dim behind (a position table expanded over rows, a view with the example's sizes
baked in) works, if at all, for one N only — and would crash or compute garbage on the next batch. So after
every rewrite the packed graph is propagated on fake tensors with N a symbol of its own
(:func:`symbolic_run`): an op that fails there, or that fixes N to a number (a view to the example's
``[1, 130, 4, 8]``: the shape environment then replaces N by 130), is a ``CannotReplay`` at compile time,
never a run-time crash.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from brcompile.passes.refusals import CannotReplay, Code
from brcompile.runtime.tree import TOKEN_ARRAYS, tree_placeholders

__all__ = ["symbolic_run", "check_packed_graph", "token_positions"]


def token_positions(gm: fx.GraphModule) -> dict[str, int]:
    """Argument position of each per-packed-token array (``TokenArrays``) among ``gm``'s placeholders."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    at = {p: i for i, p in enumerate(placeholders)}
    return {name: at[n] for name, n in zip(TOKEN_ARRAYS, tree_placeholders(gm).tokens)}


def symbolic_run(gm: fx.GraphModule, args: Sequence[Any], token_positions: dict[str, int]):
    """Fake-tensor propagation with the packed token count N symbolic; returns N's sympy symbol.

    Tree arrays get a dynamic dim 0; the shape environment gives equal sizes one symbol (duck sizing),
    so every value's N-sized dims show as that symbol. An example tree of one packed token (every row of a
    graph over flattened tokens equal) keeps N a symbol too: sizes 0 and 1 are then not specialised."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    n = args[token_positions["position"]].shape[0]
    mode = FakeTensorMode(shape_env=ShapeEnv(specialize_zero_one=n > 1), allow_non_fake_inputs=True)
    fakes = []
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            fakes.append(a)
            continue
        dynamic = i in token_positions.values()
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if (dynamic and d == 0) else
                                                      DimDynamic.STATIC for d in range(a.dim())])
        fakes.append(mode.from_tensor(a, symbolic_context=ctx, source=ConstantSource(f"arg{i}")))
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    # the tree arrays' sizes were unified by the ops that combine them (guards s_i == s_j)
    return mode.shape_env, fakes[token_positions["position"]].shape[0].node.expr


def check_packed_graph(packed: fx.GraphModule, example_args: Sequence[Any]) -> None:
    """CannotReplay unless ``packed`` propagates with a symbolic N without fixing it (module docstring).
    ``example_args``: the original inputs followed by the example batch's tree arrays."""
    try:
        env, n_sym = symbolic_run(packed, example_args, token_positions(packed))
    except CannotReplay:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise CannotReplay(Code.PACKED_COUNT,
                           f"the packed graph does not hold for every packed token count N ({type(e).__name__}: "
                           f"{first}): a value kept a batch-sized dim (e.g. positions expanded over rows) or a "
                           "view baked the example's sizes") from e
    fixed = env.simplify(n_sym)
    if fixed.is_number:
        culprit = next((n for n in packed.graph.nodes for v in [n.meta.get("val")]
                        if isinstance(v, torch.Tensor) and any(
                            isinstance(s, int) and s == int(fixed) for s in v.shape)), None)
        raise CannotReplay(Code.PACKED_COUNT,
                           f"the packed graph only holds for N = {int(fixed)} packed tokens (the example batch's): "
                           "a value kept a batch-sized dim or a view baked the example's sizes"
                           + (f"; first at {culprit.format_node()}" if culprit is not None else ""))
