"""jaxkv/_src/state/kvstate.py: where a value of each size is stored."""

import jax
import pytest

import jaxkv


@pytest.mark.parametrize(
    ("shape", "bound", "sharded"),
    [
        ((8, 2), 16, True),  # exactly the big-array bound: split across the devices (MXNet's)
        ((8, 2), 17, False),  # one element below it: whole on every device
        ((8, 3), 16, True),
        ((6, 4), 16, False),  # rows not a multiple of the devices: whole
        ((), 1, False),  # a scalar is never split
    ],
)
def test_a_value_of_at_least_the_bound_is_sharded(shape, bound, sharded):
    state = jaxkv.empty(jax.devices("cpu")[:4], bigarray_bound=bound, layout="keys")
    assert state.is_sharded(shape) is sharded


def test_one_device_or_no_bound_shards_nothing():
    one = jaxkv.empty(jax.devices("cpu")[:1], bigarray_bound=1, layout="keys")
    none = jaxkv.empty(jax.devices("cpu")[:4], bigarray_bound=None, layout="keys")
    assert not one.is_sharded((8, 2)) and not none.is_sharded((8, 2))
