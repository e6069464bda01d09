"""Run KVStore programs (see programs.py) with MXNet or jaxkv and print each op's outcome as JSON.

One program, from a file or stdin (what ``programs.py --seed S`` prints)::

    python programs.py --seed 42 | ../.venv-mxnet/bin/python run_program.py --impl mxnet
    python programs.py --seed 42 | ../.venv/bin/python run_program.py --impl jaxkv

prints ``{"id": 42, "ops": [outcome, ...]}``, one outcome per op: ``{"status": "ok", "values":
...}`` (``values``: what a pull, pushpull or broadcast filled, as nested lists in the shape of its
``out``; ``null`` for other ops), ``{"status": "refused", "error": "..."}`` (the op raised any
exception), or ``{"status": "skipped"}`` (no store: ``create`` was refused).

``--batch FILE`` (``-``: stdin) reads programs as JSON lines and prints one result line each;
every program gets a fresh store. With ``--fork`` (MXNet), each program runs in a child process
of its own, forked from this one after MXNet is imported (imported once: fast), so a crash of
MXNet loses only that program: its line is then ``{"id": ..., "crash": {"exit": code,
"at_op": i, "ops": [outcomes before op i]}}`` (``exit`` negative: killed by that signal).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import programs  # noqa: E402


# The updaters programs may choose, by name (see programs.UPDATERS). They print nothing.
def add2(key, input, stored):  # noqa: A002 (MXNet's parameter names)
    stored += input * 2


def sub_half(key, input, stored):  # noqa: A002
    stored[:] = stored - 0.5 * input


def assign(key, input, stored):  # noqa: A002
    stored[:] = input


def neg_add(key, input, stored):  # noqa: A002
    stored[:] = input - stored


def scale_add(key, input, stored):  # noqa: A002
    stored *= 2
    stored += input


def by_key(key, input, stored):  # noqa: A002
    # Only int keys are named: MXNet passes str keys to updaters as bytes (b'w'), jaxkv as str.
    stored += input * (2 if key in (3, 7, 12) else 1)


def iadd_return(key, input, stored):  # noqa: A002
    # MXNet ignores what an updater returns; jaxkv uses it. Here both are the updated `stored`.
    stored += input
    return stored


UPDATERS = {
    f.__name__: f for f in (add2, sub_half, assign, neg_add, scale_add, by_key, iadd_return)
}
assert sorted(UPDATERS) == sorted(programs.UPDATERS)


def import_mx(impl: str):
    """``mxnet`` or ``jaxkv.mx`` (the latter with 8 simulated CPU devices)."""
    if impl == "mxnet":
        import mxnet as mx

        return mx
    sys.path.insert(0, os.path.dirname(HERE))  # this checkout's jaxkv
    import jax

    jax.config.update("jax_num_cpu_devices", programs.NUM_CONTEXTS)
    import jaxkv.mx as mx

    return mx


def _message(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    name = type(e).__name__
    return (last if last.startswith(name + ":") else f"{name}: {last}")[:300]


class Runner:
    """Runs programs with one ``mx`` module."""

    def __init__(self, mx):
        self.mx = mx
        self.optimizer = None  # the optimizer of the last set_optimizer (set_learning_rate)

    def _tree(self, spec, make):
        if spec is None:
            return None
        if isinstance(spec, list):
            return [self._tree(s, make) for s in spec]
        return make(spec)

    def value(self, d):
        """The NDArray a value description ``d`` stands for (see programs.py)."""
        mx = self.mx
        ctx = mx.cpu(d["ctx"])
        if not programs.row_sparse(d):
            return mx.nd.array(programs.materialize(d), ctx=ctx)
        shape, make = tuple(d["shape"]), d["make"]
        if make == "zeros":
            return mx.nd.sparse.zeros("row_sparse", shape, ctx=ctx)
        if make == "ones":
            return mx.nd.ones(shape, ctx=ctx).tostype("row_sparse") * d["fill"]
        if make == "tostype":
            return mx.nd.array(programs.materialize(d), ctx=ctx).tostype("row_sparse")
        rows = d["rows"]
        data = np.array(programs.row_data(d), dtype=np.float32).reshape((len(rows), *shape[1:]))
        return mx.nd.sparse.row_sparse_array(
            (mx.nd.array(data, ctx=ctx), self.ids(rows, d["ids_dtype"], ctx)), shape=shape, ctx=ctx
        )

    def ids(self, ids, dtype, ctx):
        """Row ids as MXNet code makes them: ``int64``, or ``nd.array``'s default float32."""
        mx = self.mx
        if dtype == "int64":
            return mx.nd.array(ids, ctx=ctx, dtype="int64")
        return mx.nd.array(ids, ctx=ctx)

    def values(self, spec):
        return self._tree(spec, self.value)

    def outs(self, spec):
        mx = self.mx

        def out(d):
            if programs.row_sparse(d):
                return mx.nd.sparse.zeros("row_sparse", tuple(d["shape"]), ctx=mx.cpu(d["ctx"]))
            return mx.nd.zeros(tuple(d["shape"]), ctx=mx.cpu(d["ctx"]))

        return self._tree(spec, out)

    def row_ids(self, spec):
        mx = self.mx
        return self._tree(spec, lambda d: self.ids(d["ids"], d["dtype"], mx.cpu(d["ctx"])))

    def read(self, arrays):
        """Nested lists; a row-sparse array as ``{"rsp": its dense value, "ids": its row ids}``."""
        if isinstance(arrays, list):
            return [self.read(a) for a in arrays]
        if getattr(arrays, "stype", "default") == "row_sparse":
            ids = [int(i) for i in arrays.indices.asnumpy().tolist()]
            return {"rsp": arrays.asnumpy().tolist(), "ids": ids}
        return arrays.asnumpy().tolist()

    def step(self, kv, op):
        """Run one op on ``kv``; returns ``(kv, values)``."""
        mx, name = self.mx, op["op"]
        result = None
        if name == "create":
            kv = mx.kv.create(op["type"])
        elif name == "init":
            kv.init(op["key"], self.values(op["value"]))
        elif name == "push":
            kv.push(op["key"], self.values(op["value"]))
        elif name == "pull":
            outs = self.outs(op["out"])
            if "ignore_sparse" in op:
                kv.pull(op["key"], out=outs, ignore_sparse=op["ignore_sparse"])
            else:
                kv.pull(op["key"], out=outs)
            result = outs
        elif name == "row_sparse_pull":
            outs = self.outs(op["out"])
            kv.row_sparse_pull(op["key"], out=outs, row_ids=self.row_ids(op["row_ids"]))
            result = outs
        elif name == "pushpull":
            values, outs = self.values(op["value"]), self.outs(op.get("out"))
            kv.pushpull(op["key"], values, out=outs)
            result = values if outs is None else outs
        elif name == "broadcast":
            outs = self.outs(op["out"])
            kv.broadcast(op["key"], self.values(op["value"]), out=outs)
            result = outs
        elif name == "set_updater":
            kv._set_updater(UPDATERS[op["name"]])
        elif name == "set_optimizer":
            args = dict(op["args"])
            if "scheduler" in op:
                cls, kwargs = op["scheduler"]
                args["lr_scheduler"] = getattr(mx.lr_scheduler, cls)(**kwargs)
            with warnings.catch_warnings():  # a learning_rate replacing the schedule's base_lr
                warnings.simplefilter("ignore")
                self.optimizer = getattr(mx.optimizer, op["name"])(**args)
            kv.set_optimizer(self.optimizer)
        elif name == "set_learning_rate":
            if op["how"] == "lr":
                self.optimizer.lr = op["lr"]
            else:
                self.optimizer.set_learning_rate(op["lr"])
        else:
            raise ValueError(f"unknown op {name!r}")
        mx.nd.waitall()  # MXNet is asynchronous: an error must show up at its own op
        return kv, None if result is None else self.read(result)

    def run(self, program, emit=None):
        """The outcome of each op; ``emit(outcome)`` is called after each one, as it happens."""
        kv, outcomes = None, []
        for op in program["ops"]:
            if kv is None and op["op"] != "create":
                outcome = {"status": "skipped"}
            else:
                try:
                    kv, values = self.step(kv, op)
                    outcome = {"status": "ok", "values": values}
                except Exception as e:  # any exception is a refusal
                    outcome = {"status": "refused", "error": _message(e)}
            outcomes.append(outcome)
            if emit is not None:
                emit(outcome)
        return outcomes


def _open(source: str):
    return os.fdopen(os.dup(0)) if source == "-" else open(source)


def _read_programs(source: str):
    with _open(source) as stream:
        for line in stream:
            if line.strip():
                yield json.loads(line)


def _run_forked(runner: Runner, program: dict, timeout: int) -> dict:
    """Run ``program`` in a forked child; its outcomes stream back through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report, and leave without running any clean-up
        code = 0
        try:
            os.close(r)
            signal.alarm(timeout)  # a hung program dies of SIGALRM: reported as a crash
            out = os.fdopen(w, "w", buffering=1)

            def emit(outcome):
                out.write(json.dumps(outcome) + "\n")

            runner.run(program, emit)
            out.write('"done"\n')
            out.flush()
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as pipe:
        lines = [json.loads(line) for line in pipe if line.strip()]
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    done = bool(lines) and lines[-1] == "done"
    ops = lines[:-1] if done else lines
    if code != 0 or not done:
        return {"id": program["id"], "crash": {"exit": code, "at_op": len(ops), "ops": ops}}
    return {"id": program["id"], "ops": ops}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["mxnet", "jaxkv"], required=True)
    parser.add_argument("program", nargs="?", default="-", help="a program file (default stdin)")
    parser.add_argument("--batch", metavar="FILE", help="run many programs: JSON lines")
    parser.add_argument(
        "--fork",
        action="store_true",
        help="with --batch: run each program in a forked child of its own",
    )
    parser.add_argument(
        "--timeout",
        type=int,
        default=120,
        help="with --fork: seconds a program may take before it is killed",
    )
    args = parser.parse_args(argv)

    # Results go to the real stdout; anything a library prints goes to stderr instead.
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    runner = Runner(import_mx(args.impl))
    if args.batch is None:
        with _open(args.program) as source:
            program = json.load(source)
        results.write(json.dumps({"id": program.get("id"), "ops": runner.run(program)}) + "\n")
        return
    for program in _read_programs(args.batch):
        if args.fork:
            result = _run_forked(runner, program, args.timeout)
        else:
            result = {"id": program["id"], "ops": runner.run(program)}
        results.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
