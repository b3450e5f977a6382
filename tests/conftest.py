"""Shared test setup: strict mode (BRCOMPILE_STRICT=1), TRITON_INTERPRET=1 without a GPU, threads per xdist
worker, the repo root on sys.path (for ``examples`` / ``benchmarks`` / ``tests.helpers``), fresh Dynamo state and
fresh brcompile counters in every test; the ``float64_norms`` fixture. Shared plain helpers are in tests/helpers.py."""
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

# Under pytest-xdist (README's test command runs ``-n auto``: one worker per core) each worker gets its share
# of the cores for torch's intra-op threads and Inductor's compile pool, so workers do not oversubscribe them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    _share = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_share)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(_share))

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


@pytest.fixture
def float64_norms(monkeypatch):
    """HF's RMSNorms (Llama, Qwen2, Qwen3, Mistral, Gemma3) with their math in the model's dtype instead of
    float32: a float64 model's gradients can then be held to the float64 bound (tests/models/test_hf.py's
    docstring says why HF's float32 norm gives the float32 bound only). Skips without transformers."""
    from tests.helpers import gemma_rmsnorm_in_input_dtype, rmsnorm_in_input_dtype, transformers_or_skip

    transformers_or_skip()
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    for cls in (LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, MistralRMSNorm):
        monkeypatch.setattr(cls, "forward", rmsnorm_in_input_dtype)
    monkeypatch.setattr(Gemma3RMSNorm, "forward", gemma_rmsnorm_in_input_dtype)
