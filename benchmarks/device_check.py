"""One device check for a CUDA GPU (not a test; CI has no GPU): correctness, attention timings, a GRPO step.

In one call, within ``--budget-s`` (default 450 s; each part skips what no longer fits, with a note):

(a) check    the "triton" and "flex" tree-attention impls against the float64 "reference" on two GRPO trees
             (a prompt shared by its group's responses, a shared response prefix, left or right padding), bf16
             and fp32, forward and backward through the op (q, k, v, and with every score feature on also the
             sinks, the relative-bias table and trainable ALiBi slopes); prints max |error| / max |reference|
             per output and gradient, and OK / FAILED against the dtype's bound.
(b) timing   forward+backward of tree attention on the packed tokens (impl "triton", impl "flex") and of dense
             causal SDPA on the equivalent dense batch (every row recomputes the prompt), bf16, Qwen2-1.5B's
             heads (Hq/Hkv = 12/2, D = 128), GRPO trees of N = 8k, 32k, 128k packed tokens: one prompt of N/2
             tokens shared by G = 8 responses of N/16; one table.
(c) grpo     one GRPO step (loss forward + backward, examples/hf.py's TRL-style loss) of a Qwen2 with
             Qwen2-1.5B's dimensions (hidden 1536, MLP 8960, 12/2 heads, vocab 151936, tied embeddings), random
             bf16 weights (nothing is downloaded) and ``--layers`` of its 28 layers (default 8, to fit the time
             budget: the report says how many ran), dense eager vs ``torch.compile(model,
             backend=brcompile.backend(attention=A, compiler=C))`` for A in ``--grpo-attention`` (default "auto",
             the Triton kernels on CUDA, and "flex"), C = ``--compiler`` (default aot_eager: unfused like the
             baseline, so the speedup is the shared prefixes' alone); prints the loss difference, the largest
             relative gradient difference over the parameters and the speedup (median step times).

(d) cp       with two GPUs or more: examples/context_parallel.py over NCCL, one rank per GPU (up to 4), the example
             GPT and Qwen2 in float32 under ``context_parallel``, their loss and all-reduced gradients against one
             process (the CPU tests run the same over gloo); with one GPU a note says it needs two.

(a) may use a quarter of the budget and (b) a third (what does not fit is skipped, with a note); (c) the rest.

Without a CUDA device it prints "no CUDA device: nothing to check" and exits 0; ``--quick`` instead runs every
code path at tiny sizes, on the CPU when there is no GPU (Triton through its interpreter, FlexAttention forward
only: it has no CPU backward, so its backward cells read "n/a" and the backend refuses attention="flex" for the
CPU GRPO step, which the report shows as a fallback with its reason). ``--out PATH`` writes the report too:
JSON for a ``.json`` path, markdown otherwise. The exit status is 1 when a correctness check failed.

    python benchmarks/device_check.py --out benchmarks/out/device_check.md
    python benchmarks/device_check.py --quick --out /tmp/device_check.json      # seconds, CPU or GPU
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `examples` importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

log = logging.getLogger("device_check")

NO_DEVICE = "no CUDA device: nothing to check (run with --quick for a CPU smoke of the code paths)"
#: Qwen2-1.5B's attention heads and head dim, used by (a) and (b)
HQ, HKV, D = 12, 2, 128
#: (a): max |error| / max(|reference|, 1) bound per dtype
CHECK_BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
#: (b): packed token counts, the group size; the prompt is N/2, each response N/(2G)
TIMING_TOKENS = (8192, 32768, 131072)
GROUP = 8
#: Qwen2-1.5B (its HF config's sizes)
QWEN2_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)
#: --quick: every part at tiny sizes
QUICK = dict(hq=4, hkv=2, d=16, check_prompt=(4, 6), check_response=(2, 4), tokens=(32,), group=2,
             qwen2=dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        tie_word_embeddings=True), grpo_prompt=(12, 16), grpo_response=(4, 8), grpo_group=4)


class Budget:
    """The wall-clock budget of the run: ``left()`` seconds remain; ``fits(s)`` whether s more do."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, seconds: float) -> bool:
        return self.left() > seconds

    def part(self, seconds: float) -> "Budget":
        """The budget of one part: at most ``seconds`` from now, and never past this budget's end."""
        sub = Budget(0.0)
        sub.deadline = min(self.deadline, time.monotonic() + seconds)
        return sub


@dataclass
class Report:
    """Everything the run found: (a) check lines, (b) timing rows, (c) GRPO rows, notes; ``failed`` when a
    correctness check failed."""

    device: str
    torch: str
    quick: bool
    check: list = field(default_factory=list)
    timing: list = field(default_factory=list)
    grpo: list = field(default_factory=list)
    cp: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    failed: bool = False


def _say(line: str) -> None:
    print(line, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], device: torch.device, reps: int, cap_s: float) -> tuple[float, int]:
    """(median seconds, reps timed) of ``fn()`` after one untimed warm-up call; at most ``reps`` timed calls,
    fewer once ``cap_s`` seconds are spent."""
    fn()
    _sync(device)
    times: list[float] = []
    while len(times) < reps and sum(times) < cap_s:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(max |want|, 1), in float64 (NaN anywhere: inf)."""
    diff = (got.detach().double() - want.detach().double()).abs()
    if torch.isnan(diff).any():
        return math.inf
    return diff.max().item() / max(want.detach().double().abs().max().item(), 1.0) if diff.numel() else 0.0


# ----------------------------------------------------------------------------------------- (a) check


def check_trees(device: torch.device, quick: bool) -> list[tuple[str, object]]:
    """[(name, PackedTree)]: two GRPO batches (2 prompts x 4 responses sharing 8 response tokens; left-padded
    prompts, and right-padded rows; ``quick``: the first, tiny), their prefix trees on ``device``."""
    from brcompile.runtime.tree import build_tree
    from examples.grpo import make_grpo_batch

    prompt, response = (QUICK["check_prompt"], QUICK["check_response"]) if quick else ((150, 400), (64, 256))
    shared = 2 if quick else 8
    trees = []
    for name, left in (("left-padded", True),) + (() if quick else (("right-padded", False),)):
        b = make_grpo_batch(num_prompts=2, group_size=4, prompt_len=prompt, response_len=response,
                            shared_response_prefix=shared, left_pad_prompts=left, seed=int(left))
        trees.append((name, build_tree(b["input_ids"], attention_mask=b["attention_mask"]).to(device)))
    return trees


def check_inputs(tree, hq: int, hkv: int, d: int, features: bool, device: torch.device) -> dict:
    """float64 leaves of one check: q [hq, N, d], k/v [hkv, N, d], dout; with ``features`` also sinks [hq], a
    relative-bias table [hq, N, 16] and trainable ALiBi slopes [hq], plus the op's window and soft-cap."""
    g = torch.Generator(device="cpu").manual_seed(0)
    n = tree.num_tokens

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device)

    leaves = dict(q=rand(hq, n, d), k=rand(hkv, n, d), v=rand(hkv, n, d))
    if features:
        leaves.update(sinks=rand(hq), relbias=rand(hq, n, 16, scale=0.5),
                      slopes=torch.tensor([2.0 ** -(8 + i % 4) for i in range(hq)], dtype=torch.float64,
                                          device=device))
    options = dict(window=64, softcap=30.0) if features else {}
    return dict(leaves=leaves, options=options, dout=rand(hq, n, d))


def run_op(tree, impl: str, leaves: dict, options: dict, dout: torch.Tensor, dtype: torch.dtype,
           backward: bool) -> dict:
    """{name: tensor}: the op's output ("out") and, with ``backward``, the gradient of every leaf, for ``impl``
    with the leaves cast to ``dtype`` (the slopes stay float64: the op reads them in its accumulation dtype)."""
    from brcompile.backends.attention.op import tree_attention

    xs = {k: (v if k == "slopes" else v.to(dtype)).detach().requires_grad_(backward) for k, v in leaves.items()}
    with torch.set_grad_enabled(backward):
        out = tree_attention(xs["q"], xs["k"], xs["v"], tree, impl=impl, position=tree.position,
                             sinks=xs.get("sinks"), relbias=xs.get("relbias"), slopes=xs.get("slopes"), **options)
    result = {"out": out}
    if backward:
        grads = torch.autograd.grad(out, list(xs.values()), dout.to(out.dtype))
        result.update({f"d{k}": g for k, g in zip(xs, grads)})
    return result


def part_check(report: Report, device: torch.device, quick: bool, budget: Budget) -> None:
    """(a): triton and flex against the reference (module docstring)."""
    hq, hkv, d = (QUICK["hq"], QUICK["hkv"], QUICK["d"]) if quick else (HQ, HKV, D)
    flex_backward = device.type == "cuda"
    for tree_name, tree in check_trees(device, quick):
        for features in (False, True):
            case = check_inputs(tree, hq, hkv, d, features, device)
            label = f"{tree_name} N={tree.num_tokens} " + ("window+softcap+sinks+relbias+slopes" if features
                                                            else "plain")
            want = run_op(tree, "reference", case["leaves"], case["options"], case["dout"], torch.float64, True)
            for impl in ("triton", "flex"):
                for dtype in (torch.float32, torch.bfloat16):
                    name = f"{impl} {str(dtype).replace('torch.', '')} {label}"
                    if impl == "triton" and dtype == torch.bfloat16 and device.type != "cuda":
                        report.check.append(dict(case=name, note="not checked: bf16 tl.dot is wrong in Triton's "
                                                                 "interpreter (needs a GPU)"))
                        continue
                    if not budget.fits(30):
                        report.check.append(dict(case=name, note="skipped: budget"))
                        continue
                    backward = impl != "flex" or flex_backward
                    try:
                        got = run_op(tree, impl, case["leaves"], case["options"], case["dout"], dtype, backward)
                    except Exception as e:  # noqa: BLE001 - reported, and counted as a failure
                        report.failed = True
                        row = dict(case=name, note=f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                        report.check.append(row)
                        _say(f"check {name}: {row['note']}")
                        continue
                    errors = {k: rel_error(g, want[k]) for k, g in got.items()}
                    ok = max(errors.values()) <= CHECK_BOUNDS[dtype]
                    report.failed |= not ok
                    note = "OK" if ok else "FAILED"
                    if not backward:
                        note += " (forward only: FlexAttention has no CPU backward)"
                    report.check.append(dict(case=name, errors=errors, bound=CHECK_BOUNDS[dtype], note=note))
                    _say(f"check {name}: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items())
                         + f" (bound {CHECK_BOUNDS[dtype]:g}) {note}")


# ---------------------------------------------------------------------------------------- (b) timing


def grpo_tree(p: int, g: int, t: int, device: torch.device):
    """(end, valid, segments) of one prompt of p tokens followed by g distinct responses of t tokens
    (benchmarks/bench_attention.py's prompt_tails_tree) on ``device``."""
    from benchmarks.bench_attention import prompt_tails_tree

    return tuple(x.to(device) for x in prompt_tails_tree(p, g, t))


def tree_step(impl: str, tree_arrays, q, k, v, dout) -> Callable[[], None]:
    """Forward + backward of the tree-attention op with ``impl`` on packed q [Hq, N, D], k/v [Hkv, N, D]."""
    from brcompile.backends.attention.op import tree_attention

    def step():
        out = tree_attention(q, k, v, tree_arrays, impl=impl)
        torch.autograd.grad(out, (q, k, v), dout)
    return step


def sdpa_step(q, k, v, dout) -> Callable[[], None]:
    """Forward + backward of causal SDPA on the dense batch q [G, Hq, L, D], k/v [G, Hkv, L, D]: GQA by
    ``enable_gqa``, or, where this torch's kernels refuse it, K/V heads repeated inside the step (the repeat's
    backward is a sum, small next to attention)."""
    import torch.nn.functional as F

    native = {"gqa": True}

    def attend():
        if native["gqa"]:
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            except RuntimeError as e:
                log.info("SDPA without enable_gqa (%s); repeating K/V heads", str(e).splitlines()[0])
                native["gqa"] = False
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=True)

    def step():
        torch.autograd.grad(attend(), (q, k, v), dout)
    return step


def _randn(shape, dtype, device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=dtype)


def time_row(method: str, n: int, p: int, g: int, t: int, device: torch.device, dtype: torch.dtype, hq: int,
             hkv: int, d: int, reps: int, cap_s: float) -> dict:
    """One timing row: fwd+bwd median ms of ``method`` ("triton", "flex": the packed tree of N tokens; "sdpa":
    the dense [G, P + T] batch)."""
    row = dict(tokens=n, prompt=p, group=g, response=t, method=method)
    if method == "sdpa":
        length = p + t
        q, k, v = (_randn((g, h, length, d), dtype, device, i).requires_grad_() for i, h in enumerate((hq, hkv, hkv)))
        step = sdpa_step(q, k, v, _randn((g, hq, length, d), dtype, device, 3))
        row["dense_tokens"] = g * length
    else:
        arrays = grpo_tree(p, g, t, device)
        q, k, v = (_randn((h, n, d), dtype, device, i).requires_grad_() for i, h in enumerate((hq, hkv, hkv)))
        step = tree_step(method, arrays, q, k, v, _randn((hq, n, d), dtype, device, 3))
    seconds, timed = median_time(step, device, reps, cap_s)
    row.update(ms=seconds * 1e3, reps=timed)
    return row


def part_timing(report: Report, device: torch.device, quick: bool, budget: Budget) -> None:
    """(b): triton vs flex vs dense SDPA, fwd+bwd (module docstring)."""
    hq, hkv, d = (QUICK["hq"], QUICK["hkv"], QUICK["d"]) if quick else (HQ, HKV, D)
    tokens, g = (QUICK["tokens"], QUICK["group"]) if quick else (TIMING_TOKENS, GROUP)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    warm: set = set()  # methods timed once already (their kernels compiled)
    for n in tokens:
        p, t = n // 2, n // (2 * g)
        for method in ("triton", "flex", "sdpa"):
            base = dict(tokens=n, prompt=p, group=g, response=t, method=method)
            if method == "flex" and device.type != "cuda":
                report.timing.append(dict(base, note="n/a: FlexAttention has no CPU backward"))
                continue
            # a first flex call compiles its kernels (about a minute); later sizes recompile once, dynamically
            need = 90 if method == "flex" and method not in warm else 20
            if not budget.fits(need):
                report.timing.append(dict(base, note=f"skipped: under {need} s of budget left"))
                continue
            try:
                row = time_row(method, n, p, g, t, device, dtype, hq, hkv, d, reps=2 if quick else 5,
                               cap_s=min(10.0, budget.left() / 6))
                warm.add(method)
            except torch.cuda.OutOfMemoryError:
                row = dict(base, note="out of memory")
            except Exception as e:  # noqa: BLE001 - one failing method must not end the run
                row = dict(base, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            report.timing.append(row)
            _say(f"timing N={n} {method}: " + (f"{row['ms']:.2f} ms fwd+bwd" if "ms" in row else row["note"]))
    triton_ms = {r["tokens"]: r.get("ms") for r in report.timing if r["method"] == "triton"}
    for r in report.timing:
        base = triton_ms.get(r["tokens"])
        if base and r.get("ms"):
            r["vs_triton"] = r["ms"] / base


# ------------------------------------------------------------------------------------------ (c) grpo


def qwen2_model(sizes: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A random-weight HF Qwen2ForCausalLM of ``sizes`` (a Qwen2Config's fields) with SDPA attention."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**sizes, pad_token_id=0, bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype)


def grpo_step(model, batch: dict) -> Callable[[], tuple[torch.Tensor, tuple]]:
    """The GRPO step: examples/hf.py's TRL-style loss of ``model`` on ``batch`` and the gradient of every
    parameter."""
    from examples.hf import completion_width, trl_grpo_loss

    params = [p for p in model.parameters() if p.requires_grad]
    width = completion_width(batch["completion_mask"])
    target = getattr(model, "_orig_mod", model)

    def step():
        loss = trl_grpo_loss(model, **batch, completion_len=width)
        return loss.detach(), torch.autograd.grad(loss, params)
    step.names = [n for n, p in target.named_parameters() if p.requires_grad]
    return step


def grad_rel_diff(got: tuple, want: tuple, names: list) -> tuple[float, str]:
    """(largest max |g - g_eager| / max |g_eager| over the parameters, the parameter's name)."""
    worst, where = 0.0, ""
    for name, g, w in zip(names, got, want):
        err = (g.double() - w.double()).abs().max().item() / max(w.double().abs().max().item(), 1e-30)
        if err > worst:
            worst, where = err, name
    return worst, where


def part_grpo(report: Report, device: torch.device, quick: bool, budget: Budget, layers: int, compiler: str,
              attentions: list) -> None:
    """(c): one GRPO step, dense eager vs branch_replay per attention impl (module docstring)."""
    import brcompile
    from examples.grpo import make_grpo_batch

    if quick:
        sizes, dtype = dict(QUICK["qwen2"]), torch.float32 if device.type == "cpu" else torch.bfloat16
        prompt, response, group = QUICK["grpo_prompt"], QUICK["grpo_response"], QUICK["grpo_group"]
    else:
        sizes, dtype = dict(QWEN2_15B, num_hidden_layers=layers), torch.bfloat16
        prompt, response, group = (768, 1024), (256, 512), 8
    model = qwen2_model(sizes, dtype, device)
    batch = make_grpo_batch(num_prompts=2, group_size=group, prompt_len=prompt, response_len=response,
                            vocab_size=sizes["vocab_size"], left_pad_prompts=True, seed=0, device=device)
    shape = (f"Qwen2 hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} layers"
             + ("" if quick else f" of Qwen2-1.5B's {QWEN2_15B['num_hidden_layers']}")
             + f", {str(dtype).replace('torch.', '')}, batch {tuple(batch['input_ids'].shape)}")
    report.notes.append(f"grpo model: {shape}")
    _say(f"grpo: {shape}")
    reps = 2 if quick else 3
    eager = grpo_step(model, batch)
    want_loss, want_grads = eager()
    eager_s, _ = median_time(eager, device, reps, cap_s=30.0)
    report.grpo.append(dict(method="dense eager", ms=eager_s * 1e3, loss=want_loss.item()))
    _say(f"grpo dense eager: {eager_s * 1e3:.1f} ms, loss {want_loss.item():.6f}")
    for attention in attentions:
        name = f"branch_replay attention={attention} compiler={compiler}"
        if not budget.fits(120 if not quick else 10):
            report.grpo.append(dict(method=name, note="skipped: budget"))
            continue
        brcompile.reset_stats()  # no Dynamo reset: the flex kernels compiled in (a) and (b) stay warm
        try:
            compiled = torch.compile(model, backend=brcompile.backend(attention=attention, compiler=compiler))
            step = grpo_step(compiled, batch)
            t0 = time.perf_counter()
            got_loss, got_grads = step()
            _sync(device)
            first_s = time.perf_counter() - t0
            seconds, _ = median_time(step, device, reps, cap_s=30.0)
        except Exception as e:  # noqa: BLE001 - one failing method must not end the run
            report.failed = True
            row = dict(method=name, note=f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            report.grpo.append(row)
            _say(f"grpo {name}: {row['note']}")
            continue
        stats = brcompile.stats()
        worst, where = grad_rel_diff(got_grads, want_grads, step.names)
        reasons = sorted(stats.fallback_reasons)
        row = dict(method=name, ms=seconds * 1e3, first_call_s=first_s, loss=got_loss.item(),
                   loss_diff=abs(got_loss.item() - want_loss.item()), grad_max_rel_diff=worst, grad_worst=where,
                   speedup=eager_s / seconds, replayed_calls=stats.replayed_calls,
                   fallback_calls=stats.fallback_calls, dedup=stats.dedup_ratio,
                   note="replayed" if stats.replayed_calls else "fell back: " + "; ".join(reasons)[:300])
        report.grpo.append(row)
        _say(f"grpo {name}: {row['ms']:.1f} ms ({row['speedup']:.2f}x), loss diff {row['loss_diff']:.2e}, grad max "
             f"rel diff {worst:.2e} ({where}), replayed {stats.replayed_calls}, fallback {stats.fallback_calls}, "
             f"first call {first_s:.1f} s; {row['note']}")
    del model


# ------------------------------------------------------------------------------------------ report


def part_cp(report: Report, quick: bool) -> None:
    """(d): context parallelism over NCCL, one rank per GPU (module docstring)."""
    gpus = torch.cuda.device_count()
    if gpus < 2:
        report.notes.append(f"cp: context parallelism over NCCL needs two GPUs or more; {gpus} here (the gloo "
                            f"tests on the CPU cover it)")
        return
    from examples.context_parallel import TOL, Case, compare, launch, reference

    ranks = min(gpus, 4)
    cases = [Case(device="cuda", dtype=torch.float32, compiler="inductor"),
             Case(model="qwen2", device="cuda", dtype=torch.float32, compiler="inductor", left_pad_prompts=True,
                  prompt_len=(40, 80) if quick else (400, 800), response_len=(8, 32))]
    for case, results in zip(cases, launch(cases, world_size=ranks)):
        err = max(compare(r, reference(case)) for r in results)
        ok = err <= 10 * TOL[case.dtype] and all(r["stats"]["context_parallel_calls"] == 1 for r in results)
        report.cp.append({"model": case.model, "ranks": ranks, "tokens": [r["tokens"] for r in results],
                          "max_rel_err": err, "ok": ok})
        report.failed |= not ok
        _say(f"cp {case.model} on {ranks} GPUs (NCCL): tokens {[r['tokens'] for r in results]}, "
             f"max rel err {err:.2e} {'OK' if ok else 'FAILED'}")


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def markdown(report: Report) -> str:
    """The report as markdown: the check lines, the timing table, the GRPO table."""
    out = ["# Device check", "", f"device: {report.device}; torch {report.torch}" + ("; --quick" if report.quick
                                                                                     else ""), ""]
    out += ["## (a) impls vs the float64 reference (max |error| / max(|ref|, 1))", ""]
    for r in report.check:
        errs = ", ".join(f"{k}={v:.1e}" for k, v in r.get("errors", {}).items())
        out.append(f"- {r['case']}: " + (f"{errs} " if errs else "") + r["note"])
    out += ["", "## (b) tree attention fwd+bwd: triton vs flex vs dense SDPA", "",
            "| packed N | prompt | G | response | method | dense tokens | fwd+bwd ms | ms / triton ms | reps | note |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.timing:
        out.append("| " + " | ".join(_cell(r.get(k)) for k in ("tokens", "prompt", "group", "response", "method",
                                                                 "dense_tokens", "ms", "vs_triton", "reps", "note"))
                   + " |")
    out += ["", "## (c) GRPO step: dense eager vs branch_replay", "",
            "| method | step ms | speedup | loss | loss diff | grad max rel diff | worst param | replayed | dedup "
            "| first call s | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.grpo:
        out.append("| " + " | ".join(_cell(r.get(k)) for k in (
            "method", "ms", "speedup", "loss", "loss_diff", "grad_max_rel_diff", "grad_worst", "replayed_calls",
            "dedup", "first_call_s", "note")) + " |")
    if report.cp:
        out += ["", "## (d) context parallelism over NCCL", "", "| model | ranks | tokens per rank | max rel err | ok |",
                "|---|---|---|---|---|"]
        out += [f"| {r['model']} | {r['ranks']} | {r['tokens']} | {r['max_rel_err']:.2e} | {r['ok']} |"
                for r in report.cp]
    out += [""] + [f"- {n}" for n in report.notes]
    return "\n".join(out) + "\n"


def write_report(report: Report, path: str) -> None:
    """JSON for a ``.json`` path, markdown otherwise (directories made as needed)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(asdict(report), indent=2) if target.suffix == ".json" else markdown(report)
    target.write_text(text)
    _say(f"wrote {target}")


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="every part at tiny sizes (runs on the CPU too)")
    ap.add_argument("--out", default=None, help="also write the report here (.json: JSON, else markdown)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget of the whole run")
    ap.add_argument("--layers", type=int, default=8, help="(c): layers of the 28 of Qwen2-1.5B")
    ap.add_argument("--compiler", default="aot_eager", choices=["inductor", "aot_eager", "eager"],
                    help="(c): how branch_replay runs the packed graph (default aot_eager: no fusion, like the "
                         "dense eager baseline, so the speedup is the shared prefixes' alone, and no Inductor "
                         "compile time in the budget)")
    ap.add_argument("--grpo-attention", default="auto,flex",
                    help="(c): comma-separated brcompile attention impls to compile the model with")
    ap.add_argument("--parts", default="check,timing,grpo,cp", help="comma-separated parts to run")
    args = ap.parse_args(argv)
    if not 1 <= args.layers <= QWEN2_15B["num_hidden_layers"]:
        ap.error(f"--layers {args.layers}: choose 1..{QWEN2_15B['num_hidden_layers']}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        _say(NO_DEVICE)
        return 0
    if not cuda:  # the Triton kernels run in Triton's interpreter; it must be set before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if cuda else "cpu")
    budget = Budget(args.budget_s)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    report = Report(device=name, torch=torch.__version__, quick=args.quick)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    start = time.monotonic()
    if "check" in parts:
        part_check(report, device, args.quick, budget.part(0.25 * args.budget_s))
    if "timing" in parts:
        part_timing(report, device, args.quick, budget.part(0.35 * args.budget_s))
    if "grpo" in parts:
        attentions = [a.strip() for a in args.grpo_attention.split(",") if a.strip()]
        part_grpo(report, device, args.quick, budget, args.layers, args.compiler if cuda else "eager",
                  attentions)
    if "cp" in parts and cuda:
        part_cp(report, args.quick)
    report.notes.append(f"wall time {time.monotonic() - start:.0f} s of a {args.budget_s:g} s budget")
    _say(markdown(report))
    if args.out:
        write_report(report, args.out)
    if report.failed:
        _say("device check: a correctness check FAILED (see above)")
    return 1 if report.failed else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
