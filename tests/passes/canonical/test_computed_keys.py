"""Computed tree keys (passes/canonical/keys.py, brcompile/runtime/keys.py): token ids the graph builds along an
axis no input has, CPM-Ant's prompt ids joined before the input ids, read as inputs the runtime computes per call.

The model is CPM-Ant's construct in a few lines: P prompt ids joined before the ``[B, L]`` ids inside the model,
segment ids and the key padding joined the same way, one causal attention over the ``P + L`` positions, the
logits of the input's positions read back at ``[:, P:]``. Every end-to-end case compares the loss and every
parameter gradient with the eager original in float64 and asserts through ``brcompile.stats()`` and the runtime's
last tree that the rewrite ran: the prompt is one chain of P packed tokens at the root of the tree, computed once.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import brcompile
from brcompile.testing import assert_exact
from brcompile.passes.analysis.axes import hint
from brcompile.passes.canonical.keys import find_computed_keys, token_axis_index
from brcompile.passes.pipeline import analyse
from brcompile.passes.refusals import CannotReplay, Code
from tests.helpers import assert_replayed, capture, exact_over_batches, grouped_rows, real_next_token_loss

VOCAB = 41
P_MAX = 4  # the embedding holds VOCAB ids and P_MAX prompt ids after them (CPM-Ant's input embedding)


class PromptJoinedLM(nn.Module):
    """``P`` prompt ids joined before the input ids (``prompt`` says how they are made), a segment id per position
    (0 on the prompt, 2 on a token, 1 on padding) and the key padding (``padding``) joined to the prompt's the
    same way; token + segment embeddings -> one causal SDPA -> logits at ``[:, P:]``.

    ``prompt``: ``"arange"`` (``arange(VOCAB, VOCAB + P).repeat(B, 1)``, CPM-Ant's), ``"buffer"`` (a ``[P]`` int
    buffer expanded over the rows), ``"per_row"`` (each row's own: the sum of its ids modulo the vocabulary, a
    function of the whole row), ``"random"`` (drawn per call), ``"parameter"`` (the argmax of a trainable
    ``[P, VOCAB]`` tensor). ``padding``: ``"none"`` (``is_causal``), ``"mask"`` (``cat((ones(B, P), am), 1)``),
    ``"length"`` (CPM-Ant's left-padding mask, ``reversed(arange(L)) < (ids != 0).sum(-1)``: a count over the whole
    row)."""

    def __init__(self, P=3, prompt="arange", padding="mask", dim=16, heads=2):
        super().__init__()
        self.P, self.prompt, self.padding, self.heads = P, prompt, padding, heads
        self.emb = nn.Embedding(VOCAB + P_MAX, dim)
        self.seg = nn.Embedding(3, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, VOCAB)
        self.register_buffer("prompt_ids", torch.arange(VOCAB, VOCAB + P))
        if prompt == "parameter":
            self.prompt_logits = nn.Parameter(torch.randn(P, VOCAB))

    def prompt_of(self, ids):
        B, P = ids.size(0), self.P
        if self.prompt == "arange":
            return torch.arange(VOCAB, VOCAB + P, device=ids.device).repeat(B, 1)
        if self.prompt == "buffer":
            return self.prompt_ids[None].expand(B, P)
        if self.prompt == "per_row":
            return (ids.sum(-1, keepdim=True) % VOCAB).expand(B, P)
        if self.prompt == "random":
            return torch.randint(VOCAB, (B, P), device=ids.device)
        if self.prompt == "parameter":
            return self.prompt_logits.argmax(-1)[None].expand(B, P)
        raise ValueError(self.prompt)

    def keep(self, ids, am):
        B, L = ids.shape
        ones = torch.ones(B, self.P, dtype=torch.bool, device=ids.device)
        if self.padding == "mask":
            return torch.cat((ones, am.bool()), 1)
        length = (ids != 0).sum(-1)
        return torch.cat((ones, torch.arange(L - 1, -1, -1, device=ids.device)[None].repeat(B, 1)
                          < length[:, None]), 1)

    def forward(self, ids, am):
        B, L = ids.shape
        x = torch.cat((self.prompt_of(ids), ids), dim=1)
        segment = torch.cat((torch.zeros(B, self.P, dtype=ids.dtype, device=ids.device),
                             torch.where(ids != 0, 2, 1)), dim=1)
        h = self.emb(x) + self.seg(segment)
        q, k, v = self.qkv(h).view(B, L + self.P, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.padding == "none":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            causal = torch.ones(L + self.P, L + self.P, dtype=torch.bool, device=ids.device).tril()
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & self.keep(ids, am)[:, None, None, :])
        return self.out(o.transpose(1, 2).reshape(B, L + self.P, -1))[:, self.P:]


def make(**kw):
    torch.manual_seed(0)
    return PromptJoinedLM(**kw).double()


def run_exact(model, batches, *, dynamic=False, **options):
    """Compiled vs eager, loss and every parameter gradient, for each batch (float64); returns the backend."""
    return exact_over_batches(model, real_next_token_loss(model), batches,
                              brcompile.backend(compiler="eager", strict=True, **options), dynamic)


def assert_prompt_chain(backend, P):
    """The last call's tree holds the prompt's P columns as one chain of P packed tokens, the same in every row:
    the root of the tree, computed once."""
    rec = next(r for r in backend.records if r.rewritten)
    tree = rec.runtime.last_tree
    assert torch.equal(tree.index[:, :P], tree.index[:1, :P].expand_as(tree.index[:, :P])), tree.index
    assert sorted(tree.index[0, :P].tolist()) == list(range(P)), tree.index
    return rec, tree


# ------------------------------------------------------------------------------------------------
# which values become keys


def test_the_joined_ids_segments_and_padding_are_the_keys():
    """The embedded ids, the segments and the key padding are the token axis's frontier; the ``[B, L', L']``
    mask built from them and a value of sizes alone (``arange(L').repeat(B, 1)``) are not keys."""
    model = make(padding="length")
    ids, am = grouped_rows(0, pad=True)
    gm, _ = capture(real_next_token_loss(model), ids, am)
    index = token_axis_index(gm)
    assert index is not None and tuple(index.meta["example_value"].shape) == (ids.shape[0], ids.shape[1] + 3)
    keys = find_computed_keys(gm)
    assert [k.meta["example_value"].dtype for k in keys] == [torch.int64, torch.int64, torch.bool], keys
    assert index in keys


def test_ids_computed_along_the_inputs_axis_are_no_computed_keys():
    """``EMB(ids % V)`` keeps the ids input as its key: the embedded value lies along the input's own axis."""
    emb = nn.Embedding(VOCAB, 8).double()
    gm, _ = capture(lambda ids: emb(ids % VOCAB).sum(), torch.randint(0, VOCAB, (3, 5)))
    assert token_axis_index(gm) is None and find_computed_keys(gm) == []


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_analysis_reads_the_joined_ids_as_its_token_input(dynamic):
    """The analysed graph takes the keys after its own inputs; the key graph computes them from the inputs
    alone, equal to the values the original graph joins."""
    model = make(padding="mask")
    ids, am = grouped_rows(1, pad=False)
    gm, inputs = capture(real_next_token_loss(model), ids, am, dynamic=dynamic)
    an = analyse(gm, inputs)
    assert an.keys is not None and an.keys.inputs == len(inputs)
    placeholders = [n.name for n in an.gm.graph.nodes if n.op == "placeholder"]
    assert placeholders[-len(an.keys.names):] == list(an.keys.names)
    assert an.token_ids.name == an.keys.names[0] and set(an.tree_inputs) <= set(an.placeholders[len(inputs):])
    x, segment, keep = an.keys([hint(a) for a in inputs])  # (a dynamic capture's sizes are SymInts)
    B = ids.shape[0]
    assert torch.equal(x, torch.cat((torch.arange(VOCAB, VOCAB + 3).repeat(B, 1), ids), 1))
    assert torch.equal(segment, torch.cat((torch.zeros(B, 3, dtype=ids.dtype), torch.where(ids != 0, 2, 1)), 1))
    assert torch.equal(keep, torch.cat((torch.ones(B, 3, dtype=torch.bool), am.bool()), 1))
    assert all(info.keypad is not None for info in an.masks.values()), an.masks


# ------------------------------------------------------------------------------------------------
# end to end: exact, and the prompt computed once


@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("padding, pad", [("none", False), ("mask", False), ("mask", True), ("length", True),
                                          ("length", False)],
                         ids=["no-padding", "right-padded-mask", "left-padded-mask", "left-padding-count",
                              "left-padding-count-of-right-padded-rows"])
def test_prompt_joined_replays_exactly(P, padding, pad):
    """GRPO-like groups (rows sharing a prompt, two of each group sharing their first response tokens too), with
    and without padding: loss and every gradient equal eager's; the joined prompt is the tree's root chain.
    CPM-Ant's left-padding count reads the whole row: on right-padded rows it hides their first tokens, so rows
    sharing a prefix but not a length differ in that key there and share less; exact either way."""
    model = make(P=P, padding=padding)
    backend = run_exact(model, [grouped_rows(2, pad=pad)])
    assert_replayed()
    rec, _ = assert_prompt_chain(backend, P)
    assert rec.tree_inputs[0] == "x_key", rec.tree_inputs
    assert rec.computed_keys[0].startswith("x_key = cat [") and rec.computed_keys[0].endswith("of l_ids_"), \
        rec.computed_keys
    if padding != "none":
        assert all("keypad" in m for m in rec.masks), rec.masks


@pytest.mark.parametrize("prompt", ["buffer", "per_row"])
def test_prompts_of_other_spellings_replay_exactly(prompt):
    """A prompt read from an int buffer is the same rule; so is one computed per row from the whole row (its
    tree merges only rows whose prompts agree too: here none, since each row's sum differs)."""
    model = make(prompt=prompt)
    ids, am = grouped_rows(3, pad=False)
    backend = run_exact(model, [(ids, am)])
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0, str(s)
    tree = next(r for r in backend.records if r.rewritten).runtime.last_tree
    if prompt == "buffer":
        assert_prompt_chain(backend, 3)
        assert s.executed_tokens < s.logical_tokens, str(s)
    else:  # rows agreeing on their ids' prefix but not on their sums share no token
        firsts = tree.index[:, 0]
        sums = ids.sum(-1) % VOCAB
        assert len(set(firsts.tolist())) == len(set(sums.tolist())), (firsts, sums)


def test_ids_joined_along_the_rows_replay_exactly():
    """Constant rows joined before the batch's rows (``cat((C, ids), 0)``): the token axis is ``[R + B, L]``, the
    tree is over those rows (the R equal rows are one chain)."""
    emb, qkv = nn.Embedding(VOCAB, 8).double(), nn.Linear(8, 24).double()
    params = [*emb.parameters(), *qkv.parameters()]

    def f(ids):
        x = torch.cat((torch.arange(5, 5 + ids.size(1))[None].repeat(2, 1), ids), dim=0)
        q, k, v = qkv(emb(x)).unsqueeze(1).chunk(3, -1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)[2:].pow(2).sum()

    ids, _ = grouped_rows(4, pad=False)
    want = f(ids)
    gw = torch.autograd.grad(want, params)
    got = torch.compile(f, backend=brcompile.backend(compiler="eager"))(ids)
    gg = torch.autograd.grad(got, params)
    assert_replayed()
    assert_exact(got, want, torch.float64, "loss")
    for a, b in zip(gg, gw):
        assert_exact(a, b, torch.float64, "grad")


def test_prompt_joined_replays_at_the_aten_level():
    """``level="aten"``: the keys are lifted out of the functional ATen graph the same way (its respelled ``cat``,
    ``arange``, ``repeat``), and the call replays there."""
    model = make(padding="length")
    backend = run_exact(model, [grouped_rows(11, pad=True)], level="aten")
    assert_replayed()
    rec, _ = assert_prompt_chain(backend, 3)
    assert rec.level == "aten" and rec.tree_inputs[0].endswith("_key"), (rec.level, rec.tree_inputs)


def test_explain_shows_the_computed_keys():
    """explain(): the graph's computed keys, what each is and which inputs it reads, beside its tree inputs."""
    model = make(padding="mask")
    ids, am = grouped_rows(12, pad=False)
    report = brcompile.explain(real_next_token_loss(model), ids, am)
    (g,) = report.to_dict()["graphs"]
    B, L = ids.shape
    assert g["computed_keys"] == [f"x_key = cat [{B}, {L + 3}] of l_ids_",
                                  f"segment_key = cat [{B}, {L + 3}] of l_ids_",
                                  f"cat_2_key = cat [{B}, {L + 3}] of l_am_"], g["computed_keys"]
    assert "computed per call" in report.render_text(code=False)


def test_dynamic_shapes_compute_the_keys_of_every_batch():
    """Dynamic shapes: one compiled graph, the keys computed per call for batches of other sizes."""
    model = make(padding="mask")
    run_exact(model, [grouped_rows(5, pad=False), grouped_rows(6, pad=True, response=9)], dynamic=True)
    assert_replayed(calls=2)
    assert brcompile.stats().compiled_graphs == 1


def test_a_call_that_falls_back_runs_the_original_on_its_own_inputs():
    """A batch that shares too little runs the original graph (given the call's inputs, not the keys); with
    ``verify=True`` the first replayed call is checked against the original on its own inputs."""
    model = make(padding="mask")
    ids, am = grouped_rows(7, pad=False)
    run_exact(model, [(ids, am)], min_dedup=10.0)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_codes == {Code.SHARES_TOO_LITTLE: 1}, str(s)
    brcompile.reset_stats()
    torch._dynamo.reset()
    run_exact(model, [(ids, am)], verify=True)
    assert_replayed()


def test_streaming_replay_of_a_joined_prompt():
    """``mode="replay"``: the prompt and the shared prefixes run once as the prefix, the tails in chunks."""
    model = make(padding="mask")
    backend = run_exact(model, [grouped_rows(8, pad=False)], mode="replay", chunk_tokens=8)
    rec = next(r for r in backend.records if r.rewritten)
    assert rec.replay is not None, rec.replay_reason
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.streamed_calls == 1 and s.fallback_calls == 0, str(s)


# ------------------------------------------------------------------------------------------------
# refused: the embedded ids are not a function of the inputs alone


@pytest.mark.parametrize("prompt, what", [("random", "draws random numbers"), ("parameter", "reads the parameter")])
def test_ids_joined_to_values_not_computed_from_the_inputs_are_refused(prompt, what):
    """A prompt drawn at random (a key graph run apart would draw other numbers) or read off a trainable tensor:
    no key of the inputs alone, refused naming the node."""
    model = make(prompt=prompt)
    ids, am = grouped_rows(9, pad=False)
    gm, inputs = capture(real_next_token_loss(model), ids, am)
    with pytest.raises(CannotReplay, match=what) as e:
        analyse(gm, inputs)
    assert e.value.code is Code.JOINED_TOKEN_IDS


def test_ids_joined_to_a_parameter_fall_back_exactly():
    """End to end, the refused graph runs unchanged: loss and gradients exact, one fallback under its code (the
    prompt's tensor gets no gradient through its argmax, in either run)."""
    model = make(prompt="parameter")
    fn = real_next_token_loss(model)
    ids, am = grouped_rows(10, pad=False)
    params = list(model.parameters())
    want = fn(ids, am)
    gw = torch.autograd.grad(want, params, allow_unused=True)
    got = torch.compile(fn, backend=brcompile.backend(compiler="eager"))(ids, am)
    gg = torch.autograd.grad(got, params, allow_unused=True)
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_codes == {Code.JOINED_TOKEN_IDS: 1}, str(s)
    assert_exact(got, want, torch.float64, "loss")
    for a, b in zip(gg, gw):
        assert (a is None) == (b is None) and (b is None or torch.equal(a, b))
