"""jaxkv/_src/rows/sizes.py: row counts rounded to a few sizes, rows padded and cut without a
compile on CPU, and the slots of a route."""

import jax
import numpy as np
import pytest

from jaxkv._src.jax_internals import single_device_sharding
from jaxkv._src.rows import sizes


def test_counts_of_a_batch_meet_few_sizes():
    """1,200-1,300 distinct rows a step (an embedding batch) meet two sizes; any count is
    padded by at most 1/8 of it (or 7 rows)."""
    got = {sizes.padded(n) for n in range(1200, 1301)}
    assert got == {1280, 1408}
    for n in range(1, 5000):
        p = sizes.padded(n)
        assert n <= p <= n + max(7, n // 8)


def test_padded_ids_select_no_row_and_rows_are_zeros(devices):
    ids = sizes.pad_ids(np.array([3, 1], np.int32), 5)
    assert ids.tolist() == [3, 1, -1, -1, -1] and ids.dtype == np.int32
    rows = jax.device_put(np.ones((2, 3), np.float32), devices[0])
    padded = sizes.pad_rows(rows, 5)
    assert padded.shape == (5, 3) and padded.devices() == {devices[0]}
    np.testing.assert_array_equal(np.asarray(padded), np.r_[np.ones((2, 3)), np.zeros((3, 3))])
    np.testing.assert_array_equal(np.asarray(sizes.cut(padded, 2)), np.ones((2, 3)))
    assert sizes.cut(padded, 5) is padded


def test_new_counts_compile_nothing_on_cpu(devices, compiles):
    """Padding, cutting and joining rows of a count never seen goes through the host on CPU
    devices: no computation, so nothing to compile."""
    replicated = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(devices[:2]), ("d",)), jax.sharding.PartitionSpec()
    )
    with compiles() as c:
        for n in (17, 23, 29):
            rows = jax.device_put(np.full((n, 4), n, np.float32), devices[0])
            padded = sizes.pad_rows(rows, sizes.padded(n))
            back = sizes.cut(padded, n)
            both = sizes.concat_rows([rows, back], replicated, sizes.padded(2 * n))
            np.testing.assert_array_equal(np.asarray(both)[: 2 * n], np.full((2 * n, 4), n))
            np.testing.assert_array_equal(np.asarray(both)[2 * n :], 0)
    assert c.count == 0


@pytest.mark.parametrize(
    "most, n, parts, c",
    [
        (150, 1024, 8, 160),
        (600, 1280, 2, 704),
        (660, 1280, 2, 704),
        (1280, 1280, 2, 1280),
        (50, 144, 3, 72),  # 3 processes of 129-143 rows: the busiest route stays under 72
    ],
)
def test_a_route_follows_the_padded_count(most, n, parts, c):
    """A busiest route near its even share gets the share and 2.5 of its standard deviations
    (so it moves only with the padded count); a much busier one gets its own slots."""
    assert sizes.route(most, n, parts) == c
    assert sizes.route(most, n, parts) >= most


def test_a_site_pads_only_once_its_counts_vary():
    """A place of the code compiles for its first count as it is (a workload of one size pads
    and copies nothing), and pads any other to a few sizes."""
    other = ("another test", object())
    got = [sizes.fit(other, n) for n in (1000, 1250, 1300, 1000, 1201, 1290, 1000)]
    assert got == [1000, 1280, 1408, 1000, 1280, 1408, 1000]
    constant = ("a third test", object())
    assert [sizes.fit(constant, 1000) for _ in range(4)] == [1000] * 4


def test_joined_rows_take_the_dtype_asked_for_without_a_compile(devices, compiles):
    rows = [jax.device_put(np.ones((n, 2), np.float32), devices[0]) for n in (3, 5)]
    with compiles() as c:
        both = sizes.concat_rows(rows, single_device_sharding(devices[0]), 8, np.float16)
    assert c.count == 0
    assert both.dtype == np.float16 and both.shape == (8, 2)
    np.testing.assert_array_equal(np.asarray(both)[:8], np.ones((8, 2), np.float16))
