"""Variants of a test over several axes, split between ``make test`` and ``make test-deep``.

``covering(axes)`` gives every combination of the axes' values as ``pytest.param``s. Those of a
covering set run in ``make test``: with ``strength=2`` every pair of values of any two axes
shows up in at least one of them (a pairwise covering array), with ``strength=1`` every value of
every axis. The other combinations are marked ``deep``: ``make test`` deselects them
(``-m "not deep"``) and ``make test-deep`` runs them. The covering set is picked greedily in the
axes' order, so it is the same on every run and the first combination is always in it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest


def covering(*axes: Sequence[Any], strength: int = 2) -> list[Any]:
    """Every combination of ``axes``' values, as ``pytest.param``s (a tuple of values each, or
    the value itself for one axis), those outside a covering set of ``strength`` marked
    ``pytest.mark.deep``."""
    combos = list(itertools.product(*(range(len(axis)) for axis in axes)))
    chosen = set(_cover(combos, len(axes), strength))
    params = []
    for i, combo in enumerate(combos):
        values = [axis[j] for axis, j in zip(axes, combo)]
        marks = () if i in chosen else (pytest.mark.deep,)
        params.append(pytest.param(*values, marks=marks))
    return params


def _cover(combos: list[tuple], n_axes: int, strength: int) -> list[int]:
    """Indices of ``combos`` (tuples of value indices) that together hold every
    ``strength``-tuple of values (at their axes) that some combo holds: at each turn the combo
    holding the most not yet held."""
    strength = min(strength, n_axes)
    groups = list(itertools.combinations(range(n_axes), strength))

    def tuples(combo: tuple) -> set:
        return {(g, tuple(combo[a] for a in g)) for g in groups}

    held = [tuples(c) for c in combos]
    missing = set().union(*held) if held else set()
    chosen: list[int] = []
    while missing:
        best = max(range(len(combos)), key=lambda i: (len(held[i] & missing), -i))
        chosen.append(best)
        missing -= held[best]
    return chosen


def rotating(cases: Sequence[Any], settings: Sequence[Any]) -> list[Any]:
    """Every case under every setting, as ``pytest.param(case, setting)``s: in ``make test``
    each case once, the settings taking turns case by case (so each setting runs on a share of
    the cases); the other pairs marked ``pytest.mark.deep``."""
    return [
        pytest.param(case, setting, marks=() if j == i % len(settings) else (pytest.mark.deep,))
        for i, case in enumerate(cases)
        for j, setting in enumerate(settings)
    ]
