"""Shared test setup: the repo root on sys.path (for ``examples``/``benchmarks``), fresh Dynamo state
and fresh brcompile counters in every test."""
import sys
from pathlib import Path

import pytest
import torch

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
