"""Three ways to reduce-scatter across processes on CPU devices (gloo), compared exactly and timed:
``lax.psum`` and a slice, ``lax.psum_scatter`` (gloo's reduce-scatter) and ``lax.all_to_all``
with each device's sum (what jaxkv uses there: ``core/collectives.py``). Run under the launcher:

    python -m jaxkv.launch -n P --devices-per-process 1 \
        benchmarks/reduce_scatter_probe.py [N] [REPS]

N float32 per device (default 8M), REPS timed runs per way (default 30). Each device's values are
small integers, so every sum is exact in any order: a wrong element is a wrong collective. Each
process prints, per way, the median ms and how many of its results were wrong.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxkv  # noqa: F401  (joins the launched job)

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8 << 20
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 30


def main():
    devs = jax.devices()
    n = len(devs)
    mesh = Mesh(np.array(devs), ("x",))
    size = N // n * n

    def psum_slice(x):
        whole = jax.lax.psum(x, "x")
        part = x.shape[0] // n
        return jax.lax.dynamic_slice_in_dim(whole, jax.lax.axis_index("x") * part, part, 0)

    def reduce_scatter(x):
        return jax.lax.psum_scatter(x, "x", tiled=True)

    def all_to_all_sum(x):
        got = jax.lax.all_to_all(x.reshape(n, -1), "x", 0, 0, tiled=True)
        return jnp.sum(got, axis=0)

    ways = {
        "psum + slice": psum_slice,
        "psum_scatter": reduce_scatter,
        "all_to_all + sum": all_to_all_sum,
    }
    fns = {
        k: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        for k, f in ways.items()
    }
    blocks = {
        d.id: np.random.default_rng([0, d.id]).integers(0, 4, size).astype(np.float32) for d in devs
    }
    want = sum(blocks.values()).reshape(n, -1)
    x = jax.make_array_from_callback(
        (n * size,),
        NamedSharding(mesh, P("x")),
        lambda i: blocks[devs[(i[0].start or 0) // size].id],
    )
    out = {}
    for name, f in fns.items():
        jax.block_until_ready(f(x))
        wrong, times = 0, []
        for _ in range(REPS):
            t = time.perf_counter()
            got = jax.block_until_ready(f(x))
            times.append(time.perf_counter() - t)
            for shard in got.addressable_shards:
                j = (shard.index[0].start or 0) // (size // n)
                wrong += not np.array_equal(np.asarray(shard.data), want[j])
        out[name] = f"{np.median(times) * 1e3:.1f} ms, {wrong} of {REPS} wrong"
    print(f"rank {jax.process_index()} of {n}, {N} float32:", out, flush=True)


if __name__ == "__main__":
    main()
