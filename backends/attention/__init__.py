"""Tree attention, one op and its implementations under one name: the op, its schema, checks and
impl registry (op.py), its optional features (features.py), the implementations: reference.py (the
float64 oracle), cpu.py (the segment-pair schedule; cpu_kernel.py, when the compiled kernel runs instead),
flex.py (FlexAttention), the Triton kernels (triton/); cached.py, the streaming op against cached prefix K/V."""
