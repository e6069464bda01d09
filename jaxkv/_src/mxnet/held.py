"""What the imperative store holds until something reads: per-key inits, pushes and pulls into
outs, run together as list calls (MXNet's asynchronous engine, which queues work and runs it
when a result is read).

MXNet code goes one key at a time: Gluon's ``Trainer`` and the Module API ``init`` each
parameter alone, then at every step ``push(i)`` and ``pull(i, out)`` each. Run one by one, every
key is a computation of its own (and a compile of its own). Held, a step's calls run as one
init, one push and at most two pulls, whatever their number, in a fixed order that gives every
read exactly what MXNet's ordering gives it: each key's calls are
``[init] [pull ...] [push] [pull ...] [push] ...``: the inits run first, then the pulls that
came before their key's first push, then every key's first push at once, then the pulls that
came after it, then every key's second push, and so on (a second init is refused; a pull into
an out a held pull already owes runs what is held up to that pull first: the rest stays held in
one process, so that a loop that pulls into the same outs at every step runs each step's
pushes together). What runs together does not depend
on the order of the calls of different keys.

Across processes (``dist_sync``) the keys each process holds are compared first (one host
all-gather of a digest): held pushes are summed in key order, so processes that pushed the
same keys in their own orders get the same sums; processes that hold different keys all raise
``KVStoreError`` naming each process's keys, before anything changes.

:class:`Calls` is the store's part that holds them (its queue, and a push of rows held for its
``row_sparse_pull``) and runs them in that order through the store's own calls (:class:`Runs`);
the store keeps MXNet's API.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import itertools
import json
import logging
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from jaxkv._src.errors import KVStoreError, named
from jaxkv._src.processes import host
from jaxkv._src.rows import ops
from jaxkv._src.state.kvstate import Key, KVState, spans_processes

__all__ = [
    "Calls",
    "Held",
    "Runs",
    "agree",
    "before",
    "described",
    "differ",
    "holding",
    "run_everything_held",
]

logger = logging.getLogger("jaxkv")


class Held:
    """The calls a store holds, by phase (see the module doc)."""

    __slots__ = ("inits", "pushes", "scalars", "counted", "pulls", "count", "outs")

    def __init__(self) -> None:
        self.inits: dict[Key, Any] = {}  # key -> its value (a jax.Array), in call order
        # Pushes by generation: a key's n-th held push is in pushes[n] (key -> its arrays).
        self.pushes: list[dict[Key, list]] = []
        # Under an MXNet optimizer, each held push's kernel numbers, worked out when it was
        # called (MXNet's order): scalars[n] is key -> its row, as pushes[n].
        self.scalars: list[dict[Key, Any]] = []
        self.counted: Any = None  # the optimizer's bookkeeping before the first held push
        # Pulls by how many pushes of their key came before: pulls[n] runs after pushes[n-1].
        self.pulls: list[list[tuple[Key, list]]] = [[]]
        self.count: dict[Key, int] = {}  # key -> its held pushes
        self.outs: list[Any] = []  # every out owed a value

    def __bool__(self) -> bool:
        return bool(self.inits or self.pushes or any(self.pulls))

    def hold_push(self, key: Key, arrays: list, scalars: Any = None) -> None:
        """Hold a (checked) push of ``key``: its generation is how many are held before it,
        whatever the order of the other keys' pushes (``scalars``: its optimizer's numbers)."""
        n = self.count.get(key, 0)
        while len(self.pushes) <= n:
            self.pushes.append({})
            self.scalars.append({})
            self.pulls.append([])
        self.pushes[n][key] = arrays
        if scalars is not None:
            self.scalars[n][key] = scalars
        self.count[key] = n + 1

    def hold_pull(self, key: Key, outs: list, owner: Any) -> None:
        """Hold a pull of ``key`` into ``outs`` (checked), each out now owed by ``owner``."""
        self.pulls[self.count.get(key, 0)].append((key, outs))
        for o in outs:
            o.owed_by = owner
        self.outs.extend(outs)

    def extend(self, later: Held) -> None:
        """Hold ``later``'s calls after these, each key's in its order (its pulls after as many
        of its pushes as came before them)."""
        self.inits.update(later.inits)
        for n, pulls in enumerate(later.pulls):
            if n:
                for k, arrays in later.pushes[n - 1].items():
                    self.hold_push(k, arrays, later.scalars[n - 1].get(k))
            for k, outs in pulls:
                self.pulls[self.count.get(k, 0)].append((k, outs))
        self.outs.extend(later.outs)
        if self.counted is None:
            self.counted = later.counted

    def split(self, n: int) -> Held:
        """Cut these calls after the pulls of phase ``n`` (``pulls[n]``, which run after each
        key's ``n``-th push): these keep the inits and everything up to those pulls; the
        returned ``Held`` has the rest (each key's later pushes and the pulls after them), in
        the same order, its optimizer counts not recorded (``counted``: what was counted
        before it was held mixes with these calls' counts)."""
        later = Held()
        later.pushes, self.pushes = self.pushes[n:], self.pushes[:n]
        later.scalars, self.scalars = self.scalars[n:], self.scalars[:n]
        later.pulls, self.pulls = [[], *self.pulls[n + 1 :]], self.pulls[: n + 1]
        later.count = {k: c - n for k, c in self.count.items() if c > n}
        self.count = {k: min(c, n) for k, c in self.count.items()}
        mine = {id(o) for pulls in self.pulls for _, outs in pulls for o in outs}
        later.outs = [o for o in self.outs if id(o) not in mine]
        self.outs = [o for o in self.outs if id(o) in mine]
        return later

    def release(self) -> None:
        """No out is owed anything any more (each keeps the value it holds)."""
        for o in self.outs:
            o.owed_by = None

    def keys(self) -> list[Key]:
        """Every key a held call names."""
        seen = dict.fromkeys(self.inits)
        for gen, pulls in zip([{}, *self.pushes], self.pulls):
            seen.update(dict.fromkeys(gen))
            seen.update(dict.fromkeys(k for k, _ in pulls))
        return list(seen)


class Runs(NamedTuple):
    """What a store does when its held calls run: its own calls, made now (bound to it by the
    store each time they run, so that no part of it keeps the store alive)."""

    owner: Any  # the store (noted by :func:`holding` when it holds calls again)
    stored: Callable[[], KVState]  # its state as stored (its held calls not run)
    rebind: Callable[[KVState], None]  # its state replaced
    init: Callable[[list[Key], list], None]  # held inits, in key order
    push: Callable[[list[Key], list[list], dict[Key, Any]], None]  # one generation of pushes
    pull: Callable[[list[Key], list[list]], None]  # pulls into outs, in key order
    restore: Callable[[Any], None]  # an MXNet optimizer's bookkeeping put back (None: nothing)
    # the arrays pulls not made yet read kept from a push of rows to these keys (Lending)
    spare_for_rows: Callable[[KVState, list[Key]], None]
    push_rows: Callable[[KVState, Any], KVState]  # a held push of rows run on a state
    # The updater a held generation of pushes runs with, as one optimizer group (each key's
    # update alone: MXNet's optimizer's), where a push of rows may make them in its own
    # computation (``rows.ops.Before.pushes``); else None.
    group_updater: Callable[[], Any] = lambda: None


class Calls:
    """What an imperative store holds until something reads, and how it runs (the module doc):
    its queue of per-key calls (``queue``: a :class:`Held`, or ``None``), and a lazy push of
    rows held for its ``row_sparse_pull`` (``rows``: a ``kvstore_rows.Held``, run by
    ``Runs.push_rows``; or ``None``),
    which across processes may keep the queue held before it (its ``before``), to be agreed
    in the pull's own all-gather. The store's lock is held by every caller."""

    __slots__ = ("queue", "rows")

    def __init__(self) -> None:
        self.queue: Held | None = None
        self.rows: Any = None  # a kvstore_rows.Held

    def hold(self, queue: Held, owner: Any) -> None:
        """Hold ``queue`` (the calls held before and the new ones) for ``owner``, the store."""
        self.queue = queue
        holding(owner)

    def shape(self, state: KVState, key: Key, queue: Held | None = None) -> tuple[int, ...]:
        """``key``'s shape, from a held init (of ``queue``, default this one's) or ``state``
        (whose held calls need not run)."""
        queue = self.queue if queue is None else queue
        if queue is not None and key in queue.inits:
            return tuple(queue.inits[key].shape)
        return state.key_shapes[state.index(key)]

    def run(self, runs: Runs) -> None:
        """Run every held call: the push of rows (after the calls it keeps), then the queue."""
        if self.rows is not None:
            self.settle(runs)
        queue, self.queue = self.queue, None
        self.run_queue(queue, runs)

    def run_through(self, outs: list, runs: Runs) -> None:
        """Run the held calls up to the last held pull into any of ``outs`` (owed by this
        store), so that it lands before a new pull into them. In one process with no push of
        rows held, the calls held after that pull stay held (each key's later pushes and the
        pulls after them, in their order): Gluon's loop pulls into the same outs at every step,
        so a step's first pull would otherwise run the previous step with only its own key's
        next push, and each step's pushes would run as two lists of other keys (two more
        computations, each compiled). Across processes everything held runs (what runs is
        agreed as a whole). Where the calls run fail, those held after them are dropped too,
        as when everything held runs."""
        queue = self.queue
        if queue is None or self.rows is not None or spans_processes(runs.stored().devices):
            self.run(runs)
            return
        owed = {id(o) for o in outs}
        n = max(
            (
                i
                for i, pulls in enumerate(queue.pulls)
                for _, os in pulls
                for o in os
                if id(o) in owed
            ),
            default=len(queue.pulls) - 1,
        )
        later = queue.split(n)
        self.queue = None
        try:
            self.run_queue(queue, runs)
        except BaseException:
            later.release()
            raise
        if later:
            if self.queue is not None:  # (nothing is held while they run)
                later.extend(self.queue)
            self.queue = later

    def settle(self, runs: Runs) -> None:
        """Run the held push of rows (after the calls held before it, if it keeps them); where
        it fails, what the MXNet optimizer counted for it is put back."""
        rows, self.rows = self.rows, None
        if rows is None:
            return
        if rows.before is not None:
            try:
                self.run_kept(rows.before, runs)
            except BaseException:  # the push of rows is dropped with them
                if rows.before.counted is None:
                    runs.restore(rows.counted)
                raise
        try:
            state = runs.stored()
            if rows.donate:  # (pulls run since it was held may read what it donates)
                runs.spare_for_rows(state, [rows.key])
            runs.rebind(runs.push_rows(state, rows))
        except BaseException:
            runs.restore(rows.counted)
            raise

    def run_queue(self, queue: Held | None, runs: Runs, agreed: bool = False) -> None:
        """Run the held calls ``queue`` in their order (across processes, agreed first unless
        ``agreed``): the inits in key order, then each phase's pulls and the next generation
        of pushes. Where a call fails, the error is a ``KVStoreError`` naming the held keys,
        and where nothing ran (the processes disagree), the MXNet optimizer's counts of the
        held pushes are put back."""
        if not queue:  # (nothing held: no out is owed either)
            return
        # Each out stays owed until it is filled (or, where a call fails, released below, to
        # keep what it holds): a read of it from another thread meanwhile waits for the store,
        # where it read what it held before (its zeros) once they were released first.
        state = runs.stored()
        try:
            if not agreed and spans_processes(state.devices):
                gathered = self.gathered(queue, state)
                # (pulls alone of values each process holds whole make no collective)
                if queue.inits or queue.pushes or any(gathered):
                    agree(queue, gathered)
            if queue.inits:  # in key order: the same in every process
                keys = sorted(queue.inits)
                runs.init(keys, [queue.inits[k] for k in keys])
            for n, pulls in enumerate(queue.pulls):
                if n:  # the n-th push of every key pushed n times, in key order
                    gen = queue.pushes[n - 1]
                    keys = sorted(gen)
                    runs.push(keys, [gen[k] for k in keys], queue.scalars[n - 1])
                if pulls:  # in key order too (a key's own pulls in call order)
                    pulls = sorted(pulls, key=lambda pull: pull[0])
                    runs.pull([k for k, _ in pulls], [o for _, o in pulls])
        except BaseException as e:
            if runs.stored() is state and queue.counted is not None:
                # Refused before anything ran (the processes disagree): the optimizer
                # has not counted the held pushes either.
                runs.restore(queue.counted)
            if isinstance(e, KVStoreError) or not isinstance(e, Exception):
                raise
            raise KVStoreError(
                f"{named(list(queue.keys()))}: the held calls failed when run "
                f"({type(e).__name__}: {e})"
            ) from e
        finally:
            queue.release()  # (the outs not filled keep what they hold)

    def gathered(self, queue: Held, state: KVState) -> list[list[Key]]:
        """Across processes, the keys of ``queue``'s pulls of values split across processes
        (each a collective: it gathers them), per phase of pulls."""
        return [
            sorted({k for k, _ in pulls if state.splits(self.shape(state, k, queue))})
            for pulls in queue.pulls
        ]

    def keeps(self, lazy_mxnet: bool) -> bool:
        """Whether a push of rows may keep the calls held before it, to run with it (the store
        then checks that it is one key's rows): across processes, under an MXNet optimizer's
        lazy update (``lazy_mxnet``), after held pushes and no held init, with no push of rows
        held already. Decided from what every process agrees on, so that every process
        decides alike."""
        queue = self.queue
        return (
            queue is not None
            and bool(queue.pushes)
            and not queue.inits
            and self.rows is None
            and lazy_mxnet
        )

    def run_after(self, queue: Held, runs: Runs) -> Callable[[], KVState]:
        """In one process, how the calls ``queue`` kept by a push of rows (other keys' pushes,
        no pull) run once the push of rows has run: ahead of any call held since (which waits
        for the next read), on the state the push left. Where one fails when run (a call
        accepted and counted already), the push of rows has run: nothing is put back, the
        error names the kept keys."""

        def run() -> KVState:
            queue.counted = None  # (the push of rows, counted after them, ran)
            self.run_kept(queue, runs, agreed=True)
            return runs.stored()

        return run

    def run_kept(self, queue: Held, runs: Runs, agreed: bool = False) -> None:
        """Run the calls ``queue`` a push of rows kept, ahead of the calls held since it: those
        wait (set aside while these run, so that a read inside these runs none of them first:
        a key pushed before and after the push of rows gets its pushes in call order)."""
        since, self.queue = self.queue, None
        try:
            self.run_queue(queue, runs, agreed)
        finally:
            if since is not None:
                if self.queue is not None:  # (nothing is held while they run)
                    since.extend(self.queue)
                self.queue = since

    def kept(self, rows: Any, runs: Runs) -> tuple[Any, Callable[[], None], Callable[[], None]]:
        """The calls a held push of rows kept (``rows.before``), as ``rows.ops.Before`` for its
        ``row_sparse_pull`` (agreed in the push's all-gather, run by it once agreed), what
        to do where the push and pull raise: undo what the push counted; the kept calls held
        again (ahead of any held since) where they did not run (a process refused, the
        numbers differ), dropped where the processes hold different ones (as :func:`agree`
        drops them); and what to do once the push and pull have run and the store holds their
        state: across processes, run the kept calls where the push left them to run after it
        (``Before.later``: a push kept between host agreements agreed them in its own
        computation), as one process runs them (:meth:`run_after`)."""
        queue = rows.before
        if queue is None:  # (across processes, described as none: where another process
            # kept calls, this one's error names them too)
            across = spans_processes(runs.stored().devices)
            return (
                nothing(runs.stored) if across else None,
                functools.partial(runs.restore, rows.counted),
                _nothing_later,
            )
        stage = {"running": False, "ran": False, "dropped": False, "later": False}

        def run() -> KVState:
            stage["running"] = True
            self.run_kept(queue, runs, agreed=True)
            stage["ran"] = True
            return runs.stored()

        def failed() -> None:
            if stage["ran"]:
                runs.restore(rows.counted)
            elif stage["running"]:  # a kept call failed: it undid its own counts, which came first
                if queue.counted is None:
                    runs.restore(rows.counted)
            elif stage["dropped"]:  # (what they counted came first)
                queue.release()
                runs.restore(queue.counted if queue.counted is not None else rows.counted)
            else:
                runs.restore(rows.counted)
                if self.queue is not None:  # held since the push: after the kept ones
                    queue.extend(self.queue)
                self.hold(queue, runs.owner)

        if not spans_processes(runs.stored().devices):
            # One process: nothing to agree (described as none), and the store runs them
            # after the push of rows (its computation dispatched): see :meth:`run_after`.
            return nothing(self.run_after(queue, runs)), failed, _nothing_later

        agreed = before(queue, self.gathered(queue, runs.stored()), run)

        def differ(texts: list[bytes]) -> None:
            stage["dropped"] = True
            agreed.differ(texts)

        def later() -> None:
            stage["later"] = True

        def after() -> None:
            if stage["later"]:
                self.run_after(queue, runs)()

        # (a held pull must read what it reads before the push of rows: run before it)
        runs_later = None if any(queue.pulls) else later
        pushes = None
        if (
            runs_later is not None
            and len(queue.pushes) == 1
            and len(queue.scalars[0]) == len(queue.pushes[0])
        ):  # (one generation, each push's numbers worked out: an MXNet optimizer's)
            updater = runs.group_updater()
            if updater is not None:
                keys = tuple(sorted(queue.pushes[0]))
                pushes = ops.HeldPushes(
                    keys,
                    [queue.pushes[0][k] for k in keys],
                    np.stack([np.asarray(queue.scalars[0][k]) for k in keys]),
                    updater,
                )
        return agreed._replace(differ=differ, later=runs_later, pushes=pushes), failed, after


def _nothing_later() -> None:
    """No kept calls left to run after a push of rows."""


def agree(held: Held, gathered: list[list[Key]]) -> None:
    """Across processes: check that every process holds inits and pushes of the same keys, and
    pulls of the same values split across processes (``gathered``: those keys, per phase of
    pulls; other pulls are each process's own), so that their collectives match; else every
    process raises ``KVStoreError`` naming the keys each one holds. One host all-gather of a
    digest (:func:`described`), the one a row push's agreement makes (``rows.ops``: processes
    that hold different calls meet in all-gathers of one size), and one more only where they
    differ. For a store over several processes."""
    # The watchdog names the turn by the held call a process waits in (its keys compared first).
    what = "push" if held.pushes else "held init" if held.inits else "held pull"
    ops.agree_before(before(held, gathered, run=None), what)


def before(held: Held, gathered: list[list[Key]], run: Any) -> ops.Before:
    """``held`` (``gathered`` as :func:`agree` takes it) as calls held before a row push,
    agreed in its all-gather (``rows.ops.Before``), run by ``run()``."""
    text, digest = described(held, gathered)
    return ops.Before(text, digest, functools.partial(differ, text), run)


def nothing(run: Any) -> ops.Before:
    """No calls held before a row push, as :func:`before` gives them: the digest every process
    sends where it holds none (zeros), with a text naming none, so that where another process
    holds calls this one's error names them too (``run()`` returns the store's state)."""
    return ops.Before(b"{}", np.zeros(32, np.uint8), functools.partial(differ, b"{}"), run)


def described(held: Held, gathered: list[list[Key]]) -> tuple[bytes, np.ndarray]:
    """What :func:`agree` compares across processes: the held calls as text, and its
    SHA-256 (32 bytes), for a caller that compares it in an all-gather of its own."""
    mine = {
        "init": sorted(map(repr, held.inits)),
        "push": [sorted(map(repr, gen)) for gen in held.pushes],
        "gathered": [list(map(repr, keys)) for keys in gathered if keys],
        # An MXNet optimizer's numbers for each held push (its learning rate, ...): the
        # processes update the same values, so they must use the same numbers.
        "numbers": [
            [[repr(k), np.asarray(gen[k]).tolist()] for k in sorted(gen)] for gen in held.scalars
        ],
    }
    text = json.dumps(mine, sort_keys=True).encode()
    return text, np.frombuffer(hashlib.sha256(text).digest(), np.uint8)


def differ(text: bytes, texts: list[bytes]) -> None:
    """The processes' held calls differ (their digests did): raises ``KVStoreError`` naming
    the keys each one holds (or the numbers that differ), given this process's
    :func:`described` text and every process's (gathered by the caller, in every process)."""
    mine = json.loads(text.decode())
    described = []
    everyone = [json.loads(t.decode()) for t in texts]
    if all({**t, "numbers": None} == {**mine, "numbers": None} for t in everyone):
        _numbers_differ(everyone)
    for rank, theirs in enumerate(everyone):  # ({} from a process that holds nothing)
        pushed = " then ".join(_names(gen) for gen in theirs.get("push", [])) or "[]"
        pulled = " then ".join(_names(keys) for keys in theirs.get("gathered", [])) or "[]"
        described.append(
            f"process {rank}: init {_names(theirs.get('init', []))}, push {pushed}, "
            f"pull of split values {pulled}"
        )
    raise KVStoreError(
        "dist_sync: expected every process to push (and init, and pull values split across "
        "processes) the same keys between two reads, "
        "given different ones: " + "; ".join(described) + ". Nothing was pushed. Each process "
        "may push in its own order, but all must push the same keys before any of them reads "
        "a pulled value (asnumpy or any use of an out, nd.waitall, or another call of the store)"
    )


def agree_numbers(keys: list[Key], table: Any) -> None:
    """Across processes, for a push that is not held (a row-sparse push, ``pushpull``): check
    that every process's MXNet optimizer worked out the same numbers for ``keys`` (a row of
    ``table`` each), else every process raises ``KVStoreError`` naming the first key that
    differs and each process's numbers. One host all-gather of a digest, two more only where
    they differ. Every process of the store calls it at the same point of its calls."""
    mine = {"numbers": [[[repr(k), np.asarray(row).tolist()] for k, row in zip(keys, table)]]}
    text = json.dumps(mine, sort_keys=True).encode()
    texts = host.texts_if_differ(text, "the optimizer's numbers of a push")
    if texts is None:
        return
    everyone = [json.loads(t.decode()) for t in texts]
    given = [[k for k, _ in t["numbers"][0]] for t in everyone]
    if any(g != given[0] for g in given):
        per = "; ".join(f"process {p}: {_names(g)}" for p, g in enumerate(given))
        raise KVStoreError(
            f"dist_sync: expected every process to push the same keys, given {per}. Nothing "
            "was pushed"
        )
    _numbers_differ(everyone)


def _numbers_differ(everyone: list[dict]) -> None:
    """Every process holds pushes of the same keys, but its MXNet optimizer worked out other
    numbers for some of them: raise, naming the first such key and each process's numbers."""
    for n, gen in enumerate(everyone[0]["numbers"]):
        for i, (key, _) in enumerate(gen):
            rows = [t["numbers"][n][i][1] for t in everyone]
            if any(r != rows[0] for r in rows):
                per = "; ".join(f"process {p}: {r}" for p, r in enumerate(rows))
                raise KVStoreError(
                    f"dist_sync: key {key}: expected every process's optimizer to update it with "
                    f"the same numbers (learning rate, weight decay, ...), given {per}. Nothing "
                    "was pushed. MXNet's num_update (which drives an lr_scheduler) is the "
                    "largest count of any key, so processes that push keys unequally, in "
                    "different orders, or change the learning rate at different times, count "
                    "differently: push the same keys in the same steps, and change the rate "
                    "in every process alike"
                )
    raise KVStoreError("dist_sync: the processes' held calls differ")  # pragma: no cover


def _names(keys: list[str]) -> str:
    return "[" + ", ".join(keys) + "]"


# Stores that hold calls, for nd.waitall() and the end of the process, each with the number
# of its first hold: they run in that order, the program's own, so that across processes their
# collectives come in the same order in every process.
_HOLDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SERIAL = itertools.count()


def holding(store: Any) -> None:
    """Note that ``store`` holds calls (until it runs them)."""
    if store not in _HOLDING:
        _HOLDING[store] = next(_SERIAL)


def _in_order() -> list[Any]:
    return sorted(_HOLDING.keys(), key=lambda store: _HOLDING.get(store, -1))


def run_everything_held() -> None:
    """Run what every store holds (``nd.waitall``), in the order the stores first held."""
    for store in _in_order():
        store.run_held()


@atexit.register
def _at_exit() -> None:
    """Held pushes run before the process ends, as MXNet's engine finishes its queue: nothing
    pushed is lost (and across processes, every process's collectives still match)."""
    for store in _in_order():
        try:
            store.run_held()
        except Exception:  # pragma: no cover - reported, the process is ending anyway
            logger.exception("jaxkv: a held push failed as the process ended")
