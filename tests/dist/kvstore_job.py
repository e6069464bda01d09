"""Run by tests/test_dist.py through ``python -m jaxkv.launch``: one worker of a dist_sync job.

Each check prints ``ok <name>`` on success; any failure raises, so the worker exits non-zero.
"""

import sys

import jax
import numpy as np
import optax

import jaxkv.mx as mx  # importing jaxkv joins the job (importing jax starts no backend)

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
    total = len(local) * sum(r + 1 for r in range(workers))
    outs = [mx.nd.zeros(SHAPE, mx.cpu(i)) for i in range(len(local))]
    kv.pull(3, out=outs)
    for o in outs:
        check("push sums over workers", o.asnumpy(), np.full(SHAPE, total))
    # A big (sharded) value with an optimizer, and a single value per worker.
    kv.set_optimizer(optax.sgd(0.5))
    kv.push(5, mx.nd.ones((64, 512)))
    check("sharded value with sgd", kv.pull(5), np.full((64, 512), -0.5 * workers))
    kv.barrier()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
