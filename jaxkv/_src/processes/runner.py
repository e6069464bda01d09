"""Each launched process's program: runs the script as ``python script.py args...`` would.

``python -m jaxkv.launch`` starts every process as ``python .../runner.py script.py args...``
(what ``ps`` shows), with the directory for failure notes in ``JAXKV_LAUNCH_NOTES``. The
runner runs the script as Python would (``__main__``, ``sys.argv``, ``sys.path[0]``, the
traceback of an uncaught exception), with two differences. A process that joined a JAX job and
ends with ``sys.exit(n)`` (or ``raise SystemExit(n)``), n not 0, exits at once with that status,
without running its ``atexit`` handlers: JAX's shutdown, an ``atexit`` handler, would otherwise
wait, up to 5 minutes, for every other process to finish, while they wait for it in their next
collective (as for an uncaught exception: ``join.py``). And a process that fails so, or by an
uncaught exception, first writes ``NOTES/failed-RANK``: ``time.monotonic()`` (the same clock in
every process of a machine), then the ranks of the peers listed in ``NOTES/pids`` that had begun
to exit before (``/proc/PID/stat``: ``PF_EXITING``, a zombie, or gone). The launcher names the
first process to fail from these notes, not one whose collective failed because that one had
gone (launcher.py).

This file is run by its path, not imported: it imports nothing from jaxkv (importing jaxkv joins
the job, which the script must be free to do later, after its own set-up), and everything it
defines is removed from ``__main__`` before the script runs there.
"""


def _jaxkv_run_script() -> None:
    import os
    import sys

    globals().pop("_jaxkv_run_script")
    notes = os.environ.pop("JAXKV_LAUNCH_NOTES", "")
    path = os.path.abspath(sys.argv[1])  # as Python makes the __main__ module's __file__
    sys.argv = sys.argv[1:]
    # This file's directory is sys.path[0] until now: the script's takes its place before
    # anything else is imported.
    sys.path[0] = os.path.dirname(os.path.realpath(path)) if os.path.isfile(path) else path

    import contextlib
    import importlib.machinery
    import io
    import runpy
    import time

    def note_failure() -> None:
        # The peers that had begun to exit first, then the time: the launcher names the first
        # process to fail, not one whose collective failed because that one had gone.
        try:
            if not notes:
                return
            ending = []
            if os.path.exists("/proc/self/stat"):
                try:
                    with open(os.path.join(notes, "pids")) as f:
                        peers = [line.split() for line in f]
                except FileNotFoundError:  # this process failed before the others started
                    peers = []
                for rank, pid in peers:
                    if int(pid) == os.getpid():
                        continue
                    try:
                        with open(f"/proc/{pid}/stat") as f:
                            fields = f.read().rsplit(")", 1)[1].split()
                    except (FileNotFoundError, ProcessLookupError):
                        ending.append(rank)  # ended, and the launcher has reaped it
                        continue
                    if fields[0] in ("Z", "X") or int(fields[6]) & 4:  # PF_EXITING
                        ending.append(rank)
            name = os.path.join(notes, "failed-" + os.environ["JAXKV_PROCESS_ID"])
            with open(name + ".tmp", "w") as f:
                f.write(" ".join([repr(time.monotonic()), *ending]))
            os.replace(name + ".tmp", name)
        except Exception:
            pass

    try:
        if os.path.isfile(path):
            with io.open_code(path) as f:
                code = compile(f.read(), path, "exec", dont_inherit=True)
            loader = importlib.machinery.SourceFileLoader("__main__", path)
            globals().update(__file__=path, __cached__=None, __loader__=loader, __doc__=None)
            exec(code, globals())
        else:  # a directory or zip file with __main__.py
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            note_failure()
        jax = sys.modules.get("jax")
        several = int(os.environ.get("JAXKV_NUM_PROCESSES") or 1) > 1
        if e.code in (None, 0) or not several or not getattr(jax, "distributed", None):
            raise
        try:
            joined = jax.distributed.is_initialized()  # type: ignore[union-attr]
        except Exception:
            joined = False
        if not joined:
            raise
        status = e.code
        if not isinstance(status, int):
            print(status, file=sys.stderr)
            status = 1
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        note_failure()
        # As Python reports it: from the script's own frame.
        e = e.with_traceback(e.__traceback__.tb_next if e.__traceback__ else None)
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)


if __name__ == "__main__":
    _jaxkv_run_script()
