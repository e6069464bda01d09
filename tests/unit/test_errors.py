"""jaxkv/_src/errors.py: each error is a KVStoreError and the built-in an MXNet user catches,
prints its plain message, and an unknown key's message shows at most eight known keys."""

import pytest

import jaxkv
from jaxkv._src import errors


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.UnknownKeyError, KeyError),
        (errors.DuplicateKeyError, KeyError),
        (errors.KeyTypeError, TypeError),
        (errors.ShapeError, ValueError),
    ],
)
def test_each_error_is_caught_as_a_kvstore_error_and_as_its_builtin(cls, builtin):
    for catch in (errors.KVStoreError, builtin):
        with pytest.raises(catch):
            raise cls("key 'w': expected 1, given 2")
    assert issubclass(errors.KVStoreError, Exception)
    assert not issubclass(errors.KVStoreError, (KeyError, TypeError, ValueError))


@pytest.mark.parametrize(
    "cls",
    [
        errors.KVStoreError,
        errors.UnknownKeyError,
        errors.DuplicateKeyError,
        errors.KeyTypeError,
        errors.ShapeError,
    ],
)
def test_an_error_prints_its_message_as_given_and_nothing_without_one(cls):
    # KeyError alone would print the repr of its message, quotes and all.
    message = "key 'w': expected shape (2,), given (3,)"
    assert str(cls(message)) == message
    assert str(cls()) == ""


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_is_named_where_users_import_it(name):
    cls = getattr(errors, name)
    assert cls.__module__ == "jaxkv"
    assert getattr(jaxkv, name) is cls
    assert repr(cls("x")).startswith(f"{name}(")


@pytest.mark.parametrize(
    ("known", "shown", "more"),
    [
        (range(1), "[0]", ""),
        (range(7, -1, -1), "[0, 1, 2, 3, 4, 5, 6, 7]", ""),  # exactly eight: all shown
        (range(8, -1, -1), "[0, 1, 2, 3, 4, 5, 6, 7]", " (and 1 more)"),  # nine: one hidden
        (range(19, -1, -1), "[0, 1, 2, 3, 4, 5, 6, 7]", " (and 12 more)"),
    ],
)
def test_an_unknown_key_shows_the_first_eight_known_keys_sorted_and_counts_the_rest(
    known, shown, more
):
    err = errors.unknown_key(99, set(known))
    assert isinstance(err, errors.UnknownKeyError)
    assert str(err) == (
        f"key 99 has not been initialised: expected one of {shown}{more}, given 99. "
        "Call init(99, value) first."
    )


def test_an_unknown_str_key_is_named_by_its_repr_among_sorted_str_keys():
    err = errors.unknown_key("w", ["c", "a", "b"])
    assert str(err).startswith("key 'w' has not been initialised: expected one of ['a', 'b', 'c'],")
    assert "given 'w'" in str(err) and "init('w', value)" in str(err)
    with pytest.raises(KeyError):
        raise err


def test_an_unknown_key_in_an_empty_store_expects_none():
    assert "expected one of [], given 0" in str(errors.unknown_key(0, []))


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        ("w", "key 'w'"),
        (3, "key 3"),
        (["a", "b"], "keys ['a', 'b']"),
        ({"a": 1, "b": 2}, "keys ['a', 'b']"),
        (list(range(9)), "keys [0, 1, 2, 3, 4, 5, 6, 7 ...]"),
        ("k" * 500, "key 'kkkk"),
    ],
)
def test_named_says_a_key_or_the_first_eight_keys_of_a_list(keys, said):
    """One key as `key K`, a list (or a mapping's keys) as `keys [...]`: its first eight, then
    ` ...`; a long key shortened as `shown` shortens it."""
    got = errors.named(keys)
    assert got.startswith(said)
    assert len(got) < 200
