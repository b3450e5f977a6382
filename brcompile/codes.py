"""Refusal codes: the rules a graph (at compile time) or a call (at run time) can break, read by both sides.

Every refusal names one :class:`Code`, the rule it breaks, plus free text (``detail``) saying how this graph
or call breaks it. Codes are grouped by the construct they are about (:attr:`Code.construct`); each has a
one-line description (:meth:`Code.describe`). Their string values are stable: reports, stats and tests key on
them, so a value is never renamed, only added.

The passes raise them in ``CannotReplay`` (passes/refusals.py); the runtime returns a :class:`Refusal` for a call
that runs the original graph (a failed guard, a batch that shares too little) and counts it
(``brcompile.stats().fallback_codes``). This module sits below both, so the runtime imports nothing from the passes.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["CONSTRUCTS", "Code", "Refusal", "check_code", "refusal"]


class Code(str, enum.Enum):
    """One rule a graph or a call can break. ``Code(value)`` looks a member up by its stable string value."""

    def __new__(cls, value: str, construct: str, description: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.construct = construct
        member.description = description
        return member

    def describe(self) -> str:
        """The one-line, user-facing description of the rule."""
        return self.description

    def __str__(self) -> str:
        return self.value

    # -- the captured graph as a whole ------------------------------------------------------------------
    GRAPH_INPUTS = ("graph_inputs", "graph", "the example inputs do not match the graph's placeholders")
    ATEN_LOWERING = ("aten_lowering", "graph", "the graph could not be lowered to its functional ATen graph")
    CUSTOM_AUTOGRAD_FUNCTION = ("custom_autograd_function", "graph",
                                "a custom torch.autograd.Function is in the graph (its backward is opaque)")
    SIDE_EFFECTS = ("side_effects", "graph", "the graph has ops with side effects")
    INPUT_WRITE = ("input_write", "graph", "the graph writes into one of its inputs in a way the rewrite cannot keep")
    RANDOM_DRAW = ("random_draw", "graph",
                   "a random draw over token values (copies of a shared token would draw alike)")
    INPLACE_TOKEN_VALUE = ("inplace_token_value", "graph", "an in-place op on a value derived from the tokens")
    # -- the token input and the rows ---------------------------------------------------------------------
    NO_TOKEN_INPUT = ("no_token_input", "token input",
                      "no [B, L] integer token input that the graph's per-token work depends on")
    JOINED_TOKEN_IDS = ("joined_token_ids", "token input",
                        "the embedded token ids are built in the graph along an axis no input has, but not from "
                        "its inputs alone")
    KEY_PADDING_INPUTS = ("key_padding_inputs", "token input", "the attentions use different key-padding inputs")
    NOTHING_PACKED = ("nothing_packed", "token input",
                      "no op computes on packed per-token values: every one went dense, nothing is shared")
    # -- nothing to share (NothingToShare: run as it is, no fallback) --------------------------------------
    NO_PER_TOKEN_WORK = ("no_per_token_work", "nothing to share",
                         "the graph has no per-token work: it only moves, casts or indexes, or reads no per-token "
                         "value")
    ONE_ROW_BATCH = ("one_row_batch", "nothing to share", "the batch is one row at every call")
    DECODE_STEP = ("decode_step", "nothing to share",
                   "a decode step against a KV cache: each row's prefix is its cache, not the batch")
    # -- attention ----------------------------------------------------------------------------------------
    UNRECOGNISED_ATTENTION = ("unrecognised_attention", "attention",
                              "the tokens are mixed by an attention that is not recognised as one")
    EAGER_ATTENTION = ("eager_attention", "attention",
                       "an eager softmax attention whose math is not exactly scaled dot-product attention")
    ATTENTION_IN_BODY = ("attention_in_body", "attention",
                         "an attention inside a higher-order op's body (only checkpoints are inlined)")
    ATTENTION_UNPACKED = ("attention_unpacked", "attention",
                          "an attention whose inputs went dense (an op before it mixes rows or has no token rule)")
    ATTENTION_LAYOUT = ("attention_layout", "attention",
                        "an attention whose query, keys or values are not packed [B, H, L, D] token values")
    ATTENTION_DTYPE = ("attention_dtype", "attention",
                       "an attention whose q/k/v and output dtypes are neither one dtype nor autocast's casts")
    ATTENTION_DROPOUT = ("attention_dropout", "attention", "an attention with dropout")
    ATTENTION_SCALAR = ("attention_scalar", "attention",
                        "an attention scalar (scale, soft-cap) computed in the graph, not read from an input")
    ATTENTION_SINKS = ("attention_sinks", "attention", "attention sink logits that are not a value of the query token")
    RELATIVE_BIAS = ("relative_bias", "attention",
                     "a relative-position bias table that is not a per-query [B, H, L, E] token value")
    ATTENTION_BIAS = ("attention_bias", "attention",
                      "an additive attention bias that is not ALiBi in a form the tree can compute")
    ATTENTION_IMPL = ("attention_impl", "attention",
                      "the attention implementation on this device lacks a feature the packed attention needs")
    # -- masks --------------------------------------------------------------------------------------------
    MASK_NOT_CAUSAL = ("mask_not_causal", "mask",
                       "the attention mask is not causal (a query sees keys after it)")
    MASK_UNPROVEN = ("mask_unproven", "mask",
                     "the attention mask's meaning could not be proven (causal, key padding, window) on probes")
    MASK_FROM_VALUES = ("mask_from_values", "mask",
                        "the attention mask is computed from the values of an input, not from token positions")
    MASK_FLOAT_BIAS = ("mask_float_bias", "mask",
                       "a float attention mask that is not 0 / blocking (a bias, NaN or +inf)")
    MASK_USE = ("mask_use", "mask",
                "the attention mask is used in a way tree attention does not replace (with is_causal, elsewhere)")
    MASK_SOURCE = ("mask_source", "mask", "the attention mask is built without any [B, L] input")
    INPUT_MASK = ("input_mask", "mask",
                  "a mask built outside the compiled graph that tree attention cannot compute from the tensor")
    PACKED_SEQUENCES = ("packed_sequences", "mask",
                        "packed sequences that the attentions do not all read the same way")
    # -- scans --------------------------------------------------------------------------------------------
    SCAN_PADDING = ("scan_padding", "scan",
                    "a scan along the tokens that reads key-padded positions left out of the tree")
    SCAN_SHAPE = ("scan_shape", "scan", "a scan or causal conv read in a shape the tree scan does not cover")
    SCAN_IMPL = ("scan_impl", "scan", "the scan implementation does not run on this device")
    # -- shapes and token axes ----------------------------------------------------------------------------
    SYMBOLIC_SIZE = ("symbolic_size", "shape", "a non-token dim of a packed value has a symbolic size")
    PACKED_COUNT = ("packed_count", "shape",
                    "the packed graph does not hold for every packed token count N")
    TOKEN_LOCAL_REGION = ("token_local_region", "shape",
                          "a value of a token-local region (a sort order, an index, group offsets) read densely "
                          "or mixed across layouts")
    REPACK_PADDING = ("repack_padding", "shape",
                      "a dense region packed again needs padded positions that are left out of the tree")
    # -- mixture of experts -------------------------------------------------------------------------------
    MOE_GROUPS = ("moe_groups", "moe", "group counts of routing keys that are not proved integers in range")
    GROUPED_MM = ("grouped_mm", "moe", "a grouped matmul not over constant per-group weights and the group offsets")
    # -- activation checkpoints ---------------------------------------------------------------------------
    CHECKPOINT_FORM = ("checkpoint_form", "checkpoint", "an activation checkpoint in a form that cannot be inlined")
    CHECKPOINT_INTERLEAVED = ("checkpoint_interleaved", "checkpoint",
                              "an activation checkpoint's nodes are interleaved with others after the rewrite")
    # -- streaming replay (packed mode still runs) --------------------------------------------------------
    STREAMING_CONSTRUCT = ("streaming_construct", "streaming",
                           "the packed graph holds a construct the streaming split does not cover")
    STREAMING_FRONTIER = ("streaming_frontier", "streaming",
                          "the outer graph reads a trunk value that cannot cross the streaming frontier")
    STREAMING_ATTENTION = ("streaming_attention", "streaming",
                           "an attention whose key validity or positions are not per-token tree arrays")
    STREAMING_AUTOCAST = ("streaming_autocast", "streaming",
                          "an autocast region's boundary falls inside the token-local trunk")
    # -- context parallelism (the graph runs whole on every rank, its gradient counted once) ---------------
    CP_SPLIT = ("cp_split", "context parallel", "the graph has no token-local trunk to split over the ranks")
    CP_SCAN = ("cp_scan", "context parallel", "a scan along the tree paths would carry its state across the ranks")
    CP_CALL = ("cp_call", "context parallel",
               "this call's tokens are not split over the ranks (too few tokens, or an input activation that needs "
               "a gradient) (run time)")
    # -- routed pairs (experts after a routing graph break) -----------------------------------------------
    ROUTED_SHAPE = ("routed_shape", "routed pairs",
                    "no gather of tokens by a routing index split into groups and scattered back")
    ROUTED_NOT_PAIR_LOCAL = ("routed_not_pair_local", "routed pairs", "an op on the pairs is not pair-local")
    ROUTED_COUNTS = ("routed_counts", "routed pairs", "the graph does not hold for other per-expert counts")
    ROUTED_CALL = ("routed_call", "routed pairs",
                   "this call's pairs are not routed alike for copies of a shared token (run time)")
    # -- per-call guards and the batch (run time) ---------------------------------------------------------
    GUARD_SCALAR = ("guard_scalar", "guard", "a scalar input differs from the value the packed graph was "
                                             "specialised to")
    GUARD_QUERY_WITHOUT_KEYS = ("guard_query_without_keys", "guard",
                                "a query sees no key (left padding, an empty window) under an additive mask")
    GUARD_TABLE_RANGE = ("guard_table_range", "guard", "an integer table the graph indexes holds values out of range")
    GUARD_SEQUENCES = ("guard_sequences", "guard", "the position ids do not split the rows into packed sequences")
    GUARD_MASK_LENGTH = ("guard_mask_length", "guard",
                         "the batch is longer than the lengths the mask's meaning was proven for")
    GUARD_INPUT_MASK = ("guard_input_mask", "guard",
                        "a mask from outside the graph is not what tree attention computes for this call")
    SHARES_TOO_LITTLE = ("shares_too_little", "batch", "the batch shares too little (dedup below min_dedup)")
    NOTHING_NEEDED = ("nothing_needed", "batch",
                      "no position of the batch is needed (all padding, or loss weight 0 everywhere)")
    VERIFY_FAILED = ("verify_failed", "batch",
                     "verify=True: the packed graph's outputs differ from the original graph's")
    # -- bugs ---------------------------------------------------------------------------------------------
    INTERNAL_ERROR = ("internal_error", "internal", "an unexpected exception in a pass or a packed run (a bug)")


#: the constructs, in the order reports list them
CONSTRUCTS: tuple[str, ...] = tuple(dict.fromkeys(c.construct for c in Code))


def check_code(code: object) -> Code:
    """``code`` itself when it is a :class:`Code`, else TypeError: every refusal names its rule."""
    if not isinstance(code, Code):
        raise TypeError(f"a refusal needs a refusals.Code, got {code!r}")
    return code


class Refusal(NamedTuple):
    """A per-call fallback at run time: the rule broken and how (the call runs the original graph)."""

    code: Code
    detail: str

    def __str__(self) -> str:
        return self.detail


def refusal(code: Code, detail: str) -> Refusal:
    """A checked :class:`Refusal` (TypeError when ``code`` is not a :class:`Code`)."""
    return Refusal(check_code(code), detail)
