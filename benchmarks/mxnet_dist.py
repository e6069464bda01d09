"""MXNet 1.9.1 ``dist_sync`` baseline: one role of a parameter-server job (benchmarks/dist.py
starts them all: a scheduler, the servers and the workers, each a process with ``DMLC_ROLE``).

A scheduler or server only imports mxnet, which runs its role until the job ends. A worker
pushes the ResNet-50 tensors from D cpu contexts and pulls them back to D contexts, timed:

    DMLC_ROLE=worker ... python mxnet_dist.py D STEPS

and prints ``mxnet dist D=<d> median_ms=<x> ok=<bool>``. ``ok`` checks the first step's values
(the sum of every worker's D pushes of ones, stored by the server's default assign); later
steps are not checked, because with one array per key MXNet's dist pull writes into the pushed
buffer.
"""

import json
import os
import sys
import time

import mxnet as mx  # a scheduler or server runs its role here, then exits
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def main(devices: int, steps: int) -> None:
    with open(os.path.join(HERE, "data", "resnet50_shapes.json")) as f:
        shapes = [tuple(s) for s in json.load(f)]
    keys = list(range(len(shapes)))
    kv = mx.kv.create("dist_sync")
    kv.init(keys, [mx.nd.zeros(s) for s in shapes])
    grads = [[mx.nd.ones(s, mx.cpu(d)) for d in range(devices)] for s in shapes]
    outs = [[mx.nd.zeros(s, mx.cpu(d)) for d in range(devices)] for s in shapes]

    def step():
        kv.push(keys, grads)
        kv.pull(keys, out=outs)
        mx.nd.waitall()

    step()
    expected = kv.num_workers * devices
    ok = all(float(o.asnumpy().min()) == float(o.asnumpy().max()) == expected for o in outs[0])
    step()
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    if kv.rank == 0:
        print(f"mxnet dist D={devices} median_ms={np.median(ts) * 1e3:.2f} ok={ok}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
