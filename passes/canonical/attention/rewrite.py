"""Rewriting a matched chain as ``scaled_dot_product_attention`` with its features, and what such a canonical
attention computes (:func:`canonical_attention`, used by the probes)."""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from brcompile.passes.analysis.axes import example_value
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.meta import CANONICAL, SOFTCAP
from brcompile.passes.analysis.rules.attention import sdpa_bind
from brcompile.passes.canonical.attention.bias import key_bias, mark_relative, relative_step
from brcompile.passes.canonical.attention.common import Canonical, EagerChain, call
from brcompile.passes.canonical.attention.masks import canonical_mask

log = logging.getLogger(__name__)


def replace_with_sdpa(graph: fx.Graph, ch: EagerChain, canon: Canonical,
                       values: Optional[dict] = None) -> list[fx.Node]:
    """Insert ``scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c, dropout_p=p)`` after the
    chain's output matmul, redirect its users, erase the chain. Returns the node if it has a mask. A per-key
    bias computed from trainable tensors (:func:`key_bias`) becomes one more q/k feature."""
    scale = ch.scale
    if isinstance(scale, tuple):  # division by c
        c = scale[1]
        if isinstance(c, fx.Node):  # 1.0 / x.item(): resolved to a constant by specialise_scalars
            with graph.inserting_after(c):
                scale = graph.call_function(operator.truediv, (1.0, c))
        else:
            scale = 1.0 / c
    p = ch.dropout_p if ch.dropout_training is not False else 0.0
    width = None
    with graph.inserting_before(ch.out):
        q, k, v = (x if dims is None else call(graph, "permute", (x, *dims))
                   for x, dims in ((ch.q, ch.q_dims), (ch.k, ch.k_dims), (ch.v, ch.v_dims)))
        ch = dataclasses.replace(ch, q=q, v=v, q_dims=None, v_dims=None)
        keyed = key_bias(graph, ch, k, scale, values or {})
        if keyed is not None:
            (q, k, v), masks, width, _ = keyed
            ch = dataclasses.replace(ch, masks=masks)
        relative = relative_step(graph, ch, values or {})
        if relative is not None:
            masks, relative = relative
            ch = dataclasses.replace(ch, masks=masks)
        mask = canonical_mask(graph, ch)
    kwargs = {"attn_mask": mask, "dropout_p": p, "is_causal": False, "scale": scale}
    if ch.sinks is not None:  # read by attention.emit_sdpa and canonical_attention (the probes)
        kwargs["br_sinks"] = ch.sinks
    if relative is not None:
        kwargs["br_relbias"] = relative[0]
    with graph.inserting_after(ch.out):
        node = graph.call_function(F.scaled_dot_product_attention, (q, k, v), kwargs)
    node.meta.update(ch.out.meta)
    out = _attention_output_value(ch)
    node.meta["example_value"] = out
    CANONICAL.set(node, "eager attention")
    if relative is not None:
        mark_relative(node, relative, canon)
    if ch.softcap:
        SOFTCAP.set(node, ch.softcap)
    chain = " -> ".join(n.name for n in reversed(ch.dead))
    result = node
    if width is not None:  # the values carry one zero feature for the key bias: drop it from the output
        node.meta["example_value"] = torch.cat([out, out[..., :1]], -1) if out is not None else None
        with graph.inserting_after(node):
            result = graph.call_function(operator.getitem, (node, (Ellipsis, slice(None, width))))
        result.meta["example_value"] = out
        canon.notes.append(f"{node.name}: per-key bias {keyed[3].name} as one more q/k feature")
    if ch.out_dims is not None:  # the einsum's output layout ([B, L, H, D]) of the [B, H, Lq, D] attention output
        with graph.inserting_after(result):
            result = call(graph, "permute", (result, *ch.out_dims))
    if ch.merged_out:  # the users read the [B*H, Lq, D] product: the [B, H, Lq, D] output with (B, H) merged
        node.meta["example_value"] = example_value(ch.out).unflatten(0, (-1, ch.heads))
        with graph.inserting_after(node):
            result = call(graph, "flatten", (node, 0, 1))
    ch.out.replace_all_uses_with(result)
    for n in ch.dead:
        if not n.users:
            graph.erase_node(n)
    # k^T (and a no-longer-used repeat_kv) become dead: removed by the final dead-code pass.
    canon.notes.append(f"{node.name}: eager attention {chain} -> scaled_dot_product_attention")
    log.debug("canonical attention %s from eager chain %s", node.name, chain)
    return [node] if mask is not None else []


def _attention_output_value(ch: EagerChain) -> Optional[torch.Tensor]:
    """The example value of the chain's [B, H, Lq, D] attention output: ``out``'s, with its einsum layout
    ``out = o.permute(out_dims)`` undone (``o = out.permute(argsort(out_dims))``)."""
    out = example_value(ch.out)
    if out is None or ch.out_dims is None:
        return out
    return out.permute(tuple(sorted(range(4), key=ch.out_dims.__getitem__)))


def canonical_attention(node: fx.Node, args: tuple, kwargs: dict) -> torch.Tensor:
    """What the canonical attention ``node`` computes, on real values ``args``/``kwargs`` (its own, mapped):
    ``o = softmax(cap · tanh(c · q kᵀ / cap) + M [, S]) v`` with the sink logit ``S`` (``br_sinks``) a
    value-less last column dropped after the softmax, the soft-cap ``cap`` (``node.meta["br_softcap"]``) only
    where there is one, ``M`` a float mask added (``-inf`` blocks) or a bool mask (False blocks), and a query
    row with no visible key and no sink 0 — tree attention's value there (the original's value on such a row
    is a padding query's, which the guards keep out of every replayed call).

    The canonical copy is analysed, not run as a whole; its probes (:func:`..masks.evaluate`: a mask or a
    repacked region computed from an earlier attention's output, HY-V4's top-k index over the hidden states)
    evaluate the attention by this meaning, not by the ``scaled_dot_product_attention`` call it is spelled as
    (that call takes neither the sinks nor the soft-cap). A random dropout has no single value: refused."""
    a = sdpa_bind(args, kwargs)
    q, k, v, M = a["query"], a["key"], a["value"], a["attn_mask"]
    if a["dropout_p"]:
        raise CannotReplay(Code.ATTENTION_DROPOUT,
                           f"a probe evaluates {node.name}, an attention with dropout (p={a['dropout_p']}): "
                           "random, it has no single value", node)
    if a["enable_gqa"] and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scale = a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    cap = float(SOFTCAP.get(node, 0.0) or 0.0)
    if cap:
        s = torch.tanh(s / cap) * cap
    if a["is_causal"]:
        Lq, Lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if M is not None:
        s = s.masked_fill(~M, float("-inf")) if M.dtype == torch.bool else s + M
    S = a.get("br_sinks")
    if S is not None:
        column = S.reshape(1, -1, 1, 1) if S.dim() == 1 else S
        s = torch.cat([s, column.to(s.dtype).expand(*s.shape[:-1], 1)], -1)
    seen = s.amax(-1, keepdim=True) > float("-inf")
    p = torch.softmax(s.masked_fill(~seen, 0.0), -1).masked_fill(~seen, 0.0)
    if S is not None:
        p = p[..., :-1]
    return torch.matmul(p.to(v.dtype), v)
