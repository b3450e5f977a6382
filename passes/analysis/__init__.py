"""The analysis: the tree inputs (tree_inputs.py, decode.py), masks (mask_stage.py, masks.py,
input_masks.py), token-axis facts (axes.py, rules/), dense regions packed again (repack.py), per-call
guards (guards.py), live positions (liveness.py)."""
