"""GRPO (and DPO) loss forward+backward: dense eager vs torch.compile vs branch_replay vs PrefixGrouper.

The command line of :mod:`benchmarks.harness` (its docstring says what is measured and how; ``--help`` lists
the flags). Run it from a checkout:

    python benchmarks/bench_grpo.py                           # the case suite: equal, ragged (right-padded),
                                                              # ragged-shared, ragged-nomask, qwen2-trl, dpo
    python benchmarks/bench_grpo.py --quick                   # the suite on a tiny model
    python benchmarks/bench_grpo.py --group-sizes 8 --prefix-lens 2048 --tail-lens 256 --repeats 3 --out OUT  # grid
    python benchmarks/bench_grpo.py --model qwen2 --prefix-lens 512 --methods eager,branch_replay

    python benchmarks/bench_grpo.py --micro-batches 1,2,4      # the micro-batches case (benchmarks/bench_window.py):
                                                              # the rows shuffled into calls of 1, 2, 4 rows, one
                                                              # optimizer step: eager, per call, the window, and
                                                              # PrefixGrouper side by side, tokens against the ideal

Executed FLOPs are reported against the FLOPs of the positions the loss needs (the limit: harness docstring),
and against the earlier tree limit (every tree node, padding included).

The flags of this script's earlier, two-method version still work (a grid flag selects the grid):
``--group-size``, ``--prompt-lens`` and ``--response-len`` are other names of ``--group-sizes``, ``--prefix-lens``
and ``--tail-lens``;
``--backend B`` runs dense eager against one compiled method (``branch_replay``, or ``torch.compile`` with
backend B); ``--json PATH`` writes the JSON document there too. Its defaults (dim 256, 4 layers, G = 8,
P in {512, 2048}, T = 128, a full group and a mixed batch per P) are now spelt out:
``--dim 256 --layers 4 --group-sizes 8 --prefix-lens 512,2048 --tail-lens 128 --mixed-groups``.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, "") and str(ROOT) not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import main  # noqa: E402


def micro_batches_case(argv) -> int:
    """The micro-batches case: benchmarks/bench_window.py's command line (``--micro-batches`` and its flags)."""
    from benchmarks.bench_window import main as window_main

    return window_main(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if any(a == "--micro-batches" or a.startswith("--micro-batches=") for a in sys.argv[1:]):
        sys.exit(micro_batches_case(sys.argv[1:]))
    sys.exit(main(prog="bench_grpo.py"))
