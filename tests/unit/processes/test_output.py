"""jaxkv/_src/processes/output.py: the relay of the launched processes' output, on pipes this
test writes to: lines whole and prefixed with their rank, never mixed between processes, gloo's
connection lines dropped, bytes kept as they are, and pipes drained whatever happens to the
launcher's own streams."""

import io
import os
import threading
import time

import pytest

from jaxkv._src.processes import output
from jaxkv._src.processes.output import Relay

GLOO = (
    b"[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
)


class _Stream(io.TextIOWrapper):
    """A text stream over bytes, as ``sys.stdout`` is; what was written is :meth:`bytes`."""

    def __init__(self):
        super().__init__(io.BytesIO(), encoding="utf-8")

    def bytes(self):
        self.flush()
        return self.buffer.getvalue()


class _Job:
    """Processes' pipes as the launcher gives them to the relay, written to by the test."""

    def __init__(self, ranks, **kwargs):
        self.out, self.err = _Stream(), _Stream()
        self.relay = Relay(streams=(self.out, self.err), **kwargs)
        self.writers = {}
        for rank in ranks:
            pipes = [os.pipe(), os.pipe()]
            self.writers[rank] = [w for _, w in pipes]
            self.relay.watch(rank, *(os.fdopen(r, "rb") for r, _ in pipes))
        self.relay.start()

    def write(self, rank, data, stream=1):
        os.write(self.writers[rank][stream - 1], data)

    def end(self, rank=None):
        for r in [rank] if rank is not None else list(self.writers):
            for w in self.writers.pop(r):
                os.close(w)

    def wait_for(self, want, stream=1, timeout=10.0):
        """Waits until the stream's bytes are ``want`` (then a little longer: nothing more)."""
        target = self.out if stream == 1 else self.err
        deadline = time.monotonic() + timeout
        while target.bytes() != want and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert target.bytes() == want

    def close(self):
        self.end()
        self.relay.close()


@pytest.fixture
def job():
    made = []

    def make(ranks=(0, 1), **kwargs):
        made.append(_Job(ranks, **kwargs))
        return made[-1]

    yield make
    for j in made:
        j.close()


def test_each_line_goes_to_its_stream_prefixed_with_its_rank(job):
    j = job()
    j.write(1, b"loss 0.25\n")
    j.wait_for(b"[1] loss 0.25\n")
    j.write(0, b"oops\n", stream=2)
    j.wait_for(b"[0] oops\n", stream=2)
    j.write(0, b"a\nb\n")
    j.wait_for(b"[1] loss 0.25\n[0] a\n[0] b\n")


def test_a_line_written_in_pieces_comes_out_whole(job):
    j = job()
    for piece in [b"[Gloo] Ra", b"nk 0 is ", b"con", b"nected\nstep", b" 1\n"]:
        j.write(0, piece)
        time.sleep(0.01)
    j.wait_for(b"[0] [Gloo] Rank 0 is connected\n[0] step 1\n")


def test_a_line_never_mixes_with_another_processs(job, monkeypatch):
    """The start of rank 0's line waits for its end while rank 1's whole line goes first; once
    passed on early (a prompt, after PARTIAL_WAIT), it is ended before rank 1's next line, and
    its rest comes prefixed again."""
    assert output.PARTIAL_WAIT <= 1.0  # a prompt shows within a second
    monkeypatch.setattr(output, "PARTIAL_WAIT", 60.0)
    j = job()
    j.write(0, b"abc")
    j.write(1, b"line\n")
    j.wait_for(b"[1] line\n")
    j.write(0, b"def\n")
    seen = b"[1] line\n[0] abcdef\n"
    j.wait_for(seen)
    monkeypatch.setattr(output, "PARTIAL_WAIT", 0.05)
    j.write(0, b"prompt> ")
    j.wait_for(seen + b"[0] prompt> ")
    j.write(0, b"yes\n")  # the same process goes on: no second prefix
    seen += b"[0] prompt> yes\n"
    j.wait_for(seen)
    j.write(0, b"progress 10%")
    j.wait_for(seen + b"[0] progress 10%")
    j.write(1, b"other\n")
    seen += b"[0] progress 10%\n[1] other\n"
    j.wait_for(seen)
    j.write(0, b" 20%\n")
    j.wait_for(seen + b"[0]  20%\n")


def test_a_dropped_gloo_line_leaves_another_processs_open_line_open(job, monkeypatch):
    monkeypatch.setattr(output, "PARTIAL_WAIT", 0.05)
    j = job()
    j.write(0, b"prompt> ")
    j.wait_for(b"[0] prompt> ")
    j.write(1, GLOO)  # dropped: nothing is written, nor is rank 0's line ended
    time.sleep(0.2)
    j.write(0, b"yes\n")
    j.wait_for(b"[0] prompt> yes\n")


def test_gloos_connection_lines_are_dropped_unless_asked_for(job):
    j = job()
    j.write(0, GLOO + b"[Gloo] a line of the user's\n")
    j.wait_for(b"[0] [Gloo] a line of the user's\n")
    j.write(1, GLOO.replace(b"Rank 1", b"Rank 12") + b"after\n")
    j.wait_for(b"[0] [Gloo] a line of the user's\n[1] after\n")
    kept = job(gloo_lines=True)
    kept.write(0, GLOO)
    kept.wait_for(b"[0] " + GLOO)


def test_without_prefix_the_bytes_pass_as_they_are(job):
    j = job(ranks=(0,), prefix=False)
    data = b"\xff\xfe not utf-8\r\nno end"
    j.write(0, data)
    j.end(0)
    j.wait_for(data)


def test_the_last_line_without_its_end_is_ended_when_prefixed(job):
    j = job()
    j.write(0, b"no end")
    j.end(0)
    j.wait_for(b"[0] no end\n")
    j.write(1, b"next\n")
    j.wait_for(b"[0] no end\n[1] next\n")


def test_each_whole_line_of_stderr_is_heard_with_its_rank_before_it_is_passed_on(job):
    heard = []
    j = job(on_error_line=lambda rank, line: heard.append((rank, line)))
    j.write(0, b"out\n")  # stdout: not heard
    j.write(1, b"E1202 half ", stream=2)
    time.sleep(0.05)
    j.write(1, b"a line\r\n1\n", stream=2)
    j.wait_for(b"[1] E1202 half a line\r\n[1] 1\n", stream=2)
    j.write(0, b"no end", stream=2)
    j.end(0)
    j.wait_for(b"[1] E1202 half a line\r\n[1] 1\n[0] no end\n", stream=2)
    assert heard == [(1, b"E1202 half a line"), (1, b"1"), (0, b"no end")]


class _TextOnly(io.StringIO):
    """A text stream with no bytes beneath, as a notebook's ``sys.stdout`` may be."""

    @property
    def buffer(self):
        raise io.UnsupportedOperation("no buffer")


@pytest.mark.parametrize("stream", [io.StringIO, _TextOnly])
def test_a_text_stream_without_bytes_beneath_gets_the_lines_as_text(stream):
    out = stream()
    relay = Relay(streams=(out, stream()))
    r, w = os.pipe()
    relay.watch(2, os.fdopen(r, "rb"), None)
    relay.start()
    os.write(w, "caf\xe9 \u2713\n".encode() + b"\xff\n")
    os.close(w)
    relay.close()
    assert out.getvalue() == "[2] caf\xe9 \u2713\n[2] \ufffd\n"


class _Broken:
    """``sys.stdout`` once the reader of the launcher's output has gone."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_process_never_waits_on_a_full_pipe_when_the_launchers_stream_is_broken():
    """``python -m jaxkv.launch ... | head -1``: the relay goes on reading the pipes (a process
    blocked on a full pipe would hang the job) and drops what it cannot write."""
    relay = Relay(streams=(_Broken(), _Broken()))
    r, w = os.pipe()
    relay.watch(0, os.fdopen(r, "rb"), None)
    relay.start()
    wrote = threading.Event()

    def write():
        for _ in range(64):  # 4 MiB, far past a pipe's 64 KiB
            os.write(w, b"x" * 65535 + b"\n")
        wrote.set()

    threading.Thread(target=write, daemon=True).start()
    assert wrote.wait(30)
    os.close(w)
    relay.close()


def test_close_gives_up_on_a_pipe_held_open_and_passes_on_what_came():
    """Something a process started holds its pipe open after it ended: close() waits only
    its timeout, and the start of a line that came is not lost."""
    out = _Stream()
    relay = Relay(streams=(out, _Stream()))
    r, w = os.pipe()
    relay.watch(3, os.fdopen(r, "rb"), None)
    relay.start()
    os.write(w, b"half")
    start = time.monotonic()
    relay.close(timeout=0.3)
    assert time.monotonic() - start < 2.0
    assert out.bytes().startswith(b"[3] half")
    os.close(w)


def test_close_without_start_closes_the_pipes():
    r, w = os.pipe()
    pipe = os.fdopen(r, "rb")
    relay = Relay(streams=(_Stream(), _Stream()))
    relay.watch(0, pipe, None)
    relay.close()
    assert pipe.closed
    os.close(w)
