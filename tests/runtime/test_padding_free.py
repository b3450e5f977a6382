"""Padding-free batches: several sequences concatenated in one row, ``position_ids`` restarting at 0.

TRL's ``padding_free=True``, verl's remove-padding and similar stacks feed a model ``input_ids [R, T]`` with
the rollouts of a batch concatenated in R rows and ``position_ids`` counting 0, 1, 2, ... per sequence, no
attention mask; HF then masks attention to each sequence (``transformers.masking_utils``: packed-sequence
mask from the position ids). The shared prompts sit inside one row, so the tree is built over the
sequences, not the rows (docs/ARCHITECTURE.md §4 "Packed sequences", §8).

Every test compares with the same function run eagerly (loss and every parameter gradient; float64 with
the RMSNorms in float64: 1e-10) and asserts through ``brcompile.stats()`` that the packed graph ran, with
exactly the executed tokens of the padded layout of the same rollouts (whose padding is dropped) — or that
it fell back with the expected reason.
"""
import functools

import pytest
import torch

import brcompile
from brcompile.runtime.tree import build_sequence_tree, build_tree, drop_padding, sequence_layout_problem
from brcompile.testing import assert_exact, assert_subtree_ranges

from tests.helpers import assert_replayed, grpo_needed_tokens, hf_tiny_model

EAGER_ONLY = brcompile.backend(compiler="eager")
VOCAB = 61


def make_model(family: str, impl: str = "sdpa", dtype=torch.float64):
    """A tiny HF ``family`` model (skips without transformers)."""
    return hf_tiny_model(family, impl, dtype)


# --------------------------------------------------------------------------------------------------
# the rollouts and their two layouts


def rollouts(seed=1):
    """2 prompts x 3 responses of different lengths (GRPO); two responses of group 0 share their first
    token. Returns ([(ids, completion mask)] per rollout, in group order)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (5, 6)]
    lengths = [(3, 4, 2), (2, 3, 3)]
    out = []
    for p, lens in zip(prompts, lengths):
        responses = [torch.randint(1, VOCAB, (n,), generator=g) for n in lens]
        if len(out) == 0:
            responses[1][0] = responses[0][0]
        for r in responses:
            out.append((torch.cat([p, r]), torch.cat([torch.zeros(len(p), dtype=torch.long),
                                                      torch.ones(len(r), dtype=torch.long)])))
    return out


def padded_layout(seqs):
    """[6, L_max] right-padded rows with an attention mask (pad id 0)."""
    L = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    am, cm = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, (x, c) in enumerate(seqs):
        ids[b, :len(x)], am[b, :len(x)], cm[b, :len(x)] = x, 1, c
    return ids, am, cm


def padding_free_layout(seqs, rows):
    """``rows`` rows, each the concatenation of its sequences (``rows``: lists of rollout numbers, equal
    total lengths), position ids 0, 1, ... per sequence; no padding, no attention mask."""
    ids, pos, cm = [], [], []
    for which in rows:
        ids.append(torch.cat([seqs[i][0] for i in which]))
        pos.append(torch.cat([torch.arange(len(seqs[i][0])) for i in which]))
        cm.append(torch.cat([seqs[i][1] for i in which]))
    assert len({len(r) for r in ids}) == 1, "rows of a padding-free layout must have one length here"
    return torch.stack(ids), torch.stack(pos), torch.stack(cm)


#: one row holding all six rollouts; two rows mixing the groups (each prompt appears in both rows)
LAYOUTS = {"one_row": [[0, 1, 2, 3, 4, 5]], "two_rows": [[0, 3, 1], [4, 2, 5]]}


# --------------------------------------------------------------------------------------------------
# the functions that get compiled


def next_token_loss(model, ids, pos, am, cm):
    """Masked mean NLL of the completion tokens (logits[:, :-1] -> log_softmax -> gather). In a
    padding-free row the last token of a sequence "predicts" the next sequence's first token, a prompt
    token whose completion-mask bit is 0."""
    kw = dict(input_ids=ids, use_cache=False)
    if pos is not None:
        kw["position_ids"] = pos
    if am is not None:
        kw["attention_mask"] = am
    logits = model(**kw).logits[:, :-1]
    lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = cm[:, 1:].to(lp.dtype)
    return -(lp * m).sum() / m.sum()


def check_loss_and_grads(model, fn, args, compiled, tol):
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    ref = fn(*args)
    gref = torch.autograd.grad(ref, params, allow_unused=True)
    out = compiled(*args)
    gout = torch.autograd.grad(out, params, allow_unused=True)
    assert_exact(out, ref, tol, "loss")
    for name, a, b in zip(names, gout, gref):
        if b is None:
            assert a is None or not a.abs().max().item(), f"grad of {name}: eager has none"
            continue
        assert_exact(a, b, tol, f"grad of {name}")


def run_layout(model, args, backend=EAGER_ONLY, tol=torch.float64, dynamic=False):
    """Eager vs compiled on one layout; returns the stats of the compiled call."""
    fn = functools.partial(next_token_loss, model)
    brcompile.reset_stats()
    check_loss_and_grads(model, fn, args, torch.compile(fn, backend=backend, dynamic=dynamic), tol)
    return brcompile.stats()


def padded_executed_tokens(model, seqs):
    """Executed tokens of the padded layout of the same rollouts: the needed ones (tests.helpers.grpo_needed_tokens,
    asserted), the distinct prefixes the loss reads."""
    ids, am, cm = padded_layout(seqs)
    torch._dynamo.reset()
    s = run_layout(model, (ids, None, am, cm), backend=EAGER_ONLY)
    assert s.executed_tokens == grpo_needed_tokens(ids, am, cm), str(s)
    assert_replayed(s=s)
    torch._dynamo.reset()
    return s.executed_tokens


# --------------------------------------------------------------------------------------------------
# end to end


@pytest.mark.parametrize("family,layout,mode", [
    ("llama", "one_row", "packed"),
    ("llama", "two_rows", "replay"),  # streaming replay: the shared prompts cached, the tails in chunks
    ("qwen2", "one_row", "packed"),
    pytest.param("qwen2", "two_rows", "packed", marks=pytest.mark.slow),
])
def test_padding_free_replays_exactly(float64_norms, family, layout, mode):
    """SDPA, float64: loss and every gradient to 1e-10; the rewrite ran, with the padded layout's dedup; the
    masks were classified causal within sequences and the tree was built over the six sequences."""
    model = make_model(family)
    seqs = rollouts()
    ids, pos, cm = padding_free_layout(seqs, LAYOUTS[layout])
    backend = brcompile.backend(compiler="eager", mode=mode, chunk_tokens=8)
    s = run_layout(model, (ids, pos, None, cm), backend=backend)
    assert_replayed(s=s)
    (rec,) = backend.records
    assert rec.rewritten, rec.reason
    assert rec.masks and all("causal+sequences(" in m for m in rec.masks), rec.masks
    if mode == "packed":
        assert rec.runtime.last_tree.packed_sequences and rec.runtime.last_tree.stats.sequences == 6
    assert s.streamed_calls == (mode == "replay"), str(s)
    assert s.logical_tokens == ids.numel()
    # the distinct prefixes: 2 prompts (11 tokens) + 17 response tokens - 1 shared first response token
    assert s.executed_tokens == 27, str(s)
    if layout == "one_row":  # the padded layout of the same rollouts: its needed tokens (passes/analysis/liveness.py),
        # fewer by the 6 sequences' last tokens, which predict nothing (padding-free batches keep every token)
        assert padded_executed_tokens(model, seqs) == 27 - 6


@pytest.mark.slow
def test_padding_free_dynamic_two_batches(float64_norms):
    """dynamic=True: one captured graph replays a one-row and a two-row padding-free batch of other lengths."""
    model = make_model("llama")
    fn = functools.partial(next_token_loss, model)
    compiled = torch.compile(fn, backend=EAGER_ONLY, dynamic=True)
    for seed, rows in ((1, LAYOUTS["one_row"]), (2, LAYOUTS["two_rows"])):
        ids, pos, cm = padding_free_layout(rollouts(seed), rows)
        check_loss_and_grads(model, fn, (ids, pos, None, cm), compiled, torch.float64)
    s = brcompile.stats()
    assert s.replayed_calls == 2 and s.fallback_calls == 0, str(s)


def test_padding_free_eager_attention():
    """HF's eager attention (float32: its softmax is float32) on a packed-sequence mask: canonicalised to
    SDPA, classified causal within sequences, replayed to the float32 bound."""
    model = make_model("llama", impl="eager", dtype=torch.float32)
    ids, pos, cm = padding_free_layout(rollouts(), LAYOUTS["two_rows"])
    assert_replayed(s=run_layout(model, (ids, pos, None, cm), tol=torch.float32))


# --------------------------------------------------------------------------------------------------
# fallbacks


def test_malformed_position_ids_fall_back():
    """Position ids that do not start every sequence at 0 (a row starting at 3) or that jump inside one
    (0, 1, 2, 5, ...): the packed-sequence guard refuses each call, the original graph runs (exact). One
    compile serves both calls: the guard is per call."""
    model = make_model("llama")
    fn = functools.partial(next_token_loss, model)
    compiled = torch.compile(fn, backend=EAGER_ONLY)
    ids, good, cm = padding_free_layout(rollouts(), LAYOUTS["one_row"])
    compiled(ids, good.clone(), None, cm)  # compiles (and replays) on well-formed position ids
    for bad in ("offset", "gap"):
        brcompile.reset_stats()
        pos = good.clone()
        if bad == "offset":
            pos[0, :8] += 3
        else:
            pos[0, 3:8] += 2
        ref = fn(ids, pos, None, cm)
        out = compiled(ids, pos, None, cm)
        assert_exact(out, ref, torch.float64, f"loss ({bad})")
        s = brcompile.stats()
        assert s.replayed_calls == 0 and s.fallback_calls == 1, f"{bad}: {s}"
        assert s.fallback_codes == {brcompile.Code.GUARD_SEQUENCES: 1}, f"{bad}: {s}"


def test_column_dependent_value_is_refused():
    """A padding-free graph whose token values read the column (``arange(L)`` outside the masks) cannot
    share a token across columns: refused at compile time, with the reason."""
    model = make_model("llama")

    def fn(ids, pos, cm):
        L = ids.shape[1]
        emb = model.get_input_embeddings()(ids)
        col = torch.arange(L, dtype=emb.dtype)[:, None]  # [L, 1]: the column, a position-only token value
        logits = model(inputs_embeds=emb * (1 + col / L), position_ids=pos, use_cache=False).logits
        return logits.sum()

    ids, pos, cm = padding_free_layout(rollouts(), LAYOUTS["one_row"])
    backend = brcompile.backend(compiler="eager")
    ref = fn(ids, pos, cm)
    out = torch.compile(fn, backend=backend)(ids, pos, cm)
    assert_exact(out, ref, torch.float64, "output")
    (rec,) = backend.records
    assert not rec.rewritten and rec.code is brcompile.Code.PACKED_SEQUENCES, rec.reason


# --------------------------------------------------------------------------------------------------
# the sequence tree


def _random_packed(g, B, L, p_start=0.35, vocab=3):
    starts = torch.rand(B, L, generator=g) < p_start
    starts[:, 0] = True
    t = torch.arange(L).expand(B, L)
    pos = t - torch.where(starts, t, 0).cummax(1).values
    return torch.randint(0, vocab, (B, L), generator=g), pos


def test_sequence_tree_brute_force():
    """Two positions share a packed token iff their sequences agree up to them; (rep_row, position) is the
    token's first occurrence; k <= q < end[k] iff k is a prefix of q's sequence."""
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        B, L = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        ids, pos = _random_packed(g, B, L)
        tree = build_sequence_tree([ids, pos], pos)
        key = {(b, c): tuple(int(ids[b, u]) for u in range(c - int(pos[b, c]), c + 1))
               for b in range(B) for c in range(L)}
        by_key = {}
        for (b, c), k in key.items():
            by_key.setdefault(k, set()).add(int(tree.index[b, c]))
        assert all(len(v) == 1 for v in by_key.values()) and len(by_key) == tree.num_tokens
        of_token = {int(tree.index[b, c]): k for (b, c), k in key.items()}
        for k in range(tree.num_tokens):
            r, c = int(tree.rep_row[k]), int(tree.position[k])
            assert int(tree.index[r, c]) == k
            assert r == min(b for (b, cc) in key if int(tree.index[b, cc]) == k)
        end = tree.end.tolist()
        assert_subtree_ranges(tree.parent.tolist(), end)
        for q in range(tree.num_tokens):
            anc = {k for k in range(tree.num_tokens) if k <= q < end[k]}
            assert anc == {k for k, v in of_token.items() if of_token[q][:len(v)] == v}
        assert tree.stats.sequences == int((pos == 0).sum()) and tree.packed_sequences


def test_sequence_tree_equals_padded_tree():
    """The sequences of a padding-free layout give the tree of their padded layout with its padding dropped
    (same N, same segments count)."""
    seqs = rollouts()
    ids, am, _ = padded_layout(seqs)
    padded = drop_padding(build_tree(ids, am))
    for rows in LAYOUTS.values():
        pids, pos, _ = padding_free_layout(seqs, rows)
        tree = build_sequence_tree([pids, pos], pos)
        assert tree.num_tokens == padded.num_tokens and tree.stats.segments == padded.stats.segments
        assert tree.stats.dedup_ratio == pids.numel() / tree.num_tokens


def test_sequence_layout_problem():
    assert sequence_layout_problem(torch.tensor([[0, 1, 2, 0, 1, 0]])) is None
    assert "row 0, column 0: 1" in sequence_layout_problem(torch.tensor([[1, 2, 3]]))
    assert "column 2: 3 after 1" in sequence_layout_problem(torch.tensor([[0, 1, 3]]))
    assert "column 1: 0" not in (sequence_layout_problem(torch.tensor([[0, 0, 0]])) or "")
    assert "not a non-empty integer" in sequence_layout_problem(torch.zeros(2, 3))
    # one long sequence among many one-token ones: the [S, L_max] layout is too large
    long_row = torch.cat([torch.arange(300), torch.zeros(300, dtype=torch.long)])[None]
    assert "too uneven" in sequence_layout_problem(long_row)
