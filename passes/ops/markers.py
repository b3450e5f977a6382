"""brcompile's own markers in an analysis graph: ``packed_again`` (a dense value packed again).
"""
from __future__ import annotations

import torch

from brcompile.passes.ops.registry import register_op


def packed_again(x: torch.Tensor, row: int, pos: int) -> torch.Tensor:
    """The analysis graph's marker of a re-packed value (passes/analysis/repack.py): ``x`` itself on dense values
    (so the analysis graph still evaluates, for probes); the packed graph emits ``repack_tokens`` in its place."""
    return x


register_op("packed_again", spellings=(packed_again,), axes="_repack_rule")
