"""MXNet code as it is written: one key at a time, as Gluon's ``Trainer`` and the Module API
drive a store (each parameter ``init`` alone, then each step ``push(i)`` and ``pull(i, out)``
per parameter), held and run as lists; and Python updaters called on every push, as MXNet calls
them (compared with MXNet 1.9.1's own runs, recorded by conformance/record_updaters.py)."""

import json
import os

import jax
import numpy as np
import optax
import pytest
from _variants import covering

import jaxkv
import jaxkv.mx as mx
from jaxkv import nd

pytestmark = pytest.mark.standard_promotion  # optax's Adam casts implicitly

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "..", "conformance", "data", "mxnet_updaters.json")) as f:
    MXNET = json.load(f)

# Small and big values (64 x 512 is above the big-array bound: split over the 8 devices).
BASE = [(3,), (2, 5), (4, 4), (64, 512), (7,), (1,), (3, 3, 2), (8, 8)]


def shapes(n, offset):
    """``n`` shapes of BASE's kinds, their last dimension moved by ``offset`` (so that one
    test's computations are not another's, compiled already)."""
    out = []
    for i in range(n):
        s = BASE[i % len(BASE)]
        if s == (64, 512):
            out.append((64, 512 + 8 * offset))
        else:
            out.append((*s[:-1], s[-1] + offset + i // len(BASE)))
    return out


def arrays(shp, n, steps):
    """A loop's arrays, made ahead (their own compiles are not the store's): each key's
    initial value, its gradients on ``n`` devices per step, and its outs."""
    ctx = [jaxkv.cpu(d) for d in range(n)]
    inits = [nd.array(np.full(s, 0.5 + i, np.float32)) for i, s in enumerate(shp)]
    grads = [
        [
            [
                nd.array(np.full(s, (i % 5 + 1) * 0.25 * (d + 1) + step, np.float32), ctx[d])
                for d in range(n)
            ]
            for i, s in enumerate(shp)
        ]
        for step in range(steps)
    ]
    params = [[nd.zeros(s, c) for c in ctx] for s in shp]
    return inits, grads, params


def gluon_loop(kv, data, read_each=False):
    """Gluon's Trainer on ``kv``: init one key at a time, then per step push and pull each
    key with ``priority=-i``; ``read_each`` reads an out after every call (nothing held)."""
    inits, grads, params = data
    for i, x in enumerate(inits):
        kv.init(i, x)
        if read_each:
            kv.pull(i, out=params[i])
            params[i][0].asnumpy()
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            kv.push(i, g, priority=-i)
            if read_each:
                kv.pull(i, out=params[i])
                params[i][0].asnumpy()
            kv.pull(i, out=params[i], priority=-i)
            if read_each:
                params[i][0].asnumpy()
    nd.waitall()
    return [[p.asnumpy() for p in ps] for ps in params]


def optimizers():
    return {
        "assign": None,
        "mx_sgd": mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4),
        "optax_adam": optax.adam(0.01),
    }


# Each layout and each kind of updater in make test (3 of the 9); all in make test-deep.
@pytest.mark.parametrize(
    ("layout", "opt"),
    covering(["auto", "flat", "keys"], ["assign", "mx_sgd", "optax_adam"], strength=1),
)
def test_one_key_at_a_time_compiles_a_constant_and_no_more_than_a_list(
    devices, compiles, layout, opt
):
    offset = 3 * ["auto", "flat", "keys"].index(layout) + ["assign", "mx_sgd", "optax_adam"].index(
        opt
    )
    counts = {}
    for n in (5, 15):  # the count does not grow with the keys
        kv = jaxkv.KVStore("device", devices, layout=layout)
        if optimizers()[opt] is not None:
            kv.set_optimizer(optimizers()[opt])
        data = arrays(shapes(n, 10 * offset + n), len(devices), 3)
        with compiles() as c:
            gluon_loop(kv, data)
        counts[n] = c.count
    # The same 15 keys (other shapes, compiled afresh) pushed and pulled as lists.
    kv = jaxkv.KVStore("device", devices, layout=layout)
    if optimizers()[opt] is not None:
        kv.set_optimizer(optimizers()[opt])
    inits, grads, params = arrays(shapes(15, 10 * offset + 300), len(devices), 3)
    with compiles() as c:
        keys = list(range(len(inits)))
        kv.init(keys, inits)
        for step_grads in grads:
            kv.push(keys, step_grads)
            kv.pull(keys, out=params)
        nd.waitall()
    # A small constant: never one per key (before the store held calls, 20 keys of this loop
    # took 163 compiles), and within 3 of the list's: each step's pushes run as one list (a
    # pull into an out owed runs what is held up to it only), and optax pushed one key at a
    # time updates each key alone, its keys in buckets and its split keys two groups (their
    # states made and packed once), where the list updates one tree. (Running everything held
    # at such a pull made two more lists at the start: 17-19 compiles for optax's Adam.)
    assert counts[15] <= counts[5] + 2, counts
    assert counts[15] <= c.count + 3, (counts, c.count)
    assert counts[15] <= 12, counts


@pytest.mark.parametrize("layout", ["auto", "flat", "keys"])
def test_init_then_read_one_key_at_a_time_compiles_once_per_shape(devices, compiles, layout):
    """MXNet's nightly KVStore tests: ``init(k)``, ``pull(k, out)`` and a read, key after key.
    Each init used to lay out every key anew (one concatenation and one set of views over all
    keys: two compiles per key, 410 for 200 keys, and minutes). Now a new key keeps an array
    of its own until the next push, so the count is per shape, not per key; the push lays the
    keys out in buckets once, with the same numbers."""
    offset = 20 + ["auto", "flat", "keys"].index(layout)
    small, big = (2, 3 + offset), (64, 512 + 8 * offset)  # big: above the big-array bound
    kv = jaxkv.KVStore("device", devices, layout=layout)
    counts = []
    for n in (4, 24):
        with compiles() as c:
            for i in range(len(kv.keys()), n):
                shape = small if i % 3 else big
                kv.init(i, nd.array(np.full(shape, i, np.float32)))
                out = nd.zeros(shape)
                kv.pull(i, out=out)
                np.testing.assert_array_equal(out.asnumpy(), np.full(shape, i, np.float32))
        counts.append(c.count)
    assert counts[1] <= 1, counts  # 20 more keys of the same shapes: nothing new to compile
    # The first push lays the keys out, as a list init would have: the same buckets.
    keys = list(range(24))
    kv.push(keys, [nd.ones(kv._state.shapes[k]) for k in keys])
    listed = jaxkv.KVStore("device", devices, layout=layout)
    listed.init(keys, [nd.array(np.full(kv._state.shapes[k], k, np.float32)) for k in keys])
    listed.push(keys, [nd.ones(kv._state.shapes[k]) for k in keys])
    assert kv._state.buckets == listed._state.buckets and not kv._state.deferred
    assert (layout == "keys") is (kv._state.buckets == 0)
    for k in keys:
        np.testing.assert_array_equal(kv.pull(k), listed.pull(k))
        np.testing.assert_array_equal(np.asarray(kv.pull(k)), np.ones(kv._state.shapes[k]))


def test_a_deferred_key_leaves_the_store_laid_out(devices):
    """``kv.state`` (for the functional core) and saves see every key where the layout puts
    it, even before a push: a jitted step on it keeps its tree from the first call on."""
    kv = jaxkv.KVStore("device", devices, layout="flat")
    kv.init("a", nd.ones((3,)))
    kv.init("b", nd.ones((2, 2)))
    assert kv._state.deferred and kv._state.buckets == 0
    state = kv.state
    assert not state.deferred and state.buckets == 1
    pushed = jax.jit(lambda s: jaxkv.push(s, "a", [jax.numpy.ones(3)]))(state)
    assert jax.tree_util.tree_structure(pushed) == jax.tree_util.tree_structure(state)
    np.testing.assert_array_equal(jaxkv.pull(pushed, "a"), np.ones(3))
    np.testing.assert_array_equal(jaxkv.pull(pushed, "b"), np.ones((2, 2)))


# Each kind of updater, and each layout, in make test (3 of the 6); all in make test-deep.
@pytest.mark.parametrize(
    ("opt", "layout"), covering(["assign", "mx_sgd", "optax_adam"], ["auto", "keys"], strength=1)
)
def test_held_calls_give_what_calls_run_one_by_one_give(devices, layout, opt):
    """The same loop, every call read at once (one computation per call) and held: the same
    bits, and MXNet's ordering (a pull sees every push before it)."""
    shp = shapes(10, 50)
    runs = []
    for read_each in (True, False):
        kv = jaxkv.KVStore("device", devices[:4], layout=layout)
        if optimizers()[opt] is not None:
            kv.set_optimizer(optimizers()[opt])
        runs.append(gluon_loop(kv, arrays(shp, 4, 3), read_each=read_each))
    for a, b in zip(*runs):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_mxnet_sgd_one_key_at_a_time_against_numpy(devices):
    """MXNet's SGD (momentum, weight decay), each key its own state: a NumPy model."""
    shp = shapes(5, 70)
    kv = jaxkv.KVStore("device", devices[:2])
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, momentum=0.5, wd=0.0))
    got = gluon_loop(kv, arrays(shp, 2, 3))
    for i, s in enumerate(shp):
        w, mom = np.full(s, 0.5 + i, np.float32), np.zeros(s, np.float32)
        for step in range(3):
            g = sum(np.full(s, (i % 5 + 1) * 0.25 * (d + 1) + step, np.float32) for d in range(2))
            mom = 0.5 * mom - 0.5 * g
            w = w + mom
        for x in got[i]:
            np.testing.assert_allclose(x, w, rtol=1e-6)


def test_a_loop_pulling_into_the_same_outs_runs_each_steps_pushes_as_one_list(devices):
    """Gluon's loop pulls into the same outs at every step: a step's first pull, into an out
    the last step's pull still owes, runs what is held up to that pull, and the step's own push
    of its key stays held with the step's other pushes. (Running everything held ran that push
    alone, then the rest of the step with the next step's first push: two more lists at the
    start, each computation compiled.) The numbers are those of the calls run one by one."""
    kv = jaxkv.KVStore("device", devices[:2])
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, momentum=0.5, wd=0.0))
    ran, push_held = [], kv._push_held
    kv._push_held = lambda keys, *rest: (ran.append(list(keys)), push_held(keys, *rest))[1]
    data = arrays(shapes(4, 90), 2, 3)
    got = gluon_loop(kv, data)
    assert ran == [[0, 1, 2, 3]] * 3
    alone = jaxkv.KVStore("device", devices[:2])
    alone.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, momentum=0.5, wd=0.0))
    for a, b in zip(got, gluon_loop(alone, data, read_each=True)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_held_pulls_follow_mxnets_order(devices):
    kv = jaxkv.KVStore("device", devices[:2])
    kv.init("a", nd.ones((2,)))
    before, after, written = nd.zeros((2,)), nd.zeros((2,)), nd.zeros((2,))
    kv.pull("a", out=before)  # before the push: the old value
    kv.push("a", [nd.ones((2,), jaxkv.cpu(0)) * 3, nd.ones((2,), jaxkv.cpu(1)) * 4])
    kv.pull("a", out=after)
    kv.pull("a", out=written)
    assert before.owed_by is kv and after.owed_by is kv and written.owed_by is kv
    written[:] = 9  # a write after the held pull lands after it (and runs what is held)
    assert before.owed_by is None and after.owed_by is None
    np.testing.assert_array_equal(before.asnumpy(), [1, 1])
    np.testing.assert_array_equal(after.asnumpy(), [7, 7])
    np.testing.assert_array_equal(written.asnumpy(), [9, 9])
    # An out owed a pull, pushed: it pushes the pulled value.
    kv.pull("a", out=after)
    kv.push("a", after)
    kv.push("a", after)  # a second push of a held key runs the first
    np.testing.assert_array_equal(kv.pull("a"), [7, 7])
    # A second init of a held key, a push of an unknown key or of the wrong shape, a pull into
    # an out of the wrong shape: refused at the call, nothing held changes.
    kv.init("b", nd.zeros((3,)))
    kv.push("b", nd.ones((3,)))
    with pytest.raises(jaxkv.DuplicateKeyError, match="'b'"):
        kv.init("b", nd.zeros((3,)))
    with pytest.raises(jaxkv.UnknownKeyError, match="'c'"):
        kv.push("c", nd.ones((3,)))
    with pytest.raises(jaxkv.ShapeError, match="'b'"):
        kv.push("b", nd.ones((4,)))
    with pytest.raises(jaxkv.ShapeError, match="'b'"):
        kv.pull("b", out=nd.zeros((4,)))
    with pytest.raises(jaxkv.KeyTypeError):
        kv.init(5, nd.zeros((3,)))
    out = nd.zeros((3,))
    kv.pull("b", out=out)
    nd.waitall()
    np.testing.assert_array_equal(out.asnumpy(), [1, 1, 1])


def test_a_python_updater_runs_on_every_push_as_in_mxnet(devices):
    for run, n in (("shrinking", 1), ("per_device", 4)):
        calls = []

        def shrinking(key, recv, stored, calls=calls):
            calls.append([key, recv.asnumpy().tolist()])
            stored -= recv / len(calls)

        kv = mx.kv.create("local")
        kv.init(0, mx.nd.zeros((2,)))
        kv._set_updater(shrinking)
        out = mx.nd.zeros((2,))
        pulls = []
        for _ in range(4):
            kv.push(0, [mx.nd.ones((2,), mx.cpu(d)) for d in range(n)])
            kv.pull(0, out=out)
            pulls.append(out.asnumpy().tolist())
        assert pulls == MXNET[run]["pulls"], run
        assert calls == MXNET[run]["calls"], run


def test_the_tutorials_printing_updater_prints_on_every_push(capsys):
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.ones((2, 3)) * 2)

    def update(key, input, stored):
        print("update on key: %d" % key)  # noqa: UP031  (the tutorial's line)
        stored += input * 2

    kv._set_updater(update)
    for _ in range(3):
        kv.push(3, mx.nd.ones((2, 3)))
    kv.init([5, 7, 9], [mx.nd.ones((2, 3))] * 3)
    kv.push([5, 7, 9], [mx.nd.ones((2, 3))] * 3)
    assert capsys.readouterr().out.splitlines() == MXNET["printing"]["printed"]
    a, b = mx.nd.zeros((2, 3)), mx.nd.zeros((2, 3))
    kv.pull(3, out=a)
    kv.pull(7, out=b)
    assert a.asnumpy().tolist() == MXNET["printing"]["key3"]
    assert b.asnumpy().tolist() == MXNET["printing"]["key7"]


def test_an_updater_that_raises_names_the_key(devices):
    def broken(key, recv, stored):
        raise ZeroDivisionError("boom")

    kv = jaxkv.KVStore("local", devices[:2])
    kv.init(3, nd.ones((2,)))
    kv.set_updater(broken)
    with pytest.raises(jaxkv.KVStoreError, match="key 3.*broken.*ZeroDivisionError") as e:
        kv.push(3, nd.ones((2,)))
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    np.testing.assert_array_equal(kv.pull(3), [1, 1])  # unchanged
    # Traced (marked pure): the push is held, the error comes at the first read.
    kv.set_updater(jaxkv.pure_updater(broken))
    kv.push(3, nd.ones((2,)))
    out = nd.zeros((2,))
    kv.pull(3, out=out)
    with pytest.raises(jaxkv.KVStoreError, match="key 3.*ZeroDivisionError") as e:
        out.asnumpy()
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    np.testing.assert_array_equal(kv.pull(3), [1, 1])  # unchanged
    np.testing.assert_array_equal(out.asnumpy(), [0, 0])  # keeps what it held


def test_a_pure_updater_is_traced_once(devices, compiles):
    calls = []

    @jaxkv.pure_updater
    def update(key, recv, stored):
        calls.append(key)
        return stored + 2 * recv

    kv = jaxkv.KVStore("local", devices[:2])
    kv.init(list(range(4)), [nd.zeros((5,))] * 4)
    kv.set_updater(update)
    out = nd.zeros((5,))
    for _ in range(3):
        for k in range(4):
            kv.push(k, nd.ones((5,)))
        kv.pull(0, out=out)
        out.asnumpy()
    np.testing.assert_array_equal(out.asnumpy(), np.full(5, 6.0))
    assert len(calls) == 4  # traced once per key, for the one computation of the 4 pushes


def test_per_key_state_survives_a_save_and_load(devices, tmp_path):
    shp = shapes(4, 90)
    kv = jaxkv.KVStore("device", devices[:2])
    kv.set_optimizer(optax.adam(0.1))
    gluon_loop(kv, arrays(shp, 2, 2))
    kv.save(str(tmp_path / "s.npz"))
    state = jaxkv.load_state(
        str(tmp_path / "s.npz"), jaxkv.empty(devices[:2]), optimizer=optax.adam(0.1)
    )
    for k in range(4):
        np.testing.assert_array_equal(state[k], kv.pull(k))
    other = jaxkv.KVStore("device", devices[:2])
    other.set_optimizer(optax.adam(0.1))
    for i, s in enumerate(shp):
        other.init(i, nd.zeros(s))
    other.load(str(tmp_path / "s.npz"))
    for kv_ in (kv, other):  # one more step each: the same
        for i, s in enumerate(shp):
            kv_.push(i, [nd.ones(s, jaxkv.cpu(d)) for d in range(2)])
    for k in range(4):
        np.testing.assert_array_equal(other.pull(k), kv.pull(k))


def test_an_out_owed_by_another_store_gets_the_later_pull(devices):
    """Two stores pull into one out: the later call's value is what the out keeps, whichever
    store runs what it holds first."""
    a, b = (jaxkv.KVStore("local", devices[:2]) for _ in range(2))
    a.init(0, nd.ones((2,)))
    b.init(0, nd.ones((2,)) * 2)
    out, other = nd.zeros((2,)), nd.zeros((2,))
    a.pull(0, out=out)
    b.pull(0, out=out)  # a's pull into it lands first
    b.pull(0, out=other)
    np.testing.assert_array_equal(other.asnumpy(), [2, 2])  # runs b's held calls only
    nd.waitall()  # and then anything a still holds
    np.testing.assert_array_equal(out.asnumpy(), [2, 2])


def test_a_list_pull_with_nothing_held_runs_at_once(devices):
    """The list path (push a list, pull a list into outs) holds nothing: the list is the batch
    already. After a held call, a list pull is held behind it, in MXNet's order."""
    kv = jaxkv.KVStore("device", devices[:2])
    kv.init([0, 1], [nd.ones((2,)), nd.ones((3,))])
    nd.waitall()
    outs = [nd.zeros((2,)), nd.zeros((3,))]
    kv.pull([0, 1], out=outs)
    assert kv._calls.queue is None and all(o.owed_by is None for o in outs)
    held = outs[1].held_value()  # filled, no read needed (a part of the stored value, or it)
    np.testing.assert_array_equal(getattr(held, "whole", held), [1, 1, 1])
    kv.push(0, nd.ones((2,)) * 5)  # held: the next list pull waits behind it
    kv.pull([0, 1], out=outs)
    assert outs[0].owed_by is kv
    np.testing.assert_array_equal(outs[0].asnumpy(), [5, 5])
    # An out owed a pull by another store, pulled into by a list pull run at once: the later
    # pull's value is what it keeps.
    other = jaxkv.KVStore("device", devices[:2])
    other.init(0, nd.ones((2,)) * 7)
    other.pull(0, out=outs[0])
    kv.pull([0, 1], out=outs)
    np.testing.assert_array_equal(outs[0].asnumpy(), [5, 5])


def test_held_pushes_are_refused_at_the_call(devices):
    """What a push would refuse when run is refused at the call, the store unchanged."""
    kv = jaxkv.KVStore("device", devices[:2])
    kv.init(["a", "b", "c", "d"], [nd.ones((2,))] * 4)
    kv.set_optimizer(optax.sgd(0.5))
    kv.push(["a", "b"], [nd.ones((2,))] * 2)  # a list: one tree, one group
    with pytest.raises(jaxkv.KVStoreError, match=r"\['a', 'b'\]"):
        kv.push("a", nd.ones((2,)))  # part of that group
    kv.push("c", nd.ones((2,)))  # one key at a time: a group each
    kv.push("d", nd.ones((2,)))
    assert sorted(kv.state.opt_states) == [("a", "b"), ("c",), ("d",)]
    with pytest.raises(jaxkv.KVStoreError, match=r"\['c', 'd'\].*one at a time"):
        kv.push(["c", "d"], [nd.ones((2,))] * 2)  # two groups
    for k, want in (("a", 0.5), ("b", 0.5), ("c", 0.5), ("d", 0.5)):
        np.testing.assert_array_equal(kv.pull(k), [want, want])
    # A compressed store: a value on several devices has no one residual.
    kv = jaxkv.KVStore("device", devices[:2])
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init(0, nd.zeros((2,)))
    spread = jax.device_put(np.ones(2, np.float32), kv.state.sharding)
    with pytest.raises(jaxkv.KVStoreError, match="key 0.*one device"):
        kv.push(0, spread)
    np.testing.assert_array_equal(kv.pull(0), [0, 0])
