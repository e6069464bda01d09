"""MXNet 1.9.1 ``dist_sync`` baseline: one role of a parameter-server job (benchmarks/dist.py
starts them all: a scheduler, the servers and the workers, each a process with ``DMLC_ROLE``).

A scheduler or server only imports mxnet, which runs its role until the job ends. A worker
runs the timed loop of ``dist_worker.py`` (the same as jaxkv's side) with mxnet:

    DMLC_ROLE=worker ... python mxnet_dist.py D STEPS [2bit]

and prints ``mxnet dist D=<d> median_ms=<x> ok=<bool>``. With ``2bit``, the store pushes with
2-bit gradient compression (``dist_worker.THRESHOLD``).
"""

import sys

import dist_worker
import mxnet as mx  # a scheduler or server runs its role here, then exits

if __name__ == "__main__":
    compression = sys.argv[3] if len(sys.argv) > 3 else None
    dist_worker.run(mx, "mxnet", int(sys.argv[1]), int(sys.argv[2]), compression)
