"""brcompile's compiled CPU kernels: one torch C++ extension, built on first use, registering ``brcompile_cpu::`` ops.

- ``tree_attention.cpp``: tree attention in one pass over the tree (``tree_attention_forward`` / ``_backward``), the
  "cpu" attention impl's kernel (backends/attention/cpu_kernel.py says when it runs);
- ``prefix_tree.cpp``: the prefix tree of a batch and the positions left out of it (``prefix_tree``,
  ``drop_positions``), the CPU path of brcompile/runtime/tree.

Each replaces a chain of small torch calls whose per-call cost dominates at RL batch sizes on a CPU (a tree of a
few thousand tokens: dozens of flash-attention calls per layer, hundreds of vectorised index ops per tree). The
torch paths stay: on other devices, for what a kernel does not take, and when the build fails.

**The build** (:func:`available`): ``torch.utils.cpp_extension.load`` compiles both sources with the vector
instruction set torch reports (``torch.backends.cpu.get_cpu_capability()``: at::vec's AVX2 / AVX512 flags) into
torch's extensions directory (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), once per machine:
about 20 s, then a load of well under a second per process. It needs the C++ compiler that Inductor needs on a
CPU anyway. ``BRCOMPILE_CPU_KERNELS`` chooses: ``auto`` (default: build on first use; if that fails, warn once and
run the torch paths), ``0`` (never use the kernels), ``1`` (use them; a failed build raises
:class:`CpuKernelError`).
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

__all__ = ["CpuKernelError", "SOURCES", "available", "mode", "require", "unavailable_reason"]

SOURCES = tuple(Path(__file__).with_name(name) for name in ("tree_attention.cpp", "prefix_tree.cpp"))

#: at::vec's flags per vector instruction set (ATen/cpu/vec), by ``torch.backends.cpu.get_cpu_capability()``.
_ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma", "-mf16c"],
}


class CpuKernelError(RuntimeError):
    """The compiled CPU kernels could not be built or loaded (with ``BRCOMPILE_CPU_KERNELS=1``)."""


def mode() -> str:
    """``BRCOMPILE_CPU_KERNELS``: ``"auto"`` (default), ``"0"`` (off) or ``"1"`` (on; a failed build raises)."""
    value = os.environ.get("BRCOMPILE_CPU_KERNELS", "auto").strip().lower()
    return {"off": "0", "false": "0", "no": "0", "on": "1", "true": "1", "yes": "1"}.get(value, value)


_LOCK = threading.Lock()
_STATE: dict = {}  # "ok": whether the build worked, once tried; "error": why it did not


def _build() -> None:
    """Compile (or find in torch's cache) and load the extension; its ops register themselves."""
    from torch.utils import cpp_extension

    isa = torch.backends.cpu.get_cpu_capability()
    log.info("brcompile: loading the compiled CPU kernels (%s; the first time on a machine compiles them, ~20 s)",
             isa)
    cpp_extension.load(name=f"brcompile_cpu_{isa.lower()}", sources=[str(s) for s in SOURCES],
                       extra_cflags=["-O3", "-std=c++17", "-fopenmp", *_ISA_FLAGS.get(isa, [])],
                       extra_ldflags=["-fopenmp"], is_python_module=False,
                       verbose=log.isEnabledFor(logging.DEBUG))


def available() -> bool:
    """Whether the kernels are loaded, building them on the first call (never with ``BRCOMPILE_CPU_KERNELS=0``)."""
    if mode() == "0":
        return False
    if "ok" not in _STATE:
        with _LOCK:
            if "ok" not in _STATE:
                try:
                    _build()
                    _STATE["ok"] = True
                except Exception as e:  # no compiler or headers, a failed build: the torch paths run instead
                    last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
                    _STATE.update(ok=False, error=f"{type(e).__name__}: {last}")
                    log.warning("brcompile: the compiled CPU kernels could not be built (%s); tree building and "
                                "tree attention on the CPU run as torch ops", _STATE["error"])
    if not _STATE["ok"] and mode() == "1":
        raise CpuKernelError(f"BRCOMPILE_CPU_KERNELS=1 but the compiled CPU kernels could not be built: "
                             f"{_STATE['error']}")
    return _STATE["ok"]


def unavailable_reason() -> Optional[str]:
    """Why the kernels are not used (None when they are, or before the first try)."""
    if mode() == "0":
        return "BRCOMPILE_CPU_KERNELS=0"
    return _STATE.get("error")


def require() -> None:
    """CpuKernelError unless the kernels are loaded (building them if that was not tried yet)."""
    if not available():
        raise CpuKernelError(f"the compiled CPU kernels are not available: {unavailable_reason()}")
