"""Demo: one GRPO loss forward+backward, dense eager vs ``torch.compile(..., backend=...)``, on two models.

    python examples/grpo_demo.py                       # both models, branch_replay, float64, 2 groups of 8
    python examples/grpo_demo.py --model gpt --dtype float32 --groups 4 --shared-response 4
    python examples/grpo_demo.py --backend aot_eager   # the plumbing without brcompile

* ``gpt``: the example Llama-style GPT (examples/gpt.py); the whole loss function is compiled.
* ``qwen2``: an unmodified HuggingFace ``Qwen2ForCausalLM`` (random weights, SDPA) of the same sizes, vocab
  512 (examples/hf.py). Only the model is compiled, as TRL does: left-padded prompts, right-padded
  completions, ``attention_mask`` and ``logits_to_keep = C + 1``; the GRPO loss runs eagerly on its logits.

For each: the loss of both runs, the largest relative gradient error over all parameters with PASS/FAIL
(float64: 1e-10, float32: 1e-5; the Qwen2 loss and gradients in float64 against the float32 bound 1e-5,
because HF's RMSNorm computes in float32: Inductor's fused norm rounds in another order, and a shared token's
gradient is summed before the norm's float32 backward), brcompile's statistics (logical vs
executed tokens, the dedup ratio, fallbacks and why) and the wall-clock of both runs. A run whose checked
call did not replay (it fell back to the original graph) is a FAIL too. Exits with status 1 on any FAIL.
``--model both`` (the default) skips qwen2 with a note when transformers is not installed
(``pip install -e ".[hf]"``).
"""
from __future__ import annotations

import argparse
import importlib.util
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
QWEN2_VOCAB = 512
#: why the Qwen2 loss and gradients are held to the float32 bound in a float64 model
HF_GRAD_REASON = ("HF's Qwen2RMSNorm computes in float32 even in a float64 model; Inductor's fused norm rounds "
                  "in another order (dense torch.compile with Inductor gives the same loss to every printed "
                  "digit), and a shared token's gradient is summed over its branches before the norm's float32 "
                  "backward (dense: after it): reassociations around a float32 rounding, so loss and gradients "
                  "meet the float32 bound")


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
    p.add_argument("--model", choices=("gpt", "qwen2", "both"), default="both",
                   help="the example GPT (whole loss compiled), a HF Qwen2 (model compiled, TRL-style), or both")
    p.add_argument("--groups", type=int, default=2, help="number of prompts (groups)")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per prompt (G)")
    p.add_argument("--prompt-len", type=parse_len, default=(192, 256), help="N or LO:HI (inclusive)")
    p.add_argument("--response-len", type=parse_len, default=(16, 48), help="N or LO:HI (inclusive)")
    p.add_argument("--shared-response", type=int, default=0,
                   help="leading response tokens shared within a group")
    p.add_argument("--left-pad", action="store_true", help="left-pad prompts (TRL layout; the qwen2 run always does)")
    p.add_argument("--dim", type=int, default=128, help="model width (both models)")
    p.add_argument("--layers", type=int, default=2, help="layers (both models)")
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


def replay_failure(stats) -> str | None:
    """Why ``stats`` (brcompile's counters over the compiled calls) do not show a replay: None when every
    call replayed (at least one, no fallback), else a one-line reason. ``stats`` None (another backend,
    the plumbing runs) checks nothing."""
    if stats is None:
        return None
    if stats.fallback_calls or not stats.replayed_calls:
        reasons = "; ".join(stats.fallback_reasons) or "no call reached the backend's runtime"
        return (f"did not replay ({stats.replayed_calls} replayed, {stats.fallback_calls} fell back: {reasons}); "
                "the compiled numbers are the original graph's")
    return None


def check_and_time(model, dense_fn, compiled_fn, batch, args, device: torch.device, loss_tol: float,
                   grad_tol: float, grad_reason: str | None = None) -> bool:
    """Runs ``dense_fn`` and ``compiled_fn`` (each ``fn(model, **batch)`` -> loss) forward+backward, prints the
    loss, the largest relative gradient error with PASS/FAIL, brcompile's statistics and the wall-clock of
    both; returns True on PASS: loss within ``loss_tol``, every gradient within ``grad_tol`` (``grad_reason``:
    why they are looser than the dtype's bound, printed when given), and -- for branch_replay -- every compiled call replayed."""
    ref_loss, ref_grads = loss_and_grads(dense_fn, model, batch)
    brcompile_reset_stats(args.backend)
    loss, grads = loss_and_grads(compiled_fn, model, batch)
    not_replayed = replay_failure(brcompile_stats(args.backend))

    tiny = torch.finfo(ref_loss.dtype).tiny
    loss_err = float((loss - ref_loss).abs() / ref_loss.abs().clamp(min=tiny))
    grad_err, where = max_relative_grad_error(grads, ref_grads)
    ok = loss_err <= loss_tol and grad_err <= grad_tol and not_replayed is None
    print(f"loss: dense eager {ref_loss.item():.12g}, {args.backend} {loss.item():.12g} "
          f"(rel err {loss_err:.2e} vs {loss_tol:.0e})")
    if grad_reason:
        print(f"loss and gradients against {grad_tol:.0e}, not {TOLERANCE[ref_loss.dtype]:.0e}: {grad_reason}")
    verdict = "PASS" if ok else "FAIL" + (f": the checked call {not_replayed}" if not_replayed else "")
    print(f"max relative grad error {grad_err:.2e} ({where}) vs {grad_tol:.0e}: {verdict}")

    t_dense, t_comp = time_fwd_bwd([dense_fn, compiled_fn], model, batch, args.repeats, device)
    stats = brcompile_stats(args.backend)
    report_stats(stats)
    later = replay_failure(stats)
    if ok and later:
        print(f"FAIL: a timed call {later}")
        ok = False
    print(f"fwd+bwd wall-clock (median of {args.repeats}): dense eager {t_dense * 1e3:.1f} ms, "
          f"{args.backend} {t_comp * 1e3:.1f} ms, speedup {t_dense / t_comp:.2f}x")
    return ok


def make_batch(args, vocab_size: int, dtype: torch.dtype, device: torch.device, left_pad: bool):
    """The demo's GRPO batch (make_grpo_batch) from the command line."""
    return make_grpo_batch(num_prompts=args.groups, group_size=args.group_size, prompt_len=args.prompt_len,
                           response_len=args.response_len, shared_response_prefix=args.shared_response,
                           vocab_size=vocab_size, left_pad_prompts=left_pad, seed=args.seed, device=device,
                           dtype=dtype)


def run_gpt(args, dtype: torch.dtype, device: torch.device) -> bool:
    """The example GPT with ``torch.compile(grpo_loss, backend=...)``: the whole loss compiled."""
    config = GPTConfig(dim=args.dim, n_layers=args.layers)
    model = GPT(config, seed=args.seed).to(device=device, dtype=dtype)
    batch = make_batch(args, config.vocab_size, dtype, device, args.left_pad)
    B, L = batch["input_ids"].shape
    print(f"== gpt (examples/gpt.py, the loss function compiled): dim {args.dim}, layers {args.layers}, "
          f"{args.dtype}, {device.type}; batch: B={B} L={L} ({args.groups} groups x {args.group_size}), "
          f"real tokens {int(batch['attention_mask'].sum())}")
    torch._dynamo.reset()
    compiled = torch.compile(grpo_loss, backend=args.backend)
    tol = TOLERANCE[dtype]
    return check_and_time(model, grpo_loss, compiled, batch, args, device, tol, tol)


def run_qwen2(args, dtype: torch.dtype, device: torch.device) -> bool:
    """A HF Qwen2 with ``torch.compile(model, backend=...)``, TRL-style (examples/hf.py): left-padded prompts,
    ``logits_to_keep = C + 1``, the GRPO loss eager over the returned logits."""
    from examples.hf import completion_width, qwen2_model, trl_grpo_loss

    config = GPTConfig(dim=args.dim, n_layers=args.layers, vocab_size=QWEN2_VOCAB)
    batch = make_batch(args, config.vocab_size, dtype, device, left_pad=True)
    B, L = batch["input_ids"].shape
    C = completion_width(batch["completion_mask"])
    model = qwen2_model(config, max_positions=L, seed=args.seed, dtype=dtype).to(device)
    print(f"== qwen2 (transformers Qwen2ForCausalLM, sdpa; the model compiled, loss eager): hidden {args.dim}, "
          f"layers {args.layers}, heads {config.n_heads} (kv {config.n_kv_heads}), vocab {config.vocab_size}, "
          f"{args.dtype}, {device.type}; batch: B={B} L={L} ({args.groups} groups x {args.group_size}, prompts "
          f"left-padded), completions C={C} (logits_to_keep={C + 1}), real tokens {int(batch['attention_mask'].sum())}")
    torch._dynamo.reset()
    compiled_model = torch.compile(model, backend=args.backend)

    def dense(m, **b):
        return trl_grpo_loss(m, **b, completion_len=C)

    def compiled(m, **b):
        return trl_grpo_loss(compiled_model, **b, completion_len=C)

    tol = max(TOLERANCE[dtype], TOLERANCE[torch.float32])
    return check_and_time(model, dense, compiled, batch, args, device, tol, tol, HF_GRAD_REASON)


def transformers_available() -> bool:
    """Whether ``transformers`` is installed (the qwen2 run needs it)."""
    return importlib.util.find_spec("transformers") is not None


def main(argv=None) -> int:
    """Runs the demo; returns the exit status (0 PASS, 1 FAIL)."""
    args = build_parser().parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else torch.device(args.device)
    names = ("gpt", "qwen2") if args.model == "both" else (args.model,)
    if "qwen2" in names and not transformers_available():
        if args.model == "qwen2":
            raise SystemExit('--model qwen2 needs transformers >= 5: pip install -e ".[hf]"')
        print('== qwen2: skipped, transformers is not installed (pip install -e ".[hf]")')
        names = ("gpt",)
    runs = {"gpt": run_gpt, "qwen2": run_qwen2}
    results = {}
    for name in names:
        results[name] = runs[name](args, dtype, device)
        print()
    if len(results) > 1:
        print("; ".join(f"{name}: {'PASS' if ok else 'FAIL'}" for name, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
