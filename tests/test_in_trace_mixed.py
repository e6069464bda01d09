"""Inside ``shard_map``, one push may give a key several values: some already summed over the
axis (invariant, as JAX types the gradient of a replicated parameter), some not. Each is
summed exactly once: the invariant ones are not added into the others before the sum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

D = 8


@pytest.mark.parametrize("shape", [(16, 4), (64, 512)])  # replicated, sharded
def test_an_invariant_and_a_varying_value_of_one_key_are_each_summed_once(shape):
    devices = jax.devices("cpu")
    assert len(devices) == D, "tests expect 8 simulated CPU devices (see conftest.py)"
    state = jaxkv.init(jaxkv.empty(devices), {"w": jnp.zeros(shape)})
    specs = jaxkv.specs(state, "d")
    rng = np.random.default_rng(3)
    per_device = rng.normal(size=(D, *shape)).astype(np.float32)
    common = rng.normal(size=shape).astype(np.float32)

    def step(state, g, c):
        varying = g.reshape(shape)
        invariant = jax.lax.psum(c, "d") / D  # c itself, typed invariant along "d"
        return jaxkv.push(state, ["w", "w"], [invariant, varying], axis_name="d")

    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P("d"), P()), out_specs=specs))
    g = jax.device_put(per_device.reshape(D * shape[0], *shape[1:]), NamedSharding(mesh, P("d")))
    new = fn(state, g, jnp.asarray(common))
    expected = common + per_device.sum(0)
    np.testing.assert_allclose(np.asarray(new["w"]), expected, rtol=1e-5, atol=1e-5)
