"""The optional features of tree attention, one :class:`Feature` each, in the op's argument order.

``brcompile::tree_attention_forward(q, k, v, end, valid, segments, scale, impl, <features>)`` and its backward
take the features of :data:`FEATURES` after ``impl``; ``tree_attention_cached_forward`` (backends/attention/cached.py)
takes those of :data:`CACHED_FEATURES` (the same, with the cache's positions after ``position``). Each feature
has a neutral default that means off, so a call lists its features up to the last block of them that has one
on (:func:`feature_tail`, blocks: :data:`FORWARD_BLOCKS`, :data:`CACHED_BLOCKS`) and a reader fills in the rest
(:func:`call_features`). What reads or writes features
iterates this list by name instead of by argument index: :class:`..ops.TreeAttentionArgs` (its fields after
``scale`` are these, in this order), the support check of the impls (:func:`..ops.check_impl_supports`, from
``Feature.support``), the op's autograd formula (a gradient for each ``differentiable`` feature), the attention
emitter (passes/analysis/rules/attention.py), the streaming split (passes/emit/split.py) and the backend's support check
(brcompile/backend.py).

A new attention feature is one more entry here (with a neutral default), the op argument and the
TreeAttentionArgs field of the same name, and the impls that support it declaring its flag.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

__all__ = [
    "Feature", "FEATURES", "CACHED_FEATURES", "CACHE_POSITION", "FEATURE_NAMES", "FORWARD_BLOCKS", "CACHED_BLOCKS", "FORWARD_FEATURES_AT", "CACHED_FEATURES_AT",
    "feature", "call_features", "feature_tail", "active", "needs_position", "needs_support", "impl_lacks",
]


@dataclasses.dataclass(frozen=True)
class Feature:
    """One optional argument of tree attention.

    ``name``: the op argument and the :class:`..ops.TreeAttentionArgs` field; ``default``: the neutral value
    (off); ``schema``: its type in the op schema (``"Tensor?"``, ``"SymInt"``, ``"float"``, ``"float[]?"``);
    ``support``: the :class:`..ops.AttentionImpl` flags an impl must all set to be handed the feature on (empty:
    every impl, e.g. sinks, which the op applies around the impl, or an input that only serves other features);
    ``refusal``: what an impl without them "does not support" (the reason a fallback records);
    ``needs_position``: whether it is on only with the tokens' positions; ``differentiable``: whether the op
    returns a gradient for it; ``doc``: what it does to the scores."""

    name: str
    default: Any
    schema: str
    doc: str
    support: tuple[str, ...] = ()
    refusal: str = ""
    needs_position: bool = False
    differentiable: bool = False

    @property
    def is_tensor(self) -> bool:
        """Whether the argument is a tensor (saved for backward as one); else a constant of the call."""
        return self.schema.startswith("Tensor")

    def is_on(self, value: Any) -> bool:
        """Whether ``value`` turns the feature on: a tensor argument when given, a number or list when
        non-zero / non-empty (the neutral default is off)."""
        if self.is_tensor:
            return value is not None
        return bool(value)


#: The features of ``tree_attention_forward`` / ``tree_attention_backward`` (and TreeAttentionArgs), in order.
FEATURES: tuple[Feature, ...] = (
    Feature("window", 0, "SymInt", "sliding window W > 0: query q sees key k only if position[q] - position[k] < W",
            support=("supports_window",), refusal="a sliding window", needs_position=True),
    Feature("position", None, "Tensor?", "the tokens' integer positions [N] (the batch columns), read by the "
            "window and the position biases"),
    Feature("softcap", 0.0, "float", "logit soft-cap c > 0: scores c * tanh(scale * q.k / c)",
            support=("supports_softcap",), refusal="logit soft-capping"),
    Feature("alibi", None, "float[]?", "constant ALiBi slopes m [Hq]: scores + m[h] * (position[k] - position[q])",
            support=("supports_alibi",), refusal="ALiBi position biases", needs_position=True),
    Feature("sinks", None, "Tensor?", "sink logits [Hq] or [Hq, N]: one more value-less logit per query row "
            "(merged by the op around every impl)", differentiable=True),
    Feature("relbias", None, "Tensor?", "relative bias table R [Hq, N, E]: scores "
            "+ R[h, q, min(position[q] - position[k], E - 1)]", support=("supports_relbias",),
            refusal="relative biases (a per-query-token table over the clamped query-key distance)",
            needs_position=True, differentiable=True),
    Feature("slopes", None, "Tensor?", "trainable ALiBi slopes m [Hq] (not with constant alibi)",
            support=("supports_alibi", "supports_alibi_grad"),
            refusal="trainable ALiBi slopes (the gradient of the slopes)", needs_position=True, differentiable=True),
)

#: The cached prefix's positions [P], an argument of the cached op only (after ``position``).
CACHE_POSITION = Feature("cache_position", None, "Tensor?", "the cached keys' positions [P] (window and "
                         "position biases over the cross pairs of a streamed chunk)")

#: The features of ``tree_attention_cached_forward`` / ``_backward`` (backends/attention/cached.py), in order.
CACHED_FEATURES: tuple[Feature, ...] = (FEATURES[0], FEATURES[1], CACHE_POSITION, *FEATURES[2:])

FEATURE_NAMES: tuple[str, ...] = tuple(f.name for f in FEATURES)

#: How the emitters write the features of ``tree_attention_forward``: in blocks, each written whole (its
#: features that are off at their defaults) when it or a later block has a feature on.
FORWARD_BLOCKS: tuple[tuple[str, ...], ...] = (("window", "position"), ("softcap",), ("alibi", "sinks"),
                                              ("relbias",), ("slopes",))
#: The same for ``tree_attention_cached_forward`` (the positions, the cache's and the soft-cap are one block).
CACHED_BLOCKS: tuple[tuple[str, ...], ...] = (("window", "position", "cache_position", "softcap"),
                                             ("alibi", "sinks"), ("relbias",), ("slopes",))

#: Index of the first feature among the arguments of ``tree_attention_forward`` (after q, k, v, end, valid,
#: segments, scale, impl); ``tree_attention_backward`` has grad_out, out and lse more before them.
FORWARD_FEATURES_AT = 8
#: The same for ``tree_attention_cached_forward`` (after the chunk's arguments, k_cache, v_cache, cache_valid,
#: cross, scale, impl).
CACHED_FEATURES_AT = 12


def feature(name: str, features: Sequence[Feature] = FEATURES) -> Feature:
    """The feature called ``name``; KeyError when there is none."""
    for f in features:
        if f.name == name:
            return f
    raise KeyError(f"tree attention has no feature {name!r} (features: {', '.join(f.name for f in features)})")


def call_features(args: Sequence, start: int = FORWARD_FEATURES_AT,
                  features: Sequence[Feature] = FEATURES) -> dict[str, Any]:
    """{name: value} of the features of an op call's positional ``args`` (from index ``start``), defaults filled
    in for those the call leaves out."""
    tail = tuple(args[start:])
    return {f.name: tail[i] if i < len(tail) else f.default for i, f in enumerate(features)}


def feature_tail(values: Mapping[str, Any], features: Sequence[Feature] = FEATURES,
                 blocks: Sequence[tuple[str, ...]] = FORWARD_BLOCKS) -> tuple:
    """The positional feature arguments of a call with ``values`` ({name: value}, absent: the default): the
    ``blocks`` (the features' names in order, grouped) up to the last one with a feature on
    (:meth:`Feature.is_on`), each whole; none when all are off."""
    by_name = {f.name: f for f in features}
    if [n for b in blocks for n in b] != list(by_name):
        raise ValueError(f"feature blocks {blocks} do not list the features {tuple(by_name)} in order")
    on = [any(by_name[n].is_on(values.get(n, by_name[n].default)) for n in b) for b in blocks]
    written = blocks[:max((i + 1 for i, o in enumerate(on) if o), default=0)]
    return tuple(values.get(n, by_name[n].default) for b in written for n in b)


def active(values: Mapping[str, Any], features: Sequence[Feature] = FEATURES) -> tuple[str, ...]:
    """The names of the features ``values`` turns on."""
    return tuple(f.name for f in features if f.is_on(values.get(f.name, f.default)))


def needs_position(values: Mapping[str, Any], features: Sequence[Feature] = FEATURES) -> bool:
    """Whether a feature ``values`` turns on needs the tokens' positions (a window or a position bias)."""
    return any(f.needs_position and f.is_on(values.get(f.name, f.default)) for f in features)


def needs_support(values: Mapping[str, Any]) -> bool:
    """Whether ``values`` turns on a feature that not every impl runs (one with support flags)."""
    return any(f.support and f.is_on(values.get(f.name, f.default)) for f in FEATURES)


def impl_lacks(impl: Any, values: Mapping[str, Any]) -> Optional[Feature]:
    """The first feature ``values`` turns on whose support flags ``impl`` does not all set (None: it runs them
    all)."""
    for f in FEATURES:
        if f.support and f.is_on(values.get(f.name, f.default)) and not all(getattr(impl, s) for s in f.support):
            return f
    return None
