"""Padding-free batches: the mask of several sequences packed into one row, proven on probe position ids
(restarting at 0 per sequence), and its per-call guard (:func:`sequences_guard`)."""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes import probe
from brcompile.passes.probe import sequence_positions
from brcompile.passes.refusals import CannotReplay
from brcompile.passes.analysis.masks.probes import Trial
from brcompile.passes.analysis.masks.values import MaskInfo, evaluate, split_bias

log = logging.getLogger(__name__)

#: Start probabilities of the well-formed position-id patterns of :func:`sequence_meaning` (0: one sequence
#: per row; 1: every token its own sequence).
SEQUENCE_PATTERNS = (0.0, 0.15, 0.4, 1.0)


def sequence_meaning(attn: fx.Node, mask: fx.Node, inputs: Sequence[fx.Node],
                      trials: Sequence[Trial]) -> Optional[MaskInfo]:
    """``causal+sequences(P)`` for the first integer tree input P for which the mask is causal within the
    sequences that P's 0s start, on every trial size with P replaced by well-formed position ids
    (:data:`SEQUENCE_PATTERNS`, the other inputs as in the trial: key padding there must not change it);
    None when there is none. Well-formed P is all the runtime replays (:func:`sequences_guard`)."""
    gen = probe.generator(1)
    for P in inputs:
        dtype = getattr(trials[0].values[P], "dtype", None) if trials else None
        if dtype is None or dtype.is_floating_point or dtype == torch.bool:
            continue
        ok = True
        for t in trials:
            Bp, Lp = t.size
            for p_start in SEQUENCE_PATTERNS:
                values = dict(t.values)
                pos = sequence_positions(Bp, Lp, p_start, gen)
                values[P] = pos.to(device=t.values[P].device, dtype=dtype)
                try:
                    vis = split_bias(evaluate(mask, values, t.literal), attn)[0]
                except CannotReplay:
                    raise
                except Exception:  # evaluable on the trial's values, not on these: not this meaning
                    log.debug("mask of %s: cannot be evaluated on packed-sequence positions", attn.name, exc_info=True)
                    ok = False
                    break
                if not _matches_sequences(vis, pos):
                    ok = False
                    break
            if not ok:
                break
        if ok and trials:
            return MaskInfo("causal+sequences", sequences=P)
    return None


def _matches_sequences(vis: torch.Tensor, pos: torch.Tensor) -> bool:
    """``vis`` [.., B, .., L, L] is exactly "j <= i within the sequence of (b, i)", sequences started by
    the 0s of ``pos`` [B, L]."""
    if vis.dim() < 2 or vis.shape[-1] != vis.shape[-2] or vis.shape[-1] != pos.shape[1]:
        return False
    L = pos.shape[1]
    seq = (pos == 0).cumsum(dim=1).to(vis.device)  # [B, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=vis.device).tril()
    expected = causal[None, None] & (seq[:, None, :, None] == seq[:, None, None, :])  # [B, 1, L, L]
    try:
        a, b = torch.broadcast_tensors(vis, expected)
    except RuntimeError:
        return False
    return bool((a == b).all())
