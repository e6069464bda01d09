"""Records Apache MXNet 1.9.1's ``mx.optimizer.SGD`` and ``Adam``: the numbers jaxkv must give.

Run with MXNet's own venv (no JAX there; it needs no network):

    "$(bash conformance/setup_mxnet.sh)" conformance/record_optimizers.py
    # or: .venv-mxnet/bin/python conformance/record_optimizers.py

It writes conformance/data/mxnet_optimizers.json, which tests/test_mx_optimizer.py reads:

- ``dense``: for each optimizer configuration, two float32 weights (indices 0 and 1, shapes
  (6, 3) and (5,)) updated for a few steps with fixed gradients, through
  ``mx.optimizer.get_updater(opt)`` (what ``kv.set_optimizer`` installs) and through a real
  ``mx.kv.create('local')`` store (``set_optimizer``, ``init``, ``push``, ``pull``). The script
  fails unless both give the same bits. The updater's state (SGD's momentum, Adam's mean and
  var) is recorded after every step too.
- ``row_sparse``: a (6, 3) weight stored as ``row_sparse`` (every row present) or dense, pushed
  row-sparse gradients from two devices (``cpu(0)``, ``cpu(1)``) whose row ids are unsorted
  and overlap (the store sums them), with ``lazy_update`` True and False. The store's result is
  checked bit for bit against the updater run on the summed gradient, and the weights and
  the updater's states are recorded after every push.
- ``observations`` and ``notes``: what the recordings show about lazy and standard updates,
  computed from them, not assumed.
- ``defaults``, ``registry``, ``unknown_name``: constructor defaults, the names MXNet's
  optimizer registry holds, and what ``mx.optimizer.create`` says about an unknown name.

Numbers in the JSON are float32 values written as the shortest decimal that reads back to the
same float32 (read them with ``np.float32``).
"""

from __future__ import annotations

import json
import os
import sys

import mxnet as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "mxnet_optimizers.json")
SEED = 20240917
SHAPES = {0: (6, 3), 1: (5,)}
DENSE_STEPS = 5
SPARSE_SHAPE = (6, 3)

# name, optimizer, keyword arguments. Gradients are uniform(-2, 2): clip_gradient 0.3 with
# rescale_grad 0.5 clips some elements and not others.
DENSE = [
    ("sgd_default", "sgd", {}),
    ("sgd_plain", "sgd", {"learning_rate": 0.1}),
    ("sgd_wd", "sgd", {"learning_rate": 0.1, "wd": 0.03}),
    ("sgd_momentum", "sgd", {"learning_rate": 0.05, "momentum": 0.9}),
    (
        "sgd_full",
        "sgd",
        {
            "learning_rate": 0.1,
            "momentum": 0.9,
            "wd": 0.01,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
        },
    ),
    (
        "sgd_clip_no_momentum",
        "sgd",
        {"learning_rate": 0.2, "wd": 0.07, "rescale_grad": 0.5, "clip_gradient": 0.3},
    ),
    ("adam_default", "adam", {}),
    ("adam_lr", "adam", {"learning_rate": 0.1}),
    (
        "adam_full",
        "adam",
        {
            "learning_rate": 0.01,
            "beta1": 0.8,
            "beta2": 0.99,
            "epsilon": 1e-6,
            "wd": 0.01,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
        },
    ),
    ("adam_wd", "adam", {"learning_rate": 0.05, "wd": 0.1, "rescale_grad": 0.25}),
    ("adam_begin_num_update", "adam", {"learning_rate": 0.01, "begin_num_update": 3}),
]

# Row-sparse: per push, per device, the row ids (sorted, as MXNet needs: see row_id_probe;
# overlapping across devices; row 5 never touched).
PUSHES = [
    {0: [1, 4], 1: [1, 3]},
    {0: [0, 2], 1: [0]},
    {0: [1, 3, 4], 1: [2, 4]},
    {0: [0], 1: [3]},
]
SPARSE = [
    ("sgd_wd", "sgd", {"learning_rate": 0.1, "wd": 0.05}),
    (
        "sgd_clip",
        "sgd",
        {"learning_rate": 0.1, "wd": 0.05, "rescale_grad": 0.5, "clip_gradient": 0.3},
    ),
    ("sgd_momentum", "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.05}),
    (
        "sgd_momentum_clip",
        "sgd",
        {
            "learning_rate": 0.1,
            "momentum": 0.8,
            "wd": 0.02,
            "rescale_grad": 0.5,
            "clip_gradient": 0.3,
        },
    ),
    ("adam", "adam", {"learning_rate": 0.01}),
    ("adam_wd", "adam", {"learning_rate": 0.01, "wd": 0.1}),
    (
        "adam_clip",
        "adam",
        {"learning_rate": 0.02, "wd": 0.05, "rescale_grad": 0.5, "clip_gradient": 0.3},
    ),
]


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def f32list(a: np.ndarray) -> list:
    """A float32 array as nested lists of the shortest decimals that read back the same."""
    a = np.asarray(a, dtype=np.float32)
    if a.ndim == 0:
        return float(str(a[()]))
    return [f32list(x) for x in a]


def dense_inputs(rng: np.random.RandomState):
    weights = {i: rng.uniform(-1, 1, shape).astype(np.float32) for i, shape in SHAPES.items()}
    grads = {
        i: [rng.uniform(-2, 2, shape).astype(np.float32) for _ in range(DENSE_STEPS)]
        for i, shape in SHAPES.items()
    }
    return weights, grads


def state_arrays(state) -> list[np.ndarray]:
    """The updater's state of one weight, as dense arrays (None: no state)."""
    if state is None:
        return []
    if isinstance(state, (tuple, list)):
        return [s.tostype("default").asnumpy() for s in state]
    return [state.tostype("default").asnumpy()]


def record_dense(name: str, opt_name: str, kwargs: dict, rng: np.random.RandomState) -> dict:
    weights, grads = dense_inputs(rng)
    # Through the updater kv.set_optimizer installs.
    updater = mx.optimizer.get_updater(mx.optimizer.create(opt_name, **kwargs))
    nd_w = {i: mx.nd.array(w, dtype="float32") for i, w in weights.items()}
    traj: dict[int, list] = {i: [] for i in SHAPES}
    states: dict[int, list] = {i: [] for i in SHAPES}
    for step in range(DENSE_STEPS):
        for i in SHAPES:
            updater(i, mx.nd.array(grads[i][step], dtype="float32"), nd_w[i])
            traj[i].append(nd_w[i].asnumpy().copy())
            states[i].append(state_arrays(updater.states[i]))
    # Through a real local store.
    kv = mx.kv.create("local")
    kv.set_optimizer(mx.optimizer.create(opt_name, **kwargs))
    for i in SHAPES:
        kv.init(i, mx.nd.array(weights[i], dtype="float32"))
    for step in range(DENSE_STEPS):
        for i in SHAPES:
            kv.push(i, mx.nd.array(grads[i][step], dtype="float32"))
            out = mx.nd.zeros(SHAPES[i], dtype="float32")
            kv.pull(i, out=out)
            got = out.asnumpy()
            if not np.array_equal(got, traj[i][step]):
                raise SystemExit(f"{name}: kvstore and updater disagree at step {step}, key {i}")
    return {
        "name": name,
        "optimizer": opt_name,
        "kwargs": kwargs,
        "kvstore_agrees": True,
        "weights": {
            str(i): {
                "init": f32list(weights[i]),
                "grads": [f32list(g) for g in grads[i]],
                "trajectory": [f32list(w) for w in traj[i]],
                "states": [[f32list(s) for s in st] for st in states[i]],
            }
            for i in SHAPES
        },
    }


def rsp(data: np.ndarray, rows: list[int], ctx: mx.Context):
    return mx.nd.sparse.row_sparse_array(
        (mx.nd.array(data, ctx=ctx, dtype="float32"), mx.nd.array(rows, ctx=ctx, dtype="int64")),
        shape=SPARSE_SHAPE,
        ctx=ctx,
    )


def merged(push: dict[int, tuple[list[int], np.ndarray]]) -> tuple[list[int], np.ndarray]:
    """The sum of one push's parts: sorted distinct rows, duplicates added in device order."""
    rows = sorted({r for ids, _ in push.values() for r in ids})
    data = np.zeros((len(rows), SPARSE_SHAPE[1]), np.float32)
    for dev in sorted(push):
        ids, vals = push[dev]
        for r, v in zip(ids, vals):
            data[rows.index(r)] += v
    return rows, data


def record_sparse(
    name: str, opt_name: str, kwargs: dict, lazy: bool, stype: str, w0: np.ndarray, pushes: list
) -> dict:
    kw = dict(kwargs, lazy_update=lazy)
    case = {
        "name": f"{name}_{'lazy' if lazy else 'std'}_{'rsp' if stype == 'row_sparse' else 'dense'}",
        "optimizer": opt_name,
        "kwargs": kw,
        "stored_stype": stype,
    }
    # Through the store.
    try:
        kv = mx.kv.create("local")
        kv.set_optimizer(mx.optimizer.create(opt_name, **kw))
        kv.init(0, mx.nd.array(w0, dtype="float32").tostype(stype))
        kv_traj = []
        for push in pushes:
            parts = [rsp(vals, ids, mx.cpu(dev)) for dev, (ids, vals) in sorted(push.items())]
            kv.push(0, parts)
            if stype == "row_sparse":
                out = mx.nd.sparse.zeros("row_sparse", SPARSE_SHAPE, dtype="float32")
                all_rows = mx.nd.arange(SPARSE_SHAPE[0], dtype="int64")
                kv.row_sparse_pull(0, out=out, row_ids=all_rows)
            else:
                out = mx.nd.zeros(SPARSE_SHAPE, dtype="float32")
                kv.pull(0, out=out)
            kv_traj.append(out.tostype("default").asnumpy().copy())
        mx.nd.waitall()
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        case.update(accepted=False, error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
        return case
    # Through the updater, with the summed gradient.
    updater = mx.optimizer.get_updater(mx.optimizer.create(opt_name, **kw))
    weight = mx.nd.array(w0, dtype="float32").tostype(stype)
    traj, states, merged_grads = [], [], []
    for push in pushes:
        rows, data = merged(push)
        merged_grads.append({"rows": rows, "data": f32list(data)})
        updater(0, rsp(data, rows, mx.cpu(0)), weight)
        traj.append(weight.tostype("default").asnumpy().copy())
        states.append(state_arrays(updater.states[0]))
    for step, (a, b) in enumerate(zip(kv_traj, traj)):
        if not np.array_equal(a, b):
            raise SystemExit(f"{case['name']}: store and updater disagree at push {step}")
    state_stypes = sorted(
        {
            s.stype
            for s in (
                updater.states[0] if isinstance(updater.states[0], tuple) else [updater.states[0]]
            )
            if s is not None
        }
    )
    case.update(
        accepted=True,
        updater_agrees=True,
        state_stypes=state_stypes,
        init=f32list(w0),
        pushes=[
            [
                {"ctx": dev, "rows": ids, "data": f32list(vals)}
                for dev, (ids, vals) in sorted(push.items())
            ]
            for push in pushes
        ],
        merged=merged_grads,
        trajectory=[f32list(w) for w in traj],
        states=[[f32list(s) for s in st] for st in states],
    )
    return case


def sparse_inputs(rng: np.random.RandomState):
    w0 = rng.uniform(-1, 1, SPARSE_SHAPE).astype(np.float32)
    pushes = []
    for spec in PUSHES:
        pushes.append(
            {
                dev: (ids, rng.uniform(-2, 2, (len(ids), SPARSE_SHAPE[1])).astype(np.float32))
                for dev, ids in spec.items()
            }
        )
    return w0, pushes


def row_id_probe(rng: np.random.RandomState) -> dict:
    """Row ids MXNet's row-sparse arrays expect sorted and distinct: what if they are not?

    Per case, whether one push to a store with SGD (lr 0.5, momentum 0.5, wd 0.1) gives
    ``w - 0.5 * (0.1 * w + g)`` with ``g`` the row sums of the pushed rows, on the rows pushed
    (lazy_update True) or on every row (False).
    """
    cases = {
        "one_device_unsorted": {0: [4, 1, 3]},
        "one_device_duplicate": {0: [1, 4, 4]},
        "two_devices_unsorted": {0: [4, 1], 1: [1, 3]},
        "two_devices_sorted": {0: [1, 4], 1: [1, 3]},
    }
    out = {}
    w0 = rng.uniform(-1, 1, SPARSE_SHAPE).astype(np.float32)
    for label, spec in cases.items():
        push = {
            dev: (ids, rng.uniform(-2, 2, (len(ids), SPARSE_SHAPE[1])).astype(np.float32))
            for dev, ids in spec.items()
        }
        g = np.zeros(SPARSE_SHAPE, np.float64)
        for ids, vals in push.values():
            for r, v in zip(ids, vals):
                g[r] += v
        w64 = w0.astype(np.float64)
        rows = sorted({r for ids, _ in push.values() for r in ids})
        res: dict[str, object] = {}
        for lazy in (True, False):
            want = w64 - 0.5 * (0.1 * w64 + g)
            if lazy:
                keep = [r for r in range(SPARSE_SHAPE[0]) if r not in rows]
                want[keep] = w64[keep]
            kv = mx.kv.create("local")
            opt = mx.optimizer.SGD(learning_rate=0.5, momentum=0.5, wd=0.1, lazy_update=lazy)
            kv.set_optimizer(opt)
            kv.init(0, mx.nd.array(w0, dtype="float32"))
            try:
                parts = [rsp(vals, ids, mx.cpu(dev)) for dev, (ids, vals) in sorted(push.items())]
                kv.push(0, parts if len(parts) > 1 else parts[0])
                got = mx.nd.zeros(SPARSE_SHAPE, dtype="float32")
                kv.pull(0, out=got)
                res["lazy" if lazy else "std"] = bool(np.allclose(got.asnumpy(), want, atol=1e-5))
            except Exception as e:  # noqa: BLE001
                res["lazy" if lazy else "std"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        out[label] = {"rows": {str(d): ids for d, ids in spec.items()}, "matches_row_sum": res}
    return out


def defaults() -> dict:
    names = [
        "lr", "learning_rate", "wd", "rescale_grad", "clip_gradient", "lr_scheduler",
        "begin_num_update", "num_update", "multi_precision", "idx2name", "param_dict",
        "lr_mult", "wd_mult", "momentum", "lazy_update", "beta1", "beta2", "epsilon",
    ]  # fmt: skip
    out = {}
    for key, cls in (("sgd", mx.optimizer.SGD), ("adam", mx.optimizer.Adam)):
        opt = cls()
        out[key] = {n: getattr(opt, n) for n in names if hasattr(opt, n)}
    return out


def observations(sparse: list[dict]) -> dict:
    """What the row-sparse recordings show, per case: untouched rows kept or changed."""
    obs = {}
    for case in sparse:
        if not case["accepted"]:
            continue
        w = np.array(case["init"], np.float32)
        touched_any = set()
        kept, changed = True, False
        for merged_grad, after in zip(case["merged"], case["trajectory"]):
            after = np.array(after, np.float32)
            untouched = [r for r in range(SPARSE_SHAPE[0]) if r not in merged_grad["rows"]]
            same = np.array_equal(after[untouched], w[untouched])
            kept &= bool(same)
            changed |= not same
            touched_any |= set(merged_grad["rows"])
            w = after
        obs[case["name"]] = {
            "untouched_rows_kept": kept,
            "untouched_rows_changed": changed,
            "rows_never_touched": sorted(set(range(SPARSE_SHAPE[0])) - touched_any),
            "state_stypes": case["state_stypes"],
        }
    return obs


def main() -> None:
    rng = np.random.RandomState(SEED)
    dense = []
    for name, opt_name, kwargs in DENSE:
        log(f"dense {name}")
        dense.append(record_dense(name, opt_name, kwargs, rng))
    w0, pushes = sparse_inputs(rng)
    sparse = []
    for name, opt_name, kwargs in SPARSE:
        for lazy in (True, False):
            for stype in ("row_sparse", "default"):
                log(f"row_sparse {name} lazy={lazy} stored={stype}")
                sparse.append(record_sparse(name, opt_name, kwargs, lazy, stype, w0, pushes))
    log("probes")
    probe = row_id_probe(rng)
    try:
        mx.optimizer.create("bogus_optimizer")
        unknown = {"name": "bogus_optimizer", "error": None}
    except Exception as e:  # noqa: BLE001
        unknown = {"name": "bogus_optimizer", "error": f"{type(e).__name__}: {e}"}
    obs = observations(sparse)
    lazy_kept = all(o["untouched_rows_kept"] for n, o in obs.items() if "_lazy_" in n)
    std_changed = sorted(n for n, o in obs.items() if "_std_" in n and o["untouched_rows_changed"])
    std_kept = sorted(n for n, o in obs.items() if "_std_" in n and o["untouched_rows_kept"])
    refused = sorted(c["name"] for c in sparse if not c["accepted"])
    by_name = {c["name"]: c for c in sparse}
    stored_dense_same = all(
        c["trajectory"] == by_name[n[: -len("dense")] + "rsp"]["trajectory"]
        for n, c in by_name.items()
        if n.endswith("_dense") and c["accepted"]
    )
    notes = [
        "Dense SGD goes through the updater's aggregated path (multi_sgd_update / "
        "multi_sgd_mom_update, MXNET_OPTIMIZER_AGGREGATION_SIZE default 4) also for one key.",
        "kvstore 'local' (set_optimizer, init, push, pull) gave the same bits as "
        "mx.optimizer.get_updater(opt) for every dense case.",
        f"lazy_update=True with row-sparse gradients: rows not in the summed gradient kept "
        f"their weight (wd is applied only to touched rows) in every lazy case: {lazy_kept}.",
        f"lazy_update=False (standard update): untouched rows changed in {std_changed}; "
        f"kept in {std_kept or 'none'}.",
        "Row-sparse pushes from 2 devices with overlapping (sorted) row ids: the store sums "
        "them; the result equals the updater run on the summed gradient (sorted distinct rows).",
        "MXNet's row-sparse arrays need sorted, distinct row ids: row_id_probe shows which "
        "pushes of unsorted or duplicate ids still give the row sums (false: MXNet loses or "
        "misplaces rows; jaxkv sums them).",
        "A dense stored weight accepts row-sparse pushes: "
        + ("yes" if not refused else f"refused in {refused}")
        + f"; the same numbers as a row_sparse stored weight: {stored_dense_same}.",
        "Adam's step count t is per key: MXNet's Python keeps it per index "
        "(Optimizer._index_update_count) and adds one at every update of that index, whatever "
        "rows a row-sparse gradient touches (Adam.update).",
    ]
    doc = {
        "generated_by": "conformance/record_optimizers.py",
        "mxnet_version": mx.__version__,
        "numpy_version": np.__version__,
        "seed": SEED,
        "defaults": defaults(),
        "registry": sorted(mx.optimizer.Optimizer.opt_registry),
        "unknown_name": unknown,
        "dense": dense,
        "row_sparse": sparse,
        "row_id_probe": probe,
        "observations": obs,
        "notes": notes,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    log(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")
    for n in notes:
        log("-", n)
    log("row ids:", json.dumps(probe))


if __name__ == "__main__":
    main()
