"""jaxkv/_src/state/buckets.py: which bucket each key lies in, and which buckets are split."""

import numpy as np
import pytest

from jaxkv._src.state import buckets


def _layout(sizes, split_from, devices=4):
    keys = list(range(len(sizes)))
    return buckets.plan(
        keys,
        [(s,) for s in sizes],
        [np.float32] * len(sizes),
        split_from=split_from,
        devices=devices,
    )


@pytest.mark.parametrize(
    ("sizes", "split_from", "parts"),
    [
        ([3, 5], 8, 4),  # a bucket of exactly the bound is split
        ([3, 5], 9, 1),  # one element below it is not
        ([3, 5], 7, 4),
        ([8], 8, 4),
    ],
)
def test_a_bucket_of_at_least_the_bound_is_split(sizes, split_from, parts):
    flat = _layout(sizes, split_from)
    assert flat.parts_of(0) == parts
    assert flat.split == (parts > 1)


def test_no_bound_or_one_device_splits_nothing():
    assert _layout([3, 5], None).parts_of(0) == 1
    assert _layout([3, 5], 8, devices=1).parts_of(0) == 1


def test_keys_lie_in_key_order_one_bucket_per_dtype_and_group():
    flat = buckets.plan(
        [0, 1, 2, 3],
        [(2,), (3,), (4,), (5,)],
        [np.float32, np.float16, np.float32, np.float32],
        groups=[(3,)],
        bucketed=[True, True, True, False],
    )
    assert flat.buckets == (("float32", 6), ("float16", 3))
    assert flat.where == ((0, 0, 2), (1, 0, 3), (0, 2, 4), (-1, 0, 5))
    assert flat.leaves == 3 and flat.leaf(3) == 2
