"""The timed loop of one worker of the multi-process benchmark, shared by both sides:
``mxnet_dist.py`` runs it with ``mxnet`` (in MXNet's venv), ``dist.py`` with ``jaxkv.mx``, so
both time exactly the same calls.

ResNet-50's tensors are pushed from D cpu contexts and pulled back to D contexts, each step.
The first step's values are checked (every out holds the sum of every worker's D pushes of
ones, stored by the default assign; with 2-bit compression each worker sends its sum D
compressed to ``+THRESHOLD``, so every out holds ``workers * THRESHOLD`` whatever D);
later steps are not, because with one array per key MXNet's dist pull writes into the pushed
buffer.
"""

import json
import os
import time

import numpy as np

SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "resnet50_shapes.json")
THRESHOLD = 0.5  # of 2-bit compression


def run(mx, name: str, devices: int, steps: int, compression: str | None = None) -> None:
    """Time ``steps`` push + pull steps through ``mx`` (``mxnet`` or ``jaxkv.mx``) after two
    warm-up steps; rank 0 prints ``<name> dist D=<d> median_ms=<x> ok=<bool>``.
    ``compression``: ``None``, or ``'2bit'`` (threshold ``THRESHOLD``)."""
    with open(SHAPES) as f:
        shapes = [tuple(s) for s in json.load(f)]
    keys = list(range(len(shapes)))
    kv = mx.kv.create("dist_sync")
    if compression == "2bit":
        kv.set_gradient_compression({"type": "2bit", "threshold": THRESHOLD})
    elif compression is not None:
        raise ValueError(f"compression: expected None or '2bit', given {compression!r}")
    kv.init(keys, [mx.nd.zeros(s) for s in shapes])
    grads = [[mx.nd.ones(s, mx.cpu(d)) for d in range(devices)] for s in shapes]
    outs = [[mx.nd.zeros(s, mx.cpu(d)) for d in range(devices)] for s in shapes]

    def step():
        kv.push(keys, grads)
        kv.pull(keys, out=outs)
        mx.nd.waitall()

    step()
    # ones: D per worker, which 2-bit sends as +THRESHOLD (D >= THRESHOLD)
    expected = kv.num_workers * (THRESHOLD if compression else devices)
    ok = all(bool((o.asnumpy() == expected).all()) for out in outs for o in out)
    step()
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    if kv.rank == 0:
        print(f"{name} dist D={devices} median_ms={np.median(ts) * 1e3:.2f} ok={ok}", flush=True)
