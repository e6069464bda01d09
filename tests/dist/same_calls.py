"""For the jobs that run one sequence of calls twice (a push kept between host agreements, and
agreed on the host each time): the two sequences' results compared."""

import numpy as np


def assert_same(first, second):
    """Every result of ``first`` equals ``second``'s to the bit (arrays: dtype and values),
    and every refusal's verdict (a bool: whether it said what was expected) is true in both."""
    assert len(first) == len(second), (len(first), len(second))
    for j, (a, b) in enumerate(zip(first, second)):
        if isinstance(a, bool):
            assert a and b, (j, a, b)
        else:
            assert a.dtype == b.dtype and np.array_equal(a, b), (j, a, b)
