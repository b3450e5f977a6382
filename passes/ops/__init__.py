"""The op records: everything the passes know about each op, one file per op family (docs/ARCHITECTURE.md §10.2).

``registry.py`` holds :class:`~brcompile.passes.ops.registry.OpRecord` and ``register_op``; each family file
registers its ops' records on import, and importing this package imports them all.
"""
from brcompile.passes.ops import (  # noqa: F401
    attention, factories, linalg, lowering, markers, moe, pointwise, reduce, scan, shape,
)
from brcompile.passes.ops.registry import (  # noqa: F401
    Kill, Liveness, OpRecord, RuleCollision, families, record_for, record_for_packet, record_named, records,
    register_op, unregister_op,
)
