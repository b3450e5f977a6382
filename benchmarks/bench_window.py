"""Micro-batches: one optimizer step of a GRPO batch whose rows are shuffled into micro-batches of 1, 2, 4 rows (a
trainer's gradient accumulation), side by side, per step:

* ``eager``: dense eager, one forward + backward per micro-batch (the baseline);
* ``br call``: branch_replay per call (no window: each call shares within itself only);
* ``br window``: branch_replay inside ``brcompile.window(calls=N)`` (brcompile/runtime/window/): every token
  the step's rows share computed once, whichever micro-batch its rows are in;
* ``prefix_grouper``: PrefixGrouper per micro-batch, its rows grouped by prompt (it shares within a call only;
  benchmarks/peer_prefix_grouper.py ``group_by_prompt``);
* ``br one call``: branch_replay on all the step's rows in one call (what the window is measured against).

Printed per micro-batch size: wall-clock per step (median of ``--repeats``) and speedup over dense eager, the
window's speedup against one call's (the goal: >= 0.9), trunk tokens computed per step (window: its computed
tokens; per call: the calls' executed tokens) against the ideal (one call over all the rows: each distinct needed
token once), and the window's gradients against eager's (relative error). Run from a checkout:

    python benchmarks/bench_window.py                       # dim 256 x 4 layers, 2 prompts x G=8, P=512, T<=64
    python benchmarks/bench_window.py --quick               # a tiny model, to check it runs
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, "") and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import brcompile  # noqa: E402
from benchmarks.bench_per_block import median_s  # noqa: E402  (median seconds after one warm-up run)
from brcompile.contract import rel_err  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.grpo import grpo_loss, make_grpo_batch  # noqa: E402

METHODS = ("eager", "br call", "br window", "prefix_grouper", "br one call")


def micro_batches(batch: dict, size: int, seed: int) -> list[dict]:
    """The batch's rows shuffled (as TRL shuffles a generation batch) and cut into micro-batches of ``size``."""
    order = list(range(batch["input_ids"].shape[0]))
    random.Random(seed).shuffle(order)
    return [{k: v[order[i:i + size]] for k, v in batch.items()} for i in range(0, len(order), size)]


def step(model, loss_fn, mbs: list[dict], window: bool = False) -> dict:
    """One optimizer step's forward and backward over ``mbs`` (losses / N); the window's stats if ``window``."""
    model.zero_grad(set_to_none=True)
    ctx = brcompile.window(calls=len(mbs)) if window else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for mb in mbs:
            (loss_fn(model, **mb) / len(mbs)).backward()
        return ctx.stats() if ctx is not None else {}
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)


def run(args) -> list[dict]:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    cfg = GPTConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                    n_kv_heads=max(1, args.heads // 2), hidden_dim=args.dim * 3)
    model = GPT(cfg, seed=0)
    batch = make_grpo_batch(num_prompts=args.prompts, group_size=args.group_size,
                            prompt_len=(args.prompt_len * 3 // 4, args.prompt_len),
                            response_len=(max(1, args.tail_len // 4), args.tail_len), vocab_size=args.vocab, seed=1)
    backend = brcompile.backend(mode="replay", compiler=args.compiler)
    loss_br = torch.compile(grpo_loss, backend=backend, dynamic=True)
    try:
        from benchmarks import peer_prefix_grouper as pg
        pg_ok = pg.status()[0]
    except ImportError:
        pg_ok = False

    def prefix_grouper_loss(model, **mb):
        return pg.prefix_grouper_grpo_loss(model, pg.group_by_prompt(mb), mb)

    brcompile.reset_stats()
    step(model, loss_br, [batch])
    ideal = brcompile.stats().executed_tokens
    results = []
    for size in args.micro_batches:
        mbs = micro_batches(batch, size, seed=2)
        row = {"rows_per_call": size, "calls": len(mbs), "ideal_tokens": ideal,
               "logical_tokens": int(batch["input_ids"].numel())}
        step(model, grpo_loss, mbs)
        want = [p.grad.clone() for p in model.parameters()]
        st = step(model, loss_br, mbs, window=True)
        row["window_tokens"] = st["computed_tokens"]
        row["window_replayed"] = st["replayed_tokens"]
        row["window_grad_err"] = max(rel_err(p.grad, w) for p, w in zip(model.parameters(), want))
        brcompile.reset_stats()
        step(model, loss_br, mbs)
        row["call_tokens"] = brcompile.stats().executed_tokens
        seconds = {
            "eager": median_s(lambda: step(model, grpo_loss, mbs), args.repeats),
            "br call": median_s(lambda: step(model, loss_br, mbs), args.repeats),
            "br window": median_s(lambda: step(model, loss_br, mbs, window=True), args.repeats),
            "br one call": median_s(lambda: step(model, loss_br, [batch]), args.repeats),
        }
        if pg_ok:
            seconds["prefix_grouper"] = median_s(lambda: step(model, prefix_grouper_loss, mbs), args.repeats)
        row["seconds"] = seconds
        results.append(row)
        print(f"  rows/call {size}: done", file=sys.stderr, flush=True)
    return results


def table(results: list[dict]) -> str:
    """Markdown: per micro-batch size, ms per step and speedup over eager per method; tokens against the ideal."""
    head = ("| rows/call | calls | " + " | ".join(METHODS) + " | window / one call | tokens: per call | window "
            "| ideal | window grad err |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        s = r["seconds"]
        cells = []
        for m in METHODS:
            cells.append("–" if m not in s else f"{s[m] * 1e3:.0f} ms ({s['eager'] / s[m]:.2f}x)")
        ratio = (s["eager"] / s["br window"]) / (s["eager"] / s["br one call"])
        lines.append(f"| {r['rows_per_call']} | {r['calls']} | " + " | ".join(cells) +
                     f" | {ratio:.2f} | {r['call_tokens']} | {r['window_tokens']} | {r['ideal_tokens']} | "
                     f"{r['window_grad_err']:.1e} |")
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    """The command line (``--quick``: a tiny model, uncompiled)."""
    p = argparse.ArgumentParser(prog="bench_window.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--tail-len", type=int, default=64)
    p.add_argument("--micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager", "eager"))
    p.add_argument("--quick", action="store_true", help="a tiny model and batch, run uncompiled (compiler eager)")
    p.add_argument("--json", type=Path, default=None, help="write the results there too")
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.heads, args.vocab = 32, 2, 4, 61
        args.prompt_len, args.tail_len, args.group_size, args.repeats = 24, 6, 4, 1
        args.compiler = "eager"
    return args


def main(argv=None) -> int:
    args = parse(argv)
    results = run(args)
    print(f"GPT dim {args.dim} x {args.layers} layers, {args.prompts} prompts x G={args.group_size}, "
          f"prompts <= {args.prompt_len}, responses <= {args.tail_len}, float32, "
          f"{torch.get_num_threads()} threads")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
