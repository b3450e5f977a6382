"""Positions left out of the prefix tree (docs/ARCHITECTURE.md §4, "Left-out positions"; §3.8).

Three layers:

* ``brcompile.runtime.tree.drop_padding`` against a brute-force construction of the forest of kept nodes (the
  distinct valid prefixes, each under the last valid column before it in its row), with left/right
  padding and holes; segments checked by the CPU attention's own validator.
* ``brcompile::read_packed`` (materialize and the lazy gather) and ``brcompile::packed_logprob`` with
  index -1: 0 there, exact scatter-add elsewhere, DroppedPositionGradError for a nonzero gradient there.
* End to end: the example GPT under grpo_loss (which multiplies by the completion mask) with left-padded
  prompts and right-padded responses, on the three compilers, fused and unfused log-probs: loss and
  every parameter gradient equal the eager dense run (float64, 1e-10) while only the needed tokens execute;
  the model alone (drop_padding, the default): logits equal at every valid position, 0 at padding; an eager
  loss that reads padding raises in backward (the forward cannot know what the loss will read), the same loss
  compiled with the model keeps the pads; streaming replay on the dropped tree. One
  tiny HF Qwen2 through the model path.
"""
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import brcompile
from brcompile.testing import TOLERANCE, assert_exact, assert_subtree_ranges
from brcompile.backends.attention.cpu import _check_segments
from brcompile.backends.logprob.op import packed_logprob, reference_packed_logprob
from brcompile.runtime.tree import build_tree, drop_padding
from brcompile.backends.read_packed.op import DroppedPositionGradError, read_packed
from brcompile.runtime.tree import padding as tree_mod
from examples.gpt import GPT, GPTConfig
from tests.helpers import grpo_needed_tokens
from examples.grpo import grpo_loss, make_grpo_batch
from tests.helpers import grpo_args

TOL = TOLERANCE  # the contract's bound per dtype (brcompile.testing)
HINT = "multiply by the mask"






# ---------------------------------------------------------------------------------------------------------
# the tree: brute force


def kept_forest(tokens: torch.Tensor, mask: torch.Tensor):
    """Brute force: (key, nodes). key[b][t] = the prefix tuple of row b through column t (tokens and mask
    bits), None where mask[b, t] == 0; nodes[key] = (rows having it, column, parent key or None), the
    parent being the key at the last valid column < t of the row."""
    B, L = tokens.shape
    tok, m = tokens.tolist(), (mask != 0).tolist()
    key = [[None] * L for _ in range(B)]
    nodes = {}
    for b in range(B):
        prev = None
        for t in range(L):
            if not m[b][t]:
                continue
            k = tuple(zip(tok[b][: t + 1], m[b][: t + 1]))
            key[b][t] = k
            rows, _, parent = nodes.setdefault(k, ([], t, prev))
            assert parent == prev  # equal prefixes have equal previous valid columns
            rows.append(b)
            prev = k
    return key, nodes


def check_dropped_tree(tree, tokens, mask):
    """Every documented property of the dropped tree, from the brute-force kept forest."""
    B, L = tokens.shape
    key, nodes = kept_forest(tokens, mask)
    n = tree.num_tokens
    assert n == len(nodes), f"{n} kept tokens, the brute force has {len(nodes)}"
    index = tree.index.tolist()
    id_of = {}
    for b in range(B):
        for t in range(L):
            if key[b][t] is None:
                assert index[b][t] == -1, f"dropped ({b}, {t}) has index {index[b][t]}"
            else:
                assert 0 <= index[b][t] < n
                assert id_of.setdefault(key[b][t], index[b][t]) == index[b][t], f"({b}, {t}) got two ids"
    assert sorted(id_of.values()) == list(range(n)), "two different prefixes share a packed id"
    parent, end = tree.parent.tolist(), tree.end.tolist()
    for k, (rows, t, par) in nodes.items():
        i = id_of[k]
        assert tree.position[i] == t and tree.rep_row[i] == rows[0]
        assert parent[i] == (-1 if par is None else id_of[par])
    assert bool(tree.valid.all()) and tree.valid.shape == (n,)
    assert_subtree_ranges(parent, end)
    _check_segments(tree.end, tree.segments)  # partition + end[k] == subtree_end, as attention requires
    check_maximal_chains(tree.segments.tolist(), parent, n)
    valid_rows = (mask != 0).sum(1)
    assert tree.stats.executed_tokens == n and tree.stats.logical_tokens == B * L
    assert tree.stats.valid_tokens == int(valid_rows.sum())
    assert tree.stats.depth == int(valid_rows.max())
    assert tree.stats.segments == len(tree.segments)
    assert tree.stats.dedup_ratio == (B * L / n if n else float("inf"))


def check_maximal_chains(segments, parent, n):
    """Each segment is a chain of single-child nodes, and no segment could be extended backwards."""
    children = [0] * n
    for p in parent:
        if p >= 0:
            children[p] += 1
    for start, stop, _ in segments:
        assert parent[start] == -1 or children[parent[start]] != 1, f"segment at {start} is not maximal"
        for k in range(start + 1, stop):
            assert parent[k] == k - 1 and children[k - 1] == 1, f"node {k} breaks the chain at {start}"


@st.composite
def padded_batches(draw):
    """(tokens, mask): rows that share prefixes (a row copies a prefix of an earlier one, tokens and mask
    alike), left and right padding, holes, all-padding rows."""
    B = draw(st.integers(1, 6))
    L = draw(st.integers(1, 9))
    vocab = draw(st.integers(1, 4))
    rows, masks = [], []
    for i in range(B):
        row = draw(st.lists(st.integers(1, vocab), min_size=L, max_size=L))
        left, right = draw(st.integers(0, L)), draw(st.integers(0, L))
        m = [int(left <= t < L - right) for t in range(L)]
        for t in draw(st.lists(st.integers(0, L - 1), max_size=2)):  # holes
            m[t] = 0
        if i and draw(st.booleans()):
            j = draw(st.integers(0, i - 1))
            cut = draw(st.integers(0, L))
            row[:cut], m[:cut] = rows[j][:cut], masks[j][:cut]
        rows.append([tok if keep else 0 for tok, keep in zip(row, m)])  # pads carry pad id 0
        masks.append(m)
    return torch.tensor(rows), torch.tensor(masks)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(padded_batches())
def test_drop_padding_matches_kept_forest(batch):
    tokens, mask = batch
    full = build_tree(tokens, mask)
    tree = drop_padding(full)
    check_dropped_tree(tree, tokens, mask)
    assert tree.stats.executed_tokens == int(full.valid.sum())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(padded_batches(), st.integers(0, 2**16))
def test_compiled_and_torch_drops_agree(monkeypatch, batch, seed):
    """drop_positions by the compiled CPU kernel and by torch ops: the same arrays and stats, bitwise, for random
    needed and live positions (a needed position's row keeps every position a live one needs, or not: both)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH: the compiled kernels cannot be built")
    tokens, mask = batch
    g = torch.Generator().manual_seed(seed)
    needed = torch.rand(tokens.shape, generator=g) < 0.6
    live = needed & (torch.rand(tokens.shape, generator=g) < 0.7)
    trees = {}
    for path in ("1", "0"):
        monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", path)
        full = build_tree(tokens, mask)
        trees[path] = (tree_mod.drop_positions(full, needed, live), drop_padding(full))
    for got, want in zip(trees["1"], trees["0"]):
        for name in ("index", "parent", "end", "position", "valid", "rep_row", "segments"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.stats == want.stats


@settings(max_examples=60, deadline=None)
@given(padded_batches())
def test_chain_segments_reproduce_build_tree(batch):
    """The segment rule drop_padding uses gives build_tree's own segments on an undropped tree."""
    tree = build_tree(*batch)
    assert torch.equal(tree_mod._chain_segments(tree.parent, tree.end), tree.segments)


def test_left_right_padding_and_holes_by_hand():
    tokens = torch.tensor([[0, 0, 5, 6, 7, 8, 0],
                           [0, 0, 5, 6, 9, 0, 0],
                           [3, 0, 5, 6, 9, 4, 0],
                           [0, 0, 0, 0, 0, 0, 0]])
    mask = (tokens != 0).long()
    tree = drop_padding(build_tree(tokens, mask))
    check_dropped_tree(tree, tokens, mask)
    assert tree.num_tokens == 4 + 1 + 5  # rows 0 and 1 share 5, 6; row 2 (a 3, then a hole) shares nothing
    assert bool((tree.index[3] == -1).all())  # an all-padding row has no nodes


def test_no_padding_is_identity_and_all_padding_is_empty():
    tokens = torch.tensor([[1, 2, 3], [1, 2, 4]])
    tree = build_tree(tokens, torch.ones_like(tokens))
    assert drop_padding(tree) is tree
    empty = drop_padding(build_tree(tokens, torch.zeros_like(tokens)))
    assert empty.num_tokens == 0 and empty.segments.shape == (0, 3)
    assert bool((empty.index == -1).all()) and empty.stats.dedup_ratio == float("inf")
    _check_segments(empty.end, empty.segments)


# ---------------------------------------------------------------------------------------------------------
# the ops at index -1


def test_read_packed_rows_and_columns():
    g = torch.Generator().manual_seed(0)
    data = torch.randn(5, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0, 4, -1, 4], [-1, 2, 2, 1], [3, -1, -1, 0]])
    kept = (index >= 0)[..., None, None]
    out = read_packed(data, index)
    want = torch.where(kept, data[index.clamp(min=0)], 0.0)
    assert_close(out, want, rtol=0, atol=0)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64) * kept  # a loss that masks padding
    assert_close(torch.autograd.grad((out * w).sum(), data)[0], torch.autograd.grad((want * w).sum(), data)[0])
    with pytest.raises(DroppedPositionGradError, match=f"nonzero at 4 of the 4 padded.*{HINT}"):
        torch.autograd.grad(read_packed(data, index).sum(), data)

    flat = data.detach()[:, 0].requires_grad_()  # [N, V] with columns: the lazy gather
    cols = torch.randint(0, 7, (3, 4, 2), generator=g)
    out = read_packed(flat, index, cols)
    want = torch.where(kept[..., 0], flat[index.clamp(min=0)[..., None], cols], 0.0)
    assert_close(out, want, rtol=0, atol=0)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64) * kept[..., 0]
    assert_close(torch.autograd.grad((out * w).sum(), flat)[0], torch.autograd.grad((want * w).sum(), flat)[0])
    w[0, 2, 1] = float("nan")  # a NaN gradient at a dropped position is not zero either
    with pytest.raises(DroppedPositionGradError, match="nonzero at 1 of the 4"):
        torch.autograd.grad((read_packed(flat, index, cols) * w).sum(), flat)


def test_read_packed_opcheck():
    data = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0, 5, 2], [3, 3, 1]])
    torch.library.opcheck(torch.ops.brcompile.read_packed.default, (data, index, None))
    torch.library.opcheck(torch.ops.brcompile.read_packed.default, (data, index, torch.tensor([[[4], [0], [2]]] * 2)))
    dropped = torch.tensor([[0, -1, 2], [-1, 3, 1]])
    torch.library.opcheck(torch.ops.brcompile.read_packed.default, (data.detach(), dropped, None))


@pytest.mark.parametrize("impl", ["cpu", "triton"])
def test_packed_logprob_at_dropped_positions(impl):
    if impl == "triton":
        pytest.importorskip("triton")
    dtype = torch.float64 if impl == "cpu" else torch.float32
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(2)
    N, D, V = 9, 5, 23
    h = torch.randn(N, D, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, D, generator=g, dtype=dtype) * 0.5).requires_grad_()
    index = torch.randint(0, N, (3, 7), generator=g)
    index[0, 5:] = -1
    index[2, :2] = -1
    targets = torch.randint(0, V, (3, 7), generator=g)
    kept = index >= 0
    out, ent = packed_logprob(h, w, index, targets, want_entropy=True, chunk=2, impl=impl)
    ref, rent = reference_packed_logprob(h, w, index, targets, want_entropy=True)
    assert bool((out[~kept] == 0).all()) and bool((ent[~kept] == 0).all())
    assert_close(out, ref.to(dtype), **tol)
    assert_close(ent, rent.to(dtype), **tol)
    c1, c2 = (torch.randn(out.shape, generator=g, dtype=dtype) * kept for _ in range(2))  # masked weights
    got = torch.autograd.grad((out * c1 + ent * c2).sum(), (h, w))
    want = torch.autograd.grad((ref * c1 + rent * c2).sum(), (h, w))
    for a, b in zip(got, want):
        assert_close(a, b, **tol)
    out, ent = packed_logprob(h, w, index, targets, want_entropy=True, impl=impl)
    with pytest.raises(DroppedPositionGradError, match=r"packed_logprob backward \(entropy\).*nonzero at 1 of the 4"):
        torch.autograd.grad((out * c1).sum() + ent[2, 1], (h, w))
    out, _ = packed_logprob(h, w, index, targets, impl=impl)
    with pytest.raises(DroppedPositionGradError, match="log-prob"):
        torch.autograd.grad(out.sum(), (h, w))


# ---------------------------------------------------------------------------------------------------------
# end to end


def make_model(dtype=torch.float64):
    return GPT(GPTConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48), seed=0).to(dtype)


def padded_grpo_batch(seed=1, hole=False):
    """Two groups of 3: left-padded prompts (TRL's layout), ragged right-padded responses; with ``hole``
    one prompt token of row 1 is masked out too."""
    b = make_grpo_batch(vocab_size=61, seed=seed, dtype=torch.float64, num_prompts=2, group_size=3,
                        prompt_len=(4, 9), response_len=(2, 6), left_pad_prompts=True)
    if hole:
        t = int(b["attention_mask"][1].nonzero()[1])  # the second prompt token of row 1
        b["attention_mask"][1, t] = 0
        b["input_ids"][1, t] = 0
    return b


def assert_replayed_dropping(batch, model_only=False):
    """One replayed call, which executed exactly the needed tokens: the valid distinct prefixes of a model
    compiled alone (drop_padding), the tokens grpo_loss needs (tests.helpers.grpo_needed_tokens) — fewer than
    the tree with its pads."""
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0, str(s)
    full = build_tree(batch["input_ids"], batch["attention_mask"])
    want = int(full.valid.sum()) if model_only else \
        grpo_needed_tokens(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    assert s.executed_tokens == want < full.num_tokens, str(s)


@pytest.mark.parametrize("compiler,fuse", [("inductor", True), ("aot_eager", True), ("aot_eager", False),
                                           ("eager", True), ("eager", False)])
def test_grpo_loss_exact_with_dropped_padding(compiler, fuse):
    """grpo_loss multiplies the surrogate by completion_mask[:, 1:], so the padded positions' log-probs
    (0 here) get gradient exactly 0 and the loss and grads are those of the dense eager run."""
    model = make_model()
    batch = padded_grpo_batch(hole=compiler == "eager")
    params = list(model.parameters())
    ref = grpo_loss(model, *grpo_args(batch))
    gref = torch.autograd.grad(ref, params)
    fn = torch.compile(grpo_loss, backend=brcompile.backend(compiler=compiler, fuse_logprob=fuse))
    out = fn(model, *grpo_args(batch))
    gout = torch.autograd.grad(out, params)
    assert_exact(out, ref, torch.float64, "loss")
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")
    assert_replayed_dropping(batch)


def test_streaming_replay_with_dropped_padding():
    """mode="replay" (prefix once, tails in chunks) on the dropped tree: exact, and streamed."""
    model = make_model()
    batch = padded_grpo_batch(seed=2, hole=True)
    params = list(model.parameters())
    ref = grpo_loss(model, *grpo_args(batch))
    gref = torch.autograd.grad(ref, params)
    backend = brcompile.backend(compiler="eager", mode="replay", chunk_tokens=5)
    out = torch.compile(grpo_loss, backend=backend)(model, *grpo_args(batch))
    gout = torch.autograd.grad(out, params)
    assert_exact(out, ref, torch.float64, "loss")
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")
    assert_replayed_dropping(batch)
    assert brcompile.stats().streamed_calls == 1 and backend.records[-1].runtime.calls[-1].schedule["chunks"] >= 2


def unmasked_logprob_loss(model, ids, am):
    """Reads every position's next-token log-prob, padding included: no exact gradient without pads."""
    logits = model(ids, am)
    return -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).sum()


def logits_sum(model, ids, am):
    return model(ids, am).sum()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor", "eager"])
@pytest.mark.parametrize("loss_fn", [logits_sum, unmasked_logprob_loss])
def test_loss_reading_padding_raises_in_backward(compiler, loss_fn):
    """The model compiled alone (its pads left out, drop_padding): the forward runs (padded positions read 0);
    an eager loss that reads them raises the typed error with the hint in backward."""
    model = make_model()
    batch = padded_grpo_batch()
    compiled = torch.compile(model, backend=brcompile.backend(compiler=compiler))
    out = loss_fn(compiled, batch["input_ids"], batch["attention_mask"])
    assert torch.isfinite(out)
    with pytest.raises(DroppedPositionGradError, match=f"read_packed.*padded position.*{HINT}.*drop_padding=False"):
        out.backward()
    assert brcompile.stats().replayed_calls == 1


@pytest.mark.parametrize("loss_fn", [logits_sum, unmasked_logprob_loss])
def test_loss_in_the_graph_reading_padding_keeps_it(loss_fn):
    """The same losses compiled with the model: the graph sees that they read the pads, so every position is
    live and kept (nothing left out), and the loss and gradients are the eager ones."""
    model = make_model()
    batch = padded_grpo_batch()
    args = (batch["input_ids"], batch["attention_mask"])
    params = list(model.parameters())
    ref = loss_fn(model, *args)
    gref = torch.autograd.grad(ref, params)
    out = torch.compile(loss_fn, backend=brcompile.backend(compiler="eager"))(model, *args)
    gout = torch.autograd.grad(out, params)
    assert_exact(out, ref, torch.float64, "loss")
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float64, f"grad of {name}")
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.dead_tokens == 0, str(s)


def test_model_only_logits_zero_at_padding():
    """The model alone compiled (aot_eager): logits equal at valid positions and 0 at padding, gradients of a
    masked weighting exact, a gradient into a dropped position raises. The gradients are taken twice
    (``retain_graph=True``), which AOTAutograd allows without its donated buffers (as for any torch.compile)."""
    with torch._functorch.config.patch(donated_buffer=False):
        model = make_model()
        batch = padded_grpo_batch(seed=3, hole=True)
        ids, am = batch["input_ids"], batch["attention_mask"]
        ref = model(ids, am)
        out = torch.compile(model, backend=brcompile.backend(compiler="aot_eager"))(ids, am)
        valid = am.bool()
        assert_exact(out[valid], ref[valid], torch.float64, "logits at valid positions")
        assert bool((out[~valid] == 0).all())
        assert_replayed_dropping(batch, model_only=True)
        w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * am[..., None]
        params = list(model.parameters())
        gref = torch.autograd.grad((ref * w).sum(), params, retain_graph=True)
        gout = torch.autograd.grad((out * w).sum(), params, retain_graph=True)
        for (name, _), a, b in zip(model.named_parameters(), gout, gref):
            assert_exact(a, b, torch.float64, f"grad of {name}")
        with pytest.raises(DroppedPositionGradError, match=HINT):
            torch.autograd.grad(out.sum(), params)


def test_hf_qwen2_model_path_with_dropped_padding():
    """A tiny random Qwen2 (SDPA, float64): left-padded prompts + right-padded completions, the model
    alone compiled. Logits: equal at valid positions (1e-10), 0 at padding; grads of a masked weighting
    meet the float32 bound (HF's RMSNorm computes in float32; see test_hf.py)."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    cfg = transformers.Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float64)
    batch = padded_grpo_batch(seed=5)
    ids, am = batch["input_ids"], batch["attention_mask"]

    def logits_of(ids, am):
        return model(input_ids=ids, attention_mask=am).logits

    ref = logits_of(ids, am)
    out = torch.compile(logits_of, backend=brcompile.backend(compiler="eager", drop_padding=True))(ids, am)
    valid = am.bool()
    assert_exact(out[valid], ref[valid], torch.float64, "logits at valid positions")
    assert bool((out[~valid] == 0).all())
    assert_replayed_dropping(batch, model_only=True)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64) * am[..., None]
    params = [p for p in model.parameters() if p.requires_grad]
    gref = torch.autograd.grad((ref * w).sum(), params)
    gout = torch.autograd.grad((out * w).sum(), params)
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float32, f"grad of {name}")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_hf_eager_attention_left_padding_replays_with_dropped_padding(family):
    """HF eager attention on TRL's left-padded layout: without drop_padding a padded query sees no key
    (the original's additive mask makes it uniform, tree attention 0), so the per-call guard sends such a
    batch to the original graph; with drop_padding padded positions are not computed (0 by contract), the
    guard is moot and the batch replays — Gemma2 with its soft-capped, windowed attention included.
    float32 (HF's eager softmax runs in float32)."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager")
    cfg = (transformers.LlamaConfig(**common) if family == "llama" else
           transformers.Gemma2Config(**common, head_dim=8, sliding_window=3, attn_logit_softcapping=0.5))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    batch = padded_grpo_batch(seed=7)
    ids, am = batch["input_ids"], batch["attention_mask"]
    assert bool((am[:, 0] == 0).any()), "the batch needs left padding"

    def logits_of(ids, am):
        return model(input_ids=ids, attention_mask=am).logits

    ref = logits_of(ids, am)
    out = torch.compile(logits_of, backend=brcompile.backend(compiler="eager", drop_padding=False))(ids, am)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_codes == {brcompile.Code.GUARD_QUERY_WITHOUT_KEYS: 1}, str(s)
    torch._dynamo.reset()
    brcompile.reset_stats()
    out = torch.compile(logits_of, backend=brcompile.backend(compiler="eager", drop_padding=True))(ids, am)
    valid = am.bool()
    assert_exact(out[valid], ref[valid], torch.float32, "logits at valid positions")
    assert bool((out[~valid] == 0).all())
    assert_replayed_dropping(batch, model_only=True)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(6)) * am[..., None]
    params = [p for p in model.parameters() if p.requires_grad]
    gref = torch.autograd.grad((ref * w).sum(), params)
    gout = torch.autograd.grad((out * w).sum(), params)
    for (name, _), a, b in zip(model.named_parameters(), gout, gref):
        assert_exact(a, b, torch.float32, f"grad of {name}")
