"""packed_logprob: next-token log-probs and entropy without the [N, V] logits (op.py: the op, its torch
path and impl registry; triton.py: the Triton kernels)."""
