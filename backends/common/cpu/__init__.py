"""brcompile's compiled CPU kernels: one torch C++ extension registering ``brcompile_cpu::`` ops.

- ``tree_attention.cpp``: tree attention in one pass over the tree (``tree_attention_forward`` / ``_backward``), the
  "cpu" attention impl's kernel (backends/attention/cpu_kernel.py says when it runs);
- ``prefix_tree.cpp``: the prefix tree of a batch and the positions left out of it (``prefix_tree``,
  ``drop_positions``), the CPU path of brcompile/runtime/tree.

Each replaces a chain of small torch calls whose per-call cost dominates at RL batch sizes on a CPU (a tree of a
few thousand tokens: dozens of flash-attention calls per layer, hundreds of vectorised index ops per tree). The
torch paths stay: on other devices, for what a kernel does not take, and when no library can be had.

**Where the library comes from** (:func:`available`, at the first use in a process; ``build.py`` has the details):

1. **prebuilt**: ``pip install --no-build-isolation`` compiles it into the package (``setup.py``), with a record of
   the sources, flags and torch it was built for; loaded when that record matches this process (no compiler needed);
2. **just in time**: otherwise ``torch.utils.cpp_extension`` compiles it (~20 s) into torch's extensions directory,
   under a name that carries a hash of the sources, flags and torch, so two installs never share or fight over one;
   a process waits on another's build at most ``BRCOMPILE_CPU_KERNELS_WAIT`` seconds (default 300), and a killed
   build never blocks the next;
3. **the torch paths**, when neither works.

``BRCOMPILE_CPU_KERNELS`` chooses: ``auto`` (default: 1, else 2, else warn once and 3), ``1`` (1, else 2; raise
:class:`CpuKernelError` when neither works), ``prebuilt`` (only 1, else raise), ``jit`` (only 2, else raise), ``0``
(always 3).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Optional

import torch

from . import build as _b

log = logging.getLogger(__name__)

__all__ = ["CpuKernelError", "available", "library_source", "mode", "require", "unavailable_reason"]

#: the values BRCOMPILE_CPU_KERNELS takes, after the spellings of on/off
MODES = ("auto", "0", "1", "prebuilt", "jit")
_WARNED: set = set()


class CpuKernelError(RuntimeError):
    """The compiled CPU kernels could not be had in the way ``BRCOMPILE_CPU_KERNELS`` asks for."""


def mode() -> str:
    """``BRCOMPILE_CPU_KERNELS``: one of :data:`MODES` (``auto`` by default; ``on``/``off`` spellings of 1/0)."""
    value = os.environ.get("BRCOMPILE_CPU_KERNELS", "auto").strip().lower()
    value = {"off": "0", "false": "0", "no": "0", "on": "1", "true": "1", "yes": "1"}.get(value, value)
    if value not in MODES:
        if value not in _WARNED:
            _WARNED.add(value)
            log.warning("brcompile: BRCOMPILE_CPU_KERNELS=%r is none of %s; using auto", value, ", ".join(MODES))
        return "auto"
    return value


_LOCK = threading.Lock()
_STATE: dict = {}  # "ok": whether a library loaded, once tried; "source": "prebuilt" / "jit"; "library"; "error"


def _load_prebuilt(spec: _b.BuildSpec) -> str:
    """Load the library installed with the package, if its record matches ``spec``; raise BuildError if not."""
    library, why = _b.prebuilt_library(spec)
    if library is None:
        raise _b.BuildError(why)
    torch.ops.load_library(str(library))
    return str(library)


def _build(how: str = "auto") -> dict:
    """Load the kernels' library the way ``how`` allows (prebuilt first, then just in time); its ops register
    themselves. Returns the ``_STATE`` facts of the library loaded; raises BuildError when none could be."""
    spec = _b.kernel_spec()
    reasons = []
    if how != "jit":
        try:
            library = _load_prebuilt(spec)
            log.info("brcompile: loaded the prebuilt CPU kernels %s", library)
            return {"source": "prebuilt", "library": library}
        except (_b.BuildError, OSError, RuntimeError) as e:
            if how == "prebuilt":
                raise
            reasons.append(str(e))
            log.info("brcompile: %s; building the CPU kernels just in time", e)
    try:
        built = _b.jit_build(spec, verbose=log.isEnabledFor(logging.DEBUG))
    except _b.BuildError as e:
        raise type(e)("; ".join([*reasons, str(e)])) from e  # BuildTimeout stays one
    return {"source": "jit", "library": built["library"]}


def available() -> bool:
    """Whether the kernels are loaded, loading (or building) them on the first call; never with
    ``BRCOMPILE_CPU_KERNELS=0``. Under ``auto`` a failure warns once and returns False; otherwise it raises."""
    if mode() == "0":
        return False
    if "ok" not in _STATE:
        with _LOCK:
            if "ok" not in _STATE:
                try:
                    _STATE.update(ok=True, **_build(mode()))
                except Exception as e:  # no compiler or headers, a failed build, a wait past its bound
                    last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
                    _STATE.update(ok=False, error=f"{type(e).__name__}: {last}")
                    if mode() == "auto":
                        log.warning("brcompile: the compiled CPU kernels could not be loaded or built (%s); tree "
                                    "building and tree attention on the CPU run as torch ops", _STATE["error"])
    if not _STATE["ok"] and mode() != "auto":
        raise CpuKernelError(f"BRCOMPILE_CPU_KERNELS={mode()} but the compiled CPU kernels could not be had: "
                             f"{_STATE['error']}")
    return _STATE["ok"]


def library_source() -> Optional[str]:
    """Where the loaded kernels came from: ``"prebuilt"`` or ``"jit"`` (None when none is loaded)."""
    return _STATE.get("source") if _STATE.get("ok") else None


def unavailable_reason() -> Optional[str]:
    """Why the kernels are not used (None when they are, or before the first try)."""
    if mode() == "0":
        return "BRCOMPILE_CPU_KERNELS=0"
    return _STATE.get("error")


def require() -> None:
    """CpuKernelError unless the kernels are loaded (building them if that was not tried yet)."""
    if not available():
        raise CpuKernelError(f"the compiled CPU kernels are not available: {unavailable_reason()}")
