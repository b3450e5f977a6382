"""Shared test setup: strict mode (BRCOMPILE_STRICT=1), TRITON_INTERPRET=1 without a GPU, the repo root on
sys.path (for ``examples`` / ``benchmarks``), fresh Dynamo state and fresh brcompile counters in every test."""
import os
import sys
from pathlib import Path

# The suite runs the backend strict: an internal error of a pass (anything but CannotReplay) raises
# instead of silently running the original graph, so a bug cannot hide behind an exact fallback. Set
# before any test imports brcompile (the default backend reads it when it is made, at import).
# BRCOMPILE_STRICT=0 in the environment turns it off; tests of the internal-error fallback itself pass
# strict=False (tests/test_strict.py).
os.environ.setdefault("BRCOMPILE_STRICT", "1")

import torch  # noqa: E402

# Triton kernels run in the interpreter on machines without a GPU (CI). It must be set before anything
# imports triton (torch.utils.flop_counter and the backends may), so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    import brcompile

    torch._dynamo.reset()
    brcompile.reset_stats()
    yield
    torch._dynamo.reset()
