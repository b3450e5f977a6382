"""Token-axis rules, tested two ways:

1. a table of small functions with the fact their result must get;
2. a semantic oracle: every value the analysis calls TOKEN really is causal and row-independent — it is
   recomputed on batches that agree with the original only on a prefix of one row (or copy that prefix
   into another row), and its entries on that prefix must not change (or must match across rows).
"""
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from brcompile.passes.analysis.axes import AxesContext, get_axes, propagate
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.analysis.tree_inputs import find_token_ids
from brcompile.passes.pipeline import analyse
from brcompile.passes.meta import AXES
from examples.gpt import GPT, GPTConfig
from tests.helpers import capture

B, L, V, D = 3, 7, 23, 8


def facts(fn, *args):
    """Propagate facts with the token ids (first [B, L] integer placeholder) as the only tree input."""
    gm, inputs = capture(fn, *args)
    ctx = AxesContext(gm, B, L, [find_token_ids(gm)], set())
    propagate(ctx)
    result = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    return get_axes(result), ctx


EMB = torch.nn.Embedding(V, D).double()
W = torch.nn.Parameter(torch.randn(5, D, dtype=torch.float64))
POS_TABLE = torch.nn.Parameter(torch.randn(L, D, dtype=torch.float64))  # absolute positions by slot
ROW_TABLE = torch.nn.Parameter(torch.randn(B, 1, D, dtype=torch.float64))  # a constant indexed by row
BIAS = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
FLAT_TABLE = torch.nn.Parameter(torch.randn(B * L, 5, dtype=torch.float64))  # a constant per flattened token
CONV = torch.nn.Conv1d(D, D, 3, groups=D, padding=2).double()  # a causal short conv: [..., :L] of it
CONV0 = torch.nn.Conv1d(D, D, 3, groups=D).double()  # after F.pad(x, (2, 0))

def _buffer(t):  # a constant the way Dynamo sees a module buffer (a static input)
    return torch.nn.Parameter(t, requires_grad=False)


COS = _buffer(torch.randn(2 * L, D, dtype=torch.float64))  # a [T_max, hs] rotary cache
INV_FREQ = _buffer(torch.rand(D // 2, dtype=torch.float64))
ROW_FREQ = _buffer(torch.rand(B, D // 2, 1, dtype=torch.float64))  # a per-row constant, not a broadcast
EXPERT_W = torch.nn.Parameter(torch.randn(4, 3, D, dtype=torch.float64))  # 4 experts' [3, D] weights
ROUTER = torch.nn.Parameter(torch.randn(4, D, dtype=torch.float64))
FREQS_CIS = _buffer(torch.polar(torch.ones(L, D // 2, dtype=torch.float64),
                                torch.randn(L, D // 2, dtype=torch.float64)))

TABLE = [
    ("embedding", lambda ids: EMB(ids), "token(row=0, pos=1)"),
    ("view_transpose", lambda ids: EMB(ids).view(B, L, 2, -1).transpose(1, 2), "token(row=0, pos=2)"),
    ("permute", lambda ids: EMB(ids).permute(2, 1, 0), "token(row=2, pos=1)"),
    ("unsqueeze_expand", lambda ids: EMB(ids)[:, :, None].expand(B, L, 3, D), "token(row=0, pos=1)"),
    ("mean_last", lambda ids: EMB(ids).pow(2).mean(-1, keepdim=True).rsqrt(), "token(row=0, pos=1)"),
    ("mean_rows", lambda ids: EMB(ids).mean(0), "dense"),
    ("sum_positions", lambda ids: EMB(ids).sum(1), "dense"),
    ("softmax_last", lambda ids: torch.softmax(EMB(ids), -1), "token(row=0, pos=1)"),
    ("softmax_positions", lambda ids: torch.softmax(EMB(ids), 1), "dense"),
    ("linear", lambda ids: F.linear(EMB(ids), W), "token(row=0, pos=1)"),
    ("shift_slice", lambda ids: EMB(ids)[:, :-1], "token(row=0, pos=1)"),
    # flattening the leading (row, position) dims: a flattened token value (rules/moe.py), and back
    ("merge_token_dims", lambda ids: EMB(ids).reshape(B * L, D), "token(row=None, pos=0, flat=1)"),
    ("merge_token_dims_inner", lambda ids: EMB(ids).reshape(B * L * 2, D // 2), "token(row=None, pos=0, flat=2)"),
    ("flatten_unflatten", lambda ids: F.linear(EMB(ids).view(-1, D), W).reshape(B, L, 5), "token(row=0, pos=1)"),
    # GPT-2's Conv1D: addmm(bias, x.view(-1, D), W) keeps the flattened token rows
    ("addmm_flat", lambda ids: torch.addmm(BIAS, EMB(ids).view(-1, D), W.t()).view(B, L, 5), "token(row=0, pos=1)"),
    ("mm_flat", lambda ids: torch.mm(EMB(ids).view(-1, D), W.t()), "token(row=None, pos=0, flat=1)"),
    ("addmm_residual", lambda ids: torch.addmm(EMB(ids).view(-1, D)[:, :5], EMB(ids).view(-1, D), W.t(), beta=0.5),
     "token(row=None, pos=0, flat=1)"),
    ("addmm_per_token_constant", lambda ids: torch.addmm(FLAT_TABLE, EMB(ids).view(-1, D), W.t()), "dense"),
    ("mm_token_columns", lambda ids: torch.mm(W, EMB(ids).view(-1, D).t()), "token(row=None, pos=1, flat=1)"),
    ("mm_contracts_tokens", lambda ids: torch.mm(EMB(ids).view(-1, D).t(), FLAT_TABLE), "dense"),
    ("polar_positions", lambda ids: EMB(ids) * torch.view_as_real(torch.polar(
        torch.ones(L, D // 2, dtype=torch.float64), torch.arange(L)[:, None] * INV_FREQ)).flatten(1),
     "token(row=0, pos=1)"),
    # one constant array on a feature dim selects in place (Falcon's fused qkv[..., [-2], :])
    ("array_index_features", lambda ids: EMB(ids).view(B, L, 4, 2)[..., [1, 3], :], "token(row=0, pos=1)"),
    ("array_index_positions", lambda ids: EMB(ids)[:, [0, 2]], "dense"),
    ("array_index_beside_int", lambda ids: EMB(ids).view(B, L, 4, 2)[:, :, [1, 3], 0], "dense"),
    # scatter along a feature dim is per token (a router's top-k mask); along the positions it is not
    ("scatter_features", lambda ids: torch.zeros_like(EMB(ids)).scatter(-1, EMB(ids).topk(2, -1)[1], 1.0),
     "token(row=0, pos=1)"),
    ("scatter_positions", lambda ids: torch.zeros_like(EMB(ids)).scatter(1, (ids % 2)[..., None].expand(B, L, D), 1.0),
     "dense"),
    ("merge_inner_first", lambda ids: EMB(ids).transpose(0, 1).reshape(B * L, D), "dense"),
    ("flat_topk_router", lambda ids: torch.topk(torch.softmax(EMB(ids).view(-1, D), -1), 2, dim=-1)[0],
     "token(row=None, pos=0, flat=1)"),
    ("flat_cumsum_capacity", lambda ids: EMB(ids).view(-1, D).cumsum(0), "dense"),
    ("arange_positions", lambda ids: EMB(ids) * torch.arange(L)[:, None], "token(row=0, pos=1)"),
    # a constant with extent L on the position dim is a position table: read at each token's position
    ("position_table", lambda ids: EMB(ids) + POS_TABLE, "token(row=0, pos=1)"),
    ("row_table", lambda ids: EMB(ids) + ROW_TABLE, "dense"),
    ("rotary_cache_broadcast", lambda ids: EMB(ids).view(B, L, 2, D // 2).transpose(1, 2) * COS[:L, : D // 2],
     "token(row=0, pos=2)"),
    ("table_lookup_by_position", lambda ids: EMB(ids) * COS[torch.arange(L)], "token(row=0, pos=1)"),
    ("inv_freq_matmul_positions",
     lambda ids: EMB(ids) * (INV_FREQ[None, :, None] @ torch.arange(L)[None, None, :].double()).transpose(1, 2)
     .repeat(1, 1, 2), "token(row=0, pos=1)"),
    # HF rotary with per-row position_ids: inv_freq broadcast over the rows (expand) is the same in every row
    ("inv_freq_matmul_positions_over_rows",
     lambda ids: EMB(ids) * (INV_FREQ[None, :, None].double().expand(B, -1, 1)
                             @ torch.arange(L)[None].expand(B, -1)[:, None, :].double()).transpose(1, 2)
     .repeat(1, 1, 2), "token(row=0, pos=1)"),
    ("matmul_per_row_constant_positions",
     lambda ids: EMB(ids) * (ROW_FREQ @ torch.arange(L)[None].expand(B, -1)[:, None, :].double()).transpose(1, 2)
     .repeat(1, 1, 2), "dense"),
    # gpt-fast's MoE: each token's expert weights looked up (W[idx]) and contracted with einsum, flattened tokens
    ("einsum_flat_expert_weights",
     lambda ids: torch.einsum("ti,taoi->tao", EMB(ids).view(-1, D),
                              EXPERT_W[F.linear(EMB(ids).view(-1, D), ROUTER).topk(2, -1)[1]]),
     "token(row=None, pos=0, flat=1)"),
    ("einsum_outer_positions",
     lambda ids: EMB(ids) * torch.einsum("i,j->ij", torch.arange(L).double(), INV_FREQ).repeat(1, 2),
     "token(row=0, pos=1)"),
    ("einsum_linear", lambda ids: torch.einsum("bld,od->blo", EMB(ids), W), "token(row=0, pos=1)"),
    ("complex_rotary", lambda ids: torch.view_as_real(
        torch.view_as_complex(EMB(ids).view(B, L, D // 2, 2)) * FREQS_CIS[:L]).flatten(2), "token(row=0, pos=1)"),
    ("rms_norm", lambda ids: torch.rms_norm(EMB(ids), (D,), None, 1e-6), "token(row=0, pos=1)"),
    ("repeat_features", lambda ids: EMB(ids).repeat(1, 1, 2), "token(row=0, pos=1)"),
    ("repeat_positions", lambda ids: EMB(ids).repeat(1, 2, 1), "dense"),
    ("repeat_interleave_heads", lambda ids: EMB(ids).view(B, L, 2, D // 2).repeat_interleave(2, dim=2),
     "token(row=0, pos=1)"),
    ("cat_features", lambda ids: torch.cat([EMB(ids), -EMB(ids)], -1), "token(row=0, pos=1)"),
    # a constant fill in a token value's shape keeps its token dims (Inkling2's empty stack of block states)
    ("new_zeros_token_shape", lambda ids: torch.cat([EMB(ids).new_zeros(B, L, 0, D), EMB(ids)[:, :, None]], -2),
     "token(row=0, pos=1)"),
    ("new_full_moves_token_dims", lambda ids: EMB(ids) + EMB(ids).new_full((L, B, 1), 1.0).transpose(0, 1), "dense"),
    ("cat_positions", lambda ids: torch.cat([EMB(ids), EMB(ids)], 1), "dense"),
    ("scores", lambda ids: EMB(ids) @ EMB(ids).transpose(-1, -2), "dense"),
    ("chunk_features", lambda ids: EMB(ids).chunk(2, -1)[1], "token(row=0, pos=1)"),
    # scans along the positions run along the tree paths (rules/scan.py)
    ("cumsum_positions", lambda ids: EMB(ids).cumsum(1), "token(row=0, pos=1)"),
    ("cumsum_rows", lambda ids: EMB(ids).cumsum(0), "dense"),
    ("causal_conv", lambda ids: CONV(EMB(ids).transpose(1, 2))[..., :L], "token(row=0, pos=2)"),
    ("left_pad_conv", lambda ids: CONV0(F.pad(EMB(ids).transpose(1, 2), (2, 0))), "token(row=0, pos=2)"),
    ("conv_reads_later_tokens", lambda ids: CONV(EMB(ids).transpose(1, 2))[..., 2:], "dense"),
]


@pytest.mark.parametrize("name,fn,expected", TABLE, ids=[t[0] for t in TABLE])
def test_expected_axes(name, fn, expected):
    ids = torch.randint(0, V, (B, L))
    ax, _ = facts(fn, ids)
    assert str(ax) == expected


def test_shift_slice_goes_to_window():
    ax, _ = facts(lambda ids: EMB(ids)[:, 1:], torch.randint(0, V, (B, L)))
    assert not ax.window.is_whole and ax.window.steps == (("pos", (1, None, None)),)


def test_inplace_on_token_value_refused():
    def f(ids):
        x = EMB(ids)
        x.mul_(2)
        return x
    with pytest.raises(CannotReplay) as e:
        facts(f, torch.randint(0, V, (B, L)))
    assert e.value.code is Code.INPLACE_TOKEN_VALUE


def test_logical_operators_are_not_inplace():
    """operator.and_ / or_ end in "_" but are pure: a mask built from the ids is fine."""
    ax, _ = facts(lambda ids: EMB(ids) * ((ids != 0) & (ids != 5) | (ids == 3))[..., None],
                  torch.randint(0, V, (B, L)))
    assert str(ax) == "token(row=0, pos=1)"


def test_materialisation_is_recorded():
    _, ctx = facts(lambda ids: EMB(ids).mean(0), torch.randint(0, V, (B, L)))
    (m,) = ctx.materialised.values()
    assert "reduction over a token dim" in m.reason and m.numel == B * L * D


def test_token_ids_found_through_views():
    gm, _ = capture(lambda ids: EMB(ids.view(B, L)), torch.randint(0, V, (B, L)))
    assert find_token_ids(gm).op == "placeholder"


QKV = torch.nn.Linear(D, 3 * D).double()


def prompt_joined(ids):
    """CPM-Ant: P = 3 prompt ids (a constant ``arange`` every row repeats) concatenated before the input ids, then
    embedded and attended: the attention runs over [B, P + L] positions the graph made."""
    x = torch.cat((torch.arange(V - 3, V).repeat(ids.size(0), 1), ids), dim=1)
    q, k, v = QKV(EMB(x)).unsqueeze(1).chunk(3, -1)  # one head: [B, 1, P + L, D]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_ids_joined_to_constant_tokens_are_the_tree_input():
    """Token ids built in the graph (a constant prefix joined to the input ids) are read from an input the
    runtime computes per call (passes/canonical/keys.py): that [B, P + L] value is the token ids and the one tree
    input, its embedding a token value over the joined positions, the input ids no longer read."""
    ids = torch.randint(1, V, (B, L))
    gm, inputs = capture(prompt_joined, ids)
    an = analyse(gm, inputs)
    (key,) = an.tree_inputs
    assert key is an.token_ids and an.keys.names == (key.name,) and (an.ctx.B, an.ctx.L) == (B, 3 + L)
    (x,) = an.keys(inputs)
    assert torch.equal(x, torch.cat((torch.arange(V - 3, V).repeat(B, 1), ids), 1))
    emb = next(n for n in an.gm.graph.nodes if n.target is F.embedding)
    assert str(get_axes(emb)) == "token(row=0, pos=1)"
    assert not an.placeholders[0].users  # the input ids: read by the key graph only


# ------------------------------------------------------------------------------------------------
# semantic oracle


def run_all(gm: fx.GraphModule, inputs) -> dict[str, torch.Tensor]:
    """Every node's value (by name) on ``inputs``."""
    values = {}

    class Rec(fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            values[n.name] = r
            return r

    Rec(gm).run(*inputs)
    return values


def prefix_slice(v: torch.Tensor, ax, row: int, t: int, rows: int = 0) -> torch.Tensor:
    """Entries of TOKEN value ``v`` at dense row ``row`` (if it has a row dim) and positions <= t (a flattened
    value, ``rows`` rows of tokens: unflattened to [rows, L, k] first)."""
    if ax.flat:
        v = v.unflatten(ax.pos, (rows, -1, ax.flat)).select(ax.pos, row)
        return v.narrow(ax.pos, 0, t + 1)
    if ax.row is not None:
        v = v.select(ax.row, row)
        pos = ax.pos - (1 if ax.row < ax.pos else 0)
    else:
        pos = ax.pos
    return v.narrow(pos, 0, t + 1)


def check_claims(gm, inputs, tree_positions, t: int):
    """For every whole-window TOKEN node: (1) causal — changing row 0 after t and every other row leaves
    row 0's entries at positions <= t unchanged; (2) row-independent — a row 1 that copies row 0 up to t
    has the same entries there. Returns the number of nodes checked."""
    gen = torch.Generator().manual_seed(0)

    def perturbed(copy_to_row1: bool):
        new = list(inputs)
        for i in tree_positions:
            x = inputs[i]
            binary = bool(((x == 0) | (x == 1)).all())
            r = (torch.rand(x.shape, generator=gen) < 0.7).to(x.dtype) if binary else \
                torch.randint(1, V, x.shape, generator=gen).to(x.dtype)
            y = r.clone()
            y[0, : t + 1] = x[0, : t + 1]
            if copy_to_row1:
                y[1, : t + 1] = x[0, : t + 1]
            new[i] = y
        return new

    base = run_all(gm, inputs)
    other = run_all(gm, perturbed(False))
    copied = run_all(gm, perturbed(True))
    checked = 0
    rows = inputs[tree_positions[0]].shape[0]
    for n in gm.graph.nodes:
        ax = AXES.get(n)
        if ax is None or not ax.is_token or not ax.window.is_whole or not isinstance(base.get(n.name), torch.Tensor):
            continue
        if ax.region:  # a sort order, an index or group offsets: no per-position dense value to compare
            continue
        a = prefix_slice(base[n.name], ax, 0, t, rows)
        b = prefix_slice(other[n.name], ax, 0, t, rows)
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=lambda m: f"{n.name} not causal: {m}")
        if ax.row is not None or ax.flat:
            c0 = prefix_slice(copied[n.name], ax, 0, t, rows)
            c1 = prefix_slice(copied[n.name], ax, 1, t, rows)
            torch.testing.assert_close(c1, c0, rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{n.name} not row-independent: {m}")
        checked += 1
    return checked


@pytest.mark.parametrize("use_mask", [False, True])
def test_semantic_oracle_on_example_gpt(use_mask):
    model = GPT(GPTConfig(vocab_size=V, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=32)).double()
    ids = torch.randint(1, V, (4, 9))
    mask = torch.ones_like(ids)
    mask[2, :2] = 0
    args = (ids, mask) if use_mask else (ids,)
    gm, inputs = capture(model, *args)
    an = analyse(gm, inputs)
    n = check_claims(an.gm, inputs, an.tree_input_positions, t=4)
    assert n > 40  # the whole body was checked, not a handful of nodes


@pytest.mark.parametrize("name,fn,expected", [t for t in TABLE if t[2] != "dense"],
                         ids=[t[0] for t in TABLE if t[2] != "dense"])
def test_semantic_oracle_on_table(name, fn, expected):
    ids = torch.randint(0, V, (B, L))
    gm, inputs = capture(fn, ids)
    ids = find_token_ids(gm)
    propagate(AxesContext(gm, B, L, [ids], set()))
    position = [n for n in gm.graph.nodes if n.op == "placeholder"].index(ids)
    assert check_claims(gm, inputs, [position], t=3) >= 1
