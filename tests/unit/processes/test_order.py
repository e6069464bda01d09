"""jaxkv/_src/processes/order.py: the collective timeout, when the watchdog ends a process and
how often it looks, and each turn waiting for the one before it."""

import logging
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv._src.processes import order


@pytest.fixture(autouse=True)
def _no_timeout_variable(monkeypatch):
    monkeypatch.delenv(order.ENV_COLLECTIVE_TIMEOUT, raising=False)


@pytest.fixture
def two_processes(monkeypatch):
    """This process pretends to be one of two; the watchdog and the order are fresh ones that
    start no thread (their stop flag is set)."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    watchdog = order._Watchdog()
    watchdog._stopping.set()
    monkeypatch.setattr(order, "_WATCHDOG", watchdog)
    monkeypatch.setattr(order, "_ORDER", order._Order())
    return watchdog


@pytest.fixture
def clock(monkeypatch):
    """order.py's ``time.monotonic``, set by hand: ``clock.now = ...``."""
    c = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(order, "time", types.SimpleNamespace(monotonic=lambda: c.now))
    return c


def test_collective_timeout_is_the_variable_else_the_default(monkeypatch):
    assert order.collective_timeout() == order.DEFAULT_COLLECTIVE_TIMEOUT
    monkeypatch.setenv(order.ENV_COLLECTIVE_TIMEOUT, "")  # empty: as if unset
    assert order.collective_timeout() == order.DEFAULT_COLLECTIVE_TIMEOUT
    monkeypatch.setenv(order.ENV_COLLECTIVE_TIMEOUT, "2.5")
    assert order.collective_timeout() == 2.5


def test_nothing_is_watched_in_one_process():
    watchdog = order._Watchdog()
    assert watchdog.watch("push", lambda: False) is None
    assert watchdog._pending == {} and watchdog._thread is None


@pytest.mark.parametrize("timeout", ["0", "-1"])
def test_a_timeout_of_zero_or_less_turns_the_watch_off(monkeypatch, two_processes, timeout):
    monkeypatch.setenv(order.ENV_COLLECTIVE_TIMEOUT, timeout)
    assert two_processes.watch("push", lambda: False) is None
    assert two_processes._pending == {}


def test_each_watch_is_armed_with_its_start_and_the_timeout_then(monkeypatch, two_processes, clock):
    monkeypatch.setenv(order.ENV_COLLECTIVE_TIMEOUT, "5")
    first = two_processes.watch("push", bool)
    clock.now += 3.0
    monkeypatch.setenv(order.ENV_COLLECTIVE_TIMEOUT, "7")
    second = two_processes.watch("barrier", bool)
    assert first != second
    assert two_processes._pending == {
        first: ("push", 1000.0, 5.0, bool),
        second: ("barrier", 1003.0, 7.0, bool),
    }
    two_processes.forget(None)  # a watch never made: nothing to forget
    assert list(two_processes._pending) == [first, second]
    two_processes.forget(first)
    assert list(two_processes._pending) == [second]


class _Stop:
    """Stands in for the watchdog's stop flag: lets its loop run ``rounds`` times, noting each
    period it waits."""

    def __init__(self, rounds):
        self.rounds = rounds
        self.periods = []

    def wait(self, period):
        self.periods.append(period)
        self.rounds -= 1
        return self.rounds < 0


def _one_round(watchdog, monkeypatch, rounds=1):
    """Run the watchdog's loop ``rounds`` times here; returns the hung calls and the periods."""
    hung = []
    monkeypatch.setattr(order, "_hung", lambda *a: hung.append(a))
    watchdog._stopping = _Stop(rounds)
    watchdog._run()
    return hung, watchdog._stopping.periods


def test_the_watchdog_ends_a_collective_only_past_its_timeout(monkeypatch, clock):
    watchdog = order._Watchdog()
    watchdog._pending = {
        1: ("at its timeout", clock.now - 4.0, 4.0, lambda: False),
        2: ("past it", clock.now - 4.5, 4.0, lambda: False),
        3: ("long finished", clock.now - 100.0, 4.0, lambda: True),
    }
    hung, _ = _one_round(watchdog, monkeypatch)
    assert hung == [("past it", 4.5, 4.0)]
    assert sorted(watchdog._pending) == [1, 2]  # the finished one is forgotten


def test_the_watchdog_looks_four_times_per_shortest_timeout_at_least_once_a_second(
    monkeypatch, clock
):
    watchdog = order._Watchdog()
    hung, periods = _one_round(watchdog, monkeypatch, rounds=1)
    assert periods == [1.0, 1.0]  # nothing pending: once a second
    watchdog._pending = {
        1: ("slow", clock.now, 8.0, lambda: False),  # 8 / 4 = 2 s: the second caps it
        2: ("fast", clock.now, 2.0, lambda: False),  # 2 / 4 = 0.5 s
    }
    _, periods = _one_round(watchdog, monkeypatch, rounds=1)
    assert periods == [1.0, 0.5]
    watchdog._pending = {1: ("slow", clock.now, 8.0, lambda: False)}
    _, periods = _one_round(watchdog, monkeypatch, rounds=1)
    assert periods == [1.0, 1.0]
    assert hung == []


def test_a_hung_collective_ends_the_process_with_status_124(monkeypatch, caplog):
    statuses = []
    monkeypatch.setattr(os, "_exit", statuses.append)
    with caplog.at_level(logging.ERROR, logger="jaxkv"):
        order._hung("barrier (x)", 12.4, 10.0)
    assert statuses == [124]  # as timeout(1)'s
    assert "barrier (x) has waited 12 s" in caplog.text
    assert f"{order.ENV_COLLECTIVE_TIMEOUT}=10" in caplog.text


def test_a_watched_block_is_pending_only_while_it_runs_even_when_it_raises(
    monkeypatch, two_processes
):
    monkeypatch.setenv(order.ENV_COLLECTIVE_TIMEOUT, "5")
    with pytest.raises(RuntimeError), order.watched("push"):
        ((what, _, _, done),) = two_processes._pending.values()
        assert what == "push" and not done()
        raise RuntimeError
    assert two_processes._pending == {} and done()


def test_first_is_the_first_element_of_any_shape():
    x = jnp.arange(6.0).reshape(2, 3) + 4
    np.testing.assert_array_equal(order._first(x), [4.0])


class _Token:
    def __init__(self):
        self.waited = 0

    def block_until_ready(self):
        self.waited += 1


def test_a_turn_waits_for_the_previous_turns_computation_once():
    turns = order._Order()
    token = _Token()
    with turns.turn("first", watch=False) as first:
        first.token = token
    assert token.waited == 0  # its own turn does not wait for it
    with pytest.raises(RuntimeError), turns.turn("second", watch=False):
        assert token.waited == 1  # waited before the block ran
        raise RuntimeError
    with turns.turn("third", watch=False):
        pass
    assert token.waited == 1  # the second turn issued nothing: nothing more to wait for


def test_a_turn_is_watched_only_when_asked(monkeypatch, two_processes):
    monkeypatch.setenv(order.ENV_COLLECTIVE_TIMEOUT, "5")
    turns = order._Order()
    with turns.turn("save", watch=False):
        assert two_processes._pending == {}
    with turns.turn("push", watch=True):
        assert [w for w, *_ in two_processes._pending.values()] == ["push"]


def test_an_issued_computation_is_the_next_turns_wait_and_is_watched(monkeypatch, two_processes):
    monkeypatch.setenv(order.ENV_COLLECTIVE_TIMEOUT, "5")
    with order.collective("push", watch=False) as turn:
        turn.issued(jnp.arange(3.0) + 7)
    assert order._ORDER._last is turn
    np.testing.assert_array_equal(turn.token, [7.0])
    ((what, _, timeout, done),) = two_processes._pending.values()
    assert (what, timeout) == ("push", 5.0)
    assert done.__self__ is turn.token and done()  # the watch ends once the token is ready

    monkeypatch.setenv(order.ENV_COLLECTIVE_TIMEOUT, "0")
    with order.collective("pull", watch=False) as later:
        later.issued(jnp.ones(2))
    assert later.token is not None and len(two_processes._pending) == 1  # not watched


def test_in_one_process_a_collective_only_runs_its_block():
    before = order._ORDER._last
    with order.collective("push") as turn:
        turn.issued(jnp.ones(2))
    assert turn.what == "push" and turn.token is None
    assert order._ORDER._last is before
    assert order.ordered("sum", lambda a, b: a + b, 2, 3) == 5


def test_ordered_takes_a_turn_only_for_a_computation_that_spans_processes(two_processes):
    x = jnp.arange(4.0)
    out = order.ordered("local", lambda a: a * 2, x)  # every argument is this process's
    np.testing.assert_array_equal(out, [0.0, 2.0, 4.0, 6.0])
    assert order._ORDER._last is None
    out = order.ordered("local", lambda a: a * 2, x, spans=False)
    assert order._ORDER._last is None
    out = order.ordered("spanning", lambda a: (a + 1, "not an array", a * 10), x, spans=True)
    np.testing.assert_array_equal(out[0], [1.0, 2.0, 3.0, 4.0])
    last = order._ORDER._last
    assert last.what == "spanning"
    np.testing.assert_array_equal(last.token, [1.0])  # the first result's first element


def test_a_collective_says_once_that_it_waited_half_its_timeout_and_then_that_it_finished(
    monkeypatch, clock, caplog
):
    """What the launcher reads (unresponsive.py) to name the process the others waited for."""
    watchdog = order._Watchdog()
    done = []
    watchdog._pending = {
        1: ("push", clock.now - 4.5, 8.0, lambda: bool(done)),
        2: ("barrier", clock.now - 3.5, 8.0, lambda: False),
    }
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        _one_round(watchdog, monkeypatch, rounds=2)
        assert caplog.messages == [
            "jaxkv: process 0: a push has waited 4 s, half of JAXKV_COLLECTIVE_TIMEOUT=8, for "
            "the other processes"
        ]
        done.append(True)
        clock.now += 1.5
        hung, _ = _one_round(watchdog, monkeypatch)
        assert caplog.messages[1:] == [
            "jaxkv: process 0: a push finished after 6 s",
            "jaxkv: process 0: a barrier has waited 5 s, half of JAXKV_COLLECTIVE_TIMEOUT=8, for "
            "the other processes",
        ]
        watchdog.forget(2)  # finished, as a watched block ends
        watchdog.forget(2)  # once only
    assert caplog.messages[3:] == ["jaxkv: process 0: a barrier finished after 5 s"]
    assert hung == [] and watchdog._pending == {} and watchdog._warned == set()
    for message, pattern in zip(caplog.messages, [order.WAITING, order.FINISHED]):
        assert pattern.search(message.encode())
    assert order.TIMED_OUT.search(caplog.messages[0].encode()) is None
