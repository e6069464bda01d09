"""jaxkv/_src/mxnet/held.py: held calls sorted into MXNet's order, whatever the order of the
calls of different keys."""

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
