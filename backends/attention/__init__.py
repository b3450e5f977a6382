"""Tree attention, one op and its implementations under one name: the op, its schema, checks and
impl registry (op.py), its optional features (features.py), the implementations: reference.py (the
float64 oracle), cpu.py (the segment-pair schedule), flex.py (FlexAttention), the Triton kernels
(backends/triton/tree_attention.py); cached.py, the streaming op against cached prefix K/V."""
