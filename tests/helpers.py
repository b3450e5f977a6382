"""Helpers shared by the test files, imported as ``from tests.helpers import ...`` (tests/conftest.py puts the
repo root on sys.path; ``tests`` is a namespace package, like ``tests.models.zoo``). Fixtures live in
tests/conftest.py; the one tolerance table is ``brcompile.testing.TOLERANCE``.

* ``grpo_args``: the positional arguments of ``examples.grpo.grpo_loss`` from a GRPO batch.
* ``assert_replayed``: the counters show that the packed graph really ran (no silent fallback).
* tiny HuggingFace models: ``transformers_or_skip``, ``HF_TINY``, ``hf_tiny_model``, and the RMSNorm forwards
  with their math in the input's dtype (the ``float64_norms`` fixture installs them).
"""
from __future__ import annotations

import pytest
import torch

import brcompile


def shared_prefix_ids(vocab: int, length: int, prefixes=(8, 5, 10), seed: int = 1) -> torch.Tensor:
    """``[1 + len(prefixes), length]`` random token ids whose row i+1 repeats row 0's first ``prefixes[i]`` ids:
    a batch with prefixes to share."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1 + len(prefixes), length), generator=g)
    for i, p in enumerate(prefixes):
        ids[i + 1, :p] = ids[0, :p]
    return ids


def grpo_args(batch, *extra):
    """(input_ids, attention_mask, completion_mask, advantages, old_logprobs, *extra) of a GRPO batch
    (``examples.grpo.make_grpo_batch``); ``extra`` e.g. ``0.2, use_mask`` for ``grpo_loss``'s clip and mask flag."""
    return (batch["input_ids"], batch["attention_mask"], batch["completion_mask"], batch["advantages"],
            batch["old_logprobs"], *extra)


def assert_replayed(calls: int = 1, s=None):
    """``calls`` calls ran the packed graph, none fell back, a graph was rewritten and tokens were shared
    (``s``: a ``brcompile.stats()`` snapshot; the current counters by default)."""
    s = brcompile.stats() if s is None else s
    assert s.replayed_calls == calls and s.fallback_calls == 0, str(s)
    assert s.rewritten_graphs > 0, str(s)
    assert s.executed_tokens < s.logical_tokens, str(s)


# ------------------------------------------------------------------------------------ tiny HF models


def transformers_or_skip():
    """The ``transformers`` module (5.x), or skip the calling test (CI installs it: ``.[dev]``)."""
    return pytest.importorskip("transformers", minversion="5.0")


#: hidden 32, 2 layers, vocab 61: the size every HF test uses unless it needs more
HF_TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128)
#: family -> (config class name, the config overrides it needs at HF_TINY's size)
HF_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),  # q/k RMS norms
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "gemma2": ("Gemma2Config", dict(head_dim=8)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=8)),
    "phi3": ("Phi3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=None)),
}


def hf_tiny_model(family: str = "llama", impl: str = "sdpa", dtype=torch.float64, seed: int = 0, **overrides):
    """``AutoModelForCausalLM.from_config`` of a tiny ``family`` config (HF_TINY, then the family's
    overrides, then ``overrides``), random weights from ``seed``, in ``dtype`` (None: as built, float32)."""
    transformers = transformers_or_skip()
    cls_name, extra = HF_FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**HF_TINY, **extra, **overrides}, attn_implementation=impl)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model if dtype is None else model.to(dtype)


def rmsnorm_in_input_dtype(self, hidden_states):
    """HF's Llama/Qwen2/Qwen3/Mistral RMSNorm with its math in the input's dtype (HF's own casts to float32:
    with them a shared token's gradient agrees to the float32 bound only; tests/models/test_hf.py)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def gemma_rmsnorm_in_input_dtype(self, x):
    """Gemma3's RMSNorm (``x * rsqrt(mean(x^2) + eps) * (1 + w)``) without its ``x.float()``."""
    return self._norm(x) * (1.0 + self.weight)


class KeepFloat64(torch.overrides.TorchFunctionMode):
    """Inside this mode a float64 tensor's casts to float32 (``x.float()``, ``x.to(torch.float32)``,
    ``softmax(x, dtype=torch.float32)``) keep it float64: a float64 model whose modules upcast to float32
    inside (state-space mixers, gated norms, HF's RMSNorms) then runs all in float64, so the rewrite can be
    held to the float64 bound. Dynamo traces through the mode, so the compiled run sees the same math."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
            if func is torch.Tensor.float:
                return x
            if func is torch.Tensor.to and (torch.float32 in args[1:] or kwargs.get("dtype") is torch.float32):
                rest = tuple(a for a in args[1:] if a is not torch.float32)
                kwargs.pop("dtype", None)
                return func(x, *rest, **kwargs) if rest or kwargs else x
        if kwargs.get("dtype") is torch.float32 and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args):
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


#: a gradient below this fraction of the model's largest is measured against NEAR_ZERO * the largest: it is a
#: sum of terms that cancel (a key bias under softmax; Qwen3-Next's dt_bias through its chunk decays), whose
#: rounding is set by the terms, not by the small result
NEAR_ZERO = 1e-6


def assert_grads_exact(got, want, names, dtype) -> None:
    """Every gradient in ``got`` equals ``want``'s within ``brcompile.testing.TOLERANCE[dtype]``, relative to its
    own largest entry or, for a gradient that cancels to below NEAR_ZERO of the model's largest, to that."""
    from brcompile.testing import TOLERANCE

    scale = max(w.abs().max().item() for w in want if w is not None)
    for name, a, w in zip(names, got, want):
        if w is None:
            assert a is None or not a.abs().max().item(), f"grad of {name}: eager has none"
            continue
        ref = max(w.abs().max().item(), NEAR_ZERO * scale)
        err = (a - w).abs().max().item() / ref
        assert err <= TOLERANCE[dtype], f"grad of {name}: relative error {err:.3e} > {TOLERANCE[dtype]:.0e}"


def replay_exact(model, *, dynamic: bool = False, vocab: int = 11, dtype: torch.dtype = torch.float64):
    """Compile ``model`` (a module mapping ids to a scalar; its packed graph run as is) on three rows of 7
    token ids sharing their first 5: the loss and every gradient equal the eager model's in ``dtype`` (the
    model's parameters are cast to it; float64: to that bound, :func:`assert_grads_exact`), and the call replayed
    with fewer executed tokens. Returns the backend (its records say what the rewrite did)."""
    from brcompile.testing import assert_exact

    torch.manual_seed(0)
    model = model.to(dtype)
    ids = torch.randint(1, vocab, (1, 7)).repeat(3, 1)
    ids[1:, 5:] = torch.randint(1, vocab, (2, 2))
    names, params = zip(*model.named_parameters())
    want = model(ids)
    gw = torch.autograd.grad(want, params)
    backend = brcompile.backend(compiler="eager")
    got = torch.compile(model, backend=backend, dynamic=dynamic)(ids)
    gg = torch.autograd.grad(got, params)
    assert_exact(got, want, dtype, "loss")
    assert_grads_exact(gg, gw, names, dtype)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens, str(s)
    return backend


def grouped_rows(seed: int, pad: bool, groups=((7, 4), (5, 3), (9, 2)), response: int = 6,
                 holes=((0, slice(-3, None)), (5, slice(-1, None)))) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of GRPO-like groups: per ``(prompt length, rows)`` of ``groups`` one random
    prompt and ``rows`` random responses of ``response`` tokens, the first two sharing their first two
    tokens (a shared response prefix, a second branching level). Rows start at 0 (right padding), or with
    ``pad`` end at L (left padding) and the mask has ``holes`` (row, columns) set to 0."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for plen, n in groups:
        prompt = torch.randint(1, 40, (plen,), generator=g)
        for i in range(n):
            resp = torch.randint(1, 40, (response,), generator=g)
            if i < 2:
                resp[:2] = torch.tensor([3, 4])
            rows.append(torch.cat([prompt, resp]))
    L = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):
        off = L - len(r) if pad else 0
        ids[b, off:off + len(r)] = r
        mask[b, off:off + len(r)] = 1
    if pad:
        for b, cols in holes:
            mask[b, cols] = 0
    return ids, mask


def tree_qkv(n: int, dtype=torch.float64, hq: int = 4, hkv: int = 2, d: int = 8, seed: int = 0) -> list:
    """Random packed q [hq, n, d], k and v [hkv, n, d] that require grad."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(h, n, d, generator=g, dtype=dtype).requires_grad_() for h in (hq, hkv, hkv)]


# ------------------------------------------------------------------------------------ HF Inkling2 attention


class _NoBias(torch.nn.Module):
    """Inkling2's relative position bias swapped out (``position_bias=None``: the scores get no bias)."""

    def forward(self, *args, **kwargs):
        return None


class Inkling2AttentionLM(torch.nn.Module):
    """Embedding -> one HF Inkling2 attention module ``cls`` (causal additive mask, HF's relative distance) ->
    projection -> a scalar. ``rel_extent``: the relative position table's width (and the sliding window when
    wider than 4); ``relative_bias=False`` swaps the bias out. ``index`` (settable): another spelling of the
    relative distance (None: HF's). Vocabulary ``INKLING2_VOCAB``."""

    def __init__(self, cls, model_type, layer_idx, rel_extent=3, relative_bias=True):
        super().__init__()
        transformers = transformers_or_skip()
        cfg = transformers.AutoConfig.for_model(
            model_type, vocab_size=INKLING2_VOCAB, hidden_size=32, num_hidden_layers=2,
            layer_types=["hybrid_sliding", "hybrid"], num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, d_rel=4, rel_extent=rel_extent,
            sliding_window_size=max(4, rel_extent))
        cfg._attn_implementation = "eager"
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(INKLING2_VOCAB, cfg.hidden_size)
        self.attn = cls(cfg, layer_idx)
        if not relative_bias:
            self.attn.relative_position_bias = _NoBias()
        self.out = torch.nn.Linear(cfg.hidden_size, INKLING2_VOCAB)
        for p in self.parameters():  # HF initialises some of them to 0 (the convolutions, the sink projection)
            torch.nn.init.normal_(p, std=0.3)
        if relative_bias:
            torch.nn.init.normal_(self.attn.relative_position_bias.proj, std=1.0)
        self.register_buffer("tril", torch.tril(torch.ones(16, 16, dtype=torch.bool)))
        self.full = "FullAttention" in cls.__name__
        self.index = None

    def forward(self, ids):
        B, L = ids.shape
        h = self.emb(ids)
        mask = torch.zeros(L, L, dtype=h.dtype).masked_fill(~self.tril[:L, :L], torch.finfo(h.dtype).min)
        pos = torch.arange(L)[None].expand(B, -1)
        dist = pos[0][:, None] - pos[0][None, :]
        if self.index is not None:
            dist = self.index(dist)
        if self.full:
            o, _ = self.attn(h, h, h, mask[None, None], dist, position_ids=pos)
        else:
            o, _ = self.attn(h, mask[None, None], dist, position_ids=pos)
        return self.out(o).log_softmax(-1).pow(2).sum()


INKLING2_VOCAB = 11


def inkling2_streamed(model, chunk_tokens: int = 4):
    """``model`` (an ``Inkling2AttentionLM``) eager and compiled with ``mode="replay"`` on 4 rows of 9 sharing their
    first 5 tokens, in float64 (``KeepFloat64``): (eager loss, its gradients, compiled loss, its gradients,
    the backend)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, INKLING2_VOCAB, (1, 9), generator=g).repeat(4, 1)
    ids[1:, 5:] = torch.randint(1, INKLING2_VOCAB, (3, 4), generator=g)
    params = list(model.parameters())
    backend = brcompile.backend(compiler="eager", mode="replay", chunk_tokens=chunk_tokens)
    with KeepFloat64():
        want = model(ids)
        gw = torch.autograd.grad(want, params)
        got = torch.compile(model, backend=backend)(ids)
        gg = torch.autograd.grad(got, params)
    return want, gw, got, gg, backend


def assert_compiles_for_sm90(script: str) -> None:
    """Runs ``script`` (it compiles Triton kernels for sm_90 through Triton's whole CUDA pipeline, which the
    interpreter skips, and prints "compiled") in a fresh process without TRITON_INTERPRET, with this checkout
    on the path, and asserts it did."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def grpo_needed_tokens(ids, attention_mask, completion_mask, keys_hidden: bool = True) -> int:
    """The needed tokens of a GRPO batch, from first principles (passes/analysis/liveness.py): position t is live when
    the loss reads it with a nonzero weight (it predicts token t + 1: ``completion_mask[:, t + 1] != 0``);
    needed = live, or a key at or before the row's last live position (a visible key, when every attention
    hides the key-padded ones); the count is the distinct tree nodes holding a needed position."""
    from brcompile.runtime.tree import build_tree

    live = torch.zeros_like(completion_mask, dtype=torch.bool)
    live[:, :-1] = completion_mask[:, 1:] != 0
    cols = torch.arange(ids.shape[1])
    upto = cols[None] <= torch.where(live, cols, -1).amax(dim=1, keepdim=True)
    if attention_mask is not None and keys_hidden:
        upto = upto & attention_mask.bool()
    tree = build_tree([ids], attention_mask=attention_mask)
    return int(tree.index[live | upto].unique().numel())


def real_next_token_loss(model):
    """``f(ids, am)``: minus the mean log-likelihood of the next token at the real (unpadded) positions."""
    def f(ids, am):
        logp = model(ids, am)[:, :-1].log_softmax(-1)
        picked = logp.gather(-1, ids[:, 1:, None])[..., 0]
        keep = (am[:, 1:] * am[:, :-1]).to(picked.dtype)
        return -(picked * keep).sum() / keep.sum()
    return f


def exact_over_batches(model, fn, batches, backend, dynamic=False):
    """``fn(ids, am)`` compiled with ``backend`` vs eager on each ``(ids, am)`` of ``batches``: the loss and every
    parameter gradient at the float64 bound; returns the backend."""
    from brcompile.testing import assert_exact

    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    names, params = zip(*model.named_parameters())
    for ids, am in batches:
        ref = fn(ids, am)
        gref = torch.autograd.grad(ref, params)
        out = compiled(ids, am)
        gout = torch.autograd.grad(out, params)
        assert_exact(out, ref, torch.float64, f"loss at {tuple(ids.shape)}")
        for name, a, b in zip(names, gout, gref):
            assert_exact(a, b, torch.float64, f"grad of {name} at {tuple(ids.shape)}")
    return backend


def capture(fn, *args, dynamic=False):
    """The Dynamo graph of ``fn`` and its example inputs."""
    out = {}

    def grab(gm, example_inputs):
        out["gm"], out["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab, dynamic=dynamic, fullgraph=True)(*args)
    return out["gm"], out["inputs"]
