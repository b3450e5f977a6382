"""Provenance of the packed graph is torch.fx's own (passes/meta.py: record_origin): every node the rewrite made
records the node it came from in ``node.meta["from_node"]`` as a list of ``torch.fx.traceback.NodeSource``, so
torch's readers and tracers work on the packed graph, and the dump's origin column (brcompile/tools/dump.py) reads
the same names as before."""
import json
import re

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.traceback import NodeSource, NodeSourceAction, get_graph_provenance_json, preserve_node_meta

from brcompile.passes import meta
from brcompile.passes.pipeline import PipelineConfig, run_pipeline
from brcompile.tools.dump import after_source
from examples.gpt import GPT, GPTConfig
from tests.helpers import capture

PACK = "brcompile.passes.emit.pack"
FUSE = "brcompile.passes.emit.fuse_logprob"


def _packed():
    """(the analysed graph, the packed graph) of a one-layer GPT's next-token loss (its read-out fused)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1)).double()
    ids = torch.randint(0, 64, (4, 20))
    ids[:, :12] = ids[0, :12]

    def loss(ids):
        logp = F.log_softmax(model(ids)[:, :-1], -1)
        return -logp.gather(-1, ids[:, 1:, None]).mean()

    gm, inputs = capture(loss, ids)
    state = run_pipeline(gm, inputs, PipelineConfig(training=True))
    return state.gm, state.packed


def _provenance_json(graph: fx.Graph) -> dict:
    """torch's provenance JSON of ``graph`` (a dict; a JSON string on some torch versions)."""
    prov = get_graph_provenance_json(graph)
    return json.loads(prov) if isinstance(prov, str) else prov


def _sources(node: fx.Node) -> list:
    sources = node.meta["from_node"]
    assert isinstance(sources, list) and sources, (node.name, sources)
    assert all(isinstance(s, NodeSource) for s in sources), (node.name, sources)
    return sources


def test_packed_nodes_record_torch_provenance():
    """Each packed node with an origin carries a list of NodeSource whose last entry is the analysed node it was
    made from, by the packer or the log-prob fusion (the fused read-out: from the gather it replaces)."""
    analysed, packed = _packed()
    originals = {n.name: n for n in analysed.graph.nodes}
    recorded = [n for n in packed.graph.nodes if meta.has_origin(n)]
    assert len(recorded) > len([n for n in packed.graph.nodes if n.op == "call_function"]) // 2
    for n in recorded:
        last = _sources(n)[-1]
        assert last.name in originals and last.name == meta.origin_name(n), n.name
        assert last.pass_name in (PACK, FUSE) and last.action == [NodeSourceAction.CREATE], n.name
        assert last.target == str(originals[last.name].target), n.name
    fused = [n for n in packed.graph.nodes if n.target is torch.ops.brcompile.packed_logprob.default]
    assert len(fused) == 1 and _sources(fused[0])[-1].pass_name == FUSE and meta.origin_name(fused[0]) == "gather"


def test_origin_name_reads_only_torch_provenance():
    """record_origin nests the source's own provenance; origin_name is the last source's name, None without."""
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.neg, (x,))
    z = g.call_function(torch.neg, (y,))
    assert not meta.has_origin(z) and meta.origin_name(z) is None
    meta.record_origin(y, x, "an earlier pass")
    meta.record_origin(z, y, "a pass")
    assert meta.origin_name(z) == "neg" and meta.origin_name(y) == "x"
    assert [s.name for s in z.meta["from_node"][-1].from_node] == ["x"]
    z.meta["from_node"] = []
    assert meta.has_origin(z) and meta.origin_name(z) is None


def test_torch_reads_and_extends_the_packed_graphs_provenance():
    """torch's own readers: print_readable, the provenance JSON (which swallows errors and returns {} on a
    malformed entry), and a retrace under preserve_node_meta, whose nodes nest our NodeSource in theirs."""
    analysed, packed = _packed()
    originals = {n.name for n in analysed.graph.nodes}
    assert "tree_attention" in packed.print_readable(print_output=False)
    prov = _provenance_json(packed.graph)
    assert prov and any(prov.values())
    assert {entries[-1]["name"] for entries in prov.values() if entries} <= originals
    with preserve_node_meta():
        retraced = fx.Transformer(packed).transform()
    assert _provenance_json(retraced.graph)
    ours = {n.name: n.meta["from_node"][-1] for n in packed.graph.nodes if meta.has_origin(n)}
    seen = 0
    for n in retraced.graph.nodes:
        if n.op != "call_function":
            continue
        outer = _sources(n)[-1]  # the retrace's: made from the packed node of the same name
        assert outer.pass_name.startswith("Interpreter") and outer.name in {m.name for m in packed.graph.nodes}
        if outer.name in ours:
            assert [f.to_dict() for f in outer.from_node] == [ours[outer.name].to_dict()], n.name  # ours, whole
            seen += 1
        assert "pass_name=" in str(outer)  # NodeSource.print_readable walks the nested provenance
    assert seen > 10


def test_dump_shows_each_nodes_origin_as_before():
    """The dump's ``packed <- original`` column: a copy names its original, the fused read-out the gather it
    replaces, a tree input the node it stands for (the position ids), glue nodes '-'."""
    analysed, packed = _packed()
    text = after_source(packed, {n.name: n for n in analysed.graph.nodes}, '"""header"""\n')
    rows = {}
    for line in text.split("# packed node <- original node")[1].splitlines()[1:]:
        name, _, origin, kind = re.sub(r"\s+", " ", line.lstrip("#").strip()).split(" ")
        rows[name] = (origin, kind)
    for n in packed.graph.nodes:
        if n.op != "output":
            assert rows[n.name][0] == (meta.origin_name(n) or "-"), n.name
    assert rows["packed_logprob_default"] == ("gather", "brcompile")
    assert rows["tree_position"] == ("positions", "tree")
    assert rows["linear"] == ("linear", "token") and rows["tree_index"] == ("-", "tree")
