"""MXNet 1.9.1 KVStore baseline: push from D cpu contexts + pull to D contexts, timed.

`make bench` runs it with the python of conformance/setup_mxnet.sh's venv (MXNet 1.9.1 needs
numpy<1.24 and so cannot share jaxkv's environment). Prints one line per workload:
  mxnet <workload> D=<d> median_ms=<x>
Workloads: resnet50 (the 193 parameter tensors of ResNet-50 v1, 25.6M float32, from
benchmarks/data/resnet50_shapes.json) and small (1000 keys of 16x16 float32).
"""

import json
import os
import sys
import time

import mxnet as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def run(work, D):
    if work == "resnet50":
        with open(os.path.join(HERE, "data", "resnet50_shapes.json")) as f:
            shapes = [tuple(s) for s in json.load(f)]
    else:
        shapes = [(16, 16)] * 1000
    keys = list(range(len(shapes)))
    kv = mx.kv.create("local")
    kv.init(keys, [mx.nd.zeros(s) for s in shapes])
    grads = [[mx.nd.ones(s, mx.cpu(d)) for d in range(D)] for s in shapes]
    outs = [[mx.nd.zeros(s, mx.cpu(d)) for d in range(D)] for s in shapes]

    def step():
        kv.push(keys, grads)
        kv.pull(keys, out=outs)
        mx.nd.waitall()

    step()
    step()
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    print(f"mxnet {work} D={D} median_ms={np.median(ts) * 1e3:.2f}", flush=True)


if __name__ == "__main__":
    for w in sys.argv[1:] or ["resnet50:8", "small:8"]:
        name, d = w.split(":")
        run(name, int(d))
