"""jaxkv/_src/rows/ops.py: how many slots a route is given, and what a held row push takes as
its updater."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.rows import ops


@pytest.mark.parametrize(
    ("most", "c"), [(0, 8), (1, 8), (8, 8), (9, 16), (16, 16), (17, 24), (150, 160), (256, 256)]
)
def test_slots_hold_the_busiest_route(most, c):
    assert ops.slots(most) == c
    assert ops.slots(most) >= most


def test_busiest_counts_the_most_ids_one_device_sends_one_owner():
    ids = [np.array([0, 1, 2, 3, 4]), np.array([7, 7, 6]), np.array([], np.int64)]
    assert ops.busiest(ids, block=4, parts=2) == 4  # the first device's 4 ids for owner 0
    assert ops.busiest([np.array([3, 4])], block=4, parts=2) == 1
    assert ops.busiest([np.array([], np.int64)], block=4, parts=2) == 1


class _Wrapper:
    """An optax wrapper in the way of ``optax.MultiSteps``: no transformation itself."""

    def gradient_transformation(self):
        return optax.sgd(0.1)


def _state():
    return jaxkv.init(jaxkv.empty(), {"e": jnp.zeros((4, 2))})


def test_a_held_row_push_takes_a_wrapper_and_refuses_what_is_no_updater():
    # check_push: every refusal of a push the imperative store runs later, raised now
    ids = ops.check_push(_state(), "e", [1, 3], jnp.ones((2, 2)), _Wrapper())
    assert [x.tolist() for x in ids] == [[1, 3]]
    with pytest.raises(jaxkv.KVStoreError, match=r"updater: expected None \(assign\).*int 3"):
        ops.check_push(_state(), "e", [1, 3], jnp.ones((2, 2)), 3)


def test_every_row_push_dispatches_its_computations_naming_its_key(monkeypatch):
    # (a wrong sum's SumError, found at a later call, names the keys dispatching it)
    from jaxkv._src.core import checked
    from jaxkv._src.errors import named
    from jaxkv._src.processes import order

    seen = []
    real = order.ordered

    def recording(what, fn, *args, **kwargs):
        seen.append((what, checked.named_now()))
        return real(what, fn, *args, **kwargs)

    monkeypatch.setattr(order, "ordered", recording)
    s = _state()
    s = jaxkv.push_rows(s, "e", [1], jnp.ones((1, 2)))
    s, _ = jaxkv.pushpull_rows(s, "e", [2], jnp.ones((1, 2)), pull_ids=[0, 2])
    ids = ops.check_push(s, "e", [3], jnp.ones((1, 2)), None)
    s, _ = ops.pushpull_checked(
        s, "e", ([3], jnp.ones((1, 2)), ids), [np.array([3])], [s.devices[0]], None, False
    )
    pushes = [name for what, name in seen if what == "push_rows"]
    assert len(pushes) == 3
    assert pushes == [named("e")] * 3
    assert checked.named_now() is None


def _python_updater(key, pushed, stored):
    return stored * 0.5 + pushed


@pytest.mark.standard_promotion  # (optax's Adam)
@pytest.mark.parametrize(
    "updater", [None, optax.adam(0.1), _python_updater], ids=["assign", "adam", "python"]
)
@pytest.mark.parametrize("given", [False, True], ids=["default_ids", "pull_ids"])
def test_a_pull_of_the_pushed_ids_on_one_device_is_the_rows_the_update_made(
    monkeypatch, updater, given
):
    # MXNet's embedding step (push the batch's rows, pull them back) on one device: the pulled
    # rows are those the update made, with no gather from the new table, and they are what a
    # push then a pull give.
    import jax

    made = []  # own_push's back: "pushed", the computation gives the rows the update made
    real = ops.own_push

    def recording(*args, **kwargs):
        made.append(args[-1])
        return real(*args, **kwargs)

    start = np.arange(40, dtype=np.float32).reshape(10, 4)
    ids = np.array([1, 4, 5, 9])  # sorted and distinct; 4 of them: padded for the computation
    rows = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)
    one = jaxkv.init(jaxkv.empty(jax.devices()[:1], layout="keys"), {f"back {given}": start})
    key = f"back {given}"
    expected_state = jaxkv.push_rows(one, key, ids, rows, updater=updater)
    expected = np.asarray(jaxkv.pull_rows(expected_state, key, ids))
    pull_ids = ids.copy() if given else None
    monkeypatch.setattr(ops, "own_push", recording)
    for _ in range(2):  # the second: the computation compiled by the first
        new, got = jaxkv.pushpull_rows(one, key, ids, rows, pull_ids=pull_ids, updater=updater)
        np.testing.assert_array_equal(np.asarray(got), expected)
        assert got.shape == (4, 4)
        np.testing.assert_array_equal(
            np.asarray(jaxkv.pull(new, key)), np.asarray(jaxkv.pull(expected_state, key))
        )
    assert made == ["pushed", "pushed"]
    # Other ids than the pushed ones are gathered from the new table.
    new, got = jaxkv.pushpull_rows(one, key, ids, rows, pull_ids=[9, 0], updater=updater)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jaxkv.pull_rows(new, key, [9, 0])))


def test_a_list_of_one_pair_pulls_its_rows_back_to_the_device_they_came_from(devices):
    # pushpull_rows with a list of pairs gives each pair's rows on its rows' device, also on a
    # store of one device (whose push can pull the pushed ids itself)
    import jax

    one = jaxkv.init(jaxkv.empty(devices[:1], layout="keys"), {"listed": jnp.zeros((6, 2))})
    rows = jax.device_put(np.ones((2, 2), np.float32), devices[3])
    for pull_ids in (None, [np.array([4, 0])]):  # the pushed ids, or others
        new, got = jaxkv.pushpull_rows(one, "listed", [np.array([1, 4])], [rows], pull_ids=pull_ids)
        assert isinstance(got, list) and len(got) == 1
        assert got[0].devices() == {devices[3]}
        want = np.ones((2, 2)) if pull_ids is None else [[1, 1], [0, 0]]
        np.testing.assert_array_equal(np.asarray(got[0]), want)
    np.testing.assert_array_equal(
        np.asarray(jaxkv.pull_rows(new, "listed", [1, 4])), np.ones((2, 2))
    )
