"""Run by tests/test_dist_sums.py under ``python -m jaxkv.launch -n N``: the README's sharded
in-jit step across processes, checked exactly against a NumPy model of every process's data.

    sharded_step_job.py PATTERN STEPS [ROWS]

``PATTERN`` is ``jaxkv`` (``jaxkv.gather`` and ``jaxkv.push`` inside the user's ``shard_map``,
over a store spanning every process's devices) or ``hand`` (the same step written by hand with
``lax.all_gather`` and the reduce-scatter AD gives for it). Several keys of one shape are each
big enough to be split across the devices (the keys that went wrong in the flax MLP's runs),
beside a small one. Values and data are small integers and the optimizer is
``optax.sgd(1.0)``, so every sum and update is exact in float32 in any order: the model is
compared exactly, and a wrong element is a wrong collective. The step also takes the ``pmean``
of its loss, a collective of the user's own.

Each process prints ``rank R ok STEPS steps``; a wrong value raises, naming the step, the key,
and the wrong elements' span (the reduce-scatter's defect leaves the end of rank 0's rows wrong).
"""

import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv

PATTERN, STEPS = sys.argv[1], int(sys.argv[2])
# 2040 rows divide by 1 to 4 devices; 16 MiB a key (8 MiB per device at 2 devices: gloo's defect
# shows from about there). ROWS=2048 do not divide by 3: each key is split padded by rows.
BIG = (int(sys.argv[3]) if len(sys.argv) > 3 else 2040, 2048)
SHAPES = {"w0": BIG, "w1": BIG, "w2": BIG, "w3": BIG, "b": (16,)}


def data(rank_device, step, key):
    """The per-device data of one step (small integers): the same in every process's model."""
    rng = np.random.default_rng([rank_device, step, list(SHAPES).index(key)])
    return rng.integers(0, 3, SHAPES[key]).astype(np.float32)


def first(key):
    return np.random.default_rng([99, list(SHAPES).index(key)]).integers(0, 1000, SHAPES[key])


def main():
    devices = jax.devices()
    n = len(devices)
    assert jax.process_count() > 1 and n > len(jax.local_devices())
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    init = {k: first(k).astype(np.float32) for k in SHAPES}
    mesh = Mesh(np.array(devices), ("kv",))
    opt = optax.sgd(1.0)

    def local(step):
        """This process's data, one block of rows per device, as one global array per key."""
        out = {}
        for k, shape in SHAPES.items():
            blocks = {i: data(i, step, k) for i in mine}
            sharding = NamedSharding(mesh, P("kv"))
            out[k] = jax.make_array_from_callback(
                (n * shape[0], *shape[1:]), sharding, lambda idx, k=k: blocks[idx[0].start // SHAPES[k][0]]
            )
        return out

    if PATTERN == "jaxkv":
        state = jaxkv.init(jaxkv.empty(devices, bigarray_bound=1024), init)
        state = jaxkv.init_optimizer(state, opt)
        specs = jaxkv.specs(state, "kv")
        assert all(tuple(specs[k]) == ("kv",) for k in SHAPES if k != "b"), specs

        @jax.jit
        @partial(jax.shard_map, mesh=state.mesh, in_specs=(specs, P("kv")), out_specs=(specs, P()))
        def step(state, x):
            def loss(params):
                whole = jaxkv.gather(state, params, "kv")
                return sum(jnp.sum(whole[k] * (x[k] + 1)) for k in SHAPES)

            value, grads = jax.value_and_grad(loss)(dict(state.values))
            return jaxkv.push(state, grads, updater=opt, axis_name="kv"), jax.lax.pmean(value, "kv")

        def params(state):
            return {k: state[k] for k in SHAPES}
    else:
        row = NamedSharding(mesh, P("kv"))
        specs = {k: P("kv") if k != "b" else P() for k in SHAPES}
        state = {
            k: jax.device_put(v, row if k != "b" else NamedSharding(mesh, P()))
            for k, v in init.items()
        }

        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("kv")), out_specs=(specs, P()))
        def step(state, x):
            def loss(params):
                whole = {
                    k: jax.lax.all_gather(v, "kv", tiled=True) if k != "b" else v
                    for k, v in params.items()
                }
                return sum(jnp.sum(whole[k] * (x[k] + 1)) for k in SHAPES)

            # The replicated key's gradient comes back already summed over the axis.
            value, grads = jax.value_and_grad(loss)(state)
            return jax.tree.map(lambda w, g: w - g, state, grads), jax.lax.pmean(value, "kv")

        def params(state):
            return state

    model = {k: v.copy() for k, v in init.items()}
    for t in range(STEPS):
        x = local(t)
        # Each device's x holds one block of rows of the data, tiled along the whole shape:
        # the gradient of a key is its data summed over every device.
        state, _ = step(state, x)
        for k in SHAPES:
            model[k] = model[k] - sum(data(i, t, k) + 1 for i in range(n))
        got = params(state)
        for k in SHAPES:
            for shard in got[k].addressable_shards:
                want = model[k][shard.index]
                have = np.asarray(shard.data)
                if not np.array_equal(have, want):
                    wrong = np.flatnonzero(have != want)
                    raise AssertionError(
                        f"rank {jax.process_index()} step {t} key {k!r} device "
                        f"{shard.device.id}: {wrong.size} of {have.size} elements wrong, "
                        f"flat {wrong.min()}..{wrong.max()}"
                    )
    print(f"rank {jax.process_index()} ok {STEPS} steps", flush=True)


if __name__ == "__main__":
    main()
