"""Saving and loading a store: one ``.npz`` file, written atomically, checked on load, no pickle.

Layout: ``manifest`` (UTF-8 JSON as ``uint8``) lists the keys, the optimizer groups (lists of
keys), the store's compression, and every array with its key (or, for optimizer state, its
group's index), part (``value``, ``opt`` or ``residual``), tree path, shape, dtype and SHA-256;
``manifest_sha256`` holds the manifest's own SHA-256 (hex, ASCII); ``a0``, ``a1``, ... hold the
raw bytes. Loading checks both checksums and every manifest field, so any malformed file is a
:class:`KVStoreError`, before the store changes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv._src.checkpoint import disk, orbax_dirs
from jaxkv._src.checkpoint.manifest import FORMAT, VERSION, Malformed, check_manifest
from jaxkv._src.core.compression import residual_layout
from jaxkv._src.core.tree_view import inner, viewed_trees
from jaxkv._src.errors import KVStoreError
from jaxkv._src.state.buckets import leaf_owner
from jaxkv._src.state.kvstate import Key, KVState, check_compressible
from jaxkv._src.state.placement import host_copy
from jaxkv._src.state.tree_shapes import TreeShape, entries_of, from_entries

__all__ = [
    "directory_contents",
    "is_pickle",
    "load",
    "load_state",
    "load_with_record",
    "save",
    "save_state",
]


def _entries(state: KVState, values: bool) -> Iterator[tuple[dict[str, Key], str, str, jax.Array]]:
    """``(where, part, path, array)`` for every array to save, in a fixed order; ``where`` is
    ``{'key': key}``, or ``{'group': index}`` for optimizer state."""
    if values:
        for key in state.keys():
            yield {"key": key}, "value", "", state[key]
            if state.residuals[key] is not None:
                yield {"key": key}, "residual", "", state.residuals[key]
    for n, opt in enumerate(state.opt_states.values()):
        for path, leaf in jax.tree_util.tree_flatten_with_path(opt)[0]:
            yield {"group": n}, "opt", jax.tree_util.keystr(path), leaf


def _label(entry: dict) -> str:
    """How an array entry is named in messages."""
    if "group" in entry:
        return f"optimizer group {entry['group']} {entry['part']}{entry['path']}"
    return f"key {entry['key']!r} {entry['part']}{entry['path']}"


def _processes(fname: str, state: KVState) -> int:
    """How many processes hold ``state``'s devices: 1, or all of the job's (a store over some
    of them cannot save or load with the others, who would wait for it)."""
    held = {d.process_index for d in state.devices}
    if len(held) > 1 and len(held) != jax.process_count():
        raise KVStoreError(
            f"{fname}: expected a store on one process's devices or on every process's, given "
            f"one on processes {sorted(held)} of {jax.process_count()}"
        )
    return len(held)


def _together(fname: str, state: KVState) -> None:
    """A checkpoint directory is written and read by every process of the job together, so
    in a multi-process job only by a store over all of them."""
    if jax.process_count() > 1 and _processes(fname, state) == 1:
        raise KVStoreError(
            f"{fname}: a checkpoint directory is saved and loaded by every process of the job "
            f"together, into a store over all their devices (dist_sync), given a store on "
            f"process {jax.process_index()}'s devices only; save such a store to a file"
        )


def _header(state: KVState, values: bool, record: dict | None = None) -> dict[str, Any]:
    """The manifest's fields other than the arrays' (``trees``, the paths of each tree given
    to init, and ``tree_paths``, each tree's keys in its leaf order with their paths' entries
    (``None`` where the structure has an entry of another kind), only where the store holds
    trees; ``optimizer``, an MXNet optimizer's record,
    only where one is given)."""
    header = {
        "format": FORMAT,
        "version": VERSION,
        "values": values,
        "keys": list(state.keys()),
        "groups": [list(g) for g in state.opt_states],
        "arrays": [],
        "compression": list(state.compression or []) or None,
    }
    if state.trees:
        header["trees"] = [list(t) for t in state.trees]
        header["tree_paths"] = [tree_paths(t) for t in state.trees]
    if state.tp_specs:  # each key's own sharding along other mesh axes than the store's
        header["tp"] = [[k, [_entry(e) for e in spec]] for k, spec in state.tp_specs]
    if record is not None:
        header["optimizer"] = record
    return header


def tree_paths(tree: TreeShape) -> list | None:
    """``tree``'s keys in its leaf order, each with its path's entries (``[key, [["key",
    "params"], ["idx", 0], ...]]``), for the manifest: what rebuilds its structure on load."""
    entries = None if tree.treedef is None else entries_of(tree.treedef)
    return None if entries is None else [[k, e] for k, e in zip(tree.leaf_keys, entries)]


def loaded_trees(manifest: dict, like: KVState) -> list[TreeShape]:
    """The trees of a manifest: the store ``like``'s tree of the same keys and structure where
    it has one (its own structure, whatever its node types), else rebuilt from ``tree_paths``
    (mappings as dicts, sequences as lists, other nodes as dicts of their attributes), else,
    for a checkpoint that has none, nested dicts from the keys split at ``/``."""
    saved = manifest.get("tree_paths") or [None] * len(manifest.get("trees", []))
    out = []
    for keys, paths in zip(manifest.get("trees", []), saved):
        mine = next((t for t in like.trees if t == tuple(keys) and t.treedef is not None), None)
        if mine is not None and (paths is None or tree_paths(mine) == paths):
            out.append(mine)
        elif paths is not None:
            out.append(from_entries([k for k, _ in paths], [e for _, e in paths]))
        else:
            out.append(TreeShape(keys))
    return out


def _flat_keys_state(optimizer: Any, like: dict) -> list | None:
    """The ``(path, shape, dtype)`` of each leaf of ``optimizer.init`` of the flat mapping
    ``like`` (what a store handed optax before it handed the tree), or ``None`` where that
    init raises (an optimizer that needs the tree)."""
    try:
        flat = jax.eval_shape(optimizer.init, like)
    except Exception:
        return None
    return [
        (jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype))
        for p, x in jax.tree_util.tree_flatten_with_path(flat)[0]
    ]


def _entry(entry: Any) -> Any:
    return entry if entry is None or isinstance(entry, str) else list(entry)


def _kept_tp(base: KVState, manifest: dict, like: dict) -> dict[Any, PartitionSpec]:
    """The saved keys' own shardings that the store loaded into keeps: those whose axes its
    mesh of several axes has, other than its own, and which divide the value (elsewhere a
    value is placed by the store's rules: the same numbers)."""
    kept: dict[Any, PartitionSpec] = {}
    if not base.multi_axis:
        return kept
    names = set(base.mesh.axis_names) - set(base.mesh_axes)
    for key, entries in manifest.get("tp", []):
        spec = PartitionSpec(*[e if e is None or isinstance(e, str) else tuple(e) for e in entries])
        used = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
        if not used <= names or key not in like:
            continue
        shape = tuple(like[key].shape)
        if any(
            e is not None
            and shape[d]
            % math.prod(base.mesh.shape[a] for a in ((e,) if isinstance(e, str) else e))
            for d, e in enumerate(spec)
        ):
            continue
        kept[key] = spec
    return kept


def directory_contents(fname: str, state: KVState) -> tuple[dict[str, Any], list]:
    """What a whole-store checkpoint directory of ``state`` at ``fname`` holds, as ``save``
    writes one: the manifest's store fields and the ``(where, part, tree path, array)`` entries;
    a state that the job's processes cannot save together is refused first."""
    _together(fname, state)
    return _header(state, True), list(_entries(state, True))


def _sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def save(
    fname: str | os.PathLike[str],
    state: KVState,
    *,
    values: bool,
    directory: bool = False,
    record: dict | None = None,
) -> None:
    """Write ``state`` (values and/or optimizer states) to ``fname`` atomically: one file for
    a store on one process, a checkpoint directory (``orbax_dirs.py``) for a store over every
    process of a job, or where ``fname`` already is one (or ``directory`` asks for one).
    ``record``: an MXNet optimizer's bookkeeping (JSON), kept in the manifest. A file is
    written through a symbolic link, as ``numpy.save`` writes one. A disk fault is a
    :class:`KVStoreError` naming ``fname`` and the OS's reason; what ``fname`` held is kept."""
    fname = os.fspath(fname)
    if directory or _processes(fname, state) > 1 or orbax_dirs.is_checkpoint(fname):
        _together(fname, state)
        orbax_dirs.save(fname, _header(state, values, record), list(_entries(state, values)))
        return
    manifest = _header(state, values, record)
    arrays = {}
    for n, (where, part, path, leaf) in enumerate(_entries(state, values)):
        host = host_copy(leaf)  # a sharded value: gathered without JAX caching a copy on it
        if host is None:
            host = np.asarray(jax.device_get(leaf))
        raw = host.tobytes()
        arrays[f"a{n}"] = np.frombuffer(raw, np.uint8)
        manifest["arrays"].append(
            {
                **where,
                "part": part,
                "path": path,
                "shape": list(host.shape),
                "dtype": str(host.dtype),
                "sha256": _sha256(raw),
            }
        )
    text = json.dumps(manifest).encode()
    arrays["manifest"] = np.frombuffer(text, np.uint8)
    arrays["manifest_sha256"] = np.frombuffer(_sha256(text).encode(), np.uint8)
    # Its directories are made, as a checkpoint directory's save makes them. numpy's stub: a **
    # argument might reach savez's allow_pickle.
    with disk.replacing(fname) as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]


def is_pickle(head: bytes) -> bool:
    """Whether a file starting with ``head`` (its first bytes) is a pickle (protocol 2 or
    later: MXNet's)."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def _read(fname: str) -> tuple[dict, list[np.ndarray]]:
    """The manifest and arrays of ``fname``, every checksum and manifest field checked."""
    try:
        # The file is ours to close, whatever np.load makes of it.
        with disk.faults(fname, writing=False), open(fname, "rb") as f:
            if is_pickle(f.read(2)):
                raise KVStoreError(
                    f"{fname}: expected a jaxkv store file, given a Python pickle, which jaxkv "
                    "never unpickles (that can run any code). MXNet's optimizer-state files "
                    "load through kv.load_optimizer_states under an MXNet optimizer, by a "
                    "reader that runs none of their code (docs/migrating-from-mxnet.md, "
                    "'Saving and loading optimizer states')"
                )
            f.seek(0)
            z = np.load(f, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise Malformed(f"expected an .npz archive, given one {type(z).__name__}")
            files = set(z.files)
            if "manifest_sha256" not in files:
                raise Malformed(
                    f"expected a {FORMAT} v{VERSION} file with a checksummed manifest, given "
                    "one without (saved by another program or an older jaxkv)"
                )
            text = bytes(z["manifest"])
            if _sha256(text) != bytes(z["manifest_sha256"]).decode("ascii", "replace"):
                raise KVStoreError(
                    f"{fname}: manifest checksum mismatch, expected the saved SHA-256, given "
                    "different bytes (the file is corrupt or was edited)"
                )
            manifest = json.loads(text.decode())
            check_manifest(manifest, files)
            arrays = []
            for n, entry in enumerate(manifest["arrays"]):
                raw = z[f"a{n}"].tobytes()
                if _sha256(raw) != entry["sha256"]:
                    raise KVStoreError(
                        f"{fname}: {_label(entry)}: checksum mismatch, expected the saved "
                        "SHA-256, given different bytes (the file is corrupt)"
                    )
                dtype = jnp.dtype(entry["dtype"])
                size = math.prod(entry["shape"]) * dtype.itemsize
                if len(raw) != size:
                    raise KVStoreError(
                        f"{fname}: {_label(entry)}: expected {size} bytes for shape "
                        f"{entry['shape']} of {dtype}, given {len(raw)}"
                    )
                arrays.append(np.frombuffer(raw, dtype).reshape(entry["shape"]))
    except KVStoreError:
        raise
    except Malformed as e:
        raise KVStoreError(f"{fname}: {e}") from None
    except (
        OSError,
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        EOFError,
        zipfile.BadZipFile,
        UnicodeDecodeError,
    ) as e:
        raise KVStoreError(
            f"{fname}: expected a jaxkv store file, given one that cannot be "
            f"read ({type(e).__name__}: {e})"
        ) from None
    return manifest, arrays


def load(
    fname: str | os.PathLike[str], state: KVState, *, values: bool, optimizer: Any = None
) -> KVState:
    """``state`` with what ``fname`` holds loaded into it (see :func:`load_with_record`)."""
    return load_with_record(fname, state, values=values, optimizer=optimizer)[0]


def load_with_record(
    fname: str | os.PathLike[str],
    state: KVState,
    *,
    values: bool,
    optimizer: Any = None,
    check_record: Any = None,
) -> tuple[Any, Any]:
    """``state`` with what ``fname`` holds loaded into it; refuses any mismatch before changing.

    ``fname`` is a file (this module's format) or a checkpoint directory (``orbax_dirs.py``'s). With
    ``values=True`` the saved keys replace the store's contents. With ``values=False`` only
    optimizer states are loaded, into a store with the saved keys. Optimizer states need
    ``optimizer`` (to rebuild their structure); the saved optimizer groups replace the store's.
    Arrays land on ``state``'s devices, whatever devices or processes saved them. Returns
    ``(state, record)``: ``record`` the MXNet optimizer's record saved with it (or ``None``),
    or what ``check_record(record)`` made of it, called before the arrays are checked.
    """
    fname = os.fspath(fname)
    if os.path.isdir(fname):
        _together(fname, state)
        manifest, restore = orbax_dirs.open_checkpoint(fname)
    else:
        manifest, arrays = _read(fname)

        def restore(targets: list) -> list:
            return jax.device_put(arrays, [t.sharding for t in targets])  # one call: faster

    record = manifest.get("optimizer")
    if check_record is not None:
        record = check_record(record)
    loaded = _assemble(fname, manifest, state, values, optimizer, restore)
    return loaded, record


def _assemble(
    fname: str, manifest: dict, state: KVState, values: bool, optimizer: Any, restore: Any
) -> KVState:
    """Check a (well-formed) manifest against ``state`` and ``optimizer``, then ``restore`` its
    arrays (given one ``jax.ShapeDtypeStruct`` with a sharding per manifest entry) and build the
    loaded state. Every check runs before a byte of array data is read."""
    if manifest["values"] != values:
        kind = "a whole-store file (save)" if values else "an optimizer-state file"
        raise KVStoreError(f"{fname}: expected {kind}, given the other kind")
    keys = manifest["keys"]
    groups = [tuple(sorted(g)) for g in manifest["groups"]]
    entries = manifest["arrays"]
    if values:
        compression = manifest.get("compression")
        base = KVState(
            keys=(),
            devices=state.devices,
            values=(),
            opt_states=(),
            bound=state.bigarray_bound,
            compression=tuple(compression or ()) or None,
            mesh=state.user_mesh,
            policy=state.policy,
            reduce=state.reduce,
            mesh_axes=state.mesh_axes,
        )
        like = {
            e["key"]: jax.ShapeDtypeStruct(tuple(e["shape"]), jnp.dtype(e["dtype"]))
            for e in entries
            if e["part"] == "value"
        }
    else:
        if sorted(map(repr, keys)) != sorted(map(repr, state.keys())):
            raise KVStoreError(
                f"{fname}: expected optimizer states for keys "
                f"{list(state.keys())}, given keys {keys}"
            )
        base = state
        like = {k: jax.ShapeDtypeStruct(state[k].shape, state[k].dtype) for k in keys}
    if groups and optimizer is None:
        raise KVStoreError(
            f"{fname}: keys {list(groups[0])} have optimizer state: expected a store with an "
            "optimizer to load it into, given none; call set_optimizer first"
        )

    kept = _kept_tp(base, manifest, like) if values else {}
    targets = []
    for e in entries:
        shape, dtype = tuple(e["shape"]), jnp.dtype(e["dtype"])
        if e["part"] == "value":
            check_compressible(base.compression, e["key"], dtype)
            if e["key"] in kept:
                sharding = NamedSharding(base.mesh, base.spec_with(shape, kept[e["key"]]))
            else:
                sharding = base.sharding_for(shape)
        elif e["part"] == "residual":
            value = like[e["key"]]
            expected, sharding = residual_layout(base, value.shape)
            if (shape, dtype) != (expected, value.dtype):
                raise KVStoreError(
                    f"{fname}: key {e['key']!r}: residual expected shape {expected} and dtype "
                    f"{value.dtype} (one block per device of this store), given {shape} "
                    f"and {dtype}"
                )
        else:
            sharding = base.sharding_for(shape)
        targets.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))

    treedefs = []
    trees = loaded_trees(manifest, state) if values else list(state.trees)
    if optimizer is not None:  # it sees the trees, as the store's pushes will hand them
        optimizer = viewed_trees(tuple(trees), optimizer)
    for n, group in enumerate(groups):
        template = jax.eval_shape(optimizer.init, {k: like[k] for k in group})
        leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
        want = [(jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype)) for p, x in leaves]
        given = [
            (e["path"], tuple(e["shape"]), str(jnp.dtype(e["dtype"])))
            for e in entries
            if e["part"] == "opt" and e["group"] == n
        ]
        if want != given:
            if inner(optimizer) is not optimizer and given == _flat_keys_state(
                inner(optimizer), {k: like[k] for k in group}
            ):
                raise KVStoreError(
                    f"{fname}: optimizer group {list(group)}: expected an optimizer state made "
                    "with the tree given to init, given one made when jaxkv handed optax a "
                    "flat mapping of the tree's keys (before jaxkv handed optax the tree, a "
                    "mask or labels by path saw 'a/b' keys, and this state follows them): "
                    "resumed under the tree it would give other numbers. Resume it with the "
                    "jaxkv release that saved it"
                )
            raise KVStoreError(
                f"{fname}: optimizer group {list(group)}: optimizer state expected {want}, "
                f"given {given}"
            )
        treedefs.append(treedef)
        own = kept if values else {k: s for k, s in base.tp_specs if k in group}
        if own:  # the leaves of a key with its own sharding: as its value
            shapes = {k: tuple(like[k].shape) for k in own}
            where = [i for i, e in enumerate(entries) if e["part"] == "opt" and e["group"] == n]
            for i, (path, x) in zip(where, leaves):
                k = leaf_owner(path, tuple(x.shape), shapes)
                if k is not None:
                    sharding = NamedSharding(base.mesh, base.spec_with(tuple(x.shape), own[k]))
                    targets[i] = jax.ShapeDtypeStruct(
                        targets[i].shape, targets[i].dtype, sharding=sharding
                    )

    arrays = restore(targets)
    new_values: dict[Any, Any] = {}
    residuals: dict[Any, Any] = {}
    by_group: list[list] = [[] for _ in groups]
    for e, a in zip(entries, arrays):
        if e["part"] == "value":
            new_values[e["key"]] = a
        elif e["part"] == "residual":
            residuals[e["key"]] = a
        else:
            by_group[e["group"]].append(a)
    if values:
        base = base.replace(
            values=new_values, residuals=residuals, trees=trees, tp_specs=kept or None
        )
    opt_states: dict[tuple, Any] = {g: None for g in base.opt_states}
    for group, treedef, placed in zip(groups, treedefs, by_group):
        opt_states[group] = jax.tree_util.tree_unflatten(treedef, placed)
    return base.replace(opt_states=opt_states)


def save_state(path: str | os.PathLike[str], state: KVState) -> None:
    """Save a :class:`KVState` (values, optimizer states, residuals) to ``path``.

    For a state on one process's devices ``path`` is one file, written atomically; for a state
    over every process of a job, every process calls this with the same ``path``, a directory,
    and each writes only its own shards (this needs ``orbax-checkpoint``: ``pip install
    'jaxkv[dist]'``). A directory that
    already holds a checkpoint is written in the directory format by a single process too.
    Every load checks the saved bytes' SHA-256, so a damaged checkpoint is a
    :class:`KVStoreError`, never a wrong value.

    Examples:
      >>> import os, tempfile, jax.numpy as jnp, optax, jaxkv
      >>> opt = optax.sgd(0.1, momentum=0.9)
      >>> state = jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(), {"w": jnp.ones(3)}), opt)
      >>> path = os.path.join(tempfile.mkdtemp(), "kv.npz")
      >>> jaxkv.save_state(path, state)
      >>> loaded = jaxkv.load_state(path, jaxkv.empty(), optimizer=opt)
      >>> loaded["w"].tolist(), list(loaded.opt_states)
      ([1.0, 1.0, 1.0], [('w',)])
    """
    if not isinstance(state, KVState):
        raise KVStoreError(f"state: expected a jaxkv.KVState, given {type(state).__name__}")
    save(path, state, values=True)


def load_state(path: str | os.PathLike[str], like: KVState, *, optimizer: Any = None) -> KVState:
    """The :class:`KVState` saved at ``path``, on the devices of ``like`` (an empty store such
    as ``jaxkv.empty(devices)`` will do; its big-array bound also decides which values are
    sharded). ``optimizer`` rebuilds the structure of saved optimizer states, and must be
    given when there are some. Raises :class:`KVStoreError` for any damaged or mismatched
    checkpoint. In a multi-process job every process calls it."""
    if not isinstance(like, KVState):
        raise KVStoreError(f"like: expected a jaxkv.KVState, given {type(like).__name__}")
    return load(path, like, values=True, optimizer=optimizer)
