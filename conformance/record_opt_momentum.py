"""Records Apache MXNet 1.9.1's NAG, Signum, SGLD, DCASGD, LARS and LBSGD through a KVStore: the
numbers jaxkv's drop-in must give.

Run with MXNet's own venv (no JAX there; it needs no network):

    .venv-mxnet/bin/python conformance/record_opt_momentum.py

It writes ``conformance/data/mxnet_opt_momentum.json``, which ``tests/test_mx_opt_momentum.py``
replays through ``jaxkv.mx``:

- ``dense``: per configuration (an optimizer, its arguments, maybe ``set_lr_mult`` /
  ``set_wd_mult``, ``param_idx2name`` or a schedule built from a class name and arguments), two
  float32 keys of shapes (6, 3) and (5,) trained for 5 steps through a real
  ``mx.kv.create('local')`` store (``set_optimizer``, ``init``, ``push``, ``pull``). Each step
  pushes each key's gradient as two parts on ``cpu(0)`` and ``cpu(1)`` (the store sums them),
  one key at a time or as one list (the configuration's ``mode``). Recorded after every step:
  the pulled weights, the updater's state of each key (momentum; DCASGD's previous weight) and
  ``num_update``. SGLD runs with its noise replaced by zeros (MXNet's ``normal`` patched), so
  its deterministic part is recorded to the bit.
- ``row_sparse``: a (6, 3) dense weight taking 3 pushes of row-sparse parts from ``cpu(0)``
  and ``cpu(1)`` (sorted, overlapping row ids): the weight and state after each push, and the
  rows that moved (MXNet's lazy or densified semantics).
- ``multi_precision``: float16 weights under ``multi_precision=True`` (MXNet's float32 master
  copy), 4 updates through ``mx.optimizer.get_updater``: the float16 weights after each.
- ``sgld_noise``: SGLD's real noise, as MXNet draws it (zero gradients on a zero weight of
  4000 elements, 3 steps): its mean and variance per step, and the correlation of two steps'.
- ``observations``: what MXNet does where jaxkv refuses (DCASGD with momentum, LBSGD with
  ``batch_scale=2`` through a store of two devices, Signum's ``wd_lh`` without momentum, LARS
  with row-sparse gradients), computed here, not assumed.
- ``defaults``: each class's constructor defaults.

Numbers are float32 values written as the shortest decimal that reads back the same float32.
"""

from __future__ import annotations

import json
import logging
import os

import mxnet as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "mxnet_opt_momentum.json")
SEED = 20261129
SHAPES = {0: (6, 3), 1: (5,)}
STEPS = 5
SPARSE_SHAPE = (6, 3)
PUSHES = [{0: [0, 2], 1: [2, 3]}, {0: [1, 4], 1: [1, 2]}, {0: [3], 1: [0, 3, 4]}]

log = logging.getLogger("record_opt_momentum")

FACTOR = {"class": "FactorScheduler", "kwargs": {"step": 2, "factor": 0.5, "base_lr": 0.2}}

# name, optimizer, keyword arguments, mode, extra (lr_mult, wd_mult, param_idx2name, schedule)
DENSE = [
    ("nag_default", "nag", {}, "one", {}),
    ("nag_wd", "nag", {"learning_rate": 0.1, "wd": 0.03}, "list", {}),
    ("nag_momentum", "nag", {"learning_rate": 0.05, "momentum": 0.9}, "one", {}),
    (
        "nag_full",
        "nag",
        {
            "learning_rate": 0.1,
            "momentum": 0.9,
            "wd": 0.01,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
            "begin_num_update": 3,
        },
        "list",
        {"lr_mult": {"1": 0.5}, "wd_mult": {"0": 2.0}},
    ),
    ("signum_default", "signum", {}, "one", {}),
    (
        "signum_full",
        "signum",
        {
            "learning_rate": 0.05,
            "momentum": 0.8,
            "wd": 0.01,
            "wd_lh": 0.02,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
        },
        "list",
        {"lr_mult": {"0": 2.0}, "wd_mult": {"1": 3.0}},
    ),
    ("signum_momentum_wd", "signum", {"learning_rate": 0.1, "wd": 0.05}, "one", {}),
    ("signsgd", "signum", {"learning_rate": 0.1, "momentum": 0.0}, "list", {}),
    ("signsgd_wd", "signum", {"learning_rate": 0.1, "momentum": 0.0, "wd": 0.03}, "one", {}),
    ("dcasgd_default", "dcasgd", {}, "one", {}),
    (
        "dcasgd_full",
        "dcasgd",
        {
            "learning_rate": 0.1,
            "wd": 0.01,
            "lamda": 0.1,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
            "begin_num_update": 2,
        },
        "list",
        {"lr_mult": {"1": 0.5}, "wd_mult": {"0": 2.0}},
    ),
    ("dcasgd_clip_zero", "dcasgd", {"learning_rate": 0.1, "clip_gradient": 0.0}, "one", {}),
    ("sgld_default", "sgld", {}, "one", {}),
    (
        "sgld_full",
        "sgld",
        {"learning_rate": 0.1, "wd": 0.01, "rescale_grad": 0.5, "clip_gradient": 0.3},
        "list",
        {"lr_mult": {"0": 2.0}, "wd_mult": {"1": 3.0}},
    ),
    ("lars_default", "lars", {}, "one", {}),
    (
        "lars_momentum",
        "lars",
        {"learning_rate": 0.1, "momentum": 0.9, "eta": 0.01, "wd": 0.01},
        "list",
        {"param_idx2name": {"0": "fc_weight", "1": "fc_bias"}, "lr_mult": {"1": 2.0}},
    ),
    (
        "lars_schedule",
        "lars",
        {
            "momentum": 0.9,
            "eta": 0.02,
            "eps": 1e-3,
            "wd": 0.01,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
        },
        "one",
        {"schedule": FACTOR, "wd_mult": {"1": 2.0}},
    ),
    (
        "lars_no_correction",
        "lars",
        {"momentum": 0.9, "eta": 0.05, "momentum_correction": False, "begin_num_update": 1},
        "list",
        {"schedule": FACTOR},
    ),
    ("lbsgd_default", "lbsgd", {}, "one", {}),
    ("lbsgd_wd", "lbsgd", {"learning_rate": 0.1, "wd": 0.03}, "list", {}),
    (
        "lbsgd_momentum",
        "lbsgd",
        {
            "learning_rate": 0.1,
            "momentum": 0.9,
            "wd": 0.01,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
            "begin_num_update": 2,
        },
        "one",
        {"lr_mult": {"1": 0.5}, "wd_mult": {"0": 2.0}},
    ),
    ("lbsgd_schedule", "lbsgd", {"momentum": 0.5}, "list", {"schedule": FACTOR}),
    (
        "lbsgd_lars",
        "lbsgd",
        {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01, "warmup_strategy": "lars"},
        "one",
        {},
    ),
]

# name, optimizer, keyword arguments (a dense weight, row-sparse pushes from two devices)
SPARSE = [
    ("nag_rsp", "nag", {"learning_rate": 0.1, "wd": 0.1}),
    ("nag_momentum_rsp", "nag", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01}),
    ("signum_rsp", "signum", {"learning_rate": 0.1, "wd": 0.01}),
    ("signsgd_rsp", "signum", {"learning_rate": 0.1, "momentum": 0.0, "wd": 0.01}),
    ("dcasgd_rsp", "dcasgd", {"learning_rate": 0.1, "wd": 0.01, "lamda": 0.5}),
    ("sgld_rsp", "sgld", {"learning_rate": 0.1, "wd": 0.01}),
    ("lbsgd_rsp", "lbsgd", {"learning_rate": 0.1, "wd": 0.1}),
    ("lbsgd_momentum_rsp", "lbsgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01}),
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
    if "param_idx2name" in extra:
        kw["param_idx2name"] = {_key(k): v for k, v in extra["param_idx2name"].items()}
    if "schedule" in extra:
        sched = extra["schedule"]
        kw["lr_scheduler"] = getattr(mx.lr_scheduler, sched["class"])(**sched["kwargs"])
    opt = mx.optimizer.create(opt_name, **kw)
    if "lr_mult" in extra:
        opt.set_lr_mult({_key(k): v for k, v in extra["lr_mult"].items()})
    if "wd_mult" in extra:
        opt.set_wd_mult({_key(k): v for k, v in extra["wd_mult"].items()})
    return opt


class ZeroNoise:
    """MXNet's ``normal`` in its optimizer module replaced by zeros while in use."""

    def __enter__(self):
        self.saved = mx.optimizer.optimizer.normal

        def zeros(loc=0, scale=1, shape=None, dtype=None, ctx=None, **_):
            return mx.nd.zeros(shape, ctx=ctx, dtype=dtype)

        mx.optimizer.optimizer.normal = zeros
        return self

    def __exit__(self, *exc):
        mx.optimizer.optimizer.normal = self.saved


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
        moved.append([r for r in range(SPARSE_SHAPE[0]) if not np.array_equal(after[r], before[r])])
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


def sgld_noise() -> dict:
    """MXNet's SGLD noise: zero gradients on a zero weight, so each step adds only noise."""
    mx.random.seed(7)
    lr, n = 0.04, 4000
    kv = mx.kv.create("local")
    kv.set_optimizer(mx.optimizer.SGLD(learning_rate=lr))
    kv.init(0, mx.nd.zeros((n,)))
    before = np.zeros(n, np.float32)
    steps = []
    for _ in range(3):
        kv.push(0, [mx.nd.zeros((n,), ctx=mx.cpu(d)) for d in range(2)])
        out = mx.nd.zeros((n,))
        kv.pull(0, out=out)
        after = out.asnumpy()
        steps.append((after - before).astype(np.float64))
        before = after
    return {
        "learning_rate": lr,
        "size": n,
        "mean": [float(s.mean()) for s in steps],
        "var": [float(s.var()) for s in steps],
        # Nine digits: the last bits of a correlation over this many elements differ between
        # CPUs (NumPy's vector paths), and the replay only bounds it.
        "corr_first_two": float(f"{np.corrcoef(steps[0], steps[1])[0, 1]:.9g}"),
    }


MULTI_PRECISION = [
    ("nag", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01}),
    ("nag", {"learning_rate": 0.1, "wd": 0.01}),
    ("signum", {"learning_rate": 0.01, "wd": 0.01, "wd_lh": 0.01}),
    ("dcasgd", {"learning_rate": 0.1, "wd": 0.01}),
    ("lbsgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01}),
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


def observations(rng) -> dict:
    obs: dict = {}
    # DCASGD with momentum: MXNet's update raises ('if mom:'); the store swallows it.
    w0 = rng.uniform(-1, 1, (6, 3)).astype(np.float32)
    kv = mx.kv.create("local")
    kv.set_optimizer(mx.optimizer.DCASGD(learning_rate=0.1, momentum=0.9))
    kv.init(0, mx.nd.array(w0))
    kv.push(0, [mx.nd.array(rng.uniform(-1, 1, (6, 3)), ctx=mx.cpu(d)) for d in range(2)])
    out = mx.nd.zeros((6, 3))
    kv.pull(0, out=out)
    updater = mx.optimizer.get_updater(mx.optimizer.DCASGD(learning_rate=0.1, momentum=0.9))
    try:
        updater(0, mx.nd.ones((6, 3)), mx.nd.array(w0))
        raised = None
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        raised = f"{type(e).__name__}: {e}"
    obs["dcasgd_momentum"] = {
        "store_weight_moved": not np.array_equal(out.asnumpy(), w0),
        "updater_raises": raised,
    }
    # LBSGD batch_scale=2: the first large batch through one device and through two.
    g1, g2 = np.float32([1, 2, 3]), np.float32([10, 20, 30])
    got = {}
    for ndev in (1, 2):
        kv = mx.kv.create("local")
        kv.set_optimizer(mx.optimizer.LBSGD(learning_rate=0.1, batch_scale=2, warmup_epochs=0))
        kv.init(0, mx.nd.ones(3))
        for g in (g1, g2):
            if ndev == 1:
                kv.push(0, mx.nd.array(g))
            else:
                kv.push(0, [mx.nd.array(g / 2, ctx=mx.cpu(d)) for d in range(2)])
        out = mx.nd.zeros(3)
        kv.pull(0, out=out)
        got[ndev] = out.asnumpy()
    mean = (g1 + g2) / 2  # the documented cumulated gradient over batch_scale
    doubled = (g2 + g2) / 2  # the merge buffer counted twice
    lr = np.float32(0.1) * np.float32(2)  # the warm-up multiplier is batch_scale
    obs["lbsgd_batch_scale_2"] = {
        "one_device_is_mean": bool(np.allclose(got[1], 1 - lr * mean)),
        "two_devices_is_mean": bool(np.allclose(got[2], 1 - lr * mean)),
        "two_devices_counts_second_twice": bool(np.allclose(got[2], 1 - lr * doubled)),
    }
    # Signum without momentum refuses wd_lh.
    try:
        mx.optimizer.get_updater(mx.optimizer.Signum(momentum=0.0, wd_lh=0.1))(
            0, mx.nd.ones(2), mx.nd.ones(2)
        )
        obs["signsgd_wd_lh"] = None
    except Exception as e:  # noqa: BLE001
        obs["signsgd_wd_lh"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    # LARS with row-sparse gradients: the lazy rows only, scaled by the whole weight's norm.
    kv = mx.kv.create("local")
    kv.set_optimizer(mx.optimizer.LARS(learning_rate=0.1, momentum=0.9, wd=0.1))
    w0 = rng.uniform(-1, 1, SPARSE_SHAPE).astype(np.float32)
    kv.init(0, mx.nd.array(w0))
    kv.push(0, [rsp(rng.uniform(-2, 2, (2, 3)), [1, 3], mx.cpu(0))])
    out = mx.nd.zeros(SPARSE_SHAPE)
    kv.pull(0, out=out)
    obs["lars_row_sparse_rows_moved"] = [
        r for r in range(SPARSE_SHAPE[0]) if not np.array_equal(out.asnumpy()[r], w0[r])
    ]
    return obs


def defaults() -> dict:
    names = [
        "lr", "wd", "rescale_grad", "clip_gradient", "begin_num_update", "multi_precision",
        "momentum", "wd_lh", "lamda", "eta", "eps", "momentum_correction", "lazy_update",
        "warmup_strategy", "warmup_epochs", "batch_scale", "updates_per_epoch", "init_updates",
        "num_epochs",
    ]  # fmt: skip
    out = {}
    for key in ("NAG", "Signum", "SGLD", "DCASGD", "LARS", "LBSGD"):
        opt = getattr(mx.optimizer, key)()
        out[key] = {n: getattr(opt, n) for n in names if hasattr(opt, n)}
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rng = np.random.RandomState(SEED)
    dense = []
    for name, opt_name, kwargs, mode, extra in DENSE:
        log.info("dense %s", name)
        if opt_name == "sgld":
            with ZeroNoise():
                dense.append(record_dense(name, opt_name, kwargs, mode, extra, rng))
        else:
            dense.append(record_dense(name, opt_name, kwargs, mode, extra, rng))
    sparse = []
    for name, opt_name, kwargs in SPARSE:
        log.info("row_sparse %s", name)
        if opt_name == "sgld":
            with ZeroNoise():
                sparse.append(record_sparse(name, opt_name, kwargs, rng))
        else:
            sparse.append(record_sparse(name, opt_name, kwargs, rng))
    log.info("sgld noise, observations")
    doc = {
        "generated_by": "conformance/record_opt_momentum.py",
        "mxnet_version": mx.__version__,
        "numpy_version": np.__version__,
        "seed": SEED,
        "shapes": {str(k): list(s) for k, s in SHAPES.items()},
        "defaults": defaults(),
        "dense": dense,
        "row_sparse": sparse,
        "multi_precision": multi_precision(rng),
        "sgld_noise": sgld_noise(),
        "observations": observations(rng),
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    log.info("wrote %s (%d bytes)", OUT, os.path.getsize(OUT))
    log.info("%s", json.dumps(doc["observations"], indent=1))
    log.info("%s", json.dumps(doc["sgld_noise"]))
    for case in sparse:
        log.info("%s moved %s pushed %s", case["name"], case["rows_moved"], case["rows_pushed"])


if __name__ == "__main__":
    main()
