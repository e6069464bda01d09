"""jaxkv/_src/processes/host.py: rank 0's values reach every process bit for bit, gathered
rows keep their shape and bytes, and processes at different barriers are refused."""

import contextlib

import jax
import numpy as np
import pytest

from jaxkv._src.errors import KVStoreError
from jaxkv._src.processes import host, order


def test_in_one_process_an_all_gather_is_the_value_as_the_only_row():
    x = np.arange(6, dtype=np.int16).reshape(2, 3)
    got = host.all_gather(x)
    assert got.shape == (1, 2, 3) and got.dtype == np.int16
    np.testing.assert_array_equal(got[0], x)
    assert host.all_gather(np.float32(2.5)).shape == (1,)  # a scalar: one row of one


def test_in_one_process_broadcast_and_barrier_do_nothing(monkeypatch):
    monkeypatch.setattr(host, "all_gather", pytest.fail)  # a barrier gathers nothing
    tree = {"a": np.ones(3), "b": [np.int8(1)]}
    assert host.from_rank_zero(tree) is tree
    assert host.barrier("anything") is None


def test_the_process_rows_round_trip_and_their_sum_keeps_the_bytes_dtype():
    # One process: the real mesh, rows and collectives, with one row (this process's).
    x = np.array([0, 1, 128, 255, 7], np.uint8)
    add_up, gather = host._host_collectives()
    rows = host._rows(x)
    assert rows.shape == (1, 5)
    np.testing.assert_array_equal(host._mine(gather(rows)), x[None])
    summed = host._mine(add_up(rows))
    assert summed.dtype == np.uint8  # bytes summed as bytes: a wider sum would break the view
    np.testing.assert_array_equal(summed, x)


@pytest.fixture
def job(monkeypatch):
    """This process pretends to be one of two. The host collectives are simulated: each
    process's row is what it sends, ``job.others`` what the other process sends (zeros unless
    set), and the turns taken are recorded."""
    state = type("Job", (), {})()
    state.sent, state.turns, state.others = [], [], None
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    state.rank = 0
    monkeypatch.setattr(jax, "process_index", lambda: state.rank)

    @contextlib.contextmanager
    def collective(what, watch=True):
        state.turns.append(what)
        yield None

    monkeypatch.setattr(order, "collective", collective)

    def rows(x):
        state.sent.append(x.copy())
        return x[None]

    def other(row):
        return np.zeros_like(row) if state.others is None else state.others

    def add_up(rows):
        return rows[0] + other(rows[0])

    def gather(rows):
        stacked = [rows[0], other(rows[0])]
        return np.stack(stacked[::-1] if state.rank else stacked)

    monkeypatch.setattr(host, "_rows", rows)
    monkeypatch.setattr(host, "_host_collectives", lambda: (add_up, gather))
    monkeypatch.setattr(host, "_mine", np.asarray)
    return state


def _tree(seed):
    """Leaves of many dtypes and shapes, with bit patterns a float compare would miss."""
    rng = np.random.default_rng(seed)
    nan = np.array([0x7FC00001 + seed], np.uint32).view(np.float32)  # a NaN with a payload
    return {
        "floats": np.concatenate([rng.standard_normal(3).astype(np.float32), [-0.0], nan]),
        "ints": rng.integers(-100, 100, size=(2, 3)).astype(np.int8),
        "flag": np.bool_(seed % 2),
        "empty": np.zeros((0, 4), np.float64),
        "wide": [rng.standard_normal((3, 2)).T, np.uint16(1000 + seed)],  # (F-ordered view)
        "half": rng.standard_normal(2).astype(np.float16),
    }


def _assert_bitwise_equal(got, want):
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves):
        w = np.asarray(w)
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        assert g.tobytes() == w.tobytes()


def test_rank_zero_keeps_its_own_values_and_sends_them(job):
    tree = _tree(0)
    got = host.from_rank_zero(tree)
    _assert_bitwise_equal(got, tree)
    assert len(job.sent) == 1 and job.sent[0].dtype == np.uint8 and job.sent[0].any()
    assert job.turns == ["broadcast of rank 0's values"]


def test_another_rank_sends_zeros_and_receives_rank_zeros_values_bit_for_bit(job):
    mine, rank_zeros = _tree(1), _tree(2)
    host.from_rank_zero(rank_zeros)  # as rank 0: what it sends
    job.others = job.sent.pop()
    job.rank = 1
    got = host.from_rank_zero(mine)
    assert not job.sent[0].any()  # rank 1's own bytes are not added in
    _assert_bitwise_equal(got, rank_zeros)


def test_a_broadcast_of_no_leaves_is_an_empty_tree(job):
    assert host.from_rank_zero({"a": [], "b": {}}) == {"a": [], "b": {}}


def test_an_all_gather_stacks_the_rows_in_process_order_in_its_turn(job):
    job.rank, job.others = 1, np.array([5, 6], np.int32)
    got = host.all_gather(np.array([7, 8], np.int32), "gather of the sizes")
    np.testing.assert_array_equal(got, [[5, 6], [7, 8]])
    assert job.turns == ["gather of the sizes"]


def test_processes_at_the_same_barrier_pass_and_at_different_ones_are_refused(job, monkeypatch):
    sent = {}  # what this process sent, by turn

    def gather_with(other):
        """An all-gather where the other process is at barrier ``other``."""

        def all_gather(x, what):
            sent[what] = x
            return np.stack([x, sent.get(f"barrier ({other})", x)])

        return all_gather

    monkeypatch.setattr(host, "all_gather", gather_with("step"))
    host.barrier("step")
    assert list(sent) == ["barrier (step)"]
    host.barrier("step")
    with pytest.raises(KVStoreError, match="'stop'.*different"):
        host.barrier("stop")  # the other process is at "step"
    monkeypatch.setattr(host, "all_gather", gather_with("stop"))
    with pytest.raises(KVStoreError, match="'step'.*different"):
        host.barrier("step")


def test_a_text_of_any_length_comes_back_whole():
    """In one process: its own text, as given (the empty one too)."""
    assert host.all_gather_text(b'{"numbers": [0.1]}', "a test's text") == [b'{"numbers": [0.1]}']
    assert host.all_gather_text(b"", "a test's text") == [b""]
