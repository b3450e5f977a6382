"""Memory of streaming replay vs packed vs dense, as the group size G grows at a fixed prompt.

    python benchmarks/bench_replay.py                  # G in 4 8 16 32, P=1024, T=64, float32
    python benchmarks/bench_replay.py --quick          # tiny sizes (seconds)
    python benchmarks/bench_replay.py --out replay.md  # also write the markdown table
    python benchmarks/bench_replay.py --model mixtral  # HF Mixtral (a MoE block per layer) of the same sizes

One GRPO loss forward+backward (examples/gpt.py + examples/grpo.py) per (mode, G), each in a fresh
subprocess so that its peak RSS is its own:

* dense: the loss run eagerly on the [G, P+T] batch;
* packed: ``torch.compile(grpo_loss, backend=brcompile.backend(mode="packed"))``;
* replay: ``mode="replay"`` (docs/ARCHITECTURE.md §7): the prompt once, the responses in chunks of ``--chunk-tokens``.

Columns: **saved for backward** — bytes of the distinct storages autograd holds after the forward
(``saved_tensors_hooks`` during the forward only; parameters excluded; for replay this includes the
prefix's activations and the cached K/V it keeps inside its autograd node); **peak RSS** of the worker
(``ru_maxrss``: includes torch itself and compilation) and **step peak** (the peak RSS of the measured
step above the RSS just before it: freed heap is returned to the OS with malloc_trim and Linux's peak mark
reset via /proc/self/clear_refs first; compilation runs before, on a G=2 batch); wall-clock of one
forward+backward (median of ``--repeats`` after the measured step). Expected: replay flat in G, packed
growing with G*T, dense with G*(P+T); replay's time ~ packed + one extra tail forward.
Every worker also checks its loss and gradients against the dense run of the same batch.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import saved_activation_bytes  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.grpo import grpo_loss, make_grpo_batch  # noqa: E402

MODES = ("dense", "packed", "replay")
#: --model: the example GPT, or an HF model of the same sizes built from its config (random weights): Mixtral (a
#: MoE block per layer, sort-based dispatch, 4 experts top-2) or MPT (ALiBi)
MODELS = ("gpt", "mixtral", "mpt")


class HFLogits(torch.nn.Module):
    """An HF causal LM called as ``model(input_ids, attention_mask)`` -> logits (what ``grpo_loss`` calls)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def build_model(args) -> torch.nn.Module:
    """The measured model (``--model``), float32, seed 0."""
    if args.model == "gpt":
        return GPT(GPTConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                             n_kv_heads=args.kv_heads), seed=0)
    import transformers

    torch.manual_seed(0)
    if args.model == "mixtral":
        cfg = transformers.AutoConfig.for_model(
            "mixtral", vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=2 * args.dim,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=2 * (args.prompt_len + args.response_len))
        return HFLogits(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"))
    cfg = transformers.AutoConfig.for_model("mpt", vocab_size=args.vocab, d_model=args.dim, n_heads=args.heads,
                                            n_layers=args.layers, expansion_ratio=2,
                                            max_seq_len=2 * (args.prompt_len + args.response_len))
    return HFLogits(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager"))


def rss_bytes() -> int:
    """Current resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def reset_peak() -> bool:
    """Return freed heap to the OS (glibc ``malloc_trim``), then reset the kernel's peak-RSS mark of this
    process (Linux: ``5 > /proc/self/clear_refs``), so the next peak is the next step's own."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    """Peak RSS since the last reset (VmHWM), or the lifetime ru_maxrss where /proc is unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return maxrss_bytes()


def maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def _batch(args, g: int, seed: int = 0):
    b = make_grpo_batch(num_prompts=1, group_size=g, prompt_len=args.prompt_len, response_len=args.response_len,
                        vocab_size=args.vocab, seed=seed)
    return (b["input_ids"], b["attention_mask"], b["completion_mask"], b["advantages"], b["old_logprobs"], 0.2, True)


def worker(args) -> dict:
    """One (mode, G) measurement in this process."""
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = build_model(args)
    params = list(model.parameters())
    exclude = {p.untyped_storage().data_ptr() for p in params}
    if args.mode == "dense":
        fn = grpo_loss
    else:
        import brcompile

        fn = torch.compile(grpo_loss, dynamic=True, backend=brcompile.backend(
            compiler=args.compiler, mode=args.mode, chunk_tokens=args.chunk_tokens))
        warm = fn(model, *_batch(args, 2, seed=1))  # compile on a small batch
        torch.autograd.grad(warm, params)
    batch = _batch(args, args.group)
    holder = []
    peak_before = maxrss_bytes()
    reset = reset_peak()
    rss0 = rss_bytes()  # after the trim
    saved = saved_activation_bytes(lambda: holder.append(fn(model, *batch)), exclude)
    grads = torch.autograd.grad(holder.pop(), params)
    step_peak = peak_bytes() - rss0 if reset else maxrss_bytes() - rss0
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        torch.autograd.grad(fn(model, *batch), params)
        times.append(time.perf_counter() - t0)
    result = {"mode": args.mode, "G": args.group, "saved": saved, "peak_rss": max(peak_before, maxrss_bytes()),
              "step_peak": step_peak, "seconds": statistics.median(times) if times else None}
    if args.mode != "dense":
        import brcompile

        s = brcompile.stats()
        result["streamed"] = s.streamed_calls
        result["replayed"] = s.replayed_calls
        ref = torch.autograd.grad(grpo_loss(model, *batch), params)
        result["max_grad_rel_err"] = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                                         for a, b in zip(grads, ref))
    return result


def run_worker(args, mode: str, g: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--group", str(g)] + _shared_flags(args)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {mode} G={g} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _shared_flags(args) -> list[str]:
    return ["--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len), "--dim", str(args.dim),
            "--layers", str(args.layers), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
            "--vocab", str(args.vocab), "--chunk-tokens", str(args.chunk_tokens), "--compiler", args.compiler,
            "--repeats", str(args.repeats), "--threads", str(args.threads), "--model", args.model]


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def markdown(results: list[dict], args) -> str:
    by = {(r["mode"], r["G"]): r for r in results}
    gs = sorted({r["G"] for r in results})
    name = {"gpt": "GPT", "mixtral": "HF Mixtral (4 experts, top-2)", "mpt": "HF MPT (ALiBi)"}[args.model]
    kv = "" if args.model == "mpt" else f" ({args.kv_heads} kv)"  # MPT has no grouped K/V heads
    lines = [f"{name} dim {args.dim}, {args.layers} layers, {args.heads} heads{kv}, "
             f"vocab {args.vocab}, "
             f"float32; one prompt of P={args.prompt_len}, G responses of T={args.response_len}; replay chunks of "
             f"<= {args.chunk_tokens} tokens; compiler {args.compiler}; {args.threads} thread(s).", "",
             "| G | saved for bwd MiB: dense | packed | replay | step peak MiB: dense | packed | replay | "
             "peak RSS MiB: dense | packed | replay | fwd+bwd s: dense | packed | replay | replay/packed time |"
             " replay grad err |",
             "|---|" + "---|" * 14]
    for g in gs:
        row = [str(g)]
        row += [_mib(by.get((m, g), {}).get("saved")) for m in MODES]
        row += [_mib(by.get((m, g), {}).get("step_peak")) for m in MODES]
        row += [_mib(by.get((m, g), {}).get("peak_rss")) for m in MODES]
        secs = [by.get((m, g), {}).get("seconds") for m in MODES]
        row += ["-" if s is None else f"{s:.3f}" for s in secs]
        row.append("-" if None in secs[1:] else f"{secs[2] / secs[1]:.2f}")
        err = by.get(("replay", g), {}).get("max_grad_rel_err")
        row.append("-" if err is None else f"{err:.1e}")
        lines.append("| " + " | ".join(row) + " |")
    rep = [by[("replay", g)]["saved"] for g in gs if ("replay", g) in by]
    pk = [by[("packed", g)]["saved"] for g in gs if ("packed", g) in by]
    if len(rep) >= 2:
        lines += ["", f"saved for backward from G={gs[0]} to G={gs[-1]}: replay x{rep[-1] / rep[0]:.3f}, "
                      f"packed x{pk[-1] / pk[0]:.2f}" + (
                          f", dense x{by[('dense', gs[-1])]['saved'] / by[('dense', gs[0])]['saved']:.2f}"
                          if ("dense", gs[0]) in by and ("dense", gs[-1]) in by else "")]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--compiler", default="aot_eager", choices=("inductor", "aot_eager", "eager"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--model", default="gpt", choices=MODELS, help="the example GPT or an HF model of its sizes")
    p.add_argument("--out", help="also write the markdown table to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--group", type=int, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if args.quick:
        args.groups, args.prompt_len, args.response_len = [2, 4], 64, 8
        args.dim, args.layers, args.heads, args.kv_heads, args.vocab = 64, 2, 4, 2, 128
        args.chunk_tokens, args.repeats, args.compiler = 16, 1, "eager"
    results = []
    for g in args.groups:
        for mode in args.modes:
            t0 = time.perf_counter()
            r = run_worker(args, mode, g)
            results.append(r)
            print(f"  {mode:6s} G={g:3d}: saved {_mib(r['saved'])} MiB, step peak {_mib(r['step_peak'])} MiB, "
                  f"peak RSS {_mib(r['peak_rss'])} MiB, fwd+bwd {r['seconds'] or 0:.3f} s "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            if mode != "dense" and (r.get("replayed") != 1 + args.repeats + 1 or
                                    (mode == "replay" and r.get("streamed", 0) < 1)):
                print(f"  warning: {mode} G={g}: brcompile stats {r}", file=sys.stderr)
    table = markdown(results, args)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
