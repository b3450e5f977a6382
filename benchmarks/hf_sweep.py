"""Every causal LM of the installed ``transformers``, tiny and random, under ``branch_replay``: replayed or not.

For each entry of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (model type -> model class) the sweep builds a tiny
config (hidden 32, 2 layers, 4 heads / 2 KV heads, vocab 96, intermediate 64, 4 experts top-2 where the config
has experts; every sub-config shrunk the same way; per-layer overrides of a heterogeneous config scaled the
same way, per layer kind; a causal-LM class that takes a composite config's text / decoder sub-config built
from that sub-config; per-architecture overrides where the tiny shape breaks a constraint), the model
(``attn_implementation="sdpa"`` where supported, else ``"eager"``; float64 where it runs, else float32), a GRPO-style batch (2 prompts x 3 responses, right
padding, ``attention_mask``, ``use_cache=False``) and the masked next-token log-prob loss of the completion
tokens. It runs the loss and every parameter gradient eagerly, then the same function through
``torch.compile(loss_fn, backend=brcompile.backend(compiler="eager", strict=False))``, compares them
(``brcompile.testing.rel_err``) and classifies the architecture:

  replayed      brcompile.stats(): replayed calls >= 1, no fallback call, fewer executed than logical tokens,
                loss and every gradient within the bound (a graph piece with nothing to share — it computes
                nothing, or reads no per-token value: ``NothingToShare`` — runs as it is and is no fallback;
                its calls are the row's ``unshared_calls``)
  partly        some calls replayed, some ran the original graph (or a replay that saved no token)
  fell back     no call replayed: the reasons (stats().fallback_reasons and the backend's graph records)
  not instantiable   the config, the model or its eager forward/backward failed (one line: why)
  wrong         compiled loss or a gradient beyond the bound: a bug
  raised        the compiled call raised: a bug

Bound: 1e-10 for a float64 model; 1e-5 ("float32 bound") when the model runs in float32 or computes norms /
softmax in float32 inside (found in the source of its modules' forwards: the reason is recorded). A gradient
that is zero up to rounding in the eager run (a key bias: softmax ignores a shift shared by all keys) is
measured against the model's largest gradient, not its own ~1e-21 entries (listed in the row's ``zero_grads``).

Each architecture runs in its own (forked) subprocess with a timeout, so a hang or a crash costs one row.

    python benchmarks/hf_sweep.py                       # all, JSON to benchmarks/out/hf_sweep.json
    python benchmarks/hf_sweep.py --only llama,gpt2 --markdown
    python benchmarks/hf_sweep.py --markdown --from-json benchmarks/out/hf_sweep.json   # table only
"""
from __future__ import annotations

import argparse
import collections
import copy
import datetime
import functools
import inspect
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CLASSES = ("replayed", "partly", "fell back", "not instantiable", "wrong", "raised", "timeout")
LABELS = {"replayed": "replayed exactly", "partly": "partly replayed", "fell back": "fell back",
          "not instantiable": "not instantiable", "wrong": "WRONG", "raised": "RAISED", "timeout": "timeout/crash"}
TOL = {"float64": 1e-10, "float32": 1e-5}
VOCAB = 96

#: set on a config when the default config has the attribute (or an alias of it)
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, head_dim=8, max_position_embeddings=64, n_positions=64, n_ctx=64,
    max_window_layers=2, hidden_size_global=32, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, ffn_dim=64, encoder_ffn_dim=64, decoder_ffn_dim=64, d_ff=64, n_inner=64,
    decoder_layers=2, decoder_attention_heads=4, encoder_layers=2, encoder_attention_heads=4,
    d_model=32, num_layers=2, num_decoder_layers=2, num_heads=4, n_head=4, n_layer=2, n_embd=32,
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    num_experts_per_token=2, moe_topk=2, moe_k=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    n_shared_experts=1, num_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
    expert_interval=1, decoder_sparse_step=1,
    # MLA (DeepSeek-style attention)
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
    # state-space / linear-attention hybrids
    state_size=8, mamba_d_state=8, ssm_state_size=8, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    # vision / audio sub-configs
    image_size=28, patch_size=14, num_channels=3, projection_dim=32, vision_feature_layer=-1,
    # special tokens inside the tiny vocab
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # encoder-style models with a causal-LM head run as decoders (BERT's is_decoder)
    is_decoder=True, add_cross_attention=False,
)
#: per model type, on top of TINY: the state-space head layout its config validates (Mamba-2: hidden_size *
#: expand = num_heads * head_dim, the groups dividing the heads; Falcon-H1: mamba_d_ssm = mamba_n_heads *
#: mamba_d_head)
TINY_BY_TYPE = {
    "mamba2": dict(head_dim=16, n_groups=1),
    "falcon_h1": dict(mamba_d_ssm=64),
    # partial rotary: rotary_dim (64 by default) within the tiny head dim (8)
    "codegen": dict(rotary_dim=4),
    "gptj": dict(rotary_dim=4),
    # one (global, local) pair of layers: attention_types expands to one kind per layer
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    # the released checkpoints give rope parameters per layer kind (the default config has none)
    "cohere_compass_text": dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # a conv layer and an attention layer (the default config leaves layer_types unset), the second one a
    # mixture of experts
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # KV sharing: the last layer reuses the first (sliding) layer's keys and values; every kind still produces
    "gemma3n_text": dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         num_kv_shared_layers=1, activation_sparsity_pattern=[0.95, 0.0, 0.0]),
    # Zamba ties its shared transformer block across the hybrid layers: two of them
    "zamba": dict(num_hidden_layers=3, layer_types=["linear_attention", "hybrid", "hybrid"],
                  layers_block_type=["linear_attention", "hybrid", "hybrid"]),
    # ZAYA routes each token to one expert
    "zaya": dict(num_experts_per_tok=1),
    # X-MOD's language adapters: the forward needs a language
    "xmod": dict(default_language="en_XX"),
    # dots3's sliding layers: head_dim = their qk_nope_head_dim (6, scaled from 192) + qk_rope_head_dim (4)
    "dots3_note_text": dict(head_dim=10),
    # BLT: byte patches of 4 (TINY's patch_size is a vision patch), a small hash-embedding vocabulary
    "blt": dict(patch_size=4, encoder_hash_byte_group_vocab=64),
    # MusicGen's decoder: one codebook (input rows are batch x codebooks)
    "musicgen_decoder": dict(num_codebooks=1),
    "musicgen_melody_decoder": dict(num_codebooks=1),
    # Reformer: local attention layers (LSH hashes with random rotations), plain position embeddings (the axial
    # ones fix the training sequence length)
    "reformer": dict(attn_layers=["local", "local"], axial_pos_embds=False, local_attn_chunk_length=1),
}
#: per sub-config class (a sub-config without a model type of its own), on top of TINY: DBRX's attention reads
#: attn_config.rope_theta, which its released configs carry and the class does not define; its FFN width
#: (and its released clip_qkv: the class's None default fails torch.clamp)
TINY_BY_CLASS = {
    "DbrxAttentionConfig": dict(rope_theta=10000.0, kv_n_heads=2, clip_qkv=8.0),
    "DbrxFFNConfig": dict(ffn_hidden_size=64, moe_top_k=2),
}
#: substrings of config keys zeroed (dropout makes eager and compiled draw different masks)
DROPOUT_KEYS = ("dropout", "pdrop", "drop_rate", "dropout_rate")


# --------------------------------------------------------------------------------------------------
# the tiny model


_MISSING = object()


def _get(config, key: str, fallback=None):
    """``getattr(config, key, fallback)``, also for a per-layer attribute of a heterogeneous config (transformers
    5.x's ``per_layer_config``), whose global value a plain read refuses as ambiguous: the global value."""
    raw = getattr(config, "_getattr_without_heterogeneous_validation", None)
    if raw is not None:
        return raw(key, fallback)
    return getattr(config, key, fallback)


def _has(config, key: str) -> bool:
    return _get(config, key, _MISSING) is not _MISSING


def _settable(cls, key: str, default=None) -> bool:
    """False for a read-only property of the config class (derived from other fields), or one whose setter
    refuses every value (ProphetNet's num_hidden_layers, XLNet's max_position_embeddings: NotImplementedError)."""
    attr = inspect.getattr_static(cls, key, None)
    if not isinstance(attr, property):
        return True
    if attr.fset is None:
        return False
    if default is not None:
        try:
            attr.fset(copy.copy(default), _get(default, key))
        except NotImplementedError:
            return False
        except Exception:  # noqa: BLE001  (a setter that validates: settable)
            pass
    return True


def _tiny_config_kwargs(cls, default, kinds: list | None = None) -> dict:
    """TINY's keys where ``default`` has them (sub-configs aside), dropout zeroed, per-layer lists cut to the tiny
    depth; ``kinds``: the tiny config's layer kinds, for its per-layer overrides (``_tiny_per_layer``)."""
    kw = {}
    for key, value in TINY.items():
        if not _settable(cls, key, default):
            continue
        if _has(default, key) or key in getattr(cls, "attribute_map", {}):
            cur = _get(default, key)
            if isinstance(cur, (list, tuple)) and not isinstance(value, (list, tuple)):
                continue  # per-layer lists (e.g. intermediate_size per layer): keep the model's own shape
            kw[key] = value
    for key, cur in vars(default).items():
        if isinstance(cur, float) and any(s in key for s in DROPOUT_KEYS):
            kw[key] = 0.0
    # MLA: the rotary head dim is the config's head_dim (DeepSeek-V3)
    if "qk_rope_head_dim" in kw and _get(default, "head_dim") == _get(default, "qk_rope_head_dim", 0):
        kw["head_dim"] = kw["qk_rope_head_dim"]
    if "kv_lora_rank" in kw and _get(default, "num_key_value_heads") == _get(default, "num_attention_heads", 0):
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)  # MLA: as many K/V heads as query heads
    # per-layer lists sized for the default depth: cut to the tiny depth
    layers = kw.get("num_hidden_layers")
    for key in ("layer_types", "mlp_layer_types", "layers_block_type", "hybrid_override_pattern", "block_types"):
        cur = _get(default, key)
        if not _settable(cls, key):
            continue
        if layers and isinstance(cur, (list, tuple)) and len(cur) > layers:
            kw[key] = _hybrid_cut(list(cur), layers)
        elif layers and isinstance(cur, str) and len(cur) > layers and key == "hybrid_override_pattern":
            kw[key] = "".join(_hybrid_cut(list(cur), layers))
    kw.update(_hybrid_periods(cls, default, layers))
    if not _settable(cls, "layers_block_type"):
        kw.pop("layer_types", None)  # derived (Bamba, Falcon-H1): set through attn_layer_indices
    hybrid = HYBRID_LAYER_KINDS.get(getattr(cls, "model_type", None))
    if hybrid and layers and layers >= 2:
        for alias, target in getattr(cls, "attribute_map", {}).items():
            if target == hybrid[0]:
                kw.pop(alias, None)
        kw[hybrid[0]] = hybrid[1] + hybrid[1][-1:] * (layers - 2)
    per_layer = _tiny_per_layer(default, kw, kinds if kinds is not None else kw.get("layer_types"))
    if per_layer is not None:
        kw["per_layer_config"] = per_layer
    return kw


def _tiny_per_layer(default, kw: dict, kinds: list | None) -> dict | None:
    """The tiny per-layer overrides of a heterogeneous config (transformers 5.x ``per_layer_config``: Gemma 4's
    wider head_dim on its full-attention layers, dots3's fewer heads on its sliding ones), None for a homogeneous
    one. Tiny layer i takes the overrides of the default's first layer of its kind (``kinds[i]``; by index where
    the config has no layer kinds), each integer override scaled as its global value was shrunk
    (tiny * override / default, at least 1): the layers differ as the released model's do."""
    spec = default.__dict__.get("_heterogeneity_spec")
    if spec is None:
        return None
    layers = kw.get("num_hidden_layers") or _get(default, "num_hidden_layers")
    src_kinds = list(_get(default, "layer_types") or [])
    out = {}
    for i in range(layers):
        kind = kinds[i] if kinds is not None and i < len(kinds) else None
        j = src_kinds.index(kind) if kind in src_kinds else i
        over = {}
        for attr, value in spec.per_layer_overrides.get(j, {}).items():
            glob, tiny = _get(default, attr), kw.get(attr)
            if (isinstance(value, int) and not isinstance(value, bool) and isinstance(glob, int) and glob
                    and isinstance(tiny, int)):
                value = max(1, round(tiny * value / glob))
            over[attr] = value
        if over:
            out[i] = over
    return out


#: layer kinds that hold an attention (a hybrid's tiny depth keeps one of them)
ATTENTION_KINDS = ("full_attention", "attention", "hybrid", "sliding_attention", "*")

#: hybrids whose default config has no attention layer at all (the family's released checkpoints do):
#: the tiny depth sets one layer of each kind
HYBRID_LAYER_KINDS = {"granitemoehybrid": ("layer_types", ["linear_attention", "full_attention"])}


def _hybrid_cut(kinds: list, layers: int) -> list:
    """The first ``layers`` layer kinds, but a hybrid keeps one layer of each kind (its first kinds that hold
    an attention and that do not) when the plain cut would drop all its attention or all its other layers."""
    cut = kinds[:layers]
    attn = [k for k in kinds if k in ATTENTION_KINDS]
    other = [k for k in kinds if k not in ATTENTION_KINDS]
    if attn and other and layers >= 2 and (not any(k in ATTENTION_KINDS for k in cut)
                                          or all(k in ATTENTION_KINDS for k in cut)):
        cut = [other[0], attn[0]] + cut[2:]
    return cut


def _hybrid_periods(cls, default, layers) -> dict:
    """Hybrids that place attention by period/offset or index (Jamba, Zamba, Bamba): one attention layer at
    the tiny depth's last index."""
    if not layers:
        return {}
    kw = {}
    if _settable(cls, "attn_layer_period") and _get(default, "attn_layer_period"):
        kw.update(attn_layer_period=layers, attn_layer_offset=layers - 1)
    if _settable(cls, "attn_layer_indices") and _has(default, "attn_layer_indices"):
        kw["attn_layer_indices"] = [layers - 1]
    return kw


def tiny_config(model_type: str, impl: str, depth: int = 0):
    """A tiny config of ``model_type``: TINY's keys where the default config has them, every sub-config shrunk."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    kw = _tiny_config_kwargs(cls, default)
    kw.update(TINY_BY_TYPE.get(model_type, {}))
    for name in getattr(cls, "sub_configs", {}) or {}:
        sub = getattr(default, name, None)
        if isinstance(sub, PretrainedConfig) and depth < 3:
            sub_type = getattr(sub, "model_type", None)
            if sub_type in CONFIG_MAPPING and CONFIG_MAPPING[sub_type] is type(sub):
                kw[name] = tiny_config(sub_type, impl, depth + 1)
            else:
                sub_cls = type(sub)
                kw[name] = sub_cls(**{**_tiny_config_kwargs(sub_cls, sub), **TINY_BY_CLASS.get(sub_cls.__name__, {})})
    cfg = AutoConfig.for_model(model_type, **kw)
    kinds = getattr(cfg, "layer_types", None)
    if "per_layer_config" in kw and kinds is not None and list(kinds) != list(kw.get("layer_types") or []):
        # the config set its own layer kinds (Gemma 4: the last layer is a full-attention one): the per-layer
        # overrides follow those kinds
        kw["per_layer_config"] = _tiny_per_layer(default, kw, list(kinds))
        cfg = AutoConfig.for_model(model_type, **kw)
    return cfg


def causal_lm_config(model_type: str, class_name: str, impl: str):
    """The tiny config ``class_name`` is built from: ``tiny_config(model_type)``, or, where the causal-LM class
    takes one of that composite config's sub-configs (Qwen3.5's, Llama 4's, MusicGen's text / decoder config:
    ``model_cls.config_class``), the tiny config of that sub-config's model type."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    want = getattr(getattr(transformers, class_name), "config_class", None)
    if want is not None and want is not cls and want in (getattr(cls, "sub_configs", {}) or {}).values():
        sub_type = getattr(want, "model_type", None)
        if sub_type in CONFIG_MAPPING and CONFIG_MAPPING[sub_type] is want:
            return tiny_config(sub_type, impl)
        return want(**{**_tiny_config_kwargs(want, want()), **TINY_BY_CLASS.get(want.__name__, {})})
    return tiny_config(model_type, impl)


def build_model(model_type: str, class_name: str):
    """(model, impl, dtype, note) or raises: sdpa where supported, else eager; float64 where it runs."""
    import torch
    import transformers

    model_cls = getattr(transformers, class_name)
    last = None
    for impl in ("sdpa", "eager"):
        try:
            cfg = causal_lm_config(model_type, class_name, impl)
            torch.manual_seed(0)
            model = model_cls._from_config(cfg, attn_implementation=impl)
            return model, impl, cfg
        except Exception as e:  # noqa: BLE001  (sdpa unsupported -> eager; the last error is the row's)
            last = e
    raise last


def float32_inside(model) -> list[str]:
    """Module classes of ``model`` (and the eager attention function, the rotary application) whose forward
    computes in float32 whatever the model's dtype: norms (``hidden_states.to(torch.float32)``),
    softmax(dtype=float32), ``q.float() * cos``."""
    import torch.nn as nn

    pat = re.compile(r"torch\.float32|\.float\(\)|dtype=torch\.float\b")
    found, seen = [], set()
    for mod in model.modules():
        cls = type(mod)
        if cls in seen or cls.__module__.startswith("torch.") or "Rotary" in cls.__name__:
            continue
        seen.add(cls)
        if isinstance(mod, (nn.Embedding, nn.Linear)):
            continue
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            continue
        if pat.search(src):
            found.append(cls.__name__)
    impl = getattr(model.config, "_attn_implementation", None)
    modeling = sys.modules.get(type(model).__module__)
    # the rotary tables are computed in float32 the same way dense and packed, but a rotary *application* that
    # casts q and k (``q.float() * cos``, ModernBERT-decoder's) rounds their values and gradients to float32
    for name in ("eager_attention_forward",) * (impl == "eager") + ("apply_rotary_pos_emb",):
        fn = getattr(modeling, name, None)
        if fn is not None:
            try:
                if pat.search(inspect.getsource(fn)):
                    found.append(name)
            except (OSError, TypeError):
                pass
    return found


# --------------------------------------------------------------------------------------------------
# the batch and the loss


def grpo_batch(vocab: int = VOCAB, seed: int = 1):
    """2 prompts x 3 responses, ragged, right-padded (pad 0, real tokens never 0)."""
    from examples.grpo import make_grpo_batch

    return make_grpo_batch(vocab_size=vocab, seed=seed, num_prompts=2, group_size=3, prompt_len=(6, 9),
                           response_len=(3, 6), left_pad_prompts=False, pad_id=0)


def next_token_loss(model, ids, am, cm, use_cache=True):
    """Masked mean negative log-likelihood of the completion tokens (next-token log-softmax gathered)."""
    kw = dict(input_ids=ids, attention_mask=am)
    if use_cache:
        kw["use_cache"] = False
    out = model(**kw)
    logits = out.logits if hasattr(out, "logits") else out[0]
    lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = cm[:, 1:].to(lp.dtype)
    return -(lp * m).sum() / m.sum()


def _grads(model, loss):
    import torch

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    gs = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return {n: g for (n, _), g in zip(params, gs)}


def _line(e: BaseException, limit: int = 300) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return re.sub(r"\s+", " ", s)[:limit]


# --------------------------------------------------------------------------------------------------
# one architecture


#: the refusal of an eager attention whose softmax runs in float32 inside a float64 model (that rounding is
#: not a reassociation); the architecture is then run in float32, the precision its attention computes in
SOFTMAX_FLOAT32 = "is computed in torch.float32"
#: the refusal of an eager attention that casts q and k to float32 inside a float64 model (GPT-Neo, FLINT) and
#: multiplies the float64 values: two products in two dtypes (tree attention computes both in one); the
#: architecture is then run in float32, as for the softmax
SCORES_FLOAT32 = "the scores q k^T are computed in torch.float32"


def run_arch(model_type: str, class_name: str | None = None, dtypes: tuple = ("float64", "float32")) -> dict:
    """Build, run eager and compiled, compare, classify. Returns a JSON-able row (never raises). A float64 run
    with a graph refused for its eager attention's float32 softmax is run again in float32 (as tests/models/test_hf.py
    runs eager attention), the row saying so."""
    row = _run_arch(model_type, class_name, dtypes)
    reasons = [g["reason"] or "" for g in row.get("graphs", []) if not g["rewritten"]]
    if row["dtype"] == "float64" and row["status"] in ("fell back", "partly") and any(
            SOFTMAX_FLOAT32 in r or SCORES_FLOAT32 in r for r in reasons):
        what = "the softmax" if any(SOFTMAX_FLOAT32 in r for r in reasons) else "the scores"
        again = _run_arch(model_type, class_name, ("float32",))
        again["bound_reason"] = (f"model runs in float32: its eager attention computes {what} in float32 "
                                 "(float64 weights are refused for that rounding)")
        return again
    if row["status"] == "wrong" and row["dtype"] == "float64" and (row["bound_reason"] or "").startswith(
            "float32 inside"):
        return _float64_throughout(model_type, class_name, row)
    return row


def _float64_throughout(model_type: str, class_name: str | None, row: dict) -> dict:
    """A float64 model over the float32 bound that computes in float32 inside (a cancelling gradient whose
    float32 rounding the rewrite reassociates) is run again with those casts kept in float64
    (tests/helpers.py's KeepFloat64, eager and compiled alike) and held to the float64 bound; the row keeps
    what the model as written measured."""
    from tests.helpers import KeepFloat64

    with KeepFloat64():
        again = _run_arch(model_type, class_name, ("float64",), float64_throughout=True)
    again["as_written"] = {k: row[k] for k in ("status", "bound", "loss_err", "grad_err", "worst_grad")}
    again["bound_reason"] = (f"float64 throughout (its float32 casts kept in float64); as written, with float32 "
                             f"inside: {row['worst_grad']} rel err {row['grad_err']:.3g} > {row['bound']:g}")
    return again


def _run_arch(model_type: str, class_name: str | None, dtypes: tuple, float64_throughout: bool = False) -> dict:
    import torch

    import brcompile
    from brcompile.testing import rel_err

    if class_name is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    row = dict(arch=model_type, model_class=class_name, status=None, impl=None, dtype=None, bound=None,
               bound_reason=None, loss_err=None, grad_err=None, worst_grad=None, replayed_calls=0,
               fallback_calls=0, logical_tokens=0, executed_tokens=0, fallback_reasons={}, graphs=[], error=None)
    t0 = time.time()
    try:
        model, impl, cfg = build_model(model_type, class_name)
    except Exception as e:  # noqa: BLE001
        row.update(status="not instantiable", error="build: " + _line(e))
        return row
    row["impl"] = impl
    vocab = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", VOCAB)
    batch = grpo_batch(min(VOCAB, int(vocab)) if vocab else VOCAB)
    ids, am, cm = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]

    # eager reference: float64 where the model runs in it, else float32; use_cache=False where accepted
    ref = None
    dtype_note = None
    for dtype in [getattr(torch, d) for d in dtypes]:
        try:
            model = model.to(dtype)
            model.train()
            for use_cache in (True, False):
                try:
                    fn = functools.partial(next_token_loss, model, use_cache=use_cache)
                    torch.manual_seed(0)
                    loss = fn(ids, am, cm)
                    break
                except TypeError as e:
                    if use_cache and "use_cache" in str(e):
                        continue
                    raise
            if not torch.isfinite(loss):
                raise FloatingPointError(f"eager loss is {loss.item()}")
            ref = (loss.detach(), _grads(model, loss), fn, dtype)
            break
        except Exception as e:  # noqa: BLE001
            dtype_note = _line(e, 160)
            if dtype is getattr(torch, dtypes[-1]):
                row.update(status="not instantiable", error="eager run: " + _line(e))
                return row
    loss_ref, grads_ref, fn, dtype = ref
    row["dtype"] = str(dtype).replace("torch.", "")
    if dtype is torch.float32:
        row.update(bound=TOL["float32"], bound_reason=f"model runs in float32 (float64 failed: {dtype_note})"
                   if dtype_note else "model runs in float32")
    else:
        inside = [] if float64_throughout else float32_inside(model)
        if inside:
            row.update(bound=TOL["float32"], bound_reason="float32 inside the model: " + ", ".join(inside))
        else:
            row.update(bound=TOL["float64"], bound_reason="float64")

    # compiled
    torch._dynamo.reset()
    brcompile.reset_stats()
    backend = brcompile.backend(compiler="eager", strict=False, level=LEVEL, mode=MODE, chunk_tokens=CHUNK_TOKENS)
    compiled = torch.compile(fn, backend=backend)
    try:
        torch.manual_seed(0)
        loss = compiled(ids, am, cm)
        grads = _grads(model, loss)
    except Exception as e:  # noqa: BLE001
        row.update(status="raised", error=_line(e, 600), traceback=traceback.format_exc()[-3000:])
        _add_stats(row, brcompile.stats(), backend)
        return row
    s = brcompile.stats()
    _add_stats(row, s, backend)

    row["loss_err"] = rel_err(loss, loss_ref)
    # A gradient that is zero up to rounding in the eager run (a key projection's bias: softmax does not see a
    # shift shared by all keys, so its exact gradient is 0) has no scale of its own: rel_err against its
    # ~1e-21 entries is noise / noise. Such a gradient is measured against the largest gradient of the model; so is
    # one that cancels to below the model's rounding (Qwen3-Next's dt_bias with float32 inside: 5e-10 of the largest).
    gmax = max((float(g.abs().max()) for g in grads_ref.values() if g is not None and g.numel()), default=0.0)
    # the precision the model computes in: float32 inside a float64 model rounds the cancelling terms to float32
    precision = torch.float32 if row["bound"] == TOL["float32"] else dtype
    tiny = 1e3 * torch.finfo(precision).eps * gmax
    worst, worst_name, zero = 0.0, None, []
    for name, gref in grads_ref.items():
        g = grads.get(name)
        if gref is None and g is None:
            continue
        if gref is None or g is None:
            other = g if gref is None else gref
            err = float(other.abs().max()) if other.numel() else 0.0
            err = err if err == 0.0 else float("inf")
        elif gref.numel() and 0 < float(gref.abs().max()) <= tiny:
            zero.append(name)
            err = float((g - gref).abs().max()) / gmax
        else:
            err = rel_err(g, gref)
        if err > worst or worst_name is None:
            worst, worst_name = err, name
    row.update(grad_err=worst, worst_grad=worst_name, zero_grads=zero)
    within = row["loss_err"] <= row["bound"] and worst <= row["bound"]

    if s.replayed_calls == 0:
        row["status"] = "fell back" if within else "wrong"
    elif not within:
        row["status"] = "wrong"
    elif s.fallback_calls == 0 and s.executed_tokens < s.logical_tokens:
        row["status"] = "replayed"
    else:
        row["status"] = "partly"
    if not within:
        row["error"] = (f"loss rel err {row['loss_err']:.3g}, worst grad {worst_name} rel err {worst:.3g} "
                        f"> bound {row['bound']:g}")
    row["seconds"] = round(time.time() - t0, 1)
    return row


def _add_stats(row: dict, s, backend) -> None:
    row.update(replayed_calls=s.replayed_calls, fallback_calls=s.fallback_calls, logical_tokens=s.logical_tokens,
               executed_tokens=s.executed_tokens, fallback_reasons=dict(s.fallback_reasons),
               unshared_calls=s.unshared_calls, unshared_reasons=dict(s.unshared_reasons))
    row["graphs"] = [dict(id=r.graph_id, rewritten=r.rewritten, reason=r.reason, node=r.failed_node, level=r.level,
                          unshared=r.unshared, code=None if r.code is None else r.code.value)
                     for r in backend.records]
    row["level"] = LEVEL
    row["aten_graphs"] = sum(r.level == "aten" for r in backend.records)
    row["mode"] = MODE
    row["streamed_calls"] = s.streamed_calls
    # why a rewritten graph runs packed instead of streamed (mode="replay": the streaming split's refusal)
    row["replay_reasons"] = sorted({r.replay_reason for r in backend.records if r.rewritten and r.replay_reason})


# --------------------------------------------------------------------------------------------------
# reasons -> classes


def reason_class(reason: str) -> str:
    """A fallback reason with node names, shapes and numbers normalised away (one class per kind)."""
    r = reason.split("\n")[0]
    # an FX node printed in backticks: keep only what it calls (`%x : ... call_method[target=copy_](...)` -> `copy_`)
    r = re.sub(r"`%[^`]*?target=([^\]]+)\][^`]*`", lambda m: "`" + m.group(1).replace("torch.ops.", "") + "`", r)
    r = re.sub(r"\btoken\([^()]*(\([^()]*\)[^()]*)*\)", "token(…)", r)
    r = re.sub(r"torch\.Size\(\[[^\]]*\]\)", "[shape]", r)
    r = re.sub(r"\[[\d, s\-+*/()]*\]", "[shape]", r)
    r = re.sub(r"\(\d+(, *\d+)*,?\)", "(shape)", r)
    r = re.sub(r"'[^']*'", "'…'", r)
    r = re.sub(r"`[^`]{60,}`", "`…`", r)
    r = re.sub(r"\b[A-Za-z_][A-Za-z0-9_]*_\d+\b", "<node>", r)
    r = re.sub(r"\bl_[A-Za-z0-9_]+", "<input>", r)
    r = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "N", r)
    r = re.sub(r"\s+", " ", r).strip()
    return r[:160]


def row_reasons(row: dict) -> list[str]:
    """The distinct fallback reasons of a row: run-time counters and compile-time graph records (not those of
    graphs with nothing to share: they are no fallback)."""
    out = list(row.get("fallback_reasons") or {})
    for g in row.get("graphs") or []:
        if g.get("reason") and not g.get("unshared") and g["reason"] not in out:
            out.append(g["reason"])
    return out


def summarize(rows: list[dict]) -> dict:
    counts = collections.Counter(r["status"] for r in rows)
    runnable = sum(counts[c] for c in ("replayed", "partly", "fell back", "wrong", "raised"))
    classes = collections.Counter()
    examples = {}
    for r in rows:
        if r["status"] not in ("fell back", "partly"):
            continue
        for c in {reason_class(x) for x in row_reasons(r)}:
            classes[c] += 1
            examples.setdefault(c, []).append(r["arch"])
    not_inst = collections.Counter(re.sub(r"\d+", "N", (r["error"] or "").split(" {")[0])[:120] for r in rows
                                   if r["status"] == "not instantiable")
    streaming = collections.Counter()
    for r in rows:
        if r.get("mode") == "replay" and r["status"] in ("replayed", "partly"):
            for c in {reason_class(x) for x in r.get("replay_reasons") or ()}:
                streaming[c] += 1
    return dict(counts={c: counts.get(c, 0) for c in CLASSES}, total=len(rows), runnable=runnable,
                streamed=sum(1 for r in rows if r.get("streamed_calls")),
                streamed_exact=sum(1 for r in rows if r.get("streamed_calls") and r["status"] == "replayed"),
                streaming_refusals=streaming.most_common(),
                replay_pct=(100.0 * (counts["replayed"]) / runnable) if runnable else 0.0,
                any_replay_pct=(100.0 * (counts["replayed"] + counts["partly"]) / runnable) if runnable else 0.0,
                reason_classes=[(c, n, examples[c]) for c, n in classes.most_common()],
                not_instantiable_classes=not_inst.most_common())


def _bound_note(row: dict) -> str:
    """The bound column's note: float32 inside a float64 model, or its float32 casts kept in float64."""
    why = row.get("bound_reason") or ""
    return " (f32 inside)" if why.startswith("float32 inside") else \
        " (f64 throughout)" if why.startswith("float64 throughout") else ""


def markdown(result: dict) -> str:
    rows, summ = result["rows"], result["summary"]
    c = summ["counts"]
    out = [f"transformers {result.get('transformers')}, torch {result.get('torch')}, {result.get('date')}, "
           f"commit {result.get('commit', 'unknown')}; "
           f"{summ['total']} architectures", ""]
    out.append("| " + " | ".join(LABELS[k] for k in CLASSES) + " |")
    out.append("|" + "---|" * len(CLASSES))
    out.append("| " + " | ".join(str(c[k]) for k in CLASSES) + " |")
    out.append("")
    out.append(f"Runnable (built and ran eagerly): {summ['runnable']}; replayed exactly: "
               f"{summ['replay_pct']:.0f}%, replayed at least partly: {summ['any_replay_pct']:.0f}%.")
    out.append("")
    if any(r.get("mode") == "replay" for r in rows):
        out.append(f"Streaming replay (mode=\"replay\", chunks of {CHUNK_TOKENS} tail tokens): "
                   f"{summ['streamed']} architectures streamed at least one call, {summ['streamed_exact']} of them "
                   f"replayed exactly. Why a rewritten graph ran packed instead (architectures per reason):")
        out.append("")
        out.append("| archs | streaming refused |")
        out.append("|---|---|")
        for cls, n in summ["streaming_refusals"]:
            out.append(f"| {n} | {cls.replace('|', '/')} |")
        out.append("")
    out.append("Fallback reason classes (architectures per class; node names, shapes, numbers normalised):")
    out.append("")
    out.append("| archs | reason class | e.g. |")
    out.append("|---|---|---|")
    for cls, n, ex in summ["reason_classes"]:
        out.append(f"| {n} | {cls.replace('|', '/')} | {', '.join(ex[:4])} |")
    out.append("")
    out.append("Not instantiable, by error:")
    out.append("")
    out.append("| archs | error |")
    out.append("|---|---|")
    for cls, n in summ["not_instantiable_classes"]:
        out.append(f"| {n} | {cls.replace('|', '/')} |")
    out.append("")
    out.append("| arch | class | result | attn | dtype | bound | loss err | worst grad err | tokens exec/logical | why |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["arch"]):
        why = r.get("error") or ""
        if r["status"] in ("fell back", "partly"):
            why = "; ".join(sorted({reason_class(x) for x in row_reasons(r)})) or why
        bound = "" if r.get("bound") is None else f"{r['bound']:g}" + _bound_note(r)
        fmt = (lambda v: "" if v is None else f"{v:.1e}")
        tok = f"{r['executed_tokens']}/{r['logical_tokens']}" if r.get("logical_tokens") else ""
        out.append(f"| {r['arch']} | {r['model_class']} | {LABELS[r['status']]} | {r.get('impl') or ''} | "
                   f"{r.get('dtype') or ''} | {bound} | {fmt(r.get('loss_err'))} | {fmt(r.get('grad_err'))} | "
                   f"{tok} | {why.replace('|', '/')[:200]} |")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------
# the driver


def _worker(arch: str, path: str) -> None:
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    row = run_arch(arch)
    with open(path, "w") as f:
        json.dump(row, f, default=str)


def _run_forked(arch: str, class_name: str, timeout: float) -> dict:
    """``run_arch`` in a forked child (torch, transformers and brcompile imported once, in the parent), killed
    after ``timeout`` seconds: a hang or a crash costs one row."""
    import multiprocessing

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        p = multiprocessing.get_context("fork").Process(target=_worker, args=(arch, path), daemon=True)
        p.start()
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
            return dict(arch=arch, model_class=class_name, status="timeout", error=f"no result within {timeout:g} s")
        try:
            with open(path) as fh:
                return json.load(fh)
        except (OSError, json.JSONDecodeError):
            return dict(arch=arch, model_class=class_name, status="timeout",
                        error=f"worker exited {p.exitcode} without a result (crash)")
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def _short(row: dict) -> str:
    st = row["status"]
    if st in ("fell back", "partly"):
        rs = sorted({reason_class(x) for x in row_reasons(row)})
        return f"{LABELS[st]} ({'; '.join(rs)[:150]})"
    if st == "replayed":
        return f"{LABELS[st]} ({row['executed_tokens']}/{row['logical_tokens']} tokens, grad err {row['grad_err']:.1e})"
    return f"{LABELS[st]} ({(row.get('error') or '')[:150]})"


def _git_state() -> str:
    """The checkout's commit, '+dirty' when brcompile/, passes/ or backends/ have uncommitted changes."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "brcompile", "passes", "backends"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


#: Options.level of the backend under test (``--level``; set before the workers fork)
LEVEL = "auto"
#: the backend's mode (``--mode``): "replay" streams each rewritten graph (prefix once, tails in chunks of
#: CHUNK_TOKENS tokens) where the streaming split accepts it
MODE = "packed"
CHUNK_TOKENS = 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "hf_sweep.json"))
    ap.add_argument("--markdown", action="store_true", help="print the markdown summary and table")
    ap.add_argument("--first", help="comma-separated model types to run before the others (a useful partial sweep)")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --out, run the rest")
    ap.add_argument("--redo", default="", help="with --resume: statuses to run again (e.g. wrong,timeout)")
    ap.add_argument("--from-json", help="no run: summarise an earlier --out file")
    ap.add_argument("--level", default="auto", choices=("auto", "dynamo", "aten"),
                    help="the backend's level option: which form of each graph is analysed")
    ap.add_argument("--mode", default="packed", choices=("packed", "replay"),
                    help="the backend's mode option: replay streams every graph the streaming split accepts "
                         "(chunks of 4 tail tokens)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global LEVEL, MODE
    LEVEL, MODE = args.level, args.mode

    if args.worker:  # one architecture in this process (debugging: a traceback is not swallowed)
        row = run_arch(args.worker)
        if args.result_file:
            Path(args.result_file).write_text(json.dumps(row, default=str))
        else:
            print(json.dumps(row, indent=1, default=str))
        return 0

    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
    else:
        os.environ["BRCOMPILE_STRICT"] = "0"  # before brcompile is imported: internal errors fall back, recorded
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as MAPPING

        import brcompile  # noqa: F401  (imported once, before the children fork)
        import brcompile.backends.attention.op  # noqa: F401
        import brcompile.testing  # noqa: F401
        import examples.grpo  # noqa: F401

        archs = list(MAPPING)
        if args.only:
            wanted = [a.strip() for a in args.only.split(",") if a.strip()]
            unknown = [a for a in wanted if a not in MAPPING]
            if unknown:
                ap.error(f"not causal-LM model types: {unknown}")
            archs = wanted
        if args.first:
            first = [a.strip() for a in args.first.split(",") if a.strip() in archs]
            archs = first + [a for a in archs if a not in first]
        rows = []
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if args.resume and out.exists():
            redo = {x.strip() for x in args.redo.split(",") if x.strip()}
            rows = [r for r in json.loads(out.read_text())["rows"] if r["arch"] in archs and r["status"] not in redo]
            done = {r["arch"] for r in rows}
            archs = [a for a in archs if a not in done]
        result = dict(date=datetime.date.today().isoformat(), transformers=transformers.__version__,
                      torch=torch.__version__, commit=_git_state(), rows=rows)
        n0 = len(rows)
        for i, arch in enumerate(archs, len(rows) + 1):
            t0 = time.time()
            row = _run_forked(arch, MAPPING[arch], args.timeout)
            row.setdefault("seconds", round(time.time() - t0, 1))
            rows.append(row)
            print(f"[{i}/{len(archs) + n0}] {arch}: {_short(row)} [{time.time() - t0:.0f}s]", file=sys.stderr, flush=True)
            result["summary"] = summarize(rows)
            out.write_text(json.dumps(result, indent=1, default=str))
    result["summary"] = summarize(result["rows"])
    c = result["summary"]["counts"]
    print("totals: " + ", ".join(f"{LABELS[k]} {c[k]}" for k in CLASSES), file=sys.stderr)
    for cls, n, ex in result["summary"]["reason_classes"]:
        print(f"  {n:3d}  {cls}   ({', '.join(ex[:5])})", file=sys.stderr)
    if args.markdown:
        print(markdown(result))
    bad = [r["arch"] for r in result["rows"] if r["status"] in ("wrong", "raised")]
    if bad:
        print(f"BUGS (wrong/raised): {', '.join(bad)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
