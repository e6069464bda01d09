"""Steady-state peak memory of the imperative ResNet-50 loop (push from 8 devices, pull to 8).

Run by bench.py in a process of its own. Prints one JSON line: the resident set before the
store exists (interpreter + JAX, warmed on a tiny store); the peak resident set sampled every
millisecond during steady-state steps, as is, and again after ``malloc_trim`` has handed the
memory freed during set-up back to the OS; and the bytes the loop must hold: the stored values,
one set of per-device gradients and one set of per-device outs.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import jaxkv.mx as mx  # noqa: E402

D = 8


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    with open(sys.argv[1]) as f:
        shapes = [tuple(s) for s in json.load(f)]
    keys = list(range(len(shapes)))
    warm = mx.kv.create("local")  # JAX's own baseline: compile and run a tiny push and pull
    warm.init(0, mx.nd.zeros((16, 16)))
    warm.push(0, [mx.nd.ones((16, 16), mx.cpu(d)) for d in range(D)])
    warm.pull(0, out=[mx.nd.zeros((16, 16), mx.cpu(d)) for d in range(D)])
    mx.nd.waitall()
    base = rss()

    kv = mx.kv.create("local")
    kv.init(keys, [mx.nd.zeros(s) for s in shapes])
    grads = [[mx.nd.ones(s, mx.cpu(d)) for d in range(D)] for s in shapes]
    outs = [[mx.nd.zeros(s, mx.cpu(d)) for d in range(D)] for s in shapes]
    for _ in range(3):  # warm-up
        kv.push(keys, grads)
        kv.pull(keys, out=outs)
        mx.nd.waitall()

    def steady_peak() -> int:
        peak, done = [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        for _ in range(7):
            kv.push(keys, grads)
            kv.pull(keys, out=outs)
            mx.nd.waitall()
        done.set()
        sampler.join()
        return peak[0]

    raw = steady_peak()
    # glibc keeps memory freed during set-up (the outs' first zeros, the first pulls) in its
    # heap; give it back to the OS, then measure what the steady state itself holds.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = steady_peak()
    nbytes = sum(int(np.prod(s)) for s in shapes) * 4
    print(
        json.dumps(
            {"base": base, "peak": raw, "peak_trimmed": trimmed, "data": nbytes * (1 + D + D)}
        )
    )


if __name__ == "__main__":
    main()
