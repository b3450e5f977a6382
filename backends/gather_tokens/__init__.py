"""``brcompile::gather_tokens``: the packed token axis of a context-parallel group gathered (backends/gather_tokens/op.py)."""
