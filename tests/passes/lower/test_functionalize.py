"""passes/lower/functionalize.py: writes into fresh, unaliased values become out-of-place ops; every other write
stays. Graphs are captured by Dynamo; the rewritten graph must compute what the original does."""
import pytest
import torch
import torch.nn.functional as F

from brcompile.passes.analysis.axes import is_inplace
from brcompile.passes.lower.functionalize import functionalize


def capture(fn, *args):
    """The Dynamo graph of ``fn(*args)`` and its example inputs."""
    got = []

    def backend(gm, example_inputs):
        got.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (gm, inputs), = got
    return gm


def writes(gm):
    return [n.format_node() for n in gm.graph.nodes if n.op in ("call_function", "call_method") and is_inplace(n)]


def router(h, w):
    """Mixtral's router: top-k of a softmax, normalised in place."""
    probs = torch.softmax(h @ w, dim=-1)
    top, idx = torch.topk(probs, 2, dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    return top, idx


def accumulate(h, idx):
    out = torch.zeros_like(h)
    out.index_add_(0, idx, h * 2)
    out += 1
    return F.relu(out, inplace=True)


def mla_keys(h):
    """DeepSeek MLA: a new buffer filled by copies into two slices that tile its last dim."""
    a = h * 2
    b = (h + 1)[..., :3]
    k = a.new_empty(a.shape[0], a.shape[1] + 3)
    k[..., : a.shape[1]].copy_(a)
    k[..., a.shape[1]:].copy_(b)
    return k * 3


def gap_in_tiles(h):
    k = h.new_empty(h.shape[0], h.shape[1] + 3)
    k[..., : h.shape[1]].copy_(h * 2)  # the last 3 columns are never written
    return k[..., : h.shape[1]] + 1


def masked_ids(ids):
    """Gemma3: ``ids = input_ids.clone(); ids[image_mask] = 0`` (a bool mask of the value's shape)."""
    x = ids.clone()
    x[ids == 3] = 0
    return x * 2


def chunk_writes(h):
    """A chunked scan's output buffer: rows written by int and slice indices, then a number into a slice."""
    out = torch.zeros_like(h)
    out[:, 0] = h[:, 1] * 2
    out[:, 2:4] = h[:, :2] + 1
    out[1:3] = 0.5
    return out * 3


def mask_of_rows(h):
    x = h * 2
    x[h[:, 0] > 0] = 1.0  # a mask of the leading dim only
    return x


def negative_index(h):
    x = h * 2
    x[:, -1] = h[:, 0]
    return x


def broadcast_value(h):
    x = h * 2
    x[:, 1] = h[0, 0]  # a 0-d value broadcast over the column
    return x


def into_input(h):
    h.mul_(2)
    return h + 1


def into_view(h):
    x = h * 2
    y = x.transpose(0, 1)
    y.add_(1)
    return x


def aliased_before(h):
    x = h * 2
    v = x.view(-1)
    x.add_(1)
    return v * 3


def promoting(h, s):
    x = h * 2
    x += s  # s [4] float64, x float32: out of place would promote, in place keeps float32
    return x


def mrope_views(h):
    """Qwen3.5's interleaved MRoPE: strided writes into a view (``freq[0]``) of a fresh value, the sources read
    from the same value (a later reader of the base reads the written value)."""
    freq = torch.stack([h, h * 2, h * 3]).cos()  # [3, 5, 4]
    thw = freq[0]
    for dim, offset in ((1, 1), (2, 2)):
        thw[..., offset:4:3] = freq[dim, ..., offset:4:3]
    return torch.cat((thw, thw), dim=-1), freq.sum(0)


def forward_substitution(h):
    """Kimi / Bailing's chunked delta rule: ``a[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)`` with
    ``row`` and ``sub`` clones of views of ``a`` read before each write."""
    a = -(h.unsqueeze(-1) * h.unsqueeze(-2)).tril(-1) * 0.1  # [5, 4, 4]
    for i in range(1, 4):
        row = a[..., i, :i].clone()
        sub = a[..., :i, :i].clone()
        a[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    return a + 1


def methods_on_views(h):
    """In-place methods and a copy into basic-index views, a number into an int-and-slice view, the method's
    result read afterwards (it is the written view)."""
    x = h * 2
    y = x[1:4].mul_(3)
    x[:, 0].copy_(h[:, 1])
    x[-1][1:3] = 0.5
    return x + y.sum()


def view_read_after(h):
    """A view made before the write and read after it shows the written elements."""
    x = h + 1
    v = x[:, 1:]
    x[2:4, 2] = h[0, 0] * 7
    return v * 2, x


@torch.library.custom_op("brcompile_test::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@doubled.register_fake
def _(x):
    return torch.empty_like(x)


def custom_op_result(h):
    """HF's grouped experts: ``out = grouped_mm(...); out.add_(bias)`` — an operator whose schema returns a tensor
    with no alias annotation returns a new one."""
    out = torch.ops.brcompile_test.doubled(h)
    out.add_(h[0])
    return out * 3


def into_view_of_input(h):
    h[1:3][:, 0] = 1.0  # a view of a graph input: the caller's tensor changes
    return h * 2


class IntoParameterView(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5, 4))

    def forward(self, h):
        with torch.no_grad():
            self.w[0, 1:3] = h[0, :2]  # a view of a parameter: the module's state changes
        return self.w * h


def reshaped_alias(h):
    x = h * 2
    r = x.reshape(4, 5)  # an alias this pass does not track, read after the write
    x[0, 1:3] = 0.0
    return r + 1


def into_sole_view(h):
    """Gemma 3n's AltUp: a write into a permuted matmul result, the permute its only reader."""
    p = (h.unsqueeze(-1) * h.unsqueeze(-2)).sum(0).permute(1, 0)
    p += h[:4]
    return p.contiguous() * 2


def into_slice_of_sole_copy(h):
    """Gemma 3n's AltUp correction: ``c = mul(…).contiguous().type_as(h); c[1:] += first``."""
    c = (h * 3).contiguous().type_as(h)
    c[1:] += c[0].clone()
    return c * 2


def into_shared_view(h):
    x = h * 2
    p = x.permute(1, 0)  # x is read again after the write: the write into p changes what that read sees
    p += 1.0
    return x + 1, p


def shape_read_before(h):
    """XLM: the scores' shape is read (``m.expand_as(s)``, a view of ``m``) before ``s.masked_fill_(…)``."""
    s = h @ h.T
    m = (h[:, 0] > 0).view(1, -1).expand_as(s)
    s.masked_fill_(m, -1e9)
    return s.softmax(-1).type_as(s)


def into_dropout(h):
    """XLM: ``t = dropout(layer_norm(…), p=0); t *= mask`` (a dropout at p = 0 returns its input)."""
    t = F.dropout(F.layer_norm(h, (4,)), p=0.0, training=True)
    t *= (h[:, :1] > 0).to(t.dtype)
    return t


def into_shared_dropout(h):
    x = h * 2
    t = F.dropout(x, p=0.0, training=True)  # t is x: x is read again after the write
    t *= 3.0
    return x + 1


H = torch.randn(5, 4)


@pytest.mark.parametrize("fn, args", [(router, (H, torch.randn(4, 3))),
                                      (accumulate, (H, torch.tensor([1, 0, 4, 4, 2]))),
                                      (mla_keys, (H,)), (masked_ids, (torch.randint(0, 5, (3, 6)),)),
                                      (chunk_writes, (H,)), (gap_in_tiles, (H,)), (negative_index, (H,)),
                                      (broadcast_value, (H,)), (mrope_views, (H,)), (forward_substitution, (H,)),
                                      (methods_on_views, (H,)), (view_read_after, (H,)), (custom_op_result, (H,)),
                                      (into_sole_view, (H,)), (into_slice_of_sole_copy, (H,)),
                                      (shape_read_before, (H,)), (into_dropout, (H,))])
def test_writes_into_fresh_values_become_pure(fn, args):
    gm = capture(fn, *args)
    assert writes(gm)
    new = functionalize(gm)
    assert new is not gm and writes(new) == []
    assert writes(gm)  # the captured graph is not changed
    for a, b in zip(new(*args), fn(*[x.clone() for x in args]) if isinstance(fn(*args), tuple) else [fn(*args)]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("fn, args", [(into_input, (H.clone(),)), (into_view, (H,)), (aliased_before, (H,)),
                                      (promoting, (H, torch.ones(4, dtype=torch.float64))),
                                      (mask_of_rows, (H,)), (into_view_of_input, (H,)),
                                      (IntoParameterView(), (H,)), (reshaped_alias, (H,)), (into_shared_view, (H,)),
                                      (into_shared_dropout, (H,))],
                         ids=["input", "view", "aliased", "promoting", "mask_of_rows", "view_of_input",
                              "view_of_parameter", "reshaped_alias", "shared_view", "shared_dropout"])
def test_other_writes_stay(fn, args):
    gm = capture(fn, *[a.clone() for a in args])
    before = writes(gm)
    assert before
    assert writes(functionalize(gm)) == before


class WritesIntoTokenViews(torch.nn.Module):
    """Token values written through views, then attended: an interleaved MRoPE table (``thw = freq[0];
    thw[..., k::3] = freq[d, ..., k::3]``, positions broadcast over sections and the rows) and a per-token
    forward substitution (``a[..., i, :i] = row + …``) of an outer product."""

    def __init__(self, V=11, D=6):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.inv_freq = torch.nn.Parameter(torch.linspace(0.1, 1.0, D))
        self.section = torch.nn.Parameter(torch.tensor([1.0, 0.7]))

    def forward(self, ids):
        B, L = ids.shape
        h = self.emb(ids)
        pos = torch.arange(L).view(1, 1, -1).expand(2, B, -1)  # 2 sections: B (3) names one dim only
        freq = (pos[..., None].to(h.dtype) * self.inv_freq * self.section[:, None, None, None]).cos()
        thw = freq[0]
        thw[..., 1:6:3] = freq[1, ..., 1:6:3]
        thw[..., 2::3] = freq[1, ..., 2::3] * 2
        a = -(h.unsqueeze(-1) * h.unsqueeze(-2)).tril(-1) * 0.1  # [B, L, D, D]
        for i in range(1, 4):
            row = a[..., i, :i].clone()
            sub = a[..., :i, :i].clone()
            a[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
        q = ((a @ h.unsqueeze(-1)).squeeze(-1) * thw).unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).square().sum()


def test_writes_into_views_of_token_values_replay():
    """The writes become slice/select_scatter (no write left to refuse), the packed graph replays, and the
    loss and every gradient equal eager's in float64."""
    from tests.helpers import replay_exact

    backend = replay_exact(WritesIntoTokenViews())
    assert backend.records[0].rewritten, backend.records[0].reason


class AltUpPredict(torch.nn.Module):
    """Gemma 3n's AltUp: a per-token mixing of n streams, ``p = (streams @ coefs).permute(…)``, then
    ``p += streams`` in place, and the correction ``c = (…).contiguous().type_as(h); c[1:] += c[0]``, attended."""

    def __init__(self, V=11, D=6, n=2):
        super().__init__()
        self.n = n
        self.emb = torch.nn.Embedding(V, D)
        self.coef = torch.nn.Linear(D, n * n)
        self.up = torch.nn.Linear(D, n * D)

    def forward(self, ids):
        B, L = ids.shape
        h = self.emb(ids)
        streams = self.up(h).view(B, L, self.n, -1).permute(2, 0, 1, 3)  # [n, B, L, D]
        coefs = self.coef(h).view(B, L, self.n, self.n)
        p = torch.matmul(streams.permute(1, 2, 3, 0), coefs).permute(3, 0, 1, 2)
        p += streams
        c = (p * 1.5).contiguous().type_as(h)
        c[1:] += c[0].clone()  # AltUp's correction: the other streams get the active one
        q = c.sum(0).unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).square().sum()


def test_write_into_sole_view_of_token_value_replays():
    """The write into the permuted matmul result becomes an add; the packed graph replays, loss and every
    gradient equal eager's in float64."""
    from tests.helpers import replay_exact

    backend = replay_exact(AltUpPredict())
    assert backend.records[0].rewritten, backend.records[0].reason
