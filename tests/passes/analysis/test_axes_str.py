"""``str(TokenAxes)`` of every fact the rules produce (explain and debug logs print them)."""
import torch.fx as fx

from brcompile.passes.analysis.axes import CONST, DENSE, Window, token


def test_str_of_region_facts():
    """A sort's result tuple carries ``points=("pair",)`` (one element); an index ``points=(f, order)`` with
    ``order`` a node or None; group offsets ``groups``: each prints without raising."""
    g = fx.Graph()
    perm = g.placeholder("perm")
    w = Window()
    assert str(token(1, None, 0, w, flat=2, order=perm, points=("pair",))) == \
        "token(row=None, pos=0, flat=2, order=perm, points=(pair))"
    assert str(token(1, None, 0, w, flat=2, order=perm, points=(2, None))) == \
        "token(row=None, pos=0, flat=2, order=perm, points=(2, None))"
    assert str(token(1, None, 0, w, flat=2, points=(1, perm))) == "token(row=None, pos=0, flat=2, points=(1, perm))"
    assert str(token(1, None, 0, w, groups=("offsets", perm))) == "token(offsets of perm)"
    assert str(token(3, 0, 1, w)) == "token(row=0, pos=1)"
    assert (str(CONST), str(DENSE)) == ("const", "dense")
