"""GRPO loss forward+backward: dense eager vs ``torch.compile(grpo_loss, backend="branch_replay")``.

    python benchmarks/bench_grpo.py                 # G=8, P in {512, 2048}, T=128, float32
    python benchmarks/bench_grpo.py --quick         # a tiny grid (seconds)
    python benchmarks/bench_grpo.py --backend aot_eager --quick   # the plumbing without brcompile
    python benchmarks/bench_grpo.py --model qwen2 --prompt-lens 512  # HF Qwen2, TRL-style (see below)

``--model qwen2`` runs an unmodified HuggingFace ``Qwen2ForCausalLM`` of the same sizes (examples/hf.py) the
way TRL does: prompts left-padded, only the model compiled, called with ``logits_to_keep = C + 1``, the
GRPO loss eager over those logits (:func:`examples.hf.trl_grpo_loss`). There the LM head runs on the last
C + 1 columns only, so the limit below counts it over the tree nodes in those columns instead of N (see
:func:`limit_flops`). ``--model both`` runs the GPT grid, then the Qwen2 one.

For each case, in one run and on the same model and batch:

* wall-clock of one forward+backward (median of ``--repeats`` after a warm-up), dense eager and compiled,
  the two alternating so that changes in machine load hit both alike;
* executed FLOPs for both, counted with ``torch.utils.flop_counter``'s formulas by a small dispatch
  mode (:class:`OpFlopCounter`: ``FlopCounterMode`` itself makes Dynamo skip compiled code), and the
  **limit**;
* bytes saved for backward (``saved_tensors_hooks``; each storage counted once; parameters excluded).

FLOP conventions. torch's registry counts matmuls and attention (not pointwise ops). It has no formula
for the CPU attention kernels (``aten._scaled_dot_product_flash_attention_for_cpu[_backward]``), so
this script uses torch's own SDPA formulas for them: like torch on GPU, dense attention is counted
over the full s_q x s_k score matrix (causal or masked pairs are not discounted). brcompile's
``tree_attention`` is counted by the formula it registers with ``register_flop_formula``.

The limit is the FLOPs of a forward+backward over just the N unique tokens of the prefix tree:

    limit = (F_dense - A_dense) * N / (B * L)  +  n_layers * H * P_tree * (4 + 10) * D

* F_dense: all counted FLOPs of the dense run; A_dense: its attention part (SDPA ops, fwd + bwd).
  Everything else (projections, MLP, LM head) is per position, so over N tokens it costs N/(B L) as much.
* P_tree: the (query, key) pairs attention must compute in the tree: for every tree node, the number
  of its ancestors, itself included, whose attention-mask bit is 1 (padding keys are visible to none).
* per pair, head and layer: 4 D forward (q k^T, p v) and 10 D backward (recompute q k^T, dP, dV, dQ, dK),
  torch's ``sdpa_flop_count`` / ``sdpa_backward_flop_count`` per score; H query heads of width D.

Running the model on one row of N packed tokens would NOT give the limit: causal attention over that
row would let every token see all earlier tokens, siblings included.

N counts every distinct (row prefix) node, padding included (brcompile's default keeps pad tokens as
tree nodes). Absolute times only mean something on a GPU; ratios on a quiet CPU are indicative.
Cost on CPU: a dense fwd+bwd at P=2048 takes ~20 s on 2 cores (the full grid ~15 min with an eager
"compiled" run; use --prompt-lens 512 or --quick for less).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
import torch.utils.flop_counter as flop_counter
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

if __package__ in (None, ""):  # run as a script: make `examples` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.grpo import grpo_loss, make_grpo_batch  # noqa: E402

log = logging.getLogger(__name__)

aten = torch.ops.aten
FWD_PAIR_FLOPS_PER_D = 4     # q k^T (2 D) + p v (2 D)
BWD_PAIR_FLOPS_PER_D = 10    # recompute q k^T, dP = dO v^T, dV = P^T dO, dQ = dS k, dK = dS^T q (2 D each)


# ----------------------------------------------------------------------------------------------------
# FLOP counting

def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """``aten._scaled_dot_product_flash_attention_for_cpu``: torch's SDPA forward formula (full s_q x s_k)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward``: torch's SDPA backward formula."""
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(_sdpa_cpu_flop),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(_sdpa_cpu_backward_flop),
}


def is_attention_op(op) -> bool:
    """SDPA kernels (any backend) and brcompile's tree attention, forward or backward."""
    name = str(op)
    return "scaled_dot_product" in name or "tree_attention" in name


class OpFlopCounter(TorchDispatchMode):
    """Counts FLOPs per op with torch's formula registry (``torch.utils.flop_counter.flop_registry``, which
    ``register_flop_formula`` fills, e.g. for brcompile's ``tree_attention``) plus the CPU SDPA formulas
    above. An op without a formula is decomposed if it can be (as ``FlopCounterMode`` does), else run.

    Why not ``FlopCounterMode``: under it, Dynamo skips the compiled function -- the count is the eager
    graph's, and (torch 2.13) the function's code stays skipped afterwards, so later calls run eagerly
    too; its module tracker's global hooks also break Dynamo's tracing of nested ``torch.compile``.
    This mode declares ``ignore_compile_internals``: it is off while Dynamo compiles and on while the
    compiled code runs, so it counts the ops the compiled code executes (extern kernels and custom ops;
    Inductor's fused pointwise kernels carry no FLOPs in the registry anyway).
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Count what compiled code runs, not what its compilation traces."""
        return True

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not isinstance(func, torch._ops.OpOverload):   # higher-order ops: run, nothing to count here
            return func(*args, **kwargs)
        packet = func._overloadpacket
        formula = CPU_ATTENTION_FLOPS.get(packet) or flop_counter.flop_registry.get(packet)
        if formula is None:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self.counts[packet] += int(formula(*args, **kwargs, out_val=out))
        return out


@dataclass
class FlopCount:
    """FLOPs of one forward+backward, split into attention and everything else."""

    total: int
    attention: int

    @property
    def other(self) -> int:
        """Non-attention FLOPs (projections, MLP, LM head)."""
        return self.total - self.attention


def count_flops(step) -> FlopCount:
    """Runs ``step()`` under :class:`OpFlopCounter` and splits the count into attention and the rest."""
    with OpFlopCounter() as counter:
        step()
    attention = sum(n for op, n in counter.counts.items() if is_attention_op(op))
    return FlopCount(total=sum(counter.counts.values()), attention=attention)


# ----------------------------------------------------------------------------------------------------
# The prefix tree, counted independently of brcompile

@dataclass
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
# Memory and time

def saved_activation_bytes(step, exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``step()`` (the forward of a
    fwd+bwd step), skipping storages whose data_ptr is in ``exclude`` (the parameters)."""
    seen: dict[int, int] = {}

    @torch._dynamo.disable  # hooks fire inside compiled regions too; never trace them into a graph
    def pack(t):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses): not countable
            return t
        ptr = storage.data_ptr()
        if ptr not in exclude:
            seen[ptr] = storage.nbytes()
        return t

    @torch._dynamo.disable
    def unpack(t):
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        step()
    return sum(seen.values())


def sync(device: torch.device) -> None:
    """Waits for queued device work so wall-clock times are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, device: torch.device) -> float:
    """Wall-clock seconds of one ``step()`` (device work included)."""
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


def median_seconds(steps: list, repeats: int, device: torch.device) -> list[float]:
    """Median wall-clock of each of ``steps`` over ``repeats`` rounds, after one warm-up call each.

    The steps alternate within a round (dense, compiled, dense, compiled, ...), so a change in machine
    load hits all of them alike rather than biasing whichever ran during it.
    """
    for step in steps:
        step()
    times = [[] for _ in steps]
    for _ in range(max(1, repeats)):
        for step, ts in zip(steps, times):
            ts.append(timed(step, device))
    return [statistics.median(ts) for ts in times]


# ----------------------------------------------------------------------------------------------------
# Cases

@dataclass
class Case:
    """One batch shape: ``num_prompts`` groups of ``group_size`` rollouts (see make_grpo_batch)."""

    name: str
    num_prompts: int
    group_size: int
    prompt_len: int | tuple[int, int]
    response_len: int | tuple[int, int]
    shared_response_prefix: int = 0
    left_pad_prompts: bool = False


@dataclass
class Subject:
    """The model a grid runs, its sizes, and its loss: ``losses(batch, backend)`` returns the dense and the
    compiled loss, each ``fn(model, **batch)`` -> scalar (called after ``torch._dynamo.reset()``)."""

    name: str
    model: torch.nn.Module
    config: GPTConfig            # the sizes: the batch's vocabulary and the FLOP limit's layers/heads/head_dim
    losses: Callable[[dict, str], tuple[Callable, Callable]]
    left_pad_prompts: bool = False   # TRL's layout (forced on for every case of this subject)
    head_window: Callable[[dict], int] | None = None   # batch -> columns the LM head runs on (logits_to_keep)


def gpt_subject(config: GPTConfig, seed: int, dtype: torch.dtype, device: torch.device) -> Subject:
    """The example GPT; the whole GRPO loss compiled."""
    model = GPT(config, seed=seed).to(device=device, dtype=dtype)
    return Subject("gpt", model, config, lambda batch, backend: (grpo_loss, torch.compile(grpo_loss, backend=backend)))


def qwen2_subject(config: GPTConfig, seed: int, dtype: torch.dtype, device: torch.device,
                  max_positions: int) -> Subject:
    """A HF Qwen2 of ``config``'s sizes, TRL-style: the model compiled alone, ``logits_to_keep = C + 1``,
    the loss eager (examples/hf.py); prompts left-padded."""
    from examples.hf import completion_width, qwen2_model, trl_grpo_loss

    model = qwen2_model(config, max_positions=max_positions, seed=seed, dtype=dtype).to(device)

    def losses(batch, backend):
        C = completion_width(batch["completion_mask"])
        compiled_model = torch.compile(model, backend=backend)

        def dense(m, **b):
            return trl_grpo_loss(m, **b, completion_len=C)

        def compiled(m, **b):
            return trl_grpo_loss(compiled_model, **b, completion_len=C)
        return dense, compiled

    return Subject("qwen2", model, config, losses, left_pad_prompts=True,
                   head_window=lambda batch: completion_width(batch["completion_mask"]) + 1)


def make_cases(quick: bool, group_size: int = 8, response_len: int = 128,
               prompt_lens: tuple[int, ...] = (512, 2048)) -> list[Case]:
    """The grid: per prompt length P, one group of G equal-length tails (the best case for prefix
    sharing) and a realistic batch: 2 groups with prompt lengths drawn from [P/2, P], ragged responses
    in [T/4, T] right-padded, the first T/8 response tokens shared within a group."""
    if quick:
        prompt_lens, group_size, response_len = (48,), 4, 16
    cases = []
    for P in prompt_lens:
        T = response_len
        cases.append(Case(f"1 group, P={P}", 1, group_size, P, T))
        cases.append(Case(f"2 groups ragged, P<={P}", 2, group_size, (P // 2, P), (T // 4, T),
                          shared_response_prefix=T // 8))
    return cases


def max_row_len(cases: list[Case]) -> int:
    """The longest row any case can build: the longest prompt plus the longest response."""
    def hi(n):
        return n if isinstance(n, int) else n[1]
    return max(hi(c.prompt_len) + hi(c.response_len) for c in cases)


@dataclass
class Result:
    """Measurements of one case (times in seconds, FLOPs, bytes)."""

    case: str
    B: int
    L: int
    nodes: int
    dense_s: float
    dense_flops: int
    dense_attention_flops: int
    dense_saved_bytes: int
    limit_flops: int
    limit_attention_flops: int
    compiled_s: float | None = None
    compiled_flops: int | None = None
    compiled_attention_flops: int | None = None
    compiled_saved_bytes: int | None = None
    compiled_calls: int = 0
    max_rel_grad_err: float | None = None
    replayed_calls: int | None = None
    fallback_calls: int | None = None
    fallback_reasons: dict = field(default_factory=dict)
    error: str | None = None


def _grads(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_rel_err(grads, ref) -> float:
    """max over parameters of max|g - ref| / max|ref| (a missing gradient counts as 1)."""
    worst = 0.0
    for name, r in ref.items():
        g = grads.get(name)
        err = 1.0 if g is None else float((g - r).abs().max() / r.abs().max().clamp(min=torch.finfo(r.dtype).tiny))
        worst = max(worst, err)
    return worst


def _stats(backend: str):
    """brcompile.stats() for the branch_replay backend if brcompile provides it, else None."""
    if backend != "branch_replay":
        return None
    import brcompile
    return brcompile.stats() if hasattr(brcompile, "stats") else None


def _reset_stats(backend: str) -> None:
    """brcompile.reset_stats() for the branch_replay backend if brcompile provides it."""
    if backend != "branch_replay":
        return
    import brcompile
    if hasattr(brcompile, "reset_stats"):
        brcompile.reset_stats()


def run_case(case: Case, subject: Subject, args, device: torch.device) -> Result:
    """Measures one case: dense FLOPs and saved bytes, then the compiled loss (its gradients against the
    dense ones), wall-clock of both interleaved, the compiled saved bytes and FLOPs. A failure of the
    compiled run is recorded in the result, and the dense run is timed alone."""
    model = subject.model
    batch = make_grpo_batch(num_prompts=case.num_prompts, group_size=case.group_size, prompt_len=case.prompt_len,
                            response_len=case.response_len, shared_response_prefix=case.shared_response_prefix,
                            vocab_size=subject.config.vocab_size,
                            left_pad_prompts=case.left_pad_prompts or subject.left_pad_prompts,
                            seed=args.seed, device=device, dtype=next(model.parameters()).dtype)
    B, L = batch["input_ids"].shape
    window = subject.head_window(batch) if subject.head_window else 0
    tree = count_tree(batch["input_ids"], batch["attention_mask"], window)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def step_with(fn):
        def step():
            model.zero_grad(set_to_none=True)
            fn(model, **batch).backward()
        return step

    torch._dynamo.reset()
    dense_fn, compiled_fn = subject.losses(batch, args.backend)
    dense_step = step_with(dense_fn)
    dense_step()
    ref = _grads(model)
    dense = count_flops(dense_step)
    dense_saved = saved_activation_bytes(dense_step, params)
    limit = limit_flops(dense, tree, subject.config)
    result = Result(case.name, B, L, tree.nodes, float("nan"), dense.total, dense.attention, dense_saved,
                    limit.total, limit.attention)

    compiled_step = step_with(compiled_fn)
    try:
        _reset_stats(args.backend)
        compiled_step()                                      # compiles
        result.max_rel_grad_err = _max_rel_err(_grads(model), ref)
        result.dense_s, result.compiled_s = median_seconds([dense_step, compiled_step], args.repeats, device)
        result.compiled_saved_bytes = saved_activation_bytes(compiled_step, params)
        comp = count_flops(compiled_step)                    # last: see OpFlopCounter
        result.compiled_flops, result.compiled_attention_flops = comp.total, comp.attention
        result.compiled_calls = 2 + max(1, args.repeats) + 2   # compile, warm-up, timed, saved bytes, FLOPs
    except Exception as exc:  # report the failure in the table and keep benchmarking the other cases
        log.exception("%s: %s backend failed", case.name, args.backend)
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        result.dense_s, = median_seconds([dense_step], args.repeats, device)
    log.info("%s: B=%d L=%d N=%d dense %.3fs compiled %s", case.name, B, L, tree.nodes, result.dense_s,
             result.compiled_s)
    try:
        stats = _stats(args.backend)
    except ImportError as exc:  # brcompile itself is broken: the compiled run above has failed already
        log.warning("brcompile.stats() unavailable: %s", exc)
        stats = None
    if stats is not None:
        result.replayed_calls, result.fallback_calls = stats.replayed_calls, stats.fallback_calls
        result.fallback_reasons = dict(stats.fallback_reasons)
    return result


# ----------------------------------------------------------------------------------------------------
# Report

def _g(flops) -> str:
    """FLOPs as GFLOP with 3 significant digits ('-' when missing)."""
    return "-" if flops is None else f"{flops / 1e9:.3g}"


def _ratio(num, den) -> str:
    """num/den with two decimals ('-' when either is missing or den is 0)."""
    return "-" if num is None or not den else f"{num / den:.2f}"


def _mb(n) -> str:
    """Bytes as MB ('-' when missing)."""
    return "-" if n is None else f"{n / 2**20:.1f}"


def markdown(results: list[Result], backend: str) -> str:
    """Two markdown tables: the headline numbers, then the FLOP split (attention vs the rest)."""
    head = ["case", "B x L", "N", "B*L/N", "dense ms", f"{backend} ms", "speedup", "dense GF", f"{backend} GF",
            "limit GF", "FLOP ratio", "exec/limit", "dense MB", f"{backend} MB", "grad err", "replayed/fallback"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        rf = "-" if r.replayed_calls is None else f"{r.replayed_calls}/{r.fallback_calls} of {r.compiled_calls}"
        lines.append("| " + " | ".join([
            r.case, f"{r.B} x {r.L}", str(r.nodes), _ratio(r.B * r.L, r.nodes),
            f"{r.dense_s * 1e3:.1f}", "-" if r.compiled_s is None else f"{r.compiled_s * 1e3:.1f}",
            _ratio(r.dense_s, r.compiled_s), _g(r.dense_flops), _g(r.compiled_flops), _g(r.limit_flops),
            _ratio(r.dense_flops, r.compiled_flops), _ratio(r.compiled_flops, r.limit_flops),
            _mb(r.dense_saved_bytes), _mb(r.compiled_saved_bytes),
            "-" if r.max_rel_grad_err is None else f"{r.max_rel_grad_err:.1e}", rf]) + " |")
    split = ["case", "dense attn GF", "dense other GF", f"{backend} attn GF", f"{backend} other GF",
             "limit attn GF", "limit other GF"]
    lines += ["", "| " + " | ".join(split) + " |", "|" + "---|" * len(split)]
    for r in results:
        c_other = None if r.compiled_flops is None else r.compiled_flops - r.compiled_attention_flops
        lines.append("| " + " | ".join([
            r.case, _g(r.dense_attention_flops), _g(r.dense_flops - r.dense_attention_flops),
            _g(r.compiled_attention_flops), _g(c_other), _g(r.limit_attention_flops),
            _g(r.limit_flops - r.limit_attention_flops)]) + " |")
    for r in results:
        if r.error:
            lines.append(f"\n{r.case}: {backend} failed: {r.error}")
        for reason, count in r.fallback_reasons.items():
            lines.append(f"\n{r.case}: fallback x{count}: {reason}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model and grid (seconds)")
    p.add_argument("--model", choices=("gpt", "qwen2", "both"), default="gpt",
                   help="the example GPT (loss compiled), a HF Qwen2 of the same sizes (model compiled, TRL "
                        "layout; needs transformers), or both")
    p.add_argument("--backend", default="branch_replay")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up (median)")
    p.add_argument("--dim", type=int, default=None, help="model width (default 256; 64 with --quick)")
    p.add_argument("--layers", type=int, default=None, help="layers (default 4; 2 with --quick)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--prompt-lens", default="512,2048", help="comma-separated prompt lengths P")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    return p


def main(argv=None) -> list[Result]:
    """Runs the grid, prints the markdown tables, returns the results."""
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else torch.device(args.device)
    dim = args.dim or (64 if args.quick else 256)
    layers = args.layers or (2 if args.quick else 4)
    config = GPTConfig(dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2)
    dtype = getattr(torch, args.dtype)
    cases = make_cases(args.quick, args.group_size, args.response_len,
                       tuple(int(p) for p in args.prompt_lens.split(",")))
    subjects = []
    if args.model in ("gpt", "both"):
        subjects.append(gpt_subject(config, args.seed, dtype, device))
    if args.model in ("qwen2", "both"):
        subjects.append(qwen2_subject(config, args.seed, dtype, device, max_positions=max_row_len(cases)))
    print(f"model: dim {dim}, layers {layers}, heads {config.n_heads} (kv {config.n_kv_heads}), "
          f"{' and '.join(s.name for s in subjects)}, {args.dtype}, {device.type}; backend {args.backend}; "
          f"median of {args.repeats} after a warm-up\n")
    results = []
    for subject in subjects:
        for case in cases:
            if subject.name != "gpt":
                case = replace(case, name=f"{subject.name}: {case.name}")
            results.append(run_case(case, subject, args, device))
    print(markdown(results, args.backend))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
