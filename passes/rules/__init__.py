"""Per-op token-axis rules, by op family. Importing this package fills ``passes.axes.RULES``.

``eager_attention`` is a canonicalisation (HF's eager softmax chain -> SDPA) run before propagation;
``logprob`` fuses the LM head and log-softmax read-outs into ``brcompile::packed_logprob``.

Each rule proves that its op keeps a TOKEN value causal and row-independent (and says where the token
dims go), or hands the value to the dense side. See the docstring of each rule for its math.
"""
from brcompile.passes.rules import (  # noqa: F401
    attention, eager_attention, linalg, logprob, pointwise, positions, reduce, shape,
)
