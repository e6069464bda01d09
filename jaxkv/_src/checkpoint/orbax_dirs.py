"""Checkpoint directories: written by every process of a job through orbax-checkpoint, checked on
load as strictly as the one-file format (``npz.py``).

Layout of a checkpoint directory ``path``:

- ``manifest.json``: ``{"manifest": <JSON text>, "sha256": <the text's SHA-256>}``. The manifest
  has the one-file format's fields (keys, optimizer groups, compression, and per array its key
  or group, part, tree path, shape and dtype), plus ``data`` (the data directory's name),
  ``processes`` (how many wrote it) and ``files``: every file under ``data`` with its size, its
  SHA-256 and the process that hashed it. Replacing this file (``os.replace``) commits a save.
- ``data-<16 hex digits>/state/``: the arrays ``a0``, ``a1``, ... as orbax writes them, each
  process its own shards (replicated arrays once). orbax-checkpoint does not checksum them.

A save writes a new data directory, has each process hash the files it wrote (those under a
``...process_<i>`` name; process 0 also hashes the shared ones), gathers the digests, and then
process 0 commits the manifest and removes older data directories. A save killed part way
leaves the previous manifest, and so the previous checkpoint, in place; one that fails before
its commit removes its data directory (a disk fault is a KVStoreError naming ``path``). A load
checks the manifest (checksum and every field) and its fit to the loading store, then the
processes share out the files and verify every size and SHA-256 (and that no file is missing
or added), and only then asks orbax to restore the arrays onto the loading store's shardings:
any topology.
No file is read with pickle: orbax keeps its metadata in JSON, its data in tensorstore's formats.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import jax
import numpy as np

from jaxkv._src.checkpoint import disk
from jaxkv._src.checkpoint.manifest import Malformed, check_manifest, expect
from jaxkv._src.errors import KVStoreError
from jaxkv._src.processes import host, order

__all__ = [
    "MANIFEST",
    "commit",
    "data_name",
    "describe",
    "digests",
    "file_records",
    "is_checkpoint",
    "open_checkpoint",
    "orbax",
    "save",
]

MANIFEST = "manifest.json"
FORMAT = "jaxkv-checkpoint"
VERSION = 1
_DATA = re.compile(r"data-[0-9a-f]{16}")
_LEFT = re.compile(rf"{_DATA.pattern}|\.jaxkv-.*\.tmp")  # data directories, temporary files
_OWNER = re.compile(r"process_(\d+)")
_HEX = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 22


def orbax() -> ModuleType:
    """``orbax.checkpoint``, or a KVStoreError that says how to install it."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise KVStoreError(
            "checkpoint directories (saving in a multi-process job, or loading one) expect "
            f"orbax-checkpoint, given none installed ({e}); pip install 'jaxkv[dist]'"
        ) from None
    return ocp


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a checkpoint directory (it holds a manifest)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def _owner(rel: str) -> int:
    """The process that hashes the file ``rel``: the one its path names, else process 0."""
    for part in reversed(rel.split("/")):
        m = _OWNER.search(part)
        if m and m.end() == len(part):
            return int(m.group(1))
    return 0


def _files(root: str) -> list[str]:
    """Every file under ``root``, as sorted relative paths with ``/``."""
    out = []
    for top, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(top, name), root)
            out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _digest(path: str) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _gather(text: str) -> list[str]:
    """``text`` from every process, in process order."""
    if jax.process_count() == 1:
        return [text]
    raw = np.frombuffer(text.encode(), np.uint8)
    sizes = host.all_gather(np.array([raw.size], np.int32)).reshape(-1)
    padded = np.zeros(max(int(sizes.max()), 1), np.uint8)
    padded[: raw.size] = raw
    every = host.all_gather(padded)
    return [every[p, : int(n)].tobytes().decode() for p, n in enumerate(sizes)]


def _token() -> str:
    """A fresh data directory name, the same on every process (rank 0's)."""
    mine = np.frombuffer(secrets.token_hex(8).encode(), np.uint8)
    return "data-" + np.asarray(host.from_rank_zero(mine)).tobytes().decode()


def save(path: str, manifest: dict, entries: list) -> None:
    """Write ``entries`` (``(where, part, tree path, array)``, as ``npz._entries``
    gives them) and ``manifest`` (their store's fields) to the directory ``path``; every
    process of the job calls it."""
    ocp = orbax()  # refused before anything is written where orbax is missing
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise KVStoreError(
            f"{path}: a checkpoint of a multi-process job is a directory, given an existing "
            "file; pass a directory path"
        )
    # One collective turn for the whole save: orbax's own barriers are collectives too.
    with order.collective("checkpoint save", watch=False):
        _save(ocp, path, manifest, entries)


class _MissingMetadata(logging.Filter):
    """Drops orbax's warning that a step's arrays have no ``_CHECKPOINT_METADATA``: a
    ``CheckpointManager`` step writes its arrays with orbax's array handler alone, and jaxkv's
    own manifest (checked before the restore) is their metadata; the restore is right."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Metadata file does not exist")


@contextlib.contextmanager
def _without_missing_metadata_warning() -> Iterator[None]:
    logger = logging.getLogger("absl")
    quiet = _MissingMetadata()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _save(ocp: ModuleType, path: str, manifest: dict, entries: list) -> None:
    token = _token()
    data = os.path.join(path, token)
    root = os.path.join(data, "state")

    def undo() -> None:
        """Until the commit the new data directory is the save's own: an error removes it
        (process 0's: it keeps the directory, as it commits and removes older ones)."""
        if jax.process_index() == 0:
            disk.remove(data)

    with disk.faults(path, undo=undo):
        os.makedirs(data, exist_ok=True)
        tree = describe(manifest, entries, token)
        if tree:
            with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
                checkpointer.save(root, args=ocp.args.StandardSave(tree))
        host.barrier("jaxkv.save: data written")
        every = _gather(json.dumps(digests(root)))
        manifest["files"] = file_records([json.loads(t) for t in every])
        if jax.process_index() == 0:
            commit(path, manifest)
    if jax.process_index() == 0:  # older data, and what saves cut short left (else: next time)
        disk.remove_in(path, lambda name: name != token and bool(_LEFT.fullmatch(name)))
    host.barrier("jaxkv.save: committed")


def data_name(number: int) -> str:
    """The data directory's name for ``number`` (below 16**16): ``data-`` and 16 hex digits."""
    return f"data-{number:016x}"


def describe(manifest: dict, entries: list, data: str) -> dict[str, Any]:
    """Complete ``manifest`` (its store's fields) with the format, the data directory's name
    ``data``, the count of processes and an entry per array of ``entries`` (``(where, part,
    tree path, array)``); return the arrays orbax writes, ``{'a<n>': array}`` (empty arrays
    left out: orbax refuses them, and the manifest alone describes them)."""
    manifest.update(format=FORMAT, version=VERSION, data=data, processes=jax.process_count())
    tree = {}
    for n, (where, part, tree_path, leaf) in enumerate(entries):
        if not isinstance(leaf, jax.Array):
            leaf = np.asarray(leaf)
        manifest["arrays"].append(
            {
                **where,
                "part": part,
                "path": tree_path,
                "shape": list(leaf.shape),
                "dtype": str(np.dtype(leaf.dtype)),
            }
        )
        if leaf.size:
            tree[f"a{n}"] = leaf
    return tree


def digests(root: str) -> dict[str, tuple[int, str]]:
    """The size and SHA-256 of each data file under ``root`` that this process hashes: those
    under a ``...process_<i>`` name of its own, and process 0 also the shared ones."""
    me, mine = jax.process_index(), {}
    if os.path.isdir(root):
        for rel in _files(root):
            if _owner(rel) == me or (me == 0 and _owner(rel) >= jax.process_count()):
                mine[rel] = _digest(os.path.join(root, rel))
    return mine


def file_records(every: list[dict]) -> dict[str, dict[str, Any]]:
    """The manifest's ``files``: each process's ``digests`` (in process order) as records."""
    files = {}
    for process, mine in enumerate(every):
        for rel, (size, sha256) in mine.items():
            files[rel] = {"process": process, "size": size, "sha256": sha256}
    return files


def commit(path: str, manifest: dict) -> None:
    """Put ``manifest`` in place in the directory ``path`` (an atomic rename): the save's
    commit."""
    text = json.dumps(manifest)
    outer = json.dumps({"manifest": text, "sha256": hashlib.sha256(text.encode()).hexdigest()})
    with disk.replacing(os.path.join(path, MANIFEST), target=path) as f:
        f.write(outer.encode())


def _check_files(manifest: dict) -> None:
    data, processes = manifest.get("data"), manifest.get("processes")
    expect(isinstance(data, str) and _DATA.fullmatch(data), "'data' a data directory", data)
    expect(type(processes) is int and processes >= 1, "'processes' a count", processes)
    files: Any = manifest.get("files")  # parsed JSON, checked next
    expect(isinstance(files, dict), "'files' an object", files)
    for rel, f in files.items():
        parts = rel.split("/")
        expect(all(p not in ("", ".", "..") for p in parts), f"files[{rel!r}] a relative path", rel)
        expect(
            isinstance(f, dict)
            and type(f.get("process")) is int
            and 0 <= f["process"] < processes
            and type(f.get("size")) is int
            and f["size"] >= 0
            and isinstance(f.get("sha256"), str)
            and _HEX.fullmatch(f["sha256"]),
            f"files[{rel!r}] with its process, size and SHA-256",
            f,
        )


def open_checkpoint(path: str) -> tuple[dict[str, Any], Callable[[list], list]]:
    """The checked manifest of the checkpoint directory ``path``, and ``restore(targets)``,
    which verifies every data file and returns the arrays placed as ``targets`` (one
    ``jax.ShapeDtypeStruct`` with a sharding per manifest entry) say."""
    path = os.path.abspath(path)
    with disk.faults(path, writing=False):
        try:
            with open(os.path.join(path, MANIFEST), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise KVStoreError(
                f"{path}: expected a jaxkv checkpoint (a file, or a directory with {MANIFEST}), "
                f"given a directory without {MANIFEST}"
            ) from None
    try:
        outer = json.loads(raw.decode())
        if not (
            isinstance(outer, dict)
            and isinstance(outer.get("manifest"), str)
            and isinstance(outer.get("sha256"), str)
        ):
            raise Malformed(f"{MANIFEST}: expected an object with 'manifest' and 'sha256'")
        text = outer["manifest"]
        if hashlib.sha256(text.encode()).hexdigest() != outer["sha256"]:
            raise KVStoreError(
                f"{path}: manifest checksum mismatch, expected the saved SHA-256, given "
                "different bytes (the file is corrupt or was edited)"
            )
        manifest = json.loads(text)
        check_manifest(manifest, None, FORMAT, VERSION)
        _check_files(manifest)
    except Malformed as e:
        raise KVStoreError(f"{path}: {e}") from None
    except (ValueError, UnicodeError, RecursionError) as e:
        raise KVStoreError(
            f"{path}: expected a jaxkv checkpoint manifest, given one that cannot be read "
            f"({type(e).__name__}: {e})"
        ) from None

    def restore(targets: list) -> list:
        # One collective turn for the whole load: orbax's own barriers are collectives too.
        with order.collective("checkpoint load", watch=False):
            return _restore(targets)

    def _restore(targets: list) -> list:
        root = os.path.join(path, manifest["data"], "state")
        _verify(path, root, manifest["files"])
        tree = {f"a{n}": t for n, t in enumerate(targets) if t.size}
        try:
            out = {}
            if tree:
                ocp = orbax()
                with (
                    _without_missing_metadata_warning(),
                    ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer,
                ):
                    _match(path, checkpointer.metadata(root), tree)
                    out = checkpointer.restore(root, args=ocp.args.StandardRestore(tree))
            arrays = [out[f"a{n}"] if t.size else _empty(t) for n, t in enumerate(targets)]
        except KVStoreError:
            raise
        except Exception as e:  # orbax's and tensorstore's own errors, of many types
            raise KVStoreError(
                f"{path}: the data cannot be restored ({type(e).__name__}: {e})"
            ) from None
        for n, (a, t) in enumerate(zip(arrays, targets)):
            if (a.shape, a.dtype) != (t.shape, t.dtype):
                raise KVStoreError(
                    f"{path}: array a{n}: expected shape {t.shape} and dtype {t.dtype}, given "
                    f"{a.shape} and {a.dtype}"
                )
        return arrays

    return manifest, restore


def _match(path: str, metadata: Any, tree: dict) -> None:
    """orbax's own record of the arrays against the manifest's: orbax would cast a stored
    array to another dtype the manifest gave, rather than refuse it."""
    metadata = getattr(metadata, "item_metadata", metadata)
    stored = getattr(metadata, "tree", metadata)
    if not isinstance(stored, dict) or set(stored) != set(tree):
        names = sorted(stored) if isinstance(stored, dict) else type(stored).__name__
        raise KVStoreError(
            f"{path}: the data holds arrays {names}, expected {sorted(tree)} (the manifest's)"
        )
    for name, t in tree.items():
        got = (tuple(getattr(stored[name], "shape", ())), getattr(stored[name], "dtype", None))
        if got != (tuple(t.shape), t.dtype):
            raise KVStoreError(
                f"{path}: array {name}: the data holds shape {got[0]} and dtype {got[1]}, the "
                f"manifest says {tuple(t.shape)} and {t.dtype}"
            )


def _empty(target: Any) -> jax.Array:
    """An empty array placed as ``target`` says (on every process's devices)."""
    block = np.zeros(target.sharding.shard_shape(target.shape), target.dtype)
    return jax.make_array_from_callback(target.shape, target.sharding, lambda _: block)


def _verify(path: str, root: str, files: dict) -> None:
    """Every process checks its share of the data files; all raise if any found a fault (the
    process whose fault is an OS error raises it from that error)."""
    fault, error = "", None
    try:
        present = _files(root) if os.path.isdir(root) else []
    except OSError as e:
        present, fault, error = [], f"the data directory cannot be read: {disk.reason(e)}", e
    if not fault and set(present) != set(files):
        missing = sorted(set(files) - set(present))
        extra = sorted(set(present) - set(files))
        fault = (
            f"expected the data files the manifest lists, given {len(missing)} missing "
            f"{missing[:3]} and {len(extra)} not listed {extra[:3]}"
        )
    if not fault:
        me, count = jax.process_index(), jax.process_count()
        for n, rel in enumerate(sorted(files)):
            if n % count != me:
                continue
            try:
                size, sha256 = _digest(os.path.join(root, rel))
            except OSError as e:
                fault, error = f"data file {rel} cannot be read: {disk.reason(e)}", e
                break
            want = files[rel]
            if size != want["size"]:
                fault = f"data file {rel}: expected {want['size']} bytes, given {size}"
                break
            if sha256 != want["sha256"]:
                fault = (
                    f"data file {rel}: checksum mismatch, expected the SHA-256 process "
                    f"{want['process']} saved, given different bytes (the file is corrupt)"
                )
                break
    faults = [(p, f) for p, f in enumerate(_gather(fault)) if f]
    if faults:
        p, f = faults[0]
        where = "" if jax.process_count() == 1 else f" (found by process {p})"
        mine = error if p == jax.process_index() else None
        raise KVStoreError(f"{path}: {f}{where}") from mine
