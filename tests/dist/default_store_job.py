"""Run by tests/test_dist_default.py under ``python -m jaxkv.launch -n N``: what a store made
with no arguments is in a joined job, and what it keeps per process.

    default_store_job.py

- ``jaxkv.empty()`` spans every process's devices (``jax.devices()``); a store over this
  process's devices alone is made only when asked for (``jaxkv.empty(jax.local_devices())``),
  and ``jaxkv.create('local')`` is MXNet's per-process store.
- A functional push of every device's gradient into the default store sums over every device
  of every process: each process feeds its own data and every replica sees the same sums.
- Processes whose ``JAXKV_BIGARRAY_BOUND`` differ are refused by ``jaxkv.empty()``, every one
  naming each process's bound.

Each check prints ``rank R ok NAME``; a failure raises.
"""

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv


def ok(name):
    print(f"rank {jax.process_index()} ok {name}", flush=True)


def main():
    rank = jax.process_index()
    everyone, mine = tuple(jax.devices()), tuple(jax.local_devices())
    assert len(everyone) > len(mine)

    state = jaxkv.empty()
    assert state.devices == everyone, (state.devices, everyone)
    ok("empty() spans every process")
    assert jaxkv.empty(jax.local_devices()).devices == mine
    assert jaxkv.create("local")._state.devices == mine  # noqa: SLF001
    ok("one process's devices when asked")

    # Each process feeds its own data: device d's gradient is d + 1 everywhere. Split keys
    # (the default big-array bound) and a replicated one.
    shapes = {"w": (len(everyone) * 8, 4096), "b": (16,)}
    state = jaxkv.init(state, {k: np.zeros(s, np.float32) for k, s in shapes.items()})
    state = jaxkv.init_optimizer(state, optax.sgd(1.0))
    assert tuple(state["w"].sharding.spec) == ("kv",), state["w"].sharding
    specs = jaxkv.specs(state, "kv")
    mesh = state.mesh

    def grads_of(x):
        return {k: jnp.broadcast_to(x.reshape(()), s) for k, s in shapes.items()}

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("kv")), out_specs=specs)
    def step(state, x):
        return jaxkv.push(state, grads_of(x), updater=optax.sgd(1.0), axis_name="kv")

    ids = np.arange(len(everyone), dtype=np.float32) + 1
    x = jax.make_array_from_callback(
        (len(everyone),), NamedSharding(mesh, P("kv")), lambda i: ids[i]
    )
    state = step(state, x)
    total = ids.sum()
    for k in shapes:
        for shard in state[k].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), -total, err_msg=k)
    ok(f"a push sums every process's devices ({rank})")

    # Processes whose environments give the store other bounds would place its values apart
    # (their collectives never meet): every process refuses, naming each one's bound.
    os.environ["JAXKV_BIGARRAY_BOUND"] = str(1024 * (rank + 1))
    try:
        jaxkv.empty()
    except jaxkv.KVStoreError as e:
        assert "expected every process to make the store" in str(e), e
        assert "bigarray_bound=1024" in str(e) and "bigarray_bound=2048" in str(e), e
    else:
        raise AssertionError("processes with different JAXKV_BIGARRAY_BOUND were not refused")
    os.environ["JAXKV_BIGARRAY_BOUND"] = "1024"
    assert jaxkv.empty().placement.bound == 1024  # alike again: made
    del os.environ["JAXKV_BIGARRAY_BOUND"]
    ok("processes with different bounds refused")


if __name__ == "__main__":
    main()
