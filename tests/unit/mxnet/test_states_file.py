"""jaxkv/_src/mxnet/states_file.py: MXNet's optimizer-state pickles read without running them."""

import pickle
import struct

import numpy as np
import pytest

import jaxkv
from jaxkv._src.mxnet import states_file as sf


def _shape(dims):
    return struct.pack("<i", len(dims)) + struct.pack(f"<{len(dims)}q", *dims)


def _dense(x, flag=0):
    head = struct.pack("<Ii", 0xF993FAC9, 0) + _shape(x.shape) + struct.pack("<iii", 1, 0, flag)
    return head + x.tobytes()


def _row_sparse(shape, ids, rows, stale=0):
    """As MXNet's NDArray::Save writes one, its storage shape as stale as MXNet leaves it."""
    out = struct.pack("<Ii", 0xF993FAC9, 1) + _shape((stale, shape[1])) + _shape(shape)
    out += struct.pack("<iii", 1, 0, 0) + struct.pack("<i", 6) + _shape((len(ids),))
    return out + rows.astype(np.float32).tobytes() + np.asarray(ids, np.int64).tobytes()


class _Array:
    """An array as MXNet pickles one: its class, (None,), then {'handle': bytearray}."""

    def __init__(self, raw, module="mxnet.ndarray.ndarray", name="NDArray"):
        self.raw, self.module, self.name = raw, module, name


def _ops(x):
    """Pickle opcodes (protocol 3) for ``x``: dicts of str keys, tuples, None, ``_Array``s."""
    if x is None:
        return b"N"
    if isinstance(x, str):
        data = x.encode()
        return b"X" + struct.pack("<I", len(data)) + data
    if isinstance(x, tuple):
        return b"(" + b"".join(_ops(v) for v in x) + b"t"
    if isinstance(x, dict):
        return b"}" + b"".join(_ops(k) + _ops(v) + b"s" for k, v in x.items())
    if isinstance(x, _Array):
        made = f"c{x.module}\n{x.name}\nN\x85R".encode("latin1")
        handle = b"cbuiltins\nbytearray\nB" + struct.pack("<I", len(x.raw)) + x.raw + b"\x85R"
        return made + b"}" + _ops("handle") + handle + b"sb"
    raise TypeError(x)


def _write(tmp_path, obj):
    path = tmp_path / "states"
    if isinstance(obj, dict) and any(isinstance(v, _Array | tuple) for v in obj.values()):
        path.write_bytes(b"\x80\x03" + _ops(obj) + b".")
    else:
        path.write_bytes(pickle.dumps(obj, protocol=4))
    return str(path)


def test_arrays_dense_and_row_sparse(tmp_path):
    dense = np.arange(6, dtype=np.float32).reshape(2, 3)
    half = np.ones(4, np.float16)
    rows = np.full((2, 3), 0.5, np.float32)
    states = {
        "d": (_Array(_dense(dense)), _Array(_dense(half, flag=2))),
        "e": _Array(_row_sparse((4, 3), [1, 3], rows), "mxnet.ndarray.sparse", "RowSparseNDArray"),
        "n": None,
    }
    got, optimizer = sf.read(_write(tmp_path, states))
    assert optimizer is None
    np.testing.assert_array_equal(got["d"][0], dense)
    assert got["d"][1].dtype == np.float16
    want = np.zeros((4, 3), np.float32)
    want[[1, 3]] = 0.5
    np.testing.assert_array_equal(got["e"], want)
    assert got["n"] is None


@pytest.mark.parametrize(
    "raw, what",
    [
        (b"\x00\x01\x02\x03" + b"\x00" * 8, "magic"),
        (_dense(np.ones(3, np.float32))[:-4], "cut short"),
        (_dense(np.ones(3, np.float32), flag=99), "MXNet type 99"),
        (_row_sparse((4, 3), [7], np.ones((1, 3))), "row ids outside"),
    ],
)
def test_damaged_arrays_are_refused(tmp_path, raw, what):
    with pytest.raises(jaxkv.KVStoreError, match=what):
        sf.read(_write(tmp_path, {"k": _Array(raw)}))


def test_other_globals_are_refused_before_they_run(tmp_path):
    class Trap:
        def __reduce__(self):
            return (print, ("ran",))

    with pytest.raises(jaxkv.KVStoreError, match=r"builtins\.print"):
        sf.read(_write(tmp_path, {"k": Trap()}))
    with pytest.raises(jaxkv.KVStoreError, match="numpy"):
        sf.read(_write(tmp_path, {"k": np.zeros(2)}))
    with pytest.raises(jaxkv.KVStoreError, match="states as list"):
        sf.read(_write(tmp_path, [1, 2]))


def test_multi_precision_states_in_jaxkvs_slot_order():
    m, v, copy = np.zeros(2), np.ones(2), np.full(2, 2.0)
    assert [x[0] for x in sf.slots_of((copy, (m, v)), "Adam", True)] == [0, 1, 2]
    assert [x[0] for x in sf.slots_of((m, copy), "SGD", True)] == [0, 2]
    assert [x[0] for x in sf.slots_of((None, copy), "SGD", True)] == [2]
    assert sf.slots_of(None, "SGD", False) == []
    with pytest.raises(jaxkv.KVStoreError, match="not \\(state, float32 copy\\)"):
        sf.slots_of(m, "Adam", True)


def test_filled_broadcasts_per_row_states_and_adds_jaxkvs_own_slots():
    t = [np.zeros((), np.int32), np.zeros((4, 3), np.float32), np.zeros((4, 3), np.float32)]
    got = sf.filled("f", "k", t, 5, [np.arange(4.0).reshape(4, 1)])
    assert int(got[0]) == 5
    np.testing.assert_array_equal(got[1], np.repeat(np.arange(4.0).reshape(4, 1), 3, axis=1))
    np.testing.assert_array_equal(got[2], 0)
    with pytest.raises(jaxkv.KVStoreError, match=r"shape \(5,\), expected \(4, 3\)"):
        sf.filled("f", "k", t, 0, [np.zeros(5)])
    with pytest.raises(jaxkv.KVStoreError, match="holds arrays of shapes"):
        sf.filled("f", "k", t, 0, [np.zeros((4, 3))] * 3)


def test_only_a_file_that_starts_as_a_pickle_is_one(tmp_path):
    assert not sf.is_pickle_file(tmp_path)  # a checkpoint directory
    assert not sf.is_pickle_file(tmp_path / "missing")
    (tmp_path / "npz").write_bytes(b"PK\x03\x04")
    assert not sf.is_pickle_file(tmp_path / "npz")
    (tmp_path / "p").write_bytes(pickle.dumps({}, protocol=2))
    assert sf.is_pickle_file(tmp_path / "p")
