"""Run by tests/test_optax_trees.py under ``python -m jaxkv.launch -n N``: a flax-style tree
trained across processes with a weight-decay mask by path (AdamW, no decay on biases) in the
README's sharded step (``state.tree()`` differentiated, ``jaxkv.push`` inside the user's
``shard_map``), against optax on one device over the whole batch, which every process computes
for itself.

Each process prints ``rank R ok STEPS steps``; a parameter off by more than float rounding
raises, naming the step and the leaf.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

STEPS = 3


def params0():
    rng = np.random.default_rng(0)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    return {
        "dense": {"kernel": f(16, 64), "bias": f(64)},
        "out": {"kernel": f(64, 2), "bias": f(2)},
    }


def no_decay_on_bias(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key != "bias", params)


def loss(p, x):
    h = jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"])
    return jnp.mean((h @ p["out"]["kernel"] + p["out"]["bias"]) ** 2)


def main():
    devices = jax.devices()
    n = len(devices)
    assert jax.process_count() > 1 and n > len(jax.local_devices())
    tx = optax.adamw(0.05, weight_decay=0.5, mask=no_decay_on_bias)
    x_all = np.random.default_rng(1).normal(size=(8 * n, 16)).astype(np.float32)
    mesh = Mesh(np.array(devices), ("kv",))
    x = jax.make_array_from_callback(x_all.shape, NamedSharding(mesh, P("kv")), lambda i: x_all[i])

    state = jaxkv.init(jaxkv.empty(devices, bigarray_bound=512), params0())
    state = jaxkv.init_optimizer(state, tx)
    specs = jaxkv.specs(state, "kv")
    assert tuple(specs.values["dense/kernel"]) == ("kv",), specs

    @jax.jit
    @partial(jax.shard_map, mesh=state.mesh, in_specs=(specs, P("kv")), out_specs=specs)
    def step(state, x):
        grads = jax.grad(lambda local: loss(jaxkv.gather(state, local, "kv"), x))(state.tree())
        return jaxkv.push(state, grads, updater=tx, axis_name="kv", reduce="mean")

    cpu = jax.local_devices(backend="cpu")[0]
    with jax.default_device(cpu), jax.numpy_dtype_promotion("standard"):
        ref = jax.tree.map(jnp.asarray, params0())
        opt = tx.init(ref)
        for _ in range(STEPS):
            updates, opt = tx.update(jax.grad(loss)(ref, jnp.asarray(x_all)), opt, ref)
            ref = optax.apply_updates(ref, updates)
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(STEPS):
            state = step(state, x)
    for path, want in jax.tree_util.tree_flatten_with_path(ref)[0]:
        key = jax.tree_util.keystr(path, simple=True, separator="/")
        for shard in state[key].addressable_shards:
            have, expect = np.asarray(shard.data), np.asarray(want)[shard.index]
            if not np.allclose(have, expect, rtol=1e-5, atol=1e-6):
                raise AssertionError(
                    f"rank {jax.process_index()} key {key!r}: max |difference| "
                    f"{np.max(np.abs(have - expect)):.3g} from optax on one device"
                )
    print(f"rank {jax.process_index()} ok {STEPS} steps", flush=True)


if __name__ == "__main__":
    main()
