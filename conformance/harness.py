"""Conformance: random KVStore programs through MXNet 1.9.1 and jaxkv, compared op by op.

Run it with jaxkv's venv (``make conformance`` does)::

    .venv/bin/python conformance/harness.py --n 500 [--seed 0] [--workers 2]
    .venv/bin/python conformance/harness.py --only 123     # one program, op by op

Program ``i`` of a run has id (and seed) ``seed * 1_000_000 + i``. MXNet runs every program in a
process of its own (a crash loses only that program, reported as an "MXNet crash" and left out of
the comparison); jaxkv runs them all in one process, each with a fresh store. Every op's outcome
must agree: the same pulled values, or a refusal on both sides. Ops where MXNet 1.9.1 has a known
defect (programs.DEFECTS; the generator marks them), and later ops on keys such an op left wrong
in MXNet, are counted as "known MXNet defect" instead. Exit status 1 on any disagreement.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import programs  # noqa: E402

RUN_PROGRAM = os.path.join(HERE, "run_program.py")
PROGRESS_EVERY = 50


def default_mxnet_python() -> str:
    venv = os.environ.get("MXNET_VENV", os.path.join(os.path.dirname(HERE), ".venv-mxnet"))
    return os.environ.get("MXNET_PYTHON", os.path.join(venv, "bin", "python"))


# ---------------------------------------------------------------------------------------------
# Running the programs
# ---------------------------------------------------------------------------------------------
class Progress:
    """Counts finished programs on each side; prints a line every PROGRESS_EVERY programs."""

    def __init__(self, total: int, start: float):
        self.total, self.start = total, start
        self.lock = threading.Lock()
        self.done = {"mxnet": 0, "jaxkv": 0}
        self.crashes = 0
        self.printed = 0

    def add(self, side: str, crashed: bool = False) -> None:
        with self.lock:
            self.done[side] += 1
            self.crashes += crashed
            both = min(self.done.values())
            if both >= self.printed + PROGRESS_EVERY or (both == self.total > self.printed):
                self.printed = both
                print(
                    f"  [{both:4d}/{self.total}] MXNet {self.done['mxnet']} "
                    f"({self.crashes} crashed), jaxkv {self.done['jaxkv']}, "
                    f"{time.monotonic() - self.start:.0f} s",
                    flush=True,
                )


def _feed(proc: subprocess.Popen, progs: list[dict]) -> None:
    try:
        for p in progs:
            proc.stdin.write(json.dumps(p) + "\n")
        proc.stdin.close()
    except BrokenPipeError:
        pass


def run_jaxkv(progs: list[dict], results: dict, progress: Progress, stderr) -> subprocess.Popen:
    """All programs through one jaxkv process (JAX start-up and compiles are paid once)."""
    proc = subprocess.Popen(
        [sys.executable, RUN_PROGRAM, "--impl", "jaxkv", "--batch", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    threading.Thread(target=_feed, args=(proc, progs), daemon=True).start()

    def read():
        for line in proc.stdout:
            r = json.loads(line)
            results[r["id"]] = r
            progress.add("jaxkv")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.reader = reader
    return proc


def run_mxnet(progs: list[dict], results: dict, progress: Progress, args, stderr) -> None:
    """Each program in its own MXNet process, ``args.workers`` at a time."""
    todo: queue.Queue = queue.Queue()
    for p in progs:
        todo.put(p)

    def record(r):
        results[r["id"]] = r
        progress.add("mxnet", "crash" in r)

    def forked_worker():
        # A server that imports MXNet once and forks one child per program.
        cmd = _mxnet_server(args)
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1
        )
        try:
            while True:
                try:
                    p = todo.get_nowait()
                except queue.Empty:
                    break
                proc.stdin.write(json.dumps(p) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(
                        f"the MXNet server died (exit {proc.wait()}) at program {p['id']}"
                    )
                record(json.loads(line))
        finally:
            proc.stdin.close()
            proc.wait()

    def exec_worker():
        # A fresh interpreter per program: slower (MXNet's import each time), fully isolated.
        while True:
            try:
                p = todo.get_nowait()
            except queue.Empty:
                break
            try:
                done = subprocess.run(
                    [args.mxnet_python, RUN_PROGRAM, "--impl", "mxnet"],
                    input=json.dumps(p),
                    capture_output=True,
                    text=True,
                    timeout=args.timeout + 60,
                )
                code, out = done.returncode, done.stdout
            except subprocess.TimeoutExpired as e:
                code, out = -9, e.stdout or ""
            if code == 0 and out.strip():
                record(json.loads(out))
            else:
                record({"id": p["id"], "crash": {"exit": code, "at_op": None, "ops": []}})

    worker = forked_worker if args.isolation == "fork" else exec_worker
    errors = []

    def guarded():
        try:
            worker()
        except Exception as e:  # reported after the others finish
            errors.append(e)

    threads = [threading.Thread(target=guarded) for _ in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------------------------
class Match:
    """How two ok outcomes' values compare: ``differ`` (values or structure), else ``close``
    (some number equal only within the tolerance; ``largest`` is the largest difference) and
    ``ids`` (row-sparse outs whose dense values agree but whose row ids differ, as (MXNet's,
    jaxkv's) pairs)."""

    def __init__(self):
        self.differ = False
        self.close = False
        self.largest = 0.0
        self.ids: list[tuple[dict, dict]] = []


def _number(a, b, approx: bool, m: Match) -> None:
    if a is None and b is None:  # an op that fills nothing
        return
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if a == b or (a != a and b != b):  # equal, or both NaN
            return
        diff = abs(a - b)
        if approx and diff <= programs.ATOL + programs.RTOL * abs(a):
            m.close = True
            m.largest = max(m.largest, diff)
            return
    m.differ = True


def _values(a, b, approx: bool, m: Match) -> None:
    """Walk two value trees (per-key lists, per-device lists, arrays as nested lists); a
    row-sparse out is a dict ``{"rsp": dense value, "ids": row ids}``."""
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            m.differ = True
            return
        for x, y in zip(a, b):
            _values(x, y, approx, m)
    elif isinstance(a, dict) and isinstance(b, dict):
        _values(a["rsp"], b["rsp"], approx, m)
        if a["ids"] != b["ids"]:
            m.ids.append((a, b))
    elif isinstance(a, (list, dict)) or isinstance(b, (list, dict)):
        m.differ = True
    else:
        _number(a, b, approx, m)


def match(a, b, approx: bool) -> Match:
    m = Match()
    _values(a, b, approx, m)
    return m


def _zero_rows(dense) -> set:
    return {i for i, row in enumerate(dense) if not any(x != 0 for x in programs._flat(row))}


def explain_ids(op: dict, pairs: list[tuple[dict, dict]]) -> str | None:
    """The documented difference (X2, X6) that explains every row-id mismatch of an op whose
    dense values agree, or None."""
    labels = set()
    for mx, jx in pairs:
        zero = _zero_rows(mx["rsp"])
        if op["op"] == "row_sparse_pull" and not mx["ids"] and len(zero) == len(mx["rsp"]):
            labels.add(programs.X2)  # MXNet stores no rows; jaxkv lists the ids asked for
            continue
        nonzero = sorted(set(range(len(mx["rsp"]))) - zero)
        extra = set(mx["ids"]) - set(jx["ids"])
        if (
            op["op"] == "pull"
            and op.get("ignore_sparse") is False
            and jx["ids"] == nonzero
            and set(jx["ids"]) <= set(mx["ids"])
            and extra <= zero
        ):
            labels.add(programs.X6)  # MXNet lists its stored zero rows too
            continue
        return None
    return min(labels)


def show(o: dict) -> str:
    if o["status"] == "ok":
        return "ok" if o.get("values") is None else f"ok {json.dumps(o['values'])}"
    return f"{o['status']} ({o.get('error', '')})" if o.get("error") else o["status"]


class Tally:
    def __init__(self):
        self.programs = self.ops = self.agree = self.both_refused = 0
        self.approx_exact = self.approx_close = 0  # ok ops with optimizer values that agree
        self.largest = 0.0  # the largest difference among the close ones
        self.known = collections.Counter()  # defect or difference -> ops
        self.disagreements: list[dict] = []
        self.crashes: list[dict] = []
        self.kinds = collections.Counter()  # op name -> ops compared
        self.families = collections.Counter()  # program features -> programs compared


def _label(op: dict) -> str | None:
    """The known defect or documented difference an op is marked with."""
    return op.get("defect") or op.get("differs")


def compare(program: dict, mx: dict, jx: dict, tally: Tally) -> list[dict]:
    """Compare one program's outcomes; returns its per-op classification."""
    taints: dict = {}  # key (or "*") -> (op index, defect)
    rows = []
    tally.programs += 1
    tally.families["+".join(program.get("features", [])) or "plain"] += 1
    for i, (op, a, b) in enumerate(zip(program["ops"], mx["ops"], jx["ops"])):
        keys = programs.keys_of(op)
        tally.ops += 1
        tally.kinds[op["op"]] += 1
        tainted = [taints[k] for k in ["*", *keys] if k in taints]
        same, m = a["status"] == b["status"], None
        if same and a["status"] == "ok":
            m = match(a.get("values"), b.get("values"), bool(op.get("approx")))
            same = not m.differ and not m.ids
        explained = explain_ids(op, m.ids) if m and not m.differ and m.ids else None
        if same:
            verdict = "agree"
            tally.agree += 1
            tally.both_refused += a["status"] == "refused"
            if m is not None and op.get("approx") and a.get("values") is not None:
                if m.close:
                    verdict = f"agree within the tolerance (largest difference {m.largest:.3g})"
                    tally.approx_close += 1
                    tally.largest = max(tally.largest, m.largest)
                else:
                    tally.approx_exact += 1
        elif tainted:
            j, defect = min(tainted)
            verdict = f"known {_kind(defect)} {defect} (a consequence of op {j})"
            tally.known[defect] += 1
            # MXNet may have applied part of this op: its other keys are suspect from now on.
            for k in keys:
                taints.setdefault(k, (j, defect))
        elif _label(op):
            verdict = f"known {_kind(_label(op))} {_label(op)}"
            tally.known[_label(op)] += 1
        elif explained:
            verdict = f"known {_kind(explained)} {explained}"
            tally.known[explained] += 1
        else:
            verdict = "DISAGREE"
            tally.disagreements.append(
                {"id": program["id"], "op": i, "spec": op, "mxnet": a, "jaxkv": b}
            )
        rows.append({"op": i, "verdict": verdict, "mxnet": a, "jaxkv": b})
        for k in op.get("taint", []):
            taints.setdefault(k, (i, op.get("taint_defect") or _label(op)))
    return rows


def _kind(label: str) -> str:
    return "MXNet defect" if label in programs.DEFECTS else "difference"


def reproduce(pid: int, mxnet_python: str) -> str:
    return (
        f"python3 conformance/programs.py --seed {pid} | {mxnet_python} "
        f"conformance/run_program.py --impl mxnet   (and with --impl jaxkv); or "
        f"conformance/harness.py --only {pid}"
    )


def _where(crash: dict) -> str:
    return f"{crash['id']}@op{crash['at_op']}" if crash["at_op"] is not None else str(crash["id"])


def summarize(tally: Tally, n_programs: int, wall: float, mxnet_python: str) -> None:
    expected = [c for c in tally.crashes if c["after_defect"]]
    causes = collections.Counter(c["after_defect"] for c in expected)
    print(f"\nconformance summary ({wall:.0f} s)")
    print(f"  programs:              {n_programs}")
    print(
        f"  MXNet crashes excluded: {len(tally.crashes)} programs "
        f"({len(expected)} at or after an op with a known defect: "
        + (", ".join(f"{d} {n}" for d, n in sorted(causes.items())) or "none")
        + ")"
    )
    if tally.crashes:
        shown = ", ".join(_where(c) for c in tally.crashes[:20])
        more = f" (and {len(tally.crashes) - 20} more)" if len(tally.crashes) > 20 else ""
        print(f"    program@op: {shown}{more}")
    unexpected = [c for c in tally.crashes if not c["after_defect"]]
    if unexpected:
        print(
            "    crashes with no known defect before them: "
            + ", ".join(_where(c) for c in unexpected)
        )
    print(f"  programs compared:     {tally.programs}")
    print(
        f"  ops compared:          {tally.ops}  ("
        + ", ".join(f"{k} {v}" for k, v in sorted(tally.kinds.items()))
        + ")"
    )
    print(
        "  programs by family:    "
        + ", ".join(f"{k} {v}" for k, v in sorted(tally.families.items()))
    )
    print(f"  agreements:            {tally.agree}  (refused by both: {tally.both_refused})")
    approx = tally.approx_exact + tally.approx_close
    print(
        f"    of which with optimizer values: {approx} ({tally.approx_exact} bit for bit, "
        f"{tally.approx_close} within rtol {programs.RTOL} / atol {programs.ATOL}"
        + (f", largest difference {tally.largest:.3g})" if tally.approx_close else ")")
    )
    defects = {d: n for d, n in tally.known.items() if d in programs.DEFECTS}
    differences = {d: n for d, n in tally.known.items() if d in programs.DIFFERENCES}
    print(f"  known-defect ops excluded: {sum(defects.values())}")
    for d, count in sorted(defects.items(), key=lambda item: int(item[0][1:])):
        print(f"    {count:5d}  {programs.DEFECTS[d]}")
    print(f"  documented-difference ops excluded: {sum(differences.values())}")
    for d, count in sorted(differences.items(), key=lambda item: int(item[0][1:])):
        print(f"    {count:5d}  {programs.DIFFERENCES[d]}")
    print(f"  disagreements:         {len(tally.disagreements)}")
    for d in tally.disagreements:
        print(f"\n  DISAGREEMENT: program {d['id']}, op {d['op']}: {json.dumps(d['spec'])}")
        print(f"    MXNet: {show(d['mxnet'])}")
        print(f"    jaxkv: {show(d['jaxkv'])}")
        print(f"    reproduce: {reproduce(d['id'], mxnet_python)}")


def check_all(progs, mx_results, jx_results) -> Tally:
    tally = Tally()
    for p in progs:
        mx, jx = mx_results.get(p["id"]), jx_results.get(p["id"])
        if jx is None:
            raise RuntimeError(f"jaxkv gave no result for program {p['id']}")
        if mx is None:
            raise RuntimeError(f"MXNet gave no result for program {p['id']}")
        if "crash" in mx:
            at = mx["crash"]["at_op"]
            last = len(p["ops"]) if at is None else at + 1
            # The defect of the last marked op up to the crash that tainted a key of the op it
            # crashed at, else of the last marked op (None: no marked op before it).
            keys = set(programs.keys_of(p["ops"][at])) | {"*"} if at is not None else {"*"}
            marks = [
                (op.get("defect") or op.get("differs") or op.get("taint_defect"), op)
                for op in p["ops"][:last]
            ]
            marks = [(m, op) for m, op in marks if m]
            touching = [m for m, op in marks if keys & set(op.get("taint", []))]
            after = touching[-1] if touching else marks[-1][0] if marks else None
            tally.crashes.append(
                {"id": p["id"], "at_op": at, "exit": mx["crash"]["exit"], "after_defect": after}
            )
            continue
        compare(p, mx, jx, tally)
    return tally


def _mxnet_server(args) -> list[str]:
    """The command of a server that imports MXNet once and forks one child per program."""
    return [
        args.mxnet_python,
        RUN_PROGRAM,
        "--impl",
        "mxnet",
        "--batch",
        "-",
        "--fork",
        "--timeout",
        str(args.timeout),
    ]


def only(pid: int, args) -> int:
    """Run one program through both and print each op with its verdict."""
    program = programs.generate(pid)
    text = json.dumps(program) + "\n"
    stderr = None if args.verbose else subprocess.DEVNULL
    mx = subprocess.run(
        _mxnet_server(args),
        input=text,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        check=True,
    )
    jx = subprocess.run(
        [sys.executable, RUN_PROGRAM, "--impl", "jaxkv"],
        input=text,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        check=True,
    )
    mx_result, jx_result = json.loads(mx.stdout), json.loads(jx.stdout)
    tally = Tally()
    if "crash" in mx_result:
        crash = mx_result["crash"]
        print(f"MXNet crashed (exit {crash['exit']}) at op {crash['at_op']}")
        done = crash["ops"] + [{"status": "crashed"}]
        done += [{"status": "-"}] * (len(program["ops"]) - len(done))
        rows = [
            {"op": i, "verdict": "-", "mxnet": a, "jaxkv": b}
            for i, (a, b) in enumerate(zip(done, jx_result["ops"]))
        ]
    else:
        rows = compare(program, mx_result, jx_result, tally)
    print(
        f"program {pid}: {program['store']}, {program['key_kind']} keys, features "
        f"{program.get('features') or 'none'}"
    )
    for op, row in zip(program["ops"], rows):
        note = f"  [{op['note']}]" if op.get("note") else ""
        print(f"op {row['op']}: {json.dumps(op)}{note}")
        print(f"    MXNet: {show(row['mxnet'])}")
        print(f"    jaxkv: {show(row['jaxkv'])}")
        print(f"    -> {row['verdict']}")
    return 1 if tally.disagreements else 0


def wanted(program: dict, family: str) -> bool:
    features = program.get("features", [])
    return family == "all" or (family in features if family != "plain" else not features)


def select(seed: int, n: int, family: str) -> list[dict]:
    """The first ``n`` programs of ``family`` among ids ``seed * 1e6 + 0, 1, ...``."""
    progs, i = [], 0
    while len(progs) < n and i < 1_000_000:
        p = programs.generate(seed * 1_000_000 + i)
        if wanted(p, family):
            progs.append(p)
        i += 1
    return progs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="how many programs (default 500)")
    parser.add_argument("--seed", type=int, default=0, help="program ids: seed*1e6 + 0..n-1")
    parser.add_argument("--workers", type=int, default=2, help="MXNet processes at a time")
    parser.add_argument(
        "--mxnet-python",
        default=default_mxnet_python(),
        help="the python of MXNet's venv (default $MXNET_PYTHON or "
        "${MXNET_VENV:-.venv-mxnet}/bin/python)",
    )
    parser.add_argument(
        "--isolation",
        choices=["fork", "exec"],
        default="fork",
        help="fork: one MXNet import, a forked child per program (default); "
        "exec: a fresh interpreter per program (slow)",
    )
    parser.add_argument("--timeout", type=int, default=120, help="seconds per MXNet program")
    parser.add_argument(
        "--family",
        choices=["all", "plain", "rows", "optimizer"],
        default="all",
        help="only programs of one family: rows (row-sparse values), optimizer (set_optimizer, "
        "rows programs with one included), plain (neither); ids are then those of the first n "
        "such programs",
    )
    parser.add_argument("--only", type=int, metavar="ID", help="run and show one program")
    parser.add_argument("--verbose", action="store_true", help="show the runners' stderr")
    parser.add_argument("--save", metavar="FILE", help="write programs and outcomes (JSON)")
    args = parser.parse_args(argv)
    if not os.path.exists(args.mxnet_python):
        sys.exit(f"no MXNet python at {args.mxnet_python}: run conformance/setup_mxnet.sh")
    if args.only is not None:
        return only(args.only, args)

    start = time.monotonic()
    progs = select(args.seed, args.n, args.family)
    n_ops = sum(len(p["ops"]) for p in progs)
    print(
        f"conformance: {len(progs)} programs ({n_ops} ops, family {args.family}), ids "
        f"{progs[0]['id']}.."
        f"{progs[-1]['id']}; MXNet at {args.mxnet_python}, {args.workers} workers "
        f"({args.isolation})",
        flush=True,
    )
    stderr = None if args.verbose else subprocess.DEVNULL
    progress = Progress(args.n, start)
    mx_results: dict = {}
    jx_results: dict = {}
    jaxkv_proc = run_jaxkv(progs, jx_results, progress, stderr)
    run_mxnet(progs, mx_results, progress, args, stderr)
    jaxkv_proc.reader.join()
    if jaxkv_proc.wait() != 0:
        sys.exit(
            f"the jaxkv runner failed (exit {jaxkv_proc.returncode}) after "
            f"{len(jx_results)} programs; rerun with --verbose"
        )
    tally = check_all(progs, mx_results, jx_results)
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"programs": progs, "mxnet": mx_results, "jaxkv": jx_results}, f)
    summarize(tally, len(progs), time.monotonic() - start, args.mxnet_python)
    return 1 if tally.disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
