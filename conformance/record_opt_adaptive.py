"""Records Apache MXNet 1.9.1's AdaGrad, GroupAdaGrad, RMSProp (plain and centered), AdaDelta
and Ftrl through a KVStore: the numbers jaxkv's drop-in must give.

Run with MXNet's own venv (no JAX there; it needs no network):

    .venv-mxnet/bin/python conformance/record_opt_adaptive.py

It writes ``conformance/data/mxnet_opt_adaptive.json``, which ``tests/test_mx_opt_adaptive.py``
replays through ``jaxkv.mx``:

- ``dense``: per configuration (an optimizer, its arguments, maybe ``set_lr_mult`` /
  ``set_wd_mult`` or a schedule built from a class name and arguments), two float32 keys of
  different shapes ((6, 3) and (5,); GroupAdaGrad, which takes 2-D weights only: (6, 3) and
  (4, 5)) trained for 5 steps through a real ``mx.kv.create('local')`` store
  (``set_optimizer``, ``init``, ``push``, ``pull``). Each step pushes each key's gradient as two
  parts on ``cpu(0)`` and ``cpu(1)`` (the store sums them), one key at a time or as one list
  (the configuration's ``mode``). Recorded after every step: the pulled weights, the updater's
  state of each key and ``num_update``.
- ``row_sparse``: a (6, 3) weight stored ``row_sparse`` (every row present) or dense, taking 4
  pushes of row-sparse parts from ``cpu(0)`` and ``cpu(1)`` (each part's ids sorted, the two
  parts' ids overlapping, in no order together; row 5 never pushed): the weight (pulled with
  ``row_sparse_pull`` of every row, or ``pull``) and the state after each push, and the rows
  that moved (MXNet's lazy or densified semantics).
- ``multi_precision``: float16 weights under ``multi_precision=True`` (MXNet's float32 master
  copy), 4 updates through ``mx.optimizer.get_updater``: the float16 weights after each.
- ``observations``: what MXNet does where jaxkv refuses (a row-sparse AdaGrad push with weight
  decay, GroupAdaGrad with weight decay or a 1-D weight, a row-sparse AdaDelta push with a
  negative ``clip_gradient``), computed here, not assumed.
- ``defaults``: each class's constructor defaults (MXNet's attribute names).

Numbers are float32 values written as the shortest decimal that reads back the same float32.
"""

from __future__ import annotations

import json
import logging
import os
import warnings

import mxnet as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "mxnet_opt_adaptive.json")
SEED = 20261130
SHAPES = {0: (6, 3), 1: (5,)}
GROUP_SHAPES = {0: (6, 3), 1: (4, 5)}  # GroupAdaGrad: 2-D weights only
STEPS = 5
SPARSE_SHAPE = (6, 3)
# Per push, per device, sorted ids; overlapping across devices, unsorted together; row 5 never.
PUSHES = [
    {0: [1, 4], 1: [1, 3]},
    {0: [2, 3], 1: [0, 2]},
    {0: [0, 3, 4], 1: [1, 4]},
    {0: [4], 1: [0, 2]},
]

log = logging.getLogger("record_opt_adaptive")

FACTOR = {"class": "FactorScheduler", "kwargs": {"step": 2, "factor": 0.5, "base_lr": 0.2}}

# name, optimizer, keyword arguments, mode, extra (lr_mult, wd_mult, schedule)
DENSE = [
    ("adagrad_default", "adagrad", {}, "one", {}),
    (
        "adagrad_full",
        "adagrad",
        {
            "learning_rate": 0.1,
            "eps": 1e-6,
            "wd": 0.01,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
            "begin_num_update": 2,
        },
        "list",
        {"lr_mult": {"1": 0.5}, "wd_mult": {"0": 2.0}},
    ),
    (
        "adagrad_clip_zero",
        "adagrad",
        {"learning_rate": 0.1, "wd": 0.05, "clip_gradient": 0.0},
        "one",
        {},
    ),
    ("adagrad_schedule", "adagrad", {"wd": 0.01}, "list", {"schedule": FACTOR}),
    ("groupadagrad_default", "groupadagrad", {}, "one", {}),
    (
        "groupadagrad_full",
        "groupadagrad",
        {
            "learning_rate": 0.1,
            "eps": 1e-4,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
            "begin_num_update": 3,
        },
        "list",
        {"lr_mult": {"1": 0.5}},
    ),
    (
        "groupadagrad_wd_mult_zero",
        "groupadagrad",
        {"learning_rate": 0.1, "wd": 0.1},
        "one",
        {"wd_mult": {"0": 0.0, "1": 0.0}, "schedule": FACTOR},
    ),
    ("rmsprop_default", "rmsprop", {}, "one", {}),
    (
        "rmsprop_full",
        "rmsprop",
        {
            "learning_rate": 0.01,
            "gamma1": 0.8,
            "epsilon": 1e-6,
            "wd": 0.01,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
            "clip_weights": 0.5,
        },
        "list",
        {"lr_mult": {"1": 0.5}, "wd_mult": {"0": 2.0}},
    ),
    ("rmsprop_centered", "rmsprop", {"learning_rate": 0.01, "centered": True}, "one", {}),
    (
        "rmsprop_centered_full",
        "rmsprop",
        {
            "learning_rate": 0.01,
            "gamma1": 0.85,
            "gamma2": 0.7,
            "epsilon": 1e-5,
            "centered": True,
            "wd": 0.02,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
            "clip_weights": 0.5,
            "begin_num_update": 4,
        },
        "list",
        {"lr_mult": {"0": 2.0}, "wd_mult": {"1": 3.0}},
    ),
    ("rmsprop_schedule", "rmsprop", {"learning_rate": 0.05}, "one", {"schedule": FACTOR}),
    ("adadelta_default", "adadelta", {}, "one", {}),
    (
        "adadelta_full",
        "adadelta",
        {
            "rho": 0.8,
            "epsilon": 1e-4,
            "wd": 0.01,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
            "begin_num_update": 2,
        },
        "list",
        {"lr_mult": {"0": 3.0}, "wd_mult": {"1": 2.0}},
    ),
    ("adadelta_clip_zero", "adadelta", {"wd": 0.05, "clip_gradient": 0.0}, "one", {}),
    ("adadelta_clip_negative", "adadelta", {"rho": 0.95, "clip_gradient": -0.2}, "list", {}),
    ("ftrl_default", "ftrl", {}, "one", {}),
    (
        "ftrl_full",
        "ftrl",
        {
            "lamda1": 0.05,
            "learning_rate": 0.05,
            "beta": 0.5,
            "wd": 0.01,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
            "begin_num_update": 1,
        },
        "list",
        {"lr_mult": {"1": 0.5}, "wd_mult": {"0": 2.0}},
    ),
    ("ftrl_schedule", "ftrl", {"lamda1": 0.02}, "one", {"schedule": FACTOR}),
]

# name, optimizer, keyword arguments, stored storage types
SPARSE = [
    ("adagrad_rsp", "adagrad", {"learning_rate": 0.1}, ("row_sparse", "default")),
    (
        "adagrad_clip_rsp",
        "adagrad",
        {"learning_rate": 0.1, "rescale_grad": 0.5, "clip_gradient": 0.3, "eps": 1e-5},
        ("row_sparse", "default"),
    ),
    ("groupadagrad_rsp", "groupadagrad", {"learning_rate": 0.1}, ("row_sparse", "default")),
    (
        "groupadagrad_clip_rsp",
        "groupadagrad",
        {"learning_rate": 0.1, "rescale_grad": 0.5, "clip_gradient": 0.3, "eps": 1e-4},
        ("row_sparse", "default"),
    ),
    (
        "ftrl_rsp",
        "ftrl",
        {"lamda1": 0.05, "learning_rate": 0.05, "wd": 0.01, "rescale_grad": 0.5},
        ("row_sparse", "default"),
    ),
    ("ftrl_clip_rsp", "ftrl", {"clip_gradient": 0.3, "beta": 0.5}, ("row_sparse", "default")),
    ("rmsprop_rsp", "rmsprop", {"learning_rate": 0.01, "wd": 0.05}, ("default",)),
    (
        "rmsprop_centered_rsp",
        "rmsprop",
        {"learning_rate": 0.01, "wd": 0.05, "centered": True, "clip_gradient": 0.3},
        ("default",),
    ),
    ("adadelta_rsp", "adadelta", {"wd": 0.05, "clip_gradient": 0.3}, ("default",)),
]


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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a schedule's base_lr replaced, as MXNet warns
        opt = mx.optimizer.create(opt_name, **kw)
    if "lr_mult" in extra:
        opt.set_lr_mult({_key(k): v for k, v in extra["lr_mult"].items()})
    if "wd_mult" in extra:
        opt.set_wd_mult({_key(k): v for k, v in extra["wd_mult"].items()})
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
    shapes = GROUP_SHAPES if opt_name == "groupadagrad" else SHAPES
    weights = {k: rng.uniform(-1, 1, s).astype(np.float32) for k, s in shapes.items()}
    grads = [
        {k: [rng.uniform(-1, 1, s).astype(np.float32) for _ in range(2)] for k, s in shapes.items()}
        for _ in range(STEPS)
    ]
    kv = mx.kv.create("local")
    opt = build(opt_name, kwargs, extra)
    kv.set_optimizer(opt)
    for k, w in weights.items():
        kv.init(k, mx.nd.array(w, dtype="float32"))
    keys = sorted(shapes)
    record = []
    for step in grads:
        parts = {k: [mx.nd.array(x, ctx=mx.cpu(d)) for d, x in enumerate(step[k])] for k in keys}
        outs = {k: mx.nd.zeros(shapes[k]) for k in keys}
        if mode == "one":
            for k in keys:
                kv.push(k, parts[k])
                kv.pull(k, out=outs[k])
        else:
            kv.push(keys, [parts[k] for k in keys])
            kv.pull(keys, out=[outs[k] for k in keys])
        record.append(
            {
                "weights": {str(k): f32list(outs[k].asnumpy()) for k in keys},
                "states": {
                    str(k): [f32list(s) for s in state_arrays(kv._updater.states[k])] for k in keys
                },
                "num_update": opt.num_update,
            }
        )
    return {
        "name": name,
        "optimizer": opt_name,
        "kwargs": kwargs,
        "mode": mode,
        **extra,
        "shapes": {str(k): list(s) for k, s in shapes.items()},
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


def pull_all(kv, stype: str) -> np.ndarray:
    if stype == "row_sparse":
        out = mx.nd.sparse.zeros("row_sparse", SPARSE_SHAPE, dtype="float32")
        kv.row_sparse_pull(0, out=out, row_ids=mx.nd.arange(SPARSE_SHAPE[0], dtype="int64"))
    else:
        out = mx.nd.zeros(SPARSE_SHAPE, dtype="float32")
        kv.pull(0, out=out)
    return out.tostype("default").asnumpy().copy()


def record_sparse(name, opt_name, kwargs, stype, w0, pushes) -> dict:
    kv = mx.kv.create("local")
    opt = mx.optimizer.create(opt_name, **kwargs)
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.array(w0, dtype="float32").tostype(stype))
    trajectory, states, moved = [], [], []
    before = w0
    for push in pushes:
        kv.push(0, [rsp(vals, ids, mx.cpu(d)) for d, (ids, vals) in sorted(push.items())])
        after = pull_all(kv, stype)
        trajectory.append(f32list(after))
        states.append([f32list(s) for s in state_arrays(kv._updater.states[0])])
        moved.append([r for r in range(SPARSE_SHAPE[0]) if not np.array_equal(after[r], before[r])])
        before = after
    return {
        "name": f"{name}_{'rsp' if stype == 'row_sparse' else 'dense'}",
        "optimizer": opt_name,
        "kwargs": kwargs,
        "stored_stype": stype,
        "init": f32list(w0),
        "pushes": [
            [{"ctx": d, "rows": ids, "data": f32list(v)} for d, (ids, v) in sorted(p.items())]
            for p in pushes
        ],
        "trajectory": trajectory,
        "states": states,
        "rows_moved": moved,
        "rows_pushed": [sorted({r for ids, _ in p.values() for r in ids}) for p in pushes],
        "num_update": opt.num_update,
    }


MULTI_PRECISION = [
    ("adagrad", {"learning_rate": 0.1, "wd": 0.01}),
    ("groupadagrad", {"learning_rate": 0.1}),
    ("rmsprop", {"learning_rate": 0.01, "wd": 0.01}),
    ("rmsprop", {"learning_rate": 0.01, "wd": 0.01, "centered": True}),
    ("adadelta", {"wd": 0.01}),
    ("ftrl", {"wd": 0.01}),
]


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


def _error(call) -> str | None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        lines = str(e).splitlines() or [""]
        said = next((x for x in lines if "Check failed" in x), lines[0])  # MXNet's reason
        said = said.strip().removeprefix(f"{type(e).__name__}: ")
        return f"{type(e).__name__}: {said}".strip()
    return None


def _store_push(opt, w0, parts) -> dict:
    """One push through a store: whether the weight moved, and the count MXNet kept."""
    kv = mx.kv.create("local")
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.array(w0))
    kv.push(0, parts)
    out = mx.nd.zeros(w0.shape)
    kv.pull(0, out=out)
    mx.nd.waitall()
    return {
        "store_weight_moved": not np.array_equal(out.asnumpy(), w0),
        "num_update": opt.num_update,
    }


def observations(rng) -> dict:
    obs: dict = {}
    w0 = rng.uniform(-1, 1, SPARSE_SHAPE).astype(np.float32)
    part = lambda: [rsp(rng.uniform(-1, 1, (2, 3)), [1, 3], mx.cpu(0))]  # noqa: E731
    # AdaGrad: a row-sparse gradient with weight decay (its sparse kernel takes none).
    obs["adagrad_row_sparse_wd"] = {
        **_store_push(mx.optimizer.AdaGrad(wd=0.1), w0, part()),
        "updater_raises": _error(
            lambda: mx.optimizer.get_updater(mx.optimizer.AdaGrad(wd=0.1))(
                0, part()[0], mx.nd.array(w0)
            )
        ),
    }
    # GroupAdaGrad with weight decay, dense: MXNet asserts wd == 0.
    dense = [mx.nd.array(rng.uniform(-1, 1, SPARSE_SHAPE), ctx=mx.cpu(d)) for d in range(2)]
    obs["groupadagrad_wd"] = {
        **_store_push(mx.optimizer.create("groupadagrad", wd=0.1), w0, dense),
        "updater_raises": _error(
            lambda: mx.optimizer.get_updater(mx.optimizer.create("groupadagrad", wd=0.1))(
                0, mx.nd.ones(SPARSE_SHAPE), mx.nd.array(w0)
            )
        ),
    }
    # GroupAdaGrad with a 1-D weight: MXNet asserts len(weight.shape) == 2.
    obs["groupadagrad_1d_weight"] = _error(
        lambda: mx.optimizer.get_updater(mx.optimizer.create("groupadagrad"))(
            0, mx.nd.ones(5), mx.nd.ones(5)
        )
    )
    # AdaDelta: a row-sparse gradient with a negative clip_gradient (clip's bounds exclude 0).
    obs["adadelta_row_sparse_negative_clip"] = {
        **_store_push(mx.optimizer.AdaDelta(clip_gradient=-0.2), w0, part()),
        "updater_raises": _error(
            lambda: mx.optimizer.get_updater(mx.optimizer.AdaDelta(clip_gradient=-0.2))(
                0, part()[0], mx.nd.array(w0)
            )
        ),
    }
    return obs


def defaults() -> dict:
    names = [
        "lr", "wd", "rescale_grad", "clip_gradient", "begin_num_update", "multi_precision",
        "float_stable_eps", "gamma1", "gamma2", "epsilon", "centered", "clip_weights", "rho",
        "lamda1", "beta",
    ]  # fmt: skip
    out = {}
    for key, make in (
        ("AdaGrad", mx.optimizer.AdaGrad),
        ("GroupAdaGrad", mx.optimizer.contrib.GroupAdaGrad),
        ("RMSProp", mx.optimizer.RMSProp),
        ("AdaDelta", mx.optimizer.AdaDelta),
        ("Ftrl", mx.optimizer.Ftrl),
    ):
        opt = make()
        out[key] = {n: getattr(opt, n) for n in names if hasattr(opt, n)}
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rng = np.random.RandomState(SEED)
    dense = []
    for name, opt_name, kwargs, mode, extra in DENSE:
        log.info("dense %s", name)
        dense.append(record_dense(name, opt_name, kwargs, mode, extra, rng))
    w0 = rng.uniform(-1, 1, SPARSE_SHAPE).astype(np.float32)
    pushes = [
        {d: (ids, rng.uniform(-2, 2, (len(ids), 3)).astype(np.float32)) for d, ids in p.items()}
        for p in PUSHES
    ]
    sparse = []
    for name, opt_name, kwargs, stypes in SPARSE:
        for stype in stypes:
            log.info("row_sparse %s stored %s", name, stype)
            sparse.append(record_sparse(name, opt_name, kwargs, stype, w0, pushes))
    log.info("multi_precision, observations")
    doc = {
        "generated_by": "conformance/record_opt_adaptive.py",
        "mxnet_version": mx.__version__,
        "numpy_version": np.__version__,
        "seed": SEED,
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
