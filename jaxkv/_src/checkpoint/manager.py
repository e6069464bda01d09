"""Numbered checkpoints in one directory, saved in the background, through orbax-checkpoint."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import re
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

import jax
import numpy as np

from jaxkv._src.checkpoint import disk, npz, orbax_dirs
from jaxkv._src.errors import KVStoreError
from jaxkv._src.processes import host, order
from jaxkv._src.state.kvstate import KVState, empty

if TYPE_CHECKING:
    from jaxkv._src.mxnet.kvstore import KVStore

__all__ = ["CheckpointManager"]

#: The item of a step directory that holds the store: a checkpoint directory as
#: ``orbax_dirs`` writes one (``manifest.json`` and ``data-<16 hex digits>/state``).
ITEM = "kv"
#: Where processes other than 0 leave the digests of the files they wrote, for process 0 to
#: put in the manifest (removed before the step is committed).
DIGESTS = ".jaxkv-digests"
_MAX_STEP = 16**16 - 1  # a step names its data directory in 16 hex digits
#: What saves cut short leave in the directory: orbax's temporary directory of a step
#: (``<step>.orbax-checkpoint-tmp``, with a suffix of its own in some orbax versions) and
#: jaxkv's temporary files.
_INTERRUPTED = re.compile(r"(\d+)\.orbax-checkpoint-tmp.*|\.jaxkv-.*\.tmp")


def _is_store(target: Any) -> bool:
    """Whether ``target`` is an imperative store (a ``state`` property and ``load``), without
    reading its state (reading it settles held calls and shares its arrays)."""
    return isinstance(getattr(type(target), "state", None), property) and callable(
        getattr(target, "load", None)
    )


@functools.cache
def _orbax_types() -> tuple[type, type]:
    """orbax's handler for a jaxkv checkpoint directory, and its save arguments (built on first
    use: orbax is imported only when used)."""
    ocp = orbax_dirs.orbax()
    from etils import epath  # type: ignore[import-untyped]  # (orbax's own dependency)

    @dataclasses.dataclass
    class Save(ocp.args.CheckpointArgs):  # type: ignore[name-defined]
        """A store's manifest (``orbax_dirs.describe``'s) and the arrays orbax writes."""

        manifest: dict
        tree: dict

    class Handler(ocp.AsyncCheckpointHandler):  # type: ignore[name-defined]
        """Writes a jaxkv checkpoint directory into the step's item directory.

        ``async_save`` (every process, in the caller's thread): orbax's own handler copies the
        arrays to the host and starts writing each process's shards to ``data-.../state``.
        Then, in orbax's background thread, every process other than 0 hashes the files it
        wrote once they are written and leaves the digests in ``.jaxkv-digests``. ``finalize``
        (process 0, after every process has written): orbax's handler finishes its files,
        process 0 hashes its own and the shared ones, and puts the manifest with every file's
        size and SHA-256 in place. orbax then renames the step's directory into place: a
        process killed before that leaves the previous steps as they were.
        """

        def __init__(self) -> None:
            self._arrays = ocp.StandardCheckpointHandler()
            self._saving: dict[str, tuple[dict, bool]] = {}

        async def async_save(self, directory: Any, args: Save) -> list:
            manifest, tree = args.manifest, args.tree
            root = os.path.join(os.fspath(directory), manifest["data"], "state")
            os.makedirs(root, exist_ok=True)  # every process, before writing into it
            futures: list = []
            if tree:
                save = ocp.args.StandardSave(tree)
                futures = await self._arrays.async_save(epath.Path(root), args=save) or []
            self._saving[os.fspath(directory)] = (manifest, bool(tree))
            hashed = functools.partial(_leave_digests, os.fspath(directory), root)
            return [ocp.future.ChainedFuture(futures, cb=hashed)]

        def save(self, directory: Any, args: Save) -> None:
            for f in asyncio.run(self.async_save(directory, args)):
                f.result()

        def restore(self, directory: Any, args: Any = None) -> Any:
            raise KVStoreError(
                f"{directory}: a step is restored by jaxkv.CheckpointManager.restore, "
                "not through orbax"
            )

        def finalize(self, directory: Any) -> None:
            manifest, arrays = self._saving.pop(os.fspath(directory))
            root = os.path.join(os.fspath(directory), manifest["data"], "state")
            if arrays:
                self._arrays.finalize(epath.Path(root))
            manifest["files"] = orbax_dirs.file_records(
                [orbax_dirs.digests(root), *_digests_left(os.fspath(directory))]
            )
            orbax_dirs.commit(os.fspath(directory), manifest)
            disk.remove(os.path.join(os.fspath(directory), DIGESTS))

        def close(self) -> None:
            self._arrays.close()

    # (orbax asks for restore arguments too; restores go through jaxkv, see Handler.restore)
    ocp.args.register_with_handler(Handler, for_save=True, for_restore=True)(Save)
    return Handler, Save


def _leave_digests(directory: str, root: str) -> None:
    """Once this process's files are written: on a process other than 0, leave their digests
    for process 0 (which hashes its own in ``finalize``, after orbax's last files)."""
    me = jax.process_index()
    if me == 0:
        return
    with disk.replacing(os.path.join(directory, DIGESTS, f"process_{me}.json")) as f:
        f.write(json.dumps(orbax_dirs.digests(root)).encode())


def _remove_interrupted(directory: str, step: int | None = None) -> None:
    """On process 0, remove what saves cut short left in ``directory`` (of ``step`` alone,
    where given): orbax's temporary step directories and jaxkv's temporary files; and, on
    opening (``step`` None), a step whose deletion was cut short (``max_to_keep``'s: orbax
    deletes a step's files in place, so a kill there leaves a step directory without its
    manifest, which a committed step always has: orbax renames a step into place once
    jaxkv's manifest is in it)."""
    if jax.process_index() != 0:
        return

    def left(name: str) -> bool:
        match = _INTERRUPTED.fullmatch(name)
        if match is not None:
            return step is None or match.group(1) == str(step)
        return (
            step is None
            and name.isdigit()
            and os.path.isdir(os.path.join(directory, name))
            and not os.path.exists(os.path.join(directory, name, ITEM, orbax_dirs.MANIFEST))
        )

    disk.remove_in(directory, left)


def _digests_left(directory: str) -> list[dict]:
    """The digests processes 1, 2, ... left, in process order."""
    out = []
    for process in range(1, jax.process_count()):
        path = os.path.join(directory, DIGESTS, f"process_{process}.json")
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError) as e:
            raise KVStoreError(
                f"{directory}: expected the digests of the files process {process} wrote, "
                f"given none readable ({type(e).__name__}: {e})"
            ) from None
    return out


class CheckpointManager:
    """Numbered checkpoints of a store in one directory: saved in the background, the newest
    ``max_to_keep`` kept, the latest complete one restored after a restart.

    Each step is a directory ``directory/<step>`` whose ``kv`` is a checkpoint directory as
    :func:`save_state` writes one across processes: every array's file checked (SHA-256) when
    restored, so a damaged or mismatched step is a :class:`KVStoreError`, never a wrong value.
    orbax-checkpoint's ``CheckpointManager`` keeps the steps (``pip install 'jaxkv[dist]'``): a
    save returns once the arrays are copied to the host and writes them in a background
    thread; the step's directory is renamed into place once every process has written, so a
    save cut short (a process killed) leaves the steps before it as they were and is never
    listed. Opening the directory removes what saves cut short left there (orbax's
    ``<step>.orbax-checkpoint-tmp*`` directories, jaxkv's ``.jaxkv-*.tmp`` files), and a save
    that fails removes its own: a disk fault (a read-only directory, a full disk) is a
    :class:`KVStoreError` naming the step's directory and the OS's reason, and the steps before
    it are kept. In a multi-process job every process makes the manager and calls each method,
    in the same order, with a store over every process's devices; process 0 removes the
    leftovers while the others wait.

    Args:
      directory: where the steps are (made if missing).
      max_to_keep: how many of the newest steps to keep, older ones deleted once a newer save
        has completed; ``None`` (default) keeps all.

    Raises:
      KVStoreError: ``max_to_keep`` is not a positive int, or orbax-checkpoint is missing.

    Examples:
      >>> import tempfile, jax.numpy as jnp, optax, jaxkv
      >>> opt = optax.sgd(0.1, momentum=0.9)
      >>> state = jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(), {"w": jnp.ones(3)}), opt)
      >>> with jaxkv.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as ckpt:
      ...     for step in (10, 20, 30):
      ...         ckpt.save(step, state)  # returns while the step is written
      ...     ckpt.wait_until_finished()
      ...     print(ckpt.all_steps(), ckpt.latest_step())
      ...     restored = ckpt.restore(optimizer=opt)  # the latest step
      [20, 30] 30
      >>> restored["w"].tolist(), list(restored.opt_states)
      ([1.0, 1.0, 1.0], [('w',)])
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int | None = None):
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise KVStoreError(
                f"max_to_keep: expected None or a positive int, given {max_to_keep!r}"
            )
        ocp = orbax_dirs.orbax()
        handler, save_args = _orbax_types()
        self._directory = os.path.abspath(os.fspath(directory))
        self._composite = ocp.args.Composite
        self._save_args = save_args
        self._saving: int | None = None  # the step a background save may still be writing
        self._closed = False
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add(ITEM, save_args, handler())
        options = ocp.CheckpointManagerOptions(
            preservation_policy=(
                None if max_to_keep is None else ocp.checkpoint_managers.LatestN(n=max_to_keep)
            ),
            # Saves that a kill cut short: removed below, before orbax lists the steps.
            cleanup_tmp_directories=False,
            enable_async_checkpointing=True,
            # The item's directory exists when the handler starts writing into it.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        # orbax's barriers between processes here are collectives: one turn for them all.
        with order.collective("checkpoint manager", watch=False), disk.faults(self._directory):
            _remove_interrupted(self._directory)  # process 0, while the others wait here:
            host.barrier("jaxkv.CheckpointManager: interrupted saves removed")
            self._manager = ocp.CheckpointManager(
                self._directory, options=options, handler_registry=registry
            )

    @property
    def directory(self) -> str:
        """The directory of the steps, absolute."""
        return self._directory

    def path(self, step: int) -> str:
        """The checkpoint directory of ``step``, which :func:`load_state` and
        :meth:`KVStore.load` read too."""
        return os.path.join(self._directory, str(self._step(step)), ITEM)

    def all_steps(self) -> list[int]:
        """Every step saved, in increasing order (a save in progress included)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step saved (a save in progress included: :meth:`restore` waits for it),
        or ``None``."""
        return self._manager.latest_step()

    def save(self, step: int, target: KVState | KVStore) -> None:
        """Save ``target`` (a :class:`KVState`, or a :class:`KVStore`'s state) as ``step``.

        Waits for the previous save, copies the arrays to the host and returns; the step is
        written in the background (:meth:`wait_until_finished` waits for it). Once it is
        complete, steps beyond the newest ``max_to_keep`` are deleted.

        Raises:
          KVStoreError: ``step`` is not after the latest step, ``target`` is neither a state
            nor a store, the state is not on one process's devices or every process's, the
            previous save failed, or a disk fault (naming the step's directory and the OS's
            reason; the step's temporary directory is removed).
        """
        self._open("save")
        step = self._step(step)
        self.wait_until_finished()
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise KVStoreError(
                f"{self._directory}: step {step}: expected a step after the latest saved "
                f"({latest}), given {step}; save to another directory to start over"
            )
        if isinstance(target, KVState):
            state = target
        elif _is_store(target):
            state = target.state
        else:
            raise KVStoreError(
                f"save: expected a jaxkv.KVState or a jaxkv.KVStore, given {type(target).__name__}"
            )
        path = os.path.join(self._directory, str(step), ITEM)
        manifest, entries = npz.directory_contents(path, state)
        tree = orbax_dirs.describe(manifest, entries, orbax_dirs.data_name(step))
        with (
            order.collective("checkpoint manager save", watch=False),
            disk.faults(os.path.dirname(path), undo=self._removing(step)),
        ):
            try:
                item = self._composite(**{ITEM: self._save_args(manifest, tree)})
                self._manager.save(step, args=item, force=True)
            except KVStoreError:
                raise
            except Exception as e:  # orbax's and tensorstore's own errors, of many types
                raise KVStoreError(f"{path}: the save failed ({type(e).__name__}: {e})") from e
        self._saving = step

    def wait_until_finished(self) -> None:
        """Wait until the save in progress, if any, is complete on every process.

        Raises:
          KVStoreError: that save failed (a disk fault names the step's directory and the OS's
            reason); its step is then not listed, and its temporary directory is removed.
        """
        step, self._saving = self._saving, None
        if step is None:
            target, undo = self._directory, None
        else:
            target, undo = os.path.join(self._directory, str(step)), self._removing(step)
        with disk.faults(target, undo=undo):
            try:
                self._manager.wait_until_finished()
            except Exception as e:
                raise KVStoreError(
                    f"{self._directory}: the save of step {step} failed ({type(e).__name__}: {e})"
                ) from e

    @overload
    def restore(
        self, step: int | None = None, into: KVState | None = None, *, optimizer: Any = None
    ) -> KVState: ...

    @overload
    def restore(self, step: int | None, into: KVStore, *, optimizer: Any = None) -> None: ...

    def restore(
        self,
        step: int | None = None,
        into: KVState | KVStore | None = None,
        *,
        optimizer: Any = None,
    ) -> KVState | None:
        """Restore ``step`` (default: the latest), once any save in progress is complete.

        Args:
          step: a step of :meth:`all_steps`, or ``None`` for the latest.
          into: a :class:`KVState` whose devices (and big-array bound) the restored state is
            placed on (default ``jaxkv.empty()``): the restored state is returned; or a
            :class:`KVStore`, which loads the step itself (:meth:`KVStore.load`, with its own
            optimizer) and ``None`` is returned.
          optimizer: the optax transformation that rebuilds the saved optimizer states of a
            state (not of a store).

        Raises:
          KVStoreError: no step is saved, ``step`` is not one of them, or the step is damaged
            or does not fit (as :func:`load_state` refuses it); a store is then unchanged.
        """
        self._open("restore")
        self.wait_until_finished()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise KVStoreError(f"{self._directory}: expected a saved step, given none")
            step = steps[-1]
        step = self._step(step)
        if step not in steps:
            raise KVStoreError(
                f"{self._directory}: expected one of the saved steps {steps}, given {step}"
            )
        path = self.path(step)
        if _is_store(into):
            if optimizer is not None:
                raise KVStoreError(
                    "restore: a KVStore restores its optimizer states with its own optimizer "
                    "(set_optimizer), given optimizer= too"
                )
            into.load(path)  # type: ignore[union-attr]
            return None
        like = empty() if into is None else into
        if not isinstance(like, KVState):
            raise KVStoreError(
                f"into: expected a jaxkv.KVState, a jaxkv.KVStore or None, given "
                f"{type(like).__name__}"
            )
        return npz.load(path, like, values=True, optimizer=optimizer)

    def close(self) -> None:
        """Wait for the save in progress, then release orbax's resources (once)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_until_finished()
        finally:
            self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _removing(self, step: int) -> functools.partial[None]:
        """What removes the temporary directory of a failed save of ``step``."""
        return functools.partial(_remove_interrupted, self._directory, step)

    def _open(self, what: str) -> None:
        if self._closed:
            raise KVStoreError(f"{what}: expected an open CheckpointManager, given a closed one")

    def _step(self, step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise KVStoreError(f"step: expected an int, given {type(step).__name__}")
        if not 0 <= step <= _MAX_STEP:
            raise KVStoreError(f"step: expected an int from 0 to 16**16 - 1, given {step}")
        return int(step)
