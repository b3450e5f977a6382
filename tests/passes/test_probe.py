"""The probe engine (passes/probe.py): region extraction, the one interpreter, the seeded probe-value generators
and the tolerance policies, each on small hand-built graphs and tensors."""
import math
import operator

import pytest
import torch
import torch.fx as fx

from brcompile.passes import probe


def _chain() -> tuple[fx.Graph, dict]:
    """x, y -> a = x + y; b = a * 2; c = b.sum(); d = torch.relu(y) (d is off the path to c)."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    a = g.call_function(operator.add, (x, y))
    b = g.call_function(operator.mul, (a, 2))
    c = g.call_method("sum", (b,))
    d = g.call_function(torch.relu, (y,))
    g.output((c, d))
    return g, dict(x=x, y=y, a=a, b=b, c=c, d=d)


def test_ancestors_in_graph_order_and_stop_at_the_boundary():
    _, n = _chain()
    assert probe.ancestors(n["c"]) == [n["x"], n["y"], n["a"], n["b"], n["c"]]
    assert probe.ancestors(n["c"], inside=lambda a: a is not n["a"]) == [n["b"], n["c"]]  # the boundary stays out
    assert probe.ancestors(n["d"]) == [n["y"], n["d"]]


def test_region_module_copies_the_nodes_between_inputs_and_outputs():
    _, n = _chain()
    gm = probe.region_module([n["a"]], [n["b"], n["c"]], n["c"], prefix="leaf")
    assert [p.name for p in gm.graph.nodes if p.op == "placeholder"] == ["leaf0"]
    assert [m.op for m in gm.graph.nodes] == ["placeholder", "call_function", "call_method", "output"]
    a = torch.arange(3.0)
    assert probe.run(gm, a).item() == 6.0
    pair = probe.region_module([n["a"]], [n["b"]], (n["b"], n["a"]))
    got_b, got_a = probe.run(pair, a)
    assert torch.equal(got_b, 2 * a) and torch.equal(got_a, a)


def test_region_module_transform_edits_each_copy():
    _, n = _chain()

    def triple(c: fx.Node) -> None:
        if c.target is operator.mul:
            c.args = (c.args[0], 3)

    gm = probe.region_module([n["a"]], [n["b"]], n["b"], transform=triple)
    assert torch.equal(probe.run(gm, torch.ones(2)), torch.full((2,), 3.0))


def test_evaluate_runs_the_ancestors_only_and_binds_free_values():
    _, n = _chain()
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -4.0])
    assert probe.evaluate(n["c"], {n["x"]: x, n["y"]: y}).item() == 4.0
    c, d = probe.evaluate((n["c"], n["d"]), {n["x"]: x, n["y"]: y})
    assert c.item() == 4.0 and torch.equal(d, torch.tensor([3.0, 0.0]))
    # a bound inner node takes its value: its inputs are not evaluated (x is never needed)
    assert probe.evaluate(n["c"], {n["a"]: torch.ones(4)}).item() == 8.0
    with pytest.raises(KeyError):
        probe.evaluate(n["c"], {n["x"]: x})


def test_evaluate_literal_rewrite_and_call_hook():
    _, n = _chain()
    vals = {n["x"]: torch.ones(2), n["y"]: torch.ones(2)}
    assert probe.evaluate(n["c"], vals, literal=lambda c: c + 1).item() == 12.0  # a * 3

    def by_meaning(node, args, kwargs):
        return args[0] - 1 if node is n["b"] else NotImplemented

    assert probe.evaluate(n["c"], vals, call=by_meaning).item() == 2.0


def test_evaluate_runs_every_given_node_and_reports_failures():
    g = fx.Graph()
    x = g.placeholder("x")
    seen = []
    side = g.call_function(seen.append, (x,))  # no users: run only because it is listed
    bad = g.call_method("reshape", (x, 5))
    g.output(bad)
    with pytest.raises(RuntimeError):
        probe.evaluate(bad, {x: torch.ones(2)}, nodes=[side, bad])
    assert len(seen) == 1

    class Refused(Exception):
        pass

    def fail(node, e):
        raise Refused(node.name) from e

    with pytest.raises(Refused, match="reshape"):
        probe.evaluate(bad, {x: torch.ones(2)}, fail=fail)


def test_evaluate_refuses_a_module_call():
    g = fx.Graph()
    x = g.placeholder("x")
    m = g.call_module("lin", (x,))
    g.output(m)
    with pytest.raises(probe.UnsupportedNode) as info:
        probe.evaluate(m, {x: torch.ones(2)})
    assert info.value.node is m


def test_evaluate_reads_get_attr_off_the_owning_module():
    root = torch.nn.Module()
    root.register_buffer("w", torch.tensor([2.0, 3.0]))
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("w")
    y = g.call_function(operator.mul, (x, w))
    g.output(y)
    gm = fx.GraphModule(root, g)
    y = next(m for m in gm.graph.nodes if m.op == "call_function")
    assert torch.equal(probe.run(gm, torch.ones(2)), torch.tensor([2.0, 3.0]))
    assert torch.equal(probe.evaluate(y, {next(iter(gm.graph.nodes)): torch.ones(2)}), torch.tensor([2.0, 3.0]))


def test_generators_are_deterministic_per_seed():
    def draw(seed):
        gen = probe.generator(seed)
        return (probe.normal((3, 4), gen), probe.uniform((5,), gen), probe.unit_vectors((2, 3), gen),
                probe.padding(2, 6, 1, gen), probe.padding(2, 6, 3, gen),
                probe.in_range(torch.tensor([[3, 9]]), (2, 5), gen), probe.sequence_positions(2, 9, 0.4, gen))

    first, again, other = draw(0), draw(0), draw(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])


def test_generators_draw_what_they_state():
    gen = probe.generator(0)
    x = probe.normal((4, 3), gen, like=torch.zeros(1, dtype=torch.float32))
    assert x.dtype == torch.float32
    assert probe.normal((2,), gen, draw=torch.float32).dtype == torch.float32
    u = probe.uniform((100,), gen)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    v = probe.unit_vectors((5, 7), gen)
    assert torch.allclose(v.norm(dim=-1), torch.ones(5, dtype=torch.float64))
    ids = probe.in_range(torch.tensor([[4, 9, 6]], dtype=torch.int32), (3, 50), gen)
    assert ids.dtype == torch.int32 and int(ids.min()) >= 4 and int(ids.max()) <= 9
    const = probe.in_range(torch.tensor([[7, 7]]), (1, 50), gen)
    assert set(const.flatten().tolist()) <= {6, 7}
    assert probe.padding(2, 5, 0, gen).all()
    left, right = probe.padding(3, 8, 1, gen), probe.padding(3, 8, 2, gen)
    assert bool((left[:, 1:] >= left[:, :-1]).all()) and bool((right[:, 1:] <= right[:, :-1]).all())
    pos = probe.sequence_positions(3, 17, 0.3, gen)
    assert (pos[:, 0] == 0).all() and ((pos[:, 1:] == 0) | (pos[:, 1:] == pos[:, :-1] + 1)).all()


@pytest.mark.parametrize("x", [torch.tensor([True, False]), torch.tensor([0, 1, 1]), torch.tensor([5, 5]),
                               torch.tensor([1, 4, 9, 4]), torch.randn(6, dtype=torch.float64)])
def test_differing_changes_every_entry_within_the_domain(x):
    y = probe.differing(x, probe.generator(0))
    assert y.dtype == x.dtype and y.shape == x.shape and bool((y != x).all())
    if x.dtype not in (torch.bool, torch.float64) and len(torch.unique(x)) > 2:
        assert set(y.tolist()) <= set(x.tolist())


def test_recurrence_tolerance_is_relative_to_the_largest_entry_at_least_one():
    want = torch.tensor([0.0, 1e6], dtype=torch.float64)
    assert probe.close(want + torch.tensor([0.0, 1e-4]), want, probe.RECURRENCE)  # 1e-10 relative
    assert not probe.close(want + torch.tensor([0.0, 1e-2]), want, probe.RECURRENCE)
    zero = torch.zeros(3, dtype=torch.float64)
    assert probe.close(zero + 5e-10, zero, probe.RECURRENCE)  # scale floor 1
    assert not probe.close(zero + 2e-9, zero, probe.RECURRENCE)
    assert not probe.close(zero.float(), zero, probe.RECURRENCE)  # dtype
    assert not probe.close(zero[:2], zero, probe.RECURRENCE)  # shape
    assert not probe.close((zero,), zero, probe.RECURRENCE)  # not a tensor


def test_recurrence_tolerance_fails_on_nan_and_matched_inf():
    want = torch.tensor([1.0, 2.0], dtype=torch.float64)
    nan = torch.tensor([float("nan"), 2.0], dtype=torch.float64)
    assert not probe.close(nan, want, probe.RECURRENCE)
    assert not probe.close(want, nan, probe.RECURRENCE)
    assert not probe.close(nan, nan, probe.RECURRENCE)
    inf = torch.tensor([math.inf, 2.0], dtype=torch.float64)
    assert not probe.close(inf, want, probe.RECURRENCE)
    assert not probe.close(inf, inf, probe.RECURRENCE)  # inf - inf is NaN
    # the bound follows the expected value's largest entry, which an expected inf makes infinite
    assert probe.close(want, inf, probe.RECURRENCE)


def test_rounding_tolerance_counts_ulps_of_the_largest_entry():
    eps = torch.finfo(torch.float32).eps
    want = torch.tensor([1.0, 100.0], dtype=torch.float32)
    assert probe.close(want + torch.tensor([0.0, 32 * 100 * eps]), want, probe.ROUNDING)
    assert not probe.close(want + torch.tensor([0.0, 128 * 100 * eps]), want, probe.ROUNDING)
    zero = torch.zeros(2, dtype=torch.float32)
    assert probe.close(zero, zero, probe.ROUNDING)  # exactly equal at scale 0 (the bound floors at tiny)
    assert not probe.close(zero + 1e-30, zero, probe.ROUNDING)
    assert probe.ROUNDING.bound(torch.float32, 0.0) == 64 * eps * torch.finfo(torch.float32).tiny
    assert probe.close(torch.empty(0), torch.empty(0), probe.ROUNDING)


def test_rounding_tolerance_needs_non_finite_entries_to_match():
    a = torch.tensor([math.nan, math.inf, -math.inf, 1.0], dtype=torch.float64)
    assert probe.close(a.clone(), a, probe.ROUNDING)  # NaN equal to NaN, infs of one sign
    b = a.clone()
    b[1] = -math.inf
    assert not probe.close(b, a, probe.ROUNDING)
    c = a.clone()
    c[0] = 0.0
    assert not probe.close(c, a, probe.ROUNDING)
    # a finite value where an inf is expected fails (unlike RECURRENCE), and the scale is over the entries finite
    # on both sides: an inf elsewhere does not widen the bound
    d = torch.tensor([math.inf, 1.0], dtype=torch.float64)
    assert not probe.close(torch.tensor([1e300, 1.0], dtype=torch.float64), d, probe.ROUNDING)
    f = torch.tensor([math.inf, 1.0 + 1e-6], dtype=torch.float64)
    assert not probe.close(f, d, probe.ROUNDING)


def test_rounding_tolerance_is_exact_on_integers():
    x = torch.tensor([1, 2, 3])
    assert probe.close(x.clone(), x, probe.ROUNDING)
    assert not probe.close(x + torch.tensor([0, 0, 1]), x, probe.ROUNDING)


def test_identical_is_entrywise_with_nan_equal():
    a = torch.tensor([math.nan, 0.0, -0.0, 1.0])
    b = torch.tensor([math.nan, -0.0, 0.0, 1.0 + 1e-7])
    assert probe.identical(a, b).tolist() == [True, True, True, False]
