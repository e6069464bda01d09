"""A profiler trace of a few jaxkv pushes on CPU, drawn as a timeline: docs/_static/trace.png.

Runs, under ``jax.profiler.trace``, a data-parallel optax step in the user's ``jit`` +
``shard_map`` (``jaxkv.push`` with ``axis_name``), an eager push with 2-bit compression and an
eager row push routed to the rows' owners, each a few times after a warm-up, on 4 simulated CPU
devices. Then it reads the trace's events (its Perfetto JSON), keeps one row per device of the
XLA ops that ran and one of the host's ``jax.profiler.TraceAnnotation`` s, and colours each op by
the jaxkv scope it ran under (``jaxkv.sum``, ``jaxkv.compress``, ``jaxkv.updater``,
``jaxkv.rows.route``, ...).

On CPU an op's event names its module and instruction (``hlo_module``, ``hlo_op``); its scope
is in the instruction's op name, which XLA's HLO dump (``--xla_dump_to``, set below before JAX
starts) shows. On a GPU, TensorBoard's profile plugin and XProf show the op names themselves.

    python benchmarks/trace_picture.py [--out docs/_static/trace.png] [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile

DEVICES = 4
DUMP = tempfile.mkdtemp(prefix="jaxkv-hlo-")
# Before JAX starts: every compiled module's HLO, optimised, as text (the ops' op names).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text"
).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", DEVICES)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxkv  # noqa: E402

AXIS = "kv"
COLOURS = {
    "jaxkv.sum": "#1f77b4",
    "jaxkv.compress": "#d62728",
    "jaxkv.updater": "#2ca02c",
    "jaxkv.rows.route": "#9467bd",
    "jaxkv.push": "#8c564b",
    "jaxkv.pull": "#e377c2",
}
OTHER = "#c7c7c7"
HOST = ("#fdd49e", "#fdae6b", "#e6550d")  # the pushes' TraceAnnotations on the host


def workloads():
    """The three pushes, each a function of nothing that runs one and waits for it."""
    devices = jax.devices("cpu")[:DEVICES]
    opt = optax.adam(1e-3)
    params = {"w": jnp.zeros((128, 1024)), "b": jnp.zeros(1024)}
    state = jaxkv.init_optimizer(jaxkv.init(jaxkv.empty(devices), params), opt)
    specs = jaxkv.specs(state, AXIS)

    def step(state, grads):
        return jaxkv.push(state, grads, updater=opt, axis_name=AXIS)

    step = jax.jit(jax.shard_map(step, mesh=state.mesh, in_specs=(specs, P(AXIS)), out_specs=specs))
    split = NamedSharding(state.mesh, P(AXIS))
    rng = np.random.default_rng(0)
    grads = {
        "w": jax.device_put(rng.normal(size=(DEVICES * 128, 1024)).astype(np.float32), split),
        "b": jax.device_put(rng.normal(size=DEVICES * 1024).astype(np.float32), split),
    }
    held = {"state": state}

    def data_parallel():
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam
            held["state"] = step(held["state"], grads)
        jax.block_until_ready(held["state"])

    squeezed = jaxkv.init(
        jaxkv.empty(devices, compression={"type": "2bit", "threshold": 0.5}),
        {"g": jnp.zeros((256, 1024))},
    )
    values = [jax.device_put(rng.normal(size=(256, 1024)).astype(np.float32), d) for d in devices]

    def compressed():
        held["squeezed"] = jaxkv.push(held.get("squeezed", squeezed), "g", values)
        jax.block_until_ready(held["squeezed"])

    table = jaxkv.init(jaxkv.empty(devices), {"e": jnp.zeros((65536, 64))})
    ids = [jax.device_put(rng.integers(0, 65536, 2048).astype(np.int32), d) for d in devices]
    rows = [jax.device_put(np.ones((2048, 64), np.float32), d) for d in devices]
    sgd = optax.sgd(0.1)

    def rows_push():
        held["table"] = jaxkv.push_rows(
            held.get("table", table), "e", ids, rows, updater=sgd, donate=True
        )
        jax.block_until_ready(held["table"])

    return {
        "data-parallel step (jit + shard_map, adam)": data_parallel,
        "eager push, 2-bit compression": compressed,
        "eager row push (routed, sgd)": rows_push,
    }


def _scope(op_name: str) -> str:
    """The innermost ``jaxkv.*`` part of an op name, ``''`` where it has none."""
    parts = [p for p in op_name.split("/") if p.startswith("jaxkv.")]
    return parts[-1] if parts else ""


def dumped_modules(dump: str) -> dict[str, list[dict[str, str]]]:
    """Every module in the HLO dump, by name (several modules may share one: ``jit_run``):
    each instruction's jaxkv scope (:func:`_scope` of its op name; a fusion without one takes
    the commonest among the instructions it fuses)."""
    modules: dict[str, list[dict[str, str]]] = {}
    line = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=(.*)$")
    for path in sorted(glob.glob(os.path.join(dump, "*after_optimizations.txt"))):
        with open(path) as f:
            text = f.read()
        head = re.search(r"^HloModule ([\w.\-]+)", text, re.M)
        if head is None:
            continue
        scopes: dict[str, str] = {}
        inside: dict[str, list[str]] = {}  # each computation's instructions' scopes
        calls: dict[str, str] = {}  # a fusion's computation
        computation = ""
        for row in text.splitlines():
            opened = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+) .*\{$", row)
            if opened:
                computation = opened.group(1)
                continue
            found = line.match(row)
            if not found:
                continue
            op, rest = found.groups()
            name = re.search(r'metadata=\{op_name="([^"]*)"', rest)
            scopes[op] = _scope(name.group(1)) if name else ""
            inside.setdefault(computation, []).append(scopes[op])
            fused = re.search(r"calls=%([\w.\-]+)", rest)
            if fused:
                calls[op] = fused.group(1)
        for op, computation in calls.items():
            named = [s for s in inside.get(computation, []) if s]
            if not scopes[op] and named:
                scopes[op] = max(set(named), key=named.count)
        modules.setdefault(head.group(1), []).append(scopes)
    return modules


def scope_of(ops: list[dict], modules: dict[str, list[dict[str, str]]]) -> dict[int, str]:
    """Each op event's scope (by ``id``): of the dumped modules named as its module, the one
    that has the most of the instructions that ran beside it (in one push) decides."""
    ran: dict[str, set[str]] = {}
    for e in ops:
        ran.setdefault(e["args"].get("hlo_module", ""), set()).add(e["args"]["hlo_op"])
    chosen = {
        name: max(modules.get(name, [{}]), key=lambda scopes, names=names: len(names & set(scopes)))
        for name, names in ran.items()
    }
    return {
        id(e): chosen[e["args"].get("hlo_module", "")].get(e["args"]["hlo_op"], "") for e in ops
    }


def read_trace(trace_dir: str) -> list[dict]:
    (path,) = glob.glob(os.path.join(trace_dir, "plugins/profile/*/perfetto_trace.json.gz"))
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def draw(events: list[dict], modules: dict, labels: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    marks = [e for e in events if e.get("ph") == "X" and e.get("name") in labels]
    ops = [
        e
        for e in events
        if e.get("ph") == "X" and "hlo_op" in e.get("args", {}) and "device_ordinal" in e["args"]
    ]
    if not marks or not ops:
        sys.exit("the trace has no annotated pushes or no XLA ops: nothing to draw")
    # The last round of the three pushes: the last annotation of each.
    last = {
        name: max((e for e in marks if e["name"] == name), key=lambda e: e["ts"]) for name in labels
    }
    start = min(e["ts"] for e in last.values())
    fig, ax = plt.subplots(figsize=(12, 4.2), dpi=120)
    rows = ["host"] + [f"cpu:{d}" for d in range(DEVICES)]
    host = {name: HOST[i % len(HOST)] for i, name in enumerate(labels)}
    for name in labels:
        e = last[name]
        ax.broken_barh([((e["ts"] - start) / 1000, e["dur"] / 1000)], (0.1, 0.8), color=host[name])
    used = set()
    scopes: dict[int, str] = {}
    for e in last.values():  # each push's ops, told apart from the others' of a module's name
        scopes.update(
            scope_of([o for o in ops if e["ts"] <= o["ts"] <= e["ts"] + e["dur"]], modules)
        )
    for e in ops:
        if id(e) not in scopes:
            continue
        args = e["args"]
        scope = scopes[id(e)]
        used.add(scope)
        row = 1 + int(args["device_ordinal"])
        ax.broken_barh(
            [((e["ts"] - start) / 1000, max(e["dur"], 1.0) / 1000)],
            (row + 0.1, 0.8),
            color=COLOURS.get(scope, OTHER) if scope else OTHER,
        )
    ax.set_yticks([i + 0.5 for i in range(len(rows))], rows)
    ax.set_ylim(len(rows), 0)
    ax.set_xlabel("ms")
    ax.set_title(
        f"jaxkv pushes under jax.profiler.trace: {DEVICES} CPU devices, jax {jax.__version__}, "
        f"jaxkv {jaxkv.__version__}",
        fontsize=9,
    )
    legend = [Patch(color=c, label=f"host: {name}") for name, c in host.items()]
    legend += [Patch(color=c, label=s) for s, c in COLOURS.items() if s in used]
    legend.append(Patch(color=OTHER, label="other ops (no jaxkv scope)"))
    ax.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.22),
        ncol=4,
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out)
    print(f"wrote {out}; scopes seen: {sorted(s for s in used if s)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument(
        "--out", default=os.path.normpath(os.path.join(here, "..", "docs", "_static", "trace.png"))
    )
    parser.add_argument(
        "--trace-dir", default=None, help="keep the trace here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="jaxkv-trace-")
    runs = workloads()
    for run in runs.values():  # compiled before the trace
        run()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(3):
            for name, run in runs.items():
                with jax.profiler.TraceAnnotation(name):
                    run()
    try:
        draw(read_trace(trace_dir), dumped_modules(DUMP), list(runs), args.out)
    finally:
        shutil.rmtree(DUMP, ignore_errors=True)
    print(
        f"the trace: {trace_dir} (tensorboard --logdir {trace_dir}, or its perfetto_trace.json.gz "
        "at https://ui.perfetto.dev)"
    )


if __name__ == "__main__":
    main()
