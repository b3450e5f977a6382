"""Scans along the token axis end to end (passes/analysis/rules/scan.py): ``cumsum`` positions and the causal
depthwise "short conv" run along the tree paths (``brcompile::tree_cumsum`` / ``tree_causal_conv1d``).

Every replay test compares the loss and every parameter gradient with the eager model in float64
(``brcompile.testing.TOLERANCE``) and asserts that the call replayed, that the packed graph holds the scan
op, and that nothing was materialised before the attentions. Constructs that are not causal scans fall back
(dense, or the original graph) with the reason.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import brcompile
from brcompile.testing import TOLERANCE, assert_exact
from examples.grpo import make_grpo_batch
from tests.helpers import assert_replayed

F64 = torch.float64
EAGER = dict(compiler="eager")


# --------------------------------------------------------------------------------------------------
# a GPT-like model: cumsum positions, a causal short-conv mixer before attention


class ShortConv(nn.Module):
    """LFM2 / Mamba's gated short conv: ``B, C, x = in_proj(h).chunk(3)``, a causal depthwise conv of
    ``B * x`` along the tokens, ``C *`` it, ``out_proj``. ``spelling``: ``"padded"`` —
    ``nn.Conv1d(padding=W-1)`` then ``[..., :L]`` (HF's); ``"negative"`` — ``[..., :-(W-1)]``;
    ``"left_pad"`` — ``F.pad(x, (W-1, 0))`` then a conv without padding; ``"symmetric"`` — padding
    ``(W-1)//2`` both sides (not causal); ``"shifted"`` — ``[..., W-1:]`` (reads later tokens)."""

    def __init__(self, D: int, W: int = 4, spelling: str = "padded"):
        super().__init__()
        self.W, self.spelling = W, spelling
        self.in_proj = nn.Linear(D, 3 * D)
        pad = {"left_pad": 0, "symmetric": (W - 1) // 2}.get(spelling, W - 1)
        self.conv = nn.Conv1d(D, D, W, groups=D, padding=pad, bias=True)
        self.out_proj = nn.Linear(D, D)

    def forward(self, h):
        L = h.shape[1]
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        bx = (b * x).transpose(1, 2)  # [B, D, L]
        if self.spelling == "left_pad":
            y = self.conv(F.pad(bx, (self.W - 1, 0)))
        elif self.spelling == "negative":
            y = self.conv(bx)[..., :-(self.W - 1)]
        elif self.spelling == "shifted":
            y = self.conv(bx)[..., self.W - 1:]
        elif self.spelling == "symmetric":
            y = self.conv(bx)
        else:
            y = self.conv(bx)[..., :L]
        return self.out_proj(c * y.transpose(1, 2))


class ScanGPT(nn.Module):
    """Token embedding + learned positions from ``cumsum(mask)`` (RoBERTa's spelling, so left-padded rows
    count from their first real token), then per block a short conv mixer and causal attention with key
    padding, both residual."""

    def __init__(self, V=23, D=8, H=2, layers=2, W=4, spelling="padded", pad_id=0):
        super().__init__()
        self.pad_id, self.H = pad_id, H
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Embedding(32, D)
        self.convs = nn.ModuleList(ShortConv(D, W, spelling) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(D, 3 * D) for _ in range(layers))
        self.head = nn.Linear(D, V)

    def forward(self, ids, am):
        B, L = ids.shape
        mask = am.int()
        positions = (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + self.pad_id
        h = self.emb(ids) + self.pos(positions)
        causal = torch.ones(L, L, dtype=torch.bool, device=ids.device).tril()
        attn_mask = causal[None, None] & am.bool()[:, None, None, :]
        for conv, qkv in zip(self.convs, self.qkv):
            h = h + conv(h)
            q, k, v = qkv(h).view(B, L, 3, self.H, -1).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            h = h + o.transpose(1, 2).reshape(B, L, -1)
        return self.head(h)


def grpo_like_batch(seed=1, left=True):
    """Two prompt groups of 3 rollouts, ragged prompts (left-padded) and right-padded responses."""
    b = make_grpo_batch(vocab_size=23, seed=seed, num_prompts=2, group_size=3, prompt_len=(4, 7),
                        response_len=(2, 5), left_pad_prompts=left, pad_id=0)
    return b["input_ids"], b["attention_mask"], b["completion_mask"]


def token_loss(model, ids, am, cm):
    """Masked next-token NLL of the completion tokens (a dense loss over the packed logits)."""
    lp = model(ids, am)[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = cm[:, 1:].to(lp.dtype)
    return -(lp * m).sum() / m.sum()


#: a gradient below this fraction of the model's largest is rounding noise around an exact 0 (RoBERTa's key
#: bias: a constant added to every score of a query leaves its softmax unchanged)
ZERO_GRAD = 1e-12


def run_exact(model, fn, args, *, dynamic=False, **options):
    """Eager vs compiled ``fn(*args)`` in float64: the loss and every parameter gradient (relative error; a
    gradient that is 0 up to rounding, ``ZERO_GRAD``, is held to the bound relative to the largest gradient
    of the model instead of its own noise); returns the backend (its records say what the rewrite did)."""
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    want = fn(*args)
    gw = torch.autograd.grad(want, params, allow_unused=True)
    backend = brcompile.backend(**{**EAGER, **options})
    got = torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    gg = torch.autograd.grad(got, params, allow_unused=True)
    assert_exact(got, want, F64, "loss")
    scale = max(b.abs().max().item() for b in gw if b is not None)
    for name, a, b in zip(names, gg, gw):
        if b is None:
            assert a is None or not a.abs().max().item(), f"grad of {name}: eager has none"
            continue
        if b.abs().max().item() <= ZERO_GRAD * scale:
            assert (a - b).abs().max().item() <= TOLERANCE[F64] * scale, f"grad of {name}: not 0"
            continue
        assert_exact(a, b, F64, f"grad of {name}")
    return backend


def packed_code(backend) -> str:
    recs = [r for r in backend.records if r.rewritten]
    assert recs, [r.reason for r in backend.records]
    return "\n".join(r.packed_code for r in recs)


def scan_model(spelling="padded", seed=0, **kw):
    torch.manual_seed(seed)
    return ScanGPT(spelling=spelling, **kw).to(F64)


@pytest.mark.parametrize("spelling,dynamic", [("padded", False), ("negative", True), ("left_pad", False),
                                              ("padded", True)])
def test_short_conv_and_cumsum_positions_replay(spelling, dynamic):
    """Both scans run packed along the tree paths, in each spelling of the conv's causal padding, static
    and dynamic shapes; loss and every gradient (conv weights and biases included) equal eager's."""
    model = scan_model(spelling)
    backend = run_exact(model, functools.partial(token_loss, model), grpo_like_batch(), dynamic=dynamic)
    assert_replayed()
    code = packed_code(backend)
    assert "brcompile.tree_causal_conv1d" in code and "brcompile.tree_cumsum" in code, code
    assert "conv1d(" not in code.replace("tree_causal_conv1d(", ""), "a dense conv is left in the packed graph"
    rec = next(r for r in backend.records if r.rewritten)
    assert all("conv" not in node and "cumsum" not in node for node, *_ in rec.materialisations), \
        rec.materialisations


def test_short_conv_without_padding_rows():
    """No attention mask bits at 0: every row a full path from the root (width 4 crosses the branch points)."""
    model = scan_model("padded", W=5, layers=1)  # one block: the rows' conv windows are what is tested
    ids, am, cm = grpo_like_batch(seed=3, left=False)
    run_exact(model, functools.partial(token_loss, model), (ids, torch.ones_like(am), cm))
    assert_replayed()


@pytest.mark.parametrize("spelling,reason", [
    ("symmetric", "only the causal conv"),
    ("shifted", "other than [..., :L]"),
])
def test_non_causal_conv_is_refused_with_the_reason(spelling, reason):
    """A conv that reads later tokens is computed dense; the attention after it then cannot run packed,
    and the graph falls back naming the conv's problem (the result is still eager's)."""
    model = scan_model(spelling, W=3, layers=1)  # symmetric padding 1 keeps L outputs; the first conv refuses
    backend = run_exact(model, functools.partial(token_loss, model), grpo_like_batch())
    s = brcompile.stats()
    assert s.replayed_calls == 0 and s.fallback_calls == 1, str(s)
    assert [r.code for r in backend.records if not r.rewritten] == [brcompile.Code.ATTENTION_UNPACKED], \
        [r.reason for r in backend.records]
    assert any(reason in (r.reason or "") for r in backend.records), [r.reason for r in backend.records]  # the conv


def test_scans_keep_the_padding_they_read():
    """A tree path that skips the left padding would skip values the dense scans read, so a graph with scans
    keeps every position before a row's last needed one (left pads included) and leaves out only what follows
    it (the right pads, each row's last token): exact, and exactly that many tokens run."""
    from tests.helpers import grpo_needed_tokens

    model = scan_model("padded", layers=1)
    ids, am, cm = grpo_like_batch()
    backend = run_exact(model, functools.partial(token_loss, model), (ids, am, cm))
    s = brcompile.stats()
    assert s.replayed_calls == 1 and s.fallback_calls == 0, str(s)
    assert s.executed_tokens == grpo_needed_tokens(ids, am, cm, keys_hidden=False) \
        > grpo_needed_tokens(ids, am, cm), str(s)
    rec = next(r for r in backend.records if r.rewritten)
    assert "positions before a row's last live one kept" in rec.liveness, rec.liveness


def test_streaming_split_runs_path_scans_against_the_cached_prefix():
    """mode="replay": a chunk of tails reads its tokens' ancestors in the prefix from the cached scan values
    (the cumsum's path sums, the conv's inputs; tests/runtime/test_streaming_scans.py has the details)."""
    model = scan_model("padded", layers=1)
    backend = run_exact(model, functools.partial(token_loss, model), grpo_like_batch(), mode="replay",
                        chunk_tokens=4)
    assert brcompile.stats().streamed_calls == 1, str(brcompile.stats())
    rec = next(r for r in backend.records if r.rewritten)
    assert rec.replay_reason is None and len(rec.replay["cached_scans"]) == 2, rec.replay_reason


class CumsumFeatures(nn.Module):
    """A running mean of the hidden states along the tokens (``cumsum / count``) mixed into the queries:
    a floating-point cumsum of a row-bearing value with gradients."""

    def __init__(self, V=23, D=8):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.proj = nn.Linear(D, D)

    def forward(self, ids, am, cm):
        h = self.proj(self.emb(ids))
        count = torch.arange(1, ids.shape[1] + 1, dtype=h.dtype)[None, :, None]
        run = h.cumsum(dim=1) / count
        q = (h + run).unsqueeze(1)
        o = F.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1)
        return (o.square().sum(-1) * cm).sum()


def test_float_cumsum_of_hidden_states_replays():
    torch.manual_seed(0)
    model = CumsumFeatures().to(F64)
    ids, _, cm = grpo_like_batch(left=False)
    backend = run_exact(model, model, (ids, None, cm))
    assert_replayed()
    assert "brcompile.tree_cumsum" in packed_code(backend)


# --------------------------------------------------------------------------------------------------
# HuggingFace: RoBERTa-family decoders and OPT (positions from a cumsum of the mask)


def hf_model(family: str):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    # one layer: the cumsum positions are the embeddings' (before any layer); the layers repeat one attention
    tiny = dict(vocab_size=61, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=128, pad_token_id=0, attn_implementation="sdpa")
    if family == "opt":
        cfg = transformers.OPTConfig(**tiny, ffn_dim=48, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)
    else:
        cls = {"roberta": "RobertaConfig", "camembert": "CamembertConfig", "xlm-roberta": "XLMRobertaConfig",
               "data2vec-text": "Data2VecTextConfig", "roberta-prelayernorm": "RobertaPreLayerNormConfig"}[family]
        cfg = getattr(transformers, cls)(**tiny, intermediate_size=48, is_decoder=True, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(F64)


def hf_loss(model, ids, am, cm):
    logits = model(input_ids=ids, attention_mask=am).logits[:, :-1]
    lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = cm[:, 1:].to(lp.dtype)
    return -(lp * m).sum() / m.sum()


def hf_batch(seed=1):
    b = make_grpo_batch(vocab_size=61, seed=seed, num_prompts=2, group_size=3, prompt_len=(4, 7),
                        response_len=(2, 5), left_pad_prompts=True, pad_id=0)
    return b["input_ids"], b["attention_mask"], b["completion_mask"]


@pytest.mark.parametrize("family,dynamic", [
    ("roberta", False), ("opt", True),
    pytest.param("camembert", True, marks=pytest.mark.slow),
    pytest.param("xlm-roberta", False, marks=pytest.mark.slow),
    pytest.param("data2vec-text", True, marks=pytest.mark.slow),
    pytest.param("roberta-prelayernorm", False, marks=pytest.mark.slow),
])
def test_hf_cumsum_position_models_replay(family, dynamic):
    """RoBERTa-family decoders (``RobertaForCausalLM`` & co. with ``is_decoder=True``: positions
    ``cumsum(ids != pad) * mask + pad``) and OPT (``cumsum(attention_mask) * mask - 1``), left-padded
    prompts: loss and every gradient equal eager's in float64 (no float32 norm in these models)."""
    model = hf_model(family)
    backend = run_exact(model, functools.partial(hf_loss, model), hf_batch(), dynamic=dynamic)
    assert_replayed()
    assert "brcompile.tree_cumsum" in packed_code(backend)


def test_hf_lfm2_short_conv_replays(monkeypatch):
    """HF LFM2 (a conv layer — ``in_proj`` → ``B * x`` → ``nn.Conv1d(groups=C, padding=W-1)`` reached
    through ``causal_conv1d_fn``'s PyTorch path, ``[:, :, :seq_len]`` → ``C *`` → ``out_proj`` — then an
    attention layer), left-padded prompts, ``use_cache=False`` (the conv-state cache writes in place). Its
    RMSNorm runs in float64 (the norm's own float32 cast would bound the gradients at the float32 level,
    tests/models/test_hf.py), so every gradient meets the float64 bound."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    lfm2 = pytest.importorskip("transformers.models.lfm2.modeling_lfm2")
    from tests.helpers import rmsnorm_in_input_dtype
    monkeypatch.setattr(lfm2.Lfm2RMSNorm, "forward", rmsnorm_in_input_dtype)
    cfg = transformers.Lfm2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  layer_types=["conv", "full_attention"], pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(F64)

    def loss(ids, am, cm):
        logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits[:, :-1]
        lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = cm[:, 1:].to(lp.dtype)
        return -(lp * m).sum() / m.sum()

    backend = run_exact(model, loss, hf_batch())
    assert_replayed()
    assert "brcompile.tree_causal_conv1d" in packed_code(backend)


def test_padding_free_graph_keeps_scans_dense():
    """In a padding-free graph the tree is over the sequences packed into each row (their attentions are
    causal within them, ``MaskInfo.sequences``), while a cumsum or conv along the row crosses from one
    sequence into the next: the scans stay dense, naming the sequences' input."""
    from brcompile.passes.analysis.axes import AxesContext, get_axes, propagate
    from brcompile.passes.analysis.masks import MaskInfo

    class Scans(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(23, 4)
            self.conv = nn.Conv1d(4, 4, 3, groups=4, padding=2)

        def forward(self, ids, pos):
            h = self.emb(ids) * (pos[..., None] >= 0)  # the position ids are a tree input
            return h.cumsum(1), self.conv(h.transpose(1, 2))[..., :ids.shape[1]]

    graphs = {}

    def grab(gm, example_inputs):
        graphs["gm"] = gm
        return gm.forward

    ids, pos = torch.randint(0, 23, (2, 6)), torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)
    torch._dynamo.reset()
    torch.compile(Scans().to(F64), backend=grab, fullgraph=True)(ids, pos)
    gm = graphs["gm"]
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ids_node, pos_node = (next(n for n in ph if n.name.endswith(s)) for s in ("ids_", "pos_"))
    outs_node = next(n for n in gm.graph.nodes if n.op == "output")
    for sequences, want in ((None, "token"), (pos_node, "dense")):
        ctx = AxesContext(gm, 2, 6, [ids_node, pos_node], set())
        if sequences is not None:
            # the meaning the masks stage notes on an attention (this graph has none: any node carries it)
            ctx.set_note(outs_node, MaskInfo("causal+sequences", sequences=sequences))
        propagate(ctx)
        outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        assert [get_axes(o).kind.value for o in outs] == [want, want], [m.reason for m in ctx.materialised.values()]
        if sequences is not None:
            assert all("padding-free" in m.reason and pos_node.name in m.reason for m in ctx.materialised.values()
                       if m.user.op != "output"), [m.reason for m in ctx.materialised.values()]
