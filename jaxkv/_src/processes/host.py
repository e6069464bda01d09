"""Host-side collectives among the processes of a job: all-gather, rank 0's values to every
process, barriers. Each runs in its turn among the process's collectives (``order.py``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxkv._src.processes import join, order

logger = logging.getLogger("jaxkv")


@functools.lru_cache(maxsize=1)
def _process_mesh() -> Any:
    from jax.sharding import Mesh

    return Mesh(np.array(join.process_devices(), dtype=object), ("processes",))


@functools.lru_cache(maxsize=1)
def _host_collectives() -> tuple[Callable, Callable]:
    from jax.sharding import NamedSharding, PartitionSpec

    whole = NamedSharding(_process_mesh(), PartitionSpec())
    add_up = jax.jit(lambda rows: rows.sum(axis=0, dtype=rows.dtype), out_shardings=whole)
    gather = jax.jit(lambda rows: rows, out_shardings=whole)
    return add_up, gather


def _rows(x: np.ndarray) -> jax.Array:
    """A global ``(processes, *x.shape)`` array whose row for this process is ``x``."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _process_mesh()
    home = join.process_devices()[jax.process_index()]
    sharding = NamedSharding(mesh, PartitionSpec("processes"))
    shape = (jax.process_count(), *x.shape)
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [jax.device_put(x[None], home)]
    )


def _mine(x: jax.Array) -> np.ndarray:
    """This process's copy of a replicated result, as a host array (finished when read)."""
    return np.asarray(x.addressable_shards[0].data)


def all_gather(x: np.ndarray, what: str = "all-gather of every process's values") -> np.ndarray:
    """``x`` (a host array of the same shape and dtype in every process) from every process,
    stacked in process order, after this process's earlier collectives (``what`` names the
    turn for the watchdog)."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    with order.collective(what):
        return _mine(_host_collectives()[1](_rows(x)))


def all_gather_text(text: bytes, what: str) -> list[bytes]:
    """``text`` (bytes of any length) from every process, in process order: one all-gather of
    the lengths, one of the texts padded to the longest (``what`` names the turns)."""
    sizes = all_gather(np.array([len(text)], np.int64), f"sizes of {what}")
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: len(text)] = np.frombuffer(text, np.uint8)
    rows = all_gather(padded, what)
    return [bytes(row[: int(n)]) for row, n in zip(rows, sizes[:, 0])]


def texts_if_differ(text: bytes, what: str) -> list[bytes] | None:
    """``None`` where every process has the same ``text`` (one all-gather of its SHA-256),
    else every process's text, in process order (gathered only then: :func:`all_gather_text`);
    ``what`` names the turns. Every process calls it at the same point of its calls."""
    digest = np.frombuffer(hashlib.sha256(text).digest(), np.uint8)
    every = all_gather(digest, what)
    if (every == digest).all():
        return None
    return all_gather_text(text, what)


def from_rank_zero(tree: Any) -> Any:
    """``tree`` (host arrays) as rank 0 has it, on every process, after this process's earlier
    collectives: bit for bit (the bytes of every leaf, summed with the other processes' zeros
    in one all-reduce)."""
    if jax.process_count() == 1:
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [np.asarray(x, order="C") for x in leaves]  # (ascontiguousarray: at least 1-d)
    raw = [x.reshape(-1).view(np.uint8) for x in leaves]
    buffer = np.concatenate(raw) if raw else np.zeros(0, np.uint8)
    if jax.process_index() != 0:
        buffer = np.zeros_like(buffer)
    with order.collective("broadcast of rank 0's values"):
        summed = _mine(_host_collectives()[0](_rows(buffer)))
    out, start = [], 0
    for x, r in zip(leaves, raw):
        out.append(summed[start : start + r.size].view(x.dtype).reshape(x.shape))
        start += r.size
    return jax.tree_util.tree_unflatten(treedef, out)


def barrier(name: str) -> None:
    """Wait until every process reaches this point (a no-op in a single-process job), after
    this process's earlier collectives. Processes that reach barriers of different names are
    refused: they run different code."""
    if jax.process_count() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(name.encode()).digest()[:8], np.uint8)
    every = all_gather(digest, f"barrier ({name})")
    if not (every == digest).all():
        from jaxkv._src.errors import KVStoreError

        raise KVStoreError(
            f"barrier {name!r}: expected every process at this barrier, given processes at "
            "different ones; every process must make the same jaxkv calls in the same order"
        )
