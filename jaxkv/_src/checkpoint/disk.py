"""Disk faults as DiskErrors naming the target and the OS's reason; files replaced atomically."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import BinaryIO

from jaxkv._src.errors import DiskError

__all__ = ["faults", "reason", "remove", "remove_in", "replacing"]

# What to do about the faults a user can mend.
_FIXES = {
    errno.ENOSPC: "free some space, or save elsewhere",
    errno.EFBIG: (
        "the file system, or the process's file size limit (ulimit -f), takes no file this "
        "big; save elsewhere"
    ),
    errno.EROFS: "save to a writable file system",
    errno.EACCES: "check the permissions of the path and of its directories",
    errno.EPERM: "check the permissions of the path and of its directories",
    errno.EISDIR: "name a file, or a checkpoint directory",
    errno.ENOENT: "check the path",
}


def reason(error: OSError) -> str:
    """The OS's reason for ``error`` in words, and its name: ``no space left on device
    (ENOSPC)``."""
    if error.errno is None:
        return str(error)
    words = os.strerror(error.errno)
    return f"{words[:1].lower()}{words[1:]} ({errno.errorcode.get(error.errno, error.errno)})"


def _os_error(error: BaseException | None) -> OSError | None:
    """The OSError (one with an errno) that ``error`` is, or was raised from."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno is not None:
            return error
        seen.add(id(error))
        error = error.__cause__
    return None


@contextlib.contextmanager
def faults(
    target: str, *, writing: bool = True, undo: Callable[[], object] | None = None
) -> Iterator[None]:
    """Raise an OS error of the block (or an error raised from one) as a :class:`DiskError`
    (a KVStoreError and an OSError) that names ``target`` and the OS's reason, from the
    OSError; on any error, ``undo()`` first removes what the block left (its own OS errors
    ignored).

    Examples:
      >>> with faults("/data/kv.npz"):  # doctest: +ELLIPSIS
      ...     raise OSError(errno.ENOSPC, "No space left on device", "/data/.jaxkv-1.tmp")
      Traceback (most recent call last):
      jaxkv.DiskError: /data/kv.npz: cannot be written: no space left on device (ENOSPC); ...
    """
    try:
        yield
    except BaseException as e:
        if undo is not None:
            with contextlib.suppress(OSError):
                undo()
        cause = _os_error(e) if isinstance(e, Exception) else None
        if cause is None:
            raise
        fix = _FIXES.get(cause.errno or 0)
        message = f"{target}: cannot be {'written' if writing else 'read'}: {reason(cause)}"
        if fix:
            message += f"; {fix}"
        if writing:
            message += ". Nothing saved there before has changed"
        raise DiskError(message) from cause


@contextlib.contextmanager
def replacing(path: str, target: str | None = None) -> Iterator[BinaryIO]:
    """A binary file whose bytes replace the file ``path`` once the block ends: written beside
    it under a temporary name (``.jaxkv-*.tmp``), flushed to the disk and renamed over it, or
    removed on any error. A symbolic link at ``path`` is written through, as ``numpy.save``
    writes it (a dangling link's file is made, with its directories). Disk faults name
    ``target`` (default ``path``)."""
    final = os.path.realpath(path)
    parent = os.path.dirname(final)
    made: list[str] = []

    def undo() -> None:
        for tmp in made:
            os.unlink(tmp)

    with faults(path if target is None else target, undo=undo):
        os.makedirs(parent, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".jaxkv-", suffix=".tmp", dir=parent)
        made.append(tmp)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        made.clear()
    with contextlib.suppress(OSError):  # the rename itself reaches the disk, where it can
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove(path: str) -> None:
    """Remove the file or directory tree ``path`` if it is there, ignoring errors (what is
    left, a later save or manager removes)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def remove_in(directory: str, names: Callable[[str], bool]) -> None:
    """:func:`remove` each entry of ``directory`` whose name ``names`` accepts (none where the
    directory cannot be listed)."""
    try:
        listed = os.listdir(directory)
    except OSError:
        return
    for name in listed:
        if names(name):
            remove(os.path.join(directory, name))
