"""The impl registries (backends/common/registry.py): a name has one implementation; registering another under a taken
name raises the op's error unless ``override=True``."""
import dataclasses

import pytest
import torch

from brcompile.backends.attention.op import ATTENTION_IMPLS, AttentionImplError, get_attention_impl, register_attention_impl


@pytest.fixture
def reference():
    """The registered "reference" attention impl, registered again after the test."""
    real = get_attention_impl("reference", torch.device("cpu"))
    yield real
    register_attention_impl(real, override=True)


def test_a_second_impl_under_a_taken_name_raises(reference):
    other = dataclasses.replace(reference, supports_relbias=not reference.supports_relbias)
    with pytest.raises(AttentionImplError, match="'reference' is already registered"):
        register_attention_impl(other)
    assert get_attention_impl("reference", torch.device("cpu")) is reference


def test_override_replaces_it(reference):
    other = dataclasses.replace(reference, supports_relbias=not reference.supports_relbias)
    register_attention_impl(other, override=True)
    assert get_attention_impl("reference", torch.device("cpu")) is other


def test_registering_the_same_impl_again_is_a_no_op(reference):
    ATTENTION_IMPLS.register(reference)
    assert get_attention_impl("reference", torch.device("cpu")) is reference
