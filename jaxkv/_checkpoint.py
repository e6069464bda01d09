"""Saving and loading a store: one ``.npz`` file, written atomically, checked on load, no pickle.

Layout: ``manifest`` (UTF-8 JSON as ``uint8``) lists every array with its key, part (``value``,
``opt`` or ``residual``), tree path, shape, dtype and SHA-256, and the store's compression;
``a0``, ``a1``, ... hold the raw bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from typing import Any

import jax
import numpy as np

from ._errors import KVStoreError
from ._ops import host_copy, residual_layout
from ._state import KVState

__all__ = ["load", "save"]

_FORMAT = "jaxkv-store"
_VERSION = 1


def _entries(state: KVState, values: bool):
    """``(key, part, path, array)`` for every array to save, in a fixed order."""
    for key in state.keys():
        if values:
            yield key, "value", "", state[key]
        leaves = jax.tree_util.tree_flatten_with_path(state.opt_states[key])[0]
        for path, leaf in leaves:
            yield key, "opt", jax.tree_util.keystr(path), leaf
        if values and state.residuals[key] is not None:
            yield key, "residual", "", state.residuals[key]


def _single_process(fname: str) -> None:
    if jax.process_count() > 1:
        raise KVStoreError(
            f"{fname}: saving and loading expect a single-process job, given "
            f"{jax.process_count()} processes (not supported across processes yet)"
        )


def save(fname: str, state: KVState, *, values: bool) -> None:
    """Write ``state`` (values and/or optimizer states) to ``fname`` atomically."""
    _single_process(fname)
    manifest: dict[str, Any] = {
        "format": _FORMAT,
        "version": _VERSION,
        "values": values,
        "keys": list(state.keys()),
        "arrays": [],
        "compression": list(state.compression or []) or None,
    }
    arrays = {}
    for n, (key, part, path, leaf) in enumerate(_entries(state, values)):
        host = host_copy(leaf)  # a sharded value: gathered without JAX caching a copy on it
        if host is None:
            host = np.asarray(jax.device_get(leaf))
        raw = np.frombuffer(host.tobytes(), np.uint8)
        arrays[f"a{n}"] = raw
        manifest["arrays"].append(
            {
                "key": key,
                "part": part,
                "path": path,
                "shape": list(host.shape),
                "dtype": str(host.dtype),
                "sha256": hashlib.sha256(raw.tobytes()).hexdigest(),
            }
        )
    arrays["manifest"] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
    directory = os.path.dirname(os.path.abspath(fname))
    fd, tmp = tempfile.mkstemp(prefix=".jaxkv-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, fname)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _read(fname: str) -> tuple[dict, list[np.ndarray]]:
    try:
        with np.load(fname, allow_pickle=False) as z:
            manifest = json.loads(bytes(z["manifest"]).decode())
            if manifest.get("format") != _FORMAT or manifest.get("version") != _VERSION:
                raise KVStoreError(
                    f"{fname}: expected a {_FORMAT} v{_VERSION} file, given format "
                    f"{manifest.get('format')!r} v{manifest.get('version')!r}"
                )
            arrays = []
            for n, entry in enumerate(manifest["arrays"]):
                raw = z[f"a{n}"]
                if hashlib.sha256(raw.tobytes()).hexdigest() != entry["sha256"]:
                    raise KVStoreError(
                        f"{fname}: key {entry['key']!r} {entry['part']}{entry['path']}: "
                        "checksum mismatch, expected the saved SHA-256, given different bytes "
                        "(the file is corrupt)"
                    )
                dtype = jax.numpy.dtype(entry["dtype"])
                arrays.append(np.frombuffer(raw.tobytes(), dtype).reshape(entry["shape"]))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise KVStoreError(
            f"{fname}: expected a jaxkv store file, given one that cannot be "
            f"read ({type(e).__name__}: {e})"
        ) from None
    return manifest, arrays


def load(fname: str, state: KVState, *, values: bool, optimizer: Any = None) -> KVState:
    """``state`` with what ``fname`` holds loaded into it; refuses any mismatch before changing.

    With ``values=True`` the file's keys replace the store's contents; optimizer states in the
    file need ``optimizer`` (to rebuild their structure). With ``values=False`` only optimizer
    states are loaded, into a store whose keys and optimizer structure match the file.
    """
    _single_process(fname)
    manifest, arrays = _read(fname)
    if manifest["values"] != values:
        want = "a whole-store file (save)" if values else "an optimizer-state file"
        raise KVStoreError(f"{fname}: expected {want}, given the other kind")
    keys = manifest["keys"]
    by_key: dict[Any, dict[str, list]] = {k: {"value": [], "opt": [], "residual": []} for k in keys}
    for entry, arr in zip(manifest["arrays"], arrays):
        by_key[entry["key"]][entry["part"]].append((entry["path"], arr))

    if values:
        compression = manifest.get("compression")
        base = KVState(
            (),
            state.devices,
            (),
            (),
            state.bigarray_bound,
            (),
            tuple(compression) if compression else None,
        )
        new_values, residuals = {}, {}
        for k in keys:
            value = by_key[k]["value"][0][1]
            new_values[k] = jax.device_put(value, base.sharding_for(value.shape))
            for _, r in by_key[k]["residual"]:
                expected, sharding = residual_layout(base, value.shape)
                if r.shape != expected:
                    raise KVStoreError(
                        f"{fname}: key {k!r}: residual expected shape {expected} (one block per "
                        f"device of this store), given {r.shape}"
                    )
                residuals[k] = jax.device_put(r, sharding)
        base = base.replace(values=new_values, residuals=residuals)
        templates = {}
        for k in keys:
            if by_key[k]["opt"]:
                if optimizer is None:
                    raise KVStoreError(
                        f"{fname}: key {k!r} has optimizer state: expected a store with an "
                        "optimizer to load it into, given none; call set_optimizer first"
                    )
                templates[k] = jax.eval_shape(optimizer.init, base[k])
            else:
                templates[k] = None
    else:
        if sorted(map(repr, keys)) != sorted(map(repr, state.keys())):
            raise KVStoreError(
                f"{fname}: expected optimizer states for keys "
                f"{list(state.keys())}, given keys {keys}"
            )
        base = state
        templates = {k: state.opt_states[k] for k in keys}

    opt_states = {}
    for k in keys:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(templates[k])
        saved = by_key[k]["opt"]
        want = [(jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype)) for p, x in leaves]
        given = [(p, tuple(a.shape), str(a.dtype)) for p, a in saved]
        if want != given:
            raise KVStoreError(
                f"{fname}: key {k!r}: optimizer state expected {want}, given {given}"
            )
        placed = [jax.device_put(a, base.sharding_for(a.shape)) for _, a in saved]
        opt_states[k] = jax.tree_util.tree_unflatten(treedef, placed)
    return base.replace(opt_states=opt_states)
