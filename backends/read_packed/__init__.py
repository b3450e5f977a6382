"""read_packed: dense reads of packed values with 0 at dropped positions, and DroppedPositionGradError (op.py)."""
