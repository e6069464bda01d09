"""tests/_variants.py: the variants make test keeps cover what they claim, and the rest are
marked deep, so that make test-deep runs every combination."""

import itertools

import pytest
from _variants import covering, rotating


def _kept(params):
    return [p.values for p in params if not p.marks]


@pytest.mark.parametrize("axes", [([1, 2, 3, 4], "abc", "xyz"), ([1, 2], "ab"), ("abcd", [0, 1])])
def test_every_pair_of_values_is_kept_and_every_combination_listed(axes):
    params = covering(*axes)
    assert [p.values for p in params] == list(itertools.product(*axes))
    kept = _kept(params)
    for a, b in itertools.combinations(range(len(axes)), 2):
        want = set(itertools.product(axes[a], axes[b]))
        assert {(k[a], k[b]) for k in kept} == want, (a, b)
    for p in params:
        assert not p.marks or [m.name for m in p.marks] == ["deep"]
    if len(axes) == 3:  # 4 x 3 x 3: twelve runs hold every pair (the least there can be)
        assert len(kept) == 12


def test_strength_one_keeps_each_value_of_each_axis():
    axes = ("abc", [1, 2, 3], [True, False])
    kept = _kept(covering(*axes, strength=1))
    assert len(kept) == 3
    for i, axis in enumerate(axes):
        assert {k[i] for k in kept} == set(axis)


def test_rotating_keeps_each_case_once_with_the_settings_in_turn():
    params = rotating(["a", "b", "c", "d", "e"], [2, 8])
    assert [p.values for p in params] == list(itertools.product("abcde", [2, 8]))
    assert _kept(params) == [("a", 2), ("b", 8), ("c", 2), ("d", 8), ("e", 2)]
