"""The op registry: one frozen :class:`OpRecord` per op, registered by :func:`register_op` from its family's file.

A record is everything the passes know about one op (docs/ARCHITECTURE.md §10.2):

- ``spellings``: every Dynamo-level target of the op (callables for ``call_function``, Tensor method names for
  ``call_method``, qualified custom-op names); ``named`` makes ``name`` a family of ``spellings.FAMILIES``
  (``family_of`` / ``is_op`` / ``spellings(name)``);
- ``aten`` and ``respell``: the ATen op packets the ATen level writes back as a torch-level call, and how
  (``respell(node, args, kwargs)``: ``(op, target, args, kwargs)``, a value that replaces the node, ``DROP``, or
  None to keep the ATen op; passes/lower/aten.py);
- ``axes``: the name of its token-axis rule (passes/analysis/rules/, ``axes.axis_rule``); None: no rule, a token
  operand is materialised;
- ``liveness`` and ``kill``: how live positions pass through it (passes/analysis/liveness.py): where its dense
  result keeps its operand's token dims (its frame), and how a per-call operand kills (zeroes or replaces) the
  other;
- ``pair``: the name of its pair-local rule for routed pairs (passes/emit/routed.py); None: not pair-local.

A target, an ATen packet and a record name each belong to one record: registering a second raises
:class:`RuleCollision` unless ``override=True``. Records are looked up by target (:func:`record_for`), by ATen
packet (:func:`record_for_packet`) or by name (:func:`record_named`).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Callable, Iterator, Optional

log = logging.getLogger(__name__)

__all__ = ["Kill", "Liveness", "OpRecord", "RuleCollision", "families", "record_for", "record_for_packet",
           "record_named", "records", "register_op", "unregister_op"]


class Liveness(enum.Enum):
    """How a dense value computed from a token value keeps its operand's row and position dims (liveness's
    forward walk): the value at ``(b, t)`` reads the operand's at ``(b, t)`` only."""

    #: elementwise (with broadcasting): the token dims are the result's dims at the same place
    POSITIONWISE = "positionwise"
    #: along one ``dim`` (softmax, gather): elementwise unless ``dim`` is a token dim
    ALONG_DIM = "along_dim"
    #: a reduction over given dims: the token dims not reduced stay, shifted by the dims dropped
    REDUCES = "reduces"
    #: a transpose, permute, squeeze or unsqueeze: the token dims move with the layout
    LAYOUT = "layout"


class Kill(enum.Enum):
    """How a per-call operand ``m`` zeroes or replaces the token operand ``x``'s contribution (liveness's
    backward walk): ``x`` is dead wherever the kill holds."""

    #: ``x · m``: dead where ``m == 0``
    PRODUCT = "product"
    #: ``where(m, x, y)`` / ``where(m, y, x)``: dead where m is False / True
    SELECT = "select"
    #: ``masked_fill(x, m, v)``: dead where m is True
    FILL = "fill"


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """Everything the passes know about one op (module docstring)."""

    name: str
    spellings: tuple = ()
    named: bool = False
    aten: tuple = ()
    respell: Optional[Callable] = None
    axes: Optional[str] = None
    liveness: Optional[Liveness] = None
    kill: Optional[Kill] = None
    pair: Optional[str] = None


class RuleCollision(ValueError):
    """A record, target or ATen packet registered a second time (without ``override=True``)."""


_BY_NAME: dict[str, OpRecord] = {}
_BY_TARGET: dict[Any, OpRecord] = {}
_BY_PACKET: dict[Any, OpRecord] = {}


def _label(target: Any) -> str:
    """A readable name of a target (a method name, a qualified op name, or a callable)."""
    if isinstance(target, str):
        return target
    mod = getattr(target, "__module__", None) or ""
    return f"{mod}.{getattr(target, '__name__', repr(target))}".lstrip(".")


def _add(record: OpRecord, override: bool) -> None:
    """Index ``record`` by name, target and packet; nothing is kept when one of them is taken."""
    taken = []
    if not override:
        if record.name in _BY_NAME:
            taken.append(f"the name {record.name!r}")
        taken += [f"{_label(t)} ({_BY_TARGET[t].name})" for t in dict.fromkeys(record.spellings) if t in _BY_TARGET]
        taken += [f"{p} ({_BY_PACKET[p].name})" for p in dict.fromkeys(record.aten) if p in _BY_PACKET]
    if taken:
        raise RuleCollision(f"op {record.name!r}: already registered: {', '.join(taken)}; pass override=True to "
                            f"replace them")
    old = _BY_NAME.get(record.name)
    if old is not None:
        unregister_op(old.name)
    for t in record.spellings:
        if t in _BY_TARGET:
            log.info("op %r replaces %r for %s", record.name, _BY_TARGET[t].name, _label(t))
        _BY_TARGET[t] = record
    for p in record.aten:
        _BY_PACKET[p] = record
    _BY_NAME[record.name] = record


def register_op(name: str, *, spellings: tuple = (), named: bool = False, aten: tuple = (),
                respell: Optional[Callable] = None, axes: Optional[str] = None, liveness: Optional[Liveness] = None,
                kill: Optional[Kill] = None, pair: Optional[str] = None, override: bool = False):
    """Register the record of op ``name`` (its fields: :class:`OpRecord`) and return a decorator: applied to a
    function, that function becomes the record's ATen respelling (``@register_op("slice", aten=(aten.slice,))``
    over ``def _slice(node, args, kwargs)``). A name, target or packet already registered raises
    :class:`RuleCollision` unless ``override=True`` (then the new record replaces the old ones there)."""
    record = OpRecord(name, tuple(spellings), named, tuple(aten), respell, axes, liveness, kill, pair)
    _add(record, override)

    def with_respelling(fn: Callable) -> Callable:
        _swap(_BY_NAME[name], dataclasses.replace(_BY_NAME[name], respell=fn))
        return fn

    return with_respelling


def _swap(old: OpRecord, new: OpRecord) -> None:
    """``new`` in place of ``old`` wherever ``old`` is indexed."""
    for table in (_BY_NAME, _BY_TARGET, _BY_PACKET):
        for k in [k for k, r in table.items() if r is old]:
            table[k] = new


def unregister_op(name: str) -> None:
    """Remove the record ``name`` (and its targets and packets); tests register and remove scratch records."""
    record = _BY_NAME.pop(name)
    for table in (_BY_TARGET, _BY_PACKET):
        for k in [k for k, r in table.items() if r is record]:
            del table[k]


def record_for(target: Any) -> Optional[OpRecord]:
    """The record whose spellings hold ``target`` (a node's target), or None."""
    try:
        return _BY_TARGET.get(target)
    except TypeError:  # an unhashable target
        return None


def record_for_packet(packet: Any) -> Optional[OpRecord]:
    """The record whose ATen packets hold ``packet`` (an ``OpOverloadPacket``), or None."""
    return _BY_PACKET.get(packet)


def record_named(name: str) -> Optional[OpRecord]:
    return _BY_NAME.get(name)


def records() -> Iterator[OpRecord]:
    """Every record, in registration order."""
    return iter(list(_BY_NAME.values()))


def families() -> dict[str, tuple]:
    """The named families (``spellings.FAMILIES``): record name -> its spellings, in registration order."""
    return {r.name: r.spellings for r in _BY_NAME.values() if r.named}
