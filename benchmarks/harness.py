"""The GRPO benchmark: dense eager vs torch.compile vs branch_replay vs PrefixGrouper, side by side.

Run it as ``python benchmarks/bench_grpo.py [flags]`` from a checkout (``--help`` lists the flags). On the
example Llama-style GPT and its GRPO loss (``examples/``), or an unmodified HF Qwen2 of the same sizes run
TRL's way (``--model qwen2``), over a grid of group sizes G, prompt (prefix) lengths P and response (tail)
lengths T, it measures on the same model and batch:

* ``eager``: the dense loss forward+backward, eagerly (the reference for speed and exactness);
* ``torch.compile``: the dense loss compiled by ``--compile-backend`` (Inductor by default);
* ``branch_replay``: compiled with ``brcompile.backend(compiler=--compiler, min_dedup=--min-dedup)``;
* ``prefix_grouper``: PrefixGrouper (``pip install prefix-grouper``), the published peer, through its own API
  (``benchmarks/peer_prefix_grouper.py``; the example GPT only). Building its ``PrefixGrouper`` and regrouping the
  inputs is data preparation in a PrefixGrouper trainer, so it is not timed (branch_replay's tree building is
  timed: it runs per call).

``--model gpt`` compiles the whole GRPO loss. ``--model qwen2`` runs ``Qwen2ForCausalLM`` (examples/hf.py)
the way TRL does: prompts left-padded, only the model compiled, called with ``logits_to_keep = C + 1``, the
loss eager over those logits (``examples.hf.trl_grpo_loss``); there the LM head runs on the last C + 1
columns only, and the limit counts it over the tree nodes in those columns (:func:`limit_flops`).
``--model both`` runs the GPT grid, then the Qwen2 one.

Per case and method: wall-clock of one forward+backward, exactness (max relative error of the loss and every
parameter gradient against dense eager), bytes saved for backward (``brcompile.tools.measure.SavedBytes``:
distinct storages, parameters excluded), executed FLOPs, and ``replayed_calls`` (the branch_replay calls made
inside the method's own calls). Per case: the batch's prefix tree counted independently of brcompile
(:func:`count_tree`: N nodes) and the **limit**, the FLOPs of a forward+backward over just the N nodes:

    limit = (F_dense - A_dense) * N / (B * L)  +  n_layers * H * P_tree * (4 + 10) * D

* F_dense/A_dense: all/attention FLOPs of the dense run. Everything but attention (projections, MLP, LM head)
  is per position, so over N tokens it costs N / (B L) as much.
* P_tree: the (query, key) pairs attention must compute in the tree: for every node, its ancestors, itself
  included, whose attention-mask bit is 1; per pair, head and layer 4 D forward (q k^T, p v) and 10 D backward
  (torch's ``sdpa_flop_count`` / ``sdpa_backward_flop_count`` per score), H query heads of width D.

Running the model on one row of N packed tokens would NOT give the limit: causal attention over that row
would let every token see all earlier tokens, siblings included. N counts every distinct (row prefix) node,
padding included (brcompile's default keeps pad tokens as tree nodes).

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

    python benchmarks/bench_grpo.py                           # G in {4, 8}, P in {64, 256, 1024}, T=64
    python benchmarks/bench_grpo.py --group-sizes 8 --prefix-lens 1024 --tail-lens 128 --repeats 4
    python benchmarks/bench_grpo.py --quick                   # a tiny grid, seconds
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


class BenchError(RuntimeError):
    """The bench cannot run a method as asked (PrefixGrouper missing or on another model, ...)."""


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


def lm_head_flops(config: GPTConfig, positions: int) -> int:
    """FLOPs of an LM head (a bias-free ``dim -> vocab`` linear) over ``positions`` positions, forward and
    backward: ``y = x W^T`` (2 dim vocab), ``dx = dy W`` (2 dim vocab), ``dW = dy^T x`` (2 dim vocab)."""
    return 3 * 2 * config.dim * config.vocab_size * positions


def limit_flops(dense: FlopCount, tree: TreeCount, config: GPTConfig) -> FlopCount:
    """The limit (module docstring): non-attention dense FLOPs scaled by N/(B L) plus exact tree attention.

    With ``tree.window`` > 0 the LM head ran on the last ``window`` columns only (``logits_to_keep``): its
    dense FLOPs (:func:`lm_head_flops` over B * window positions) are scaled by window_nodes / (B * window)
    instead, the rest by N / (B L)."""
    if tree.window:
        head = lm_head_flops(config, tree.rows * tree.window)
        other = (dense.other - head) * tree.nodes / tree.logical \
            + head * tree.window_nodes / (tree.rows * tree.window)
    else:
        other = dense.other * tree.nodes / tree.logical
    attention = config.n_layers * config.n_heads * tree.tree_pairs \
        * (FWD_PAIR_FLOPS_PER_D + BWD_PAIR_FLOPS_PER_D) * config.head_dim
    return FlopCount(total=int(round(other + attention)), attention=int(attention))


# ----------------------------------------------------------------------------------------------------
# Cases and subjects


METHODS = ("eager", "torch.compile", "branch_replay", "prefix_grouper")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


@dataclasses.dataclass(frozen=True)
class Case:
    """One batch: ``num_prompts`` prompts of length P (or drawn from [``prefix_min``, P]), each with G
    responses of length T (or drawn from [``tail_min``, T], right-padded), the first ``shared_response``
    response tokens shared within a group."""

    group_size: int
    prefix_len: int
    tail_len: int
    num_prompts: int = 1
    shared_response: int = 0
    prefix_min: Optional[int] = None
    tail_min: Optional[int] = None

    @property
    def name(self) -> str:
        def span(lo, hi):
            return f"{lo}..{hi}" if lo is not None and lo != hi else f"{hi}"
        name = f"G={self.group_size} P={span(self.prefix_min, self.prefix_len)} T={span(self.tail_min, self.tail_len)}"
        if self.num_prompts > 1:
            name = f"{self.num_prompts} groups {name}"
        if self.shared_response:
            name += f" shared {self.shared_response}"
        return name

    def batch_kwargs(self) -> dict:
        """``examples.grpo.make_grpo_batch`` arguments of this case."""
        prompt = self.prefix_len if self.prefix_min is None else (self.prefix_min, self.prefix_len)
        tail = self.tail_len if self.tail_min is None else (self.tail_min, self.tail_len)
        lo = self.tail_len if self.tail_min is None else self.tail_min
        return dict(num_prompts=self.num_prompts, group_size=self.group_size, prompt_len=prompt,
                    response_len=tail, shared_response_prefix=min(self.shared_response, lo))


def make_cases(args) -> list[Case]:
    """The grid of ``args``: every (G, P, T), with ``--num-prompts``, ``--ragged`` (responses drawn from
    [T/2, T]) and ``--shared-response``; with ``--mixed-groups`` each is followed by a mixed batch of 2 groups,
    prompts drawn from [P/2, P], responses from [T/4, T], the first T/8 response tokens shared."""
    cases = []
    for G in args.group_sizes:
        for P in args.prefix_lens:
            for T in args.tail_lens:
                cases.append(Case(G, P, T, args.num_prompts, args.shared_response,
                                  tail_min=max(1, T // 2) if args.ragged else None))
                if args.mixed_groups:
                    cases.append(Case(G, P, T, 2, T // 8, prefix_min=max(1, P // 2), tail_min=max(1, T // 4)))
    return cases


def _loss_torch_compile(model, batch: dict):
    """The dense GPT loss, for the torch.compile method (its own code object: its own Dynamo cache)."""
    return grpo_loss(model, **batch)


def _loss_branch_replay(model, batch: dict):
    """The dense GPT loss, for the branch_replay method (its own code object: its own Dynamo cache)."""
    return grpo_loss(model, **batch)


_COMPILED_LOSSES = {"torch.compile": _loss_torch_compile, "branch_replay": _loss_branch_replay}


class GPTSubject:
    """The example GPT; the whole GRPO loss compiled."""

    name = "gpt"
    left_pad_prompts = False
    prefix_grouper = True   # benchmarks/peer_prefix_grouper.py writes out this model's forward

    def __init__(self, config: GPTConfig, seed: int, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.model = GPT(config, seed=seed).to(device=device, dtype=dtype)

    def dense_loss(self, batch: dict) -> Callable[[], torch.Tensor]:
        """The eager loss of ``batch``."""
        return functools.partial(grpo_loss, self.model, **batch)

    def compiled_loss(self, method: str, batch: dict, backend) -> Callable[[], torch.Tensor]:
        """The loss of ``batch`` compiled by ``backend``, through ``method``'s own wrapper."""
        compiled = torch.compile(_COMPILED_LOSSES[method], backend=backend)
        return functools.partial(compiled, self.model, batch)

    def head_window(self, batch: dict) -> int:
        """Columns the LM head runs on (0: all)."""
        return 0

    def tolerance(self, dtype: torch.dtype) -> float:
        """The exactness bound of a method's loss and gradients against dense eager (brcompile/testing.py)."""
        return TOLERANCE.get(dtype, 1e-5)


class Qwen2Subject:
    """A HF Qwen2 of ``config``'s sizes, TRL-style: the model compiled alone, ``logits_to_keep = C + 1``,
    the loss eager (examples/hf.py); prompts left-padded."""

    name = "qwen2"
    left_pad_prompts = True
    prefix_grouper = False

    def __init__(self, config: GPTConfig, seed: int, dtype: torch.dtype, device: torch.device, max_positions: int):
        from examples.hf import qwen2_model

        self.config = config
        self.model = qwen2_model(config, max_positions=max_positions, seed=seed, dtype=dtype).to(device)

    def dense_loss(self, batch: dict) -> Callable[[], torch.Tensor]:
        from examples.hf import completion_width, trl_grpo_loss

        return functools.partial(trl_grpo_loss, self.model, **batch,
                                 completion_len=completion_width(batch["completion_mask"]))

    def compiled_loss(self, method: str, batch: dict, backend) -> Callable[[], torch.Tensor]:
        from examples.hf import completion_width, trl_grpo_loss

        return functools.partial(trl_grpo_loss, torch.compile(self.model, backend=backend), **batch,
                                 completion_len=completion_width(batch["completion_mask"]))

    def head_window(self, batch: dict) -> int:
        from examples.hf import completion_width

        return completion_width(batch["completion_mask"]) + 1

    def tolerance(self, dtype: torch.dtype) -> float:
        """The float32 bound whatever ``dtype``: HF's RMSNorm normalises in float32 even in a float64 model,
        and a shared token's gradient is summed in another order by the packed backward (tests/models/test_hf.py
        measures ~1e-7 in float64)."""
        return 1e-5


# ----------------------------------------------------------------------------------------------------
# Running


@dataclasses.dataclass
class MethodResult:
    """One method on one case. Times in seconds, FLOPs of one forward+backward, bytes saved for backward."""

    seconds: Optional[float] = None
    speedup: Optional[float] = None  # dense eager seconds / seconds
    flops: Optional[int] = None
    attention_flops: Optional[int] = None
    saved_bytes: Optional[int] = None
    loss_rel_err: Optional[float] = None
    max_rel_grad_err: Optional[float] = None
    exact: Optional[bool] = None
    replayed_calls: Optional[int] = None
    fallback_reasons: dict = dataclasses.field(default_factory=dict)
    error: Optional[str] = None


@dataclasses.dataclass
class CaseResult:
    """All methods on one case, with the batch's tree sizes (:func:`count_tree`) and the FLOP limit."""

    case: Case
    subject: str
    B: int
    L: int
    valid_tokens: int
    executed_tokens: int                   # N, the prefix tree's nodes
    dedup_ratio: float                     # B * L / N
    dense_flops: Optional[int] = None
    limit_flops: Optional[int] = None
    limit_attention_flops: Optional[int] = None
    methods: dict = dataclasses.field(default_factory=dict)  # name -> MethodResult

    @property
    def name(self) -> str:
        return self.case.name if self.subject == "gpt" else f"{self.subject}: {self.case.name}"

    @property
    def flop_ratio_limit(self) -> Optional[float]:
        """dense / limit FLOPs: the speedup a method that computes each tree node once could reach."""
        return self.dense_flops / self.limit_flops if self.dense_flops and self.limit_flops else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["name"] = self.name
        d["flop_ratio_limit"] = self.flop_ratio_limit
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
    calls, fallback reasons): only what ran inside this method counts, nothing is reset."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.replayed_calls = 0
        self.fallback_reasons: collections.Counter = collections.Counter()

    def __call__(self):
        from brcompile import runtime

        before = runtime.stats()
        try:
            return self.fn()
        finally:
            after = runtime.stats()
            self.replayed_calls += after.replayed_calls - before.replayed_calls
            self.fallback_reasons.update(after.fallback_reasons - before.fallback_reasons)


class Runner:
    """Runs the methods on the cases of one subject (see the module docstring).

    Per case: the dense eager reference, then each method is prepared (compiled, run once for exactness,
    bytes saved for backward), then all methods are timed interleaved (one run of each per round, ``repeats``
    rounds after a warm-up round), so load on a shared machine hits them alike; the FLOPs are counted last.
    """

    def __init__(self, subject, args, device: torch.device):
        self.subject, self.model, self.args, self.device = subject, subject.model, args, device
        self.dtype = next(self.model.parameters()).dtype
        self.params = list(self.model.parameters())
        self.param_ptrs = storage_ptrs(self.params)

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

    def _loss_fn(self, method: str, case: Case, batch: dict, dense_fn: Callable) -> Callable[[], Any]:
        """The method's loss callable, built in its own scope: each method holds its own compiled function
        (nothing is shared between methods through a variable rebound later)."""
        import brcompile

        if method == "eager":
            return dense_fn
        if method == "torch.compile":
            return self.subject.compiled_loss(method, batch, self.args.compile_backend)
        if method == "branch_replay":
            return self.subject.compiled_loss(method, batch, brcompile.backend(
                compiler=self.args.compiler, min_dedup=self.args.min_dedup))
        if method == "prefix_grouper":
            from benchmarks import peer_prefix_grouper as pg

            if not self.subject.prefix_grouper:
                raise BenchError(f"the PrefixGrouper adapter runs the example GPT, not {self.subject.name}")
            available, why = pg.status()
            if not available:
                raise BenchError(why)
            return functools.partial(pg.prefix_grouper_grpo_loss, self.model, pg.group_batch(batch, case.group_size),
                                     batch)
        raise BenchError(f"unknown method {method!r}; choose from {METHODS}")

    def run_case(self, case: Case, bar) -> CaseResult:
        batch = make_grpo_batch(vocab_size=self.subject.config.vocab_size, seed=self.args.seed, device=self.device,
                                dtype=self.dtype, left_pad_prompts=self.subject.left_pad_prompts,
                                **case.batch_kwargs())
        B, L = batch["input_ids"].shape
        tree = count_tree(batch["input_ids"], batch["attention_mask"], self.subject.head_window(batch))
        out = CaseResult(case, self.subject.name, B, L, int(batch["attention_mask"].sum()), tree.nodes,
                         B * L / tree.nodes)
        out.methods = {m: MethodResult() for m in self.args.methods}
        dense_fn = self.subject.dense_loss(batch)
        ref = self._run_once(dense_fn)
        torch._dynamo.reset()  # the previous case's compiled code goes: every method compiles afresh
        steps: dict[str, Callable[[], None]] = {}
        counted: dict[str, _CountedCalls] = {}
        for method in self.args.methods:
            bar.set_postfix_str(f"{out.name} {method}")
            res = out.methods[method]
            try:
                counted[method] = _CountedCalls(self._loss_fn(method, case, batch, dense_fn))
                steps[method] = self._prepare(res, counted[method], ref)
            except Exception as e:  # report it in the table and go on with the other methods
                log.warning("bench: %s on %s failed", method, out.name, exc_info=log.isEnabledFor(logging.DEBUG))
                res.error = _short(e)
        bar.set_postfix_str(f"{out.name} timing")
        self._time_interleaved(steps, out)
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
                limit = limit_flops(count, tree, self.subject.config)
                out.dense_flops, out.limit_flops, out.limit_attention_flops = count.total, limit.total, limit.attention
        for method, calls in counted.items():
            res = out.methods[method]
            res.replayed_calls, res.fallback_reasons = calls.replayed_calls, dict(calls.fallback_reasons)
            if method != "branch_replay" and calls.replayed_calls and not res.error:
                res.error = (f"BenchError: {method} ran branch_replay's packed graph {calls.replayed_calls} "
                             f"time(s): its numbers are not the dense method's")
        eager = out.methods.get("eager")
        for res in out.methods.values():
            if eager is not None and eager.seconds and res.seconds:
                res.speedup = eager.seconds / res.seconds
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


def result_tables(results: list[CaseResult], methods: Sequence[str]) -> list:
    """The bench's tables (``brcompile.tools.explain.Table``) and notes."""
    from brcompile.tools.explain import Table, fmt_bytes, fmt_flops

    others = [m for m in methods if m != "eager"]
    time_rows, flop_rows, mem_rows, exact_rows, notes = [], [], [], [], []
    for r in results:
        m = r.methods
        base = [r.name, f"{r.B}x{r.L}", f"{r.executed_tokens:,}", _x(r.dedup_ratio)]
        time_rows.append(base + [_ms(m["eager"].seconds) if "eager" in m else "-"]
                         + [f"{_ms(m[k].seconds)} ({_x(m[k].speedup)})" if k in m and m[k].seconds else "-"
                            for k in others] + [_x(r.flop_ratio_limit)])
        flop_rows.append([r.name] + [fmt_flops(m[k].flops) if k in m else "-" for k in methods]
                         + [fmt_flops(r.limit_flops)]
                         + [_x(m[k].flops / r.limit_flops) if k in m and m[k].flops and r.limit_flops else "-"
                            for k in ("branch_replay", "prefix_grouper") if k in methods])
        mem_rows.append([r.name] + [fmt_bytes(m[k].saved_bytes) if k in m else "-" for k in methods])
        exact_rows.append([r.name] + [
            "-" if k not in m or m[k].exact is None else
            f"{'PASS' if m[k].exact else 'FAIL'} {max(m[k].loss_rel_err, m[k].max_rel_grad_err):.1e}"
            for k in others])
        for k, res in m.items():
            if res.error:
                notes.append(f"{r.name}: {k} failed: {res.error}")
            for reason, n in res.fallback_reasons.items():
                notes.append(f"{r.name}: {k} ran the original graph x{n}: {reason}")
            if k == "branch_replay" and res.replayed_calls == 0 and not res.error:
                notes.append(f"{r.name}: branch_replay replayed nothing (its numbers are the dense graph's)")
    return [
        Table("wall-clock of one GRPO forward+backward: median ms (speedup over dense eager)",
              ["case", "B x L", "N", "B*L/N", "eager ms"] + [f"{k} ms" for k in others] + ["FLOP limit"],
              time_rows, ["FLOP limit = dense FLOPs / limit FLOPs: the speedup of computing each tree node once."]),
        Table("executed FLOPs of one forward+backward",
              ["case"] + list(methods) + ["limit"] + [f"{k}/limit" for k in ("branch_replay", "prefix_grouper")
                                                       if k in methods],
              flop_rows, ["every method counted on its own forward+backward, compiled code included; dense "
                          "attention is counted over the full score matrix, tree attention over the visible "
                          "pairs."]),
        Table("bytes saved for backward (saved_tensors_hooks, parameters excluded)", ["case"] + list(methods),
              mem_rows),
        Table("exactness vs dense eager: max relative error over the loss and every parameter gradient",
              ["case"] + others, exact_rows, notes),
    ]


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


#: What ``--quick`` changes (flags given explicitly win): a tiny model and grid, in seconds.
QUICK = dict(group_sizes=[2, 4], prefix_lens=[16, 48], tail_lens=[8], dim=32, layers=1, heads=2, kv_heads=1,
             vocab=61, repeats=1, compile_backend="aot_eager", compiler="eager")


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """The bench's flags."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt", "qwen2", "both"), default="gpt",
                   help="the example GPT (loss compiled), a HF Qwen2 of the same sizes (model compiled, TRL "
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
                   help="a tiny model and grid in seconds (G 2,4; P 16,48; T 8; dim 32; 1 layer; aot_eager); "
                        "flags given explicitly win")
    p.add_argument("--rich", choices=("auto", "yes", "no"), default="auto", help="tables with rich")
    return p


def parse_args(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> argparse.Namespace:
    """Parses the bench's flags: ``--quick`` sets :data:`QUICK` as defaults, ``--backend`` picks the methods."""
    p = build_parser(prog)
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
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
    subjects = []
    if args.model in ("gpt", "both"):
        subjects.append(GPTSubject(config, args.seed, dtype, device))
    if args.model in ("qwen2", "both"):
        subjects.append(Qwen2Subject(config, args.seed, dtype, device,
                                     max_positions=max(c.prefix_len + c.tail_len for c in cases)))
    pg_line = pg.status()[1] if "prefix_grouper" in args.methods else "prefix_grouper not run"
    print(f"model: {' and '.join(s.name for s in subjects)}, dim {args.dim}, layers {args.layers}, heads "
          f"{args.heads} (kv {args.kv_heads}), vocab {args.vocab}, {args.dtype}, {device.type}; {len(cases)} case(s) "
          f"x {len(args.methods)} method(s); median of {args.repeats}; torch.compile backend {args.compile_backend}, "
          f"branch_replay compiler {args.compiler}; {pg_line}", flush=True)
    bar = progress_bar(len(subjects) * len(cases) * len(args.methods))
    results = []
    try:
        for subject in subjects:
            runner = Runner(subject, args, device)
            for case in cases:
                results.append(runner.run_case(case, bar))
    finally:
        bar.close()
    blocks = result_tables(results, args.methods)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / "bench.json", args.out / "bench_speedup.png"
    plot_note = "plot skipped (--no-plot)" if args.no_plot else plot_speedups(results, png_path)
    doc = {
        "schema": "brcompile.bench/2",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
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
