"""Triton tree-attention kernels (GPU; on CPU with TRITON_INTERPRET=1). Registers impl ``"triton"``.

``brcompile.backends.attention.op`` imports this package when ``impl="triton"`` (or ``"auto"`` on CUDA) is first
requested; importing it registers ``AttentionImpl("triton", forward=tree_attention_forward,
backward=tree_attention_backward, supports_window=True, supports_softcap=True, supports_alibi=True,
supports_relbias=True, supports_alibi_grad=True)`` (both take a ``TreeAttentionArgs``): sliding windows over tree
positions, logit soft-capping (``c * tanh(scale * q.k / c)``, Gemma2), ALiBi biases (``m[h] * (position[k] -
position[q])``, constant or trainable slopes) and relative biases (``R[h, q, min(position[q] - position[k], E -
1)]``, with the table's gradient) run in the kernels.
The impl runs on CUDA tensors, and on any device when Triton's interpreter is active (TRITON_INTERPRET=1
set before triton is imported).
"""
from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "brcompile.backends.attention.triton needs the `triton` package (pip install 'brcompile[triton]', "
        "triton>=3.6); use impl='cpu' or impl='reference' without it"
    ) from e

from brcompile.backends.attention.op import AttentionImpl, register_attention_impl

from .launch import *  # noqa: F401,F403  (the package re-exports the module's public names)
from .launch import __all__, is_interpreter, tree_attention_backward, tree_attention_forward

register_attention_impl(
    AttentionImpl(
        name="triton",
        forward=tree_attention_forward,
        backward=tree_attention_backward,
        device_types=None if is_interpreter() else frozenset({"cuda"}),
        supports_window=True,
        supports_softcap=True,
        supports_alibi=True,
        supports_relbias=True,
        supports_alibi_grad=True,
    )
)
