"""``make bench``'s "many processes" section: benchmarks/processes_step.py launched with 1, 2, 3
and 4 processes of one CPU device each, each row in a job of its own (its own peak RSS).

    python benchmarks/processes.py [--steps 10] [--processes 1 2 3 4] [--json FILE]

Prints a markdown table (and writes the rows as JSON with ``--json``): per process count and
row, the step's ms (mean, best of 3 rounds) and its ratio to GSPMD's, the parameters and
optimizer state each process holds (the most of any process, and as a fraction of the whole
state), each process's peak resident set, its bytes written per step (gloo's messages), and
the collectives in the compiled step.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = ["gspmd", "jaxkv", "jaxkv-every-sum", "jaxkv-unverified", "jaxkv-jit"]


def run(n, row, steps):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "jaxkv.launch", "-n", str(n), "--devices-per-process", "1"]
    command += ["--no-prefix", os.path.join(HERE, "processes_step.py"), str(steps), row]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"{n} processes, {row}:\n{out.stdout}{out.stderr}")
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == n, out.stdout
    return lines


def collect(steps, processes=(1, 2, 3, 4), log=None):
    """Every process's row of every job: ``steps`` timed steps per round, rounded up to a
    multiple of 20 (each round then checks every slice of each sum once in the default row)."""
    steps = -(-max(steps, 1) // 20) * 20
    results = []
    for n in processes:
        for row in ROWS:
            if log:
                log(f"[processes] {n} processes, {row} ...")
            results += run(n, row, steps)
    return results


def model_lines(results):
    """The fitted model's lines, and its extrapolation."""
    m = fit(results)
    lines = [
        f"Model (jaxkv-unverified, least squares over the measured P): t = {m['c_ms']:.1f} ms x "
        f"max(1, P / {m['cores']}) + sent / {m['bandwidth'] / 1e9:.2f} GB/s + "
        f"{m['latency_ms']:.2f} ms x (P - 1).",
        "",
        "| processes | measured ms | model ms | model / measured |",
        "|---|---|---|---|",
    ]
    for p, (t, pred) in m["points"].items():
        lines.append(f"| {p} | {t:.1f} | {pred:.1f} | {pred / t:.2f} |")
    lines += ["", "| hosts | link | model ms/step | state MB / host |", "|---|---|---|---|"]
    for p, link, ms, mb in extrapolate(m, results):
        lines.append(f"| {p} | {link} | {ms:.1f} | {mb:.1f} |")
    return lines


def report(results):
    """The section of results.md."""
    return [
        "Many processes: the in-jit data-parallel step of a 256 -> 2048 x 3 -> 16 MLP (8.95M "
        "float32 parameters, AdamW, 64 rows per device), P launched processes of one CPU device "
        "each, gloo between them (`benchmarks/processes_step.py`, each row a job of its own). "
        "gspmd: plain `jit` over the global mesh, leaves of at least 16384 elements (the "
        "store's default bound) split by rows; jaxkv: the README's `jaxkv.gather` + "
        "`jaxkv.push` step in `shard_map` (`jaxkv.empty()`), with "
        "verified sums as by default across processes (a twentieth of each sum checked at "
        "every step), "
        "every sum checked at every step (`JAXKV_VERIFY_SUMS=1`), and none "
        "(`JAXKV_VERIFY_SUMS=0`); jaxkv-jit: the plain-`jit` recipe (the gradient and "
        "`jaxkv.push` in one `jax.jit`, no `shard_map`). ms/step: mean of the "
        "timed steps, best of 3 rounds (the slowest process); state: parameters and optimizer "
        "state on a process's devices (the most of any), and as a fraction of the whole; peak "
        "RSS: the process's peak resident set; sent: bytes the process wrote per step (gloo's "
        "messages); collectives: in the compiled step.",
        "",
        *table(results).splitlines(),
        "",
        *model_lines(results),
    ]


# Links to extrapolate to: (bytes a second each way per host, seconds per message round):
# gloo over 10 Gb/s Ethernet (TCP, about 50 us a round), and NCCL over 200 Gb/s InfiniBand
# (about 25 GB/s of bus bandwidth per host, about 10 us a round). Assumed, not measured here.
LINKS = {"gloo, 10 GbE": (1.25e9, 50e-6), "NCCL, 200 Gb/s IB": (25e9, 10e-6)}


def fit(results, row="jaxkv-unverified"):
    """A model of ``row``'s step time against the process count P, least squares over the
    measured P: ``t = c * max(1, P / cores) + sent / B + a * (P - 1)``. ``c``: one process's
    compute alone; ``cores``: this machine's (the processes share them beyond that); ``sent``:
    the bytes a process wrote per step (measured); ``B``: the bandwidth of the link between
    processes; ``a``: each further process's latency (ring collectives take P - 1 rounds).
    Returns the fitted ``c``, ``B``, ``a`` and each P's measured and predicted ms."""
    import numpy as np

    cores = os.cpu_count() or 1
    rows = {}
    for r in results:
        if r["row"] == row:
            n = r["processes"]
            rows[n] = (max(rows.get(n, (0, 0))[0], r["ms"]), r["sent_bytes_per_step"])
    ps = sorted(rows)
    a = np.array([[max(1.0, p / cores), rows[p][1] / 1e6, p - 1.0] for p in ps])
    t = np.array([rows[p][0] for p in ps])
    (c, per_mb, lat), *_ = np.linalg.lstsq(a, t, rcond=None)
    predicted = a @ np.array([c, per_mb, lat])
    bandwidth = 1e6 / (per_mb / 1e3) if per_mb > 0 else float("inf")  # bytes/s
    return {
        "c_ms": float(c),
        "bandwidth": float(bandwidth),
        "latency_ms": float(lat),
        "cores": cores,
        "points": {p: (float(t[i]), float(predicted[i])) for i, p in enumerate(ps)},
    }


def extrapolate(model, results, hosts=(8, 64)):
    """Step time and state per host at ``hosts`` hosts of one device each, for each of
    :data:`LINKS`: compute ``c`` (each host its own cores, so no sharing), the bytes a ring
    sends (all-reduce of the gradients 2 (P - 1) / P of them, all-gather of the split
    parameters (P - 1) / P) over the link's bandwidth, and the link's latency for the rings'
    rounds (2 (P - 1) per collective of the compiled step). The fitted ``a`` is not used: on
    this machine it is mostly processes sharing its cores, not the network."""
    mine = {r["processes"]: r for r in results if r["row"] == "jaxkv-unverified" and r["rank"] == 0}
    whole = mine[min(mine)]["whole_state_bytes"]
    # The state is R replicated and S split bytes: R + S / P on each process (from P = 2).
    two = mine.get(2)
    split = 2 * (whole - two["state_bytes"]) if two else whole
    params, split_params = whole / 3, split / 3  # AdamW: each value and its two moments
    collectives = mine[max(mine)]["collectives"]
    out = []
    for p in hosts:
        sent = 2 * (p - 1) / p * params + (p - 1) / p * split_params
        for link, (bandwidth, latency) in LINKS.items():
            rounds = 2 * (p - 1) * collectives
            ms = model["c_ms"] + (sent / bandwidth + rounds * latency) * 1e3
            out.append((p, link, ms, (whole - split + split / p) / 2**20))
    return out


def table(results):
    head = "| processes | row | ms/step | GSPMD / this | state MB / process | of the state | "
    head += "peak RSS MB / process | MB sent / step / process | collectives |"
    out = [head, "|" + "---|" * 9]
    for n in sorted({r["processes"] for r in results}):
        here = [r for r in results if r["processes"] == n]
        gspmd = max(r["ms"] for r in here if r["row"] == "gspmd")
        for row in ROWS:
            rs = [r for r in here if r["row"] == row]
            if not rs:
                continue
            ms = max(r["ms"] for r in rs)
            state = max(r["state_bytes"] for r in rs)
            out.append(
                f"| {n} | {row} | {ms:.1f} | {gspmd / ms:.2f}x | {state / 2**20:.1f} | "
                f"{state / rs[0]['whole_state_bytes']:.3f} | "
                f"{max(r['rss_peak_mb'] for r in rs):.0f} | "
                f"{max(r['sent_bytes_per_step'] for r in rs) / 2**20:.1f} | "
                f"{rs[0]['collectives']} |"
            )
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--json", help="write every process's row here")
    args = parser.parse_args()
    results = collect(
        args.steps, args.processes, log=lambda m: print(m, file=sys.stderr, flush=True)
    )
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    print("\n".join(report(results)))


if __name__ == "__main__":
    main()
