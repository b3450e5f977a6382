"""passes/analysis/input_masks.py: masks that are graph inputs, read off the tensor (compile time) and checked per call."""
import pytest
import torch
import torch.fx as fx

from brcompile.passes.analysis import input_masks
from brcompile.passes.refusals import CannotReplay, Code
from brcompile.passes.analysis.input_masks import check_mask, classify_input_mask, key_validity


def hf_mask(valid: torch.Tensor, window: int = 0, additive: bool = False, dtype=torch.float32) -> torch.Tensor:
    """What HF / the example GPT build: causal & key padding [& window], [B, 1, L, L]."""
    L = valid.shape[1]
    q = torch.arange(L)[:, None]
    k = torch.arange(L)[None]
    allowed = k <= q
    if window:
        allowed = allowed & (q - k < window)
    vis = allowed[None, None] & valid[:, None, None, :].bool()
    if not additive:
        return vis
    return torch.zeros(vis.shape, dtype=dtype).masked_fill(~vis, torch.finfo(dtype).min)


def graph_with_mask(example: torch.Tensor, invert: bool = False):
    """A graph ``sdpa(q, q, q, attn_mask=mask)`` (``invert``: ``attn_mask=~mask``, the input marks what is
    hidden); returns a classifier of its mask on an example mask."""
    g = fx.Graph()
    q = g.placeholder("q")
    m = g.placeholder("mask")
    m.meta["example_value"] = example
    arg = g.call_function(torch.bitwise_not, (m,)) if invert else m
    attn = g.call_function(torch.nn.functional.scaled_dot_product_attention, (q, q, q), {"attn_mask": arg})
    g.output(attn)
    return attn, arg, [q, m]


def classify(example: torch.Tensor, invert: bool = False):
    attn, arg, placeholders = graph_with_mask(example, invert)
    return classify_input_mask(attn, arg, placeholders, (None, example))


RIGHT_PADDED = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
LEFT_PADDED = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("window", [0, 3])
def test_causal_keypad_window_is_read_off_the_example(additive, window):
    # an additive mask needs a visible key in every query's window: one padded column at most
    valid = RIGHT_PADDED if not additive else torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    info = classify(hf_mask(valid, window, additive))
    assert info.window == window and info.source.name == "mask"
    assert torch.equal(key_validity(hf_mask(valid, window, additive)), valid.bool())


def test_broadcast_mask_without_padding():
    mask = hf_mask(torch.ones(1, 7, dtype=torch.long))
    assert classify(mask).window == 0
    assert key_validity(mask).shape == (1, 7)


@pytest.mark.parametrize("case", ["bidirectional", "prefix_lm", "bias", "left_padded_additive", "heads_differ"])
def test_masks_tree_attention_does_not_compute_are_refused(case):
    mask = hf_mask(RIGHT_PADDED)
    if case == "bidirectional":
        mask = RIGHT_PADDED.bool()[:, None, None, :].expand(-1, 1, 6, -1).clone()
        why = "not causal"
    elif case == "prefix_lm":
        mask = mask.clone()
        mask[:, :, :2, :2] = True  # the first two positions see each other
        why = "not causal"
    elif case == "bias":
        mask = hf_mask(RIGHT_PADDED, additive=True) + 0.5
        why = "additive bias"
    elif case == "left_padded_additive":
        mask = hf_mask(LEFT_PADDED, additive=True)
        why = "no visible key"
    else:
        mask = torch.cat([mask, mask.roll(1, dims=0)], dim=1)
        why = "not causal"
    with pytest.raises(CannotReplay, match=why) as e:
        classify(mask)
    assert e.value.code is Code.INPUT_MASK


def test_check_reads_in_bounded_chunks(monkeypatch):
    monkeypatch.setattr(input_masks, "CHUNK_ELEMENTS", 3 * 6)  # one query row per chunk
    assert check_mask(hf_mask(RIGHT_PADDED, 2), 2) is None
    bad = hf_mask(RIGHT_PADDED, 2)
    bad[1, 0, 5, 0] = True
    assert "(1, 0, 5, 0)" in check_mask(bad, 2)


def test_guard_checks_each_mask_tensor_once(monkeypatch):
    calls = []
    real = input_masks.check_mask
    monkeypatch.setattr(input_masks, "check_mask", lambda m, w: calls.append(1) or real(m, w))
    info = classify(hf_mask(RIGHT_PADDED))
    guard = info.guard()
    calls.clear()
    mask = hf_mask(RIGHT_PADDED)
    for _ in range(4):  # the same mask handed to four blocks
        assert guard((None, mask)) is None
        assert torch.equal(info.key_padding((None, mask)), RIGHT_PADDED.bool())
    assert len(calls) == 1
    mask[0, 0, 0, 1] = True  # an in-place edit moves the version counter: checked again, and refused
    assert "not causal" in guard((None, mask))
    assert len(calls) == 2
    assert "not a tensor" in guard((None, None))


def test_mask_computed_from_the_input_is_evaluated():
    """attn_mask = ~hidden: the subgraph from the input is evaluated, at compile time and per call."""
    hidden = ~hf_mask(RIGHT_PADDED)
    info = classify(hidden, invert=True)
    assert info.guard()((None, hidden)) is None
    assert torch.equal(info.key_padding((None, hidden)), RIGHT_PADDED.bool())
    with pytest.raises(CannotReplay, match="not causal") as e:
        classify(hf_mask(RIGHT_PADDED), invert=True)
    assert e.value.code is Code.INPUT_MASK  # a mask of what is visible, inverted: anti-causal
