"""tests/default_selectors.py lists every built-in selector, and each entry is a valid configuration
that lowers onto a layer."""
from __future__ import annotations

import pytest
from default_selectors import DEFAULT_SELECTORS

import kvsieve.selectors
from kvsieve import SparseAttentionConfig, lower_config
from kvsieve.sparse import SparseSelector, get_selector_class


def _built_ins() -> set[str]:
    return {cls.name for cls in vars(kvsieve.selectors).values()
            if isinstance(cls, type) and issubclass(cls, SparseSelector)}


def test_every_built_in_selector_has_a_default_configuration():
    assert _built_ins() == set(DEFAULT_SELECTORS)


@pytest.mark.parametrize("name", sorted(DEFAULT_SELECTORS))
def test_each_default_configuration_lowers(name):
    (plan,) = lower_config(SparseAttentionConfig(name, DEFAULT_SELECTORS[name]), num_layers=1)
    assert isinstance(plan.selector, get_selector_class(name))
