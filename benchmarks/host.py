"""``make bench``'s host section: the three loops whose time is the host's (the embedding loop on
one device, 1000 keys x 8 devices pushed and pulled as lists, the embedding loop in 2
processes) and the 100-key Python-updater start-up, jaxkv beside MXNet 1.9.1 and a hand-written
JAX floor, in interleaved rounds; the embedding loops' host time (the CPU time of the thread
that runs the loop) beside their step; and where jaxkv's host time goes (each call's share of
the step).

    python benchmarks/host.py [--rounds 3] [--steps 60] [--keys-steps 23] [--no-pieces]

Each round runs, in turn, each loop's jaxkv run, its MXNet run (with MXNet's venv,
conformance/setup_mxnet.sh; "not run" where it is absent) and its floor, each in a process of
its own, then the new-keys rows; a noisy machine slows a stretch of minutes, not one run, so
each ratio is taken within a round and the report gives every round's and their median. The
JAX processes share a persistent compilation cache made for the section (JAX's, in a temporary
directory), so only the first round compiles from nothing: first steps are round 1's.

  embedding, one device   benchmarks/embedding_worker.py ``jaxkv|mxnet device`` and
                          benchmarks/embedding_floor.py ``device`` (one jitted step)
  the same, keys beside   embedding_worker.py ``jaxkv|mxnet device --beside 200`` (no floor)
  1000 keys x 8 devices   benchmarks/keys_worker.py ``jaxkv|mxnet|floor``
  embedding, 2 processes  embedding_worker.py ``dist_sync`` (jaxkv: ``python -m jaxkv.launch -n
                          2 --devices-per-process 1``, counting its host collectives; MXNet: 2
                          workers and 2 servers, rows.py's ``mxnet_loop``) and
                          embedding_floor.py ``dist_sync`` under the same launcher, the table
                          whole in each process and (``--split``) split as jaxkv keeps it
  new keys, Python        benchmarks/new_keys.py's ``python`` row (its ``one``)
  pieces                  a round of its own after the others: embedding_worker.py
                          ``--pieces`` and keys_worker.py ``--pieces``, jaxkv's and MXNet's

``run`` returns the results; ``report`` the markdown lines of results.md (benchmarks/bench.py
``--only host`` prints them; the full run adds them to results.md).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

import new_keys  # benchmarks/new_keys.py
import numpy as np
import rows as sparse_rows  # benchmarks/rows.py: the embedding loop's lines and results

HERE = os.path.dirname(os.path.abspath(__file__))
MXNET_VENV = os.environ.get("MXNET_VENV", os.path.join(HERE, "..", ".venv-mxnet"))
ROUNDS = 3
STEPS = 60  # the embedding loops: 10 of warm-up, then the median of 50
KEYS_STEPS = 23  # the keys loop: 3 of warm-up, then the median of 20
ROWS = 1_000_000
NEW_KEYS = 100
TIMEOUT = 1800  # seconds for one run (the keys loop's first compile takes minutes here)
SIDES = ("jaxkv", "mxnet", "floor")
BESIDE = 200  # the small keys beside the table in the loop "embedding-beside"
LOOPS = ("embedding-1", "embedding-beside", "keys", "embedding-2")
TITLES = {
    "embedding-1": "Embedding loop, one device",
    "embedding-beside": f"Embedding loop, one device, {BESIDE} small keys beside the table",
    "keys": "1000 keys x 8 devices, list push and pull",
    "embedding-2": "Embedding loop, 2 processes (dist_sync)",
}
EMB_PIECES = {
    "sparse": "`mx.nd.sparse.row_sparse_array((grad, ids), ...)`",
    "push_dense": '`kv.push("dense", ...)`',
    "push_emb": '`kv.push("emb", g)`',
    "row_ids": "`mx.nd.array(ids)` (the pull's row_ids)",
    "row_sparse_pull": '`kv.row_sparse_pull("emb", ...)`',
    "pull_dense": '`kv.pull("dense", ...)`',
    "wait": "`out.data.wait_to_read()`, `dense_out.wait_to_read()`",
}
KEYS_PIECES = {
    "push": "`kv.push(keys, grads)`",
    "pull": "`kv.pull(keys, out=outs)`",
    "waitall": "`mx.nd.waitall()`",
}


def _mxnet_python(mxnet_venv: str) -> str | None:
    """MXNet's venv's python, None where the venv is absent (rows.py's test: its ``.ok``)."""
    if not os.path.exists(os.path.join(mxnet_venv, ".ok")):
        return None
    return os.path.join(mxnet_venv, "bin", "python")


def _fields(out: str, prefix: str) -> list[dict]:
    """The ``prefix NAME k=v ...`` lines of ``out``: their fields, numbers as floats."""
    found = []
    for line in out.splitlines():
        if line.startswith(prefix + " "):
            _, name, *rest = line.split()
            f: dict = {"name": name}
            for item in rest:
                k, _, v = item.partition("=")
                try:
                    f[k] = float(v)
                except ValueError:
                    f[k] = v
            found.append(f)
    return found


def _run(cmd: list[str], env: dict | None = None) -> tuple[str, str]:
    """stdout and the tail of stderr of ``cmd``, under :data:`TIMEOUT`."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return out, f"timed out after {TIMEOUT} s"
    return p.stdout, (p.stderr[-2000:] if p.returncode else "")


def _embedding(row: str, out: str, err: str) -> dict:
    """One embedding run's result (rows.py's: the slower process's median, each rank's
    checksum), with jaxkv's host collectives per step where counted."""
    res = sparse_rows._loop_result(row, sparse_rows._loop_line(out), err)
    found = _fields(out, "embedding")
    syncs = [f["host_syncs"] for f in found if "host_syncs" in f]
    if syncs:
        res["host_syncs"] = max(syncs)
    host = [f["host_ms"] for f in found if "host_ms" in f]
    if host:
        res["host_ms"] = max(host)  # (the busier process's)
    return res


def _keys(row: str, out: str, err: str) -> dict:
    found = _fields(out, "keys")
    if not found:
        return {"row": row, "error": (err or "no result")[-300:]}
    f = found[0]
    return {
        "row": row,
        "median_ms": f["median_ms"],
        "first_ms": f["first_ms"],
        "compiles": int(f["compiles"]),
        "sums": {"0": f["checksum"]},
    }


def _round(k: int, rounds: int, settings: dict, mxnet: str | None, env: dict, log) -> dict:
    """One round: every loop's jaxkv, MXNet and floor runs in turn, then the new-keys rows."""
    rows, steps, keys_steps = settings["rows"], settings["steps"], settings["keys_steps"]
    worker = os.path.join(HERE, "embedding_worker.py")
    floor = os.path.join(HERE, "embedding_floor.py")
    keys = os.path.join(HERE, "keys_worker.py")
    launch = [sys.executable, "-m", "jaxkv.launch", "-n", "2", "--devices-per-process", "1"]
    launch.append("--no-prefix")
    emb = ["--rows", str(rows), "--steps", str(steps)]
    res: dict = {loop: {} for loop in LOOPS}

    def note(loop: str, side: str, result: dict) -> None:
        res[loop][side] = result
        shown = {k: v for k, v in result.items() if k != "row"}
        log(f"  {side}: {shown}")

    tag = f"[host] round {k + 1}/{rounds}"
    log(f"{tag}: the embedding loop, one device ...")
    out, err = _run([sys.executable, worker, "jaxkv", "device", *emb], env)
    note("embedding-1", "jaxkv", _embedding("jaxkv", out, err))
    if mxnet:
        out, err = _run([mxnet, worker, "mxnet", "device", *emb])
        note("embedding-1", "mxnet", _embedding("mxnet", out, err))
    out, err = _run([sys.executable, floor, "device", *emb], env)
    note("embedding-1", "floor", _embedding("floor", out, err))

    log(f"{tag}: the embedding loop, one device, {BESIDE} keys beside ...")
    beside = [*emb, "--beside", str(BESIDE)]
    out, err = _run([sys.executable, worker, "jaxkv", "device", *beside], env)
    note("embedding-beside", "jaxkv", _embedding("jaxkv", out, err))
    if mxnet:
        out, err = _run([mxnet, worker, "mxnet", "device", *beside])
        note("embedding-beside", "mxnet", _embedding("mxnet", out, err))

    log(f"{tag}: 1000 keys x 8 devices ...")
    out, err = _run([sys.executable, keys, "jaxkv", "--steps", str(keys_steps)], env)
    note("keys", "jaxkv", _keys("jaxkv", out, err))
    if mxnet:
        out, err = _run([mxnet, keys, "mxnet", "--steps", str(keys_steps)])
        note("keys", "mxnet", _keys("mxnet", out, err))
    out, err = _run([sys.executable, keys, "floor", "--steps", str(keys_steps)], env)
    note("keys", "floor", _keys("floor", out, err))

    log(f"{tag}: the embedding loop, 2 processes ...")
    out, err = _run([*launch, worker, "jaxkv", "dist_sync", *emb, "--count-syncs"], env)
    note("embedding-2", "jaxkv", _embedding("jaxkv", out, err))
    if mxnet:
        out, err = sparse_rows.mxnet_loop(worker, emb, mxnet)
        note("embedding-2", "mxnet", _embedding("mxnet", out, err))
    out, err = _run([*launch, floor, "dist_sync", *emb], env)
    note("embedding-2", "floor", _embedding("floor", out, err))
    out, err = _run([*launch, floor, "dist_sync", "--split", *emb], env)
    note("embedding-2", "split", _embedding("split", out, err))

    log(f"{tag}: {settings['new_keys']} new keys with a Python updater ...")
    res["new-keys"] = {}
    for side in ("jaxkv", "mxnet"):
        if side == "mxnet" and not mxnet:
            continue
        try:
            got = new_keys.one(side, "python", settings["new_keys"])
        except Exception as e:  # a failed side is reported; the others still run
            got = {"error": f"{type(e).__name__}: {e}"[-300:]}
        res["new-keys"][side] = got
        log(f"  {side}: {got}")
    return res


def _pieces(settings: dict, mxnet: str | None, env: dict, log) -> dict:
    """The pieces round: each call of the one-device embedding loop and of the keys loop timed
    on its own, jaxkv's and MXNet's."""
    worker = os.path.join(HERE, "embedding_worker.py")
    keys = os.path.join(HERE, "keys_worker.py")
    emb = ["device", "--rows", str(settings["rows"]), "--steps", str(settings["steps"]), "--pieces"]
    ks = ["--steps", str(settings["keys_steps"]), "--pieces"]
    got: dict = {"embedding-1": {}, "keys": {}}
    runs = [("embedding-1", "jaxkv", [sys.executable, worker, "jaxkv", *emb], env)]
    if mxnet:
        runs.append(("embedding-1", "mxnet", [mxnet, worker, "mxnet", *emb], None))
    runs.append(("keys", "jaxkv", [sys.executable, keys, "jaxkv", *ks], env))
    if mxnet:
        runs.append(("keys", "mxnet", [mxnet, keys, "mxnet", *ks], None))
    for loop, side, cmd, side_env in runs:
        log(f"[host] pieces: {TITLES[loop]}, {side} ...")
        out, err = _run(cmd, side_env)
        found = _fields(out, "pieces")
        got[loop][side] = found[0] if found else {"error": (err or "no result")[-300:]}
        log(f"  {got[loop][side]}")
    return got


def run(
    rounds: int = ROUNDS,
    steps: int = STEPS,
    keys_steps: int = KEYS_STEPS,
    pieces: bool = True,
    mxnet_venv: str = MXNET_VENV,
    log=print,
) -> dict:
    """Every round (``rounds``), then the pieces round (unless ``pieces`` is False); ``steps``:
    each embedding run's steps (at least 12: 10 of warm-up), ``keys_steps``: each keys run's (at
    least 5: 3 of warm-up)."""
    settings = {
        "rounds": rounds,
        "steps": max(steps, 12),
        "keys_steps": max(keys_steps, 5),
        "rows": ROWS,
        "new_keys": NEW_KEYS,
    }
    mxnet = _mxnet_python(mxnet_venv)
    with contextlib.ExitStack() as stack:
        cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxkv-host-cache-"))
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache)
        res = {
            "settings": settings,
            "mxnet": mxnet is not None,
            "rounds": [_round(k, rounds, settings, mxnet, env, log) for k in range(rounds)],
        }
        res["pieces"] = _pieces(settings, mxnet, env, log) if pieces else {}
    return res


# -- the report ---------------------------------------------------------------------------------
def _ms(r: dict | None) -> float | None:
    return None if not r or "median_ms" not in r else r["median_ms"]


def _cell(x: float | None, fmt: str = ".2f", none: str = "—") -> str:
    return none if x is None else format(x, fmt)


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


def _ratios(res: dict, loop: str) -> tuple[list, list]:
    """Per round: MXNet / jaxkv and jaxkv / floor (None where a side is missing)."""
    mx_j, j_floor = [], []
    for r in res["rounds"]:
        j, m, f = (_ms(r[loop].get(s)) for s in SIDES)
        mx_j.append(m / j if j and m else None)
        j_floor.append(j / f if j and f else None)
    return mx_j, j_floor


def _span(xs: list) -> str:
    """``median (lowest-highest)`` of the rounds' values."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    mid = float(np.median(xs))
    return f"{mid:.2f}x ({min(xs):.2f}-{max(xs):.2f})" if max(xs) > min(xs) else f"{mid:.2f}x"


def _checksums(res: dict, loop: str) -> str:
    """Whether MXNet's and the floor's checksums (per process) equal jaxkv's in every round:
    'yes' (relative 1e-6, as rows.py), or which differ."""
    worst: dict[str, float] = {}
    for r in res["rounds"]:
        mine = (r[loop].get("jaxkv") or {}).get("sums")
        if not mine:
            continue
        for side in ("mxnet", "floor", "split"):
            theirs = (r[loop].get(side) or {}).get("sums")
            if not theirs:
                continue
            for rank, x in mine.items():
                y = theirs.get(rank)
                d = 1.0 if y is None else abs(x - y) / max(abs(y), 1e-12)
                worst[side] = max(worst.get(side, 0.0), d)
    if not worst:
        return "—"
    bad = {s: d for s, d in worst.items() if d > 1e-6}
    if not bad:
        names = {"mxnet": "MXNet", "split": "the split floor"}
        return "yes (" + ", ".join(names.get(s, s) for s in worst) + ")"
    return "no (" + ", ".join(f"{s}: relative {d:.1e}" for s, d in bad.items()) + ")"


def _loop_table(res: dict, loop: str) -> list[str]:
    lines = [
        f"### {TITLES[loop]}",
        "",
        "| round | jaxkv ms | MXNet ms | floor ms | MXNet / jaxkv | jaxkv / floor |",
        "|---|---|---|---|---|---|",
    ]
    mx_j, j_floor = _ratios(res, loop)
    cols: dict[str, list] = {s: [] for s in SIDES}
    for i, r in enumerate(res["rounds"]):
        cells = []
        for s in SIDES:
            got = r[loop].get(s)
            cols[s].append(_ms(got))
            if got is None:
                cells.append("not run")
            elif "error" in got:
                cells.append("failed: " + str(got["error"]).replace("|", "/").replace("\n", " "))
            else:
                cells.append(f"{got['median_ms']:.2f}")
        ratios = f"{_cell(mx_j[i], '.2f')}x | {_cell(j_floor[i], '.2f')}x"
        lines.append(f"| {i + 1} | {' | '.join(cells)} | {ratios} |".replace("—x", "—"))
    meds = [_cell(_median(cols[s])) for s in SIDES]
    lines.append(
        f"| median | {' | '.join(meds)} | {_span(mx_j)} | {_span(j_floor)} |".replace("—x", "—")
    )
    first = res["rounds"][0][loop]
    starts = ", ".join(
        f"{'MXNet' if s == 'mxnet' else s} {first[s]['first_ms']:.0f}"
        for s in SIDES
        if first.get(s) and "first_ms" in first[s]
    )
    compiles = {
        s: max(
            r[loop][s]["compiles"] for r in res["rounds"] if "compiles" in (r[loop].get(s) or {})
        )
        for s in ("jaxkv", "floor")
        if any("compiles" in (r[loop].get(s) or {}) for r in res["rounds"])
    }
    extra = ""
    syncs = [r[loop]["jaxkv"].get("host_syncs") for r in res["rounds"] if r[loop].get("jaxkv")]
    syncs = [x for x in syncs if x is not None]
    if syncs:
        extra = f"; jaxkv's host collectives per step: {max(syncs):g} (the most of any round)"
    lines += [
        "",
        f"First step (round 1, ms; start-up: compiles): {starts or '—'}. Compiles after "
        "warm-up (the most of any round): "
        + (", ".join(f"{s} {n}" for s, n in compiles.items()) or "—")
        + f"{extra}. Same checksums as jaxkv: {_checksums(res, loop)}.",
    ]
    return lines


def _split_ratios(res: dict) -> tuple[list, list]:
    """Per round of the 2-process loop: MXNet / split floor and jaxkv / split floor."""
    mx_s, j_s = [], []
    for r in res["rounds"]:
        j, m, f = (_ms(r["embedding-2"].get(s)) for s in ("jaxkv", "mxnet", "split"))
        mx_s.append(m / f if m and f else None)
        j_s.append(j / f if j and f else None)
    return mx_s, j_s


def _split_table(res: dict) -> list[str]:
    """The 2-process loop's split floor beside jaxkv and MXNet, per round."""
    lines = [
        "The split floor (jaxkv's own layout: the table split over the processes, one jit with "
        "two all-to-alls; embedding_floor.py `dist_sync --split`), per round:",
        "",
        "| round | split floor ms | MXNet / split floor | jaxkv / split floor |",
        "|---|---|---|---|",
    ]
    mx_s, j_s = _split_ratios(res)
    for i, r in enumerate(res["rounds"]):
        got = r["embedding-2"].get("split")
        cell = "not run" if got is None else _cell(_ms(got)) if "error" not in got else "failed"
        lines.append(f"| {i + 1} | {cell} | {_cell(mx_s[i])}x | {_cell(j_s[i])}x |")
    mid = _median([_ms(r["embedding-2"].get("split")) for r in res["rounds"]])
    lines.append(f"| median | {_cell(mid)} | {_span(mx_s)} | {_span(j_s)} |")
    return [line.replace("—x", "—") for line in lines]


def _host_table(res: dict) -> list[str]:
    """The embedding loops' step beside the CPU time of the thread that runs it, per side
    (medians of the rounds): what is the host's and what is the computation's."""
    lines = [
        "### The embedding loops: the host's time and the computation's",
        "",
        "Each run's median CPU time a step of the thread that runs the loop "
        "(`time.thread_time`: its Python, the calls into JAX or MXNet and their dispatches; "
        "the busier process's across processes), beside its median step; what is left of the "
        "step is the computation and the waits for it: XLA's computations and MXNet's engine "
        "run on threads of their own. Medians of the rounds (the rest: of each round's step "
        "less its host time).",
        "",
        "| loop | side | step ms | host ms (the loop's thread) | rest ms (computation, waits) |",
        "|---|---|---|---|---|",
    ]
    names = {"jaxkv": "jaxkv", "mxnet": "MXNet", "floor": "floor", "split": "split floor"}
    for loop in ("embedding-1", "embedding-2"):
        for side, name in names.items():
            got = [r[loop].get(side) or {} for r in res["rounds"]]
            got = [g for g in got if "median_ms" in g]
            step = _median([g["median_ms"] for g in got])
            host = _median([g.get("host_ms") for g in got])
            rest = _median([g["median_ms"] - g["host_ms"] for g in got if "host_ms" in g])
            if step is None:
                continue
            lines.append(
                f"| {TITLES[loop]} | {name} | {_cell(step)} | {_cell(host, '.2f', '—')} "
                f"| {_cell(rest, '.2f', '—')} |"
            )
    return lines


def _new_keys_table(res: dict) -> list[str]:
    lines = [
        f"### {NEW_KEYS} new keys with a Python updater",
        "",
        "| round | jaxkv s | jaxkv compiles | MXNet s | MXNet / jaxkv |",
        "|---|---|---|---|---|",
    ]
    js, cs, ms = [], [], []
    for i, r in enumerate(res["rounds"]):
        j, m = r["new-keys"].get("jaxkv") or {}, r["new-keys"].get("mxnet") or {}
        js.append(j.get("s"))
        cs.append(j.get("compiles"))
        ms.append(m.get("s"))
        jt = f"failed: {j['error']}" if "error" in j else f"{j['s']:.2f} | {j['compiles']}"
        mt = "not run" if not m else f"failed: {m['error']}" if "error" in m else f"{m['s']:.2f}"
        ratio = f"{m['s'] / j['s']:.2f}x" if "s" in m and "s" in j else "—"
        lines.append(f"| {i + 1} | {jt} | {mt} | {ratio} |")
    lines.append(
        f"| median | {_cell(_median(js))} | {_cell(_median(cs), '.0f')} | {_cell(_median(ms))} | |"
    )
    return lines


def _goals(res: dict) -> list[str]:
    lines = ["| goal | measured | met |", "|---|---|---|"]

    def ok(flag: bool | None) -> str:
        return "—" if flag is None else ("yes" if flag else "no")

    mx_j, j_floor = _ratios(res, "embedding-1")
    a, b = _median(j_floor), _median(mx_j)
    lines.append(
        "| embedding loop, one device: <= 1.2x the floor and >= 1.2x MXNet | jaxkv / floor "
        f"{_span(j_floor)}; MXNet / jaxkv {_span(mx_j)} | "
        f"{ok(None if a is None or b is None else a <= 1.2 and b >= 1.2)} |"
    )
    alone = [_ms(r["embedding-1"].get("jaxkv")) for r in res["rounds"]]
    near = [_ms(r["embedding-beside"].get("jaxkv")) for r in res["rounds"]]
    grows = [b / a if a and b else None for a, b in zip(alone, near)]
    g = _median(grows)
    lines.append(
        f"| embedding loop, one device, {BESIDE} small keys beside the table: within 1.2x of the "
        f"loop alone (a step costs the keys it touches) | jaxkv beside / alone {_span(grows)} | "
        f"{ok(None if g is None else g <= 1.2)} |"
    )
    mx_j, _ = _ratios(res, "keys")
    b = _median(mx_j)
    lines.append(
        f"| 1000 keys x 8 devices, list push and pull: >= 2x MXNet | MXNet / jaxkv {_span(mx_j)} "
        f"| {ok(None if b is None else b >= 2)} |"
    )
    mx_j, _ = _ratios(res, "embedding-2")
    b = _median(mx_j)
    syncs = [
        r["embedding-2"]["jaxkv"].get("host_syncs")
        for r in res["rounds"]
        if r["embedding-2"].get("jaxkv")
    ]
    syncs = [x for x in syncs if x is not None and x >= 0]
    most = max(syncs) if syncs else None
    mx_s, _ = _split_ratios(res)
    lines.append(
        "| embedding loop, 2 processes: >= 1.2x MXNet; at most one host synchronisation a step "
        f"| MXNet / jaxkv {_span(mx_j)}; {_cell(most, 'g', 'not counted')} host collectives a "
        f"step (MXNet / the split floor, jaxkv's layout by hand: {_span(mx_s)}) "
        f"| {ok(None if b is None or most is None else b >= 1.2 and most <= 1)} |"
    )
    js = [(r["new-keys"].get("jaxkv") or {}) for r in res["rounds"]]
    s = _median([j.get("s") for j in js])
    c = _median([j.get("compiles") for j in js])
    lines.append(
        f"| {NEW_KEYS} new keys with a Python updater: <= 5 s, <= 8 compiles | "
        f"{_cell(s)} s, {_cell(c, '.0f')} compiles (median of the rounds) | "
        f"{ok(None if s is None or c is None else s <= 5 and c <= 8)} |"
    )
    return lines


def _pieces_table(got: dict, names: dict, title: str) -> list[str]:
    sides = [s for s in ("jaxkv", "mxnet") if s in got]
    if not sides:
        return []
    lines = [
        f"#### Where the host time goes: {title}",
        "",
        "| piece | " + " | ".join(f"{_side(s)} ms | {_side(s)} share" for s in sides) + " |",
        "|---|" + "---|---|" * len(sides),
    ]
    for p, text in names.items():
        cells = []
        for s in sides:
            g = got[s]
            x, step = g.get(f"{p}_ms"), g.get("step_ms")
            cells += [_cell(x, ".3f"), f"{x / step:.0%}" if x is not None and step else "—"]
        lines.append(f"| {text} | " + " | ".join(cells) + " |")
    cells = []
    for s in sides:
        g = got[s]
        if "step_ms" not in g:
            cells += ["—", "—"]
            continue
        total = sum(g.get(f"{p}_ms", 0.0) for p in names)
        cells += [f"{total:.3f}", f"{total / g['step_ms']:.0%}"]
    lines.append("| sum of the pieces' medians | " + " | ".join(cells) + " |")
    cells = []
    for s in sides:
        cells += [_cell(got[s].get("step_ms"), ".3f"), "100%" if "step_ms" in got[s] else "—"]
    lines.append("| the step (median) | " + " | ".join(cells) + " |")
    errors = [f"{_side(s)}: {got[s]['error']}" for s in sides if "error" in got[s]]
    if errors:
        lines += ["", "Failed: " + "; ".join(errors)]
    return lines


def _side(s: str) -> str:
    return "MXNet" if s == "mxnet" else s


def report(res: dict) -> list[str]:
    """The host section of results.md: a table per loop (each round's ms, the ratios), the
    goals, then where the host time goes."""
    st = res["settings"]
    emb_timed, keys_timed = st["steps"] - 10, st["keys_steps"] - 3
    lines = [
        "## Host time: the three loops and new keys",
        "",
        f"benchmarks/host.py, {st['rounds']} interleaved round{'s' if st['rounds'] > 1 else ''}: "
        "in each, every loop's jaxkv, "
        "MXNet 1.9.1 and floor runs in turn, each in a process of its own, then the new-keys "
        "rows; the ratios are taken within a round, and the median row gives the median of "
        "the rounds (lowest-highest). The JAX processes share one persistent compilation cache "
        "for the section (round 1 compiles, later rounds find it; a hit still counts as a "
        "compile)."
        + ("" if res.get("mxnet") else " MXNet's venv is absent: its columns are not run."),
        "",
        f"- Embedding loop, one device: benchmarks/embedding_worker.py (rows.py's loop), a "
        f"row_sparse table of {st['rows']:,} x 64 float32 and a dense 256 x 64 key, "
        "`Adam(lazy_update=True)` under a warm-up `CosineScheduler`, per step 1,200-1,300 "
        "distinct rows pushed (and the dense key with a priority), pulled back with "
        "`row_sparse_pull`, the dense key pulled; jaxkv `jaxkv.mx` `device` store, MXNet its "
        f"`device` store. Median of the {emb_timed} steps after 10 of warm-up. Floor: "
        "benchmarks/embedding_floor.py, the same numbers in one jitted step (table, moments "
        "and dense key donated, ids padded to a multiple of 128, NumPy arguments, the pulled "
        "rows cut on the host).",
        f"- Embedding loop, one device, {BESIDE} small keys beside the table: the same loop "
        f"with {BESIDE} keys of 16 x 16 float32 initialized, pushed and pulled once as a list "
        "before it (a model's other parameters; jaxkv keeps them in flat buckets), which the "
        "loop never touches (embedding_worker.py `--beside`); no floor (the floor's step is "
        "the loop alone's).",
        "- 1000 keys x 8 devices: benchmarks/keys_worker.py, a `device` store over 8 CPU "
        "devices, `SGD(learning_rate=0.1)` on the store, 1000 keys of 16 x 16 float32, per "
        "step `kv.push(keys, grads)` (8 per-device gradients a key), `kv.pull(keys, out=outs)` "
        f"(8 per-device outs a key), `mx.nd.waitall()`. Median of the {keys_timed} steps "
        "after 3 of warm-up. Floor: the same buffers in and out by hand: 8 per-device jits "
        "stacking the gradients, one jit over the 8 devices (one psum, SGD on the replicated "
        "weights, 1000 replicated outputs), each output's 8 per-device arrays as the outs.",
        "- Embedding loop, 2 processes: the same loop, `dist_sync` over 2 processes of one "
        "CPU device each (jaxkv: `python -m jaxkv.launch -n 2 --devices-per-process 1`, gloo; "
        "MXNet: 2 workers and 2 servers), the slower process's median; jaxkv's host "
        "collectives among the processes counted per step. Floor: embedding_floor.py "
        "`dist_sync` under the same launcher, one jit of a shard_map over the 2 devices (one "
        "all-gather of the ids and rows, lazy Adam on the union in each process's copy of the "
        "table, a psum of the dense gradients). The split floor: the same with the table split "
        "over the processes as jaxkv's `dist_sync` store keeps it (`--split`: one jit, one "
        "all-to-all taking each owner its rows, one bringing them back).",
        f"- {NEW_KEYS} new keys with a Python updater: benchmarks/new_keys.py's `python` row "
        "(init, push, pull and read per key, `kv._set_updater` with an in-place Python "
        "function, from a fresh process: start-up and compiles included).",
        "",
    ]
    for loop in LOOPS:
        lines += [*_loop_table(res, loop), ""]
        if loop == "embedding-2":
            lines += [*_split_table(res), ""]
    lines += [*_host_table(res), ""]
    lines += [*_new_keys_table(res), "", "### Goals", "", *_goals(res)]
    pieces = res.get("pieces") or {}
    if pieces:
        lines += [
            "",
            "### Where the host time goes",
            "",
            "A round of its own after the others (the timing perturbs the step): each call of "
            "the step timed with `time.perf_counter` around it, in the same worker with "
            "`--pieces`; each piece's median over the timed steps and its share of the median "
            "step (the medians need not add up to the step's). jaxkv dispatches work without "
            "waiting for it, so a computation's time lands in the call that waits for it.",
            "",
            *_pieces_table(pieces.get("embedding-1", {}), EMB_PIECES, TITLES["embedding-1"]),
            "",
            *_pieces_table(pieces.get("keys", {}), KEYS_PIECES, TITLES["keys"]),
        ]
    return lines


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--steps", type=int, default=STEPS, help="each embedding run's steps")
    parser.add_argument("--keys-steps", type=int, default=KEYS_STEPS, help="each keys run's steps")
    parser.add_argument("--no-pieces", action="store_true", help="skip the pieces round")
    args = parser.parse_args()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    res = run(args.rounds, args.steps, args.keys_steps, not args.no_pieces, log=log)
    print("\n".join(report(res)))


if __name__ == "__main__":
    main()
