"""Measuring, and ``python -m brcompile bench``: dense eager vs torch.compile vs branch_replay vs PrefixGrouper.

Two parts.

**Measuring helpers** (also used by :mod:`brcompile.tools.explain`): :func:`measure_fwd_bwd` runs a function
forward and backward once and returns its FLOPs (``torch.utils.flop_counter.FlopCounterMode``, split into
attention and the rest) and the bytes autograd saves for backward (``saved_tensors_hooks``);
:func:`median_seconds` times a step. Conventions:

* FLOPs are what torch's flop counter counts: matmul-like ops and attention, not pointwise ops. Torch has
  no formula for the CPU attention kernels (``aten._scaled_dot_product_flash_attention_for_cpu[_backward]``),
  so :data:`CPU_ATTENTION_FLOPS` maps them to torch's own SDPA formulas: dense attention is counted over
  the full s_q x s_k score matrix, as torch does on GPU (causal or masked pairs are not discounted).
  ``brcompile::tree_attention`` counts exactly the visible (query, key) pairs of the tree (its registered
  formula): 4D forward + 10D backward per pair and query head (D the head width).
* Bytes saved for backward: the distinct storages packed by ``saved_tensors_hooks`` during the forward,
  each counted once, storages of the inputs that require grad (the parameters) excluded.
* The limit of a batch: the FLOPs of computing each distinct tree node once,

      limit = (F_dense - A_dense) * N / (B * L) + A_tree

  with F_dense/A_dense all/attention FLOPs of the dense forward+backward, N the tree's nodes (executed
  tokens), B * L the logical positions and A_tree the tree attention's FLOPs (every visible pair once).
  Everything but attention costs the same per position, so over N tokens it costs N / (B L) as much.

**The bench** (``python -m brcompile bench``; ``brcompile bench``): on the example Llama-style GPT and a
GRPO loss (``examples/``, so it runs from a checkout), over a grid of group sizes G, prompt (prefix)
lengths P and response (tail) lengths T, it measures side by side, on the same model and batch:

* ``eager``: the dense loss forward+backward, eagerly (the reference for speed and exactness);
* ``torch.compile``: the dense loss compiled by ``--compile-backend`` (Inductor by default);
* ``branch_replay``: ``torch.compile(grpo_loss, backend=brcompile.backend(compiler=--compiler))``;
* ``prefix_grouper``: PrefixGrouper (``pip install prefix-grouper``), the published peer, through its own
  API: the batch regrouped as one row per prompt ``[prompt, response_1, ..., response_G]`` with rotary
  positions restarting at P for every response, every attention routed through
  ``PrefixGrouper.forward(attn_func, q, k, v)`` with an ``attn_func`` that applies its key-padding mask and
  bottom-right-aligned causal masking (:func:`prefix_grouper_attn_func`), the logits split back with
  ``split_output(..., include_prefix_last=1)`` and the same GRPO loss computed from the response
  log-probabilities. Building its ``PrefixGrouper`` and regrouping the inputs is data preparation in a
  PrefixGrouper trainer, so it is not timed (branch_replay's tree building is timed: it runs per call).

Times are medians of ``--repeats`` interleaved rounds (each round runs every method once, after a warm-up
round), so load on a shared machine hits all methods alike. The methods share one process but no state:
each holds its own compiled function (:meth:`Runner._loss_fn`), ``brcompile.tools.explain`` patches nothing and
drops the Dynamo cache entries it compiled, and each method counts the branch_replay calls made inside its
own calls (``replayed_calls`` in ``bench.json``; a method other than branch_replay that reached it is an
error and makes the exit status 1). Per case it prints (rich tables when rich is
installed) the wall-clock speedups over dense eager, the
executed FLOPs (branch_replay's counted on its eager packed graph via :func:`brcompile.tools.explain`; the
compiled dense run computes the dense graph's FLOPs), the limit, the bytes saved for backward and the
exactness (max relative error of the loss and every parameter gradient against dense eager), and writes
``bench.json`` and ``bench_speedup.png`` (matplotlib: speedup vs P/T, one colour per G, the FLOP-ratio
limit dense/limit dashed) under ``--out``.

    python -m brcompile bench                                    # G in {4, 8}, P in {64, 256, 1024}, T=64
    python -m brcompile bench --group-sizes 8 --prefix-lens 1024 --tail-lens 128 --repeats 4
    python -m brcompile bench --quick                            # a tiny grid, seconds

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
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from brcompile.testing import rel_err

log = logging.getLogger(__name__)

aten = torch.ops.aten

# ----------------------------------------------------------------------------------------------------
# Measuring


def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """``aten._scaled_dot_product_flash_attention_for_cpu``: torch's SDPA forward formula (full s_q x s_k)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward``: torch's SDPA backward formula."""
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


#: FlopCounterMode ``custom_mapping`` for the CPU SDPA kernels (torch counts them as 0).
CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
}


def is_attention_op(op) -> bool:
    """SDPA kernels (any backend), flex attention and brcompile's tree attention, forward or backward."""
    name = str(op)
    return "scaled_dot_product" in name or "tree_attention" in name or "flex_attention" in name


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs and bytes saved for backward of one forward (+ backward when ``backward``) run."""

    flops: int
    attention_flops: int
    saved_bytes: int
    backward: bool

    @property
    def other_flops(self) -> int:
        """Non-attention FLOPs (projections, MLP, LM head)."""
        return self.flops - self.attention_flops


def _storage_key(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """(data_ptr, nbytes) of a tensor's storage, or None for tensors without one (subclasses, fakes)."""
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class SavedBytes:
    """A ``saved_tensors_hooks`` context that sums the distinct storages autograd saves for backward,
    skipping the storages whose data_ptr is in ``exclude`` (the parameters). ``.total`` after exit."""

    def __init__(self, exclude: set[int] = frozenset()):
        self.exclude = set(exclude)
        self.seen: dict[int, int] = {}

        @torch._dynamo.disable  # hooks fire inside compiled regions too; never trace them into a graph
        def pack(t):
            key = _storage_key(t)
            if key is not None and key[0] not in self.exclude:
                self.seen[key[0]] = key[1]
            return t

        @torch._dynamo.disable
        def unpack(t):
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @property
    def total(self) -> int:
        return sum(self.seen.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def split_flops(counter: FlopCounterMode) -> tuple[int, int]:
    """(total, attention) FLOPs of a finished FlopCounterMode."""
    per_op = counter.get_flop_counts().get("Global", {})
    attention = sum(n for op, n in per_op.items() if is_attention_op(op))
    return int(counter.get_total_flops()), int(attention)


def _backward_to(outs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """Backward of ``outs`` (gradient of ones) down to ``inputs`` only, leaving every ``.grad`` as it was.

    ``torch.autograd.backward(..., inputs=...)`` rather than ``autograd.grad``: FlopCounterMode's module
    tracker puts multi-grad hooks on module inputs, which ``autograd.grad`` does not support on leaves.
    The inputs' ``.grad`` are set aside (so nothing accumulates into them) and put back after.
    """
    saved = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    try:
        torch.autograd.backward(outs, grad_tensors=[torch.ones_like(o) for o in outs], inputs=inputs)
    finally:
        for t, g in zip(inputs, saved):
            t.grad = g


def measure_fwd_bwd(fn: Callable, args: Sequence[Any]) -> Cost:
    """Runs ``fn(*args)`` and, when an output requires grad, the backward of every such output (gradient of
    ones) down to every input that requires grad (:func:`_backward_to`: every ``.grad`` is left as it was).

    Returns the FLOPs of both (FlopCounterMode with :data:`CPU_ATTENTION_FLOPS`) and the bytes saved for
    backward during the forward, storages of the inputs that require grad excluded.
    """
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    exclude = {k[0] for k in map(_storage_key, inputs) if k is not None}
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        with SavedBytes(exclude) as saved:
            out = fn(*args)
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        backward = bool(outs and inputs)
        if backward:
            _backward_to(outs, inputs)
    total, attention = split_flops(counter)
    return Cost(total, attention, saved.total, backward)


def limit_flops(dense: Cost, logical_tokens: int, executed_tokens: int, tree_attention_flops: int) -> int:
    """``(F_dense - A_dense) * N / (B L) + A_tree`` (module docstring)."""
    if logical_tokens <= 0:
        raise ValueError(f"logical_tokens={logical_tokens} must be > 0")
    return int(round(dense.other_flops * executed_tokens / logical_tokens)) + int(tree_attention_flops)


def sync(device: torch.device) -> None:
    """Waits for queued device work so wall-clock times are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(step: Callable[[], Any], repeats: int, device: torch.device, warmup: int = 1) -> float:
    """Median wall-clock of ``repeats`` calls of ``step()`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------------
# The example model and loss (examples/ of a checkout)


class BenchError(RuntimeError):
    """The bench cannot run as asked (missing examples/, a batch PrefixGrouper cannot express ...)."""


def examples_modules():
    """``(examples.gpt, examples.grpo)`` from the checkout that holds this package (the bench's model and
    GRPO loss live in ``examples/``, which is not installed)."""
    root = Path(__file__).resolve().parents[1]
    if (root / "examples" / "gpt.py").exists() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        import examples.gpt as gpt
        import examples.grpo as grpo
    except ImportError as e:
        raise BenchError(f"the bench runs the example model and loss in examples/ of a brcompile checkout, "
                         f"not found next to {Path(__file__).parent} ({e})") from e
    return gpt, grpo


def grpo_surrogate(logp: torch.Tensor, completion_mask: torch.Tensor, advantages: torch.Tensor,
                   old_logprobs: torch.Tensor, clip_eps: float = 0.2) -> torch.Tensor:
    """``examples.grpo.grpo_loss`` from the next-token log-probs ``logp`` [B, L-1] on:
    ``-mean_b(sum_t m s / max(1, sum_t m))``, ``s = min(r A, clip(r, 1-eps, 1+eps) A)``, ``r = exp(logp - old)``,
    ``m = completion_mask[:, 1:]``."""
    ratio = torch.exp(logp - old_logprobs)
    adv = advantages[:, None]
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    mask = completion_mask[:, 1:].to(surrogate.dtype)
    per_sequence = (surrogate * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return -per_sequence.mean()


# ----------------------------------------------------------------------------------------------------
# PrefixGrouper (the published peer), through its own API


def prefix_grouper_status() -> tuple[bool, str]:
    """(importable, a line saying which version or why not)."""
    try:
        import prefix_grouper
    except ImportError as e:
        return False, f"prefix_grouper is not installed (pip install prefix-grouper): {e}"
    return True, f"prefix_grouper {getattr(prefix_grouper, '__version__', '?')}"


@dataclasses.dataclass
class GroupedBatch:
    """A GRPO batch in PrefixGrouper's layout: one row per prompt, ``[prompt, response_1, ..., response_G]``.

    ``grouper``: the ``prefix_grouper.PrefixGrouper`` of ``group_info = [[P_g, T_g1, ..., T_gG], ...]``;
    ``input_ids``/``position_ids`` [groups, Lg] (right-padded; every response's positions restart at P_g);
    ``response_ids`` [B, T_max] (0 past a row's end); the scatter ``logp[rows, cols] = logp_resp[rows, steps]``
    puts response log-probs back at the dense next-token positions ``t = P_g - 1 + j``.
    """

    grouper: Any
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    response_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    steps: torch.Tensor


def group_batch(batch: dict, group_size: int) -> GroupedBatch:
    """Regroups a ``make_grpo_batch`` batch (prompts left-aligned, responses right after, right padding) for
    PrefixGrouper; raises :class:`BenchError` when the rows of a group do not share their prompt."""
    from prefix_grouper import PrefixGrouper

    ids, am, cm = batch["input_ids"], batch["attention_mask"].bool(), batch["completion_mask"].bool()
    B, L = ids.shape
    if B % group_size:
        raise BenchError(f"{B} rows are not whole groups of {group_size}")
    prompt_mask = am & ~cm
    T_max = int(cm.sum(1).max())
    info, grouped, positions, responses, rows, cols, steps = [], [], [], [], [], [], []
    for g in range(B // group_size):
        r0 = g * group_size
        P = int(prompt_mask[r0].sum())
        prompt = ids[r0, :P]
        parts, pos, lens = [prompt], [torch.arange(P)], []
        for b in range(r0, r0 + group_size):
            T = int(cm[b].sum())
            if (int(prompt_mask[b].sum()) != P or not bool(prompt_mask[b, :P].all())
                    or not torch.equal(ids[b, :P], prompt) or not bool(cm[b, P:P + T].all())):
                raise BenchError(f"row {b} does not share group {g}'s left-aligned prompt followed by its response")
            resp = ids[b, P:P + T]
            parts.append(resp)
            pos.append(torch.arange(P, P + T))
            lens.append(T)
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
        steps=torch.tensor(steps, device=device),
    )


def prefix_grouper_attn_func(q, k, v, key_mask, n_rep: int = 1):
    """PrefixGrouper's ``attn_func``: q [b, H, Lq, D], k/v [b, Hkv, Lk, D], ``key_mask`` [b, Lk] (True = a real
    key). Causal masking aligned bottom-right (query i sees key j iff j <= i + Lk - Lq: the suffix queries
    come after the Lk - Lq prefix keys), and the key-padding mask. Returns [b, Lq, H, D], as it expects."""
    gpt, _ = examples_modules()
    k, v = gpt.repeat_kv(k, n_rep), gpt.repeat_kv(v, n_rep)
    Lq, Lk = q.shape[2], k.shape[2]
    causal = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(Lk - Lq)
    mask = causal[None, None] & key_mask.bool()[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def prefix_grouper_logits(model, gb: GroupedBatch) -> torch.Tensor:
    """The example GPT's forward on the grouped batch, each attention through ``PrefixGrouper.forward``
    (the model edit PrefixGrouper needs); rotary tables from ``gb.position_ids``. Logits [groups, Lg, V]."""
    gpt, _ = examples_modules()
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
        q, k = gpt.apply_rotary_pos_emb(q, k, cos, sin)
        out = gb.grouper.forward(prefix_grouper_attn_func, q, k, v, n_rep=a.n_rep)  # [groups, Lg, H, D]
        h = h + a.o_proj(out.reshape(G, Lg, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = model.norm(h)
    return F.linear(h, model.tok_emb.weight) if model.lm_head is None else model.lm_head(h)


def prefix_grouper_grpo_loss(model, gb: GroupedBatch, batch: dict, clip_eps: float = 0.2) -> torch.Tensor:
    """The GRPO loss of ``batch`` computed PrefixGrouper's way: grouped forward, ``split_output(logits,
    include_prefix_last=1)`` (the last prompt token predicts the first response token), response log-probs
    scattered to the dense next-token positions, then :func:`grpo_surrogate`."""
    logits = prefix_grouper_logits(model, gb)
    _, _, suffix, _ = gb.grouper.split_output(logits, include_prefix_last=1)  # [B, 1 + T_max, V]
    logp_resp = torch.log_softmax(suffix[:, :-1], dim=-1).gather(-1, gb.response_ids[..., None]).squeeze(-1)
    B, L = batch["input_ids"].shape
    logp = logp_resp.new_zeros(B, L - 1).index_put((gb.rows, gb.cols), logp_resp[gb.rows, gb.steps])
    return grpo_surrogate(logp, batch["completion_mask"], batch["advantages"], batch["old_logprobs"], clip_eps)


# ----------------------------------------------------------------------------------------------------
# The grid


METHODS = ("eager", "torch.compile", "branch_replay", "prefix_grouper")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


@dataclasses.dataclass(frozen=True)
class Case:
    """One batch: ``num_prompts`` prompts of length P, each with G responses of length T (or ragged in
    [T/2, T], right-padded), the first ``shared_response`` response tokens shared within a group."""

    group_size: int
    prefix_len: int
    tail_len: int
    num_prompts: int = 1
    ragged: bool = False
    shared_response: int = 0

    @property
    def name(self) -> str:
        name = f"G={self.group_size} P={self.prefix_len} T={self.tail_len}"
        if self.num_prompts > 1:
            name = f"{self.num_prompts} groups {name}"
        if self.ragged:
            name += " ragged"
        if self.shared_response:
            name += f" shared {self.shared_response}"
        return name

    def batch_kwargs(self) -> dict:
        tail = (max(1, self.tail_len // 2), self.tail_len) if self.ragged else self.tail_len
        lo = tail[0] if isinstance(tail, tuple) else tail
        return dict(num_prompts=self.num_prompts, group_size=self.group_size, prompt_len=self.prefix_len,
                    response_len=tail, shared_response_prefix=min(self.shared_response, lo))


@dataclasses.dataclass
class MethodResult:
    """One method on one case. Times in seconds, FLOPs of one forward+backward, bytes saved for backward."""

    seconds: Optional[float] = None
    speedup: Optional[float] = None  # dense eager seconds / seconds
    flops: Optional[int] = None
    attention_flops: Optional[int] = None
    flops_counted_on: Optional[str] = None
    saved_bytes: Optional[int] = None
    loss_rel_err: Optional[float] = None
    max_rel_grad_err: Optional[float] = None
    exact: Optional[bool] = None
    replayed_calls: Optional[int] = None
    fallback_reasons: dict = dataclasses.field(default_factory=dict)
    error: Optional[str] = None


@dataclasses.dataclass
class CaseResult:
    """All methods on one case, with the batch's tree sizes and the FLOP limit."""

    case: Case
    B: int
    L: int
    valid_tokens: int
    executed_tokens: Optional[int] = None  # N, the prefix tree's nodes (from branch_replay's explain run)
    dedup_ratio: Optional[float] = None
    dense_flops: Optional[int] = None
    limit_flops: Optional[int] = None
    limit_attention_flops: Optional[int] = None
    methods: dict = dataclasses.field(default_factory=dict)  # name -> MethodResult

    @property
    def flop_ratio_limit(self) -> Optional[float]:
        """dense / limit FLOPs: the speedup a method that computes each tree node once could reach."""
        return self.dense_flops / self.limit_flops if self.dense_flops and self.limit_flops else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["name"] = self.case.name
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


_GRPO_LOSS: Optional[Callable] = None  # examples.grpo.grpo_loss, set by Runner (the compiled wrappers read it)


def _loss_torch_compile(model, batch: dict):
    """The dense loss, for the torch.compile method (its own code object: its own Dynamo cache)."""
    return _GRPO_LOSS(model, **batch)


def _loss_branch_replay(model, batch: dict):
    """The dense loss, for the branch_replay method (its own code object: its own Dynamo cache)."""
    return _GRPO_LOSS(model, **batch)


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
    """Runs the methods on the cases of one model (see the module docstring).

    Per case: the dense eager reference, then each method is prepared (compiled, run once for exactness,
    FLOPs, bytes saved for backward), then all methods are timed interleaved (one run of each per round,
    ``repeats`` rounds after a warm-up round), so load on a shared machine hits them alike.
    """

    def __init__(self, model, args, device: torch.device):
        global _GRPO_LOSS
        _, grpo = examples_modules()
        _GRPO_LOSS = grpo.grpo_loss
        self.model, self.args, self.device = model, args, device
        self.dtype = next(model.parameters()).dtype
        self.params = [p for p in model.parameters()]
        self.param_ptrs = {k[0] for k in map(_storage_key, self.params) if k is not None}

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

    def _saved_bytes(self, loss_fn) -> int:
        self.model.zero_grad(set_to_none=True)
        with SavedBytes(self.param_ptrs) as saved:
            loss = loss_fn()
        loss.backward()
        return saved.total

    def _flops(self, loss_fn) -> tuple[int, int]:
        self.model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
            loss_fn().backward()
        return split_flops(counter)

    def _exactness(self, res: MethodResult, first, ref) -> None:
        (loss, grads), (ref_loss, ref_grads) = first, ref
        res.loss_rel_err = rel_err(loss, ref_loss)
        res.max_rel_grad_err = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
        tol = TOLERANCE.get(self.dtype, 1e-5)
        res.exact = res.loss_rel_err <= tol and res.max_rel_grad_err <= tol

    def _prepare(self, res: MethodResult, loss_fn, ref) -> Callable[[], None]:
        """First (warm-up/compile) run -> exactness; bytes saved for backward; returns the timed step."""
        self._exactness(res, self._run_once(loss_fn), ref)
        res.saved_bytes = self._saved_bytes(loss_fn)
        return self._step(loss_fn)

    def _loss_fn(self, method: str, case: Case, batch: dict, dense_fn: Callable) -> Callable[[], Any]:
        """The method's loss callable, built in its own scope: each method holds its own compiled function
        (nothing is shared between methods through a variable rebound later)."""
        import brcompile

        if method == "eager":
            return dense_fn
        if method == "torch.compile":
            compiled = torch.compile(_loss_torch_compile, backend=self.args.compile_backend)
            return functools.partial(compiled, self.model, batch)
        if method == "branch_replay":
            compiled = torch.compile(_loss_branch_replay, backend=brcompile.backend(
                compiler=self.args.compiler, min_dedup=self.args.min_dedup))
            return functools.partial(compiled, self.model, batch)
        if method == "prefix_grouper":
            available, why = prefix_grouper_status()
            if not available:
                raise BenchError(why)
            return functools.partial(prefix_grouper_grpo_loss, self.model, group_batch(batch, case.group_size), batch)
        raise BenchError(f"unknown method {method!r}; choose from {METHODS}")

    def run_case(self, case: Case, bar) -> CaseResult:
        gpt, grpo = examples_modules()
        batch = grpo.make_grpo_batch(vocab_size=self.model.config.vocab_size, seed=self.args.seed,
                                     device=self.device, dtype=self.dtype, **case.batch_kwargs())
        B, L = batch["input_ids"].shape
        out = CaseResult(case, B, L, int(batch["attention_mask"].sum()))
        out.methods = {m: MethodResult() for m in self.args.methods}
        dense_fn = lambda: grpo.grpo_loss(self.model, **batch)  # noqa: E731
        ref = self._run_once(dense_fn)
        if "branch_replay" in out.methods:  # FLOPs and the tree; explain() leaves no compiled code behind
            bar.set_postfix_str(f"{case.name} branch_replay FLOPs")
            try:
                self._branch_replay_cost(out.methods["branch_replay"], out, batch)
            except Exception as e:
                log.warning("bench: explain on %s failed", case.name, exc_info=log.isEnabledFor(logging.DEBUG))
                out.methods["branch_replay"].flops_counted_on = f"not counted: {_short(e)}"
        torch._dynamo.reset()  # the previous case's compiled code goes: every method compiles afresh
        steps: dict[str, Callable[[], None]] = {}
        counted: dict[str, _CountedCalls] = {}
        for method in self.args.methods:
            bar.set_postfix_str(f"{case.name} {method}")
            res = out.methods[method]
            try:
                loss_fn = self._loss_fn(method, case, batch, dense_fn)
                counted[method] = _CountedCalls(loss_fn)
                steps[method] = self._prepare(res, counted[method], ref)
                if method == "eager":
                    res.flops, res.attention_flops = self._flops(loss_fn)
                    res.flops_counted_on = "the dense loss, eagerly"
                    out.dense_flops = res.flops
                elif method == "torch.compile":
                    eager = out.methods.get("eager")
                    res.flops, res.attention_flops = (eager.flops, eager.attention_flops) if eager else (None, None)
                    res.flops_counted_on = "the dense graph (the compiled code computes it)"
                elif method == "prefix_grouper":
                    res.flops, res.attention_flops = self._flops(loss_fn)
                    res.flops_counted_on = "PrefixGrouper's forward+backward, eagerly"
            except Exception as e:  # report it in the table and go on with the other methods
                log.warning("bench: %s on %s failed", method, case.name, exc_info=log.isEnabledFor(logging.DEBUG))
                res.error = _short(e)
                steps.pop(method, None)
        bar.set_postfix_str(f"{case.name} timing")
        self._time_interleaved(steps, out)
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
        """A warm-up round, then ``repeats`` rounds running each method once; the median per method."""
        times: dict[str, list[float]] = {m: [] for m in steps}
        for round_ in range(1 + max(1, self.args.repeats)):
            for method, step in list(steps.items()):
                try:
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

    def _branch_replay_cost(self, res: MethodResult, out: CaseResult, batch: dict) -> None:
        """FLOPs, the tree and the limit from brcompile.tools.explain (the eager original and packed graphs of one
        call, counted; see brcompile/tools/explain.py)."""
        import brcompile
        from brcompile.tools.explain import explain

        self.model.zero_grad(set_to_none=True)
        report = explain(_GRPO_LOSS, self.model, **batch,
                         backend=brcompile.backend(compiler="eager", min_dedup=self.args.min_dedup))
        call = report.calls[0] if report.calls else {}
        tree, cost = call.get("tree") or {}, call.get("cost") or {}
        out.executed_tokens, out.dedup_ratio = tree.get("executed_tokens"), tree.get("dedup_ratio")
        out.limit_flops = cost.get("limit_flops")
        out.limit_attention_flops = cost.get("packed_attention_flops")
        res.flops, res.attention_flops = cost.get("packed_flops"), cost.get("packed_attention_flops")
        res.flops_counted_on = "the eager packed graph (brcompile.tools.explain)"
        if res.flops is None:
            res.flops_counted_on = f"not counted: {cost.get('skipped') or call.get('reason') or 'no call'}"


# ----------------------------------------------------------------------------------------------------
# Output: tables, JSON, plot


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def result_tables(results: list[CaseResult], methods: Sequence[str]) -> list:
    """The bench's tables (brcompile.tools.explain.Table) and notes."""
    from brcompile.tools.explain import Table, fmt_bytes, fmt_flops

    others = [m for m in methods if m != "eager"]
    time_rows, flop_rows, mem_rows, exact_rows, notes = [], [], [], [], []
    for r in results:
        m = r.methods
        base = [r.case.name, f"{r.B}x{r.L}", "-" if r.executed_tokens is None else f"{r.executed_tokens:,}",
                _x(r.dedup_ratio)]
        time_rows.append(base + [_ms(m["eager"].seconds) if "eager" in m else "-"]
                         + [f"{_ms(m[k].seconds)} ({_x(m[k].speedup)})" if k in m and m[k].seconds else "-"
                            for k in others] + [_x(r.flop_ratio_limit)])
        flop_rows.append([r.case.name] + [fmt_flops(m[k].flops) if k in m else "-" for k in methods]
                         + [fmt_flops(r.limit_flops)]
                         + [_x(m[k].flops / r.limit_flops) if k in m and m[k].flops and r.limit_flops else "-"
                            for k in ("branch_replay", "prefix_grouper") if k in methods])
        mem_rows.append([r.case.name] + [fmt_bytes(m[k].saved_bytes) if k in m else "-" for k in methods])
        exact_rows.append([r.case.name] + [
            "-" if k not in m or m[k].exact is None else
            f"{'PASS' if m[k].exact else 'FAIL'} {max(m[k].loss_rel_err, m[k].max_rel_grad_err):.1e}"
            for k in others])
        for k, res in m.items():
            if res.error:
                notes.append(f"{r.case.name}: {k} failed: {res.error}")
            for reason, n in res.fallback_reasons.items():
                notes.append(f"{r.case.name}: {k} ran the original graph x{n}: {reason}")
            if k == "branch_replay" and res.replayed_calls == 0 and not res.error:
                notes.append(f"{r.case.name}: branch_replay replayed nothing (its numbers are the dense graph's)")
    return [
        Table("wall-clock of one GRPO forward+backward: median ms (speedup over dense eager)",
              ["case", "B x L", "N", "B*L/N", "eager ms"] + [f"{k} ms" for k in others] + ["FLOP limit"],
              time_rows, ["FLOP limit = dense FLOPs / limit FLOPs: the speedup of computing each tree node once."]),
        Table("executed FLOPs of one forward+backward",
              ["case"] + list(methods) + ["limit"] + [f"{k}/limit" for k in ("branch_replay", "prefix_grouper")
                                                       if k in methods],
              flop_rows, ["eager and prefix_grouper: counted on their eager run; torch.compile: the dense graph's "
                          "count; branch_replay: its eager packed graph (brcompile.tools.explain); dense attention is "
                          "counted over the full score matrix, tree attention over the visible pairs."]),
        Table("bytes saved for backward (saved_tensors_hooks, parameters excluded)", ["case"] + list(methods),
              mem_rows),
        Table("exactness vs dense eager: max relative error over the loss and every parameter gradient",
              ["case"] + others, exact_rows, notes),
    ]


def plot_speedups(results: list[CaseResult], path: Path) -> Optional[str]:
    """Speedup over dense eager vs P/T, one colour per G: branch_replay solid, prefix_grouper dotted,
    torch.compile dash-dot, the FLOP-ratio limit dashed. Returns None, or why no plot was written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed, no plot (pip install matplotlib): {e}"
    fig, ax = plt.subplots(figsize=(8, 5))
    groups = sorted({r.case.group_size for r in results})
    colours = plt.get_cmap("tab10")
    styles = (("branch_replay", "-", "o"), ("prefix_grouper", ":", "s"), ("torch.compile", "-.", "^"))
    for i, G in enumerate(groups):
        rs = sorted((r for r in results if r.case.group_size == G), key=lambda r: r.case.prefix_len / r.case.tail_len)
        x = [r.case.prefix_len / r.case.tail_len for r in rs]
        for method, style, marker in styles:
            pts = [(xi, r.methods[method].speedup) for xi, r in zip(x, rs)
                   if method in r.methods and r.methods[method].speedup]
            if pts:
                ax.plot(*zip(*pts), linestyle=style, marker=marker, color=colours(i), label=f"{method}, G={G}")
        lim = [(xi, r.flop_ratio_limit) for xi, r in zip(x, rs) if r.flop_ratio_limit]
        if lim:
            ax.plot(*zip(*lim), linestyle="--", color=colours(i), alpha=0.6, label=f"FLOP-ratio limit, G={G}")
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


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The bench's flags (``python -m brcompile bench --help``)."""
    p.add_argument("--group-sizes", type=_ints, default=[4, 8], help="G values, comma-separated (default 4,8)")
    p.add_argument("--prefix-lens", type=_ints, default=[64, 256, 1024], help="prompt lengths P (default 64,256,1024)")
    p.add_argument("--tail-lens", type=_ints, default=[64], help="response lengths T (default 64)")
    p.add_argument("--num-prompts", type=int, default=1, help="groups per batch (default 1: PrefixGrouper's best case)")
    p.add_argument("--ragged", action="store_true", help="response lengths drawn from [T/2, T], right-padded")
    p.add_argument("--shared-response", type=int, default=0, help="leading response tokens shared in a group")
    p.add_argument("--methods", type=_methods, default=list(METHODS), help=f"subset of {','.join(METHODS)}")
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
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quick", action="store_true",
                   help="a tiny model and grid in seconds (G 2,4; P 16,48; T 8; dim 32; 1 layer; aot_eager)")
    p.add_argument("--rich", choices=("auto", "yes", "no"), default="auto", help="tables with rich")
    return p


def _apply_quick(args) -> None:
    args.group_sizes, args.prefix_lens, args.tail_lens = [2, 4], [16, 48], [8]
    args.dim, args.layers, args.heads, args.kv_heads, args.vocab, args.repeats = 32, 1, 2, 1, 61, 1
    args.compile_backend, args.compiler = "aot_eager", "eager"


def run(args) -> dict:
    """Runs the grid of ``args`` (parsed :func:`add_arguments` flags), prints the tables, writes JSON and the
    plot; returns the JSON document."""
    from brcompile.tools.explain import print_blocks

    if args.quick:
        _apply_quick(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else torch.device(args.device)
    gpt, _ = examples_modules()
    config = gpt.GPTConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                           n_kv_heads=args.kv_heads)
    model = gpt.GPT(config, seed=args.seed).to(device=device, dtype=getattr(torch, args.dtype))
    cases = [Case(G, P, T, args.num_prompts, args.ragged, args.shared_response)
             for G in args.group_sizes for P in args.prefix_lens for T in args.tail_lens]
    pg_ok, pg_line = prefix_grouper_status()
    print(f"model: dim {args.dim}, layers {args.layers}, heads {args.heads} (kv {args.kv_heads}), vocab {args.vocab}, "
          f"{args.dtype}, {device.type}; {len(cases)} case(s) x {len(args.methods)} method(s); median of "
          f"{args.repeats}; torch.compile backend {args.compile_backend}, branch_replay compiler {args.compiler}; "
          f"{pg_line}", flush=True)
    runner = Runner(model, args, device)
    bar = progress_bar(len(cases) * len(args.methods))
    results = []
    try:
        for case in cases:
            results.append(runner.run_case(case, bar))
    finally:
        bar.close()
    blocks = result_tables(results, args.methods)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / "bench.json", args.out / "bench_speedup.png"
    plot_note = "plot skipped (--no-plot)" if args.no_plot else plot_speedups(results, png_path)
    doc = {
        "schema": "brcompile.bench/1",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "environment": {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
                        "machine": platform.machine(), "prefix_grouper": pg_line},
        "results": [r.to_dict() for r in results],
        "plot": None if plot_note else str(png_path),
        "notes": [n for n in (plot_note,) if n],
    }
    json_path.write_text(json.dumps(doc, indent=2, default=str))
    print_blocks(blocks + [f"wrote {json_path}" + ("" if plot_note else f" and {png_path}")] + doc["notes"],
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m brcompile bench``: see the module docstring."""
    args = add_arguments(argparse.ArgumentParser(prog="brcompile bench", description=__doc__.split("\n\n")[0]))\
        .parse_args(argv)
    return exit_status(run(args))
