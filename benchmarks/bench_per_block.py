"""Per-block graphs: the cost of float tree keys, and branch_replay per block vs dense per-block compile.

    python benchmarks/bench_per_block.py [--quick] [--compiler aot_eager|inductor] [--repeats 3]

1. **Key hashing.** A per-block graph's tree keys are its hidden states [B, L, D]: every call of the first
   block hashes them per position, sorts the rows and verifies equal prefixes bitwise
   (``brcompile.runtime.tree.build_tree``); later blocks reuse the tree by provenance (no hashing). Timed on
   random hidden states with shared prefixes (G groups of R rows), float32 and bfloat16; reported as ns per
   key element and as a fraction of one dense block's forward+backward on the same input (the block of
   the example GPT at width D, eager). Extrapolated to 2.1M positions x D = 4096 in bfloat16 two ways: the
   CPU per-element cost times the elements, and the GPU bound of reading the keys once at H200 memory
   bandwidth (4.8 TB/s), next to the block's forward+backward at that size at H200 dense bf16 peak — both
   estimates, labelled as such.
2. **Per-block speedup.** The example GPT with every block compiled on its own (``torch.compile(block)``,
   as FSDP2 per block does), on a GRPO batch: dense per-block compile vs branch_replay per block (the first
   block hashes, the others reuse the tree), forward+backward wall-clock side by side in one process,
   median of repeats, exactness of every gradient checked first.

Results: benchmarks/RESULTS.md ("Per-block graphs").
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import brcompile  # noqa: E402
from brcompile.runtime.tree import build_tree  # noqa: E402
from brcompile.testing import rel_err  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.grpo import grpo_loss, make_grpo_batch  # noqa: E402

H200_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS = 989e12
TARGET_POSITIONS, TARGET_DIM = 2_100_000, 4096


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shared_hidden(groups: int, rows: int, L: int, D: int, prompt: int, dtype, seed: int = 0) -> torch.Tensor:
    """[groups * rows, L, D] hidden states: each group's rows equal on their first ``prompt`` positions."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(groups * rows, L, D, generator=g).to(dtype)
    for k in range(groups):
        h[k * rows:(k + 1) * rows, :prompt] = h[k * rows, :prompt].clone()
    return h


def block_step_s(D: int, h: torch.Tensor, repeats: int) -> float:
    """Forward+backward of one dense block of the example GPT at width D on ``h`` (float32, eager): timed on
    the first 8 rows and scaled by the row count (the block is linear in the rows)."""
    model = GPT(GPTConfig(vocab_size=64, dim=D, n_layers=1, n_heads=max(1, D // 64), n_kv_heads=max(1, D // 128),
                          hidden_dim=(8 * D) // 3), seed=0)
    x = h[:8].float().requires_grad_()
    cos, sin = model.rotary_cos_sin(x.shape[1], x.device, x.dtype)
    blk = model.layers[0]
    return median_s(lambda: blk(x, cos, sin).sum().backward(), repeats) * h.shape[0] / x.shape[0]


def hashing(args) -> list[dict]:
    rows = []
    shapes = [(4, 8, 512, 256), (4, 8, 512, 1024)] if args.quick else \
        [(4, 8, 512, 256), (4, 8, 512, 1024), (4, 8, 2048, 1024), (2, 8, 1024, 4096)]
    # the block is timed up to D = 1024 (a D = 4096 block takes minutes on a CPU)
    for groups, r, L, D in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            h = shared_hidden(groups, r, L, D, L // 2, dtype)
            s = median_s(lambda: build_tree([h]), args.repeats)
            elems = h.numel()
            step = block_step_s(D, h, args.repeats) if dtype == torch.float32 and D <= 1024 else None
            rows.append(dict(B=groups * r, L=L, D=D, dtype=str(dtype).replace("torch.", ""), hash_ms=s * 1e3,
                             ns_per_elem=s * 1e9 / elems, block_ms=None if step is None else step * 1e3))
            print(f"hash  B={groups * r:3d} L={L:5d} D={D:5d} {rows[-1]['dtype']:8s}  {s * 1e3:8.1f} ms  "
                  f"{rows[-1]['ns_per_elem']:.2f} ns/elem" + ("" if step is None else
                                                             f"  block fwd+bwd {step * 1e3:8.1f} ms  "
                                                             f"hash/block {s / step:6.1%}"), flush=True)
    return rows


def extrapolate(rows: list[dict]) -> None:
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    ns = bf16[-1]["ns_per_elem"]  # the largest shape measured
    elems = TARGET_POSITIONS * TARGET_DIM
    cpu_s = ns * elems * 1e-9
    gpu_read_s = elems * 2 / H200_BYTES_PER_S
    # one Llama-style block at D = 4096 (MLP 11008, GQA 32/8 heads of 128): ~ 2 * params FLOPs per position
    # forward, 4x for forward+backward (dense attention at long context adds more; not counted: a lower bound)
    params = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 11008
    block_s = 6 * params * TARGET_POSITIONS / H200_BF16_FLOPS
    print(f"extrapolated to {TARGET_POSITIONS:,} positions x D={TARGET_DIM} bf16 ({elems * 2 / 2**30:.1f} GiB of keys):")
    print(f"  CPU at {ns:.2f} ns/elem: {cpu_s:.1f} s  (estimate)")
    print(f"  GPU bound, reading the keys once at 4.8 TB/s: {gpu_read_s * 1e3:.1f} ms; one dense block fwd+bwd "
          f"(6 x {params / 1e6:.0f}M params x positions at 989 TFLOP/s, attention not counted): {block_s * 1e3:.0f} ms "
          f"-> {gpu_read_s / block_s:.1%} (estimate; hashing also sorts N keys)")


def per_block(args) -> None:
    dim, layers = (64, 2) if args.quick else (256, 4)
    P, T, G = (64, 16, 4) if args.quick else (512, 64, 8)
    cfg = GPTConfig(vocab_size=512, dim=dim, n_layers=layers, n_heads=max(1, dim // 64),
                    n_kv_heads=max(1, dim // 128), hidden_dim=(8 * dim) // 3)
    batch = make_grpo_batch(num_prompts=1, group_size=G, prompt_len=P, response_len=T, vocab_size=512, seed=0,
                            dtype=torch.float32)
    model = GPT(cfg, seed=0)
    params = list(model.parameters())
    ids = batch["input_ids"]

    def wrap(blocks):
        class PerBlock(torch.nn.Module):
            def forward(self, input_ids, attention_mask=None):
                h = model.tok_emb(input_ids)
                cos, sin = model.rotary_cos_sin(input_ids.shape[1], h.device, h.dtype)
                for blk in blocks:
                    h = blk(h, cos, sin)
                return model.logits(model.norm(h))
        return PerBlock()

    def step(wrapped):
        loss = grpo_loss(wrapped, ids, batch["attention_mask"], batch["completion_mask"], batch["advantages"],
                         batch["old_logprobs"], use_attention_mask=False)
        return torch.autograd.grad(loss, params)

    torch._dynamo.reset()
    dense = wrap([torch.compile(b, backend=args.compiler) for b in model.layers])
    replay = wrap([torch.compile(b, backend=brcompile.backend(compiler=args.compiler)) for b in model.layers])
    g_dense, g_replay = step(dense), step(replay)
    err = max(rel_err(a, b) for a, b in zip(g_replay, g_dense))
    brcompile.reset_stats()
    t_dense = median_s(lambda: step(dense), args.repeats)
    t_replay = median_s(lambda: step(replay), args.repeats)
    st = brcompile.stats()
    print(f"per block: GPT dim {dim} x {layers} blocks, G={G} P={P} T={T}, {args.compiler}: dense per-block "
          f"{t_dense * 1e3:.0f} ms, branch_replay per block {t_replay * 1e3:.0f} ms -> {t_dense / t_replay:.2f}x; "
          f"tokens {st.logical_tokens // max(1, st.replayed_calls)} -> {st.executed_tokens // max(1, st.replayed_calls)} "
          f"per block call; max grad rel err {err:.1e}")
    if err > 1e-4:
        raise SystemExit("per-block gradients differ from dense")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    p.add_argument("--compiler", default="aot_eager", choices=["aot_eager", "inductor", "eager"])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    extrapolate(hashing(args))
    per_block(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
