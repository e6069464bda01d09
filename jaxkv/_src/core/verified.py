"""Verified sums: checksums of jaxkv's sums across devices, and the error a wrong one raises.

A sum is linear, so the checksum of a sum is the sum of the inputs' checksums. jaxkv checks its
reduce-scatters and all-reduces across processes this way (docs/distributed.md, "Verified
sums"): an engine's collective that gives wrong values is then a :class:`SumError`, not a
silently wrong number. By default across processes every run of a computation that sums checks
a :data:`DEFAULT_EVERY`-th of each sum, another one at each run, so that in that many runs every
element has been checked and a check costs a few percent of a step; ``JAXKV_VERIFY_SUMS=1``
checks the whole of every sum at every run. The sums of one push share one check
(:func:`batched`): one small all-gather of their checksums."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxkv._src.core import checked
from jaxkv._src.errors import KVStoreError, SumError
from jaxkv._src.jax_internals import manual_axes

__all__ = [
    "DEFAULT_EVERY",
    "ENV_VERIFY_SUMS",
    "SumError",
    "batched",
    "check_sum",
    "check_sums",
    "verify_every",
    "verify_sums",
]


# The named scope of the checks' computations (in the HLO's op names and profiler traces).
CHECK = "jaxkv.check"

# ``JAXKV_VERIFY_SUMS=1`` checks every sum jaxkv makes across devices whole at every run, ``0``
# none, ``N`` an N-th of each at every run (another N-th each run); by default those across
# processes, a DEFAULT_EVERY-th.
ENV_VERIFY_SUMS = "JAXKV_VERIFY_SUMS"

# Across processes, by default, every run of a computation that sums checks this fraction of
# each sum (1/DEFAULT_EVERY of each segment, another slice at each run): in this many runs every
# element has been checked once, and a sum that is wrong throughout is caught at its first run.
# The whole of every sum at every run (JAXKV_VERIFY_SUMS=1) costs 15-25 % of the in-jit step of
# the many-processes benchmark (a 9M-parameter MLP on this 2-core machine): mostly the dots,
# which read every gradient once more; a tenth at every run 3-6 %, a twentieth 1-3 % (its
# callback, all-gather and conditional alone 0.6 %: docs/distributed.md, "What it costs").
DEFAULT_EVERY = 20


def verify_every() -> int:
    """How often jaxkv checks its reduce-scatters and all-reduces with a checksum
    (:func:`check_sum`): 0 never, 1 the whole of each sum at every run of the computation that
    sums, N an N-th of each segment of each sum at every run (another N-th each run, so that in
    N runs every element has been checked). ``JAXKV_VERIFY_SUMS`` if set, else
    :data:`DEFAULT_EVERY` across processes, where the sums are an engine's network
    collectives (gloo's, NCCL's), and 0 in one process. Read when a computation is traced: set
    it before the first step, alike in every process."""
    setting = os.environ.get(ENV_VERIFY_SUMS, "").strip()
    if setting:
        try:
            every = int(setting)
        except ValueError:
            every = -1
        if every < 0:
            raise KVStoreError(
                f"{ENV_VERIFY_SUMS}={setting!r}: expected 0 (no checks), 1 (every sum checked "
                "whole) or N > 1 (an N-th of each sum checked at each run, another each run)"
            )
        return every
    return DEFAULT_EVERY if jax.process_count() > 1 else 0


def verify_sums() -> bool:
    """Whether jaxkv checks its sums at all (:func:`verify_every` above 0)."""
    return verify_every() > 0


# Each place a check is traced gets a number; each device counts its runs of each.
_sites = itertools.count()
_runs: dict[tuple[int, tuple[int, ...]], int] = {}
_runs_lock = threading.Lock()


def _count_run(site: int, every: int, *coords: Any) -> np.ndarray:
    """On the host, for one device (``coords``: its place on the mesh): which slice of its
    sums this run of check ``site`` checks (the run's number modulo ``every``)."""
    key = (site, tuple(int(c) for c in coords))
    with _runs_lock:
        k = _runs.get(key, 0)
        _runs[key] = k + 1
    return np.asarray(k % every, np.int32)


def _turn(every: int, axis: Any) -> jax.Array:
    """Inside ``shard_map``: which of ``every`` slices of each sum this run of the computation
    checks, the same on every device and in every process (each device counts its own runs of
    the place, and every device runs every computation, in the same order). A host callback
    with no array operands: it costs no copy of the values summed. In jaxkv's own computations
    (``checked.py``) the host's count of their runs, an argument: no callback."""
    if checked.collecting():
        return checked.turn() % every
    site = next(_sites)
    names = sorted(manual_axes() or (), key=str)
    if not names:  # pmap, or a JAX without the abstract mesh: the sum's own axes
        names = list(axis) if isinstance(axis, tuple | list) else [axis]
    coords = [jax.lax.axis_index(name) for name in names]
    counted = functools.partial(_count_run, site, every)
    return io_callback(counted, jax.ShapeDtypeStruct((), jnp.int32), *coords)


def _weights(size: int) -> jax.Array:
    """A fixed pseudo-random vector in [-1, 1) of ``size``, the same on every device: an
    integer hash of each position (computed where it is used, never stored)."""
    h = jax.lax.iota(jnp.uint32, size) * jnp.uint32(0x9E3779B1)
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-23) - 1.0


def _dots(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's dot (over its last axis) with :func:`_weights`, and the sum of its absolute
    values (which bounds the dot of absolute values, the scale of the rounding errors: the
    weights lie in [-1, 1)), in float32; elementwise products and sums, so no matrix unit
    rounds. The vector repeats with a period of up to ``PERIOD`` elements (the largest power of
    two that divides the row), so that it costs nothing to make. Two plain reductions: a dot
    with the absolute weights took 7x as long on XLA:CPU."""
    size = rows.shape[-1]
    period = math.gcd(size, PERIOD)
    r = _weights(period)
    rows = rows.astype(jnp.float32)
    grid = rows.reshape(*rows.shape[:-1], size // period, period)
    return jnp.sum(grid * r, axis=(-2, -1)), jnp.sum(jnp.abs(rows), axis=-1)


# The period of the checksums' pseudo-random vector.
PERIOD = 4096


# Each device's part of a checked sum is dotted in this many segments (where its size divides),
# so that a few wrong elements stand out against the rounding of a segment, not of the part.
SEGMENTS = 64


def check_sum(
    x: jax.Array, out: jax.Array, axis: Any, what: str, owners: tuple[int, ...] | None = None
) -> None:
    """Inside ``shard_map``: check that ``out`` is this device's part of the sum of ``x`` over
    ``axis`` (a reduce-scatter along axis 0; ``out`` of ``x``'s shape: an all-reduce).

    A sum is linear, so the checksum of a sum is the sum of the inputs' checksums: each device
    dots its ``x`` (each device's part, in :data:`SEGMENTS` segments) with a fixed
    pseudo-random vector, and its part of the result; one small all-gather brings every
    device's dots, and the inputs' are added. A part whose dots differ from the expected ones
    by more than float rounding raises a :class:`SumError` on the host, in every process, naming
    ``what`` and the devices (and ``owners``' processes) whose part was wrong. JAX raises it
    when the step's results are read, as a ``JaxRuntimeError`` carrying its text.
    """
    check_sums([(x, out, what)], axis, owners)


def check_sums(
    sums: list[tuple[jax.Array, jax.Array, str]],
    axis: Any,
    owners: tuple[int, ...] | None = None,
) -> None:
    """:func:`check_sum` of several sums ``(x, out, what)`` over one ``axis`` at once: one
    all-gather carries every sum's dots (a small collective costs about 3 ms on gloo, so one
    per sum would cost more than the dots of a push of many keys). Inside :func:`batched` over
    the same ``axis`` and ``owners``, the sums join the batch's one check instead. Where
    :func:`verify_every` is N above 1, each run checks an N-th of each segment of each sum,
    another N-th at each run."""
    open_ = getattr(_batches, "open", None)
    if open_ and open_[-1][0] == (axis, owners):
        open_[-1][1].extend(sums)
        return
    if sums:
        _check(sums, axis, owners, verify_every())


_batches = threading.local()  # .open: the batches being traced, innermost last


@contextlib.contextmanager
def batched(axis: Any, owners: tuple[int, ...] | None = None) -> Iterator[None]:
    """Inside ``shard_map``: the sums checked within (:func:`check_sum`, :func:`check_sums`)
    over ``axis`` (and ``owners``) are checked together when it closes, with one all-gather
    and one count of the runs: a push's sums, however many keys and collectives it takes."""
    if not hasattr(_batches, "open"):
        _batches.open = []
    pending: list[tuple[jax.Array, jax.Array, str]] = []
    _batches.open.append(((axis, owners), pending))
    try:
        yield
    finally:
        _batches.open.pop()
    if pending:
        _check(pending, axis, owners, verify_every())


def _chunk(size: int, every: int) -> int:
    """How many elements of a row of ``size`` one run checks: an ``every``-th, rounded up to a
    multiple of the row's power-of-two factor (up to 256, the period of the checksum's vector);
    ``size`` where that is the whole row (``every`` of 1, or rows too short to slice)."""
    if every <= 1 or size <= 1:
        return size
    q = math.gcd(size, 256)
    per = -(-size // every)  # ceil(size / every)
    return min(size, -(-per // q) * q)


def _slice(rows: jax.Array, turn: jax.Array | None, chunk: int) -> jax.Array:
    """Run ``turn``'s slice of ``chunk`` elements of each row of ``rows`` (along its last axis):
    the ``turn``-th, moved back inside the row at its end. In as many runs as a row holds
    chunks, every element has been in a slice."""
    size = rows.shape[-1]
    if turn is None or chunk == size:
        return rows
    start = jnp.minimum(turn * chunk, size - chunk)
    return jax.lax.dynamic_slice_in_dim(rows, start, chunk, axis=rows.ndim - 1)


def _check(
    sums: list[tuple[jax.Array, jax.Array, str]],
    axis: Any,
    owners: tuple[int, ...] | None,
    every: int,
) -> None:
    names = tuple(axis) if isinstance(axis, tuple | list) else (axis,)
    n = math.prod(jax.lax.axis_size(name) for name in names)
    # Each sum's segments, and the elements of a segment one run checks.
    segments = [
        next(s for s in (SEGMENTS, 32, 16, 8, 4, 2, 1) if out.size % s == 0) for _, out, _ in sums
    ]
    chunks = [_chunk(out.size // k, every) for (_, out, _), k in zip(sums, segments)]
    # The run's count only where a slice is taken: no host callback for sums checked whole.
    sliced = any(c < out.size // k for (_, out, _), k, c in zip(sums, segments, chunks))
    turn = _turn(every, axis) if sliced else None
    pieces, shapes, wholes = [], [], []
    for (x, out, _), k, chunk in zip(sums, segments, chunks):
        whole = tuple(out.shape) == tuple(x.shape)
        mine = _slice(x.reshape(1 if whole else n, k, -1), turn, chunk)
        expected, scale = _dots(mine)  # (parts, segments)
        got = _dots(_slice(out.reshape(k, -1), turn, chunk))[0]
        pieces += [expected.ravel(), scale.ravel(), got]
        shapes.append(expected.shape)
        wholes.append(whole)
    # In jaxkv's own computations, the digest of the keys summed rides last (below 2**24:
    # exact in float32): every device's must be this one's.
    keyed = checked.collecting()
    if keyed:
        pieces.append(checked.keys_digest().astype(jnp.float32)[None])
    # One all-gather of every device's dots: the inputs' are summed here.
    with jax.named_scope(CHECK):
        every_dot = jax.lax.all_gather(jnp.concatenate(pieces), axis)
    f32 = float(jnp.finfo(jnp.float32).eps)
    offs, reports, at = [], [], 0
    for (x, _, what), shape, whole in zip(sums, shapes, wholes):
        k = math.prod(shape)
        expected = every_dot[:, at : at + k].sum(0).reshape(shape)
        scale = every_dot[:, at + k : at + 2 * k].sum(0).reshape(shape)
        got = every_dot[:, at + 2 * k : at + 2 * k + shape[-1]]  # (devices, segments)
        at += 2 * k + shape[-1]
        eps = float(jnp.finfo(x.dtype).eps) if jnp.issubdtype(x.dtype, jnp.floating) else 0.0
        tolerance = (2 * n * eps + 64 * f32) * scale + 1e-30
        offs.append(jnp.any(jnp.isfinite(expected) & ~(jnp.abs(got - expected) <= tolerance)))
        compare: Any = functools.partial(
            _compare, what=what, owners=owners, eps=eps, devices=n, whole=whole
        )
        reports.append((compare, jnp.stack([expected, scale]), got))

    if keyed:
        digests = every_dot[:, -1]
        offs.append(jnp.any(digests != digests[0]))
        compare = functools.partial(_compare_keys, owners=owners)
        reports.append((compare, digests, digests))

    def report(*arrays: Any) -> None:  # on the host: the first sum that is off raises
        for j, (compare, _, _) in enumerate(reports):
            compare(arrays[2 * j], arrays[2 * j + 1])

    args = [a for _, totals, got in reports for a in (totals, got)]
    if checked.collecting():  # jaxkv's own computation: the verdict is an output
        checked.found(functools.reduce(jnp.logical_or, offs), args, [c for c, _, _ in reports])
        return
    # The host is called only when a part is off: a right sum costs no host round trip (and
    # the conditional's operands are the small checksums, never the values summed).
    jax.lax.cond(
        functools.reduce(jnp.logical_or, offs),
        lambda: jax.debug.callback(report, *args),
        lambda: None,
    )


def _compare_keys(digests: Any, _: Any, *, owners: tuple[int, ...] | None) -> None:
    """On the host: refuse a sum whose devices summed values of different keys (each
    device's digest of its call's keys, ``checked.digest``): processes whose calls differ
    met in one collective, and its sum mixed them."""
    digests = np.asarray(digests).reshape(-1)
    other = np.flatnonzero(digests != digests[0])
    if other.size:
        where = ", ".join(
            f"device {d}" + (f" (process {owners[d]})" if owners and d < len(owners) else "")
            for d in other
        )
        raise SumError(
            f"the sum across {digests.size} devices mixed the values of different keys: "
            f"{where} pushed other keys than device 0 in the same collective (every process "
            "must make the same calls: one program on every process). Those keys' values "
            "are now wrong on every process: init them again, or load a checkpoint"
        )


def _compare(
    totals: Any,
    got: Any,
    *,
    what: str,
    owners: tuple[int, ...] | None,
    eps: float,
    devices: int,
    whole: bool,
) -> None:
    """On the host: refuse parts of a sum whose checksum is off by more than rounding."""
    expected, scale = np.asarray(totals, np.float64)  # (parts, segments) each
    got = np.asarray(got, np.float64).reshape(-1, expected.shape[-1])  # (devices, segments)
    if whole:  # every device holds the whole sum: each is checked against the one total
        expected = np.broadcast_to(expected, got.shape)
        scale = np.broadcast_to(scale, got.shape)
    # The sum's own rounding (in the values' dtype, over the devices) and the checksum's.
    tolerance = (2 * devices * eps + 64 * float(np.finfo(np.float32).eps)) * scale + 1e-30
    with np.errstate(invalid="ignore"):  # inf - inf: a sum that cannot be checked
        off = np.isfinite(expected) & ~(np.abs(got - expected) <= tolerance)
    wrong = np.flatnonzero(off.any(axis=1))
    if wrong.size:
        where = ", ".join(
            f"device {d}" + (f" (process {owners[d]})" if owners and d < len(owners) else "")
            for d in wrong
        )
        first = [int(np.flatnonzero(off[d])[0]) for d in wrong]

        def listed(a: Any) -> str:
            return ", ".join(f"{a[d, j]:.7g}" for d, j in zip(wrong, first))

        raise SumError(
            f"{what}: the sum across {devices} devices failed its checksum on {where}: in "
            f"segment {', '.join(map(str, first))} of {off.shape[1]}, expected "
            f"{listed(expected)}, given {listed(got)} (tolerance {listed(tolerance)}); a "
            "collective of this backend gave wrong values. Rerun; if it recurs, report it with "
            "docs/distributed.md's repro"
        )
