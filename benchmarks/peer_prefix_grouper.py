"""PrefixGrouper (``pip install prefix-grouper``), the published peer, on the example GPT and GRPO loss.

PrefixGrouper is used through its own API: the batch regrouped as one row per prompt
``[prompt, response_1, ..., response_G]`` with rotary positions restarting at P for every response
(:func:`group_batch`), every attention routed through ``PrefixGrouper.forward(attn_func, q, k, v)`` with an
``attn_func`` that applies its key-padding mask and bottom-right-aligned causal masking
(:func:`prefix_grouper_attn_func`), the logits split back with ``split_output(..., include_prefix_last=1)``
and the same GRPO loss computed from the response log-probabilities (:func:`prefix_grouper_grpo_loss`).
Routing the attentions needs the model's forward written out (:func:`prefix_grouper_logits`): that is the
model edit PrefixGrouper asks of its users.

(The module is named ``peer_prefix_grouper`` so that it never shadows the installed ``prefix_grouper``.)
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch
import torch.nn.functional as F

from examples.gpt import apply_rotary_pos_emb, repeat_kv
from examples.grpo import grpo_surrogate


class PrefixGrouperError(ValueError):
    """A batch PrefixGrouper's layout cannot express (rows of a group that do not share their prompt ...)."""


def _package():
    """The installed ``prefix_grouper`` package (ImportError when it is missing)."""
    return importlib.import_module("prefix_grouper")


def status() -> tuple[bool, str]:
    """(usable, a line saying which version or why not)."""
    try:
        pkg = _package()
    except ImportError as e:
        return False, f"prefix_grouper is not installed (pip install prefix-grouper): {e}"
    return True, f"prefix_grouper {getattr(pkg, '__version__', '?')}"


@dataclasses.dataclass
class GroupedBatch:
    """A GRPO batch in PrefixGrouper's layout: one row per prompt, ``[prompt, response_1, ..., response_G]``.

    ``grouper``: the ``prefix_grouper.PrefixGrouper`` of ``group_info = [[P_g, T_g1, ..., T_gG], ...]``;
    ``input_ids``/``position_ids`` [groups, Lg] (right-padded; every response's positions restart at P_g);
    ``response_ids`` [B, T_max] (0 past a row's end, in group order); the scatter ``logp[rows, cols] =
    logp_resp[srows, steps]`` puts response log-probs back at the dense next-token positions ``t = P_g - 1 + j``
    (``rows``: the batch row, ``srows``: its place among the suffixes).
    """

    grouper: Any
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    response_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    steps: torch.Tensor
    srows: torch.Tensor


def group_batch(batch: dict, group_size: int) -> GroupedBatch:
    """Regroups a ``make_grpo_batch`` batch (prompts left-aligned, responses right after, right padding) for
    PrefixGrouper, ``group_size`` consecutive rows a group; raises :class:`PrefixGrouperError` when the rows of a
    group do not share their prompt."""
    B = batch["input_ids"].shape[0]
    if B % group_size:
        raise PrefixGrouperError(f"{B} rows are not whole groups of {group_size}")
    return _grouped(batch, [list(range(r0, r0 + group_size)) for r0 in range(0, B, group_size)])


def group_by_prompt(batch: dict) -> GroupedBatch:
    """Regroups any rows of a ``make_grpo_batch`` batch (a micro-batch of shuffled rows) for PrefixGrouper: the
    rows that share their prompt form one group, in order of first appearance (PrefixGrouper shares within a
    call only: a prompt whose rows are in other calls is recomputed there)."""
    ids, am, cm = batch["input_ids"], batch["attention_mask"].bool(), batch["completion_mask"].bool()
    groups: dict[tuple, list[int]] = {}
    for b in range(ids.shape[0]):
        P = int((am[b] & ~cm[b]).sum())
        groups.setdefault(tuple(ids[b, :P].tolist()), []).append(b)
    return _grouped(batch, list(groups.values()))


def _grouped(batch: dict, groups: list[list[int]]) -> GroupedBatch:
    """The rows ``groups`` (each a list of row indices sharing one prompt) in PrefixGrouper's layout."""
    PrefixGrouper = _package().PrefixGrouper

    ids, am, cm = batch["input_ids"], batch["attention_mask"].bool(), batch["completion_mask"].bool()
    prompt_mask = am & ~cm
    T_max = int(cm.sum(1).max())
    info, grouped, positions, responses, rows, srows, cols, steps = [], [], [], [], [], [], [], []
    for g, group in enumerate(groups):
        r0 = group[0]
        P = int(prompt_mask[r0].sum())
        prompt = ids[r0, :P]
        parts, pos, lens = [prompt], [torch.arange(P)], []
        for b in group:
            T = int(cm[b].sum())
            if (int(prompt_mask[b].sum()) != P or not bool(prompt_mask[b, :P].all())
                    or not torch.equal(ids[b, :P], prompt) or not bool(cm[b, P:P + T].all())):
                raise PrefixGrouperError(f"row {b} does not share group {g}'s left-aligned prompt followed by "
                                         f"its response")
            resp = ids[b, P:P + T]
            parts.append(resp)
            pos.append(torch.arange(P, P + T))
            lens.append(T)
            srows += [len(responses)] * T  # the row's place among PrefixGrouper's suffixes (group order)
            responses.append(F.pad(resp, (0, T_max - T)))
            rows += [b] * T
            cols += range(P - 1, P - 1 + T)
            steps += range(T)
        info.append([P, *lens])
        grouped.append(torch.cat(parts))
        positions.append(torch.cat(pos).to(ids.device))
    Lg = max(len(r) for r in grouped)
    device = ids.device
    return GroupedBatch(
        grouper=PrefixGrouper(group_info=info, device=device, padding_mode="right"),
        input_ids=torch.stack([F.pad(r, (0, Lg - len(r))) for r in grouped]),
        position_ids=torch.stack([F.pad(p, (0, Lg - len(p))) for p in positions]),
        response_ids=torch.stack(responses),
        rows=torch.tensor(rows, device=device), cols=torch.tensor(cols, device=device),
        steps=torch.tensor(steps, device=device), srows=torch.tensor(srows, device=device),
    )


def prefix_grouper_attn_func(q, k, v, key_mask, n_rep: int = 1):
    """PrefixGrouper's ``attn_func``: q [b, H, Lq, D], k/v [b, Hkv, Lk, D], ``key_mask`` [b, Lk] (True = a real
    key). Causal masking aligned bottom-right (query i sees key j iff j <= i + Lk - Lq: the suffix queries
    come after the Lk - Lq prefix keys), and the key-padding mask. Returns [b, Lq, H, D], as it expects."""
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    Lq, Lk = q.shape[2], k.shape[2]
    causal = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(Lk - Lq)
    mask = causal[None, None] & key_mask.bool()[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def prefix_grouper_logits(model, gb: GroupedBatch) -> torch.Tensor:
    """The example GPT's forward (``examples.gpt.GPT``) on the grouped batch, each attention through
    ``PrefixGrouper.forward``; rotary tables from ``gb.position_ids``. Logits [groups, Lg, V]."""
    h = model.tok_emb(gb.input_ids)
    inv_freq = model.inv_freq if model.inv_freq.dtype == torch.float64 else model.inv_freq.float()
    freqs = gb.position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(h.dtype)[:, None], emb.sin().to(h.dtype)[:, None]  # [groups, 1, Lg, D]
    for layer in model.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        G, Lg, _ = x.shape
        q = a.q_proj(x).view(G, Lg, a.n_heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(G, Lg, a.n_kv_heads, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(G, Lg, a.n_kv_heads, a.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = gb.grouper.forward(prefix_grouper_attn_func, q, k, v, n_rep=a.n_rep)  # [groups, Lg, H, D]
        h = h + a.o_proj(out.reshape(G, Lg, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.logits(model.norm(h))


def prefix_grouper_grpo_loss(model, gb: GroupedBatch, batch: dict, clip_eps: float = 0.2) -> torch.Tensor:
    """The GRPO loss of ``batch`` computed PrefixGrouper's way: grouped forward, ``split_output(logits,
    include_prefix_last=1)`` (the last prompt token predicts the first response token), response log-probs
    scattered to the dense next-token positions, then :func:`grpo_surrogate`."""
    logits = prefix_grouper_logits(model, gb)
    _, _, suffix, _ = gb.grouper.split_output(logits, include_prefix_last=1)  # [B, 1 + T_max, V]
    logp_resp = torch.log_softmax(suffix[:, :-1], dim=-1).gather(-1, gb.response_ids[..., None]).squeeze(-1)
    B, L = batch["input_ids"].shape
    logp = logp_resp.new_zeros(B, L - 1).index_put((gb.rows, gb.cols), logp_resp[gb.srows, gb.steps])
    return grpo_surrogate(logp, batch["completion_mask"], batch["advantages"], batch["old_logprobs"], clip_eps)
