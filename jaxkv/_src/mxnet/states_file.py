"""MXNet 1.9.1's optimizer-state files read without running any of their code: a restricted
reader of the known structure its ``save_optimizer_states`` pickles.

MXNet's file is ``pickle.dumps(states)``, or ``pickle.dumps((states, optimizer))`` with
``dump_optimizer=True``: ``states`` maps each key to its optimizer state (``None``, an
``NDArray``, or a tuple of them, nested under ``multi_precision``); each ``NDArray`` pickles as
its class and the bytes of MXNet's ``NDArray::Save`` (a magic number, the storage type, the
shape, the context, the dtype, the data, and for a row-sparse array its row ids); the optimizer
as its class and its ``__dict__`` (its schedule likewise). A pickle may name any callable, and
loading it calls them; this reader resolves only those names, to stand-ins of its own that
record what the file holds, and refuses any other name before it is called.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

import numpy as np

from jaxkv._src.checkpoint import disk
from jaxkv._src.checkpoint.npz import is_pickle
from jaxkv._src.errors import KVStoreError, shown

__all__ = [
    "Saved",
    "SavedArray",
    "as_record",
    "filled",
    "is_pickle_file",
    "read",
    "slots_of",
]

# NDArray::Save's magic numbers (MXNet's src/ndarray/ndarray.cc): V2, and V3 (NumPy shapes).
_MAGICS = (0xF993FAC9, 0xF993FACA)
# mshadow's type flags (MXNet's include/mshadow/base.h).
_DTYPES = {
    0: np.float32,
    1: np.float64,
    2: np.float16,
    3: np.uint8,
    4: np.int32,
    5: np.int8,
    6: np.int64,
    7: np.bool_,
}
_ARRAYS = {
    ("mxnet.ndarray.ndarray", "NDArray"),
    ("mxnet.ndarray.sparse", "RowSparseNDArray"),
    ("mxnet.numpy.multiarray", "ndarray"),
}
_OBJECT_MODULES = ("mxnet.optimizer.optimizer", "mxnet.optimizer", "mxnet.lr_scheduler")


def is_pickle_file(fname: Any) -> bool:
    """Whether ``fname`` is a file that starts as a pickle (a directory, a missing or an
    unreadable file is not: the store's own loader reports those)."""
    try:
        with open(fname, "rb") as f:
            return is_pickle(f.read(2))
    except OSError:
        return False


class SavedArray:
    """An MXNet array of the file: ``value`` (dense, a NumPy array) once its state is set."""

    value: np.ndarray

    def __init__(self, *args: Any) -> None:
        if args not in ((), (None,)):
            raise _Refused(f"an array made from {args!r}")

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("handle"), bytes | bytearray):
            raise _Refused(f"an array's state of {type(state).__name__}")
        self.value = _ndarray(bytes(state["handle"]))


class Saved:
    """An MXNet object of the file (its optimizer, its schedule): its class name and fields."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fields: dict[str, Any] = {}

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]
        if not isinstance(state, dict):
            raise _Refused(f"the fields of {self.name} as {type(state).__name__}")
        self.fields.update(state)


class _Refused(Exception):
    """Something the reader does not take: raised as a ``KVStoreError`` naming the file."""


def _object_class(name: str) -> type:
    """A stand-in class for MXNet's ``name`` (an optimizer or a schedule): ``cls()``,
    ``cls.__new__(cls)`` and ``__setstate__`` record; nothing of MXNet's runs."""

    def new(cls: type, *args: Any, **kwargs: Any) -> Saved:  # noqa: ARG001
        return Saved(name)

    return type(name, (), {"__new__": new})


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:  # copyreg._reconstructor
    if not isinstance(cls, type) or base is not object or state is not None:
        raise _Refused("an object made by copyreg from other than object")
    return cls()


def _latin1(text: Any, encoding: Any = "utf-8") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _Refused(f"an encoding of {type(text).__name__} as {encoding!r}")
    return text.encode("latin1")


class _Reader(pickle.Unpickler):
    """A pickle reader that resolves MXNet's array, optimizer and schedule classes to stand-ins
    and refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ARRAYS:
            return SavedArray
        if module in ("builtins", "__builtin__") and name == "bytearray":
            return bytearray
        if module == "copyreg" and name == "_reconstructor":
            return _reconstructor
        if module == "_codecs" and name == "encode":  # bytes under protocol 2
            return _latin1
        if module.startswith(_OBJECT_MODULES) and name.isidentifier():
            return _object_class(name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"a persistent id {pid!r}")


def _shape(view: memoryview, at: int) -> tuple[tuple[int, ...], int]:
    (ndim,) = struct.unpack_from("<i", view, at)
    if not 0 <= ndim <= 32:
        raise _Refused(f"an array of {ndim} dimensions")
    dims = struct.unpack_from(f"<{ndim}q", view, at + 4)
    if any(d < 0 for d in dims):
        raise _Refused(f"an array of shape {dims}")
    return tuple(dims), at + 4 + 8 * ndim


def _take(view: memoryview, at: int, dtype: Any, shape: tuple[int, ...]) -> tuple[Any, int]:
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if at + n > len(view):
        raise _Refused("an array cut short")
    return np.frombuffer(view[at : at + n], dtype).reshape(shape).copy(), at + n


def _ndarray(raw: bytes) -> np.ndarray:
    """An array from the bytes of MXNet's ``NDArray::Save``, as a dense NumPy array."""
    view = memoryview(raw)
    try:
        magic, stype = struct.unpack_from("<Ii", view, 0)
        if magic not in _MAGICS or stype not in (0, 1):
            raise _Refused(f"an array of magic {magic:#x} and storage type {stype}")
        at = 8
        if stype == 1:  # row_sparse: the shape of its rows (not always kept up to date: its
            _, at = _shape(view, at)  # row ids say how many rows follow), then the whole shape
        shape, at = _shape(view, at)
        at += 8  # the context: device type and id
        (flag,) = struct.unpack_from("<i", view, at)
        at += 4
        if flag not in _DTYPES:
            raise _Refused(f"an array of MXNet type {flag}")
        dtype = _DTYPES[flag]
        if stype == 0:
            value, at = _take(view, at, dtype, shape)
            return value
        (id_flag,) = struct.unpack_from("<i", view, at)
        id_shape, at = _shape(view, at + 4)
        if len(id_shape) != 1 or not shape:
            raise _Refused(f"row ids of shape {id_shape} for an array of shape {shape}")
        rows, at = _take(view, at, dtype, (id_shape[0], *shape[1:]))
        ids, at = _take(view, at, _DTYPES.get(id_flag, np.int64), id_shape)
        dense: np.ndarray = np.zeros(shape, dtype)
        if ids.size and (ids.min() < 0 or ids.max() >= shape[0]):
            raise _Refused("row ids outside the array")
        dense[ids.astype(np.int64)] = rows
        return dense
    except struct.error as e:
        raise _Refused(f"an array cut short ({e})") from None


def _plain(x: Any) -> Any:
    """The file's value with its arrays as NumPy arrays and its objects as ``Saved``."""
    if isinstance(x, SavedArray):
        return x.value
    if isinstance(x, Saved):
        x.fields = {k: _plain(v) for k, v in x.fields.items()}
        return x
    if isinstance(x, tuple | list):
        return type(x)(_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def read(fname: str) -> tuple[dict[Any, Any], Saved | None]:
    """The states (key -> ``None``, an array, or a tuple of them) and, where it was dumped, the
    optimizer (``Saved``) of MXNet's optimizer-state file ``fname``.

    Raises:
      KVStoreError: the file holds anything else than MXNet's states and optimizer (naming
        it), or cannot be read (a disk fault names ``fname`` and the OS's reason); nothing it
        names is called.
    """
    try:
        with disk.faults(fname, writing=False), open(fname, "rb") as f:
            raw = f.read()
        loaded = _Reader(io.BytesIO(raw)).load()
        states, optimizer = loaded, None
        if isinstance(loaded, tuple) and len(loaded) == 2 and isinstance(loaded[1], Saved):
            states, optimizer = loaded
        if not isinstance(states, dict):
            raise _Refused(f"states as {type(states).__name__}, not a dict of keys")
        return _plain(states), _plain(optimizer) if optimizer is not None else None
    except _Refused as e:
        raise KVStoreError(
            f"{fname}: expected MXNet's optimizer states (a dict of NDArrays, and its optimizer "
            f"with dump_optimizer=True), given {e}; jaxkv reads such files without running "
            "their code, and refuses anything else they hold"
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise KVStoreError(
            f"{fname}: expected MXNet's optimizer states, given a file that cannot be read "
            f"({type(e).__name__}: {e})"
        ) from None


# MXNet's optimizers whose multi-precision state is (state, float32 copy); the others keep
# (float32 copy, state), as MXNet's Optimizer.create_state_multi_precision.
_STATE_FIRST = ("SGD", "ccSGD", "NAG", "LARS", "LBSGD")


def _arrays(x: Any) -> list[np.ndarray]:
    if x is None:
        return []
    if isinstance(x, np.ndarray):
        return [x]
    if isinstance(x, tuple | list):
        return [a for v in x for a in _arrays(v)]
    raise _Refused(f"a state of {type(x).__name__}")


def slots_of(state: Any, name: str, master: bool) -> list[np.ndarray]:
    """One key's MXNet state as jaxkv's slots of the optimizer ``name``, in their order (the
    float32 copy last, where ``master``)."""
    try:
        if not master:
            return _arrays(state)
        if not isinstance(state, tuple) or len(state) != 2:
            raise _Refused("a multi-precision state that is not (state, float32 copy)")
        inner, copy = (state[0], state[1]) if name in _STATE_FIRST else (state[1], state[0])
        return [*_arrays(inner), *_arrays(copy)]
    except _Refused as e:
        raise KVStoreError(f"MXNet's optimizer states: {e}") from None


def filled(
    fname: str, key: Any, leaves: list[Any], count: Any, slots: list[np.ndarray]
) -> list[np.ndarray]:
    """The leaves of a key's jaxkv optimizer state (``leaves``: the template's, its count
    first) filled with ``count`` and MXNet's ``slots``: each of the template's shape and dtype
    (a state MXNet keeps per row, broadcast along it); slots jaxkv keeps beyond MXNet's (Ftrl's
    residual) start at zeros."""
    want = leaves[1:]
    if len(slots) > len(want) or not slots and want:
        shapes = [tuple(x.shape) for x in slots]
        raise KVStoreError(
            f"{fname}: key {shown(key)}: MXNet's optimizer state holds arrays of shapes {shapes}, "
            f"expected {[tuple(t.shape) for t in want]} for this store's optimizer; load it "
            "into a store with the optimizer (and arguments) that saved it"
        )
    out = [np.asarray(count, leaves[0].dtype)]
    for j, t in enumerate(want):
        if j >= len(slots):
            out.append(np.zeros(t.shape, t.dtype))
            continue
        x = slots[j]
        try:
            out.append(np.broadcast_to(x, t.shape).astype(t.dtype))
        except ValueError:
            raise KVStoreError(
                f"{fname}: key {shown(key)}: MXNet's optimizer state holds an array of shape "
                f"{tuple(x.shape)}, expected {tuple(t.shape)} (the stored value's); load it "
                "into a store with the keys and optimizer that saved it"
            ) from None
    return out


def as_record(saved: Saved, opt: Any) -> dict[str, Any]:
    """A dumped MXNet optimizer as jaxkv's record of one (``Optimizer.record``'s form) for
    ``opt``: its class, the arguments ``opt`` has too, its numbers, counts and schedule."""
    from jaxkv._src.mxnet.optimizers.optimizer import as_json

    fields = saved.fields
    mine = opt._repr_args()  # noqa: SLF001 - the arguments a record compares
    args = {
        k: fields["lr" if k == "learning_rate" else k]
        for k in mine
        if ("lr" if k == "learning_rate" else k) in fields
    }
    args.update({k: v for k, v in mine.items() if k not in args})  # (not MXNet's fields)
    scheduler = fields.get("lr_scheduler")
    sched_record = None
    if isinstance(scheduler, Saved):
        ours = dict(vars(opt.lr_scheduler)) if opt.lr_scheduler is not None else {}
        ours.update({k: v for k, v in scheduler.fields.items() if k in ours})
        sched_record = {"class": scheduler.name, "state": as_json(ours)}
    numbers = {n: fields.get(n, getattr(opt, n)) for n in ("lr", "wd", "rescale_grad")}
    numbers["clip_gradient"] = fields.get("clip_gradient", opt.clip_gradient)
    numbers["lr_mult"] = dict(fields.get("lr_mult", {}))
    numbers["wd_mult"] = dict(fields.get("wd_mult", {}))
    return {
        "class": saved.name,
        "args": as_json(args),
        "numbers": as_json(numbers),
        "num_update": int(fields.get("num_update", opt.begin_num_update)),
        "begin_num_update": int(fields.get("begin_num_update", 0)),
        "counts": as_json(dict(fields.get("_index_update_count", {}))),
        "scheduler": sched_record,
        "host": as_json(opt._host_state()),  # noqa: SLF001 - kept: MXNet's is not this form
    }
