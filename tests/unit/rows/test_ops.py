"""jaxkv/_src/rows/ops.py: how many slots a route is given."""

import numpy as np
import pytest

from jaxkv._src.rows import ops


@pytest.mark.parametrize(
    ("most", "c"), [(0, 8), (1, 8), (8, 8), (9, 16), (16, 16), (17, 24), (150, 160), (256, 256)]
)
def test_slots_hold_the_busiest_route(most, c):
    assert ops.slots(most) == c
    assert ops.slots(most) >= most


def test_busiest_counts_the_most_ids_one_device_sends_one_owner():
    ids = [np.array([0, 1, 2, 3, 4]), np.array([7, 7, 6]), np.array([], np.int64)]
    assert ops.busiest(ids, block=4, parts=2) == 4  # the first device's 4 ids for owner 0
    assert ops.busiest([np.array([3, 4])], block=4, parts=2) == 1
    assert ops.busiest([np.array([], np.int64)], block=4, parts=2) == 1
