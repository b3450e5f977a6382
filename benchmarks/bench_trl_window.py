"""TRL's GRPOTrainer with gradient accumulation: what a window per optimizer step shares, against the ideal.

For each configuration (rows per micro-batch x gradient-accumulation steps, gradient checkpointing on/off) the
same training runs three times from the same seeds:

- eager (no backend): the oracle for losses and gradient norms;
- ``BranchReplayCallback(windows=False)``: sharing within each micro-batch only (what a TRL user had before);
- ``BranchReplayCallback()`` (a window per optimizer step).

Tokens are counted over the training forwards (grad mode) only: logical (rows x padded length), executed by
per-call sharing, and computed by the window (its executed tokens less those replayed from an earlier call). The
**ideal** is the tokens one call over each step's rows executes: the same training with all of a step's rows in
one micro-batch (``per_device = rows per step, accumulation 1``), whose generations are the same (one generation
batch per step, the same seeds). "of ideal" = ideal / computed (1.0: each distinct needed token once per step).

Run: ``python benchmarks/bench_trl_window.py [--steps 2]``; a markdown table on stdout. Needs ``trl``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import brcompile  # noqa: E402
from examples import trl_grpo  # noqa: E402

ROWS_PER_STEP = 8  # trl_grpo.train's default: 2 prompts x 4 generations


def training_tokens(run) -> tuple[int, int]:
    """(logical, executed) tokens of the run's training (grad-mode) calls; a call that ran its original graph
    (one row shares too little: ``min_dedup``) executes all of its logical tokens."""
    calls = [c for c in run.calls if c.grad]
    return sum(c.logical for c in calls), sum(c.executed if c.replayed else c.logical for c in calls)


def measure(per_device: int, accumulation: int, checkpointing: bool, steps: int, ideal: int) -> dict:
    kw = dict(steps=steps, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
              gradient_checkpointing=checkpointing)
    want = trl_grpo.train(None, **kw)
    per_call = trl_grpo.train(brcompile.backend(mode="replay", compiler="aot_eager"), windows=False, **kw)
    windowed = trl_grpo.train(brcompile.backend(mode="replay", compiler="aot_eager"), **kw)
    err = trl_grpo.compare_runs(windowed, want)
    logical, executed = training_tokens(per_call)
    w_logical, w_executed = training_tokens(windowed)
    computed = w_executed - windowed.stats.window_replayed_tokens
    return dict(per_device=per_device, accumulation=accumulation, checkpointing=checkpointing,
                calls=sum(1 for c in windowed.calls if c.grad), logical=w_logical, per_call=executed,
                computed=computed, ideal=ideal, of_ideal=ideal / computed if computed else float("nan"),
                dedup_per_call=logical / executed, dedup_window=w_logical / computed,
                max_err=max(err["loss"] + err["grads"] + [err["params"]]),
                fallbacks=windowed.stats.fallback_calls, windows=windowed.stats.windows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--checkpointing", choices=("both", "on", "off"), default="both")
    a = p.parse_args(argv)
    rows = []
    for checkpointing in {"both": (True, False), "on": (True,), "off": (False,)}[a.checkpointing]:
        one = trl_grpo.train(brcompile.backend(mode="replay", compiler="aot_eager"), steps=a.steps,
                             gradient_checkpointing=checkpointing)
        ideal = training_tokens(one)[1]
        for per_device, accumulation in ((4, 2), (2, 4), (1, 8)):
            rows.append(measure(per_device, accumulation, checkpointing, a.steps, ideal))
            r = rows[-1]
            print(f"# {per_device}x{accumulation} checkpointing={checkpointing}: computed {r['computed']} ideal "
                  f"{r['ideal']} err {r['max_err']:.1e}", flush=True)
    print("| rows/call x accumulation | checkpointing | training calls | logical | per-call sharing (dedup) | "
          "window computed (dedup) | ideal | ideal / computed | max rel err vs eager | fallbacks |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['per_device']} x {r['accumulation']} | {'on' if r['checkpointing'] else 'off'} | {r['calls']} | "
              f"{r['logical']} | {r['per_call']} ({r['dedup_per_call']:.2f}x) | {r['computed']} "
              f"({r['dedup_window']:.2f}x) | {r['ideal']} | {r['of_ideal']:.2f} | {r['max_err']:.1e} | "
              f"{r['fallbacks']} |")
    ok = all(r["max_err"] <= trl_grpo.TOL and r["fallbacks"] == 0 and r["of_ideal"] >= 0.9 for r in rows)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
