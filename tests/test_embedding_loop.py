"""An embedding table as MXNet users train it (issue 38): one device, a row-sparse table under a
lazy optimizer whose learning rate follows a schedule, a different number of distinct rows at
every step, dense keys beside it, save and load of the optimizer states.

- a push of rows updates the table and its optimizer state in place (donated), never copied,
  unless an out still holds the table (a dense pull lent it);
- after warm-up, neither a new count of rows nor a new learning rate compiles anything, and the
  values are lazy Adam's (a NumPy model of MXNet's kernel);
- a resume gives MXNet 1.9.1's recorded numbers (``conformance/record_resume.py``), with and
  without ``dump_optimizer``;
- float16 rows under ``multi_precision=True`` update a float32 master copy, cast back;
- an MXNet optimizer-state file (a pickle) is refused with a message that says what to do.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxkv
import jaxkv.mx as mx
from jaxkv._src.jax_internals import per_device
from jaxkv._src.mxnet import ndarray
from jaxkv._src.rows import sizes

RECORDED = json.loads(
    (Path(__file__).parent.parent / "conformance/data/mxnet_resume.json").read_text()
)
R, W = 4096, 8


@pytest.fixture
def one(devices):
    return devices[:1]


def _store(one, sched=None, **kw):
    kv = jaxkv.KVStore("device", devices=one)
    kv.set_optimizer(mx.optimizer.Adam(lazy_update=True, lr_scheduler=sched, **kw))
    return kv


def _rows(rng, n):
    ids = np.sort(rng.choice(R, n, replace=False))
    return ids, rng.normal(size=(n, W)).astype(np.float32)


def _push_pull(kv, ids, g, out):
    kv.push("emb", mx.nd.sparse.row_sparse_array((g, ids), shape=(R, W)))
    kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array(ids))


def _table(kv):
    """The stored table (read without handing out the store's state)."""
    return kv._stored["emb"]  # noqa: SLF001 - the test looks at the buffer itself


def test_a_push_of_rows_on_one_device_updates_the_table_in_place(one):
    """The table and Adam's moments are donated to the push (the old buffers are gone), so a
    step costs its rows; a table lent to a dense out is kept for that out, which keeps its
    numbers."""
    rng = np.random.default_rng(0)
    kv = _store(one, learning_rate=0.1)
    kv.init("emb", mx.nd.array(rng.normal(size=(R, W))))
    out = mx.nd.sparse.zeros("row_sparse", (R, W))
    _push_pull(kv, *_rows(rng, 40), out)  # the first push makes the optimizer state
    for _ in range(3):
        before = _table(kv)
        moments = jax.tree_util.tree_leaves(kv._stored.group_states)  # noqa: SLF001
        _push_pull(kv, *_rows(rng, 40), out)
        jax.block_until_ready(out.data.asjax())
        assert before.is_deleted()  # donated: the push wrote into it
        assert all(m.is_deleted() for m in moments if m.size > 1)
    dense = mx.nd.zeros((R, W))
    kv.pull("emb", out=dense)  # lends the stored table to the out
    held = dense.asnumpy()
    lent = _table(kv)
    _push_pull(kv, *_rows(rng, 40), out)
    assert not lent.is_deleted()  # the out holds it: kept
    np.testing.assert_array_equal(dense.asnumpy(), held)
    dense[:] = 0  # the out lets go of it: the next push donates again
    before = _table(kv)
    _push_pull(kv, *_rows(rng, 40), out)
    assert before.is_deleted()


def _lazy_adam_model(table, steps, lrs, wd, beta1=0.9, beta2=0.999, eps=1e-8):
    """MXNet's lazy Adam on the rows of each step (float64 bias correction on the host, the
    kernel in float32): the table after ``steps`` of ``(ids, g)`` at base rates ``lrs``."""
    w = table.astype(np.float32).copy()
    m, v = np.zeros_like(w), np.zeros_like(w)
    f = np.float32
    b1, b2, one = f(beta1), f(beta2), f(1)
    for t, ((ids, g), lr) in enumerate(zip(steps, lrs), start=1):
        lr_t = f(lr * (math.sqrt(1 - beta2**t) / (1 - beta1**t)))
        gw = g + w[ids] * f(wd)
        m[ids] = b1 * m[ids] + (one - b1) * gw
        v[ids] = b2 * v[ids] + ((one - b2) * gw) * gw
        w[ids] = w[ids] - (lr_t * m[ids]) / (np.sqrt(v[ids]) + f(eps))
    return w


def test_varying_counts_and_a_schedule_compile_nothing_after_warm_up(one, compiles):
    """1-device loop of MXNet code: a warm-up cosine schedule (a new learning rate at every
    step), between 129 and 143 distinct rows a step (one padded size), a dense key pushed
    beside the table with a priority: from the third step on nothing compiles (the first
    count exact, then one padded size; the dense key's update compiled once), and the table is
    lazy Adam's."""
    rng = np.random.default_rng(1)
    sched = mx.lr_scheduler.CosineScheduler(
        max_update=40, base_lr=0.05, final_lr=0.001, warmup_steps=3, warmup_begin_lr=0.01
    )
    kv = _store(one, sched, learning_rate=None, wd=1e-3)
    start = rng.normal(size=(R, W)).astype(np.float32)
    kv.init("emb", mx.nd.array(start).tostype("row_sparse"))
    kv.init("bias", mx.nd.zeros((W,)))
    out = mx.nd.sparse.zeros("row_sparse", (R, W))
    bias = mx.nd.zeros((W,))
    steps, lrs, counted = [], [], []
    for step in range(10):
        n = [130, 141, 129, 137, 143, 133, 139, 131, 135, 142][step]
        ids, g = _rows(rng, n)
        steps.append((ids, g))
        with compiles() as c:
            kv.push("bias", mx.nd.ones((W,)), priority=-1)
            _push_pull(kv, ids, g, out)
            kv.pull("bias", out=bias, priority=-1)
            np.testing.assert_array_equal(out.indices.asnumpy(), ids)
            bias.asnumpy()
        lrs.append(sched(step + 1))
        counted.append(c.count)
    assert counted[2:] == [0] * 8, counted
    want = _lazy_adam_model(start, steps, lrs, wd=1e-3)
    got = kv.pull("emb")
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-7)
    ids = steps[-1][0]
    np.testing.assert_allclose(out.data.asnumpy(), want[ids], rtol=2e-6, atol=2e-7)


def test_the_dense_key_pushed_beside_the_table_compiles_its_update_once(one, compiles):
    """The loop's dense key, its gradient the same NDArray at every step: the first push (the
    general path, which makes the optimizer state) and the later ones (a replayed plan) run
    one computation, compiled once: the value is passed as it lies on the store's one device
    by both (the first push placed it anew, and the second compiled the update again)."""
    kv = _store(one, learning_rate=0.1)
    kv.init("dense", mx.nd.zeros((256, W)))
    grad = mx.nd.ones((256, W)) * 0.01
    out = mx.nd.zeros((256, W))
    counted = []
    for _ in range(4):
        with compiles() as c:
            kv.push("dense", grad, priority=-1)
            kv.pull("dense", out=out, priority=-1)
            got = out.asnumpy()
        counted.append(c.count)
    assert counted[0] > 0 and counted[1:] == [0, 0, 0], counted
    all_rows = np.arange(256)
    steps = [(all_rows, np.full((256, W), 0.01, np.float32))] * 4
    want = _lazy_adam_model(np.zeros((256, W), np.float32), steps, [0.1] * 4, wd=0.0)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7)


def _jaxkv_calls(fn):
    """How many calls of jaxkv's own Python functions ``fn()`` makes (``sys.setprofile``)."""
    root = os.path.dirname(jaxkv.__file__) + os.sep
    count = 0

    def profile(frame, event, arg):  # noqa: ARG001
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(root):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _loop_beside(one, others, steps=8):
    """The loop with ``others`` small dense keys beside the table and its dense key (a model's
    other parameters: a store of many small keys is flat), each pushed and pulled once
    first. Returns the table, the last pulled rows and dense value, and the jaxkv calls of
    each step."""
    rng = np.random.default_rng(3)
    kv = jaxkv.KVStore("device", devices=one, layout="auto")  # (whatever JAXKV_LAYOUT says)
    kv.set_optimizer(mx.optimizer.Adam(lazy_update=True))
    start = rng.normal(size=(R, W)).astype(np.float32)
    kv.init("emb", mx.nd.array(start).tostype("row_sparse"))
    kv.init("dense", mx.nd.zeros((W,)))
    names = [f"w{k:03d}" for k in range(others)]
    if names:
        kv.init(names, [mx.nd.zeros((4, W))] * others)
        kv.push(names, [mx.nd.ones((4, W))] * others)
        kv.pull(names, out=[mx.nd.zeros((4, W)) for _ in names])
    out = mx.nd.sparse.zeros("row_sparse", (R, W))
    dense = mx.nd.zeros((W,))
    calls = []
    for _ in range(steps):
        ids, g = _rows(rng, 130)

        def step(ids=ids, g=g):
            kv.push("dense", mx.nd.ones((W,)), priority=-1)
            _push_pull(kv, ids, g, out)
            kv.pull("dense", out=dense, priority=-1)
            out.data.wait_to_read()
            dense.wait_to_read()

        calls.append(_jaxkv_calls(step))
    return np.asarray(kv.pull("emb")), out.data.asnumpy(), dense.asnumpy(), calls, kv


def test_a_step_costs_the_keys_it_touches_not_the_keys_beside_them(one):
    """Issue 48's O(keys touched): the loop with 100 or 200 small keys beside the table (a flat
    store) makes as many of jaxkv's Python calls a warm step either way (a pass over every
    key, or every lent array, at each step would add a call per key), gives the numbers of
    the loop with none beside it, and its dense push leaves the table's array as it was: not
    copied (a 1M x 64 table was copied at every push of a small key of a flat store)."""
    alone = _loop_beside(one, 0)
    few = _loop_beside(one, 100)
    many = _loop_beside(one, 200)
    for got in (few, many):
        for a, b in zip(alone[:3], got[:3]):
            np.testing.assert_array_equal(a, b)
    assert few[4]._stored.flat_layout is not None  # noqa: SLF001 - the layout asked of
    assert few[3][3:] == many[3][3:], (few[3], many[3])
    kv = many[4]
    table = _table(kv)
    kv.push("dense", mx.nd.ones((W,)))
    kv.pull("dense", out=mx.nd.zeros((W,)))
    assert _table(kv) is table


def _small_keys_beside_a_big_one(one, layout):
    kv = jaxkv.KVStore("device", devices=one, layout=layout)
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.01, wd=0.001))
    names = [f"w{k:03d}" for k in range(70)]
    kv.init("dense", mx.nd.zeros((256, 128)))  # (above the big-array bound: its own array)
    kv.init(names, [mx.nd.ones((4, 4)) * (k + 1) for k in range(70)])
    for step in range(3):  # each step's pushes held, then run as one list push
        kv.push(names, [mx.nd.ones((4, 4)) * 0.1 * (k + step) for k in range(70)])
        kv.push("dense", mx.nd.ones((256, 128)) * 0.01 * (step + 1))
        outs = [mx.nd.zeros((4, 4)) for _ in names]
        dense = mx.nd.zeros((256, 128))
        kv.pull(names, out=outs)
        kv.pull("dense", out=dense)
    return kv, [o.asnumpy() for o in outs] + [dense.asnumpy()], names


def test_small_keys_pushed_beside_a_big_key_keep_their_optimizer_state_packed(one):
    """A held push of small keys (kept in buckets) and of a key kept as an array of its own
    under an MXNet optimizer runs as two optimizer groups, so the small keys' state is
    packed beside their bucket (one fused update): one group over both is updated key by
    key, in a computation whose compile grew with the keys (200 small keys beside a dense
    one: an 11 s first step of the loop above). The numbers are a store of one array per
    key's."""
    kv, got, names = _small_keys_beside_a_big_one(one, "auto")
    _, want, _ = _small_keys_beside_a_big_one(one, "keys")
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    state = kv._stored  # noqa: SLF001 - the layout and groups asked of
    assert state.flat_layout is not None
    small = state.opt_group(names[0])
    assert small == tuple(sorted(names)), small
    assert state.packings[state.groups.index(small)] is not None
    assert state.opt_group("dense") == ("dense",)


def test_a_push_cut_in_two_groups_compiles_nothing_after_its_first_step(one, compiles):
    """The two groups of such a push are made, with their optimizer state, before the first
    of them runs, so the bucketed keys' computation (which takes the whole state) is traced
    at the first step for the state every later step passes it: nothing compiles after the
    first step (the second step compiled it again: the Gluon loop's ResNet-50, 3-10 s)."""
    kv = jaxkv.KVStore("device", devices=one, layout="auto")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4))
    names = [f"w{k:03d}" for k in range(40)]
    kv.init(names, [mx.nd.ones((4, 4)) * (k + 1) for k in range(40)])
    kv.init("dense", mx.nd.zeros((256, 128)))  # (above the big-array bound: its own array)
    outs = [mx.nd.zeros((4, 4)) for _ in names]
    dense = mx.nd.zeros((256, 128))
    counted = []
    for step in range(4):
        with compiles() as c:
            kv.push(names, [mx.nd.ones((4, 4)) * 0.1 * (k + step) for k in range(40)])
            kv.push("dense", mx.nd.ones((256, 128)) * 0.01)
            kv.pull(names, out=outs)
            kv.pull("dense", out=dense)
            dense.wait_to_read()
            last = outs[-1].asnumpy()  # (read: no pull's values left to spare at the next push)
        counted.append(c.count)
    assert counted[0] > 0 and counted[1:] == [0, 0, 0], counted
    state = kv._stored  # noqa: SLF001 - the groups asked of
    assert state.opt_group(names[0]) == tuple(sorted(names))
    assert state.opt_group("dense") == ("dense",)
    # MXNet's SGD with momentum, key by key: mom = 0.9 mom - lr (g + wd w); w += mom
    w = np.float32(40.0)
    mom = np.float32(0.0)
    for step in range(4):
        g = np.float32(0.1) * np.float32(39 + step)
        mom = np.float32(0.9) * mom - np.float32(0.1) * (g + np.float32(1e-4) * w)
        w = w + mom
    np.testing.assert_allclose(last, np.full((4, 4), w), rtol=1e-6)


def _many_small_keys_then_a_big_one(one, layout):
    kv = jaxkv.KVStore("device", devices=one, layout=layout)
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.1))
    names = [f"w{k:03d}" for k in range(80)]
    kv.init(names, [mx.nd.ones((4, 4)) * k for k in range(80)])
    kv.push(names, [mx.nd.ones((4, 4)) * (k % 3) for k in range(80)])
    outs = [mx.nd.zeros((4, 4)) for _ in names]
    kv.pull(names, out=outs)
    kv.init("dense", mx.nd.zeros((256, 128)))
    kv.push("dense", mx.nd.ones((256, 128)))
    dense = mx.nd.zeros((256, 128))
    kv.pull("dense", out=dense)
    dense.wait_to_read()
    return kv, outs


def test_a_first_push_and_pull_of_many_small_keys_makes_no_view_of_each(one, monkeypatch):
    """Start-up of the loop with small keys beside: their optimizer state is made with their
    views inside its computation, and a pull into outs that are not read makes nothing, so
    no computation gives an array per key, whose compile grows with the keys (200 keys'
    views: 2.7-4.6 s, twice, of a 14 s first step where MXNet takes 0.8 s). The outs, read
    later, hold a store of one array per key's values."""
    from jaxkv._src.state import buckets

    _, want = _many_small_keys_then_a_big_one(one, "keys")
    made = []
    for name in ("eager_views", "eager_values"):
        real = getattr(buckets, name)
        monkeypatch.setattr(
            buckets, name, lambda *a, _real=real, _name=name: made.append(_name) or _real(*a)
        )
    kv, outs = _many_small_keys_then_a_big_one(one, "auto")
    assert made == []
    assert kv._stored.flat_layout is not None  # noqa: SLF001 - the layout asked of
    for a, b in zip(outs, want):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def _small_keys_pulled_beside_rows(one, layout, steps=3):
    """A model's loop: 40 small keys pushed and pulled into outs at every step, the table's
    rows pushed and pulled beside them, the outs read at the end of the step. Returns the
    store, the small keys' outs, the pulled rows and the table."""
    rng = np.random.default_rng(11)
    kv = jaxkv.KVStore("device", devices=one, layout=layout)
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.1, lazy_update=True))
    names = [f"w{k:03d}" for k in range(40)]
    kv.init(names, [mx.nd.ones((4, 4)) * k for k in range(40)])
    kv.init("emb", mx.nd.array(rng.normal(size=(R, W))).tostype("row_sparse"))
    outs = [mx.nd.zeros((4, 4)) for _ in names]
    rows = mx.nd.sparse.zeros("row_sparse", (R, W))
    for step in range(steps):
        kv.push(names, [mx.nd.ones((4, 4)) * (k % 3 + step) for k in range(40)])
        kv.pull(names, out=outs)
        _push_pull(kv, *_rows(rng, 30), rows)
        rows.data.wait_to_read()
        for out in outs:
            out.wait_to_read()
    return kv, outs, rows.data.asnumpy(), _table(kv)


def test_small_keys_pulled_beside_a_table_of_its_own_are_not_copied_at_its_push(one, monkeypatch):
    """A push of rows into a table kept as an array of its own donates no bucket, so the small
    keys' values pulled before it (made when their outs are read) keep reading the buckets:
    no copy of the buckets at each step (every pending pull's buckets were copied before any
    donating push of rows). The numbers are a store of one array per key's."""
    from jaxkv._src.state import placement

    _, want_outs, want_rows, want_table = _small_keys_pulled_beside_rows(one, "keys")
    copied = []
    real = placement.copies
    monkeypatch.setattr(placement, "copies", lambda xs: copied.append(len(xs)) or real(xs))
    kv, outs, got_rows, table = _small_keys_pulled_beside_rows(one, "auto")
    state = kv._stored  # noqa: SLF001 - the layout the test asks for
    assert state.flat_layout is not None
    assert state.own_leaves([state.index("emb")]) is not None  # the table: its own array
    assert copied == []
    for a, b in zip(outs, want_outs):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    np.testing.assert_array_equal(got_rows, want_rows)
    np.testing.assert_array_equal(np.asarray(table), np.asarray(want_table))


def _resume_store(one):
    kv = jaxkv.KVStore("device", devices=one)
    sched = mx.lr_scheduler.CosineScheduler(
        max_update=20, base_lr=0.1, final_lr=0.01, warmup_steps=2, warmup_begin_lr=0.02
    )
    kv.set_optimizer(
        mx.optimizer.Adam(learning_rate=None, lazy_update=True, lr_scheduler=sched, wd=0.01)
    )
    kv.init("e", mx.nd.ones((6, 2)).tostype("row_sparse"))
    kv.init("d", mx.nd.ones((6, 2)))
    return kv


def _resume_push(kv, g, dense_only=False):
    ids = np.array(RECORDED["ids"])
    if not dense_only:
        kv.push("e", mx.nd.sparse.row_sparse_array((g[ids], ids), shape=(6, 2)))
    kv.push("d", mx.nd.array(g))


@pytest.mark.parametrize("dump", [False, True])
def test_a_resume_gives_mxnets_recorded_numbers(one, tmp_path, dump):
    """Saved after 3 steps, loaded into a new store with a new optimizer, 2 more steps: MXNet
    1.9.1's numbers bit for bit. Without dump_optimizer MXNet keeps no counts (both keys count
    from 0 again, as jaxkv's row key once did not); with it, the counts, num_update and the
    schedule come back."""
    grads = [np.array(g, np.float32) for g in RECORDED["gradients"]]
    want = RECORDED["runs"][str(int(dump))]
    kv = _resume_store(one)
    for s in range(3):
        _resume_push(kv, grads[s])
    fname = str(tmp_path / "states")
    kv.save_optimizer_states(fname, dump_optimizer=dump)
    kv = _resume_store(one)
    kv.load_optimizer_states(fname)
    _resume_push(kv, grads[3])
    e, d = mx.nd.zeros((6, 2)), mx.nd.zeros((6, 2))
    kv.pull("e", out=e, ignore_sparse=False)
    kv.pull("d", out=d)
    _resume_push(kv, grads[4], dense_only=True)
    d2 = mx.nd.zeros((6, 2))
    kv.pull("d", out=d2)
    np.testing.assert_array_equal(e.asnumpy(), np.array(want["e"], np.float32))
    np.testing.assert_array_equal(d.asnumpy(), np.array(want["d"], np.float32))
    np.testing.assert_array_equal(d2.asnumpy(), np.array(want["d2"], np.float32))
    assert kv._mxnet_optimizer.num_update == want["num_update"]  # noqa: SLF001


def test_a_whole_store_resume_keeps_the_counts(one, tmp_path):
    """kv.save / kv.load under an MXNet optimizer: the next step is the uninterrupted run's."""
    grads = [np.array(g, np.float32) for g in RECORDED["gradients"]]
    whole = _resume_store(one)
    for s in range(4):
        _resume_push(whole, grads[s])
    kv = _resume_store(one)
    for s in range(3):
        _resume_push(kv, grads[s])
    kv.save(str(tmp_path / "store"))
    kv = _resume_store(one)
    kv.load(str(tmp_path / "store"))
    _resume_push(kv, grads[3])
    for k in "ed":
        np.testing.assert_array_equal(np.asarray(kv.pull(k)), np.asarray(whole.pull(k)))


def test_a_dumped_optimizer_of_another_kind_is_refused_before_anything_changes(one, tmp_path):
    kv = _resume_store(one)
    _resume_push(kv, np.ones((6, 2), np.float32))
    fname = str(tmp_path / "states")
    kv.save_optimizer_states(fname, dump_optimizer=True)
    other = jaxkv.KVStore("device", devices=one)
    other.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    other.init("e", mx.nd.ones((6, 2)))
    other.init("d", mx.nd.ones((6, 2)))
    with pytest.raises(jaxkv.KVStoreError, match=r"saved optimizer is Adam, expected .* SGD"):
        other.load_optimizer_states(fname)
    other.push("d", mx.nd.ones((6, 2)))
    np.testing.assert_allclose(np.asarray(other.pull("d")), np.full((6, 2), 0.9), rtol=1e-6)
    optax_store = jaxkv.KVStore("device", devices=one)
    import optax

    optax_store.set_optimizer(optax.sgd(0.1))
    optax_store.init("w", mx.nd.ones((2,)))
    with pytest.raises(jaxkv.KVStoreError, match="optax transformation, which is code"):
        optax_store.save_optimizer_states(fname, dump_optimizer=True)


@pytest.mark.parametrize("dump", [False, True])
def test_mxnets_own_states_file_resumes_mxnets_run(one, dump):
    """MXNet 1.9.1's save_optimizer_states file itself (a pickle, kept by
    conformance/record_resume.py), loaded by a new store with a new optimizer: the next steps
    are the numbers MXNet gave after loading it, bit for bit (with dump_optimizer, its counts
    and schedule come back)."""
    grads = [np.array(g, np.float32) for g in RECORDED["gradients"]]
    want = RECORDED["runs"][str(int(dump))]
    kv = _resume_store(one)
    data = Path(__file__).parent.parent / "conformance/data"
    kv.load_optimizer_states(str(data / f"mxnet_resume_states_{int(dump)}.bin"))
    _resume_push(kv, grads[3])
    np.testing.assert_array_equal(np.asarray(kv.pull("e")), np.array(want["e"], np.float32))
    np.testing.assert_array_equal(np.asarray(kv.pull("d")), np.array(want["d"], np.float32))
    _resume_push(kv, grads[4], dense_only=True)
    np.testing.assert_array_equal(np.asarray(kv.pull("d")), np.array(want["d2"], np.float32))
    assert kv._mxnet_optimizer.num_update == want["num_update"]  # noqa: SLF001


class _Trap:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_of_anything_else_is_refused_without_running_it(one, tmp_path):
    """A states file that is a pickle of other things than MXNet's states: refused, naming
    what it holds, and none of its code runs (here: it would create a file); loaded as a whole
    store (kv.load), a pickle is refused by name, without numpy's allow_pickle hint."""
    fname = tmp_path / "mxnet.states"
    marker = tmp_path / "created"
    fname.write_bytes(pickle.dumps({"e": _Trap(str(marker))}, protocol=4))
    kv = _resume_store(one)
    with pytest.raises(jaxkv.KVStoreError, match=r"builtins\.open|io\.open") as err:
        kv.load_optimizer_states(str(fname))
    assert not marker.exists()
    assert "running their code" in str(err.value)
    with pytest.raises(jaxkv.KVStoreError, match="Python pickle") as err:
        kv.load(str(fname))
    assert "allow_pickle" not in str(err.value)
    assert "load_optimizer_states" in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    "name, kw",
    [("test", {}), ("sgd", {"momentum": 0.9}), ("adam", {}), ("nag", {"momentum": 0.9})],
)
def test_float16_rows_under_multi_precision_update_a_float32_master_copy(one, name, kw):
    """A float16 row-sparse table under multi_precision=True: the update runs on a float32
    copy and is cast back, so with numbers float16 holds exactly it gives a float32 table's
    numbers cast to float16 (MXNet's local store loses this update: the rows stay as they
    were)."""
    rows = np.array([0, 2])
    g = (np.arange(6, dtype=np.float32).reshape(2, 3) + 1) / 8

    def run(dtype, mp):
        kv = jaxkv.KVStore("local", devices=one)
        opt = mx.optimizer.create(name, rescale_grad=2, multi_precision=mp, **kw)
        kv.set_optimizer(opt)
        kv.init("10", mx.nd.ones((4, 3), dtype=dtype).tostype("row_sparse"))
        for _ in range(3):
            kv.push("10", mx.nd.sparse.row_sparse_array((g.astype(dtype), rows), shape=(4, 3)))
        out = mx.nd.sparse.zeros("row_sparse", (4, 3), dtype=dtype)
        kv.row_sparse_pull("10", out=out, row_ids=mx.nd.array([0, 1, 2, 3]))
        return out.asnumpy()

    half = run("float16", True)
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half, run("float32", False).astype(np.float16))
    if name == "test":  # weight += rescale_grad * g, three times
        np.testing.assert_array_equal(half[rows], (1 + 6 * g).astype(np.float16))


RATES = json.loads(
    (Path(__file__).parent.parent / "conformance/data/mxnet_adam_rates.json").read_text()
)


def test_a_thousand_scheduled_adam_steps_are_mxnets_bit_for_bit(one):
    """MXNet hands adam_update each learning rate as a decimal string, and its parser is an ulp
    off the nearest float32 for about 1 rate in 100: the store parses as MXNet does, so 1,000
    steps of a cosine schedule (conformance/record_adam_rates.py) give MXNet's weights bit for
    bit, where the nearest float32 drifts from them."""
    from jaxkv._src.mxnet.optimizers import float32 as f32

    grads = np.array(RATES["gradients"], np.float32)
    kv = jaxkv.KVStore("local", devices=one)
    sched = mx.lr_scheduler.CosineScheduler(
        max_update=1000, base_lr=0.01, final_lr=1e-4, warmup_steps=5, warmup_begin_lr=1e-3
    )
    opt = mx.optimizer.Adam(learning_rate=None, lr_scheduler=sched, wd=1e-4)
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.ones((8,)))
    out = mx.nd.zeros((8,))
    for step, g in enumerate(grads):
        kv.push(0, mx.nd.array(g))
        if (step + 1) % 100 == 0:
            kv.pull(0, out=out)
            want = np.array(RATES["weights"][step // 100], np.float32)
            np.testing.assert_array_equal(out.asnumpy(), want, err_msg=f"step {step + 1}")

    # The rate of each step as the store hands it to the kernel is the float32 MXNet's kernel
    # used (recorded through adam_update itself), where the nearest float32 is not always.
    def schedule():
        return mx.lr_scheduler.CosineScheduler(
            max_update=1000, base_lr=0.01, final_lr=1e-4, warmup_steps=5, warmup_begin_lr=1e-3
        )

    again = mx.optimizer.Adam(learning_rate=None, lr_scheduler=schedule())
    given = np.array([again.next_update([0])[0][0] for _ in range(1000)], np.float32)
    np.testing.assert_array_equal(given, np.array(RATES["rates"], np.float32))
    exact = mx.optimizer.Adam(learning_rate=None, lr_scheduler=schedule())
    float64 = []
    for _ in range(1000):
        exact._update_count(0)  # noqa: SLF001 - the bookkeeping alone, as next_update's
        float64.append(exact.scalars(0)[0])
    nearest = np.array(float64).astype(np.float32)
    assert 3 <= int((nearest != given).sum()) <= 30
    assert all(f32.parsed(x) == y for x, y in zip(float64, given))


def test_the_pulled_rows_stay_on_the_host_until_used_on_the_device(one, monkeypatch):
    """MXNet's loop reads ``out.data`` to wait for the pulled rows: nothing is put on the
    device for it (their ids are not asked for; rows pulled padded on a CPU device are cut on
    the host and stay there until an operation uses them on the device); their values and
    device are the pull's."""
    rng = np.random.default_rng(3)
    kv = _store(one, learning_rate=0.1)
    kv.init("emb", mx.nd.array(rng.normal(size=(R, W))))
    out = mx.nd.sparse.zeros("row_sparse", (R, W))
    puts = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a) or real_put(*a, **k))
    # Sizes met afresh, one count run exactly: the second count is pulled padded.
    monkeypatch.setattr(sizes, "_SEEN", {})
    monkeypatch.setattr(sizes, "EXACT", 1)
    on_host = []
    for n in (40, 37, 40):
        ids, g = _rows(rng, n)
        _push_pull(kv, ids, g, out)
        puts.clear()
        data = out.data
        data.wait_to_read()
        got = data.asnumpy()
        assert got.shape == (n, W) and puts == []  # nothing put on the device
        np.testing.assert_array_equal(np.asarray(_table(kv))[ids], got)
        on_host.append(data.host_value() is not None)
        twice = data * 2  # used on the device: put there (once) if still on the host
        assert len(puts) == on_host[-1] and twice.context.device_id == one[0].id
        np.testing.assert_array_equal(twice.asnumpy(), 2 * got)
        np.testing.assert_array_equal(np.asarray(out.data.asjax()), got)
    assert on_host == [False, True, False]


def test_a_store_notes_each_array_it_lends_once(one):
    """Pulling a key again and again into outs (no push between) keeps one note of what was
    lent: the stored array, whichever outs got it."""
    kv = jaxkv.KVStore("device", devices=one)
    kv.init("w", mx.nd.ones((4, 4)))
    out = mx.nd.zeros((4, 4))
    for _ in range(100):
        kv.pull("w", out=out)
        out.asnumpy()
        kept = mx.nd.zeros((4, 4))
        kv.pull("w", out=kept)
        kept.asnumpy()
    notes = kv._lending.lent_to  # noqa: SLF001 - the bookkeeping itself
    assert [n() for n in notes.values()] == [kv._stored["w"]]  # noqa: SLF001


def test_outs_on_each_device_hold_parts_of_the_stored_array_until_read(devices, monkeypatch):
    """A pull into one out per device of a store over several devices gives each out its
    device's part of the stored array, taken out of it only when the out is read (no
    single-device array made for an out never read: MXNet's list pull into 8 outs a key). A
    part unread keeps the table it is part of from being donated to a push of rows, as a
    part read does, and reads the numbers pulled."""
    two = devices[:2]  # (a table below the split bound: whole on each device)
    kv = jaxkv.KVStore("device", devices=two)
    kv.set_optimizer(mx.optimizer.Adam(lazy_update=True, learning_rate=0.1))
    table = np.random.default_rng(0).normal(size=(64, W)).astype(np.float32)
    kv.init("emb", mx.nd.array(table).tostype("row_sparse"))

    def push():
        ids, g = np.array([1, 5, 9]), np.ones((3, W), np.float32)
        rows = mx.nd.sparse.row_sparse_array
        kv.push("emb", [rows((g, ids), shape=(64, W), ctx=mx.cpu(d)) for d in range(2)])
        mx.nd.waitall()

    push()
    before = _table(kv)
    push()
    assert before.is_deleted()  # with no out holding it, the table is donated
    outs = [mx.nd.zeros((64, W), ctx=mx.cpu(d)) for d in range(2)]
    taken = []
    monkeypatch.setattr(ndarray, "per_device", lambda x: taken.append(x) or per_device(x))
    kv.pull("emb", out=outs)
    mx.nd.waitall()
    lent = _table(kv)
    pulled = np.asarray(lent)
    assert taken == [] and all(type(o.held_value()) is ndarray.Part for o in outs)
    push()
    assert not lent.is_deleted()  # the outs hold parts of it: kept
    np.testing.assert_array_equal(outs[1].asnumpy(), pulled)
    assert taken == [lent] and type(outs[0].held_value()) is ndarray.Part  # read: taken out
    assert outs[1].asjax().devices() == {two[1]}
    push()
    assert not lent.is_deleted()  # still held, read or not
    np.testing.assert_array_equal(outs[0].asnumpy(), pulled)
    for o in outs:
        o[:] = 0  # the outs let go of it: the next push donates again
    before = _table(kv)
    push()
    assert before.is_deleted()


@pytest.mark.parametrize("split", [False, True])
def test_rows_touched_before_their_gather_give_lazy_adams_numbers(devices, monkeypatch, split):
    """A big table's rows are touched a cache line at a time before the push gathers them
    (``kernels._touched``; the bound lowered here to a small table's size): on one device (the
    sorted rows' gather) and split over 8 (each device's block), the table is lazy Adam's and
    the pulled rows are its rows."""
    from jaxkv._src.rows import kernels

    rows, width = 600, 32  # 128-byte rows: two cache lines (shapes of this test's own)
    monkeypatch.setattr(kernels, "TOUCH_MIN_BYTES", 0)
    touched = []
    plain = kernels._touched  # noqa: SLF001

    def spy(x, ids, ordered=False):
        out = plain(x, ids, ordered)
        touched.append(out is not ids)  # traced: a touch made
        return out

    monkeypatch.setattr(kernels, "_touched", spy)
    if split:
        monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", str(rows * width // 8))
    kv = jaxkv.KVStore("device", devices=devices if split else devices[:1])
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.05, lazy_update=True))
    rng = np.random.default_rng(7)
    start = rng.normal(size=(rows, width)).astype(np.float32)
    kv.init("emb", mx.nd.array(start).tostype("row_sparse"))
    out = mx.nd.sparse.zeros("row_sparse", (rows, width))
    steps = []
    for n in (50, 61, 57):
        ids = np.sort(rng.choice(rows, n, replace=False))
        g = rng.normal(size=(n, width)).astype(np.float32)
        steps.append((ids, g))
        kv.push("emb", mx.nd.sparse.row_sparse_array((g, ids), shape=(rows, width)))
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array(ids))
    assert any(touched)
    want = _lazy_adam_model(start, steps, [0.05] * 3, wd=0.0)
    np.testing.assert_allclose(np.asarray(kv.pull("emb")), want, rtol=2e-6, atol=2e-7)
    np.testing.assert_allclose(out.data.asnumpy(), want[steps[-1][0]], rtol=2e-6, atol=2e-7)
