"""Demo: one GRPO loss forward+backward, dense eager vs ``torch.compile(grpo_loss, backend=...)``.

    python examples/grpo_demo.py                       # branch_replay, float64, 2 groups of 8
    python examples/grpo_demo.py --dtype float32 --groups 4 --shared-response 4
    python examples/grpo_demo.py --backend aot_eager   # the plumbing without brcompile

Prints the loss of each run, the largest relative gradient error over all parameters (PASS/FAIL
against 1e-10 in float64, 1e-5 in float32), brcompile's statistics (logical vs executed tokens,
the dedup ratio, fallbacks and why) and the wall-clock of both runs. Exits with status 1 on FAIL.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `examples` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.grpo import grpo_loss, make_grpo_batch  # noqa: E402

log = logging.getLogger(__name__)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def parse_len(text: str):
    """``"32"`` -> 32; ``"24:40"`` or ``"24,40"`` -> (24, 40), an inclusive range."""
    for sep in (":", ","):
        if sep in text:
            lo, hi = text.split(sep, 1)
            return int(lo), int(hi)
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=2, help="number of prompts (groups)")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per prompt (G)")
    p.add_argument("--prompt-len", type=parse_len, default=(192, 256), help="N or LO:HI (inclusive)")
    p.add_argument("--response-len", type=parse_len, default=(16, 48), help="N or LO:HI (inclusive)")
    p.add_argument("--shared-response", type=int, default=0,
                   help="leading response tokens shared within a group")
    p.add_argument("--left-pad", action="store_true", help="left-pad prompts (TRL layout)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    p.add_argument("--backend", default="branch_replay", help="torch.compile backend (eager, aot_eager for plumbing)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    return p


def loss_and_grads(fn, model, batch):
    """Runs ``fn(model, **batch)`` forward and backward; returns (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    loss = fn(model, **batch)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def max_relative_grad_error(grads, ref) -> tuple[float, str]:
    """max over parameters p of ``max|g_p - ref_p| / max|ref_p|`` (a missing grad counts as error 1);
    returns the error and the parameter it came from."""
    worst, where = 0.0, ""
    for name, r in ref.items():
        g = grads.get(name)
        if g is None:
            err = 1.0
        else:
            err = float((g - r).abs().max() / r.abs().max().clamp(min=torch.finfo(r.dtype).tiny))
        if err > worst or not where:
            worst, where = err, name
    return worst, where


def sync(device: torch.device) -> None:
    """Waits for queued device work so wall-clock times are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fwd_bwd(fns, model, batch, repeats: int, device: torch.device) -> list[float]:
    """Median seconds of a forward+backward of ``fn(model, **batch)`` for each of ``fns``, over ``repeats``
    rounds after one warm-up each; the functions alternate within a round so load changes hit all alike."""
    def step(fn):
        model.zero_grad(set_to_none=True)
        fn(model, **batch).backward()

    for fn in fns:
        step(fn)
    times = [[] for _ in fns]
    for _ in range(max(1, repeats)):
        for fn, ts in zip(fns, times):
            sync(device)
            t0 = time.perf_counter()
            step(fn)
            sync(device)
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def brcompile_stats(backend: str):
    """``brcompile.stats()`` for the branch_replay backend when brcompile provides it, else None (other
    backends, e.g. the eager/aot_eager plumbing runs, never import brcompile)."""
    if backend != "branch_replay":
        return None
    import brcompile
    return brcompile.stats() if hasattr(brcompile, "stats") else None


def brcompile_reset_stats(backend: str) -> None:
    """``brcompile.reset_stats()`` for the branch_replay backend when brcompile provides it."""
    if backend != "branch_replay":
        return
    import brcompile
    if hasattr(brcompile, "reset_stats"):
        brcompile.reset_stats()


def report_stats(stats) -> None:
    """Prints replayed/fallback calls, logical vs executed tokens and the dedup ratio."""
    if stats is None:
        print("brcompile.stats(): not available (not the branch_replay backend, or no stats yet)")
        return
    logical, executed = stats.logical_tokens, stats.executed_tokens
    ratio = f"{logical / executed:.2f}x" if executed else "n/a"
    print(f"replayed calls {stats.replayed_calls}, fallback calls {stats.fallback_calls}")
    if not stats.replayed_calls:
        print("WARNING: nothing was replayed: the compiled numbers above are the original graph's")
    print(f"tokens: logical {logical}, executed {executed}, dedup ratio {ratio}")
    if stats.fallback_reasons:
        for reason, count in stats.fallback_reasons.most_common():
            print(f"  fallback x{count}: {reason}")


def main(argv=None) -> int:
    """Runs the demo; returns the exit status (0 PASS, 1 FAIL)."""
    args = build_parser().parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else torch.device(args.device)

    config = GPTConfig(dim=args.dim, n_layers=args.layers)
    model = GPT(config, seed=args.seed).to(device=device, dtype=dtype)
    batch = make_grpo_batch(num_prompts=args.groups, group_size=args.group_size, prompt_len=args.prompt_len,
                            response_len=args.response_len, shared_response_prefix=args.shared_response,
                            vocab_size=config.vocab_size, left_pad_prompts=args.left_pad, seed=args.seed,
                            device=device, dtype=dtype)
    B, L = batch["input_ids"].shape
    print(f"model: dim {args.dim}, layers {args.layers}, {args.dtype}, {device.type}; batch: B={B} L={L} "
          f"({args.groups} groups x {args.group_size}), real tokens {int(batch['attention_mask'].sum())}")

    torch._dynamo.reset()
    compiled = torch.compile(grpo_loss, backend=args.backend)
    ref_loss, ref_grads = loss_and_grads(grpo_loss, model, batch)
    brcompile_reset_stats(args.backend)
    loss, grads = loss_and_grads(compiled, model, batch)

    tol = TOLERANCE[dtype]
    loss_err = float((loss - ref_loss).abs() / ref_loss.abs().clamp(min=torch.finfo(dtype).tiny))
    grad_err, where = max_relative_grad_error(grads, ref_grads)
    ok = loss_err <= tol and grad_err <= tol
    print(f"loss: dense eager {ref_loss.item():.12g}, {args.backend} {loss.item():.12g} (rel err {loss_err:.2e})")
    print(f"max relative grad error {grad_err:.2e} ({where}) vs {tol:.0e}: {'PASS' if ok else 'FAIL'}")

    t_dense, t_comp = time_fwd_bwd([grpo_loss, compiled], model, batch, args.repeats, device)
    report_stats(brcompile_stats(args.backend))
    print(f"fwd+bwd wall-clock (median of {args.repeats}): dense eager {t_dense * 1e3:.1f} ms, "
          f"{args.backend} {t_comp * 1e3:.1f} ms, speedup {t_dense / t_comp:.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
