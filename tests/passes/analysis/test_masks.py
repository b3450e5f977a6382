"""Mask classification (passes/analysis/masks/): meanings read off small probe batches, never the real B·L².

Every end-to-end case compares the loss and all parameter gradients with the eager original in float64
and asserts through ``brcompile.stats()`` that the rewrite ran (or fell back with the expected reason).
The memory-capped cases run in a subprocess whose address space is limited to well below one [B, L, L]
mask of the example batch: compiling them must not build one.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import brcompile
from brcompile.passes import probe
from brcompile.passes.analysis import masks
from brcompile.testing import assert_exact
from tests.helpers import exact_over_batches

ROOT = Path(__file__).resolve().parents[2]


class MaskLM(nn.Module):
    """One attention layer whose mask is built in the graph the way hand-written models do:
    ``arange`` comparisons (causal, optionally ``i - j < window``; ``window="batch"``: the window is the
    batch size), ``& attention_mask`` over keys; or a registered ``[T, T]`` tril buffer (``tril=T``)."""

    def __init__(self, vocab=37, dim=16, heads=2, window=0, tril=0):
        super().__init__()
        self.heads, self.window = heads, window
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, vocab)
        if tril:
            self.register_buffer("bias", torch.tril(torch.ones(tril, tril, dtype=torch.bool)))
        else:
            self.bias = None

    def forward(self, ids, am):
        B, L = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.bias is not None:
            m = self.bias[:L, :L]
        else:
            i = torch.arange(L, device=ids.device)
            m = i[:, None] >= i[None, :]
            if self.window:
                w = B if self.window == "batch" else self.window
                m = m & (i[:, None] - i[None, :] < w)
        m = m[None, None] & am[:, None, None, :].bool()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return self.out(o.transpose(1, 2).reshape(B, L, -1))


def shared_batch(rows, prompt, tail, seed=0, vocab=37, right_pad=0):
    """``rows`` rows sharing a ``prompt``-token prefix, each with its own ``tail`` tokens; the last
    ``right_pad`` columns of odd rows are padding (id 0, mask 0)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(1, vocab, (1, prompt), generator=g).expand(rows, -1)
    ids = torch.cat([p, torch.randint(1, vocab, (rows, tail), generator=g)], 1)
    am = torch.ones_like(ids)
    if right_pad:
        am[1::2, -right_pad:] = 0
        ids = ids * am
    return ids, am


def loss_fn(model):
    def f(ids, am):
        return model(ids, am).log_softmax(-1).mean()
    return f


def run_exact(model, batches, *, dynamic, backend=None):
    """Compiled vs eager, loss and every parameter gradient, for each batch (float64)."""
    return exact_over_batches(model, loss_fn(model), batches, backend or brcompile.backend(compiler="eager"), dynamic)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("window", [0, 5])
def test_causal_keypad_and_window_exact(window, dynamic):
    """Causal & key padding, with and without an active window, static and dynamic (two lengths)."""
    model = MaskLM(window=window).double()
    batches = [shared_batch(4, 9, 3, seed=1, right_pad=2), shared_batch(3, 14, 4, seed=2, right_pad=1)]
    backend = run_exact(model, batches, dynamic=dynamic)
    s = brcompile.stats()
    assert s.replayed_calls == 2 and s.fallback_calls == 0, str(s)
    want = "causal+keypad(l_am_)" + (f"+window({window})" if window else "")
    assert all(m.endswith(want) for r in backend.records for m in r.masks), [r.masks for r in backend.records]


def test_window_longer_than_the_example_found_by_probes():
    """Dynamic shapes: a window of 20 is inactive at the compile-time length 9 and active at 30; the
    probes at the constant's lengths find it, so both calls replay."""
    model = MaskLM(window=20).double()
    backend = run_exact(model, [shared_batch(4, 6, 3, seed=1), shared_batch(4, 25, 5, seed=2)], dynamic=True)
    s = brcompile.stats()
    assert s.replayed_calls == 2 and s.compiled_graphs == 1, str(s)
    assert all("window(20)" in m for m in backend.records[0].masks), backend.records[0].masks


def test_window_that_follows_the_batch_size_is_refused():
    """``window = B``: probes with two row counts see two windows; the original graph runs, saying why."""
    model = MaskLM(window="batch").double()
    run_exact(model, [shared_batch(4, 9, 3, seed=1), shared_batch(6, 9, 3, seed=2)], dynamic=True)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 2, str(s)
    assert s.fallback_codes == {brcompile.Code.MASK_UNPROVEN: 2}, str(s)


def test_tril_buffer_mask_is_bounded_by_the_buffer():
    """A [T, T] tril buffer sliced to [:L, :L]: causal for every length the buffer covers (dynamic)."""
    model = MaskLM(tril=40).double()
    backend = run_exact(model, [shared_batch(4, 6, 3, seed=1), shared_batch(4, 20, 5, seed=2)], dynamic=True)
    s = brcompile.stats()
    assert s.replayed_calls == 2, str(s)
    assert all(m.endswith(": causal+keypad(l_am_) for L <= 40") for m in backend.records[0].masks), \
        backend.records[0].masks


def test_unprobeable_constant_bounds_the_lengths_by_a_guard(monkeypatch):
    """A window constant too large to probe (rows·L² over MAX_PROBE_ELEMENTS, lowered here to 4096) bounds
    the proven lengths: the dynamic graph replays below it, and the per-call guard (O(1), a length check)
    runs the original graph above it, saying why."""
    for module in (masks.values, masks.probes, masks.meaning):  # every reader of the bound
        monkeypatch.setattr(module, "MAX_PROBE_ELEMENTS", 4096)
    big = 70  # (70 + 2)^2 > 4096
    model = MaskLM(window=big).double()
    batches = [shared_batch(4, 6, 3, seed=1), shared_batch(4, 9, 5, seed=2), shared_batch(4, 70, 8, seed=3)]
    backend = run_exact(model, batches, dynamic=True)
    s = brcompile.stats()
    assert s.replayed_calls == 2 and s.fallback_calls == 1, str(s)
    assert any(f"L <= {big - 1}" in m for m in backend.records[0].masks), backend.records[0].masks
    assert any("at length 78" in r for r in s.details(brcompile.Code.GUARD_MASK_LENGTH)), str(s)


def test_sliding_window_reads_no_index_grids():
    """sliding_window on a [B, 1, L, L] bool mask: the window, or None for plain causal / a future key."""
    L = 9
    i = torch.arange(L)
    causal = i[:, None] >= i[None, :]
    win = causal & (i[:, None] - i[None, :] < 3)
    assert masks.sliding_window(win[None, None].expand(2, 1, L, L), None) == 3
    assert masks.sliding_window(causal[None, None], None) is None
    assert masks.sliding_window(~causal, None) is None


_CAPPED = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, {root!r}); sys.path.insert(0, {here!r})
    import torch, brcompile
    from test_masks import MaskLM, shared_batch
    torch.manual_seed(0)
    model = MaskLM(vocab=37, dim=8, heads=1, window={window})
    rows, prompt, tail = {rows}, {prompt}, {tail}
    ids, am = shared_batch(rows, prompt, tail, seed=1, right_pad=3)
    fn = lambda ids, am: model(ids, am).log_softmax(-1)[:, -1].mean()
    compiled = torch.compile(fn, backend=brcompile.backend(compiler="eager", mode="replay", chunk_tokens=512),
                             dynamic={dynamic})
    with open("/proc/self/status") as f:
        vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
    cap = vm + {cap_mib} * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    compiled(ids, am).backward()
    if {dynamic}:  # a second length through the same graph: the per-call guards at a new size, capped too
        ids, am = shared_batch(rows, prompt + 7, tail, seed=2, right_pad=3)
        compiled(ids, am).backward()
    s = brcompile.stats()
    print("RESULT", s.replayed_calls, s.fallback_calls, dict(s.fallback_reasons))
""")


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("window", [0, 1000])
def test_large_example_batch_compiles_under_a_memory_cap(window, dynamic):
    """Compile (and run, streamed) a batch of 8 x 12,288 positions with the address space capped at
    512 MiB above the process's size: one [B, 1, L, L] bool mask of it is 1.1 GiB, int64 index grids
    9 GiB. The rewrite must fire (no fallback: the original graph would not fit either); dynamic: a
    second length runs through the same graph, its per-call guards under the cap too."""
    script = _CAPPED.format(root=str(ROOT), here=str(Path(__file__).parent), window=window, rows=8, prompt=12000,
                            tail=288, dynamic=dynamic, cap_mib=512)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    assert line.startswith(f"RESULT {2 if dynamic else 1} 0 "), line


# --------------------------------------------------------------------------------------------------
# packed sequences (padding-free batches): causal within the sequences that position ids start


class PackedLM(nn.Module):
    """One attention layer over rows of packed sequences: the mask is ``j <= i`` within the sequence, the
    sequences numbered by the 0s of the position ids (``starts="diff"``: HF's rule, a new sequence wherever
    the position does not count up by 1); ``causal=False``: bidirectional within a sequence. The position
    ids also feed a learned position embedding."""

    def __init__(self, vocab=37, dim=16, heads=2, starts="zero", causal=True):
        super().__init__()
        self.heads, self.starts, self.causal = heads, starts, causal
        self.emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(64, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids, pos):
        B, L = ids.shape
        h = self.emb(ids) + self.pos_emb(pos)
        q, k, v = self.qkv(h).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.starts == "zero":
            seq = (pos == 0).cumsum(-1)
        else:
            seq = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        m = seq[:, None, :, None] == seq[:, None, None, :]
        if self.causal:
            i = torch.arange(L, device=ids.device)
            m = m & (i[:, None] >= i[None, :])
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return self.out(o.transpose(1, 2).reshape(B, L, -1))


def packed_batch(rows, prompt, tails, seed=0, vocab=37):
    """``rows`` rows, each the concatenation of sequences ``prompt + tail`` (one shared prompt, a random
    tail of each length in ``tails``), with position ids 0, 1, ... per sequence."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(1, vocab, (prompt,), generator=g)
    ids, pos = [], []
    for _ in range(rows):
        seqs = [torch.cat([p, torch.randint(1, vocab, (n,), generator=g)]) for n in tails]
        ids.append(torch.cat(seqs))
        pos.append(torch.cat([torch.arange(len(s)) for s in seqs]))
    return torch.stack(ids), torch.stack(pos)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("starts", ["zero", "diff"])
def test_packed_sequences_mask_exact(starts, dynamic):
    """Masks causal within packed sequences (started by 0s, or HF's "position does not count up" rule:
    the same on well-formed position ids) are ``causal+sequences`` of the position ids (``run_exact``
    passes them as its second argument, ``am``); the tree is over the sequences (the prompt of every
    sequence is computed once across rows), exact."""
    model = PackedLM(starts=starts).double()
    batches = [packed_batch(2, 6, (3, 2, 4), seed=1)] + ([packed_batch(3, 5, (2, 4), seed=2)] if dynamic else [])
    backend = run_exact(model, batches, dynamic=dynamic)
    s = brcompile.stats()
    assert s.replayed_calls == len(batches) and s.fallback_calls == 0, str(s)
    ids, pos = batches[0]
    prefixes = {tuple(ids[b, c - int(pos[b, c]):c + 1].tolist()) for b in range(ids.shape[0]) for c in range(ids.shape[1])}
    assert backend.records[0].runtime.calls[0].tree_stats["executed_tokens"] == len(prefixes) < ids.numel()
    assert all(m.endswith("causal+sequences(l_am_)") for r in backend.records for m in r.masks), \
        [r.masks for r in backend.records]


def test_bidirectional_within_sequences_is_refused():
    model = PackedLM(causal=False).double()
    run_exact(model, [packed_batch(2, 6, (3, 2, 4), seed=1)], dynamic=False)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.MASK_NOT_CAUSAL: 1}, str(s)


class PaddingOnlyLM(MaskLM):
    """XLM with ``causal=False`` (a masked LM): the mask is the key padding alone, ``[B, 1, 1, L]``."""

    def forward(self, ids, am):
        B, L = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=am[:, None, None, :].bool())
        return self.out(o.transpose(1, 2).reshape(B, L, -1))


def test_key_padding_alone_is_refused_as_bidirectional():
    """A mask that is only the key padding lets every query see the keys after it: refused by name (the padding-only
    ``[B, 1, 1, L]`` visibility read as every query's row)."""
    run_exact(PaddingOnlyLM().double(), [shared_batch(3, 5, 4, right_pad=2)], dynamic=False)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.MASK_NOT_CAUSAL: 1}, str(s)


class IndexedLM(nn.Module):
    """HY-V4's layers, small: an eager attention with a learned sink per head (canonicalised into an SDPA node
    whose sinks the plain call does not take), then an attention whose mask is a top-k selection of keys by an
    index over the first attention's output (DeepSeek sparse attention's indexer, a fixed projection):
    ``ones.scatter(-1, topk(index, min(topk, L)).indices, False)`` marks the keys left out. With ``topk >= L``
    every key is picked, so the mask is causal & key padding whatever the tokens; with fewer picks it follows
    them."""

    def __init__(self, topk, vocab=37, dim=16, heads=2):
        super().__init__()
        self.heads, self.topk = heads, topk
        self.emb = nn.Embedding(vocab, dim)
        self.qkv1 = nn.Linear(dim, 3 * dim)
        self.sinks = nn.Parameter(torch.randn(heads))
        self.register_buffer("index", torch.randn(dim, 4))
        self.qkv2 = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids, am):
        B, L = ids.shape
        x = self.emb(ids)
        i = torch.arange(L, device=ids.device)
        visible = (i[:, None] >= i[None, :])[None, None] & am[:, None, None, :].bool()
        q, k, v = self.qkv1(x).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-2, -1) * 0.5 + torch.zeros_like(visible, dtype=x.dtype).masked_fill(
            ~visible, torch.finfo(x.dtype).min)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, L, -1)
        p = torch.cat([s, sinks], -1).softmax(-1)[..., :-1]
        h = x + (p @ v).transpose(1, 2).reshape(B, L, -1)
        with torch.no_grad():
            u = h @ self.index
            score = (u @ u.transpose(1, 2)).masked_fill(~visible[:, 0], float("-inf"))
            picked = score.topk(min(self.topk, L), dim=-1).indices
            left_out = torch.ones(B, L, L, dtype=torch.bool).scatter(-1, picked, False)[:, None]
        q, k, v = self.qkv2(h).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible & ~left_out)
        return self.out(h + o.transpose(1, 2).reshape(B, L, -1))


def test_mask_read_through_an_attention_with_sinks_replays():
    """The probes of the second mask evaluate the first attention, a canonical SDPA node with sinks, by its meaning
    (canonicalize.canonical_attention): the mask is causal & key padding on every probe (every key picked), and
    the loss and every gradient (the sinks' included) equal eager's in float64."""
    backend = run_exact(IndexedLM(topk=64).double(), [shared_batch(3, 6, 4, right_pad=2)], dynamic=False)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens, str(s)
    masks_ = backend.records[0].masks
    assert len(masks_) == 2 and all(m.endswith(": causal+keypad(l_am_)") for m in masks_), masks_


def test_mask_probes_keep_token_ids_inside_the_vocabulary():
    """The probes draw token ids in the example's range: with the largest id the last row of the embedding, a
    mask computed through the embedding (the indexer above) is probed without reading past the vocabulary."""
    ids, am = shared_batch(3, 6, 4, right_pad=2)
    run_exact(IndexedLM(topk=64, vocab=int(ids.max()) + 1).double(), [(ids, am)], dynamic=False)
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0, str(s)


def test_mask_that_follows_the_tokens_is_refused_by_name():
    """Fewer picks than keys: which keys a query sees depends on the tokens (through the first attention's output):
    refused as a content-dependent mask."""
    run_exact(IndexedLM(topk=3).double(), [shared_batch(3, 6, 4, right_pad=2)], dynamic=False)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.MASK_FROM_VALUES: 1}, str(s)
    assert any("l_ids_" in r and "top-k" in r for r in s.details(brcompile.Code.MASK_FROM_VALUES)), str(s)


def test_sequence_positions_are_well_formed():
    g = torch.Generator().manual_seed(0)
    for p in masks.SEQUENCE_PATTERNS:
        pos = probe.sequence_positions(3, 17, p, g)
        assert (pos[:, 0] == 0).all() and ((pos[:, 1:] == 0) | (pos[:, 1:] == pos[:, :-1] + 1)).all()


class BiasLM(nn.Module):
    """One attention layer with a float mask that adds a trainable bias: ``bias="slopes"``, ALiBi with learned
    per-head slopes ``m[h] * (k - q)``; ``bias="table"``, a learned relative-position table ``T[h, q - k]``;
    ``bias="per_key"``, Doge's ``u = exp(A[h] * softplus(proj(v[b, h, k])))``
    (the same for every query, different per token) with Doge's initial ``A = 0``, where the bias is 1
    everywhere and shows what it follows only for other values of ``A``; ``bias="query_key"``, ``u[q] * u[k]``
    (per token in both the query and the key)."""

    def __init__(self, bias, vocab=37, dim=16, heads=2, A=0.0):
        super().__init__()
        self.heads, self.bias = heads, bias
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        if bias == "slopes":
            self.slopes = nn.Parameter(torch.tensor([-0.5, -0.25]))
        elif bias == "table":
            self.table = nn.Parameter(0.1 * torch.randn(heads, 64))
        else:
            self.key_bias = nn.Linear(dim // heads, 1)
            self.A = nn.Parameter(torch.full((heads,), A))
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids, am):
        B, L = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        i = torch.arange(L, device=ids.device)
        if self.bias == "slopes":
            b = self.slopes[None, :, None, None] * (i[None, :] - i[:, None])[None, None]
        elif self.bias == "table":
            b = self.table[:, (i[:, None] - i[None, :]).clamp(min=0)][None]
        else:
            u = torch.exp(self.A[None, :, None] * F.softplus(self.key_bias(v)[..., 0]))
            b = u[:, :, None, :].expand(-1, -1, L, -1) if self.bias == "per_key" else u[:, :, None, :] * u[..., None]
        visible = (i[:, None] >= i[None, :])[None, None] & am[:, None, None, :].bool()
        m = b.masked_fill(~visible, torch.finfo(b.dtype).min)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return self.out(o.transpose(1, 2).reshape(B, L, -1))


@pytest.mark.parametrize("bias, reason", [
    ("table", "a learned position bias"),
    ("query_key", "computed from the values of"),
])
def test_trainable_bias_is_refused_naming_its_kind(bias, reason):
    """A bias computed from a parameter falls back (its gradient would be lost) exactly, and the reason tells a
    learned position bias (unchanged when only the token ids are reordered) from a per-token one."""
    model = BiasLM(bias).double()
    run_exact(model, [shared_batch(3, 5, 4, right_pad=2)], dynamic=False)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert s.fallback_codes == {brcompile.Code.ATTENTION_BIAS: 1}, str(s)
    # the detail tells a learned position bias from a per-token one
    assert any("trainable tensor" in r and reason in r for r in s.details(brcompile.Code.ATTENTION_BIAS)), str(s)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_trainable_alibi_slopes_replay_exactly(dynamic):
    """ALiBi with learned slopes ``m[h] * (k - q)``, ``m`` a parameter: the slopes node is tree attention's
    differentiable ``slopes`` (masks.alibi._trainable_alibi), so the loss and every gradient, the slopes' included, are
    exact, with key padding, at one length and (dynamic) at two."""
    model = BiasLM("slopes").double()
    batches = [shared_batch(3, 5, 4, right_pad=2)] + ([shared_batch(4, 7, 3, seed=2, right_pad=1)] if dynamic else [])
    backend = run_exact(model, batches, dynamic=dynamic)
    s = brcompile.stats()
    assert s.replayed_calls == len(batches) and s.fallback_calls == 0, str(s)
    assert s.executed_tokens < s.logical_tokens, str(s)
    code = backend.records[-1].packed_code  # the slopes parameter reaches tree attention's last argument
    call = next(line for line in code.splitlines() if "tree_attention_forward" in line)
    assert call.split("(", 1)[1].split(")")[0].split(", ")[-1].startswith("reshape"), call
    assert "parameters_slopes_" in code, code


def test_trainable_alibi_slopes_are_read_per_call():
    """The slopes are an input of the packed graph, not constants of the compile: after an update of the slopes
    (an optimizer step, here one that flips a sign) the same compiled graph, not compiled again, gives eager's
    loss and gradients."""
    model = BiasLM("slopes").double()
    backend = brcompile.backend(compiler="eager")
    fn = loss_fn(model)
    compiled = torch.compile(fn, backend=backend)
    ids, am = shared_batch(3, 5, 4, right_pad=2)
    params = list(model.parameters())
    for _ in range(2):
        ref, out = fn(ids, am), compiled(ids, am)
        assert_exact(out, ref, torch.float64, "loss")
        for (name, _), a, b in zip(model.named_parameters(), torch.autograd.grad(out, params),
                                   torch.autograd.grad(ref, params)):
            assert_exact(a, b, torch.float64, f"grad of {name}")
        with torch.no_grad():
            model.slopes.mul_(-1.5).add_(0.1)
    s = brcompile.stats()
    assert len(backend.records) == 1 and s.replayed_calls == 2 and s.fallback_calls == 0, str(s)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("A", [0.0, 0.7])
def test_per_key_bias_replays_exactly(A, dynamic):
    """A trainable bias of the key token alone, ``u[b, h, k]`` added to every query's scores, replays as one
    more q/k feature (canonicalize's per-key bias): loss and every gradient (A's and the projection's through
    u included) exact, with key padding, at Doge's initial ``A = 0`` and at another ``A``."""
    model = BiasLM("per_key", A=A).double()
    batches = [shared_batch(3, 5, 4, right_pad=2)] + ([shared_batch(4, 7, 3, seed=2, right_pad=1)] if dynamic else [])
    backend = run_exact(model, batches, dynamic=dynamic)
    s = brcompile.stats()
    assert s.replayed_calls == len(batches) and s.fallback_calls == 0, str(s)
    assert s.executed_tokens < s.logical_tokens, str(s)
    code = backend.records[-1].packed_code  # q gets a ones feature, v a zeros one (the bias rides on k)
    assert "torch.ones_like" in code and "torch.zeros_like" in code, code
