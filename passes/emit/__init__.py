"""Emission: the packed graph (pack.py), fused log-probs (fuse_logprob.py), its check on the example
(check.py), the streaming split (split.py), routed pairs (routed.py)."""
