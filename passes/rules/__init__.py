"""Per-op token-axis rules, by op family. Importing this package fills ``passes.axes.RULES``.

Each rule proves that its op keeps a TOKEN value causal and row-independent (and says where the token
dims go), or hands the value to the dense side. See the docstring of each rule for its math.
"""
from brcompile.passes.rules import attention, linalg, pointwise, positions, reduce, shape  # noqa: F401
