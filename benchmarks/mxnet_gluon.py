"""MXNet 1.9.1's side of the Gluon/Module loop (benchmarks/gluon.py says what it measures).

Run with the python of conformance/setup_mxnet.sh's venv (MXNet 1.9.1 needs numpy<1.24 and so
cannot share jaxkv's environment), by benchmarks/gluon.py: the same loop as jaxkv's side
(``gluon.loop``), through ``mxnet``. Prints its events, one JSON line each, after
``gluon.EVENT``:

    python mxnet_gluon.py --kv device --devices 8 [--scale K] [--keys N] [--steps S]

With ``--kv dist_sync`` it is one role of a parameter-server job (``DMLC_ROLE``; gluon.py
starts them all through benchmarks/dist.py's ``mxnet_job``): a scheduler or server runs its
role when it imports mxnet, then exits; a worker runs the loop.
"""

import gluon  # benchmarks/gluon.py: NumPy and the standard library only, at import
import mxnet as mx  # a scheduler or server runs its role here, then exits

if __name__ == "__main__":
    args = gluon.child_parser().parse_args()
    work = gluon.shapes(args.scale, args.keys)
    gluon.loop(mx, args.kv, args.devices, work, args.steps, gluon.Events())
