"""Mutation tests of jaxkv's arithmetic and checks, with Cosmic Ray (``make mutation``).

Why Cosmic Ray: it runs a fresh test command per mutant. mutmut 3 forks each mutant's test run
from a process that has already run the tests, and JAX is multithreaded: a forked child's first
computation deadlocks (and JAX's compilation caches would hide mutants from the child anyway).

What it does:

1. copies ``jaxkv/``, ``tests/``, ``conftest.py`` and ``pyproject.toml`` into ``.mutation/work``
   (Cosmic Ray rewrites the module it mutates in place: never the checkout's own files);
2. per module of ``mutation/modules.toml``: builds a Cosmic Ray session in
   ``.mutation/<module>.sqlite``, skips every mutant outside the listed functions, inside a type
   annotation or of an operator not listed, runs the tests once unmutated (they must pass), then
   each mutant (``pytest -x`` on the module's test files, timeout 3x the unmutated run + 30 s);
3. writes ``.mutation/report.md``: per module killed / total and killed / non-equivalent, and
   every survivor, with the reason where ``mutation/equivalent.toml`` judges it equivalent.

Options: ``--modules _ops,_state`` runs only those; ``--resume`` continues the sessions and work
copy of an interrupted run; ``--retest`` runs the survivors of the last run again against the
current tests (after tests were added; refused if the mutated module changed since that run);
``--report`` only rewrites the report.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import glob
import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import toml
from cosmic_ray.commands import init as cr_init
from cosmic_ray.mutating import mutate_and_test
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".mutation"
WORK = OUT / "work"
TIMES = OUT / "seconds.json"  # seconds spent per module, unmutated run included
COPIED = ["jaxkv", "tests", "conftest.py", "pyproject.toml"]


def load_config() -> dict:
    config = toml.load(ROOT / "mutation" / "modules.toml")
    equivalent = toml.load(ROOT / "mutation" / "equivalent.toml").get("equivalent", [])
    config["equivalent"] = equivalent
    return config


def copy_tree() -> None:
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, WORK / name, ignore=ignore)
        else:
            shutil.copy2(src, WORK / name)


# -- which mutants count ---------------------------------------------------------------------
def spans(path: Path, functions: list[str]):
    """``(name, first line, last line)`` of each selected function, and the annotation spans."""
    tree = ast.parse(path.read_text())
    found, annotations = [], []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                if any(fnmatch.fnmatchcase(name, pattern) for pattern in functions):
                    found.append((name, child.lineno, child.end_lineno))
                visit(child, name + ".")

    visit(tree, "")
    for node in ast.walk(tree):
        notes = []
        if isinstance(node, ast.arguments):
            args = node.posonlyargs + node.args + node.kwonlyargs + [node.vararg, node.kwarg]
            notes = [a.annotation for a in args if a is not None and a.annotation is not None]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns:
            notes = [node.returns]
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        for n in notes:
            annotations.append(((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)))
    missing = [f for f in functions if not any(fnmatch.fnmatchcase(n, f) for n, _, _ in found)]
    if missing:
        sys.exit(f"mutation: {path}: functions {missing} not found (update mutation/modules.toml)")
    return found, annotations


def function_of(found, line: int) -> str | None:
    inner = [(b - a, name) for name, a, b in found if a <= line <= b]
    return min(inner)[1] if inner else None


def skip_reason(mutation, found, annotations, operators) -> str | None:
    if not any(re.search(p, mutation.operator_name) for p in operators):
        return "operator left out"
    if function_of(found, mutation.start_pos[0]) is None:
        return "outside the selected functions"
    start = tuple(mutation.start_pos)
    if any(a <= start < b for a, b in annotations):
        return "type annotation"
    return None


# -- running --------------------------------------------------------------------------------
def test_command(config: dict, module: dict) -> str:
    python = ROOT / config["python"]
    files = []
    for pattern in module["tests"]:
        matched = sorted(glob.glob(pattern, root_dir=WORK))
        files += [f for f in matched if f not in files]
    return " ".join([str(python), "-m", "pytest", *config["pytest-args"], *files])


def baseline(command: str, module: str) -> float:
    env = dict(os.environ)
    where = subprocess.run(
        [command.split()[0], "-c", "import jaxkv; print(jaxkv.__file__)"],
        cwd=WORK,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(WORK.resolve()):
        sys.exit(f"mutation: the tests import jaxkv from {where}, expected the copy in {WORK}")
    start = time.monotonic()
    run = subprocess.run(command.split(), cwd=WORK, env=env, capture_output=True, text=True)
    took = time.monotonic() - start
    if run.returncode != 0:
        sys.exit(f"mutation: {module}: the tests fail without any mutant:\n{run.stdout[-3000:]}")
    return took


def session_path(module: dict) -> Path:
    name = module["path"].removeprefix("jaxkv/").removesuffix(".py").replace("/", ".")
    return OUT / (name + ".sqlite")


def run_module(config: dict, module: dict, resume: bool) -> None:
    path, session = module["path"], session_path(module)
    command = test_command(config, module)
    took = baseline(command, path)
    timeout = 3 * took + 30
    print(f"{path}: unmutated tests pass in {took:.1f} s; timeout per mutant {timeout:.0f} s")
    print(f"  {command}", flush=True)
    found, annotations = spans(WORK / path, module["functions"])
    os.chdir(WORK)
    digest = hashlib.sha256((WORK / path).read_bytes()).hexdigest()
    stamp = session.with_suffix(".source")
    if resume and session.exists() and stamp.exists() and stamp.read_text() != digest:
        sys.exit(f"mutation: {path} changed since its session was made: run it afresh")
    stamp.write_text(digest)
    if not (resume and session.exists()):
        with use_db(str(session), WorkDB.Mode.create) as db:
            cr_init([Path(path)], db, {})
            skipped: dict[str, list[str]] = {}
            for item in db.pending_work_items:
                why = skip_reason(item.mutations[0], found, annotations, config["operators"])
                if why:
                    skipped.setdefault(why, []).append(item.job_id)
            for why, ids in skipped.items():
                db.set_multiple_results(
                    ids, WorkResult(output=why, worker_outcome=WorkerOutcome.SKIPPED)
                )
    began = time.monotonic()
    with use_db(str(session), WorkDB.Mode.open) as db:
        pending = sorted(db.pending_work_items, key=lambda w: tuple(w.mutations[0].start_pos))
        start, total = time.monotonic(), len(pending)
        print(f"  {total} mutants to run", flush=True)
        for n, item in enumerate(pending, 1):
            result = mutate_and_test(item.mutations, command, timeout)
            db.set_result(item.job_id, result)
            spent = time.monotonic() - start
            m = item.mutations[0]
            outcome = (result.test_outcome or result.worker_outcome).value
            print(
                f"  [{n}/{total}] {outcome:9} line {m.start_pos[0]:4} {m.operator_name[5:]}"
                f"  ({spent / 60:.1f} min, ~{spent / n * (total - n) / 60:.0f} min left)",
                flush=True,
            )
    os.chdir(ROOT)
    times = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    spent = time.monotonic() - began + took
    times[path] = (times.get(path, 0) if resume else 0) + spent
    TIMES.write_text(json.dumps(times))


# -- reporting ------------------------------------------------------------------------------
def changed_lines(diff: str) -> tuple[str, str]:
    lines = diff.splitlines()
    before = [x[1:].strip() for x in lines if x.startswith("-") and not x.startswith("---")]
    after = [x[1:].strip() for x in lines if x.startswith("+") and not x.startswith("+++")]
    return " / ".join(before), " / ".join(after)


def judged(equivalent: list[dict], module: str, function: str, op: str, before, after):
    for e in equivalent:
        if (
            e["module"] == module
            and e["function"] == function
            and e["operator"] == op
            and e["before"] == before
            and e["after"] == after
        ):
            return e["reason"]
    return None


def report(config: dict, modules: list[dict], minutes: float | None) -> int:
    rows, survivors, failed, bad = [], [], [], 0
    times = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    for module in modules:
        session = session_path(module)
        if not session.exists():
            continue
        source = WORK / module["path"]
        found, _ = spans(source, module["functions"])
        killed = survived = equiv = other = pending = 0
        with use_db(str(session), WorkDB.Mode.open) as db:
            pending = db.num_work_items - db.num_results
            for item, result in db.completed_work_items:
                if result.worker_outcome == WorkerOutcome.SKIPPED:
                    continue
                if result.test_outcome == TestOutcome.KILLED:
                    killed += 1
                    continue
                if result.test_outcome != TestOutcome.SURVIVED:  # Cosmic Ray could not apply it
                    other += 1
                    m = item.mutations[0]
                    failed.append(f"- `{module['path']}:{m.start_pos[0]}` {m.operator_name}")
                    continue
                survived += 1
                m = item.mutations[0]
                function = function_of(found, m.start_pos[0])
                op = m.operator_name.removeprefix("core/")
                before, after = changed_lines(result.diff or "")
                reason = judged(config["equivalent"], module["path"], function, op, before, after)
                equiv += reason is not None
                survivors.append((module["path"], function, op, before, after, reason, m))
        total = killed + survived
        live = total - equiv
        score = 100 * killed / live if live else 100.0
        bad += score < 90
        seconds = times.get(module["path"])
        rows.append(
            f"| `{module['path']}` | {killed} / {total} | {equiv} | {killed} / {live} "
            f"({score:.1f}%) | {other} | {pending} "
            f"| {'?' if seconds is None else f'{seconds / 60:.1f}'} |"
        )
    out = ["# Mutation report", ""]
    if minutes is not None:
        out += [f"Run time: {minutes:.1f} min.", ""]
    out += [
        "| module | killed / total | judged equivalent | killed / non-equivalent "
        "| not applied | pending | minutes |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "## Survivors",
        "",
    ]
    for path, function, op, before, after, reason, m in survivors:
        status = f"equivalent: {reason}" if reason else "**NOT JUDGED EQUIVALENT**"
        line = m.start_pos[0]
        out.append(f"- `{path}:{line}` `{function}` {op}: `{before}` -> `{after}` ({status})")
    if failed:
        out += ["", "## Mutations Cosmic Ray could not apply (not counted)", "", *failed]
    text = "\n".join(out) + "\n"
    (OUT / "report.md").write_text(text)
    print(text)
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modules",
        help="comma-separated modules, each its path's end without .py, e.g. core/ops,kvstate",
    )
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run")
    parser.add_argument("--retest", action="store_true", help="run the survivors again")
    parser.add_argument("--report", action="store_true", help="only rewrite the report")
    args = parser.parse_args()
    config = load_config()
    modules = config["module"]
    if args.modules:
        wanted = args.modules.split(",")
        modules = [
            m
            for m in modules
            if any(("/" + m["path"].removesuffix(".py")).endswith("/" + w) for w in wanted)
        ]
    OUT.mkdir(exist_ok=True)
    started = time.monotonic()
    if args.retest:
        args.resume = True
        for module in modules:  # survivors become pending again
            with sqlite3.connect(session_path(module)) as db:
                db.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'")
    if not args.report:
        if args.retest or not (args.resume and WORK.exists()):
            copy_tree()
        os.environ["PYTHONPATH"] = str(WORK)  # the copy's jaxkv, not the checkout's
        for module in modules:
            run_module(config, module, args.resume)
    minutes = None if args.report else (time.monotonic() - started) / 60
    bad = report(config, modules, minutes)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
