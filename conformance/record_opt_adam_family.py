"""Records Apache MXNet 1.9.1's Adamax, Nadam, FTML and LAMB through a KVStore: the numbers
jaxkv's drop-in must give.

Run with MXNet's own venv (no JAX there; it needs no network):

    .venv-mxnet/bin/python conformance/record_opt_adam_family.py

It writes ``conformance/data/mxnet_opt_adam_family.json``, which
``tests/test_mx_opt_adam_family.py`` replays through ``jaxkv.mx``:

- ``dense``: per configuration (an optimizer, its arguments, maybe ``set_lr_mult`` /
  ``set_wd_mult``, a schedule built from a class name and arguments, LAMB's ``aggregate_num``
  set on the optimizer before ``set_optimizer``), two float32 keys of shapes (6, 3) and (5,)
  trained for 5 steps through a real ``mx.kv.create('local')`` store (``set_optimizer``,
  ``init``, ``push``, ``pull``). Each step pushes each key's gradient as two parts on ``cpu(0)``
  and ``cpu(1)`` (the store sums them), one key at a time or as one list (the configuration's
  ``mode``). Recorded after every step: the pulled weights, the updater's state of each key
  (Adamax's mean and u; Nadam's and LAMB's mean and var; FTML's d, v and z), ``num_update``
  and Nadam's ``m_schedule`` (a float64, its repr).
- ``row_sparse``: a (6, 3) dense weight taking 3 pushes of row-sparse parts from ``cpu(0)`` and
  ``cpu(1)`` (sorted, overlapping row ids): the weight and state after each push, and the rows
  that moved (none of the four has a row-sparse kernel: MXNet densifies the gradient).
- ``multi_precision``: float16 weights under ``multi_precision=True`` (MXNet's float32 master
  copy), 4 updates through ``mx.optimizer.get_updater``: the float16 weights after each.
- ``observations``: what MXNet does, computed here, not assumed: which LAMB kernels the store's
  updater calls (``multi_lamb_update`` through its aggregation, the two phases with
  ``aggregate_num = 1``); MXNet's float32 ``power`` (C's ``powf``) at a few ``(beta, t)``, with
  the correctly rounded value beside it; Nadam's ``m_schedule`` after one push of two keys;
  Adamax with ``clip_gradient=0`` (every weight NaN: 0 / 0).
- ``defaults``: each class's constructor defaults.

Numbers are float32 values written as the shortest decimal that reads back the same float32
(``NaN`` where MXNet gives one).
"""

from __future__ import annotations

import json
import logging
import os

import mxnet as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "mxnet_opt_adam_family.json")
SEED = 20261201
SHAPES = {0: (6, 3), 1: (5,)}
STEPS = 5
SPARSE_SHAPE = (6, 3)
PUSHES = [{0: [0, 2], 1: [2, 3]}, {0: [1, 4], 1: [1, 2]}, {0: [3], 1: [0, 3, 4]}]

log = logging.getLogger("record_opt_adam_family")

FACTOR = {"class": "FactorScheduler", "kwargs": {"step": 2, "factor": 0.5, "base_lr": 0.02}}
FULL = {"wd": 0.01, "rescale_grad": 0.5, "clip_gradient": 0.3}
MULTS = {"lr_mult": {"1": 0.5}, "wd_mult": {"0": 2.0}}

# name, optimizer, keyword arguments, mode, extra (lr_mult, wd_mult, schedule, aggregate_num)
DENSE = [
    ("adamax_default", "adamax", {}, "one", {}),
    (
        "adamax_full",
        "adamax",
        {"learning_rate": 0.01, **FULL, "begin_num_update": 3},
        "list",
        MULTS,
    ),
    ("adamax_betas", "adamax", {"learning_rate": 0.05, "beta1": 0.8, "beta2": 0.99}, "one", {}),
    ("adamax_clip_negative", "adamax", {"learning_rate": 0.01, "clip_gradient": -0.3}, "list", {}),
    ("adamax_schedule", "adamax", {"wd": 0.02}, "one", {"schedule": FACTOR}),
    ("nadam_default", "nadam", {}, "one", {}),
    (
        "nadam_full",
        "nadam",
        {"learning_rate": 0.01, **FULL, "begin_num_update": 2, "schedule_decay": 0.01},
        "list",
        MULTS,
    ),
    (
        "nadam_betas",
        "nadam",
        {"learning_rate": 0.02, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6},
        "one",
        {},
    ),
    ("nadam_schedule", "nadam", {"wd": 0.01, "schedule_decay": 0.0}, "list", {"schedule": FACTOR}),
    ("ftml_default", "ftml", {}, "one", {}),
    ("ftml_full", "ftml", {"learning_rate": 0.02, **FULL, "beta1": 0.7}, "list", MULTS),
    ("ftml_betas", "ftml", {"beta1": 0.9, "beta2": 0.99, "epsilon": 1e-6}, "one", {}),
    # t = 2956..2960: glibc's powf(0.999f, 2958) is not the correctly rounded power
    ("ftml_powf", "ftml", {"begin_num_update": 2955}, "list", {}),
    ("ftml_clip_zero", "ftml", {"clip_gradient": 0.0, "wd": 0.01}, "one", {"schedule": FACTOR}),
    ("lamb_default", "lamb", {}, "one", {}),
    (
        "lamb_full",
        "lamb",
        {"learning_rate": 0.01, **FULL, "upper_bound": 1.5, "begin_num_update": 4},
        "list",
        MULTS,
    ),
    ("lamb_bounds", "lamb", {"learning_rate": 0.02, "lower_bound": 3.0, "wd": 0.1}, "one", {}),
    ("lamb_no_bias", "lamb", {"learning_rate": 0.01, "bias_correction": False}, "list", {}),
    # t = 3604..3608: glibc's powf(0.999f, 3606) is not the correctly rounded power
    ("lamb_powf", "lamb", {"learning_rate": 0.01, "begin_num_update": 3603}, "one", {}),
    ("lamb_schedule", "lamb", {"wd": 0.01, "epsilon": 1e-7}, "list", {"schedule": FACTOR}),
    (
        "lamb_phases",
        "lamb",
        {"learning_rate": 0.01, **FULL, "lower_bound": 0.5, "begin_num_update": 2},
        "one",
        {"aggregate_num": 1, **MULTS},
    ),
    ("lamb_phases_no_bias", "lamb", {"bias_correction": False}, "list", {"aggregate_num": 1}),
]

# name, optimizer, keyword arguments (a dense weight, row-sparse pushes from two devices)
SPARSE = [
    ("adamax_rsp", "adamax", {"learning_rate": 0.01, "wd": 0.01}),
    ("nadam_rsp", "nadam", {"learning_rate": 0.01, "wd": 0.01}),
    ("ftml_rsp", "ftml", {"learning_rate": 0.01, "wd": 0.01}),
    ("lamb_rsp", "lamb", {"learning_rate": 0.01, "wd": 0.01}),
]

MULTI_PRECISION = [
    ("adamax", {"learning_rate": 0.01, "wd": 0.01}),
    ("nadam", {"learning_rate": 0.01, "wd": 0.01}),
    ("ftml", {"learning_rate": 0.01, "wd": 0.01}),
]

POWERS = [(0.999, 2958), (0.999, 3606), (0.9, 5), (0.6, 7), (0.999, 12)]


def f32list(a) -> list | float:
    """A float32 array as nested lists of the shortest decimals that read back the same."""
    a = np.asarray(a, dtype=np.float32)
    if a.ndim == 0:
        return float(str(a[()]))
    return [f32list(x) for x in a]


def _key(k: str) -> int | str:
    return int(k) if k.isdigit() else k


def build(opt_name: str, kwargs: dict, extra: dict):
    kw = dict(kwargs)
    if "schedule" in extra:
        sched = extra["schedule"]
        kw["lr_scheduler"] = getattr(mx.lr_scheduler, sched["class"])(**sched["kwargs"])
    opt = mx.optimizer.create(opt_name, **kw)
    if "lr_mult" in extra:
        opt.set_lr_mult({_key(k): v for k, v in extra["lr_mult"].items()})
    if "wd_mult" in extra:
        opt.set_wd_mult({_key(k): v for k, v in extra["wd_mult"].items()})
    if "aggregate_num" in extra:
        opt.aggregate_num = extra["aggregate_num"]
    return opt


def state_arrays(state) -> list[np.ndarray]:
    """The updater's state of one key as dense arrays (None parts left out)."""
    if state is None:
        return []
    parts = state if isinstance(state, (tuple, list)) else [state]
    return [
        (s if s.stype == "default" else s.tostype("default")).asnumpy()
        for s in parts
        if s is not None
    ]


def record_dense(name, opt_name, kwargs, mode, extra, rng) -> dict:
    weights = {k: rng.uniform(-1, 1, s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [
        {k: [rng.uniform(-1, 1, s).astype(np.float32) for _ in range(2)] for k, s in SHAPES.items()}
        for _ in range(STEPS)
    ]
    kv = mx.kv.create("local")
    opt = build(opt_name, kwargs, extra)
    kv.set_optimizer(opt)
    for k, w in weights.items():
        kv.init(k, mx.nd.array(w, dtype="float32"))
    keys = sorted(SHAPES)
    record = []
    for step in grads:
        parts = {k: [mx.nd.array(x, ctx=mx.cpu(d)) for d, x in enumerate(step[k])] for k in keys}
        outs = {k: mx.nd.zeros(SHAPES[k]) for k in keys}
        if mode == "one":
            for k in keys:
                kv.push(k, parts[k])
                kv.pull(k, out=outs[k])
        else:
            kv.push(keys, [parts[k] for k in keys])
            kv.pull(keys, out=[outs[k] for k in keys])
        entry = {
            "weights": {str(k): f32list(outs[k].asnumpy()) for k in keys},
            "states": {
                str(k): [f32list(s) for s in state_arrays(kv._updater.states[k])] for k in keys
            },
            "num_update": opt.num_update,
        }
        if opt_name == "nadam":
            entry["m_schedule"] = repr(opt.m_schedule)
        record.append(entry)
    return {
        "name": name,
        "optimizer": opt_name,
        "kwargs": kwargs,
        "mode": mode,
        **extra,
        "init": {str(k): f32list(w) for k, w in weights.items()},
        "grads": [{str(k): [f32list(x) for x in step[k]] for k in keys} for step in grads],
        "merged": [{str(k): f32list(step[k][0] + step[k][1]) for k in keys} for step in grads],
        "record": record,
    }


def rsp(data: np.ndarray, rows: list[int], ctx):
    return mx.nd.sparse.row_sparse_array(
        (mx.nd.array(data, ctx=ctx, dtype="float32"), mx.nd.array(rows, ctx=ctx, dtype="int64")),
        shape=SPARSE_SHAPE,
        ctx=ctx,
    )


def record_sparse(name, opt_name, kwargs, rng) -> dict:
    w0 = rng.uniform(-1, 1, SPARSE_SHAPE).astype(np.float32)
    pushes = [
        {d: (ids, rng.uniform(-2, 2, (len(ids), 3)).astype(np.float32)) for d, ids in p.items()}
        for p in PUSHES
    ]
    kv = mx.kv.create("local")
    kv.set_optimizer(mx.optimizer.create(opt_name, **kwargs))
    kv.init(0, mx.nd.array(w0, dtype="float32"))
    trajectory, states, moved = [], [], []
    before = w0
    for push in pushes:
        kv.push(0, [rsp(vals, ids, mx.cpu(d)) for d, (ids, vals) in sorted(push.items())])
        out = mx.nd.zeros(SPARSE_SHAPE)
        kv.pull(0, out=out)
        after = out.asnumpy()
        trajectory.append(f32list(after))
        states.append([f32list(s) for s in state_arrays(kv._updater.states[0])])
        moved.append(
            [r for r in range(SPARSE_SHAPE[0]) if not np.array_equal(after[r], before[r], True)]
        )
        before = after
    return {
        "name": name,
        "optimizer": opt_name,
        "kwargs": kwargs,
        "init": f32list(w0),
        "pushes": [
            [{"ctx": d, "rows": ids, "data": f32list(v)} for d, (ids, v) in sorted(p.items())]
            for p in pushes
        ],
        "trajectory": trajectory,
        "states": states,
        "rows_moved": moved,
        "rows_pushed": [sorted({r for ids in p.values() for r in ids}) for p in PUSHES],
    }


def multi_precision(rng) -> list[dict]:
    """float16 weights with ``multi_precision=True`` (MXNet's float32 master copy), 4 updates
    through ``get_updater`` (what a store runs): the float16 weights after each."""
    out = []
    for opt_name, kwargs in MULTI_PRECISION:
        w0 = rng.uniform(-1, 1, (6, 3)).astype(np.float16)
        grads = [rng.uniform(-2, 2, (6, 3)).astype(np.float16) for _ in range(4)]
        kw = dict(kwargs, multi_precision=True)
        updater = mx.optimizer.get_updater(mx.optimizer.create(opt_name, **kw))
        weight = mx.nd.array(w0, dtype="float16")
        trajectory = []
        for g in grads:
            updater(0, mx.nd.array(g, dtype="float16"), weight)
            trajectory.append(f32list(weight.asnumpy()))
        out.append(
            {
                "optimizer": opt_name,
                "kwargs": kw,
                "init": f32list(w0),
                "grads": [f32list(g) for g in grads],
                "trajectory": trajectory,
            }
        )
    return out


def lamb_kernels(aggregate_num: int | None, mode: str) -> dict:
    """Which LAMB kernels MXNet's store runs for a push: the optimizer module's kernel functions
    wrapped to count their calls while two keys are pushed (one at a time or as a list)."""
    module = mx.optimizer.optimizer
    names = ["multi_lamb_update", "lamb_update_phase1", "lamb_update_phase2"]
    calls = dict.fromkeys(names, 0)
    saved = {n: getattr(module, n) for n in names}

    def counting(n):
        def run(*args, **kwargs):
            calls[n] += 1
            return saved[n](*args, **kwargs)

        return run

    for n in names:
        setattr(module, n, counting(n))
    try:
        opt = mx.optimizer.LAMB(learning_rate=0.01)
        if aggregate_num is not None:
            opt.aggregate_num = aggregate_num
        kv = mx.kv.create("local")
        kv.set_optimizer(opt)
        for k, s in SHAPES.items():
            kv.init(k, mx.nd.ones(s))
        parts = {k: [mx.nd.ones(s, ctx=mx.cpu(d)) for d in range(2)] for k, s in SHAPES.items()}
        if mode == "one":
            for k in SHAPES:
                kv.push(k, parts[k])
        else:
            kv.push(list(SHAPES), [parts[k] for k in SHAPES])
        mx.nd.waitall()
        return {"aggregate_num": opt.aggregate_num, **calls}
    finally:
        for n in names:
            setattr(module, n, saved[n])


def observations(rng) -> dict:
    obs: dict = {}
    obs["lamb_kernels"] = {
        f"{agg or 'default'}_{mode}": lamb_kernels(agg, mode)
        for agg in (None, 1)
        for mode in ("one", "list")
    }
    powers = []
    for beta, t in POWERS:
        b = mx.nd.array([beta], dtype="float32")
        p = mx.nd.power(b, mx.nd.array([t], dtype="float32")).asnumpy()[0]
        exact = np.float32(float(np.float32(beta)) ** t)
        powers.append({"beta": beta, "t": t, "powf": f32list(p), "rounded": f32list(exact)})
    obs["powf"] = powers
    # Nadam's m_schedule is the optimizer's: two keys pushed once multiply it twice.
    opt = mx.optimizer.Nadam()
    kv = mx.kv.create("local")
    kv.set_optimizer(opt)
    for k, s in SHAPES.items():
        kv.init(k, mx.nd.ones(s))
    kv.push(
        list(SHAPES), [[mx.nd.ones(s, ctx=mx.cpu(d)) for d in range(2)] for s in SHAPES.values()]
    )
    mx.nd.waitall()
    momentum_1 = 0.9 * (1.0 - 0.5 * (pow(0.96, 1 * 0.004)))
    obs["nadam_schedule_after_two_keys"] = {
        "m_schedule": repr(opt.m_schedule),
        "momentum_1_squared": repr(momentum_1 * momentum_1),
        "num_update": opt.num_update,
    }
    # Adamax clips whenever clip_gradient is not None: 0 clips every gradient to 0, and
    # m / u is then 0 / 0.
    kv = mx.kv.create("local")
    kv.set_optimizer(mx.optimizer.Adamax(clip_gradient=0.0))
    kv.init(0, mx.nd.array(rng.uniform(-1, 1, (6, 3))))
    kv.push(0, [mx.nd.array(rng.uniform(-1, 1, (6, 3)), ctx=mx.cpu(d)) for d in range(2)])
    out = mx.nd.zeros((6, 3))
    kv.pull(0, out=out)
    obs["adamax_clip_zero_all_nan"] = bool(np.isnan(out.asnumpy()).all())
    return obs


def defaults() -> dict:
    names = [
        "lr", "wd", "rescale_grad", "clip_gradient", "begin_num_update", "multi_precision",
        "beta1", "beta2", "epsilon", "schedule_decay", "m_schedule", "lower_bound",
        "upper_bound", "bias_correction", "aggregate_num",
    ]  # fmt: skip
    out = {}
    for key in ("Adamax", "Nadam", "FTML", "LAMB"):
        opt = getattr(mx.optimizer, key)()
        out[key] = {n: getattr(opt, n) for n in names if hasattr(opt, n)}
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rng = np.random.RandomState(SEED)
    dense = []
    for name, opt_name, kwargs, mode, extra in DENSE:
        log.info("dense %s", name)
        dense.append(record_dense(name, opt_name, kwargs, mode, extra, rng))
    sparse = []
    for name, opt_name, kwargs in SPARSE:
        log.info("row_sparse %s", name)
        sparse.append(record_sparse(name, opt_name, kwargs, rng))
    log.info("multi_precision, observations")
    doc = {
        "generated_by": "conformance/record_opt_adam_family.py",
        "mxnet_version": mx.__version__,
        "numpy_version": np.__version__,
        "seed": SEED,
        "shapes": {str(k): list(s) for k, s in SHAPES.items()},
        "defaults": defaults(),
        "dense": dense,
        "row_sparse": sparse,
        "multi_precision": multi_precision(rng),
        "observations": observations(rng),
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    log.info("wrote %s (%d bytes)", OUT, os.path.getsize(OUT))
    log.info("%s", json.dumps(doc["observations"], indent=1))
    for case in sparse:
        log.info("%s moved %s pushed %s", case["name"], case["rows_moved"], case["rows_pushed"])


if __name__ == "__main__":
    main()
