"""One registry of implementations for the brcompile ops that have several (docs/ARCHITECTURE.md §6, §10.2).

An op with several implementations (``tree_attention``: reference / cpu / triton / flex; ``packed_logprob``: cpu /
triton) keeps one :class:`Registry` of :class:`Impl` records. Its ``impl`` string argument names one:

- ``register(impl)`` adds an implementation under ``impl.name``; a name that already has another one raises
  the op's error unless ``register(impl, override=True)`` (which replaces it);
- built-in implementations live in modules imported on first use (``builtins``: name -> module); the
  module registers itself at import, so importing the op's module stays cheap and an optional dependency
  (triton) is only needed when asked for;
- ``get(name, device, dtype)`` returns the implementation, ``"auto"`` resolved for the inputs: the
  first of ``auto(device)`` that loads and runs on ``device`` / ``dtype`` (triton on CUDA, else cpu);
- ``check_name(name)`` validates a name without importing anything (fake impls, trace time).
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Mapping, Optional

import torch

log = logging.getLogger(__name__)

__all__ = ["Impl", "Registry", "triton_on_cuda"]


@dataclass(frozen=True)
class Impl:
    """Base of an op's implementation record (a frozen dataclass per op adds its callables and flags).

    ``device_types``: the ``torch.device.type`` values the impl runs on; ``dtypes``: the input dtypes it
    takes; ``None`` means any (both keyword-only). ``Error`` is the exception type of the op's registry.
    """

    Error: ClassVar[type] = ValueError
    op: ClassVar[str] = "op"

    name: str
    device_types: Optional[frozenset] = field(default=None, kw_only=True)
    dtypes: Optional[frozenset] = field(default=None, kw_only=True)

    def __post_init__(self):
        if not self.name or self.name == "auto":
            raise self.Error(f"invalid {self.op} impl name {self.name!r}")

    def runs_on(self, device: torch.device, dtype: Optional[torch.dtype] = None) -> bool:
        """Whether the impl takes inputs on ``device`` (of ``dtype``, when given)."""
        return (self.device_types is None or device.type in self.device_types) and (
            dtype is None or self.dtypes is None or dtype in self.dtypes)

    def placement(self) -> str:
        """Where the impl runs, for error messages."""
        devices = "any device" if self.device_types is None else f"devices {sorted(self.device_types)}"
        return devices if self.dtypes is None else f"{devices}, dtypes {sorted(str(d) for d in self.dtypes)}"


def triton_on_cuda(device: torch.device) -> tuple[str, ...]:
    """The default ``"auto"`` preference: triton on CUDA (when it imports and takes the inputs), else cpu."""
    return ("triton", "cpu") if device.type == "cuda" else ("cpu",)


class Registry:
    """The implementations of one op, by name (module docstring).

    ``op``: the op's name in messages; ``kind``: the :class:`Impl` subclass it holds; ``builtins``: name ->
    module that registers that impl when imported; ``auto``: device -> names to try for ``"auto"``, in order.
    """

    def __init__(self, op: str, kind: type, builtins: Mapping[str, str],
                 auto: Callable[[torch.device], tuple[str, ...]] = triton_on_cuda):
        self.op = op
        self.kind = kind
        self.error = kind.Error
        self.builtins = dict(builtins)
        self.auto = auto
        self._impls: dict[str, Impl] = {}
        self._failed: dict[str, ImportError] = {}  # built-in modules that did not import (not retried)

    def register(self, impl: Impl, *, override: bool = False) -> None:
        """Register an implementation under ``impl.name``. A name that holds another implementation raises
        the op's error unless ``override=True`` (then ``impl`` replaces it); registering the same object
        again is a no-op."""
        if not isinstance(impl, self.kind):
            raise self.error(f"{self.op}: register expects {self.kind.__name__}, got {type(impl).__name__}")
        if self._impls.get(impl.name, impl) is not impl:
            if not override:
                raise self.error(f"{self.op} impl {impl.name!r} is already registered; "
                                 f"pass override=True to replace it")
            log.info("%s: replacing impl %r", self.op, impl.name)
        self._impls[impl.name] = impl

    def names(self) -> tuple[str, ...]:
        """Names usable as ``impl`` (registered or importable on demand), without ``"auto"``."""
        return tuple(sorted(set(self._impls) | set(self.builtins)))

    def check_name(self, name: str) -> None:
        """Raise the op's error for a name that is neither ``"auto"`` nor known (imports nothing)."""
        if name != "auto" and name not in self._impls and name not in self.builtins:
            raise self._unknown(name)

    def _unknown(self, name: str) -> Exception:
        return self.error(f"unknown {self.op} impl {name!r}; known: {', '.join(self.names())} or 'auto'")

    def _load(self, name: str) -> Impl:
        """The impl ``name``, importing its built-in module first if needed."""
        if name not in self._impls and name in self.builtins:
            module = self.builtins[name]
            try:
                if name in self._failed:
                    raise self._failed[name]
                importlib.import_module(module)
            except ImportError as e:
                self._failed[name] = e
                raise self.error(f"{self.op} impl {name!r} is unavailable: importing {module} failed ({e})") from e
            if name not in self._impls:
                raise self.error(f"{self.op} impl {name!r}: {module} imported but registered nothing")
        impl = self._impls.get(name)
        if impl is None:
            raise self._unknown(name)
        return impl

    def get(self, name: str, device, dtype: Optional[torch.dtype] = None) -> Impl:
        """The implementation ``name`` for inputs on ``device`` (of ``dtype``), ``"auto"`` resolved; raises
        the op's error when it is unknown, cannot be imported, or does not run there."""
        device = torch.device(device)
        if name == "auto":
            *preferred, last = self.auto(device)
            for candidate in preferred:
                try:
                    impl = self._load(candidate)
                except self.error:
                    log.debug("%s: impl %r unavailable for 'auto'", self.op, candidate, exc_info=True)
                    continue
                if impl.runs_on(device, dtype):
                    return impl
            return self._placed(self._load(last), device, dtype, auto=True)
        return self._placed(self._load(name), device, dtype)

    def _placed(self, impl: Impl, device: torch.device, dtype: Optional[torch.dtype], auto: bool = False) -> Impl:
        """``impl`` if it runs on ``device``/``dtype``, else the op's error."""
        if not impl.runs_on(device, dtype):
            where = device.type if dtype is None else f"{device.type} {dtype}"
            raise self.error(f"{self.op} impl {impl.name!r} does not run on {where}: it runs on {impl.placement()}"
                             + (" (requested 'auto'; is triton installed?)" if auto else ""))
        return impl
