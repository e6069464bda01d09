"""A checkpoint's manifest: its format and version, and the check of every field that
``load`` reads (the ``.npz`` file's and a checkpoint directory's)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxkv._src.errors import KVStoreError, shown
from jaxkv._src.state.kvstate import compression_config

__all__ = ["FORMAT", "PARTS", "VERSION", "Malformed", "check_manifest", "expect", "is_dtype_name"]

FORMAT = "jaxkv-store"
VERSION = 3  # 2: the manifest has a checksum of its own; 3: optimizer state per group
PARTS = ("value", "opt", "residual")


class Malformed(Exception):
    """A manifest field that is not what ``save`` writes (turned into a KVStoreError)."""


def expect(ok: object, what: str, given: Any) -> None:
    if not ok:
        raise Malformed(f"manifest: expected {what}, given {given!r}")


def check_manifest(
    manifest: Any, files: set[str] | None, fmt: str = FORMAT, version: int = VERSION
) -> None:
    """Every field ``load`` reads, checked against what ``save`` writes. ``files``: the arrays
    in the ``.npz`` file, each with its own SHA-256 in the manifest; ``None`` for a checkpoint
    directory, whose data files are checksummed per process instead."""
    expect(isinstance(manifest, dict), "a JSON object", type(manifest).__name__)
    expect(
        manifest.get("format") == fmt and manifest.get("version") == version,
        f"format {fmt!r} version {version}",
        (manifest.get("format"), manifest.get("version")),
    )
    expect(type(manifest.get("values")) is bool, "'values' true or false", manifest.get("values"))
    keys = manifest.get("keys")
    expect(isinstance(keys, list), "'keys' a list", keys)
    kinds = {type(k) for k in keys}
    expect(kinds <= {int} or kinds <= {str}, "'keys' all int or all str", keys)
    expect(len(set(keys)) == len(keys), "distinct 'keys'", keys)
    compression = manifest.get("compression")
    if compression is not None:
        expect(isinstance(compression, list) and compression, "'compression' a list", compression)
        params = {"type": compression[0]}
        if len(compression) > 1:
            params["threshold"] = compression[1]
        try:
            config = compression_config(params)
        except KVStoreError as err:
            raise Malformed(f"manifest: 'compression' {compression!r}: {err}") from None
        expect(list(config or []) == compression, "a valid 'compression'", compression)
    groups = manifest.get("groups")
    expect(
        isinstance(groups, list)
        and all(isinstance(g, list) and g and all(k in keys for k in g) for g in groups),
        "'groups' a list of non-empty lists of keys",
        groups,
    )
    trees = manifest.get("trees", [])
    expect(
        isinstance(trees, list)
        and all(
            isinstance(t, list) and all(type(k) is str and k in keys for k in t) for t in trees
        ),
        "'trees' a list of lists of keys",
        trees,
    )
    paths = manifest.get("tree_paths")
    expect(
        paths is None
        or (
            isinstance(paths, list)
            and len(paths) == len(trees)
            and all(p is None or _tree_paths_ok(p, t) for p, t in zip(paths, trees))
        ),
        "'tree_paths' a list of each tree's [key, path entries] in leaf order",
        paths,
    )
    record = manifest.get("optimizer")
    expect(record is None or isinstance(record, dict), "'optimizer' an object", record)
    tp = manifest.get("tp", [])

    def axis_entry(e: Any) -> bool:
        return e is None or type(e) is str or (type(e) is list and all(type(a) is str for a in e))

    expect(
        isinstance(tp, list)
        and all(
            isinstance(t, list)
            and len(t) == 2
            and t[0] in keys
            and isinstance(t[1], list)
            and all(axis_entry(e) for e in t[1])
            for t in tp
        ),
        "'tp' a list of [key, [axis entries]]",
        tp,
    )
    grouped = [k for g in groups for k in g]
    expect(len(set(grouped)) == len(grouped), "each key in one group at most", groups)
    entries = manifest.get("arrays")
    expect(isinstance(entries, list), "'arrays' a list", entries)
    counts: dict[Any, dict[str, int]] = {k: dict.fromkeys(PARTS, 0) for k in keys}
    for n, e in enumerate(entries):
        expect(isinstance(e, dict), f"arrays[{n}] an object", e)
        expect(e.get("part") in PARTS, f"arrays[{n}] 'part' one of {PARTS}", e.get("part"))
        if e["part"] == "opt":
            g = e.get("group")
            expect(
                type(g) is int and 0 <= g < len(groups) and "key" not in e,
                f"arrays[{n}] 'group' an index below {len(groups)}",
                g,
            )
        else:
            key = e.get("key")  # (JSON's keys are ints or strs; a list cannot be looked up)
            known = type(key) in (int, str) and key in counts
            expect(known, f"arrays[{n}] 'key' one of {keys}", key)
        expect(isinstance(e.get("path"), str), f"arrays[{n}] 'path' a str", e.get("path"))
        shape = e.get("shape")
        expect(
            isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape),
            f"arrays[{n}] 'shape' a list of sizes",
            shape,
        )
        expect(is_dtype_name(e.get("dtype")), f"arrays[{n}] 'dtype' a dtype name", e.get("dtype"))
        if files is not None:
            sha256 = e.get("sha256")
            expect(isinstance(sha256, str), f"arrays[{n}] 'sha256' a str", sha256)
            expect(f"a{n}" in files, f"an array a{n} for arrays[{n}]", sorted(files))
        if e["part"] != "opt":
            counts[e["key"]][e["part"]] += 1
    # A whole-store file holds one value per key (and a residual under 2-bit compression); an
    # optimizer-state file neither.
    value = int(manifest["values"])
    residual = int(manifest["values"] and bool(compression) and compression[0] == "2bit")
    for key, c in counts.items():
        expect(
            c["value"] == value and c["residual"] == residual,
            f"key {shown(key)} with {value} value and {residual} residual entries",
            f"{c['value']} and {c['residual']}",
        )
    if files is not None:  # nothing beside them, as a checkpoint directory holds no stray file
        listed = {f"a{n}" for n in range(len(entries))} | {"manifest", "manifest_sha256"}
        expect(files <= listed, "no arrays but the manifest's", sorted(files - listed))


def is_dtype_name(name: Any) -> bool:
    if not isinstance(name, str):  # jnp.dtype(None) would be float64
        return False
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        return False
    # A dtype a jax.Array can have: native byte order, and boolean, integer, complex or a
    # float (ml_dtypes' bfloat16 and float8 types too); not bytes, str, void or big-endian.
    return dtype.isnative and (dtype.kind in "biuc" or bool(jnp.issubdtype(dtype, jnp.floating)))


def _tree_paths_ok(paths: Any, keys: list) -> bool:
    """Whether ``paths`` is a tree's ``[key, [[kind, name], ...]]`` for each of ``keys``."""

    def entry_ok(e: Any) -> bool:
        return (
            isinstance(e, list)
            and len(e) == 2
            and e[0] in ("key", "idx", "attr")
            and type(e[1]) in (str, int)
        )

    return (
        isinstance(paths, list)
        and all(
            isinstance(p, list)
            and len(p) == 2
            and type(p[0]) is str
            and isinstance(p[1], list)
            and p[1]
            and all(map(entry_ok, p[1]))
            for p in paths
        )
        and sorted(p[0] for p in paths) == sorted(keys)
    )
