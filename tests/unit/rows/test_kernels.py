"""jaxkv/_src/rows/kernels.py: the all-to-all route of each id, edges included."""

import numpy as np
import pytest

from jaxkv._src.rows import kernels


def _plan(ids, block, parts, c):
    dest, local = kernels.plan(np.asarray(ids, np.int32), block, parts, c)
    return np.asarray(dest).tolist(), np.asarray(local).tolist()


def test_a_route_exactly_full_puts_every_id_in_its_own_slot():
    # 2 owners of 4 rows each, C = 3 slots per owner; this device asks owner 0 for exactly 3.
    dest, local = _plan([2, 0, 1], block=4, parts=2, c=3)
    assert dest == [0, 1, 2]
    assert local == [2, 0, 1, 4, 4, 4]  # owner 1's slots unused (4: the block, no row)


def test_full_routes_to_every_owner_and_padding():
    # Owner 1 gets rows 5, 7, 4 (as its rows 1, 3, 0); -1 and 8 lie outside the table.
    dest, local = _plan([5, 1, 7, -1, 0, 4, 8], block=4, parts=2, c=3)
    assert dest == [3, 0, 4, 6, 1, 5, 6]
    assert local == [1, 0, 4, 1, 3, 0]


@pytest.mark.parametrize("c", [3, 4])
def test_a_route_with_room_to_spare(c):
    dest, local = _plan([6, 6], block=4, parts=2, c=c)
    assert dest == [c, c + 1]
    assert local == [4] * c + [2, 2] + [4] * (c - 2)
