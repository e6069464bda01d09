"""Records Apache MXNet 1.9.1's values of a resumed run (issue 38): a row-sparse key and a dense
key under ``Adam(lazy_update=True)`` with a warm-up ``CosineScheduler`` and weight decay; after
3 pushes of each, ``save_optimizer_states`` (with ``dump_optimizer`` False, then True), a new
store with a new optimizer, ``load_optimizer_states``, and 2 more pushes.

Run with MXNet's own venv (no JAX there; it needs no network):

    "$(bash conformance/setup_mxnet.sh)" conformance/record_resume.py

It writes conformance/data/mxnet_resume.json, which tests/test_embedding_loop.py reads: the
gradients (so both sides push the same numbers), and for each ``dump_optimizer`` the values of
both keys after the first push that follows the load and of the dense key after the second,
and the optimizer's ``num_update`` at the end. Without ``dump_optimizer`` MXNet does not save
the update counts, so the resumed run counts from 0 for both keys; with it, from 3. MXNet's
two states files are kept beside it (``mxnet_resume_states_0.bin``, ``_1.bin``: pickles, which
jaxkv reads with its restricted reader, ``jaxkv/_src/mxnet/states_file.py``).
"""

from __future__ import annotations

import json
import os

import mxnet as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
R, W = 6, 2
IDS = [0, 2, 3]  # the rows of the row-sparse key's gradient


def gradients() -> list[list[list[float]]]:
    rng = np.random.default_rng(38)
    return [rng.normal(size=(R, W)).astype(np.float32).tolist() for _ in range(5)]


def store():
    kv = mx.kv.create("local")
    sched = mx.lr_scheduler.CosineScheduler(
        max_update=20, base_lr=0.1, final_lr=0.01, warmup_steps=2, warmup_begin_lr=0.02
    )
    kv.set_optimizer(
        mx.optimizer.Adam(learning_rate=None, lazy_update=True, lr_scheduler=sched, wd=0.01)
    )
    kv.init("e", mx.nd.ones((R, W)).tostype("row_sparse"))
    kv.init("d", mx.nd.ones((R, W)))
    return kv


def push(kv, g: np.ndarray, dense_only: bool = False) -> None:
    ids = np.array(IDS)
    if not dense_only:
        kv.push("e", mx.nd.sparse.row_sparse_array((g[ids], ids), shape=(R, W)))
    kv.push("d", mx.nd.array(g))


def run(dump: bool, grads: list) -> dict:
    g = [np.array(x, np.float32) for x in grads]
    kv = store()
    for s in range(3):
        push(kv, g[s])
    # MXNet's file itself is kept: jaxkv's store reads it (without running its pickle's code).
    fname = os.path.join(HERE, "data", f"mxnet_resume_states_{int(dump)}.bin")
    kv.save_optimizer_states(fname, dump_optimizer=dump)
    kv = store()
    kv.load_optimizer_states(fname)
    push(kv, g[3])
    e, d = mx.nd.zeros((R, W)), mx.nd.zeros((R, W))
    kv.pull("e", out=e, ignore_sparse=False)
    kv.pull("d", out=d)
    push(kv, g[4], dense_only=True)
    d2 = mx.nd.zeros((R, W))
    kv.pull("d", out=d2)
    return {
        "e": e.asnumpy().tolist(),
        "d": d.asnumpy().tolist(),
        "d2": d2.asnumpy().tolist(),
        "num_update": kv._updater.optimizer.num_update,
    }


def main() -> None:
    grads = gradients()
    out = {
        "mxnet": mx.__version__,
        "gradients": grads,
        "ids": IDS,
        "runs": {str(int(dump)): run(dump, grads) for dump in (False, True)},
    }
    path = os.path.join(HERE, "data", "mxnet_resume.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
