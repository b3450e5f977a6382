"""Causal scans along the tree paths: tree_parent, tree_cumsum, tree_causal_conv1d, tree_linear_scan (op.py),
tree_matrix_scan (matrix.py), their impl registry (op.py) and their Triton kernels (triton.py)."""
