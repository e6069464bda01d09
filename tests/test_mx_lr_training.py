"""Training through jaxkv.mx while the learning rate changes, against MXNet 1.9.1's recorded
numbers (``conformance/record_lr_training.py``): ``mx.lr_scheduler`` schedules (with warm-up),
``set_learning_rate`` and ``opt.lr`` mid-training, per-parameter multipliers, a key that joins
late (``num_update`` is the largest count of any key), keys pushed in other orders, one key at a
time and as lists, with the values on 1, 2 and 8 devices. Every weight must be MXNet's to the
bit, and no learning-rate change may compile anything new."""

from __future__ import annotations

import json
import pathlib
import warnings

import jax
import numpy as np
import pytest
from _variants import rotating

import jaxkv
import jaxkv.mx as mx

DATA = json.loads(
    (pathlib.Path(__file__).parent.parent / "conformance/data/mxnet_lr_training.json").read_text()
)
SCENARIOS = {sc["name"]: sc for sc in DATA["scenarios"]}


def _key(k):
    """A JSON object key back to MXNet's: an int index where it is one, else a name."""
    return int(k) if isinstance(k, str) and k.isdigit() else k


def _build(sc):
    kwargs = dict(sc["kwargs"])
    if "param_idx2name" in kwargs:
        kwargs["param_idx2name"] = {_key(k): v for k, v in kwargs["param_idx2name"].items()}
    sched = sc["scheduler"]
    if sched is not None:
        kwargs["lr_scheduler"] = getattr(mx.lr_scheduler, sched["class"])(**sched["kwargs"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = mx.optimizer.create(sc["optimizer"], **kwargs)
    if "lr_mult" in sc:
        opt.set_lr_mult({_key(k): v for k, v in sc["lr_mult"].items()})
    if "wd_mult" in sc:
        opt.set_wd_mult({_key(k): v for k, v in sc["wd_mult"].items()})
    return opt


def _replay(sc, n_devices):
    shapes = {int(k): tuple(v) for k, v in DATA["shapes"].items()}
    opt = _build(sc)
    # One device: a store on one device (jaxkv's own KVStore takes the devices); else MXNet's.
    kv = (
        jaxkv.KVStore("device", devices=jax.devices()[:1])
        if n_devices == 1
        else mx.kv.create("device")
    )
    kv.set_optimizer(opt)
    dtype = sc.get("dtype", "float32")
    for k, v in sc["init"].items():
        kv.init(int(k), mx.nd.array(np.asarray(v, dtype), dtype=dtype))
    got = []
    for st, grads in zip(sc["steps"], sc["grads"]):
        if "set_learning_rate" in st:
            opt.set_learning_rate(st["set_learning_rate"])
        if "lr" in st:
            opt.lr = st["lr"]
        keys = st["keys"]
        vals = {}
        for k in keys:
            parts = [np.asarray(x, dtype) for x in grads[str(k)]]
            if n_devices == 1:  # the two devices' sum, one float32 addition as the store's
                parts = [parts[0] + parts[1]]
            parts += [np.zeros_like(parts[0])] * (n_devices - len(parts))  # the same sum
            vals[k] = [mx.nd.array(x, ctx=mx.cpu(d), dtype=dtype) for d, x in enumerate(parts)]
        outs = {k: mx.nd.zeros(shapes[k], dtype=dtype) for k in keys}
        if st["mode"] == "one":
            for k in keys:
                kv.push(k, vals[k])
                kv.pull(k, out=outs[k])
        else:
            kv.push(keys, [vals[k] for k in keys])
            kv.pull(keys, out=[outs[k] for k in keys])
        got.append(
            {
                "weights": {str(k): outs[k].asnumpy() for k in keys},
                "num_update": opt.num_update,
                "learning_rate": repr(float(opt.learning_rate)),
            }
        )
    return got


# make test: each scenario once, on 1, 2 or 8 devices in turn; make conformance and
# test-deep: all three.
@pytest.mark.parametrize(("name", "n_devices"), rotating(list(SCENARIOS), [1, 2, 8]))
def test_training_with_changing_learning_rates_gives_mxnets_numbers(name, n_devices):
    sc = SCENARIOS[name]
    got = _replay(sc, n_devices)
    for step, (mine, theirs) in enumerate(zip(got, sc["record"], strict=True)):
        assert mine["num_update"] == theirs["num_update"], (name, step)
        assert mine["learning_rate"] == theirs["learning_rate"], (name, step)
        for k, w in theirs["weights"].items():
            want = np.asarray(w, sc.get("dtype", "float32"))
            assert mine["weights"][k].dtype == want.dtype
            np.testing.assert_array_equal(
                mine["weights"][k], want, err_msg=f"{name} step {step} key {k}"
            )


def test_a_new_learning_rate_compiles_nothing():
    """A schedule that changes the rate at every update, past the first steps, runs on the
    computations compiled already: the rate is an argument of the computation."""
    sched = mx.lr_scheduler.CosineScheduler(max_update=50, base_lr=0.1, final_lr=0.0)
    opt = mx.optimizer.SGD(momentum=0.9, lr_scheduler=sched)
    kv = mx.kv.create("device")
    kv.set_optimizer(opt)
    for k in range(3):
        kv.init(k, mx.nd.ones((4, 2)))
    outs = [mx.nd.zeros((4, 2)) for _ in range(3)]

    def step():
        for k in range(3):
            kv.push(k, [mx.nd.ones((4, 2), ctx=mx.cpu(d)) for d in range(2)])
            kv.pull(k, out=outs[k])
        mx.nd.waitall()

    for _ in range(3):
        step()
    rates = {float(opt.learning_rate)}
    with jax.log_compiles():
        import logging

        class Count(logging.Handler):
            n = 0

            def emit(self, record):
                if "Compiling" in record.getMessage():
                    Count.n += 1

        handler = Count()
        logging.getLogger("jax").addHandler(handler)
        try:
            for _ in range(5):
                step()
                rates.add(float(opt.learning_rate))
        finally:
            logging.getLogger("jax").removeHandler(handler)
    assert len(rates) == 6  # the rate moved at every step
    assert Count.n == 0


def test_set_learning_rate_with_a_scheduler_raises_as_mxnet():
    kind, message = DATA["refusals"]["set_learning_rate_with_scheduler"]
    assert kind == "UserWarning"
    opt = mx.optimizer.SGD(lr_scheduler=mx.lr_scheduler.FactorScheduler(step=2, base_lr=0.1))
    with pytest.raises(UserWarning, match="LRScheduler of the optimizer has already been"):
        opt.set_learning_rate(0.5)
    with pytest.raises(jaxkv.KVStoreError, match="lr_scheduler=None"):
        opt.set_learning_rate(0.5)
    assert message.startswith("LRScheduler of the optimizer has already been defined")


def test_a_refused_push_counts_no_update():
    """A push refused before it runs leaves the optimizer's counts (and schedule) as they were."""
    opt = mx.optimizer.SGD(learning_rate=0.1)
    kv = mx.kv.create("device")
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.ones((3,)))
    kv.push(0, mx.nd.ones((3,)))
    mx.nd.waitall()
    assert opt.num_update == 1
    with pytest.raises(jaxkv.KVStoreError):
        kv.push(0, mx.nd.ones((4,)))  # the wrong shape
    with pytest.raises(jaxkv.KVStoreError):
        kv.push(7, mx.nd.ones((3,)))  # no such key
    mx.nd.waitall()
    assert opt.num_update == 1 and opt._index_update_count == {0: 1}
