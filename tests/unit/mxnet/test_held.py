"""jaxkv/_src/mxnet/held.py: held calls sorted into MXNet's order, whatever the order of the
calls of different keys."""

from jaxkv._src.errors import KVStoreError
from jaxkv._src.mxnet import held


class _Out:
    _owed = None


def test_a_keys_nth_push_is_in_the_nth_generation_whatever_the_other_keys_do():
    h = held.Held()
    assert not h
    h.hold_push("a", [1])
    h.hold_push("b", [2])
    h.hold_push("a", [3])  # a's second push: generation 1, though b has pushed once
    h.hold_push("c", [4])
    assert h.pushes == [{"a": [1], "b": [2], "c": [4]}, {"a": [3]}]
    assert h.count == {"a": 2, "b": 1, "c": 1}
    assert h


def test_a_pull_runs_after_the_pushes_of_its_key_held_before_it():
    h = held.Held()
    first, second, third = _Out(), _Out(), _Out()
    h.hold_pull("a", [first], "store")  # before any push of a: pulls[0]
    h.hold_push("a", [1])
    h.hold_pull("a", [second], "store")  # after a's first push: pulls[1]
    h.hold_pull("b", [third], "store")  # b pushed nothing: pulls[0]
    assert h.pulls == [[("a", [first]), ("b", [third])], [("a", [second])]]
    assert first.owed_by == second.owed_by == third.owed_by == "store"
    h.release()
    assert first.owed_by is second.owed_by is third.owed_by is None


def test_keys_lists_every_key_a_held_call_names_once():
    h = held.Held()
    h.inits["z"] = 0
    h.hold_push("a", [1])
    h.hold_pull("b", [_Out()], "store")
    h.hold_pull("a", [_Out()], "store")
    assert h.keys() == ["z", "b", "a"]


class _State:
    """A store's state as ``Calls`` reads it in one process: its devices only."""

    def __init__(self) -> None:
        import jax

        self.devices = tuple(jax.local_devices()[:1])


class _Store:
    """A store's own calls, recorded: what ``held.Calls`` runs, in its order."""

    def __init__(self, fail: str | None = None, changes: bool = False) -> None:
        self.state, self.log, self.restored = _State(), [], []
        self.fail, self.changes = fail, changes

    def _call(self, name):
        def call(*args):
            self.log.append((name, *args))
            if self.changes:  # each call leaves a new state behind
                self.state = _State()
            if name == self.fail:
                raise ValueError("broken")

        return call

    def run_held(self) -> None:
        """(``nd.waitall`` and the process's end run every holding store's calls.)"""

    def runs(self) -> held.Runs:
        return held.Runs(
            owner=self,
            stored=lambda: self.state,
            rebind=lambda s: setattr(self, "state", s),
            init=self._call("init"),
            push=self._call("push"),
            pull=self._call("pull"),
            restore=self.restored.append,
            spare_for_rows=lambda state, keys: None,
            push_rows=lambda state, rows: state,
        )


def _queue(store) -> tuple[held.Held, list]:
    """Calls of three keys in an order of their own: each key's in MXNet's order."""
    q, outs = held.Held(), [_Out() for _ in range(3)]
    q.inits.update({"k2": 2, "k1": 1})
    q.hold_pull("a", [outs[0]], store)  # before a's push
    q.hold_push("b", ["gb"], "nb")
    q.hold_push("a", ["ga"], "na")
    q.hold_pull("a", [outs[1]], store)  # after a's first push
    q.hold_push("a", ["ga2"], "na2")
    q.hold_pull("b", [outs[2]], store)  # after b's only push
    q.counted = "counts before"
    return q, outs


def test_the_calls_part_runs_what_is_held_in_mxnets_order_through_the_stores_calls():
    store = _Store()
    calls = held.Calls()
    q, outs = _queue(store)
    calls.hold(q, store)
    calls.run(store.runs())
    assert store.log == [
        ("init", ["k1", "k2"], [1, 2]),  # the inits in key order
        ("pull", ["a"], [[outs[0]]]),  # the pulls before their key's first push
        ("push", ["a", "b"], [["ga"], ["gb"]], {"a": "na", "b": "nb"}),  # every first push
        ("pull", ["a", "b"], [[outs[1]], [outs[2]]]),
        ("push", ["a"], [["ga2"]], {"a": "na2"}),  # then every second push
    ]
    assert calls.queue is None and all(o.owed_by is None for o in outs)
    assert store.restored == []  # nothing failed: the optimizer's counts stand
    calls.run(store.runs())  # nothing held: nothing runs
    assert len(store.log) == 5


def test_a_held_call_that_fails_names_the_held_keys_and_puts_back_the_counts_if_nothing_ran():
    for changes, restored in [(False, ["counts before"]), (True, [])]:
        store = _Store(fail="push", changes=changes)
        calls = held.Calls()
        calls.hold(_queue(store)[0], store)
        try:
            calls.run(store.runs())
        except KVStoreError as e:
            assert "the held calls failed when run (ValueError: broken)" in str(e)
            assert all(k in str(e) for k in ("k1", "k2", "a", "b")), e
            assert isinstance(e.__cause__, ValueError)
        else:
            raise AssertionError("a failing held push raised nothing")
        # Where the store's state is as it was (nothing ran), the optimizer's counts of the
        # held pushes are put back; where calls before it changed the state, they stand.
        assert store.restored == restored
        assert calls.queue is None


def test_keeping_the_held_calls_for_a_push_of_rows_needs_held_pushes_and_no_init():
    store = _Store()
    calls = held.Calls()
    assert not calls.keeps(True)  # nothing held
    q = held.Held()
    q.hold_push("a", ["g"])
    calls.hold(q, store)
    assert calls.keeps(True) and not calls.keeps(False)  # only under MXNet's lazy update
    q.inits["k"] = 1
    assert not calls.keeps(True)  # a held init: its key's state is not made yet
    del q.inits["k"]
    calls.rows = "a push of rows held"
    assert not calls.keeps(True)  # one push of rows held at a time
