"""jaxkv/_src/rows/kernels.py: the all-to-all route of each id, edges included, and an
updater's own errors where the touched rows are updated."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
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


def test_duplicate_ids_are_summed_once_and_ids_outside_the_table_update_nothing():
    ids = np.array([3, 0, 3, 5, -1, 0, 3, 4], np.int32)  # 5 rows: 5 and -1 lie outside
    rows = np.arange(16, dtype=np.float32).reshape(8, 2)
    unique, summed = kernels.dedupe(ids, rows, 5)
    unique, summed = np.asarray(unique), np.asarray(summed)
    assert unique.tolist() == [0, 3, 4, 5, 5, 5, 5, 5]  # distinct ids, padded with 5
    np.testing.assert_array_equal(summed[0], rows[1] + rows[5])
    np.testing.assert_array_equal(summed[1], rows[0] + rows[2] + rows[6])
    np.testing.assert_array_equal(summed[2], rows[7])
    table = np.asarray(kernels.put(jnp.zeros((5, 2), jnp.float32), unique, summed))
    np.testing.assert_array_equal(table[[1, 2]], 0)  # nothing but ids 0, 3 and 4 changed


def test_rows_outside_a_block_read_as_zeros_and_writes_there_are_dropped():
    block = jnp.arange(6, dtype=jnp.float32).reshape(3, 2) + 1  # rows 4, 5, 6 of a table
    got = np.asarray(kernels.take(block, np.array([3, 4, 6, 7]), lo=4))
    np.testing.assert_array_equal(got, [[0, 0], [1, 2], [5, 6], [0, 0]])
    put = np.asarray(kernels.put(block, np.array([3, 6, 7]), np.full((3, 2), 9.0), lo=4))
    np.testing.assert_array_equal(put, [[1, 2], [3, 4], [9, 9]])


# -- an updater's own errors, where update_rows runs it -------------------------------------------
def _raising(key, pushed, stored):
    raise ValueError("this updater refuses")


def _returning_none(key, pushed, stored):
    return None


def _returning_a_row(key, pushed, stored):
    return stored[0]


def _update_raising(updates, state, params=None):
    raise ValueError("this optimizer refuses")


def _update_rows(updater, opt_state=None):
    table = jnp.arange(8, dtype=jnp.float32).reshape(4, 2)
    ids = jnp.array([1, 3, 1], jnp.int32)
    return kernels.update_rows(
        "e", kernels.Where(), table, opt_state, ids, jnp.ones((3, 2)), 4, updater
    )


def test_an_updater_that_raises_is_a_kvstore_error_naming_the_key_and_the_updater():
    with pytest.raises(jaxkv.KVStoreError, match=r"key 'e': the updater _raising raised Val") as e:
        _update_rows(_raising)
    assert isinstance(e.value.__cause__, ValueError)


def test_an_optax_update_that_raises_is_a_kvstore_error_naming_the_key_and_the_optimizer():
    tx = optax.GradientTransformation(optax.init_empty_state, _update_raising)
    with pytest.raises(jaxkv.KVStoreError, match=r"'e'.*the optimizer .*_update_raising") as e:
        _update_rows(tx, optax.EmptyState())
    assert isinstance(e.value.__cause__, ValueError)


def test_an_updater_that_returns_none_or_another_shape_is_named():
    with pytest.raises(jaxkv.KVStoreError, match=r"the updater _returning_none returned None"):
        _update_rows(_returning_none)
    with pytest.raises(jaxkv.ShapeError, match=r"\(the updater: _returning_a_row\)"):
        _update_rows(_returning_a_row)
