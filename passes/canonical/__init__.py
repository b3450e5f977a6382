"""Canonicalisation: spellings of attention and of causal scans rewritten into the ops the tree runs."""
