"""Activation checkpointing inside the compiled graph (passes/lower/checkpoint.py, docs/ARCHITECTURE.md §3.1 and §3.9).

``torch.utils.checkpoint.checkpoint(layer, ..., use_reentrant=False)`` and HF's ``gradient_checkpointing_enable``
are captured as ``tag_activation_checkpoint`` calls whose bodies hold the attentions. The rewrite analyses the
bodies with the graph and puts each packed body back into a checkpoint call: the loss and every gradient are
exact (float64, 1e-10), the tokens are shared, the packed graph still checkpoints (its backward recomputes the
packed bodies) and saves fewer bytes for backward than the packed graph without checkpointing.
"""
import pytest
import torch
import torch.utils.checkpoint as ckpt

import brcompile
from brcompile.testing import assert_exact
from brcompile.tools.measure import SavedBytes
from examples.gpt import GPT, GPTConfig
from examples.grpo import grpo_loss, make_grpo_batch

BACKEND_OPTIONS = dict(compiler="aot_eager")  # AOTAutograd (it handles the checkpoint HOP), no codegen
CFG = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48)
HOP = torch.ops.higher_order.tag_activation_checkpoint


class CheckpointedGPT(GPT):
    """The example GPT with every block under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``."""

    checkpointing = True

    def hidden_states(self, input_ids, attention_mask=None):
        B, L = input_ids.shape
        h = self.tok_emb(input_ids)
        cos, sin = self.rotary_cos_sin(L, input_ids.device, h.dtype)
        mask = None
        if attention_mask is not None:
            idx = torch.arange(L, device=input_ids.device)
            mask = (idx[:, None] >= idx[None, :])[None, None] & attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            if self.checkpointing:
                h = ckpt.checkpoint(layer, h, cos, sin, mask, use_reentrant=False)
            else:
                h = layer(h, cos, sin, mask)
        return self.norm(h)


def grpo_batch(**kw):
    spec = dict(num_prompts=2, group_size=4, prompt_len=9, response_len=(3, 6), shared_response_prefix=2,
                vocab_size=CFG["vocab_size"], seed=3, dtype=torch.float64)
    spec.update(kw)
    return make_grpo_batch(**spec)


def grpo_args(batch):
    return (batch["input_ids"], batch["attention_mask"], batch["completion_mask"], batch["advantages"],
            batch["old_logprobs"])


def assert_replayed(calls=1):
    s = brcompile.stats()
    assert s.replayed_calls == calls and s.fallback_calls == 0, str(s)
    assert s.rewritten_graphs > 0, str(s)
    assert s.executed_tokens < s.logical_tokens, str(s)


def packed_checkpoints(backend) -> int:
    """Checkpoint calls in the packed graphs of ``backend``'s rewritten records."""
    return sum(r.packed_code.count("tag_activation_checkpoint(") for r in backend.records if r.rewritten)


def loss_and_grads(model, fn, batch):
    params = list(model.parameters())
    loss = grpo_loss(fn, *grpo_args(batch))
    return loss.detach(), torch.autograd.grad(loss, params)


@pytest.mark.parametrize("mode, compiler, level", [("packed", "aot_eager", "auto"), ("replay", "aot_eager", "auto"),
                                                   ("packed", "aot_eager", "aten"),
                                                   pytest.param("packed", "inductor", "auto", marks=pytest.mark.slow)])
def test_gpt_checkpoint_per_layer_exact(mode, compiler, level):
    """checkpoint(layer) per layer, padded GRPO batch (mask built outside the bodies and passed in): one graph,
    rewritten, the attentions inside the bodies packed, each packed body inside its own checkpoint call.
    mode="replay": the streaming split inlines the bodies into its trunk and runs the kept prefix under one
    checkpoint (the record says so), streamed.
    Inductor (slow): the packed graph with its checkpoint calls compiles and runs exactly too. level="aten": the
    same through the functional ATen graph (the bodies carried through the export, passes/lower/aten.py)."""
    model = CheckpointedGPT(GPTConfig(**CFG), seed=0).to(torch.float64)
    batch = grpo_batch()
    ref_loss, ref_grads = loss_and_grads(model, model, batch)
    backend = brcompile.backend(compiler=compiler, mode=mode, level=level)
    loss, grads = loss_and_grads(model, torch.compile(model, backend=backend), batch)
    assert_exact(loss, ref_loss, torch.float64, "loss")
    for (name, _), a, b in zip(model.named_parameters(), grads, ref_grads):
        assert_exact(a, b, torch.float64, f"grad of {name}")
    assert_replayed(1)
    assert packed_checkpoints(backend) == CFG["n_layers"]
    rec = next(r for r in backend.records if r.rewritten)
    assert rec.level == ("aten" if level == "aten" else "dynamo")
    assert "tree_attention" not in rec.packed_code.split("def forward")[1].split("tag_activation_checkpoint")[0]
    if mode == "replay":
        assert rec.replay is not None and rec.replay["recompute"] is not None, rec.replay_reason
        assert brcompile.stats().streamed_calls == 1


def test_checkpoint_packed_body_holds_the_attention():
    """The packed bodies are GraphModules of the packed graph: each holds one tree attention."""
    model = CheckpointedGPT(GPTConfig(**CFG), seed=0).to(torch.float64)
    batch = grpo_batch()
    backend = brcompile.backend(**BACKEND_OPTIONS)
    torch.compile(model, backend=backend)(batch["input_ids"], batch["attention_mask"])
    rec = next(r for r in backend.records if r.rewritten)
    packed = rec.runtime.eager_packed.__self__
    bodies = [n for n in packed.graph.nodes if n.op == "call_function" and n.target is HOP]
    assert len(bodies) == CFG["n_layers"]
    for n in bodies:
        body = getattr(packed, n.args[0].target)
        assert sum(m.target is torch.ops.brcompile.tree_attention_forward.default for m in body.graph.nodes) == 1
        assert n.kwargs == {"use_reentrant": False}


@pytest.fixture
def llama_norms_in_float64(monkeypatch):
    """HF's RMSNorm computes in float32 even in a float64 model; with its math in float64 the gradients can
    be held to the float64 bound."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)
    return transformers


def test_hf_llama_gradient_checkpointing_exact(llama_norms_in_float64):
    """HF Llama (tiny, sdpa) with gradient_checkpointing_enable(use_reentrant=False), use_cache=False, padded
    batch: the decoder layers are checkpoint bodies; logits and every parameter gradient exact."""
    transformers = llama_norms_in_float64
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float64)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = grpo_batch()
    ids, am = batch["input_ids"], batch["attention_mask"]
    weights = am[..., None].to(torch.float64)
    params = list(model.parameters())

    def run(m):
        logits = m(input_ids=ids, attention_mask=am, use_cache=False).logits
        return logits.detach(), torch.autograd.grad((logits.square() * weights).sum(), params)

    ref, ref_grads = run(model)
    backend = brcompile.backend(**BACKEND_OPTIONS)
    out, grads = run(torch.compile(model, backend=backend))
    assert_exact(out * weights, ref * weights, torch.float64, "logits")
    for (name, _), a, b in zip(model.named_parameters(), grads, ref_grads):
        assert_exact(a, b, torch.float64, f"grad of {name}")
    assert_replayed(1)
    assert packed_checkpoints(backend) == cfg.num_hidden_layers


def saved_bytes(model, fn, batch) -> int:
    """Bytes autograd saves for backward in one GRPO loss (parameters excluded)."""
    with SavedBytes(exclude={p.data_ptr() for p in model.parameters()}) as saved:
        loss = grpo_loss(fn, *grpo_args(batch))
    loss.backward()
    return saved.total


def test_checkpoint_saves_fewer_bytes_packed():
    """Bytes saved for backward: the packed graph with checkpointing saves less than without it (the packed
    bodies' activations are recomputed in backward), and less than the eager checkpointed model."""
    cfg = dict(CFG, n_layers=4, dim=64, hidden_dim=96)
    model = CheckpointedGPT(GPTConfig(**cfg), seed=0).to(torch.float64)
    batch = grpo_batch(group_size=8, prompt_len=24, response_len=(4, 8))
    sizes = {}
    for checkpointing in (False, True):
        model.checkpointing = checkpointing
        sizes["eager", checkpointing] = saved_bytes(model, model, batch)
        torch._dynamo.reset()
        sizes["packed", checkpointing] = saved_bytes(model, torch.compile(model, backend=brcompile.backend(
            **BACKEND_OPTIONS)), batch)
    print("bytes saved for backward:", {f"{k[0]}{' +checkpoint' if k[1] else ''}": v for k, v in sizes.items()})
    assert brcompile.stats().fallback_calls == 0
    assert sizes["eager", True] < sizes["eager", False]
    assert sizes["packed", True] < sizes["packed", False]
    assert sizes["packed", True] < sizes["eager", True]


def test_checkpoint_saves_fewer_bytes_streaming():
    """mode="replay": the streaming prefix of a checkpointed model is run under activation checkpointing (its
    activations recomputed in backward), so it saves fewer bytes for backward than the same model without
    checkpoints, and the gradients stay exact."""
    cfg = dict(CFG, n_layers=4, dim=64, hidden_dim=96)
    model = CheckpointedGPT(GPTConfig(**cfg), seed=0).to(torch.float64)
    batch = grpo_batch(group_size=8, prompt_len=24, response_len=(4, 8))
    sizes, grads = {}, {}
    for checkpointing in (False, True):
        model.checkpointing = checkpointing
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        brcompile.reset_stats()
        sizes[checkpointing] = saved_bytes(model, torch.compile(model, backend=brcompile.backend(
            mode="replay", **BACKEND_OPTIONS)), batch)
        assert brcompile.stats().streamed_calls == 1, str(brcompile.stats())
        grads[checkpointing] = [p.grad.clone() for p in model.parameters()]
    print("bytes saved for backward (streaming):", sizes)
    assert sizes[True] < sizes[False]
    for (name, _), a, b in zip(model.named_parameters(), grads[True], grads[False]):
        assert_exact(a, b, torch.float64, f"grad of {name}")
