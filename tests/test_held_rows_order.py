"""Random sequences of MXNet's embedding-loop calls on the imperative store give the values of
the calls run one by one, in call order: a NumPy model of MXNet's lazy momentum SGD under a
learning-rate schedule (both depend on the order of a key's pushes and on when each push was
counted). The store holds pushes and pulls until a read, runs what is held up to a pull into an
out a held pull owes (the rest stays held), keeps the pushes held before a push of rows with it
and runs them after the rows' computation (one process), and fuses a push of rows with its
``row_sparse_pull``: none of that may change a value."""

import jax
import numpy as np
import pytest
from _embedding_calls import DENSE, ROWS, Model, W, play, store
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
import jaxkv.mx as mx

LR, MU, STEP, FACTOR = 0.5, 0.9, 2, 0.5
IDS = st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=4, unique=True).map(sorted)
_PUSH = st.tuples(
    st.just("push"), st.sampled_from(["a", "a", "b"]), st.sampled_from([1.0, -2.0, 3.0])
)
# A pull into a new out, or into one of two outs per key used again (Gluon's loop pulls into
# the same outs at every step: a pull into an out a held pull owes runs what is held up to it).
_PULL = st.tuples(st.just("pull"), st.sampled_from(sorted(DENSE)), st.sampled_from([None, 0, 1]))
_READ = st.tuples(st.just("read"), st.sampled_from([*sorted(DENSE), "e"]), st.just(None))
_READ_OUT = st.tuples(st.just("read out"), st.sampled_from(sorted(DENSE)), st.sampled_from([0, 1]))


@st.composite
def _step(draw):
    """A step of the loop, varied: dense pushes (a held pull among them, sometimes), a push of
    rows, more pushes (the same key again, sometimes), then its row_sparse_pull (of the pushed
    ids or others), a read, or nothing (the next step's calls come first)."""
    calls = draw(st.lists(st.one_of(_PUSH, _PUSH, _PULL, _PULL, _READ_OUT), max_size=4))
    if draw(st.integers(0, 4)):
        calls.append(("push rows", draw(IDS), draw(st.sampled_from([1.0, -0.5]))))
    calls += draw(st.lists(_PUSH, max_size=2))
    end = draw(st.sampled_from(["pushed ids", "other ids", "read", "nothing"]))
    if end == "read":
        calls.append(draw(_READ))
    elif end != "nothing":
        calls.append(("row_sparse_pull", end == "pushed ids", draw(IDS)))
    return calls


CALLS = st.lists(_step(), min_size=1, max_size=4).map(lambda steps: sum(steps, []))
# Gluon's loop without rows: pushes and pulls into outs used again (each pull into an out a
# held pull owes runs what is held up to that pull; what is held after it stays held).
_POOL_PULL = st.one_of(
    st.tuples(st.just("pull"), st.sampled_from(sorted(DENSE)), st.sampled_from([0, 1])),
    st.tuples(st.just("pull list"), st.sampled_from([0, 1]), st.sampled_from([0, 1])),
)
DENSE_CALLS = st.lists(
    st.one_of(_PUSH, _PUSH, _POOL_PULL, _POOL_PULL, _READ_OUT), min_size=1, max_size=16
)


def _model():
    return Model(LR, MU, STEP, FACTOR)


def _store(model):
    return store(jaxkv.KVStore("local", devices=jax.devices("cpu")[:1]), model)


def _close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)


@settings(max_examples=50, deadline=None, derandomize=True, database=None)
@given(calls=CALLS)
def test_the_embedding_loops_calls_in_any_order_give_the_values_of_call_order(calls):
    _run(calls)


@pytest.mark.deep  # make test-deep: more sequences, drawn anew each run
@settings(max_examples=1000, deadline=None, database=None)
@given(calls=CALLS)
def test_the_embedding_loops_calls_in_any_order_give_the_values_of_call_order_deep(calls):
    _run(calls)


@settings(max_examples=50, deadline=None, derandomize=True, database=None)
@given(calls=DENSE_CALLS)
def test_pulls_into_outs_used_again_give_the_values_of_call_order(calls):
    _run(calls)


@pytest.mark.deep
@settings(max_examples=1000, deadline=None, database=None)
@given(calls=DENSE_CALLS)
def test_pulls_into_outs_used_again_give_the_values_of_call_order_deep(calls):
    _run(calls)


def _run(calls):
    model = _model()
    play(_store(model), model, calls, _close)


@pytest.mark.parametrize("kept", ["pushes", "pushes and a pull"])
def test_the_bug_found_here_a_key_pushed_around_a_push_of_rows(kept):
    """The sequence that was wrong across processes (the push held after the push of rows ran
    before the one kept by it), and with a pull among the held calls, in one process."""
    model = _model()
    kv = _store(model)
    kv.push("a", mx.nd.ones((W,)))
    model.push("a", 1.0)
    out = mx.nd.zeros((W,))
    if kept != "pushes":
        kv.pull("a", out=out)
    want = model.w["a"].copy()
    kv.push(
        "e", mx.nd.sparse.row_sparse_array((np.ones((2, W), np.float32), [1, 2]), shape=(ROWS, W))
    )
    model.push("e", 1.0, [1, 2])
    kv.push("a", mx.nd.ones((W,)) * 3)
    model.push("a", 3.0)
    rows = mx.nd.sparse.zeros("row_sparse", (ROWS, W))
    kv.row_sparse_pull("e", out=rows, row_ids=mx.nd.array([1, 2]))
    np.testing.assert_allclose(rows.data.asnumpy(), model.w["e"][[1, 2]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(kv.pull("a")), model.w["a"], rtol=1e-6)
    if kept != "pushes":
        np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-6)
