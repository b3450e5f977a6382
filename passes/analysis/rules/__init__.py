"""Per-op token-axis rules, by op family. Importing this package fills ``passes.analysis.axes.AXIS_RULES``; the op
records (passes/ops/) name the rule each op uses.

Passes that are not rules live next to this package: ``passes/canonical/attention/`` (eager softmax chains ->
SDPA, run before propagation) and ``passes/emit/fuse_logprob.py`` (LM head + log-softmax read-outs ->
``brcompile::packed_logprob``; it registers the ``cross_entropy`` rule it fuses).

Each rule proves that its op keeps a TOKEN value causal and row-independent (and says where the token
dims go), or hands the value to the dense side. See the docstring of each rule for its math.
"""
from brcompile.passes.analysis.rules import (  # noqa: F401
    attention, linalg, matrix_scan, moe, pointwise, positions, reduce, scan, shape,
)
