"""Lowering and normalising the captured graph: the ATen level (aten.py), activation-checkpoint bodies
inlined and outlined again (checkpoint.py), in-place ops made pure (functionalize.py), splits into one
whole piece read as their input (splits.py)."""
