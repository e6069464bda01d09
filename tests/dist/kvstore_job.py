"""Run by tests/test_dist.py through ``python -m jaxkv.launch``: one worker of a dist_sync job.

Each check prints ``ok <name>`` on success; any failure raises, so the worker exits non-zero.
"""

import sys

import jax
import numpy as np
import optax

import jaxkv
import jaxkv.mx as mx  # importing jaxkv joins the job (importing jax starts no backend)
from jaxkv._src.processes import host as host_collectives

SHAPE = (4, 3)


def check(name, got, want):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    print(f"rank {jax.process_index()} ok {name}", flush=True)


def main():
    kv = mx.kv.create("dist_sync")
    rank, workers = kv.rank, kv.num_workers
    local = jax.local_devices()
    assert workers == int(sys.argv[1]) and len(jax.devices()) == workers * len(local)
    # Only rank 0's init value counts.
    kv.init([3, 5], [mx.nd.ones(SHAPE) * (rank + 1), mx.nd.zeros((64, 512))])
    check("init from rank 0", kv.pull(3), np.ones(SHAPE))
    # Every worker pushes one value per local device: summed over all devices of all workers.
    kv.push(3, [mx.nd.ones(SHAPE, mx.cpu(i)) * (rank + 1) for i in range(len(local))])
    # Keys made and pushed one at a time keep arrays of their own (a push of one key lays
    # nothing out); the state the store hands out is laid out: under the flat layouts the
    # small key in a bucket, across processes too (never split).
    assert kv._state.buckets == 0, (kv._state.layout, kv._state.buckets)
    state = kv.state
    assert state.buckets == (0 if state.layout == "keys" else 1), (state.layout, state.buckets)
    assert state.flat_layout is None or not state.flat_layout.split
    total = len(local) * sum(r + 1 for r in range(workers))
    outs = [mx.nd.zeros(SHAPE, mx.cpu(i)) for i in range(len(local))]
    kv.pull(3, out=outs)
    for o in outs:
        check("push sums over workers", o.asnumpy(), np.full(SHAPE, total))
    # A big (sharded) value with an optimizer, and a single value per worker.
    kv.set_optimizer(optax.sgd(0.5))
    kv.push(5, mx.nd.ones((64, 512)))
    check("sharded value with sgd", kv.pull(5), np.full((64, 512), -0.5 * workers))
    # No value is split across the processes' devices, so the store lends its values to the
    # outs of a pull (a key of its own: the stored buffer itself, no copy), and a push keeps
    # them: the outs stay as they were.
    out = mx.nd.zeros((64, 512))
    kv.pull(5, out=out)
    before = out.asnumpy()
    state = kv._state
    if state.flat_layout is None or state.flat_layout.where[state.index(5)][0] < 0:
        stored = state[5].addressable_shards[0].data
        assert out.asjax().unsafe_buffer_pointer() == stored.unsafe_buffer_pointer()
    kv.push(5, mx.nd.ones((64, 512)))
    mx.nd.waitall()
    assert not out.asjax().is_deleted()
    check("outs lent and kept", out.asnumpy(), before)
    # Host-side collectives: rank 0's values bit for bit (-0.0, a NaN's payload, bools, ints,
    # a scalar, an empty array), every process's values gathered in order, and barriers of
    # different names refused on every process (they run different code).
    nan = np.array([0x7FC00123 + rank], np.uint32).view(np.float32)
    tree = {
        "f": np.array([-0.0, 1.5 + rank], np.float32),
        "nan": nan,
        "b": np.array([rank == 0, rank != 0]),
        "i": np.int64(-(2**40) - rank),
        "e": np.zeros((0, 3), np.float16),
    }
    got = host_collectives.from_rank_zero(tree)
    for name, want in (("f", [-0.0, 1.5]), ("b", [True, False]), ("i", -(2**40))):
        check(f"broadcast {name}", got[name], want)
    assert np.signbit(got["f"][0]) and got["e"].shape == (0, 3), got
    check("broadcast nan bits", got["nan"].view(np.uint32), [0x7FC00123])
    check(
        "all-gather",
        host_collectives.all_gather(np.array([rank, -rank])),
        [[r, -r] for r in range(workers)],
    )
    try:
        host_collectives.barrier(f"rank {rank}")
    except jaxkv.KVStoreError as e:
        assert "different ones" in str(e), e
        print(f"rank {rank} ok mismatched barriers refused", flush=True)
    kv.barrier()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
