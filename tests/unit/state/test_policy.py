"""jaxkv/_src/state/policy.py: the one placement policy, and the store doing what it says."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv._src.core import collectives
from jaxkv._src.state import buckets, policy
from jaxkv._src.state.policy import Placement


def test_a_store_owns_its_placement_made_from_its_devices_and_bound():
    state = jaxkv.empty(jax.devices("cpu")[:4], bigarray_bound=64, layout="keys")
    assert state.placement == Placement(4, 64)
    assert state.placement is jaxkv.empty(jax.devices("cpu")[:4], bigarray_bound=64).placement
    assert jaxkv.empty(jax.devices("cpu")[:1]).placement.shards == 1


@pytest.mark.parametrize("bound", [8, 64, 1000, None])
@pytest.mark.parametrize("shape", [(), (3,), (8,), (8, 8), (6, 20), (16, 64), (40, 25)])
def test_the_store_shards_exactly_what_its_placement_says(bound, shape):
    """Where the value of each shape lies after init is the policy's answer, for any bound."""
    state = jaxkv.empty(jax.devices("cpu")[:4], bigarray_bound=bound, layout="keys")
    state = jaxkv.init(state, {"k": jnp.zeros(shape)})
    split = buckets.is_split(state, 0)  # (a padded value: in a split bucket of its own)
    place = state.placement
    assert place.is_sharded(shape) == state.is_sharded(shape)
    assert split == (place.is_sharded(shape) or place.pads(shape)) == state.splits(shape)
    if place.is_sharded(shape):
        assert not state["k"].sharding.is_fully_replicated
    assert not (place.is_sharded(shape) and place.pads(shape))


@pytest.mark.parametrize("bound", [32, 64, 100])
def test_a_flat_stores_shared_bucket_is_split_exactly_where_its_placement_says(bound):
    """Small values share one bucket; it is split over the devices once the bucket (not any
    one value) reaches the bound, as the store's placement answers."""
    state = jaxkv.empty(jax.devices("cpu")[:4], bigarray_bound=bound, layout="flat")
    place = state.placement
    seen = set()
    for n in (1, 3, 4, 7, 12):  # buckets of 10 to 120 elements: on either side of each bound
        filled = jaxkv.init(state, {f"k{i}": jnp.ones((2, 5)) for i in range(n)})
        split = filled.flat_layout.parts_of(0) > 1
        assert split == place.splits_bucket(10 * n) == (10 * n >= bound)
        assert buckets.is_split(filled, 0) == split
        seen.add(split)
    assert seen == {True, False}
    assert not Placement(1, 8).splits_bucket(100) and not Placement(4, None).splits_bucket(100)


def test_the_smallest_split_shape_is_sharded_and_the_largest_whole_one_is_not():
    for shards, bound, width in [(8, 1 << 14, 64), (4, 100, 7), (2, 9, 1), (8, 1 << 16, 128)]:
        place = Placement(shards, bound)
        rows, w = place.smallest_split(width)
        assert w == width and place.is_sharded((rows, width))
        assert not place.is_sharded((rows - shards, width))  # the next smaller multiple
        whole = place.largest_whole(width)
        assert not place.splittable(whole) and whole[0] % shards == 0
        assert place.splittable((whole[0] + shards, width))
    assert Placement(1, 8).smallest_split() is None and Placement(4, None).smallest_split() is None


@pytest.mark.parametrize(
    ("rows", "parts", "blocks"),
    [(2048, 3, 683), (2048, 8, 256), (17, 4, None), (16, 3, None), (48, 5, 10), (0, 2, 0)],
)
def test_blocks_are_whole_rows_where_padding_adds_at_most_a_sixteenth(rows, parts, blocks):
    assert policy.block_rows((rows, 4), parts) == blocks
    assert Placement(parts).block_rows((rows, 4)) == blocks
    assert buckets.block(((rows, 4)), parts) * parts >= rows * 4
    assert policy.block_rows((), parts) is None


def test_which_pushes_are_reduce_scattered():
    place = Placement(8, 1 << 14)
    big, small = place.smallest_split(64), (8, 2)
    assert place.scatters(big) and place.scatters(big, processes=2)
    assert not place.scatters(small) and not place.scatters(small, processes=2)
    # Below the bound but at the fuse limit, rows dividing: reduce-scattered in one process.
    below = Placement(8, 1 << 20)
    rows = policy.FUSE_BELOW // 64
    assert below.scatters((rows, 64)) and not below.scatters((rows, 64), processes=2)
    assert not below.scatters((rows - 8, 64)) and not below.scatters((rows + 1, 64))
    state = jaxkv.empty(jax.devices("cpu"), bigarray_bound=1 << 20, layout="keys")
    assert collectives.scatters(state, (rows, 64)) == below.scatters((rows, 64))


def test_blocks_below_the_scatter_fusion_limit_share_a_collective():
    assert policy.scatters_alone(policy.SCATTER_FUSE_BELOW)
    assert not policy.scatters_alone(policy.SCATTER_FUSE_BELOW - 1)


def test_the_default_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(policy.BOUND_ENV, raising=False)
    assert policy.default_bound() == policy.BIGARRAY_BOUND == 1 << 14
    monkeypatch.setenv(policy.BOUND_ENV, "  ")
    assert policy.default_bound() == policy.BIGARRAY_BOUND
    monkeypatch.setenv(policy.BOUND_ENV, "None")
    assert policy.default_bound() is None
    monkeypatch.setenv(policy.BOUND_ENV, "2048")
    assert policy.default_bound() == 2048
    for bad in ("0", "-1", "x", "2.5"):
        monkeypatch.setenv(policy.BOUND_ENV, bad)
        with pytest.raises(jaxkv.KVStoreError, match=f"JAXKV_BIGARRAY_BOUND: .* given '{bad}'"):
            policy.default_bound()


def test_a_padded_value_is_split_in_blocks_the_policy_gives():
    state = jaxkv.empty(jax.devices("cpu")[:3], bigarray_bound=64, layout="keys")
    place = state.placement
    shape = (2048, 4)
    assert place.pads(shape) and place.block_rows(shape) == 683
    state = jaxkv.init(state, {"t": jnp.arange(8192.0).reshape(shape)})
    np.testing.assert_array_equal(np.asarray(state["t"]), np.arange(8192.0).reshape(shape))
