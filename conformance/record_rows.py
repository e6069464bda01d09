"""Records Apache MXNet 1.9.1's outcomes of a few fixed row-sparse and optimizer programs.

Run with MXNet's own venv (no JAX there; it needs no network):

    "$(bash conformance/setup_mxnet.sh)" conformance/record_rows.py

It writes conformance/data/mxnet_rows.json, which tests/test_conformance_rows.py reads (so that
`make test`, which has no MXNet, checks jaxkv against them):

- ``programs``: hand-written programs in programs.py's format (a value ``{"shape", "fill",
  "ramp", "ctx"}`` is ``fill + ramp * i``; row-sparse values, outs and row ids as programs.py
  describes them). They cover row-sparse ``init`` (every row, some rows, no row, with explicit
  zero rows), pushes of row-sparse values from several devices with overlapping rows (int64 and
  float32 ids), row-sparse values pushed into dense keys, ``row_sparse_pull`` with repeated and
  unsorted ids (one id array for several outs, one per out, a list of keys), ``pull`` with
  ``ignore_sparse`` True and False, pushpull and broadcast with row-sparse outs (left as they
  are), and MXNet's SGD (lazy with momentum and weight decay; standard with weight decay,
  clipping and rescaling) and Adam (lazy, then standard) on dense and row-sparse values.
  Each uses sorted, distinct row ids (as MXNet requires), and no op that hits a known MXNet
  defect.
- An op may carry ``expect``: the documented difference (programs.DIFFERENCES) the harness must
  find there (X1, X2 and X6 each appear once); every other op must agree, values bit for
  bit (the programs carry no ``approx``: optimizer values too are compared exactly).
- ``outcomes``: MXNet's outcome of every op (run_program.py's format; a row-sparse out is
  ``{"rsp": dense value, "ids": row ids}``).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
import run_program  # noqa: E402

OUT = os.path.join(HERE, "data", "mxnet_rows.json")


def V(shape, fill, ramp, ctx):  # noqa: N802 - a dense value
    return {"shape": list(shape), "fill": fill, "ramp": ramp, "ctx": ctx}


def R(shape, rows, fill, ramp, ctx, ids="int64"):  # noqa: N802 - row_sparse_array((data, rows))
    desc = V(shape, fill, ramp, ctx)
    desc.update(stype="row_sparse", make="rows", rows=list(rows), ids_dtype=ids)
    return desc


def ONES(shape, scale, ctx):  # noqa: N802 - ones(shape).tostype('row_sparse') * scale
    return {"shape": list(shape), "fill": scale, "ctx": ctx, "stype": "row_sparse", "make": "ones"}


def TOSTYPE(shape, fill, ramp, ctx):  # noqa: N802 - the dense value's tostype('row_sparse')
    return dict(V(shape, fill, ramp, ctx), stype="row_sparse", make="tostype")


def ZEROS(shape, ctx):  # noqa: N802 - sparse.zeros('row_sparse', shape)
    return {"shape": list(shape), "ctx": ctx, "stype": "row_sparse", "make": "zeros"}


def O(shape, ctx):  # noqa: E743, N802 - a dense out
    return {"shape": list(shape), "ctx": ctx}


def RO(shape, ctx):  # noqa: N802 - a row-sparse out
    return {"shape": list(shape), "ctx": ctx, "stype": "row_sparse"}


def IDS(ids, dtype, ctx):  # noqa: N802 - row ids to pull
    return {"ids": list(ids), "dtype": dtype, "ctx": ctx}


T6, T3, T4, T222, T23 = (6, 2), (3, 2), (4, 1), (2, 2, 2), (2, 3)

PROGRAMS = [
    {
        "id": "rows_local",
        "store": "local",
        "key_kind": "int",
        "ops": [
            {"op": "create", "type": "local"},
            {"op": "init", "key": [3, 5], "value": [ONES(T6, 2, 0), V(T3, 1, 1, 1)]},
            {"op": "init", "key": 7, "value": R(T4, [1, 3], 5, 1, 2, "float32")},
            # Three devices, overlapping rows (2 and 5 twice), int64 and float32 ids.
            {
                "op": "push",
                "key": 3,
                "value": [
                    R(T6, [0, 2, 5], 1, 1, 0),
                    R(T6, [2, 3, 5], 2, 0, 1, "float32"),
                    R(T6, [1, 2, 5], -1, 0, 4),
                ],
            },
            {"op": "pull", "key": 3, "out": [O(T6, 0), O(T6, 6)]},
            # Repeated, unsorted ids (int64), then one float32 id array for three outs, then
            # one id array per out.
            {
                "op": "row_sparse_pull",
                "key": 3,
                "out": RO(T6, 1),
                "row_ids": IDS([5, 0, 5, 2, 0], "int64", 1),
            },
            {
                "op": "row_sparse_pull",
                "key": 3,
                "out": [RO(T6, 2), RO(T6, 3), RO(T6, 7)],
                "row_ids": IDS([4, 2, 2], "float32", 2),
            },
            {
                "op": "row_sparse_pull",
                "key": 3,
                "out": [RO(T6, 0), RO(T6, 5)],
                "row_ids": [IDS([1], "int64", 0), IDS([3, 0, 3], "float32", 5)],
            },
            {"op": "pull", "key": 3, "out": [RO(T6, 4), O(T6, 4)], "ignore_sparse": True},
            {"op": "pull", "key": 3, "out": RO(T6, 6), "ignore_sparse": False},
            # Rows pushed into a dense key, from two devices.
            {
                "op": "push",
                "key": 5,
                "value": [R(T3, [0, 2], 3, -1, 2), R(T3, [1, 2], 1, 0, 3, "float32")],
            },
            {"op": "pull", "key": 5, "out": O(T3, 5)},
            # A list of keys, ids mirroring the outs.
            {
                "op": "row_sparse_pull",
                "key": [3, 7],
                "out": [RO(T6, 1), [RO(T4, 2), RO(T4, 3)]],
                "row_ids": [
                    IDS([0, 1], "int64", 1),
                    [IDS([3, 3, 1], "int64", 2), IDS([0], "float32", 3)],
                ],
            },
            # Row-sparse outs of pushpull and broadcast are left as they are.
            {
                "op": "pushpull",
                "key": 7,
                "value": [R(T4, [0, 1], 1, 1, 5), R(T4, [1, 2], 2, 2, 6)],
                "out": [O(T4, 0), RO(T4, 1)],
            },
            {
                "op": "broadcast",
                "key": 9,
                "value": TOSTYPE(T222, -1, 1, 3),
                "out": [O(T222, 2), RO(T222, 4)],
            },
            {"op": "pull", "key": [3, 5, 7, 9], "out": [O(T6, 1), O(T3, 1), O(T4, 1), O(T222, 1)]},
        ],
    },
    {
        "id": "rows_device_differences",
        "store": "device",
        "key_kind": "str",
        "ops": [
            {"op": "create", "type": "device"},
            {"op": "init", "key": "e0", "value": ZEROS(T3, 0)},
            # MXNet's out lists no rows (its value stores none); jaxkv's the ids asked for.
            {
                "op": "row_sparse_pull",
                "key": "e0",
                "out": RO(T3, 1),
                "row_ids": IDS([2, 0], "int64", 1),
                "expect": "X2",
            },
            # Row 1 is stored, as zeros: MXNet's out lists it, jaxkv's does not.
            {"op": "init", "key": "emb", "value": R(T4, [0, 1, 2], -1, 1, 2)},
            {"op": "pull", "key": "emb", "out": RO(T4, 3), "ignore_sparse": False, "expect": "X6"},
            # A dense out: MXNet refuses the call, jaxkv fills it.
            {
                "op": "row_sparse_pull",
                "key": "emb",
                "out": [RO(T4, 4), O(T4, 5)],
                "row_ids": [IDS([3, 0], "int64", 4), IDS([1], "int64", 5)],
                "differs": "X1",
            },
            {"op": "init", "key": "w", "value": TOSTYPE(T23, -2, 1, 6)},
            {
                "op": "push",
                "key": "w",
                "value": [
                    R(T23, [0], 1, 1, 0),
                    R(T23, [0, 1], -1, 2, 3, "float32"),
                    R(T23, [1], 4, 0, 5),
                    R(T23, [0, 1], 0, 1, 7),
                ],
            },
            {
                "op": "row_sparse_pull",
                "key": ["w", "w"],
                "out": [RO(T23, 2), [RO(T23, 6), RO(T23, 0)]],
                "row_ids": [
                    IDS([1, 0, 1], "float32", 2),
                    [IDS([1], "int64", 6), IDS([0, 0], "int64", 0)],
                ],
            },
            # A dense key pushed rows with no updater: MXNet then stores it row-sparse.
            {"op": "init", "key": "x1", "value": V(T3, 2, 1, 4)},
            {"op": "push", "key": "x1", "value": [R(T3, [1], 7, 1, 1), R(T3, [1, 2], 1, 1, 2)]},
            {
                "op": "row_sparse_pull",
                "key": "x1",
                "out": [RO(T3, 1), RO(T3, 2)],
                "row_ids": [IDS([0, 1, 2], "int64", 1)],
            },
            {"op": "pull", "key": ["emb", "w", "x1"], "out": [O(T4, 7), O(T23, 7), O(T3, 7)]},
        ],
    },
    {
        "id": "sgd_lazy_momentum",
        "store": "local",
        "key_kind": "int",
        "ops": [
            {"op": "create", "type": "local"},
            {"op": "init", "key": [3, 5], "value": [ONES(T6, 1, 0), V(T3, 1, 1, 0)]},
            {
                "op": "set_optimizer",
                "name": "SGD",
                "args": {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01},
            },
            {
                "op": "push",
                "key": 3,
                "value": [R(T6, [0, 2, 4], 1, 1, 0), R(T6, [2, 3], -2, 1, 1, "float32")],
            },
            {
                "op": "push",
                "key": 3,
                "value": [R(T6, [2, 5], 3, -1, 0), R(T6, [0, 2, 5], 1, 0, 1)],
            },
            {
                "op": "push",
                "key": 5,
                "value": [V(T3, 1, 0, 0), V(T3, -1, 1, 2), V(T3, 2, -1, 4)],
            },
            {"op": "pull", "key": [3, 5], "out": [O(T6, 3), O(T3, 3)]},
            {
                "op": "row_sparse_pull",
                "key": 3,
                "out": [RO(T6, 1), RO(T6, 2)],
                "row_ids": IDS([5, 1, 5, 0], "int64", 1),
            },
            # A dense gradient for a row-sparse weight, from one device.
            {"op": "push", "key": 3, "value": V(T6, 1, -1, 3)},
            {"op": "push", "key": 5, "value": [V(T3, 0, 1, 0), V(T3, 1, 1, 2), V(T3, 3, 0, 4)]},
            {"op": "pull", "key": [3, 5], "out": [O(T6, 0), O(T3, 6)]},
        ],
    },
    {
        "id": "sgd_standard",
        "store": "device",
        "key_kind": "str",
        "ops": [
            {"op": "create", "type": "device"},
            {"op": "init", "key": "emb", "value": R(T4, [0, 1, 2, 3], 2, 1, 0)},
            {"op": "init", "key": "b", "value": V(T23, 3, 1, 0)},
            {
                "op": "set_optimizer",
                "name": "SGD",
                "args": {
                    "learning_rate": 0.25,
                    "wd": 0.1,
                    "rescale_grad": 0.5,
                    "clip_gradient": 2.5,
                    "lazy_update": False,
                },
            },
            {
                "op": "push",
                "key": "emb",
                "value": [R(T4, [1], 3, 0, 1), R(T4, [1, 3], 2, 3, 2), R(T4, [3], -4, 0, 5)],
            },
            {"op": "push", "key": "b", "value": [R(T23, [1], 1, 1, 3), R(T23, [1], 2, 0, 4)]},
            {
                "op": "pushpull",
                "key": ["emb", "b"],
                "value": [
                    [R(T4, [0], 5, 0, 1), R(T4, [0, 2], 1, 1, 2), R(T4, [2], 1, 0, 5)],
                    [R(T23, [0], -2, 1, 3), R(T23, [0, 1], 1, 0, 4)],
                ],
                "out": [[O(T4, 0), RO(T4, 1)], O(T23, 2)],
            },
            {
                "op": "row_sparse_pull",
                "key": "emb",
                "out": RO(T4, 6),
                "row_ids": IDS([3, 0, 0], "float32", 6),
            },
            {"op": "pull", "key": ["emb", "b"], "out": [O(T4, 7), O(T23, 7)]},
        ],
    },
    {
        "id": "adam_lazy_then_standard",
        "store": "local",
        "key_kind": "str",
        "ops": [
            {"op": "create", "type": "local"},
            {"op": "init", "key": "a", "value": ONES(T3, 0.5, 0)},
            {"op": "init", "key": ["b", "c"], "value": [V(T4, 1, 1, 1), V(T222, -2, 1, 2)]},
            {
                "op": "set_optimizer",
                "name": "Adam",
                "args": {"learning_rate": 0.01, "wd": 0.01},
            },
            {"op": "push", "key": "a", "value": [R(T3, [0, 2], 1, 1, 0), R(T3, [2], -3, 0, 1)]},
            {"op": "push", "key": "a", "value": [R(T3, [1], 2, 0, 0), R(T3, [1, 2], 1, -1, 1)]},
            {
                "op": "push",
                "key": ["b", "c"],
                "value": [[V(T4, 2, -1, 3), V(T4, 1, 0, 4)], [V(T222, 1, 1, 3), V(T222, 0, -1, 4)]],
            },
            {"op": "pull", "key": ["a", "b", "c"], "out": [O(T3, 5), O(T4, 5), O(T222, 5)]},
            {
                "op": "set_optimizer",
                "name": "Adam",
                "args": {
                    "learning_rate": 0.1,
                    "beta1": 0.8,
                    "beta2": 0.99,
                    "rescale_grad": 0.5,
                    "clip_gradient": 1.0,
                    "lazy_update": False,
                },
            },
            {"op": "push", "key": "a", "value": [R(T3, [0], 4, 1, 0), R(T3, [0, 1], -1, 1, 1)]},
            {
                "op": "push",
                "key": ["b", "c"],
                "value": [[V(T4, 0, 1, 3), V(T4, 3, -1, 4)], [V(T222, 2, 0, 3), V(T222, 1, 1, 4)]],
            },
            {
                "op": "row_sparse_pull",
                "key": "a",
                "out": [RO(T3, 6), RO(T3, 7)],
                "row_ids": [IDS([2, 2, 1], "int64", 6), IDS([0, 2], "float32", 7)],
            },
            {"op": "pull", "key": ["a", "b", "c"], "out": [O(T3, 2), O(T4, 2), O(T222, 2)]},
        ],
    },
    {
        "id": "optimizer_groups",
        "store": "local",
        "key_kind": "int",
        "ops": [
            {"op": "create", "type": "local"},
            {"op": "init", "key": [3, 5], "value": [V(T3, 1, 1, 0), V(T23, 2, 0, 0)]},
            {"op": "set_optimizer", "name": "SGD", "args": {"learning_rate": 0.5}},
            {"op": "push", "key": [3, 5], "value": [V(T3, 1, 0, 1), V(T23, -1, 1, 2)]},
            # After a push of [3, 5], a push of 3 alone: MXNet's optimizers update key by key,
            # and so does jaxkv under them (under an optax transformation it would refuse).
            {"op": "push", "key": 3, "value": V(T3, 2, 0, 3)},
            {"op": "pull", "key": 3, "out": O(T3, 4)},
            {"op": "pull", "key": 5, "out": O(T23, 4)},
        ],
    },
]


def main() -> None:
    runner = run_program.Runner(mx)
    outcomes = [runner.run(p) for p in PROGRAMS]
    for p, got in zip(PROGRAMS, outcomes):
        marked = {i for i, op in enumerate(p["ops"]) if op.get("expect") or op.get("differs")}
        refused = [i for i, o in enumerate(got) if o["status"] != "ok" and i not in marked]
        if refused:  # only the marked ops may fail in MXNet
            raise SystemExit(f"{p['id']}: MXNet refused ops {refused}: {[got[i] for i in refused]}")
    record = {
        "generated_by": "conformance/record_rows.py",
        "mxnet_version": mx.__version__,
        "numpy_version": np.__version__,
        "programs": PROGRAMS,
        "outcomes": outcomes,
    }
    with open(OUT, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {len(PROGRAMS)} programs, {sum(len(o) for o in outcomes)} ops")


if __name__ == "__main__":
    main()
