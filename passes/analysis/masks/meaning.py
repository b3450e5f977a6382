"""A mask's meaning from its probe evaluations (:func:`classify`): causal, causal and key padding, a sliding window,
or refused; the per-call guards of what was proven at the example values (:func:`meaning_guard`)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import torch
import torch.fx as fx

from brcompile.passes.analysis.axes import example_value, is_static_input
from brcompile.passes.probe import ancestors
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.analysis.masks.alibi import alibi_meaning, followed_input, perturbed_parameters
from brcompile.passes.analysis.masks.probes import (
    Probes, Scaling, Trial, free_nodes, is_symbolic, probe_lengths, size_constants,
)
from brcompile.passes.analysis.masks.sequences import sequence_meaning
from brcompile.passes.analysis.masks.values import (
    BASE_LENGTHS, MAX_PROBE_ELEMENTS, MaskInfo, PROBE_ROWS, SHORT_PROBE_ELEMENTS, evaluate, float_bias_reason,
    sliding_window,
)

log = logging.getLogger(__name__)


def classify(attn: fx.Node, mask: fx.Node, tree_inputs: Sequence[fx.Node],
             values: dict[fx.Node, object]) -> MaskInfo:
    """Meaning of ``mask`` at attention node ``attn`` (see module docstring). ``values``: the example
    inputs by placeholder (SymInts as their example ints)."""
    free = free_nodes(attn)
    anc = ancestors(mask, lambda a: a not in free)
    anc_set = set(anc)
    inputs = [t for t in tree_inputs if t in anc_set]
    for n in anc:
        if n.op == "placeholder" and n not in tree_inputs and isinstance(values.get(n), torch.Tensor) \
                and values[n].dim() > 0 and not is_static_input(n):  # 0-dim: a lifted scalar, guarded by pack
            raise CannotReplay(Code.MASK_FROM_VALUES, f"attention mask depends on non-token input {n.name}", attn)
    sc = Scaling.of(tree_inputs[0], values, anc)
    dynamic = _is_symbolic_length(tree_inputs[0])
    small = sc.B * sc.L * sc.L <= MAX_PROBE_ELEMENTS
    probes = Probes(inputs, values, sc, perturbed_parameters(mask, values, free), free)
    trials = probes.example_trials() if small else []
    limit: Optional[tuple[int, str]] = None
    if dynamic or not small:
        if not sc.l_scalable:
            if not small:
                raise CannotReplay(Code.MASK_UNPROVEN,
                    f"attention mask of a [{sc.B}, {sc.L}] batch cannot be evaluated at small sizes (the batch size "
                    "and the length cannot be told apart in its subgraph) and is too large to evaluate whole", attn)
            limit = (sc.L, "its sizes cannot be scaled for probes")
        else:
            more, limit = _probe_trials(attn, mask, probes, size_constants(anc, values, sc))
            if sc.b_scalable and limit is not None and limit[0] < BASE_LENGTHS[0] \
                    and sc.B * BASE_LENGTHS[0] ** 2 <= SHORT_PROBE_ELEMENTS:
                # the batch-size literal was not only the batch size: probe with the batch's own row count
                probes.sc = sc = dataclasses.replace(sc, b_symbol=None, b_literal=False, b_scalable=False)
                more, limit = _probe_trials(attn, mask, probes, size_constants(anc, values, sc))
            trials += more
    if limit is not None and (not dynamic or limit[0] < BASE_LENGTHS[0]) and sc.L > limit[0]:
        raise CannotReplay(Code.MASK_UNPROVEN,
                           f"attention mask's meaning is proven for lengths <= {limit[0]} only ({limit[1]}); "
                           f"the batch has L = {sc.L}", attn)
    if not trials:
        raise CannotReplay(Code.MASK_UNPROVEN, "attention mask could not be evaluated at any probe size", attn)
    info = _meaning(attn, mask, inputs, trials)
    if free and any(t.bias(mask, attn) is not None for t in trials):
        raise CannotReplay(Code.RELATIVE_BIAS,
                           f"attention bias gathered from the per-query table {free[0].name} that is not "
                           f"{free[0].name}[b, h, i, clamp(i - j, 0, E - 1)] at every visible pair (i, j) (optionally 0 "
                           "from distance E on): a relative bias must be a function of the query token's table and "
                           "the clamped query-key distance alone", attn)
    if any(t.bias(mask, attn) is not None for t in trials):
        info = alibi_meaning(attn, mask, info, inputs, trials, values)
    if dynamic and limit is not None:
        info = dataclasses.replace(info, max_length=limit[0])
    if any(t.finite_blocking(mask, attn) for t in trials):
        info = dataclasses.replace(info, finite_blocking=True)
    log.debug("mask of %s: %s (%d trials up to L'=%d)", attn.name, info, len(trials),
              max(t.size[1] for t in trials))
    return info


def _probe_trials(attn: fx.Node, mask: fx.Node, probes: "Probes",
                  constants: set[int]) -> tuple[list[Trial], Optional[tuple[int, str]]]:
    """Trials at every probe length (``probe_lengths``) that the subgraph can be evaluated at, and the
    longest admitted length with why (None: every length)."""
    sc = probes.sc
    lengths, too_large = probe_lengths(sc, constants)
    limit = (min(too_large) - 1, f"the constant {min(too_large)} of its subgraph is too large to probe") \
        if too_large else None
    trials: list[Trial] = []
    for Lp in lengths:
        if limit is not None and Lp > limit[0]:
            break
        rows = PROBE_ROWS if sc.b_scalable else (sc.B,)
        if rows[0] * Lp * Lp > SHORT_PROBE_ELEMENTS:
            rows = (1,) if sc.b_scalable else rows[:1]
        if rows[0] * Lp * Lp > MAX_PROBE_ELEMENTS:
            return trials, (Lp - 1, f"a probe of length {Lp} would exceed {MAX_PROBE_ELEMENTS} mask elements")
        short = rows[0] * Lp * Lp <= SHORT_PROBE_ELEMENTS
        try:
            new = [t for r in rows for t in probes.trials(r, Lp, range(4) if short else (0, 3))]
            for t in new:
                m = t.visible(mask, attn)
                if m.dim() < 2 or tuple(m.shape[-2:]) != (Lp, Lp):
                    raise ValueError(f"mask of shape {tuple(getattr(m, 'shape', ()))} at length {Lp}")
        except CannotReplay:
            raise
        except Exception as e:  # the subgraph does not exist at this length (e.g. a [T, T] buffer shorter)
            log.debug("mask of %s: cannot be evaluated at L'=%d", attn.name, Lp, exc_info=True)
            return trials, (Lp - 1, f"its subgraph cannot be evaluated at length {Lp}: {type(e).__name__}: {e}")
        trials += new
    return trials, limit


def _is_symbolic_length(tree_input: fx.Node) -> bool:
    v = example_value(tree_input)
    return isinstance(v, torch.Tensor) and v.dim() == 2 and is_symbolic(v.shape[1])


def _meaning(attn: fx.Node, mask: fx.Node, inputs: Sequence[fx.Node], trials: Sequence[Trial]) -> MaskInfo:
    """The one candidate meaning every trial agrees with, else CannotReplay (see :func:`_row_meaning`);
    a mask that is none of the row meanings may still be causal within packed sequences
    (:func:`sequence_meaning`)."""
    try:
        return _row_meaning(attn, mask, inputs, trials)
    except CannotReplay as refusal:
        info = sequence_meaning(attn, mask, inputs, trials)
        if info is not None:
            return info
        biased = next((t for t in trials if _blocks_by_finite_values(t.visible(mask, attn), t.bias(mask, attn))),
                      None)
        if biased is not None:
            raise CannotReplay(Code.MASK_FLOAT_BIAS, float_bias_reason(evaluate(mask, biased.values, biased.literal),
                                                 biased.visible(mask, attn), "where a causal mask blocks (through "
                                                 "them a query sees the keys after it)"), attn) from refusal
        if any(_sees_later_keys(t.visible(mask, attn)) for t in trials):
            bias = " and adds a bias to the scores" if any(
                t.bias(mask, attn) is not None for t in trials) else ""
            raise CannotReplay(Code.MASK_NOT_CAUSAL,
                               f"attention mask lets a query see keys after it{bias} (bidirectional attention: an "
                               "encoder, a masked LM such as XLM with causal=False, or a prefix-LM's prompt); a "
                               "token's value must depend on its prefix only for the prefix tree to share it",
                               attn) from refusal
        x = followed_input(attn, mask, inputs, trials, Trial.visible)
        if x is not None:
            raise CannotReplay(Code.MASK_FROM_VALUES,
                               f"attention mask computed from the values of {x.name}: which keys a query sees "
                               "depends on the tokens (a content-dependent sparse mask, e.g. a top-k selection of "
                               "keys by a learned index, DeepSeek sparse attention's indexer, with fewer picks than "
                               "keys); tree attention's keys are the causal ones, by position and padding only",
                               attn) from refusal
        raise refusal


def _blocks_by_finite_values(vis: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether a float mask's finite nonzero values (``bias``, :func:`split_bias`) are what shows some query a key
    after it, a block that falls short: a value above :data:`BLOCKING` where a causal mask blocks, and 0 at every
    pair it shows on or before the diagonal (``masked_fill(~causal, -5)``). A bias at those pairs too is a bias
    added to the scores of a mask that itself shows later keys (a relative position bias over bidirectional
    attention, CPM-Ant's): such a mask is not causal (:func:`_sees_later_keys`), whatever its bias."""
    if bias is None or vis.dim() < 2:
        return False
    L = vis.shape[-1]
    later = torch.ones(L, L, dtype=torch.bool, device=vis.device).triu(1)
    try:
        v, b = torch.broadcast_tensors(vis, bias.to(vis.device))
    except RuntimeError:
        return False
    biased = v & (b != 0)
    return v.shape[-2] == L and bool((biased & later).any()) and not bool((biased & ~later).any())


def _sees_later_keys(vis: torch.Tensor) -> bool:
    """Whether a boolean visibility ``[..., Lq | 1, Lk]`` (a query row broadcast over the queries: a key-padding
    mask alone) shows some query ``i`` a key ``j > i``."""
    if vis.dim() < 2:
        return False
    L = vis.shape[-1]
    if vis.shape[-2] == 1:
        vis = vis.expand(*vis.shape[:-2], L, L)
    return vis.shape[-2] == L and bool(torch.triu(vis, diagonal=1).any())


def _row_meaning(attn: fx.Node, mask: fx.Node, inputs: Sequence[fx.Node], trials: Sequence[Trial]) -> MaskInfo:
    """The one row candidate (causal, key padding, window) every trial agrees with, else CannotReplay. The
    window is read off the trials without key padding (``Trial.unpadded``); they must all show the same one."""
    evaluated = [(t, t.visible(mask, attn)) for t in trials]
    windows = {w for t, m in evaluated if t.unpadded for w in [sliding_window(m, attn)] if w is not None}
    if len(windows) > 1:
        raise CannotReplay(Code.MASK_UNPROVEN,
                           f"attention mask shows different sliding windows {sorted(windows)} at different probe "
                           "sizes (a window that depends on the batch size or length)", attn)
    for window in sorted(windows) + [0]:
        for cand in [None] + list(inputs):
            if all(_matches(m, cand, t.values, window) for t, m in evaluated):
                return MaskInfo("causal" if cand is None else "causal+keypad", cand, window)
    raise CannotReplay(Code.MASK_NOT_CAUSAL,
                       "attention mask is neither causal nor causal & key padding from a token input, "
                       "optionally with a sliding window (prefix-LM and bias masks are not supported)", attn)


def sequences_guard(info: MaskInfo, placeholders: Sequence[fx.Node]):
    """The per-call guard of a ``causal+sequences(P)`` mask: P splits every row into well-formed sequences
    (and their virtual layout is not too uneven): :func:`brcompile.runtime.tree.sequence_layout_problem`."""
    from brcompile.passes.analysis.guards import BatchGuard  # local: guards has no pass dependencies
    from brcompile.runtime.tree import sequence_layout_problem

    pos = placeholders.index(info.sequences)

    def check(args):
        return sequence_layout_problem(args[pos])

    return BatchGuard(f"{info.sequences.name} (input {pos}) splits the rows into packed sequences", check,
                      code=Code.GUARD_SEQUENCES)


def meaning_guard(attn: fx.Node, mask: fx.Node, info: MaskInfo, tree_inputs: Sequence[fx.Node],
                  placeholders: Sequence[fx.Node], values: dict[fx.Node, object]):
    """A per-call guard for a mask of a dynamic-length graph whose meaning is proven only up to
    ``info.max_length``, or None. O(1): it reads the length of a tree input."""
    from brcompile.passes.analysis.guards import BatchGuard  # local: guards has no pass dependencies

    if info.max_length is None:
        return None
    pos = placeholders.index(tree_inputs[0])
    limit = info.max_length

    def check(args):
        L = args[pos].shape[-1]
        if L > limit:
            return (f"the mask of {attn.name} is {info}: a constant of its subgraph is too large to probe, so its "
                    f"meaning at length {L} is not proven")
        return None

    return BatchGuard(f"mask of {attn.name} proven for lengths <= {limit} (input {pos})", check,
                      code=Code.GUARD_MASK_LENGTH)


def _matches(mask: torch.Tensor, cand: Optional[fx.Node], values, window: int = 0) -> bool:
    """``mask`` (bool or additive) is exactly causal [& key padding by ``values[cand]``] [& window]."""
    vis = mask if mask.dtype == torch.bool else (mask == 0)
    if vis.dim() < 2:
        return False
    Lq, Lk = vis.shape[-2:]
    if Lq != Lk:
        return False
    causal = torch.ones(Lq, Lk, dtype=torch.bool, device=vis.device).tril()
    if window:
        causal = causal & ~torch.ones(Lq, Lk, dtype=torch.bool, device=vis.device).tril(-window)
    if cand is None:
        expected = causal
    else:
        kp = (values[cand] != 0).to(vis.device)  # [B, L]
        expected = causal[None, None] & kp[:, None, None, :]
    try:
        a, b = torch.broadcast_tensors(vis, expected)
    except RuntimeError:
        return False
    return bool((a == b).all())
