"""One line to put an HF model (and TRL's trainers) on ``branch_replay``, the trainer's code unchanged.

- ``compile_decoder(model)``: compiles the model's decoder (the transformer stack, not the LM head) in place
  with ``nn.Module.compile(backend=...)``; everything that calls the model (the training forward, ``generate``'s
  prefill and decode steps) then runs through the backend. The decoder is ``model.get_decoder()`` (transformers'
  lookup), else the submodule named by ``model.base_model_prefix``.
- ``BranchReplayCallback()``: a ``transformers.TrainerCallback`` that calls ``compile_decoder`` on the trainer's
  model at ``on_train_begin``: ``GRPOTrainer(..., callbacks=[BranchReplayCallback()])`` (any ``Trainer``); with
  gradient accumulation it makes each optimizer step a cross-call window (brcompile/runtime/window/).

Why not ``GRPOConfig(torch_compile_backend="branch_replay")``: transformers hands that name to accelerate,
whose ``DynamoBackend`` enum admits its own members only (``'BRANCH_REPLAY' is not a valid DynamoBackend``).

Importing this module needs neither transformers nor trl: ``BranchReplayCallback`` is made (subclassing
``TrainerCallback``) on first access.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["NoDecoderError", "accelerate_sync_gradients", "compile_decoder", "find_decoder", "keep_one_input_grad_hook"]  # and BranchReplayCallback, made on first access

#: attribute set on a decoder compiled by :func:`compile_decoder` (the backend it was compiled with)
_COMPILED_WITH = "_brcompile_backend"
#: attribute marking the ``enable_input_require_grads`` that :func:`keep_one_input_grad_hook` installed
_ONE_HOOK = "_brcompile_one_hook"


class NoDecoderError(TypeError):
    """The model has no decoder submodule to compile (neither ``get_decoder()`` nor ``base_model_prefix`` names
    one): compile the right module yourself with ``module.compile(backend="branch_replay")``."""


def find_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder of an HF model: ``model.get_decoder()`` (``Qwen2ForCausalLM`` -> its ``Qwen2Model``; a bare
    ``Qwen2Model`` -> itself), else ``getattr(model, model.base_model_prefix)``; NoDecoderError when neither
    gives an ``nn.Module``."""
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        decoder = get_decoder()
        if isinstance(decoder, torch.nn.Module):
            return decoder
    prefix = getattr(model, "base_model_prefix", None)
    decoder = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    if isinstance(decoder, torch.nn.Module):
        return decoder
    raise NoDecoderError(f"{type(model).__name__} has no get_decoder() and no base_model_prefix submodule: "
                         f"compile its transformer stack with module.compile(backend='branch_replay')")


def keep_one_input_grad_hook(model: torch.nn.Module) -> bool:
    """Makes ``model.enable_input_require_grads()`` replace the forward hooks it registered before instead of
    adding more; True when it did (False for a model without ``enable_input_require_grads`` /
    ``disable_input_require_grads``, or already done).

    Why: transformers' ``gradient_checkpointing_enable`` registers one more hook on the input embedding
    (``make_inputs_require_grads``) every time, and ``gradient_checkpointing_disable`` removes them only for a
    PEFT model. TRL turns checkpointing off around every generation and on again after it, so the embedding
    gains a hook every step; Dynamo guards on the number of hooks, recompiles the decoder every step and, past
    ``torch._dynamo.config.recompile_limit``, runs it eagerly without notice. The hook only sets
    ``requires_grad`` on the embedding's output, so one copy does what any number of copies do: the model
    computes the same values and gradients."""
    enable = getattr(model, "enable_input_require_grads", None)
    disable = getattr(model, "disable_input_require_grads", None)
    if not (callable(enable) and callable(disable)) or getattr(enable, _ONE_HOOK, False):
        return False

    def enable_input_require_grads():
        disable()  # the hooks the previous call registered
        enable()

    setattr(enable_input_require_grads, _ONE_HOOK, True)
    enable_input_require_grads.__doc__ = enable.__doc__
    model.enable_input_require_grads = enable_input_require_grads
    return True


def compile_decoder(model: torch.nn.Module, backend: Any = "branch_replay", **compile_kwargs) -> torch.nn.Module:
    """Compiles ``model``'s decoder (:func:`find_decoder`) in place with ``backend`` (the name, or a
    ``brcompile.backend(...)`` object) and returns the decoder. The LM head stays eager: TRL computes its
    log-probs from the hidden states itself. A decoder this function already compiled with the same backend is
    left as it is (``Trainer.train`` called twice); ``compile_kwargs`` go to ``nn.Module.compile``. Toggling
    gradient checkpointing (TRL does around every generation) then adds no embedding hook per step
    (:func:`keep_one_input_grad_hook`), so Dynamo stops recompiling after the first steps."""
    decoder = find_decoder(model)
    keep_one_input_grad_hook(model)
    if getattr(decoder, _COMPILED_WITH, None) is backend:
        log.debug("branch_replay: %s already compiled", type(decoder).__name__)
        return decoder
    decoder.compile(backend=backend, **compile_kwargs)
    setattr(decoder, _COMPILED_WITH, backend)
    log.info("branch_replay: compiled %s (the decoder of %s) in place", type(decoder).__name__,
             type(model).__name__)
    return decoder


def accelerate_sync_gradients() -> bool:
    """accelerate's ``GradientState().sync_gradients``: true during the last micro-batch of an optimizer step
    (HF's Trainer sets it before each micro-batch's forward); a cross-call window ends at that call."""
    from accelerate.state import GradientState

    return bool(GradientState().sync_gradients)


def _callback_class() -> type:
    """``BranchReplayCallback``, a ``transformers.TrainerCallback`` subclass (transformers imported here)."""
    from transformers import TrainerCallback

    class BranchReplayCallback(TrainerCallback):
        """Compiles the trainer's model's decoder with ``branch_replay`` (:func:`compile_decoder`) when training
        begins: ``GRPOTrainer(..., callbacks=[BranchReplayCallback()])``. ``backend``: the backend name or a
        ``brcompile.backend(...)`` object; ``compile_kwargs`` go to ``nn.Module.compile``.

        With gradient accumulation (``gradient_accumulation_steps > 1``) and ``windows=True``, each optimizer
        step's micro-batches are one cross-call window (brcompile/runtime/window/): opened when the step begins,
        ended by the call during which accelerate's ``GradientState().sync_gradients`` is true (the Trainer sets it
        for the step's last micro-batch before its forward), closed when the step ends. A prefix the step's rows
        share is then computed once, whichever micro-batches its rows land in. Windows need the streaming split:
        the default backend becomes ``brcompile.backend(mode="replay")`` then; a backend object of yours is used
        as it is (``mode="packed"`` shares within each call only)."""

        def __init__(self, backend: Any = "branch_replay", windows: bool = True, **compile_kwargs):
            self.backend = backend
            self.windows = windows
            self.compile_kwargs = compile_kwargs
            self._use_windows = False
            self._window = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if model is None:
                raise NoDecoderError("the trainer passed no model to on_train_begin: nothing to compile")
            self._use_windows = self.windows and getattr(args, "gradient_accumulation_steps", 1) > 1
            backend = self.backend
            if self._use_windows and backend == "branch_replay":
                import brcompile

                backend = self.backend = brcompile.backend(mode="replay")
            compile_decoder(model, backend, **self.compile_kwargs)

        def on_step_begin(self, args, state, control, **kwargs):
            if not self._use_windows:
                return
            from brcompile.runtime.window import Window

            self._close()  # a step that raised before its end left its window open: drop it
            self._window = Window(last=accelerate_sync_gradients)
            self._window.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            self._close()

        def on_train_end(self, args, state, control, **kwargs):
            self._close()

        def _close(self):
            w, self._window = self._window, None
            if w is not None:
                w.__exit__(None, None, None)

    BranchReplayCallback.__module__ = __name__
    BranchReplayCallback.__qualname__ = "BranchReplayCallback"
    return BranchReplayCallback


_LAZY: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """``BranchReplayCallback`` on first access (module ``__getattr__``: importing this module needs no
    transformers)."""
    if name == "BranchReplayCallback":
        if name not in _LAZY:
            _LAZY[name] = _callback_class()
        return _LAZY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
