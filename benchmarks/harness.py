"""The GRPO benchmark: dense eager vs torch.compile vs branch_replay vs PrefixGrouper, side by side.

Run it as ``python benchmarks/bench_grpo.py [flags]`` from a checkout (``--help`` lists the flags). On the
same model and batch it measures:

* ``eager``: the dense loss forward+backward, eagerly (the reference for speed and exactness);
* ``torch.compile``: the dense loss compiled by ``--compile-backend`` (Inductor by default);
* ``branch_replay``: compiled with ``brcompile.backend(compiler=--compiler, min_dedup=--min-dedup)``;
* ``prefix_grouper``: PrefixGrouper (``pip install prefix-grouper``), the published peer, through its own API
  (``benchmarks/peer_prefix_grouper.py``; the example GPT's GRPO loss only). Building its ``PrefixGrouper`` and
  regrouping the inputs is data preparation in a PrefixGrouper trainer, so it is not timed (branch_replay's tree
  building is timed: it runs per call).

Cases (``--cases``). By default a suite of named cases (:data:`SUITE_CASES`, sizes :data:`SUITE_SIZES`,
``--suite-sizes G,GROUPS,P,TMIN,TMAX,SHARED``; ``--quick``: tiny ones): ``equal`` (one group, equal responses,
no padding), ``ragged`` (GROUPS groups, prompts in [P/2, P], responses drawn from [TMIN, TMAX] and right-padded as
RL trainers produce them), ``ragged-shared`` (the first SHARED response tokens shared within a group),
``ragged-nomask`` (the model called without an attention mask), ``qwen2-trl`` (an unmodified HF
``Qwen2ForCausalLM`` run TRL's way: prompts left-padded, only the model compiled, ``logits_to_keep = C + 1``, the
loss eager over the returned logits, ``examples.hf.trl_grpo_loss``) and ``dpo`` (``examples/dpo.py``: pairs whose
chosen and rejected rows share the prompt, the log-probability function compiled, run for the policy and for a
frozen reference). ``--cases grid`` (or any grid flag: ``--group-sizes``, ``--prefix-lens``, ``--tail-lens``,
``--model`` ...) runs the G x P x T grid of the earlier bench instead, on ``--model gpt|qwen2|both``.

Per case and method: wall-clock of one forward+backward, exactness (max relative error of the loss and every
parameter gradient against dense eager), bytes saved for backward (``brcompile.tools.measure.SavedBytes``:
distinct storages, parameters excluded), executed FLOPs and the tokens a model call runs its layers on (dense:
B L; branch_replay: its packed tokens; PrefixGrouper: its grouped rows, one per prompt, padding included), and
``replayed_calls`` (the branch_replay calls made inside the method's own calls). Per case: the padding fraction
(positions with attention-mask bit 0), the prefix tree counted independently of brcompile (:func:`count_tree`:
N nodes, padding included), the positions the loss needs (:func:`needed_mask`) and their tree
(:func:`count_needed`), and two limits.

**The limit** (the true one, :func:`needed_limit_flops`): a position is *live* if the loss reads the model's
output there with nonzero weight (next-token losses: the output at t is live iff target t + 1 is weighted --
``completion_mask[:, t + 1]``, ``labels[:, t + 1] != -100``; with ``logits_to_keep`` only the kept columns), and
*needed* if it is live or a key a live query attends: ``needed[b, t] = live[b, t] or (key_visible[b, t] and t <=
last_live[b])``, ``key_visible`` the attention-mask bit the model gets (all ones without a mask). Over the
distinct tree nodes holding a needed position (N_needed) and a live one (N_live):

    limit = (F_other - F_head) * N_needed / (B L)  +  F_head * N_live / (B W)
            + n_layers * H * P_needed * c * D

* F_other = F_dense - A_dense: the dense run's non-attention FLOPs (projections, MLP, LM head), all per position;
  F_head: the LM head's part (:func:`lm_head_flops` over the B W positions it ran on: W = L, or C + 1 with
  ``logits_to_keep``); the head is needed on live nodes only.
* P_needed: for every needed node, its key-visible ancestors, itself included (all needed too); per pair, head
  and layer c D FLOPs: 4 forward (q k^T, p v) + 10 backward (torch's ``sdpa_flop_count`` /
  ``sdpa_backward_flop_count`` per score) per trained pass, 4 per frozen forward (DPO's reference:
  :class:`Passes`), H query heads of width D.

**The tree limit** (:func:`limit_flops`, the earlier bench's limit, kept as a column): the same with every tree
node (N, padding included) in place of the needed and live ones. Every method's executed FLOPs are reported
over the limit, the tree limit for branch_replay too: branch_replay without its live positions
(``liveness=False``) executes the whole tree (padding positions and the rows' last tokens included), which the
tree limit hides and the limit shows.

Running the model on one row of N packed tokens would NOT give either limit: causal attention over that row
would let every token see all earlier tokens, siblings included.

**branch_replay's run-time overhead** per step (:func:`measure_overhead`), after the timed rounds, on the case's
own inputs: the method's ``PackedRuntime`` instances (``BranchReplayBackend.records[i].runtime``) run a few more
steps with their pieces wrapped by timers as instance attributes (removed afterwards; nothing global changes, the
timed rounds run unwrapped): the tree stage ``PackedRuntime._tree`` (``build_tree``: codes, then on a CPU the
compiled kernel's exact sort and layout, else hashing, row order, its exact verification and assembly; the
positions left out), the guards (``PackedRuntime.guards``) and the liveness stage (``PackedRuntime._liveness``: the
call's live and needed positions; the tree's narrowing to them is part of the tree stage), each
in ms and as % of the branch_replay step, against a target of 3 % (:data:`OVERHEAD_TARGET`).

FLOP conventions (``brcompile/tools/measure.py``): torch's registry counts matmuls and attention, not pointwise
ops; the CPU attention kernels are counted with torch's SDPA formulas over the full s_q x s_k score matrix
(``CPU_ATTENTION_FLOPS``); ``brcompile::tree_attention`` by the formula it registers (visible pairs only).
Every method is counted on its own forward+backward, compiled code included (:class:`OpFlopCounter`:
``FlopCounterMode`` would make Dynamo skip the compiled code).

Times are medians of ``--repeats`` interleaved rounds (each round runs every method once, after a warm-up
round), so load on a shared machine hits all methods alike. The methods share one process but no state: each
holds its own compiled function (:meth:`Runner._loss_fn`: for the GPT, a wrapper with its own code object,
so its own Dynamo cache entries), nothing global is patched, and a method other than branch_replay that
reached branch_replay is an error (exit status 1). Output: tables (rich when installed), ``bench.json`` and
``bench_speedup.png`` (matplotlib: speedup vs P/T, one colour per G, the FLOP-ratio limit dense/limit dashed)
under ``--out``, and ``--json PATH`` when given.

    python benchmarks/bench_grpo.py                           # the suite (SUITE_CASES) at its default sizes
    python benchmarks/bench_grpo.py --quick                   # the suite on a tiny model, in a minute or two
    python benchmarks/bench_grpo.py --cases ragged,dpo --methods eager,branch_replay
    python benchmarks/bench_grpo.py --group-sizes 8 --prefix-lens 1024 --tail-lens 128 --repeats 4   # a grid
    python benchmarks/bench_grpo.py --backend aot_eager --quick   # eager vs torch.compile(aot_eager) only
    python benchmarks/bench_grpo.py --model qwen2 --prefix-lens 512 --methods eager,branch_replay
    # eager vs branch_replay on a larger model, one full group and one mixed batch per P:
    python benchmarks/bench_grpo.py --dim 256 --layers 4 --group-sizes 8 --prefix-lens 512,2048 \\
        --tail-lens 128 --mixed-groups --methods eager,branch_replay --compiler inductor

Absolute times only mean something on a quiet machine; on a CPU shared with other work, ratios are noisy.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils.flop_counter as flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from brcompile.testing import rel_err
from brcompile.tools.measure import CPU_ATTENTION_FLOPS, SavedBytes, is_attention_op, storage_ptrs, sync
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, make_grpo_batch

log = logging.getLogger(__name__)

FWD_PAIR_FLOPS_PER_D = 4     # q k^T (2 D) + p v (2 D)
BWD_PAIR_FLOPS_PER_D = 10    # recompute q k^T, dP = dO v^T, dV = P^T dO, dQ = dS k, dK = dS^T q (2 D each)


@dataclasses.dataclass(frozen=True)
class Passes:
    """How many times a step runs the model per position: ``trained`` forward+backward passes and ``frozen``
    forward-only passes (DPO's reference model). A matmul over a position costs 2 m n per forward pass and
    twice that in backward (dX and dW), an attention pair :data:`FWD_PAIR_FLOPS_PER_D` D forward and
    :data:`BWD_PAIR_FLOPS_PER_D` D more backward."""

    trained: int = 1
    frozen: int = 0

    @property
    def matmul_passes(self) -> int:
        """Matmul evaluations per position: 3 per trained pass (y, dX, dW), 1 per frozen pass."""
        return 3 * self.trained + self.frozen

    @property
    def pair_flops_per_d(self) -> int:
        """FLOPs per (query, key) pair, head and layer, in units of the head width D."""
        return (FWD_PAIR_FLOPS_PER_D + BWD_PAIR_FLOPS_PER_D) * self.trained + FWD_PAIR_FLOPS_PER_D * self.frozen


TRAIN = Passes()


class BenchError(RuntimeError):
    """The bench cannot run a method as asked (PrefixGrouper missing or on another model, ...)."""


class NotApplicable(BenchError):
    """A method does not apply to a case (PrefixGrouper's adapter on another model or loss): not run, no error."""


# ----------------------------------------------------------------------------------------------------
# FLOPs of compiled code


class OpFlopCounter(TorchDispatchMode):
    """Counts FLOPs per op with torch's formula registry (``torch.utils.flop_counter.flop_registry``, which
    ``register_flop_formula`` fills, e.g. for brcompile's ``tree_attention``) plus the CPU SDPA formulas of
    ``brcompile.tools.measure.CPU_ATTENTION_FLOPS``. An op without a formula is decomposed if it can be (as
    ``FlopCounterMode`` does), else run uncounted.

    Why not ``FlopCounterMode``: under it, Dynamo skips the compiled function -- the count is the eager
    graph's, and (torch 2.13) the function's code stays skipped afterwards, so later calls run eagerly
    too; its module tracker's global hooks also break Dynamo's tracing of nested ``torch.compile``.
    This mode declares ``ignore_compile_internals``: it is off while Dynamo compiles and on while the
    compiled code runs, so it counts the ops the compiled code executes (extern kernels and custom ops;
    Inductor's fused pointwise kernels carry no FLOPs in the registry anyway).
    """

    CPU_FORMULAS = {op: flop_counter.shape_wrapper(f) for op, f in CPU_ATTENTION_FLOPS.items()}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Count what compiled code runs, not what its compilation traces."""
        return True

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not isinstance(func, torch._ops.OpOverload):   # higher-order ops: run, nothing to count here
            return func(*args, **kwargs)
        packet = func._overloadpacket
        formula = self.CPU_FORMULAS.get(packet) or flop_counter.flop_registry.get(packet)
        if formula is None:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self.counts[packet] += int(formula(*args, **kwargs, out_val=out))
        return out


@dataclasses.dataclass
class FlopCount:
    """FLOPs of one forward+backward, split into attention (``is_attention_op``) and everything else."""

    total: int
    attention: int

    @property
    def other(self) -> int:
        """Non-attention FLOPs (projections, MLP, LM head)."""
        return self.total - self.attention


def count_flops(step: Callable[[], Any]) -> FlopCount:
    """The FLOPs of the ops ``step()`` runs, compiled code included (:class:`OpFlopCounter`), split into
    attention and the rest."""
    with OpFlopCounter() as counter:
        step()
    attention = sum(n for op, n in counter.counts.items() if is_attention_op(op))
    return FlopCount(total=sum(counter.counts.values()), attention=attention)


def saved_activation_bytes(step: Callable[[], Any], exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``step()`` (the forward of a
    fwd+bwd step), skipping storages whose data_ptr is in ``exclude`` (the parameters); see
    ``brcompile.tools.measure.SavedBytes``."""
    with SavedBytes(exclude) as saved:
        step()
    return saved.total


# ----------------------------------------------------------------------------------------------------
# The prefix tree, counted independently of brcompile, and the limit


@dataclasses.dataclass
class TreeCount:
    """Sizes of a batch's prefix tree: rows B, logical positions B*L, nodes N, attention pairs."""

    rows: int
    logical: int
    nodes: int
    tree_pairs: int      # sum over tree nodes of its valid (mask bit 1) ancestors, itself included
    dense_pairs: int     # the same sum over all B*L dense positions
    window: int = 0      # the last ``window`` columns (where an LM head with logits_to_keep runs) ...
    window_nodes: int = 0  # ... hold this many tree nodes


def count_tree(input_ids: torch.Tensor, attention_mask: torch.Tensor, window: int = 0) -> TreeCount:
    """Builds the trie of the rows (a node = a distinct row prefix of (token, mask bit) pairs) in Python.

    A position's visible keys are its valid ancestors (itself included), so a node contributes
    ``valid_prefix_count`` pairs once in the tree, and once per row that contains it in the dense batch.
    ``window_nodes`` counts the nodes in the last ``window`` columns (depth >= L - window).
    """
    ids = input_ids.cpu().tolist()
    bits = attention_mask.cpu().bool().tolist()
    root: dict = {}
    B, L = input_ids.shape
    if not 0 <= window <= L:
        raise ValueError(f"window={window} must be in [0, L={L}]")
    nodes = tree_pairs = dense_pairs = window_nodes = 0
    for row_ids, row_bits in zip(ids, bits):
        children, valid = root, 0
        for col, (tok, bit) in enumerate(zip(row_ids, row_bits)):
            valid += bit
            dense_pairs += valid
            key = (tok, bit)
            child = children.get(key)
            if child is None:
                child = children[key] = {}
                nodes += 1
                tree_pairs += valid
                window_nodes += col >= L - window
            children = child
    return TreeCount(rows=B, logical=B * L, nodes=nodes, tree_pairs=tree_pairs, dense_pairs=dense_pairs,
                     window=window, window_nodes=window_nodes)


def lm_head_flops(config: GPTConfig, positions: int, passes: Passes = None) -> int:
    """FLOPs of an LM head (a bias-free ``dim -> vocab`` linear) over ``positions`` positions: 2 dim vocab per
    matmul evaluation, ``passes.matmul_passes`` of them (a forward+backward: ``y = x W^T``, ``dx = dy W``,
    ``dW = dy^T x``, 3)."""
    return 2 * config.dim * config.vocab_size * positions * (passes or TRAIN).matmul_passes


def limit_flops(dense: FlopCount, tree: TreeCount, config: GPTConfig, passes: Passes = None) -> FlopCount:
    """The tree limit (module docstring): every tree node once, padding included (:func:`work_limit` over the
    N nodes and the tree pairs).

    With ``tree.window`` > 0 the LM head ran on the last ``window`` columns only (``logits_to_keep``): its
    dense FLOPs (:func:`lm_head_flops` over B * window positions) are scaled by window_nodes / (B * window)
    instead, the rest by N / (B L)."""
    return work_limit(dense, config, rows=tree.rows, logical=tree.logical, window=tree.window,
                      body_nodes=tree.nodes, head_nodes=tree.window_nodes if tree.window else tree.nodes,
                      pairs=tree.tree_pairs, passes=passes or TRAIN)


# ----------------------------------------------------------------------------------------------------
# Liveness: the positions the loss needs, their tree, and the true limit


@dataclasses.dataclass
class Liveness:
    """Which positions of a [B, L] batch the loss needs (all [B, L] bool).

    * ``live[b, t]``: the loss reads the model's output at (b, t) with nonzero weight;
    * ``key_visible[b, t]``: the attention-mask bit the model gets (all True when it gets no mask);
    * ``needed[b, t] = live[b, t] or (key_visible[b, t] and t <= last_live[b])``, ``last_live[b]`` the last live
      column of row b (-1 when the row has none): a live query attends the visible keys at or before it, and
      those keys' own values need their own visible ancestors, all at or before ``last_live[b]`` again.
    """

    live: torch.Tensor
    key_visible: torch.Tensor
    needed: torch.Tensor


def loss_targets(shape: tuple, *, loss_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                 ignore_index: int = -100) -> torch.Tensor:
    """``w[b, j]``: token j of row b is a target the loss weights, ``loss_mask[b, j] != 0`` and ``labels[b, j] !=
    ignore_index`` (each when given; every token when neither is). [B, L] bool."""
    w = torch.ones(shape, dtype=torch.bool)
    if loss_mask is not None:
        w = w & (loss_mask.cpu() != 0)
    if labels is not None:
        w = w & (labels.cpu() != ignore_index)
    return w


def live_positions(targets: torch.Tensor, *, shift: int = 1, window: int = 0) -> torch.Tensor:
    """``live[b, t] = targets[b, t + shift]`` for ``t + shift < L`` (a next-token loss reads the output at t for
    target t + 1: ``shift = 1``; a loss on the position's own output: 0); with ``window`` > 0 (the model returns
    the last ``window`` columns only, ``logits_to_keep``) also ``t >= L - window``. [B, L] bool."""
    B, L = targets.shape
    if not 0 <= shift < L or not 0 <= window <= L:
        raise ValueError(f"shift={shift} must be in [0, L={L}) and window={window} in [0, L]")
    live = torch.zeros(B, L, dtype=torch.bool)
    live[:, :L - shift] = targets[:, shift:].bool()
    if window:
        live[:, :L - window] = False
    return live


def needed_positions(live: torch.Tensor, key_visible: torch.Tensor) -> torch.Tensor:
    """``needed[b, t] = live[b, t] or (key_visible[b, t] and t <= last_live[b])`` (:class:`Liveness`). [B, L] bool."""
    B, L = live.shape
    cols = torch.arange(L)
    last_live = torch.where(live, cols, torch.full_like(cols, -1)).amax(dim=1)   # -1: a row without live position
    return live | (key_visible.bool() & (cols[None, :] <= last_live[:, None]))


def needed_mask(shape: tuple, *, attention_mask: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None, shift: int = 1,
                window: int = 0, ignore_index: int = -100) -> Liveness:
    """The positions a loss needs, from its masks: targets from ``loss_mask`` (a completion mask) and ``labels``
    (:func:`loss_targets`), shifted by ``shift`` and cut to the last ``window`` columns (:func:`live_positions`),
    closed over the keys ``attention_mask`` lets a live query see (the mask the model is called with; None: the
    model gets none, every key is visible) (:func:`needed_positions`)."""
    targets = loss_targets(shape, loss_mask=loss_mask, labels=labels, ignore_index=ignore_index)
    live = live_positions(targets, shift=shift, window=window)
    key_visible = torch.ones(shape, dtype=torch.bool) if attention_mask is None else attention_mask.cpu() != 0
    return Liveness(live=live, key_visible=key_visible, needed=needed_positions(live, key_visible))


@dataclasses.dataclass
class NeededCount:
    """The prefix tree of a batch restricted to the positions its loss needs (:func:`count_needed`)."""

    rows: int
    logical: int           # B * L
    tree_nodes: int        # every node of the tree, padding included (what branch_replay executes before liveness)
    nodes: int             # distinct nodes holding a needed position
    live_nodes: int        # distinct nodes holding a live position (where the LM head must run)
    pairs: int             # sum over needed nodes of their key-visible ancestors, themselves included
    needed_positions: int  # needed (b, t), counted per row
    live_positions: int    # live (b, t), counted per row
    window: int = 0        # the LM head runs on the last ``window`` columns (0: all)


def count_needed(input_ids: torch.Tensor, liveness: Liveness, window: int = 0) -> NeededCount:
    """Counts the needed tree: the prefix tree of the rows (``brcompile.runtime.tree.build_tree`` over the token
    ids, the key-visible bit part of node identity), then the distinct packed ids ``index[b, t]`` over needed
    (b, t) (``nodes``) and over live (b, t) (``live_nodes``). A needed node q at column t of row b attends the
    key-visible positions 0..t of b (all of them needed, :class:`Liveness`), so it adds ``c[b, t] =
    sum_{u <= t} key_visible[b, u]`` pairs, read at its representative (rep_row[q], position[q])."""
    from brcompile.runtime.tree import build_tree

    kv = liveness.key_visible
    tree = build_tree(input_ids.cpu(), attention_mask=kv.long())
    index = tree.index
    nodes = torch.unique(index[liveness.needed])
    live_nodes = torch.unique(index[liveness.live])
    visible_prefix = kv.long().cumsum(dim=1)
    pairs = int(visible_prefix[tree.rep_row[nodes], tree.position[nodes]].sum())
    B, L = input_ids.shape
    return NeededCount(rows=B, logical=B * L, tree_nodes=tree.num_tokens, nodes=int(nodes.numel()),
                       live_nodes=int(live_nodes.numel()), pairs=pairs,
                       needed_positions=int(liveness.needed.sum()), live_positions=int(liveness.live.sum()),
                       window=window)


def work_limit(dense: FlopCount, config: GPTConfig, *, rows: int, logical: int, window: int, body_nodes: int,
               head_nodes: int, pairs: int, passes: Passes = TRAIN) -> FlopCount:
    """FLOPs of the dense step's work done over ``body_nodes`` tokens, the LM head over ``head_nodes`` and
    attention over ``pairs`` (query, key) pairs:

        limit = (F_other - F_head) * body_nodes / (B L)  +  F_head * head_nodes / (B W)
                + n_layers * H * pairs * c * D

    F_head: :func:`lm_head_flops` over the B W positions the dense head ran on (W = ``window``, or L); c:
    ``passes.pair_flops_per_d``. Everything but attention and the head is per position."""
    W = window or logical // rows
    head = lm_head_flops(config, rows * W, passes)
    other = (dense.other - head) * body_nodes / logical + head * head_nodes / (rows * W)
    attention = config.n_layers * config.n_heads * pairs * passes.pair_flops_per_d * config.head_dim
    return FlopCount(total=int(round(other + attention)), attention=int(attention))


def needed_limit_flops(dense: FlopCount, needed: NeededCount, config: GPTConfig, passes: Passes = TRAIN) -> FlopCount:
    """The true limit: the layers over the needed nodes, the LM head over the live nodes, attention over the
    needed pairs (:func:`work_limit`)."""
    return work_limit(dense, config, rows=needed.rows, logical=needed.logical, window=needed.window,
                      body_nodes=needed.nodes, head_nodes=needed.live_nodes, pairs=needed.pairs, passes=passes)


# ----------------------------------------------------------------------------------------------------
# Cases and subjects


METHODS = ("eager", "torch.compile", "branch_replay", "prefix_grouper")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


@dataclasses.dataclass(frozen=True)
class Case:
    """One batch: ``num_prompts`` prompts of length P (or drawn from [``prefix_min``, P]), each with G
    responses of length T (or drawn from [``tail_min``, T], right-padded), the first ``shared_response``
    response tokens shared within a group; run on ``model`` ("gpt" or "qwen2") with the ``loss`` "grpo" or "dpo"
    (then ``num_prompts`` pairs of a chosen and a rejected response, G = 2), the model called with the batch's
    attention mask or (``attention_mask=False``) without one. ``label``: the name of a suite case."""

    group_size: int
    prefix_len: int
    tail_len: int
    num_prompts: int = 1
    shared_response: int = 0
    prefix_min: Optional[int] = None
    tail_min: Optional[int] = None
    model: str = "gpt"
    loss: str = "grpo"
    attention_mask: bool = True
    label: str = ""

    @property
    def name(self) -> str:
        def span(lo, hi):
            return f"{lo}..{hi}" if lo is not None and lo != hi else f"{hi}"
        sizes = f"P={span(self.prefix_min, self.prefix_len)} T={span(self.tail_min, self.tail_len)}"
        if self.loss == "dpo":
            name = f"{self.num_prompts} pairs {sizes}"
        else:
            name = f"G={self.group_size} {sizes}"
            if self.num_prompts > 1:
                name = f"{self.num_prompts} groups {name}"
        if self.shared_response:
            name += f" shared {self.shared_response}"
        if not self.attention_mask:
            name += " no mask"
        return f"{self.label}: {name}" if self.label else name

    @property
    def subject(self) -> tuple[str, str]:
        """The key of the subject that runs this case: (model, loss)."""
        return (self.model, self.loss)

    def batch_kwargs(self) -> dict:
        """``examples.grpo.make_grpo_batch`` arguments of this case."""
        prompt = self.prefix_len if self.prefix_min is None else (self.prefix_min, self.prefix_len)
        tail = self.tail_len if self.tail_min is None else (self.tail_min, self.tail_len)
        lo = self.tail_len if self.tail_min is None else self.tail_min
        return dict(num_prompts=self.num_prompts, group_size=self.group_size, prompt_len=prompt,
                    response_len=tail, shared_response_prefix=min(self.shared_response, lo))


def grid_cases(args) -> list[Case]:
    """The grid of ``args``: every (G, P, T), with ``--num-prompts``, ``--ragged`` (responses drawn from
    [T/2, T]) and ``--shared-response``; with ``--mixed-groups`` each is followed by a mixed batch of 2 groups,
    prompts drawn from [P/2, P], responses from [T/4, T], the first T/8 response tokens shared. The whole grid
    once per model of ``--model`` (both: the GPT's, then the Qwen2's)."""
    cases = []
    for model in ("gpt", "qwen2") if args.model == "both" else (args.model,):
        for G in args.group_sizes:
            for P in args.prefix_lens:
                for T in args.tail_lens:
                    cases.append(Case(G, P, T, args.num_prompts, args.shared_response,
                                      tail_min=max(1, T // 2) if args.ragged else None, model=model))
                    if args.mixed_groups:
                        cases.append(Case(G, P, T, 2, T // 8, prefix_min=max(1, P // 2), tail_min=max(1, T // 4),
                                          model=model))
    return cases


@dataclasses.dataclass(frozen=True)
class SuiteSizes:
    """Sizes of the suite cases (:func:`suite_case`): G rows per group, ``groups`` groups in the ragged cases
    (each group's prompt drawn from [P/2, P]), prompt length P, response lengths drawn from [``t_min``,
    ``t_max``] (the equal case: all ``t_max``), ``shared`` leading response tokens shared within a group."""

    group_size: int
    groups: int
    prompt_len: int
    t_min: int
    t_max: int
    shared: int


#: The suite's sizes: by default (``default``; a 2-core CPU runs the suite in minutes at the default model
#: size) and with ``--quick``.
SUITE_SIZES = {"default": SuiteSizes(group_size=8, groups=2, prompt_len=128, t_min=4, t_max=192, shared=32),
               "quick": SuiteSizes(group_size=3, groups=2, prompt_len=12, t_min=2, t_max=16, shared=4)}

#: The suite cases, in order (``--cases``).
SUITE_CASES = {
    "equal": "one group, every response T_max long (no padding)",
    "ragged": "2+ groups, prompts in [P/2, P], responses in [T_min, T_max], right-padded",
    "ragged-shared": "as ragged, the first `shared` response tokens shared within a group",
    "ragged-nomask": "as ragged, the model called without an attention mask",
    "qwen2-trl": "as ragged on HF Qwen2 run TRL's way (prompts left-padded, model compiled alone, logits_to_keep)",
    "dpo": "DPO: G pairs, chosen and rejected share the prompt (TRL's concatenated layout), policy + reference",
}


def suite_case(name: str, z: SuiteSizes) -> Case:
    """The suite case ``name`` (:data:`SUITE_CASES`) at sizes ``z``."""
    ragged = dict(group_size=z.group_size, prefix_len=z.prompt_len, tail_len=z.t_max, num_prompts=z.groups,
                  prefix_min=max(1, z.prompt_len // 2), tail_min=z.t_min, label=name)
    if name == "equal":
        return Case(z.group_size, z.prompt_len, z.t_max, label=name)
    if name == "ragged":
        return Case(**ragged)
    if name == "ragged-shared":
        return Case(**{**ragged, "tail_min": min(z.t_max, z.shared + z.t_min)}, shared_response=z.shared)
    if name == "ragged-nomask":
        return Case(**ragged, attention_mask=False)
    if name == "qwen2-trl":
        return Case(**ragged, model="qwen2")
    if name == "dpo":
        return Case(**{**ragged, "group_size": 2, "num_prompts": z.group_size}, loss="dpo")
    raise ValueError(f"unknown case {name!r}; choose from {', '.join(SUITE_CASES)}")


def make_cases(args) -> list[Case]:
    """``--cases grid``: :func:`grid_cases`; else the named suite cases at ``args.suite_sizes``."""
    if args.cases == ["grid"]:
        return grid_cases(args)
    return [suite_case(name, args.suite_sizes) for name in args.cases]


def padding_fraction(batch: dict) -> float:
    """The fraction of the B x L positions whose attention-mask bit is 0."""
    am = batch["attention_mask"]
    return 1.0 - float(am.bool().sum()) / am.numel()


def _loss_torch_compile(model, batch: dict, use_attention_mask: bool = True):
    """The dense GPT loss, for the torch.compile method (its own code object: its own Dynamo cache)."""
    return grpo_loss(model, **batch, use_attention_mask=use_attention_mask)


def _loss_branch_replay(model, batch: dict, use_attention_mask: bool = True):
    """The dense GPT loss, for the branch_replay method (its own code object: its own Dynamo cache)."""
    return grpo_loss(model, **batch, use_attention_mask=use_attention_mask)


def _logps_torch_compile(model, input_ids, attention_mask, completion_mask):
    """DPO's per-sequence log-probabilities, for the torch.compile method (its own code object)."""
    from examples.dpo import sequence_logprobs

    return sequence_logprobs(model, input_ids, attention_mask, completion_mask)


def _logps_branch_replay(model, input_ids, attention_mask, completion_mask):
    """DPO's per-sequence log-probabilities, for the branch_replay method (its own code object)."""
    from examples.dpo import sequence_logprobs

    return sequence_logprobs(model, input_ids, attention_mask, completion_mask)


_COMPILED_LOSSES = {"torch.compile": _loss_torch_compile, "branch_replay": _loss_branch_replay}
_COMPILED_LOGPS = {"torch.compile": _logps_torch_compile, "branch_replay": _logps_branch_replay}


class GPTSubject:
    """The example GPT; the whole GRPO loss compiled."""

    name = "gpt"
    left_pad_prompts = False
    prefix_grouper = True   # benchmarks/peer_prefix_grouper.py writes out this model's forward
    passes = TRAIN

    def __init__(self, config: GPTConfig, seed: int, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.model = GPT(config, seed=seed).to(device=device, dtype=dtype)

    def make_batch(self, case: Case, seed: int, device: torch.device, dtype: torch.dtype) -> dict:
        """The case's GRPO batch (``examples.grpo.make_grpo_batch``)."""
        return make_grpo_batch(vocab_size=self.config.vocab_size, seed=seed, device=device, dtype=dtype,
                               left_pad_prompts=self.left_pad_prompts, **case.batch_kwargs())

    def dense_loss(self, case: Case, batch: dict) -> Callable[[], torch.Tensor]:
        """The eager loss of ``batch``."""
        return functools.partial(grpo_loss, self.model, **batch, use_attention_mask=case.attention_mask)

    def compiled_loss(self, method: str, case: Case, batch: dict, backend) -> Callable[[], torch.Tensor]:
        """The loss of ``batch`` compiled by ``backend``, through ``method``'s own wrapper."""
        compiled = torch.compile(_COMPILED_LOSSES[method], backend=backend)
        return functools.partial(compiled, self.model, batch, case.attention_mask)

    def head_window(self, batch: dict) -> int:
        """Columns the LM head runs on (0: all)."""
        return 0

    def liveness(self, case: Case, batch: dict) -> Liveness:
        """The GRPO loss reads the logits at t for target t + 1 where ``completion_mask[:, t + 1]`` is 1
        (:func:`needed_mask`), within the head's window; keys through the mask the model is called with."""
        return needed_mask(tuple(batch["input_ids"].shape), loss_mask=batch["completion_mask"], shift=1,
                           attention_mask=batch["attention_mask"] if case.attention_mask else None,
                           window=self.head_window(batch))

    def tolerance(self, dtype: torch.dtype) -> float:
        """The exactness bound of a method's loss and gradients against dense eager (brcompile/testing.py)."""
        return TOLERANCE.get(dtype, 1e-5)


class Qwen2Subject(GPTSubject):
    """A HF Qwen2 of ``config``'s sizes, TRL-style: the model compiled alone, ``logits_to_keep = C + 1``,
    the loss eager (examples/hf.py); prompts left-padded."""

    name = "qwen2"
    left_pad_prompts = True
    prefix_grouper = False

    def __init__(self, config: GPTConfig, seed: int, dtype: torch.dtype, device: torch.device, max_positions: int):
        from examples.hf import qwen2_model

        self.config = config
        self.model = qwen2_model(config, max_positions=max_positions, seed=seed, dtype=dtype).to(device)

    def _call_kwargs(self, case: Case, batch: dict) -> dict:
        from examples.hf import completion_width

        return {**batch, "attention_mask": batch["attention_mask"] if case.attention_mask else None,
                "completion_len": completion_width(batch["completion_mask"])}

    def dense_loss(self, case: Case, batch: dict) -> Callable[[], torch.Tensor]:
        from examples.hf import trl_grpo_loss

        return functools.partial(trl_grpo_loss, self.model, **self._call_kwargs(case, batch))

    def compiled_loss(self, method: str, case: Case, batch: dict, backend) -> Callable[[], torch.Tensor]:
        from examples.hf import trl_grpo_loss

        return functools.partial(trl_grpo_loss, torch.compile(self.model, backend=backend),
                                 **self._call_kwargs(case, batch))

    def head_window(self, batch: dict) -> int:
        from examples.hf import completion_width

        return completion_width(batch["completion_mask"]) + 1

    def tolerance(self, dtype: torch.dtype) -> float:
        """The float32 bound whatever ``dtype``: HF's RMSNorm normalises in float32 even in a float64 model,
        and a shared token's gradient is summed in another order by the packed backward (tests/models/test_hf.py
        measures ~1e-7 in float64)."""
        return 1e-5


class DPOSubject(GPTSubject):
    """DPO on the example GPT (examples/dpo.py): the per-sequence log-probability function compiled, called
    for the policy (forward+backward) and for a frozen reference copy (forward, no grad)."""

    name = "dpo"
    prefix_grouper = False
    passes = Passes(trained=1, frozen=1)

    def __init__(self, config: GPTConfig, seed: int, dtype: torch.dtype, device: torch.device):
        from examples.dpo import make_reference

        super().__init__(config, seed, dtype, device)
        self.reference = make_reference(self.model, seed=seed + 1)

    def make_batch(self, case: Case, seed: int, device: torch.device, dtype: torch.dtype) -> dict:
        """The case's DPO batch (``examples.dpo.make_dpo_batch``: chosen rows, then rejected rows)."""
        from examples.dpo import make_dpo_batch

        kw = case.batch_kwargs()
        return make_dpo_batch(num_pairs=kw["num_prompts"], prompt_len=kw["prompt_len"],
                              response_len=kw["response_len"], shared_response_prefix=kw["shared_response_prefix"],
                              vocab_size=self.config.vocab_size, seed=seed, device=device)

    def dense_loss(self, case: Case, batch: dict) -> Callable[[], torch.Tensor]:
        from examples.dpo import dpo_step

        return functools.partial(dpo_step, self.model, self.reference, batch)

    def compiled_loss(self, method: str, case: Case, batch: dict, backend) -> Callable[[], torch.Tensor]:
        from examples.dpo import dpo_step

        return functools.partial(dpo_step, self.model, self.reference, batch,
                                 torch.compile(_COMPILED_LOGPS[method], backend=backend))


def make_subject(key: tuple[str, str], config: GPTConfig, seed: int, dtype: torch.dtype, device: torch.device,
                 cases: Sequence[Case]):
    """The subject of ``key`` = (model, loss) (:attr:`Case.subject`); a Qwen2 gets rotary tables for the
    longest of ``cases``."""
    if key == ("gpt", "grpo"):
        return GPTSubject(config, seed, dtype, device)
    if key == ("qwen2", "grpo"):
        return Qwen2Subject(config, seed, dtype, device,
                            max_positions=max(c.prefix_len + c.tail_len for c in cases if c.subject == key))
    if key == ("gpt", "dpo"):
        return DPOSubject(config, seed, dtype, device)
    raise BenchError(f"no subject runs model {key[0]!r} with loss {key[1]!r}")


# ----------------------------------------------------------------------------------------------------
# branch_replay's run-time overhead per call


@dataclasses.dataclass
class Overhead:
    """branch_replay's run-time overhead in one step (seconds, medians over the measured steps): the tree stage
    (``PackedRuntime._tree``: ``build_tree``'s codes, then the compiled CPU kernel's exact sort and layout, or hashing,
    row order, its exact verification and assembly; the positions left out; or a tree reused by provenance), the per-call guards (``PackedRuntime.guards``) and the liveness stage
    (``PackedRuntime._liveness``: the call's live and needed positions, passes/analysis/liveness.py)."""

    tree: float
    guards: float
    liveness: Optional[float]
    liveness_note: str
    calls: int                 # PackedRuntime calls per step

    @property
    def total(self) -> float:
        """Seconds of all timed components."""
        return self.tree + self.guards + (self.liveness or 0.0)


class _ComponentClock:
    """Seconds spent in wrapped callables, per component and per step (:meth:`new_step` opens a step)."""

    def __init__(self, device: torch.device, components: Sequence[str]):
        self.device = device
        self.seconds: dict[str, list[float]] = {c: [] for c in components}
        self.calls: dict[str, list[int]] = {c: [] for c in components}

    def new_step(self) -> None:
        for c in self.seconds:
            self.seconds[c].append(0.0)
            self.calls[c].append(0)

    def wrap(self, component: str, fn: Callable) -> Callable:
        """``fn`` timed into ``component`` (device work included: :func:`sync` before and after)."""
        def timed(*args, **kwargs):
            sync(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(self.device)
                self.seconds[component][-1] += time.perf_counter() - t0
                self.calls[component][-1] += 1
        return timed

    def median(self, component: str) -> float:
        return statistics.median(self.seconds[component]) if self.seconds[component] else 0.0


_MISSING = object()


class _TimedPieces:
    """Within the block, each ``PackedRuntime`` of ``runtimes`` runs its tree stage, guards and liveness method
    (if any) through ``clock``'s timers: instance attributes shadow the methods (``rt._tree``), ``rt.guards``
    holds timed wrappers; on exit every attribute is what it was. Nothing global changes, and the timed
    rounds of the bench never run with the wrappers."""

    def __init__(self, runtimes: Sequence[Any], clock: _ComponentClock):
        self.runtimes, self.clock = list(runtimes), clock
        self.saved: list[tuple[Any, str, Any]] = []   # (runtime, attribute, its instance value or _MISSING)

    def _shadow(self, rt, attr: str, value) -> None:
        self.saved.append((rt, attr, rt.__dict__.get(attr, _MISSING)))
        setattr(rt, attr, value)

    def __enter__(self):
        for rt in self.runtimes:
            self._shadow(rt, "_tree", self.clock.wrap("tree", rt._tree))
            self._shadow(rt, "guards", tuple(self.clock.wrap("guards", g) for g in rt.guards))
            self._shadow(rt, "_liveness", self.clock.wrap("liveness", rt._liveness))
        return self

    def __exit__(self, *exc):
        for rt, attr, value in reversed(self.saved):
            if value is _MISSING:
                rt.__dict__.pop(attr, None)
            else:
                setattr(rt, attr, value)
        self.saved.clear()
        return False


def measure_overhead(runtimes: Sequence[Any], step: Callable[[], None], steps: int,
                     device: torch.device) -> Overhead:
    """Runs ``step()`` ``steps`` times with the pieces of ``runtimes`` (the method's ``PackedRuntime``
    instances, ``BranchReplayBackend.records[i].runtime``) timed (:class:`_TimedPieces`); the medians per step."""
    clock = _ComponentClock(device, ("tree", "guards", "liveness"))
    with _TimedPieces(runtimes, clock):
        for _ in range(max(1, steps)):
            clock.new_step()
            step()
    liveness, note = clock.median("liveness"), "PackedRuntime._liveness: the call's live and needed positions"
    calls = int(statistics.median(clock.calls["tree"])) if clock.calls["tree"] else 0
    return Overhead(tree=clock.median("tree"), guards=clock.median("guards"), liveness=liveness,
                    liveness_note=note, calls=calls)


# ----------------------------------------------------------------------------------------------------
# Running


@dataclasses.dataclass
class MethodResult:
    """One method on one case. Times in seconds, FLOPs of one forward+backward, bytes saved for backward."""

    seconds: Optional[float] = None
    speedup: Optional[float] = None  # dense eager seconds / seconds
    flops: Optional[int] = None
    attention_flops: Optional[int] = None
    over_limit: Optional[float] = None       # flops / the needed limit
    over_tree_limit: Optional[float] = None  # flops / the tree limit (padding counted as work)
    executed_tokens: Optional[int] = None    # tokens one model call runs its layers on (mean over its calls)
    saved_bytes: Optional[int] = None
    loss_rel_err: Optional[float] = None
    max_rel_grad_err: Optional[float] = None
    exact: Optional[bool] = None
    replayed_calls: Optional[int] = None
    fallback_reasons: dict = dataclasses.field(default_factory=dict)
    error: Optional[str] = None
    skipped: Optional[str] = None            # why the method does not apply to the case (not run)


@dataclasses.dataclass
class CaseResult:
    """All methods on one case, with the batch's padding, its prefix tree (:func:`count_tree`), the tree of the
    positions its loss needs (:func:`count_needed`), both limits and branch_replay's overhead."""

    case: Case
    subject: str
    B: int
    L: int
    valid_tokens: int                      # positions whose attention-mask bit is 1
    padding_fraction: float                # 1 - valid_tokens / (B L)
    tree_nodes: int                        # N, the prefix tree's nodes, padding included
    dedup_ratio: float                     # B * L / N
    needed_tokens: int                     # distinct tree nodes the loss needs (the true limit's tokens)
    live_tokens: int                       # distinct tree nodes the loss reads
    dense_flops: Optional[int] = None
    limit_flops: Optional[int] = None      # the needed limit (:func:`needed_limit_flops`)
    limit_attention_flops: Optional[int] = None
    tree_limit_flops: Optional[int] = None  # the tree limit (:func:`limit_flops`): every node, padding included
    overhead: Optional[Overhead] = None
    methods: dict = dataclasses.field(default_factory=dict)  # name -> MethodResult

    @property
    def name(self) -> str:
        if self.subject == "gpt" or self.case.label:
            return self.case.name
        return f"{self.subject}: {self.case.name}"

    @property
    def flop_ratio_limit(self) -> Optional[float]:
        """dense / limit FLOPs: the speedup a method that computes each needed tree node once could reach."""
        return self.dense_flops / self.limit_flops if self.dense_flops and self.limit_flops else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["name"] = self.name
        d["flop_ratio_limit"] = self.flop_ratio_limit
        if self.overhead is not None:
            d["overhead"]["total"] = self.overhead.total
        return d


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class _LineProgress:
    """A minimal stand-in for tqdm: one line per step on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.n, self.desc, self.postfix = total, 0, desc, ""

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s
        print(f"{self.desc} [{self.n}/{self.total}] {s}", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        print(f"{self.desc} [{self.n}/{self.total}] done", file=sys.stderr, flush=True)


def progress_bar(total: int, desc: str = "bench"):
    """tqdm when installed, else one line per step."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _LineProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True)


class _CountedCalls:
    """A method's loss callable that adds up the ``brcompile.stats()`` counters of its own calls (replayed
    calls, tokens they executed, fallback reasons): only what ran inside this method counts, nothing is reset."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.replayed_calls = 0
        self.executed_tokens = 0
        self.fallback_reasons: collections.Counter = collections.Counter()

    def __call__(self):
        from brcompile import runtime

        before = runtime.stats()
        try:
            return self.fn()
        finally:
            after = runtime.stats()
            self.replayed_calls += after.replayed_calls - before.replayed_calls
            self.executed_tokens += after.executed_tokens - before.executed_tokens
            self.fallback_reasons.update(after.fallback_reasons - before.fallback_reasons)


class Runner:
    """Runs the methods on the cases of one subject (see the module docstring).

    Per case: the dense eager reference, then each method is prepared (compiled, run once for exactness,
    bytes saved for backward), then all methods are timed interleaved (one run of each per round, ``repeats``
    rounds after a warm-up round), so load on a shared machine hits them alike; then branch_replay's overhead
    is measured on its own steps (:func:`measure_overhead`), and the FLOPs are counted last.
    """

    def __init__(self, subject, args, device: torch.device):
        self.subject, self.model, self.args, self.device = subject, subject.model, args, device
        self.dtype = next(self.model.parameters()).dtype
        self.params = list(self.model.parameters())
        self.param_ptrs = storage_ptrs(self.params)
        self.backends: dict[str, Any] = {}    # method -> its brcompile backend object (records, runtimes)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def _run_once(self, loss_fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.model.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        return loss.detach(), self._grads()

    def _step(self, loss_fn) -> Callable[[], None]:
        def step():
            self.model.zero_grad(set_to_none=True)
            loss_fn().backward()
        return step

    def _exactness(self, res: MethodResult, first, ref) -> None:
        (loss, grads), (ref_loss, ref_grads) = first, ref
        res.loss_rel_err = rel_err(loss, ref_loss)
        res.max_rel_grad_err = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
        tol = self.subject.tolerance(self.dtype)
        res.exact = res.loss_rel_err <= tol and res.max_rel_grad_err <= tol

    def _prepare(self, res: MethodResult, loss_fn, ref) -> Callable[[], None]:
        """First (warm-up/compile) run -> exactness; bytes saved for backward; returns the timed step."""
        self._exactness(res, self._run_once(loss_fn), ref)
        step = self._step(loss_fn)
        res.saved_bytes = saved_activation_bytes(step, self.param_ptrs)
        return step

    def _loss_fn(self, method: str, case: Case, batch: dict, dense_fn: Callable,
                 res: MethodResult) -> Callable[[], Any]:
        """The method's loss callable, built in its own scope: each method holds its own compiled function
        (nothing is shared between methods through a variable rebound later). Sets ``res.executed_tokens``
        where it is known before running (dense: B L; PrefixGrouper: its grouped rows, padding included)."""
        import brcompile

        B, L = batch["input_ids"].shape
        if method in ("eager", "torch.compile"):
            res.executed_tokens = B * L
        if method == "eager":
            return dense_fn
        if method == "torch.compile":
            return self.subject.compiled_loss(method, case, batch, self.args.compile_backend)
        if method == "branch_replay":
            backend = self.backends[method] = brcompile.backend(compiler=self.args.compiler,
                                                                min_dedup=self.args.min_dedup)
            return self.subject.compiled_loss(method, case, batch, backend)
        if method == "prefix_grouper":
            from benchmarks import peer_prefix_grouper as pg

            if not self.subject.prefix_grouper:
                raise NotApplicable(f"the PrefixGrouper adapter runs the example GPT's GRPO loss, not "
                                 f"{self.subject.name}")
            available, why = pg.status()
            if not available:
                raise BenchError(why)
            grouped = pg.group_batch(batch, case.group_size)
            res.executed_tokens = grouped.input_ids.numel()
            return functools.partial(pg.prefix_grouper_grpo_loss, self.model, grouped, batch)
        raise BenchError(f"unknown method {method!r}; choose from {METHODS}")

    def _case_result(self, case: Case, batch: dict) -> tuple[CaseResult, TreeCount, NeededCount]:
        """The case's sizes: padding, the tree (:func:`count_tree`, keys as the model sees them) and the needed
        tree (:func:`count_needed`)."""
        B, L = batch["input_ids"].shape
        window = self.subject.head_window(batch)
        liveness = self.subject.liveness(case, batch)
        tree = count_tree(batch["input_ids"], liveness.key_visible.long(), window)
        needed = count_needed(batch["input_ids"], liveness, window)
        if needed.tree_nodes != tree.nodes:
            log.warning("bench: build_tree found %d nodes, count_tree %d", needed.tree_nodes, tree.nodes)
        out = CaseResult(case, self.subject.name, B, L, int(batch["attention_mask"].bool().sum()),
                         padding_fraction(batch), tree.nodes, B * L / tree.nodes, needed.nodes, needed.live_nodes)
        out.methods = {m: MethodResult() for m in self.args.methods}
        return out, tree, needed

    def run_case(self, case: Case, bar) -> CaseResult:
        batch = self.subject.make_batch(case, self.args.seed, self.device, self.dtype)
        out, tree, needed = self._case_result(case, batch)
        dense_fn = self.subject.dense_loss(case, batch)
        ref = self._run_once(dense_fn)
        torch._dynamo.reset()  # the previous case's compiled code goes: every method compiles afresh
        self.backends = {}
        steps: dict[str, Callable[[], None]] = {}
        counted: dict[str, _CountedCalls] = {}
        for method in self.args.methods:
            bar.set_postfix_str(f"{out.name} {method}")
            res = out.methods[method]
            try:
                counted[method] = _CountedCalls(self._loss_fn(method, case, batch, dense_fn, res))
                steps[method] = self._prepare(res, counted[method], ref)
            except NotApplicable as e:
                res.skipped = str(e)
            except Exception as e:  # report it in the table and go on with the other methods
                log.warning("bench: %s on %s failed", method, out.name, exc_info=log.isEnabledFor(logging.DEBUG))
                res.error = _short(e)
        bar.set_postfix_str(f"{out.name} timing")
        self._time_interleaved(steps, out)
        if "branch_replay" in steps:
            bar.set_postfix_str(f"{out.name} overhead")
            runtimes = [r.runtime for r in self.backends["branch_replay"].records if r.runtime is not None]
            out.overhead = measure_overhead(runtimes, steps["branch_replay"], self.args.repeats, self.device)
        bar.set_postfix_str(f"{out.name} FLOPs")
        for method, step in steps.items():  # last: the counts run every method once more
            try:
                count = count_flops(step)
            except Exception as e:
                log.warning("bench: counting %s on %s failed", method, out.name, exc_info=True)
                out.methods[method].error = _short(e)
                continue
            out.methods[method].flops, out.methods[method].attention_flops = count.total, count.attention
            if method == "eager":
                passes = self.subject.passes
                limit = needed_limit_flops(count, needed, self.subject.config, passes)
                out.dense_flops, out.limit_flops, out.limit_attention_flops = count.total, limit.total, limit.attention
                out.tree_limit_flops = limit_flops(count, tree, self.subject.config, passes).total
        for method, calls in counted.items():
            res = out.methods[method]
            res.replayed_calls, res.fallback_reasons = calls.replayed_calls, dict(calls.fallback_reasons)
            if method == "branch_replay" and calls.replayed_calls:
                res.executed_tokens = round(calls.executed_tokens / calls.replayed_calls)
            if method != "branch_replay" and calls.replayed_calls and not res.error:
                res.error = (f"BenchError: {method} ran branch_replay's packed graph {calls.replayed_calls} "
                             f"time(s): its numbers are not the dense method's")
        eager = out.methods.get("eager")
        for res in out.methods.values():
            if eager is not None and eager.seconds and res.seconds:
                res.speedup = eager.seconds / res.seconds
            if res.flops and out.limit_flops:
                res.over_limit = res.flops / out.limit_flops
            if res.flops and out.tree_limit_flops:
                res.over_tree_limit = res.flops / out.tree_limit_flops
        bar.update(len(self.args.methods))
        return out

    def _time_interleaved(self, steps: dict[str, Callable[[], None]], out: CaseResult) -> None:
        """A warm-up round, then ``repeats`` rounds running each method once; the median per method. A method
        that fails is dropped from ``steps`` (and from the FLOP count after)."""
        times: dict[str, list[float]] = {m: [] for m in steps}
        for round_ in range(1 + max(1, self.args.repeats)):
            for method, step in list(steps.items()):
                try:
                    sync(self.device)
                    t0 = time.perf_counter()
                    step()
                    sync(self.device)
                    if round_:
                        times[method].append(time.perf_counter() - t0)
                except Exception as e:
                    out.methods[method].error = _short(e)
                    steps.pop(method)
                    times.pop(method)
        for method, ts in times.items():
            out.methods[method].seconds = statistics.median(ts)


# ----------------------------------------------------------------------------------------------------
# Output: tables, JSON, plot


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(part: Optional[float], whole: Optional[float]) -> str:
    return "-" if part is None or not whole else f"{100 * part / whole:.1f}%"


def overhead_cells(r: CaseResult) -> list[str]:
    """branch_replay's step ms, its runtime calls per step, then tree, guards and liveness as "ms (% of the
    step)", the total's % and whether it is within :data:`OVERHEAD_TARGET`."""
    br = r.methods.get("branch_replay")
    o, step = r.overhead, br.seconds if br is not None else None
    if o is None or not step:
        return [_ms(step), "-", "-", "-", "-", "-", "-"]
    live = "n/a" if o.liveness is None else f"{o.liveness * 1e3:.2f} ({_pct(o.liveness, step)})"
    return [_ms(step), str(o.calls), f"{o.tree * 1e3:.2f} ({_pct(o.tree, step)})", f"{o.guards * 1e3:.2f} ({_pct(o.guards, step)})",
            live, _pct(o.total, step), "yes" if o.total <= OVERHEAD_TARGET * step else "NO"]


#: The target bound of branch_replay's run-time overhead (tree, guards, liveness) as a fraction of a step.
OVERHEAD_TARGET = 0.03


def result_tables(results: list[CaseResult], methods: Sequence[str]) -> list:
    """The bench's tables (``brcompile.tools.explain.Table``) and notes."""
    from brcompile.tools.explain import Table, fmt_bytes, fmt_flops

    others = [m for m in methods if m != "eager"]
    time_rows, flop_rows, token_rows, over_rows, mem_rows, exact_rows, notes = [], [], [], [], [], [], []
    for r in results:
        m = r.methods
        time_rows.append([r.name, f"{100 * r.padding_fraction:.0f}%", f"{r.B}x{r.L}", f"{r.tree_nodes:,}",
                          f"{r.needed_tokens:,}", _ms(m["eager"].seconds) if "eager" in m else "-"]
                         + [f"{_ms(m[k].seconds)} ({_x(m[k].speedup)})" if k in m and m[k].seconds else "-"
                            for k in others] + [_x(r.flop_ratio_limit)])
        flop_rows.append([r.name, fmt_flops(r.limit_flops), fmt_flops(r.tree_limit_flops)]
                         + [f"{fmt_flops(m[k].flops)} ({_x(m[k].over_limit)})" if k in m and m[k].flops else "-"
                            for k in methods]
                         + [_x(m["branch_replay"].over_tree_limit) if "branch_replay" in m else "-"])
        token_rows.append([r.name, f"{r.B * r.L:,}", f"{r.valid_tokens:,}", f"{r.tree_nodes:,}",
                           f"{r.needed_tokens:,}", f"{r.live_tokens:,}"]
                          + [f"{m[k].executed_tokens:,}" if k in m and m[k].executed_tokens else "-" for k in methods])
        if "branch_replay" in m:
            over_rows.append([r.name] + overhead_cells(r))
            if r.overhead is not None and not notes_has(notes, r.overhead.liveness_note):
                notes.append(f"liveness: {r.overhead.liveness_note}")
        mem_rows.append([r.name] + [fmt_bytes(m[k].saved_bytes) if k in m else "-" for k in methods])
        exact_rows.append([r.name] + [
            "-" if k not in m or m[k].exact is None else
            f"{'yes' if m[k].exact else 'NO'} {max(m[k].loss_rel_err, m[k].max_rel_grad_err):.1e}"
            for k in others])
        for k, res in m.items():
            if res.error:
                notes.append(f"{r.name}: {k} failed: {res.error}")
            if res.skipped and not notes_has(notes, res.skipped):
                notes.append(f"{k} not run: {res.skipped}")
            for reason, n in res.fallback_reasons.items():
                notes.append(f"{r.name}: {k} ran the original graph x{n}: {reason}")
            if k == "branch_replay" and res.replayed_calls == 0 and not res.error:
                notes.append(f"{r.name}: branch_replay replayed nothing (its numbers are the dense graph's)")
    return [
        Table("wall-clock of one forward+backward: median ms (speedup over dense eager)",
              ["case", "pad", "B x L", "tree N", "needed N", "eager ms"] + [f"{k} ms" for k in others]
              + ["FLOP limit"], time_rows,
              ["pad: positions with attention-mask bit 0; tree N: prefix-tree nodes, padding included; needed N: "
               "distinct nodes the loss needs; FLOP limit = dense FLOPs / needed-limit FLOPs."]),
        Table("executed FLOPs of one forward+backward (x the needed limit)",
              ["case", "limit", "tree limit"] + list(methods) + ["branch_replay/tree limit"], flop_rows,
              ["limit: the layers over the needed nodes, the LM head over the live nodes, attention over each "
               "needed node's visible ancestors; tree limit: every tree node, padding included. Every method "
               "counted on its own forward+backward, compiled code included; dense attention is counted over the "
               "full score matrix, tree attention over the visible pairs."]),
        Table("tokens: per model call", ["case", "B*L", "valid", "tree N", "needed N", "live N"]
              + [f"{k} runs" for k in methods], token_rows,
              ["valid: attention-mask bit 1; live: distinct nodes whose output the loss reads; `runs`: the tokens a "
               "method's layers run on per call (PrefixGrouper: its grouped rows, padding included)."]),
        Table(f"branch_replay run-time overhead per step: ms (% of its step); target <= {OVERHEAD_TARGET:.0%}",
              ["case", "step ms", "calls", "tree", "guards", "liveness", "total", f"<= {OVERHEAD_TARGET:.0%}"],
              over_rows,
              ["calls: PackedRuntime calls per step; tree: PackedRuntime._tree (build_tree: codes, row order, layout; "
               "drop_positions); "
               "guards: PackedRuntime.guards; timed on separate steps (the timed rounds run unwrapped)."]),
        Table("bytes saved for backward (saved_tensors_hooks, parameters excluded)", ["case"] + list(methods),
              mem_rows),
        Table("exactness vs dense eager: max relative error over the loss and every parameter gradient",
              ["case"] + others, exact_rows, notes),
    ]


def notes_has(notes: list[str], text: str) -> bool:
    """Whether a note already mentions ``text``."""
    return any(text in n for n in notes)


def plot_speedups(results: list[CaseResult], path: Path) -> Optional[str]:
    """Speedup over dense eager vs P/T, one colour per (model, G): branch_replay solid, prefix_grouper
    dotted, torch.compile dash-dot, the FLOP-ratio limit dashed. Returns None, or why no plot was written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed, no plot (pip install matplotlib): {e}"
    fig, ax = plt.subplots(figsize=(8, 5))
    lines = sorted({(r.subject, r.case.group_size) for r in results})
    colours = plt.get_cmap("tab10")
    styles = (("branch_replay", "-", "o"), ("prefix_grouper", ":", "s"), ("torch.compile", "-.", "^"))
    for i, (subject, G) in enumerate(lines):
        label = f"G={G}" if subject == "gpt" else f"{subject} G={G}"
        rs = sorted((r for r in results if (r.subject, r.case.group_size) == (subject, G)),
                    key=lambda r: r.case.prefix_len / r.case.tail_len)
        x = [r.case.prefix_len / r.case.tail_len for r in rs]
        for method, style, marker in styles:
            pts = [(xi, r.methods[method].speedup) for xi, r in zip(x, rs)
                   if method in r.methods and r.methods[method].speedup]
            if pts:
                ax.plot(*zip(*pts), linestyle=style, marker=marker, color=colours(i), label=f"{method}, {label}")
        lim = [(xi, r.flop_ratio_limit) for xi, r in zip(x, rs) if r.flop_ratio_limit]
        if lim:
            ax.plot(*zip(*lim), linestyle="--", color=colours(i), alpha=0.6, label=f"FLOP-ratio limit, {label}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ticks = sorted({r.case.prefix_len / r.case.tail_len for r in results})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("prefix / tail length (P / T)")
    ax.set_ylabel("speedup over dense eager (fwd+bwd wall-clock)")
    ax.set_title("GRPO loss forward+backward: speedup vs prefix/tail ratio")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------------------------------
# Command line


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _methods(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in METHODS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"unknown method(s) {bad}; choose from {','.join(METHODS)}")
    return ["eager"] + [v for v in values if v != "eager"]  # eager is the reference: always first


def _cases(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if values == ["all"]:
        return list(SUITE_CASES)
    if values == ["grid"]:
        return values
    bad = [v for v in values if v not in SUITE_CASES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"unknown case(s) {bad}; choose from all, grid, {', '.join(SUITE_CASES)}")
    return values


def _suite_text(z: SuiteSizes) -> str:
    return ",".join(str(getattr(z, f.name)) for f in dataclasses.fields(z))


def _suite_sizes(text: str) -> SuiteSizes:
    values = _ints(text)
    if len(values) != 6:
        raise argparse.ArgumentTypeError(f"expected G,GROUPS,P,TMIN,TMAX,SHARED (6 integers), got {text!r}")
    z = SuiteSizes(*values)
    if z.t_min > z.t_max:
        raise argparse.ArgumentTypeError(f"TMIN={z.t_min} > TMAX={z.t_max}")
    return z


#: What ``--quick`` changes (flags given explicitly win): a tiny model, suite and grid, in seconds.
QUICK = dict(group_sizes=[2, 4], prefix_lens=[16, 48], tail_lens=[8], dim=32, layers=1, heads=2, kv_heads=1,
             vocab=61, repeats=1, compile_backend="aot_eager", compiler="eager", suite_sizes=SUITE_SIZES["quick"])

#: The flags of the G x P x T grid: one given without ``--cases`` means ``--cases grid``.
GRID_FLAGS = ("group_sizes", "prefix_lens", "tail_lens", "num_prompts", "ragged", "shared_response", "mixed_groups",
              "model")


def _given(p: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations of the options written out in ``argv`` (``--flag`` or ``--flag=value``)."""
    given = set()
    for action in p._actions:
        for opt in action.option_strings:
            if any(tok == opt or tok.startswith(opt + "=") for tok in argv):
                given.add(action.dest)
    return given


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """The bench's flags."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=_cases, default=None,
                   help="suite cases, comma-separated, or 'all', or 'grid' (the G x P x T grid); suite cases: "
                        f"{', '.join(SUITE_CASES)}. Default: all, or grid when a grid flag (--model, --group-sizes, "
                        "--prefix-lens, --tail-lens, --num-prompts, --ragged, --shared-response, --mixed-groups) is "
                        "given")
    p.add_argument("--suite-sizes", type=_suite_sizes, default=SUITE_SIZES["default"],
                   help="sizes of the suite cases: G,GROUPS,P,TMIN,TMAX,SHARED (default "
                        f"{_suite_text(SUITE_SIZES['default'])}; --quick: {_suite_text(SUITE_SIZES['quick'])})")
    p.add_argument("--model", choices=("gpt", "qwen2", "both"), default="gpt",
                   help="grid: the example GPT (loss compiled), a HF Qwen2 of the same sizes (model compiled, TRL "
                        "layout; needs transformers), or both")
    p.add_argument("--group-sizes", "--group-size", type=_ints, default=[4, 8],
                   help="G values, comma-separated (default 4,8)")
    p.add_argument("--prefix-lens", "--prompt-lens", type=_ints, default=[64, 256, 1024],
                   help="prompt lengths P (default 64,256,1024)")
    p.add_argument("--tail-lens", "--response-len", type=_ints, default=[64], help="response lengths T (default 64)")
    p.add_argument("--num-prompts", type=int, default=1, help="groups per batch (default 1: PrefixGrouper's best case)")
    p.add_argument("--ragged", action="store_true", help="response lengths drawn from [T/2, T], right-padded")
    p.add_argument("--shared-response", type=int, default=0, help="leading response tokens shared in a group")
    p.add_argument("--mixed-groups", action="store_true",
                   help="after each case also a mixed batch: 2 groups, prompts in [P/2, P], responses in [T/4, T], "
                        "the first T/8 response tokens shared")
    p.add_argument("--methods", type=_methods, default=list(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--backend", default=None,
                   help="shortcut for one compiled method: 'branch_replay' means --methods eager,branch_replay; "
                        "any other torch.compile backend B means --methods eager,torch.compile --compile-backend B")
    p.add_argument("--compile-backend", default="inductor", help="backend of the dense torch.compile method")
    p.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager", "eager"),
                   help="how branch_replay runs its packed graph")
    p.add_argument("--min-dedup", type=float, default=1.05, help="branch_replay's min_dedup")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method after a warm-up (median)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for bench.json and bench_speedup.png")
    p.add_argument("--json", type=Path, default=None, help="also write the JSON document here")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quick", action="store_true",
                   help="a tiny model, suite and grid in seconds (suite sizes "
                        f"{_suite_text(SUITE_SIZES['quick'])}; grid G 2,4, P 16,48, T 8; dim 32; 1 layer; "
                        "aot_eager); flags given explicitly win")
    p.add_argument("--rich", choices=("auto", "yes", "no"), default="auto", help="tables with rich")
    return p


def parse_args(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> argparse.Namespace:
    """Parses the bench's flags: ``--quick`` sets :data:`QUICK` as defaults, ``--backend`` picks the methods."""
    p = build_parser(prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if args.cases is None:
        args.cases = ["grid"] if _given(p, argv) & set(GRID_FLAGS) else list(SUITE_CASES)
    if args.backend is not None:
        if args.backend == "branch_replay":
            args.methods = ["eager", "branch_replay"]
        else:
            args.methods, args.compile_backend = ["eager", "torch.compile"], args.backend
    return args


def run(args: argparse.Namespace) -> dict:
    """Runs the grid of ``args`` (:func:`parse_args`), prints the tables, writes JSON and the plot; returns the
    JSON document."""
    from brcompile.tools.explain import print_blocks
    from benchmarks import peer_prefix_grouper as pg

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    config = GPTConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       n_kv_heads=args.kv_heads)
    cases = make_cases(args)
    keys = list(dict.fromkeys(c.subject for c in cases))   # (model, loss), in the cases' order
    pg_line = pg.status()[1] if "prefix_grouper" in args.methods else "prefix_grouper not run"
    names = {("gpt", "grpo"): "gpt", ("qwen2", "grpo"): "qwen2", ("gpt", "dpo"): "gpt dpo"}
    print(f"model: {' and '.join(names.get(k, str(k)) for k in keys)}, dim {args.dim}, layers {args.layers}, heads "
          f"{args.heads} (kv {args.kv_heads}), vocab {args.vocab}, {args.dtype}, {device.type}; {len(cases)} case(s) "
          f"x {len(args.methods)} method(s); median of {args.repeats}; torch.compile backend {args.compile_backend}, "
          f"branch_replay compiler {args.compiler}; {pg_line}", flush=True)
    bar = progress_bar(len(cases) * len(args.methods))
    runners: dict[tuple[str, str], Runner] = {}
    results = []
    try:
        for case in cases:
            if case.subject not in runners:
                subject = make_subject(case.subject, config, args.seed, dtype, device, cases)
                runners[case.subject] = Runner(subject, args, device)
            results.append(runners[case.subject].run_case(case, bar))
    finally:
        bar.close()
    blocks = result_tables(results, args.methods)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / "bench.json", args.out / "bench_speedup.png"
    plot_note = "plot skipped (--no-plot)" if args.no_plot else plot_speedups(results, png_path)
    doc = {
        "schema": "brcompile.bench/3",
        "config": {k: (str(v) if isinstance(v, Path) else dataclasses.asdict(v) if isinstance(v, SuiteSizes) else v)
                   for k, v in vars(args).items()},
        "environment": {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
                        "machine": platform.machine(), "prefix_grouper": pg_line},
        "results": [r.to_dict() for r in results],
        "plot": None if plot_note else str(png_path),
        "notes": [n for n in (plot_note,) if n],
    }
    text = json.dumps(doc, indent=2, default=str)
    json_path.write_text(text)
    written = [json_path] + ([] if plot_note else [png_path])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
        written.append(args.json)
    print_blocks(blocks + [f"wrote {', '.join(map(str, written))}"] + doc["notes"],
                 rich={"auto": None, "yes": True, "no": False}[args.rich])
    return doc


def exit_status(doc: dict) -> int:
    """1 when a method gave a wrong number (not exact), branch_replay failed or another method ran
    branch_replay's packed graph; else 0."""
    for r in doc["results"]:
        for name, m in r["methods"].items():
            if m.get("exact") is False or (name == "branch_replay" and m.get("error")):
                return 1
            if name != "branch_replay" and m.get("replayed_calls"):
                return 1
    return 0


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """Parses ``argv``, runs the grid; returns the exit status (:func:`exit_status`)."""
    return exit_status(run(parse_args(argv, prog)))
