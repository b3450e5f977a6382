"""passes/meta.py: every fact the passes record has one accessor, under the key a dump shows, and the passes
write and read them only through it."""
import pathlib
import re

import pytest
import torch
import torch.fx as fx

from brcompile.passes import meta
from brcompile.passes.analysis.axes import CONST, get_axes, set_axes
from brcompile.passes.lower.checkpoint import region_of

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _node() -> fx.Node:
    g = fx.Graph()
    return g.placeholder("x")


def test_keys_are_the_recorded_ones():
    """The key strings stay as dumps and logs show them; no two facts share one."""
    assert [f.key for f in meta.NODE_FACTS] == [
        "br_axes", "br_repack_axes", "br_ckpt", "br_checkpoint", "br_ckpt_region", "br_canonical", "br_softcap",
        "br_relbias_zero", "br_relbias_source", "br_fused", "br_fused_covers"]
    assert [f.key for f in meta.GRAPH_FACTS] == ["br_token_outputs", "br_sequences", "br_rows", "br_written_inputs"]
    assert all(f.__doc__ and len(f.__doc__) > 40 for f in (*meta.NODE_FACTS, *meta.GRAPH_FACTS))


def test_node_fact_round_trip():
    n = _node()
    assert not meta.SOFTCAP.has(n) and meta.SOFTCAP.get(n) is None and meta.SOFTCAP.get(n, 0.0) == 0.0
    with pytest.raises(meta.FactMissing, match="br_softcap"):
        meta.SOFTCAP.require(n)
    meta.SOFTCAP.set(n, 30.0)
    assert n.meta["br_softcap"] == 30.0 and meta.SOFTCAP.require(n) == 30.0 and meta.SOFTCAP.has(n)
    other = _node()
    meta.SOFTCAP.copy(n, other)
    meta.RELBIAS_ZERO.copy(n, other)  # absent on n: not written
    assert meta.SOFTCAP.get(other) == 30.0 and "br_relbias_zero" not in other.meta


def test_nested_fact_lives_in_custom_and_keeps_other_entries():
    """The checkpoint index rides in ``meta["custom"]`` (what the export copies); writing it keeps what else is
    there and replaces the dict, so a copy the tracer holds is not changed behind its back."""
    n = _node()
    assert meta.CHECKPOINT_INDEX.get(n) is None and not meta.CHECKPOINT_INDEX.has(n)
    before = {"other": 1}
    n.meta["custom"] = before
    meta.CHECKPOINT_INDEX.set(n, 3)
    assert n.meta["custom"] == {"other": 1, "br_ckpt_region": 3} and before == {"other": 1}
    assert meta.CHECKPOINT_INDEX.require(n) == 3


def test_graph_fact_defaults():
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    assert (meta.TOKEN_OUTPUTS.get(gm), meta.SEQUENCES.get(gm), meta.ROWS.get(gm), meta.WRITTEN_INPUTS.get(gm)) \
        == ((), None, False, ())
    meta.WRITTEN_INPUTS.set(gm, (0, 2))
    assert gm.br_written_inputs == (0, 2) and meta.WRITTEN_INPUTS.get(gm) == (0, 2)


def test_axes_and_checkpoint_helpers_go_through_the_accessors():
    n = _node()
    with pytest.raises(KeyError):
        get_axes(n)
    set_axes(n, CONST)
    assert n.meta["br_axes"] is CONST and meta.AXES.get(n) is CONST
    assert region_of(n) is None
    meta.CHECKPOINT_REGION.set(n, "region")
    assert region_of(n) == "region"


def test_no_raw_key_reads_left():
    """Outside passes/meta.py no code reads or writes a fact, or torch.fx's provenance (``from_node``, written
    only by ``meta.record_origin``), by its raw key (docs may name the keys in ``literals`` and prose strings)."""
    keys = "|".join(re.escape(k) for k in (*(f.key for f in (*meta.NODE_FACTS, *meta.GRAPH_FACTS)), meta.FROM_NODE))
    raw = re.compile(rf"""(meta(\.get)?\s*[\[(]\s*["']({keys})["']|attr\([^)]*["']({keys})["']|\.({keys})\s*=)""")
    found = [f"{p.relative_to(ROOT)}:{i}" for d in ("passes", "backends", "brcompile") for p in (ROOT / d).rglob("*.py")
             if p.name != "meta.py" for i, line in enumerate(p.read_text().splitlines(), 1)
             if raw.search(re.sub(r'``.*?``|"[^"]* [^"]*"', "", line.split("#")[0]))]
    assert found == []
