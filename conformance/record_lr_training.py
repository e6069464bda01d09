"""Records Apache MXNet 1.9.1 training through a KVStore while the learning rate changes: the
numbers jaxkv's drop-in must give under ``mx.lr_scheduler``, ``set_learning_rate``, ``opt.lr``,
per-parameter multipliers and ``begin_num_update``.

Run with MXNet's own venv (no JAX there; it needs no network):

    .venv-mxnet/bin/python conformance/record_lr_training.py

It writes ``conformance/data/mxnet_lr_training.json``, which ``tests/test_mx_lr_training.py``
replays through ``jaxkv.mx``. Each scenario is a small program: an optimizer (its arguments, and
a schedule built from a class name and arguments), keys with shapes, and steps; a step pushes
each key's gradient from two contexts (``cpu(0)``, ``cpu(1)``; the store sums them) and pulls
it, one key at a time (``push(k)``, ``pull(k)``, keys in the step's order) or as one list, and
may first change the learning rate (``set_learning_rate``, or ``opt.lr = ...``). A scenario
may be of float16 weights (``"dtype"``), with MXNet's float32 master copy (``multi_precision``).
Recorded after every step: each pulled weight (float32 as the shortest decimal that reads back
the same), the
optimizer's ``num_update`` and ``learning_rate``; and the exception MXNet raises where it
raises one.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import mxnet as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "mxnet_lr_training.json")
SEED = 20261128
SHAPES = {0: (4, 3), 1: (5,), 2: (2, 2)}


def f32list(a):
    a = np.asarray(a, dtype=np.float32)
    if a.ndim == 0:
        return float(str(a[()]))
    return [f32list(x) for x in a]


def steps(n, keys=(0, 1), mode="one", **extra):
    return [dict({"keys": list(keys), "mode": mode}, **extra) for _ in range(n)]


FACTOR = {"class": "FactorScheduler", "kwargs": {"step": 2, "factor": 0.5, "base_lr": 0.1}}
SCENARIOS = [
    {
        "name": "sgd_factor_one_key",
        "optimizer": "sgd",
        "kwargs": {"momentum": 0.9, "wd": 1e-3},
        "scheduler": FACTOR,
        "steps": steps(7),
    },
    {
        "name": "sgd_factor_list",
        "optimizer": "sgd",
        "kwargs": {"momentum": 0.9, "wd": 1e-3},
        "scheduler": FACTOR,
        "steps": steps(7, mode="list"),
    },
    {
        "name": "sgd_multifactor_warmup",
        "optimizer": "sgd",
        "kwargs": {"momentum": 0.5},
        "scheduler": {
            "class": "MultiFactorScheduler",
            "kwargs": {
                "step": [3, 5],
                "factor": 0.1,
                "base_lr": 0.5,
                "warmup_steps": 2,
                "warmup_begin_lr": 0.05,
            },
        },
        "steps": steps(7),
    },
    {
        "name": "sgd_poly_warmup_list",
        "optimizer": "sgd",
        "kwargs": {"wd": 0.01},
        "scheduler": {
            "class": "PolyScheduler",
            "kwargs": {
                "max_update": 5,
                "base_lr": 0.1,
                "pwr": 2,
                "final_lr": 0.01,
                "warmup_steps": 1,
            },
        },
        "steps": steps(7, mode="list"),
    },
    {
        "name": "sgd_cosine_constant_warmup",
        "optimizer": "sgd",
        "kwargs": {"momentum": 0.9, "rescale_grad": 0.5, "clip_gradient": 0.6},
        "scheduler": {
            "class": "CosineScheduler",
            "kwargs": {
                "max_update": 6,
                "base_lr": 0.1,
                "final_lr": 0.001,
                "warmup_steps": 2,
                "warmup_mode": "constant",
                "warmup_begin_lr": 0.02,
            },
        },
        "steps": steps(7),
    },
    {
        # Adam's own learning_rate (0.001) is not None: it replaces the schedule's base_lr.
        "name": "adam_cosine_default_lr",
        "optimizer": "adam",
        "kwargs": {"wd": 0.01},
        "scheduler": {
            "class": "CosineScheduler",
            "kwargs": {"max_update": 5, "base_lr": 0.1, "final_lr": 0.0},
        },
        "steps": steps(6),
    },
    {
        "name": "adam_factor_lr_none",
        "optimizer": "adam",
        "kwargs": {"learning_rate": None, "beta1": 0.8},
        "scheduler": FACTOR,
        "steps": steps(6, mode="list"),
    },
    {
        "name": "sgd_set_learning_rate",
        "optimizer": "sgd",
        "kwargs": {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3},
        "scheduler": None,
        "steps": steps(2)
        + [dict(steps(1)[0], set_learning_rate=0.01)]
        + steps(1)
        + [dict(steps(1)[0], lr=0.2)]
        + steps(1, mode="list"),
    },
    {
        "name": "adam_set_learning_rate_list",
        "optimizer": "adam",
        "kwargs": {"learning_rate": 0.01},
        "scheduler": None,
        "steps": steps(2, mode="list")
        + [dict(steps(1, mode="list")[0], set_learning_rate=0.1)]
        + steps(2, mode="list"),
    },
    {
        # num_update is the largest count of any key: key 2 joins late and starts from it.
        "name": "sgd_factor_key_joins_late",
        "optimizer": "sgd",
        "kwargs": {"momentum": 0.9},
        "scheduler": FACTOR,
        "steps": steps(3) + steps(4, keys=(2, 0, 1)),
    },
    {
        "name": "sgd_keys_in_other_orders",
        "optimizer": "sgd",
        "kwargs": {"momentum": 0.9, "wd": 0.01},
        "scheduler": {"class": "FactorScheduler", "kwargs": {"step": 1, "factor": 0.7}},
        "steps": steps(2, keys=(1, 0)) + steps(2, keys=(0, 1)) + steps(2, keys=(1, 0)),
    },
    {
        "name": "sgd_multipliers",
        "optimizer": "sgd",
        "kwargs": {
            "learning_rate": 0.1,
            "wd": 0.1,
            "momentum": 0.5,
            "param_idx2name": {0: "fc_weight", 1: "fc_bias", 2: "bn_gamma"},
        },
        "lr_mult": {0: 0.5, "bn_gamma": 3.0},
        "wd_mult": {"fc_weight": 2.0},
        "scheduler": None,
        "steps": steps(4, keys=(0, 1, 2)),
    },
    {
        "name": "adam_multipliers_begin_num_update",
        "optimizer": "adam",
        "kwargs": {"learning_rate": 0.05, "wd": 0.01, "begin_num_update": 3},
        "lr_mult": {1: 0.25},
        "wd_mult": {0: 0.0},
        "scheduler": {"class": "FactorScheduler", "kwargs": {"step": 4, "factor": 0.5}},
        "steps": steps(5, mode="list"),
    },
    {
        # float16 weights with MXNet's float32 master copy: the update runs on the copy.
        "name": "sgd_multi_precision_float16",
        "optimizer": "sgd",
        "kwargs": {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01, "multi_precision": True},
        "dtype": "float16",
        "scheduler": FACTOR,
        "steps": steps(5),
    },
    {
        "name": "sgd_no_momentum_multi_precision_float16_list",
        "optimizer": "sgd",
        "kwargs": {"learning_rate": 0.05, "multi_precision": True, "rescale_grad": 0.5},
        "dtype": "float16",
        "scheduler": None,
        "steps": steps(4, mode="list"),
    },
    {
        "name": "adam_multi_precision_float16",
        "optimizer": "adam",
        "kwargs": {"learning_rate": 0.01, "multi_precision": True},
        "dtype": "float16",
        "scheduler": None,
        "steps": steps(4),
    },
    {
        "name": "test_multi_precision_float16",
        "optimizer": "test",
        "kwargs": {"rescale_grad": 0.3, "multi_precision": True},
        "dtype": "float16",
        "scheduler": None,
        "steps": steps(3, mode="list"),
    },
    {
        "name": "sgd_float16_without_multi_precision",
        "optimizer": "sgd",
        "kwargs": {"learning_rate": 0.1, "momentum": 0.9},
        "dtype": "float16",
        "scheduler": None,
        "steps": steps(3),
    },
]


def build(sc):
    kwargs = dict(sc["kwargs"])
    sched = sc["scheduler"]
    if sched is not None:
        kwargs["lr_scheduler"] = getattr(mx.lr_scheduler, sched["class"])(**sched["kwargs"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = mx.optimizer.create(sc["optimizer"], **kwargs)
    if "lr_mult" in sc:
        opt.set_lr_mult(sc["lr_mult"])
    if "wd_mult" in sc:
        opt.set_wd_mult(sc["wd_mult"])
    return opt


def run(sc, rng):
    keys = sorted({k for st in sc["steps"] for k in st["keys"]})
    dtype = sc.get("dtype", "float32")
    init = {k: rng.uniform(-1, 1, SHAPES[k]).astype(dtype) for k in keys}
    grads = [
        {k: [rng.uniform(-2, 2, SHAPES[k]).astype(dtype) for _ in range(2)] for k in st["keys"]}
        for st in sc["steps"]
    ]
    opt = build(sc)
    kv = mx.kv.create("local")
    kv.set_optimizer(opt)
    for k in keys:
        kv.init(k, mx.nd.array(init[k], dtype=dtype))
    record = []
    for st, g in zip(sc["steps"], grads):
        if "set_learning_rate" in st:
            opt.set_learning_rate(st["set_learning_rate"])
        if "lr" in st:
            opt.lr = st["lr"]
        vals = {
            k: [mx.nd.array(g[k][d], ctx=mx.cpu(d), dtype=dtype) for d in range(2)]
            for k in st["keys"]
        }
        outs = {k: mx.nd.zeros(SHAPES[k], dtype=dtype) for k in st["keys"]}
        if st["mode"] == "one":
            for k in st["keys"]:
                kv.push(k, vals[k])
                kv.pull(k, out=outs[k])
        else:
            kv.push(st["keys"], [vals[k] for k in st["keys"]])
            kv.pull(st["keys"], out=[outs[k] for k in st["keys"]])
        record.append(
            {
                "weights": {str(k): f32list(outs[k].asnumpy()) for k in st["keys"]},
                "num_update": opt.num_update,
                "learning_rate": repr(float(opt.learning_rate)),
            }
        )
    return {
        "init": {str(k): f32list(v) for k, v in init.items()},
        "grads": [{str(k): [f32list(x) for x in v] for k, v in g.items()} for g in grads],
        "record": record,
    }


def refusals():
    sched = mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.1)
    opt = mx.optimizer.SGD(lr_scheduler=sched)
    try:
        opt.set_learning_rate(0.5)
    except Exception as e:  # noqa: BLE001 - recorded
        return {"set_learning_rate_with_scheduler": [type(e).__name__, str(e)]}
    raise SystemExit("MXNet accepted set_learning_rate with a scheduler")


def main():
    rng = np.random.RandomState(SEED)
    out = {"seed": SEED, "shapes": {str(k): v for k, v in SHAPES.items()}, "scenarios": []}
    for sc in SCENARIOS:
        print(sc["name"], file=sys.stderr, flush=True)
        out["scenarios"].append(dict(sc, **run(sc, rng)))
    out["refusals"] = refusals()
    with open(OUT + ".tmp", "w") as f:
        json.dump(out, f, indent=1, default=str)
    os.replace(OUT + ".tmp", OUT)
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
