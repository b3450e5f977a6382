"""Causal scans along the positions as tree ops: affine and state-space scans as ``linear_scan``
(linear.py, ssd.py), chunked gated delta rules as ``matrix_scan`` (delta_rule.py)."""
