"""Run by tests/test_dist_default.py under ``python -m jaxkv.launch -n N --devices-per-process
1``: how much of a ``dist_sync`` store each process keeps, by default.

    bytes_job.py ROWS [DIR MODE]

Adam over one 8M-element key (ROWS rows) and 20 small ones, as MXNet users' models have them:
MXNet's servers split arrays of at least ``MXNET_KVSTORE_BIGARRAY_BOUND`` (1M) elements, so
each worker holds only 1/P of the big one; so must each process here, with its optimizer
state. After a push, each process prints ``rank R ok held FRACTION`` (the bytes of the stored
values and optimizer state on its devices over the store's), and the big key's pull is checked.
With ``DIR save`` the store is then saved there (``kv.save``: each process writes its own
shards); with ``DIR load`` a fresh store loads it instead of training, on however many
processes this job has, and the same checks run.
"""

import sys

import jax
import numpy as np
import optax

import jaxkv.mx as mx

ROWS = int(sys.argv[1])
DIRECTORY, MODE = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else (None, None)


def main():
    kv = mx.kv.create("dist_sync")
    big = (ROWS, (8 << 20) // ROWS)
    kv.set_optimizer(optax.adam(1e-3))
    if MODE == "load":
        kv.load(DIRECTORY)
    else:
        kv.init("big", mx.nd.ones(big))
        for i in range(20):
            kv.init(f"small{i}", mx.nd.ones((64, 64)))
        local = jax.local_devices()
        kv.push("big", [mx.nd.ones(big, mx.cpu(i)) for i in range(len(local))])
        for i in range(20):
            kv.push(f"small{i}", [mx.nd.ones((64, 64), mx.cpu(j)) for j in range(len(local))])
    if MODE == "save":
        kv.save(DIRECTORY)
    out = mx.nd.zeros(big)
    kv.pull("big", out=out)
    np.testing.assert_allclose(out.asnumpy(), 1 - 1e-3, rtol=1e-5)
    leaves = jax.tree_util.tree_leaves(kv.state)
    held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    whole = sum(x.nbytes for x in leaves)
    print(f"rank {kv.rank} ok held {held / whole:.4f} of {whole} bytes", flush=True)


if __name__ == "__main__":
    main()
