"""The launched processes' output as the launcher passes it on: a line at a time, each prefixed
with its process's rank, gloo's connection lines dropped."""

from __future__ import annotations

import os
import re
import selectors
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TextIO

#: The line gloo prints to stdout in each process when it has connected to its peers (once per
#: gloo context: at a job's first collective, and again for each new group of processes).
GLOO_CONNECTED = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    rb"Expected number of connected peer ranks is : \d+\r?\n?"
)

#: Seconds the start of a line waits for its end before it is passed on as it is (a prompt,
#: a progress bar that rewrites one line): its end follows, without a second prefix, when it
#: comes, unless another process's line came between.
PARTIAL_WAIT = 0.5


@dataclass
class _Pipe:
    """One process's stdout or stderr, read by the relay."""

    rank: int
    stream: int  # 1 or 2: where its lines go
    pipe: IO[bytes]
    pending: bytearray = field(default_factory=bytearray)
    since: float = 0.0  # when the first byte of ``pending`` came


class Relay:
    """Copies each process's stdout and stderr to the launcher's, a line at a time, from a
    thread of its own that reads every pipe as soon as it has data (a process never waits on a
    full pipe).

    Args:
      prefix: start each line with ``[RANK] `` (the job-wide rank), as torchrun's ``--tee``
        does.
      gloo_lines: pass on gloo's ``[Gloo] Rank N is connected to ...`` lines
        (:data:`GLOO_CONNECTED`); by default they are dropped.
      streams: where a process's stdout and stderr go; by default the launcher's
        ``sys.stdout`` and ``sys.stderr`` at the time of each write.
      on_error_line: called from the relay's thread with the rank and each whole line of a
        process's stderr (JAX's own errors), before the line is passed on; the launcher reads
        the coordination service's reports of silent processes there (unresponsive.py).

    Lines from different processes never mix: a line is passed on whole, and the start of a
    line passed on early (:data:`PARTIAL_WAIT`) is ended by a newline before another
    process's line goes to the same stream.
    """

    def __init__(
        self,
        prefix: bool = True,
        gloo_lines: bool = False,
        streams: tuple[TextIO, TextIO] | None = None,
        on_error_line: Callable[[int, bytes], None] | None = None,
    ) -> None:
        self.prefix, self.gloo_lines, self._streams = prefix, gloo_lines, streams
        self._on_error_line = on_error_line
        self._selector = selectors.DefaultSelector()
        self._pipes: dict[int, _Pipe] = {}
        # Per stream: the pipe whose line's start was passed on without its end, if any.
        self._mid_line: dict[int, _Pipe | None] = {1: None, 2: None}
        self._abandon = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, rank: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        """Relay process ``rank``'s pipes (``None``: not piped)."""
        for stream, pipe in ((1, stdout), (2, stderr)):
            if pipe is not None:
                self._pipes[pipe.fileno()] = _Pipe(rank, stream, pipe)
                self._selector.register(pipe.fileno(), selectors.EVENT_READ)

    def start(self) -> None:
        """Starts relaying the pipes given to :meth:`watch` so far."""
        self._thread = threading.Thread(target=self._run, name="jaxkv.launch output", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Waits up to ``timeout`` seconds for the end of every pipe (the processes have ended;
        something they started may hold a pipe open), passes on what is left and closes them."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._abandon.set()
                self._thread.join()
        else:
            self._finish()
        self._selector.close()

    def _run(self) -> None:
        while self._pipes and not self._abandon.is_set():
            for key, _ in self._selector.select(timeout=0.1):
                self._read(self._pipes[key.fd])
            now = time.monotonic()
            for p in list(self._pipes.values()):
                if p.pending and now - p.since >= PARTIAL_WAIT:
                    self._pass_on(p, bytes(p.pending), whole=False)
                    p.pending.clear()
        self._finish()

    def _read(self, p: _Pipe) -> None:
        try:
            chunk = os.read(p.pipe.fileno(), 65536)
        except OSError:
            chunk = b""
        if not chunk:
            self._end(p)
            return
        if not p.pending:
            p.since = time.monotonic()
        p.pending += chunk
        end = p.pending.rfind(b"\n") + 1
        if end:
            for line in bytes(p.pending[:end]).splitlines(keepends=True):
                self._heard(p, line)
                self._pass_on(p, line, whole=True)
            del p.pending[:end]
            p.since = time.monotonic()

    def _end(self, p: _Pipe) -> None:
        """The end of ``p``: what is left of its last line is passed on, with a newline when
        lines are prefixed (the next line, from another process, must start a line)."""
        if p.pending:
            self._heard(p, bytes(p.pending))
            self._pass_on(p, bytes(p.pending) + (b"\n" if self.prefix else b""), whole=True)
            p.pending.clear()
        elif self._mid_line[p.stream] is p and self.prefix:
            self._pass_on(p, b"\n", whole=True)
        self._selector.unregister(p.pipe.fileno())
        del self._pipes[p.pipe.fileno()]
        p.pipe.close()

    def _heard(self, p: _Pipe, line: bytes) -> None:
        if p.stream == 2 and self._on_error_line is not None:
            self._on_error_line(p.rank, line.rstrip(b"\r\n"))

    def _finish(self) -> None:
        for p in list(self._pipes.values()):
            self._end(p)

    def _pass_on(self, p: _Pipe, data: bytes, whole: bool) -> None:
        """Writes ``data``, a whole line (``whole``) or the start of one, of ``p``."""
        out = b""
        open_line = self._mid_line[p.stream]  # the pipe whose line was left open, if any
        if open_line is not p:  # a new line of p
            if whole and not self.gloo_lines and GLOO_CONNECTED.fullmatch(data):
                return
            if open_line is not None:
                out += b"\n"  # another process's line was left open: end it first
            if self.prefix:
                out += f"[{p.rank}] ".encode()
        out += data
        self._mid_line[p.stream] = None if whole else p
        self._write(p.stream, out)

    def _write(self, stream: int, data: bytes) -> None:
        if self._streams is not None:
            target = self._streams[stream - 1]
        else:
            target = sys.stdout if stream == 1 else sys.stderr
        try:  # a text stream without bytes beneath (a notebook's, io.StringIO)
            buffer = target.buffer
        except (AttributeError, OSError, ValueError):
            buffer = None
        try:  # a closed or broken stream: the pipes are still read, the output is lost
            target.flush()  # what was written as text first comes first
            if buffer is not None:
                buffer.write(data)
                buffer.flush()
            else:
                target.write(data.decode(errors="replace"))
                target.flush()
        except (OSError, ValueError):
            pass
