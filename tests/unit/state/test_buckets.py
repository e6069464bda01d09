"""jaxkv/_src/state/buckets.py: which bucket each key lies in, and which buckets are split."""

import math

import jax
import numpy as np
import pytest

from jaxkv._src.state import buckets
from jaxkv._src.state.policy import Placement


def _layout(sizes, split_from, devices=4):
    keys = list(range(len(sizes)))
    return buckets.plan(
        keys,
        [(s,) for s in sizes],
        [np.float32] * len(sizes),
        placement=Placement(devices, split_from),
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


@pytest.mark.parametrize(("size", "parts", "n"), [(8, 4, 2), (9, 4, 3), (7, 4, 2), (1, 4, 1)])
def test_a_block_is_the_value_padded_to_a_multiple_of_the_parts(size, parts, n):
    assert buckets.block((size,), parts) == n
    assert buckets.as_blocks(np.arange(size, dtype=np.float32), parts).shape == (parts, n)


@pytest.mark.parametrize(
    ("shape", "parts", "block"),
    [
        ((8, 3), 4, (2, 3)),
        ((6, 3), 4, (5,)),
        ((5,), 4, (2,)),
        ((2048, 4), 3, (683, 4)),  # one row of zeros: at most 1/16 of the rows, so rows
        ((17, 2), 4, (9,)),  # three rows of zeros would be 3/17: flattened instead
        ((32, 2), 3, (11, 2)),  # one row of zeros in 32
        ((16, 2), 3, (11,)),  # two in 16: flattened
    ],
)
def test_a_block_keeps_its_rows_where_they_divide_or_pad_by_little(shape, parts, block):
    assert buckets.block_shape(shape, parts) == block
    assert buckets.block(shape, parts) == math.prod(block)
    blocks = buckets.as_blocks(np.arange(math.prod(shape), dtype=np.float32).reshape(shape), parts)
    assert blocks.shape == (parts, math.prod(block))
    whole = buckets.from_blocks(blocks, math.prod(shape), shape)
    np.testing.assert_array_equal(whole, np.arange(math.prod(shape)).reshape(shape))
    if len(block) == len(shape):  # device d's block is rows [d*B, (d+1)*B), zeros past the end
        rows = np.concatenate(
            [np.asarray(whole), np.zeros((parts * block[0] - shape[0], *shape[1:]))]
        )
        for d in range(parts):
            np.testing.assert_array_equal(
                np.asarray(blocks[d]).reshape(block), rows[d * block[0] : (d + 1) * block[0]]
            )


@pytest.mark.parametrize("shapes", [[(5,), (8, 3), (3,)], [(4,), (4,)], [(7, 2), (1,)]])
def test_values_written_into_a_split_bucket_read_back_whole_and_per_device(shapes):
    """Every key written at its offset comes back as it was, from the whole bucket and from
    each device's chunk, whatever the padding: the off-by-ones of a split bucket."""
    parts = 4
    sizes = [int(np.prod(s)) for s in shapes]
    flat = buckets.plan(
        list(range(len(shapes))), shapes, [np.float32] * len(shapes), placement=Placement(parts, 1)
    )
    total = flat.buckets[0][1]
    assert flat.parts_of(0) == parts and total % parts == 0
    leaf = np.zeros(total, np.float32)
    values = [
        np.arange(1, n + 1, dtype=np.float32).reshape(s) * (k + 1)
        for k, (n, s) in enumerate(zip(sizes, shapes))
    ]
    for (_, offset, _), v in zip(flat.where, values):
        leaf = buckets.split_write(leaf, offset, v, parts, total)
    chunks = np.asarray(leaf).reshape(parts, -1)
    for (_, offset, size), v, s in zip(flat.where, values, shapes):
        np.testing.assert_array_equal(buckets.split_view(leaf, offset, size, s, parts, total), v)
        whole = np.concatenate(
            [
                np.asarray(buckets.split_view(c, offset, size, s, parts, total)).ravel()
                for c in chunks
            ]
        )
        np.testing.assert_array_equal(whole[:size], v.ravel())
        assert not whole[size:].any()  # the padding holds zeros


def test_a_state_kept_per_key_packs_each_place_of_a_keys_state_into_one_leaf():
    """MXNet's per-key state (each key its own step count and moments, key after key): each
    key's moment at one place of its state is one bucket, the step counts one array of a count
    per key; a leaf of another shape stays as it is. Unpacked, every leaf is the key's own."""
    import jax
    import jax.numpy as jnp

    from jaxkv._src.mxnet.per_key import PerKeyState

    keys, shapes = (0, 1, 2), [(2, 3), (4,), (2, 3)]
    rng = np.random.default_rng(0)

    def own(k, shape):
        return {
            "count": jnp.asarray(k + 1, jnp.int32),
            "mu": {k: jnp.asarray(rng.normal(size=shape), jnp.float32)},
            "odd": jnp.full((k + 1,), float(k)),  # a shape of its own per key: kept
        }

    state = PerKeyState({k: own(k, s) for k, s in zip(keys, shapes)})
    packing, leaves = buckets.pack_opt(keys, shapes, state)
    assert packing.stride == 3 and len(leaves) == 2 + len(keys)
    assert [(kind, i) for kind, i in packing.slots()][:2] == [("scalars", 0), ("family", 1)]
    np.testing.assert_array_equal(leaves[0], [1, 2, 3])
    assert leaves[1].shape == (6 + 4 + 6,)
    back = buckets.unpack_opt(packing, leaves)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(state)
    # written back: the same leaves again, each family in place
    new = jax.tree_util.tree_map(lambda x: x + 1, state)
    again = buckets.unpack_opt(packing, buckets.write_opt(packing, leaves, new))
    for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(new)):
        np.testing.assert_array_equal(a, b)


def test_a_state_not_kept_key_after_key_is_not_packed_per_key():
    """Leaves that are not under their key's name, key after key, keep optax's packing."""
    import jax.numpy as jnp

    state = {"count": jnp.zeros((), jnp.int32), "mu": {0: jnp.ones(3), 1: jnp.ones(3)}}
    packing = buckets.opt_packing((0, 1), [(3,), (3,)], state)
    assert packing.stride == 0 and packing.families == ((1, "float32"),)


def test_the_values_of_a_few_keys_are_made_for_them_alone(compiles):
    """eager_values_at gives what eager_values gives at those positions (a key of its own:
    its array itself; a key in a bucket: a fresh array of its view), by a computation whose
    offsets are arguments: other keys of the same shapes compile nothing new. Keys in a split
    bucket give ``None`` (every view is made then)."""
    shapes = [(3, 2), (5,), (3, 2), (40,), (5,), (2, 2)]
    kept = [1, 1, 1, 0, 1, 1]  # key 3 an array of its own
    flat = buckets.plan(list(range(len(shapes))), shapes, [np.float32] * 6, bucketed=kept)
    nb = len(flat.buckets)
    leaves = [
        jax.numpy.arange(n, dtype=np.float32) + 100 * b for b, (_, n) in enumerate(flat.buckets)
    ]
    own = jax.numpy.ones(40, np.float32)
    leaves.append(own)
    everything = buckets.eager_values(flat, leaves)
    got = buckets.eager_values_at(flat, leaves, [3, 0, 4])
    assert got[0] is own
    for g, i in zip(got, [3, 0, 4]):
        np.testing.assert_array_equal(g, everything[i])
        assert g.shape == shapes[i]
    with compiles() as c:  # (the same shapes in the same buckets: keys 2 and 1)
        again = buckets.eager_values_at(flat, leaves, [2, 1])
    assert c.count == 0
    np.testing.assert_array_equal(again[0], everything[2])
    np.testing.assert_array_equal(again[1], everything[1])
    assert len(leaves) == nb + 1
    split = buckets.plan([0, 1], [(8,), (8,)], [np.float32] * 2, placement=Placement(4, 1))
    assert buckets.eager_values_at(split, [jax.numpy.zeros(split.buckets[0][1])], [0]) is None
