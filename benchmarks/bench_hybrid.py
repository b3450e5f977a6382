"""Hybrid models (attention + state-space / short-conv layers) under branch_replay: executed FLOPs, bytes saved
for backward and wall-clock of one GRPO-style forward+backward, dense eager vs branch_replay, side by side.

HF Bamba (Mamba-2 mixer), Jamba (Mamba-1 selective scan), LFM2 (gated short conv), Qwen3-Next (gated DeltaNet:
the chunked delta rule, a tree matrix scan after passes/canonical/scans/delta_rule.py), Mamba (no attention:
every layer a mixer, ``use_associative_scan=True``), and Llama as the all-attention control, built random from
configs: ``--layers`` layers alternating mixer / attention, hidden
``--dim``; one prompt of ``--prompt`` tokens and ``--group`` responses of ``--tail`` tokens. The Mamba mixers
have no token-axis rule: they run densely on the B·L positions and are packed again after (passes/analysis/repack.py),
so their FLOPs are not shared; LFM2's short conv is a tree scan (passes/analysis/rules/scan.py) and shares like
attention, and so are Mamba's conv and selective scan (``tree_causal_conv1d``, ``tree_linear_scan``). FLOPs and saved bytes come from ``brcompile.explain`` (FlopCounterMode over the eager original
and packed graphs); wall-clock is the median of ``--repeats`` steps in one process.

    python benchmarks/bench_hybrid.py                       # the table in benchmarks/RESULTS.md
    python benchmarks/bench_hybrid.py --families bamba --prompt 128 --repeats 1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import brcompile  # noqa: E402
from brcompile.testing import rel_err  # noqa: E402
from examples.grpo import make_grpo_batch  # noqa: E402

VOCAB = 256


def config_overrides(family: str, layers: int) -> dict:
    """Layers alternate mixer / attention (the attention at odd indices)."""
    attn = list(range(1, layers, 2))
    if family == "bamba":
        return dict(attn_layer_indices=attn, mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
                    mamba_chunk_size=64)
    if family == "jamba":
        return dict(attn_layer_period=2, attn_layer_offset=1, num_experts=1, mamba_d_state=16, use_mamba_kernels=False)
    if family == "mamba":  # no attention: the conv and the associative scan run on the tree
        return dict(state_size=16, expand=2, conv_kernel=4, use_associative_scan=True, use_mambapy=False)
    if family == "lfm2":
        return dict(layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(layers)], conv_L_cache=3)
    if family == "qwen3_next":  # gated DeltaNet layers (the chunked delta rule: a tree matrix scan), dense MLPs
        return dict(layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                    linear_value_head_dim=32, num_experts=0, mlp_only_layers=list(range(layers)))
    return {}


def build(family: str, dim: int, layers: int):
    import transformers

    cfg = transformers.AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0,
        **config_overrides(family, layers))
    torch.manual_seed(0)
    impl = "eager" if family == "mamba" else "sdpa"  # no attention to implement
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).float()


def next_token_loss(model, ids, am, cm):
    logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits
    lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = cm[:, 1:].to(lp.dtype)
    return -(lp * m).sum() / m.sum()


def median_step(fn, model, args, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up (compilation)
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        fn(model, *args).backward()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return times[len(times) // 2]


def run(family: str, a) -> dict:
    model = build(family, a.dim, a.layers)
    b = make_grpo_batch(vocab_size=VOCAB, seed=0, num_prompts=1, group_size=a.group, prompt_len=a.prompt,
                        response_len=a.tail)
    args = (b["input_ids"], b["attention_mask"], b["completion_mask"])
    report = brcompile.explain(next_token_loss, model, *args, backend=brcompile.backend(compiler="eager"))
    call = report.calls[0]
    cost = call.get("cost") or {}
    graph = report.graphs[0]
    want = next_token_loss(model, *args)
    brcompile.reset_stats()
    compiled = torch.compile(next_token_loss, backend=brcompile.backend(compiler="eager"))
    got = compiled(model, *args)
    eager_s = median_step(next_token_loss, model, args, a.repeats)
    replay_s = median_step(compiled, model, args, a.repeats)
    return dict(family=family, replayed=call["replayed"], reason=call.get("reason"),
                dense_regions=len(getattr(graph, "repacked", ())), B=args[0].shape[0], L=args[0].shape[1],
                N=(call.get("tree") or {}).get("executed_tokens"),
                dense_flops=cost.get("dense_flops"), packed_flops=cost.get("packed_flops"),
                limit_flops=cost.get("limit_flops"),
                dense_saved=cost.get("dense_saved_bytes"), packed_saved=cost.get("packed_saved_bytes"),
                eager_s=eager_s, replay_s=replay_s, loss_err=rel_err(got, want))


def markdown(rows: list[dict]) -> str:
    out = ["| model | B×L → N | dense regions | FLOPs dense / packed (ratio) | limit | saved for bwd dense / packed | "
           "eager s | branch_replay s | speedup | loss err |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["replayed"]:
            out.append(f"| {r['family']} | fell back: {r['reason']} |")
            continue
        ratio = r["dense_flops"] / r["packed_flops"] if r["packed_flops"] else float("nan")
        out.append(f"| {r['family']} | {r['B']}×{r['L']} → {r['N']} | {r['dense_regions']} | "
                   f"{r['dense_flops'] / 1e9:.2f} / {r['packed_flops'] / 1e9:.2f} G ({ratio:.2f}x) | "
                   f"{r['limit_flops'] / 1e9:.2f} G | {r['dense_saved'] / 2**20:.0f} / {r['packed_saved'] / 2**20:.0f} MiB | "
                   f"{r['eager_s']:.2f} | {r['replay_s']:.2f} | {r['eager_s'] / r['replay_s']:.2f}x | {r['loss_err']:.1e} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="llama,lfm2,bamba,jamba")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tail", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    print(f"torch {torch.__version__}, dim {a.dim}, {a.layers} layers, 1 prompt x {a.group} responses, "
          f"prompt {a.prompt}, tail {a.tail}, float32, CPU ({torch.get_num_threads()} threads)\n", flush=True)
    for i, family in enumerate(a.families.split(",")):  # one row at a time: a slow family loses nothing before it
        lines = markdown([run(family, a)]).splitlines()
        print("\n".join(lines if i == 0 else lines[2:]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
