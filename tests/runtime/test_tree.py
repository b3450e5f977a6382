"""brcompile.runtime.tree: the packed prefix tree against a brute-force Python trie (dict keyed by prefix tuples).
On the CPU the compiled kernel (backends/common/cpu/prefix_tree.cpp) builds the trees of ``hash_fn=None``; the
tests of the vectorised paths (hashed order, exact sort) turn it off (``torch_path``)."""
import math
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from brcompile.testing import assert_subtree_ranges
from brcompile.runtime.tree import build as tree_mod  # the builder: its counters, hashes and limits
from brcompile.runtime.tree import PackedTree, TreeInputError, TreeStats, build_tree

FIELDS = ("index", "parent", "end", "position", "valid", "rep_row", "segments")
HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


@pytest.fixture
def torch_path(monkeypatch):
    """The vectorised torch builder (the compiled CPU kernels off)."""
    monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", "0")


def zero_hash(codes):
    """Every prefix collides."""
    return torch.zeros_like(codes[0])


def mod3_hash(codes):
    """Token 0 and token 3 (and 1, 4 ...) collide at every column."""
    return codes[0] % 3


# ---------------------------------------------------------------------------------------------------------
# brute force


def cell_value(x, b, t):
    """A hashable exact value of x[b, t]: floats by their bit pattern (struct), ints and bools by value;
    the trailing elements of a [B, L, ...] input by their bytes."""
    if x.dim() > 2:
        return ("w", x[b, t].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    v = x[b, t].item()
    if x.is_floating_point():
        return ("f", struct.pack("<d", v))
    return ("i", int(v))


def brute_force_trie(inputs, mask):
    """key[b][t] = the prefix tuple of row b through column t; and {key: sorted rows having it}."""
    first = inputs[0]
    B, L = first.shape[:2]
    columns = list(inputs) + ([(mask != 0)] if mask is not None else [])
    cells = [[tuple(cell_value(x, b, t) for x in columns) for t in range(L)] for b in range(B)]
    keys = [[tuple(cells[b][: t + 1]) for t in range(L)] for b in range(B)]
    rows_of = {}
    for b in range(B):
        for t in range(L):
            rows_of.setdefault(keys[b][t], []).append(b)
    return keys, rows_of


def check_against_trie(tree, inputs, mask):
    """Every documented property of PackedTree, from the brute-force trie."""
    B, L = inputs[0].shape[:2]
    keys, rows_of = brute_force_trie(inputs, mask)
    n = tree.num_tokens
    assert tree.batch_shape == (B, L)
    assert n == len(rows_of), f"{n} packed tokens, trie has {len(rows_of)} nodes"
    index = tree.index.tolist()
    parent, end, position = tree.parent.tolist(), tree.end.tolist(), tree.position.tolist()
    valid, rep_row = tree.valid.tolist(), tree.rep_row.tolist()

    # index is a bijection between trie nodes and [0, N)
    id_of = {}
    for b in range(B):
        for t in range(L):
            k = index[b][t]
            assert 0 <= k < n
            assert id_of.setdefault(keys[b][t], k) == k, f"one prefix at ({b}, {t}) got two ids"
    assert sorted(id_of.values()) == list(range(n)), "two different prefixes share a packed id"

    mask_list = mask.tolist() if mask is not None else None
    for key, k in id_of.items():
        rows = rows_of[key]
        t = len(key) - 1
        assert position[k] == t
        assert rep_row[k] == rows[0]
        assert valid[k] == (bool(mask_list[rows[0]][t]) if mask is not None else True)
        assert parent[k] == (id_of[key[:-1]] if t > 0 else -1)

    # packed order is a DFS preorder: k <= q < end[k]  <=>  k is an ancestor-or-self of q
    assert_subtree_ranges(parent, end)

    check_segments(tree.segments.tolist(), parent, end, n)
    assert tree.stats == TreeStats(
        rows=B,
        logical_tokens=B * L,
        executed_tokens=n,
        valid_tokens=int((mask != 0).sum()) if mask is not None else B * L,
        dedup_ratio=B * L / n,
        depth=L,
        segments=len(tree.segments),
    )


def check_segments(segments, parent, end, n):
    """Segments partition [0, N) into maximal chains of single-child nodes."""
    children = [0] * n
    for p in parent:
        if p >= 0:
            children[p] += 1
    assert segments[0][0] == 0 and segments[-1][1] == n
    for (start, stop, sub_end), nxt in zip(segments, segments[1:] + [[n]]):
        assert start < stop == nxt[0]
        assert parent[start] == -1 or children[parent[start]] != 1, f"segment at {start} is not maximal"
        for k in range(start + 1, stop):
            assert parent[k] == k - 1 and children[k - 1] == 1, f"node {k} breaks the chain at {start}"
        assert sub_end == end[start]


# ---------------------------------------------------------------------------------------------------------
# generated batches


@st.composite
def batches(draw):
    """(inputs, mask): groups, nested branches (a row copies a prefix of an earlier row), equal rows, no
    sharing, padding left/right with a mask, a second input (position ids or floats), L == 1, B == 1."""
    B = draw(st.integers(1, 7))
    L = draw(st.integers(1, 9))
    vocab = draw(st.integers(1, 5))
    rows = []
    for i in range(B):
        row = draw(st.lists(st.integers(0, vocab - 1), min_size=L, max_size=L))
        if i and draw(st.booleans()):
            j = draw(st.integers(0, i - 1))
            cut = draw(st.integers(0, L))
            row[:cut] = rows[j][:cut]
        rows.append(row)
    tokens = torch.tensor(rows, dtype=torch.int64)

    mask = None
    padding = draw(st.sampled_from(["none", "right", "left"]))
    if padding != "none":
        lengths = draw(st.lists(st.integers(0, L), min_size=B, max_size=B))
        col = torch.arange(L)
        length = torch.tensor(lengths).unsqueeze(1)
        mask = col < length if padding == "right" else col >= L - length
        if draw(st.booleans()):
            tokens = tokens.masked_fill(~mask, 7)  # pad id; else the padded tokens stay arbitrary
        mask = mask.to(draw(st.sampled_from([torch.bool, torch.int64, torch.float32])))

    inputs = [tokens]
    extra = draw(st.sampled_from(["none", "positions", "floats"]))
    if extra == "positions":
        live = (mask != 0).to(torch.int64) if mask is not None else torch.ones_like(tokens)
        inputs.append((live.cumsum(1) - 1).clamp(min=0))
    elif extra == "floats":
        table = torch.tensor([0.0, -0.0, 1.5, float("nan")], dtype=torch.float64)
        inputs.append(table[tokens % 4])
    return inputs, mask


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.sampled_from([None, zero_hash, mod3_hash]))
def test_matches_brute_force_trie(batch, hash_fn):
    inputs, mask = batch
    tree = build_tree(inputs if len(inputs) > 1 else inputs[0], mask, hash_fn=hash_fn)
    check_against_trie(tree, inputs, mask)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches())
def test_layout_is_canonical_across_paths(monkeypatch, batch):
    """The compiled kernel, the hashed order, the weak-hash fallback and the exact sort (large-B path) give
    identical tensors."""
    inputs, mask = batch
    monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", "1" if HAS_COMPILER else "0")
    compiled = build_tree(inputs, mask)
    monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", "0")
    reference = build_tree(inputs, mask)
    weak = build_tree(inputs, mask, hash_fn=zero_hash)
    saved = tree_mod.PAIRWISE_MAX_ROWS
    tree_mod.PAIRWISE_MAX_ROWS = 0
    try:
        exact = build_tree(inputs, mask)
    finally:
        tree_mod.PAIRWISE_MAX_ROWS = saved
    for name in FIELDS:
        for other in (compiled, weak, exact):
            torch.testing.assert_close(getattr(other, name), getattr(reference, name), rtol=0, atol=0, msg=name)
    assert compiled.stats == reference.stats


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on PATH: the compiled kernels cannot be built")
def test_the_compiled_kernel_builds_cpu_trees(monkeypatch):
    """On the CPU, without a hash_fn, the compiled kernel builds the tree (one call, no hash) where it is available."""
    monkeypatch.setenv("BRCOMPILE_CPU_KERNELS", "1")
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 3, (9, 11), generator=g)
    mask = torch.rand(9, 11, generator=g) < 0.7
    tree, delta = counter_delta(lambda: build_tree([tokens, tokens % 2], mask))
    assert delta == {"builds": 1, "compiled": 1}
    check_against_trie(tree, [tokens, tokens % 2], mask)


# ---------------------------------------------------------------------------------------------------------
# the hash can never merge different prefixes


def counter_delta(fn):
    """(result, counter increments) of fn()."""
    before = dict(tree_mod.counters)
    result = fn()
    after = dict(tree_mod.counters)
    return result, {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


@pytest.mark.parametrize("hash_fn", [zero_hash, mod3_hash], ids=["constant", "mod3"])
def test_weak_hash_collision_falls_back_to_exact(hash_fn):
    # rows 0 and 2 differ only in 3 vs 0 at column 1: both hashes collide there, so the hashed order
    # keeps index order, which is not lexicographic -> verification fails -> exact sort.
    tokens = torch.tensor([[1, 3, 2, 2, 5], [1, 4, 4, 1, 1], [1, 0, 2, 2, 5], [1, 3, 2, 2, 6]])
    tree, delta = counter_delta(lambda: build_tree(tokens, hash_fn=hash_fn))
    assert delta == {"builds": 1, "hash_fallback": 1}
    check_against_trie(tree, [tokens], None)
    assert tree.num_tokens == 5 + 4 + 4 + 1


def test_weak_hash_in_sorted_order_still_exact():
    # constant hash, rows already lexicographic: verification passes without a fallback and the merges
    # still come from exact comparisons only (3 != 0 stay different nodes).
    tokens = torch.tensor([[0, 1, 1], [0, 1, 2], [3, 1, 1]])
    tree, delta = counter_delta(lambda: build_tree(tokens, hash_fn=zero_hash))
    assert delta == {"builds": 1, "hashed_order": 1}
    check_against_trie(tree, [tokens], None)
    assert tree.num_tokens == 7


def test_default_hash_takes_fast_path(torch_path):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 5, (13, 37), generator=g)
    tokens[:, :20] = tokens[0, :20]
    tree, delta = counter_delta(lambda: build_tree(tokens))
    assert delta == {"builds": 1, "hashed_order": 1}
    check_against_trie(tree, [tokens], None)


@pytest.mark.parametrize("B, L, path", [(41, 7, "hashed_order"), (77, 6, "exact_order")])
def test_bushy_forests_with_many_rows(B, L, path, torch_path):
    """Binary vocab: deep branching, many segments, long range-min / binary-lifting tables."""
    g = torch.Generator().manual_seed(B)
    tokens = torch.randint(0, 2, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) < 0.8
    tree, delta = counter_delta(lambda: build_tree(tokens, mask))
    assert delta == {"builds": 1, path: 1}
    check_against_trie(tree, [tokens], mask)


def test_many_rows_use_exact_sort(torch_path):
    B, L = tree_mod.PAIRWISE_MAX_ROWS + 7, 3
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4, (B, L), generator=g)
    tree, delta = counter_delta(lambda: build_tree(tokens))
    assert delta == {"builds": 1, "exact_order": 1}
    distinct_prefixes = sum(len({tuple(r[: t + 1]) for r in tokens.tolist()}) for t in range(L))
    assert tree.num_tokens == distinct_prefixes
    torch.testing.assert_close(tree.position[tree.index], torch.arange(L).expand(B, L))


# ---------------------------------------------------------------------------------------------------------
# specific batches


def test_float_inputs_compare_by_bit_pattern():
    values = torch.tensor([[0.0, 1.0], [-0.0, 1.0], [math.nan, 2.0], [math.nan, 2.0]], dtype=torch.float32)
    tree = build_tree(values)
    assert tree.index[0, 0] != tree.index[1, 0]  # 0.0 and -0.0 differ in bits
    assert torch.equal(tree.index[2], tree.index[3])  # the same NaN is the same token
    check_against_trie(tree, [values.to(torch.float64)], None)


def test_other_dtypes_and_strided_inputs():
    """int32 / bool / float16 inputs and non-contiguous views (a next-token slice, a transpose)."""
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 3, (9, 6), generator=g)
    base[1:4, :3] = base[0, :3]
    tokens = base.to(torch.int32)[:, 1:]  # [9, 5], non-contiguous
    flags = (base.t().contiguous().t() % 2 == 0)[:, :-1]  # [9, 5] bool, non-contiguous
    halves = (base[:, :-1].to(torch.float16) / 2).t().contiguous().t()  # [9, 5] f16, column-major
    mask = torch.ones(9, 6, dtype=torch.int64)[:, 1:]
    mask[4, 3:] = 0
    inputs = [tokens, flags, halves]
    tree = build_tree(inputs, mask)
    check_against_trie(tree, inputs, mask)
    assert not tokens.is_contiguous() and not flags.is_contiguous() and not halves.is_contiguous()


def test_packing_of_several_inputs():
    """Small ranges pack into one key (order kept); a full-range input keeps the codes separate."""
    tokens = torch.tensor([[5, 2, 9], [5, 2, 7], [4, 8, 8]])
    positions = torch.tensor([[0, 1, 2], [0, 1, 1], [0, 1, 2]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    codes, _ = tree_mod._token_codes([tokens, positions], mask)
    (key,) = tree_mod._packed_codes(codes)  # widths 3 (2..9), 2 (0..2), 1 (mask)
    torch.testing.assert_close(key, ((tokens - 2) << 3) | (positions << 1) | mask, rtol=0, atol=0)
    wide = torch.tensor([[-(2**62), 0, 1], [2**62, 0, 1], [0, 0, 1]])
    codes, _ = tree_mod._token_codes([wide, positions], mask)
    assert len(tree_mod._packed_codes(codes)) == 3
    for inputs in ([tokens, positions], [wide, positions]):
        check_against_trie(build_tree(inputs, mask), inputs, mask)


def test_rl_batch_groups_and_ragged_padding():
    """Two prompt groups of 3 rollouts, right-padded responses with a shared first response token."""
    prompt_a, prompt_b = [5, 6, 7, 8], [5, 9]
    rows = [
        prompt_a + [1, 2, 3],
        prompt_a + [1, 2, 4],
        prompt_a + [1, 0, 0],  # ends early: padded with 0, mask 0
        prompt_b + [1, 1, 0, 0, 0],
        prompt_b + [1, 1, 2, 0, 0],
        prompt_b + [3, 0, 0, 0, 0],
    ]
    lengths = [7, 7, 5, 4, 5, 3]
    tokens = torch.tensor(rows)
    mask = torch.arange(7) < torch.tensor(lengths).unsqueeze(1)
    tree = build_tree(tokens, mask)
    check_against_trie(tree, [tokens], mask)
    # nodes per column (the mask bit is part of identity), and how many of them are valid
    assert tree.num_tokens == 1 + 2 + 3 + 3 + 4 + 5 + 6
    assert tree.valid.sum().item() == 1 + 2 + 3 + 2 + 2 + 1 + 2
    assert tree.stats.valid_tokens == sum(lengths)


def test_single_row_and_single_column():
    row = torch.tensor([[4, 4, 4, 1, 2]])
    tree = build_tree(row)
    check_against_trie(tree, [row], None)
    assert tree.segments.tolist() == [[0, 5, 5]]
    column = torch.tensor([[3], [1], [3], [2]])
    tree = build_tree(column)
    check_against_trie(tree, [column], None)
    assert tree.parent.tolist() == [-1, -1, -1]


def test_identical_rows_are_one_path():
    tokens = torch.tensor([[2, 7, 1]] * 5)
    tree = build_tree(tokens)
    assert tree.num_tokens == 3 and tree.stats.dedup_ratio == 5.0
    assert tree.segments.tolist() == [[0, 3, 3]]


def test_to_and_properties():
    tokens = torch.tensor([[1, 2, 3], [1, 2, 4], [0, 2, 3]])
    tree = build_tree(tokens)
    moved = tree.to("cpu")
    assert isinstance(moved, PackedTree) and moved.stats is tree.stats
    for name in FIELDS:
        assert torch.equal(getattr(moved, name), getattr(tree, name))
    assert tree.num_tokens == 7 and tree.batch_shape == (3, 3)
    assert tree.stats.to_dict() == {
        "rows": 3,
        "logical_tokens": 9,
        "executed_tokens": 7,
        "valid_tokens": 9,
        "dedup_ratio": 9 / 7,
        "depth": 3,
        "segments": 4,
    }


# ---------------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "per_token, mask, match",
    [
        (torch.zeros(5, dtype=torch.int64), None, r"must be a \[B, L\] tensor, got shape \(5,\)"),
        (torch.zeros(2, 3, 4, dtype=torch.complex64), None, r"per_token\[0\]: .*unsupported dtype torch.complex64"),
        ([torch.zeros(2, 3), torch.zeros(2, 4, 5)], None, r"per_token\[1\] has shape \(2, 4, 5\), per_token\[0\]"),
        ([torch.zeros(2, 3), torch.zeros(2, 4)], None, r"per_token\[1\] has shape \(2, 4\), per_token\[0\] has"),
        (torch.zeros(2, 3), torch.ones(3, 2), r"attention_mask has shape \(3, 2\), per_token has \(2, 3\)"),
        (torch.zeros(0, 3), None, r"the batch is empty: B=0, L=3"),
        (torch.zeros(2, 0), None, r"the batch is empty: B=2, L=0"),
        ([], None, r"empty sequence"),
        ([torch.zeros(2, 3), [1, 2, 3]], None, r"per_token\[1\] must be a tensor, got list"),
        ("tokens", None, r"must be a tensor or a sequence of tensors, got str"),
        (torch.zeros(2, 3, dtype=torch.complex64), None, r"unsupported dtype torch.complex64"),
        ([torch.zeros(2, 3), torch.zeros(2, 3, device="meta")], None, r"per_token\[1\] is on meta, .* on cpu"),
        (torch.zeros(2, 3), torch.ones(2, 3, device="meta"), r"attention_mask is on meta, per_token on cpu"),
    ],
)
def test_invalid_inputs_raise(per_token, mask, match):
    with pytest.raises(TreeInputError, match=match):
        build_tree(per_token, mask)
    assert issubclass(TreeInputError, ValueError)


def test_bad_hash_fn_raises():
    with pytest.raises(TreeInputError, match=r"hash_fn must return an integer \[B, L\] = \[2, 3\] tensor"):
        build_tree(torch.zeros(2, 3), hash_fn=lambda codes: torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(TreeInputError, match=r"got \(2, 3\) torch.float32"):
        build_tree(torch.zeros(2, 3), hash_fn=lambda codes: torch.zeros(2, 3))


# ---------------------------------------------------------------------------------------------------------
# [B, L, ...] inputs (embeddings, hidden states): trailing elements compared as bytes


def vector_table(D, dtype):
    """Rows for token ids 0..5: distinct vectors, -0.0 vs 0.0, two NaN payloads, and two vectors that
    differ only in their last element (a hash of the first words alone would collide)."""
    base = torch.zeros(6, D, dtype=torch.float64)
    base[0, 0] = 0.0
    base[1, 0] = -0.0
    base[2] = torch.arange(D, dtype=torch.float64) + 1.5
    base[3] = torch.arange(D, dtype=torch.float64) + 1.5
    base[3, -1] += 1.0
    base[4, 0] = float("nan")
    t = base.to(dtype)
    if dtype in (torch.float32, torch.float64, torch.bfloat16):
        bits = t.view({torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}[dtype])
        bits[5] = bits[4]
        bits[5, 0] += 1  # another NaN payload
    return t


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.sampled_from([1, 3, 4]), st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
       st.sampled_from(["default", "constant", "first_word"]))
def test_wide_inputs_match_brute_force_trie(batch, D, dtype, wide_hash):
    """A [B, L, D] input (embedding rows of the token ids) alone or with the ids: the tree equals the trie of
    the bytes; a constant or partial per-position hash only costs the exact rebuild."""
    inputs, mask = batch
    x = vector_table(D, dtype)[inputs[0] % 6]
    saved = tree_mod._wide_hash
    if wide_hash == "constant":
        tree_mod._wide_hash = lambda words: torch.zeros(words.shape[:2], dtype=torch.int64)
    elif wide_hash == "first_word":
        tree_mod._wide_hash = lambda words: words[..., 0].to(torch.int64)
    try:
        for keys in ([x], [x] + inputs[1:], [inputs[0], x]):
            tree = build_tree(keys, mask)
            check_against_trie(tree, keys, mask)
            assert tree_mod.rows_agree(tree, keys)
    finally:
        tree_mod._wide_hash = saved


def test_wide_hash_collision_rebuilds_exactly():
    x = torch.zeros(3, 4, 2)
    x[1, 2, 1] = 1.0  # rows 0 and 1 differ only at column 2, in the second element
    x[2, 1, 0] = -0.0  # bitwise different from 0.0
    saved = tree_mod._wide_hash
    tree_mod._wide_hash = lambda words: torch.zeros(words.shape[:2], dtype=torch.int64)
    try:
        tree, delta = counter_delta(lambda: build_tree(x))
    finally:
        tree_mod._wide_hash = saved
    assert delta.get("wide_hash_fallback") == 1
    check_against_trie(tree, [x], None)
    tree2, delta2 = counter_delta(lambda: build_tree(x))
    assert "wide_hash_fallback" not in delta2
    assert tree2.num_tokens == tree.num_tokens == 4 + 2 + 3


def test_rows_agree_checks_every_key_exactly():
    ids = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 2, 3]])
    x = torch.randn(1, 3, 5).expand(3, 3, 5).clone()
    tree = build_tree(ids)
    assert tree_mod.rows_agree(tree, [ids, x])
    y = x.clone()
    y[2, 1, 4] = torch.nextafter(y[2, 1, 4], torch.tensor(1.0))  # one ulp at a merged position
    assert not tree_mod.rows_agree(tree, [ids, y])
    assert not tree_mod.rows_agree(tree, [ids[:2]])  # another batch shape
    finer = build_tree(torch.arange(3).unsqueeze(1).expand(3, 3))  # no sharing: agrees with anything
    assert tree_mod.rows_agree(finer, [y])


def test_wide_input_strided_and_unaligned_views():
    big = torch.randn(2, 5, 7, dtype=torch.float32)
    x = big[:, 1:4, 1:6]  # non-contiguous, storage offset not a multiple of 8 bytes
    x2 = torch.cat([x, x[:1]], dim=0)
    tree = build_tree(x2)
    check_against_trie(tree, [x2], None)
    assert tree.num_tokens == 6
