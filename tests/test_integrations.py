"""brcompile/integrations.py: ``compile_decoder`` (an HF model's decoder compiled in place) and
``BranchReplayCallback`` (the same when a trainer begins training); ``import brcompile`` needs no transformers.
The end-to-end TRL runs are in tests/examples/test_trainers.py."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import brcompile
from brcompile.integrations import NoDecoderError, compile_decoder, find_decoder, keep_one_input_grad_hook
from tests.helpers import hf_tiny_model, transformers_or_skip

ROOT = Path(__file__).resolve().parents[1]


def test_import_without_transformers():
    """With transformers and trl unimportable, ``import brcompile`` works and names ``compile_decoder``;
    ``brcompile.BranchReplayCallback`` raises the ImportError of transformers."""
    code = textwrap.dedent("""
        import sys
        sys.modules["transformers"] = None  # import transformers -> ImportError
        sys.modules["trl"] = None
        import brcompile
        assert callable(brcompile.compile_decoder)
        try:
            brcompile.BranchReplayCallback
        except ImportError:
            print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_find_decoder_and_compile_in_place():
    """``Qwen2ForCausalLM``'s decoder is its ``Qwen2Model`` (``get_decoder``), a bare ``Qwen2Model`` its own; it is
    compiled in place once (a second call with the same backend leaves it), and a module without a decoder is a
    NoDecoderError."""
    model = hf_tiny_model("qwen2")
    assert find_decoder(model) is model.model
    assert find_decoder(model.model) is model.model
    backend = brcompile.backend(compiler="eager")
    decoder = compile_decoder(model, backend)
    assert decoder is model.model and decoder._compiled_call_impl is not None
    first = decoder._compiled_call_impl
    assert compile_decoder(model, backend) is decoder and decoder._compiled_call_impl is first
    with pytest.raises(NoDecoderError):
        find_decoder(torch.nn.Linear(2, 2))


def test_checkpointing_toggles_keep_one_embedding_hook():
    """transformers adds an input-embedding hook at every ``gradient_checkpointing_enable`` and removes none at
    ``gradient_checkpointing_disable``; after ``keep_one_input_grad_hook`` toggling checkpointing (as TRL does
    around each generation) adds none, and the embedding output still requires grad."""
    model = hf_tiny_model("qwen2")
    model.gradient_checkpointing_enable()
    hooks = model.model.embed_tokens._forward_hooks
    for _ in range(3):
        model.gradient_checkpointing_disable()
        model.gradient_checkpointing_enable()
    leaked = len(hooks)
    assert leaked == 4, leaked  # one more per toggle: what made Dynamo recompile every TRL step
    assert keep_one_input_grad_hook(model) and not keep_one_input_grad_hook(model)
    for _ in range(3):
        model.gradient_checkpointing_disable()
        model.gradient_checkpointing_enable()
    assert len(hooks) == leaked, len(hooks)  # the last enable's hook replaced, no more added
    assert model.model.embed_tokens(torch.tensor([[1, 2]])).requires_grad


def test_callback_compiles_on_train_begin():
    """``BranchReplayCallback`` is a ``TrainerCallback`` whose ``on_train_begin`` compiles the model's decoder;
    without a model it raises NoDecoderError."""
    transformers = transformers_or_skip()
    backend = brcompile.backend(compiler="eager")
    cb = brcompile.BranchReplayCallback(backend)
    assert isinstance(cb, transformers.TrainerCallback)
    model = hf_tiny_model("qwen2")
    cb.on_train_begin(None, None, None, model=model)
    assert model.model._compiled_call_impl is not None and model.model._brcompile_backend is backend
    with pytest.raises(NoDecoderError):
        cb.on_train_begin(None, None, None)
