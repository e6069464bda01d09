"""The multi-process row of ``make bench``: ResNet-50's 193 tensors pushed from D devices and
pulled back to D devices per step, in 2 processes on this machine, MXNet 1.9.1 ``dist_sync``
(2 servers) beside jaxkv ``dist_sync`` (gloo), for D = 1 and 2 devices per process.

    python benchmarks/dist.py [--steps 7] [--rounds 2]        # prints both, with ratios
    python benchmarks/dist.py --compression 2bit              # both with 2-bit compression
    python -m jaxkv.launch -n 2 --devices-per-process D benchmarks/dist.py --worker STEPS

MXNet's ``tools/launch.py`` hangs under Python 3.11 and its tracker picks eth0's address, so
:func:`mxnet_dist` starts the roles itself (``DMLC_*`` variables, loopback only), each under a
timeout. jaxkv's processes start through ``python -m jaxkv.launch``, as a user starts them.
Each side's worker checks the first step's values before timing. :func:`mxnet_job` runs any
MXNet parameter-server job this way (conformance/record_dist_compression.py uses it too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MXNET_VENV = os.environ.get("MXNET_VENV", os.path.join(HERE, "..", ".venv-mxnet"))
PROCESSES = 2
SERVERS = 2
TIMEOUT = 300  # seconds for one side's whole job


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(out: str, prefix: str) -> tuple[float, bool] | None:
    for line in out.splitlines():
        if line.startswith(prefix):
            fields = dict(f.split("=") for f in line.split()[3:])
            return float(fields["median_ms"]), fields["ok"] == "True"
    return None


def mxnet_job(
    argv: list[str],
    *,
    servers: int = SERVERS,
    workers: int = PROCESSES,
    env: dict[str, str] | None = None,
    python: str | None = None,
    timeout: int = TIMEOUT,
) -> list[tuple[str, int, str, str]]:
    """Run one MXNet parameter-server job on loopback: a scheduler, ``servers`` servers and
    ``workers`` workers, each ``python argv`` with its ``DMLC_ROLE`` (a scheduler or server
    runs its role when it imports mxnet), each under ``timeout`` seconds.

    ``env`` is added to every role's environment; ``python`` is MXNet's venv's by default.
    Returns ``(role, returncode, stdout, stderr)`` per process: the scheduler, the servers,
    then the workers (a worker's rank is not its place in this list).
    """
    python = python or os.path.join(MXNET_VENV, "bin", "python")
    base = {
        **os.environ,
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": str(_free_port()),
        "DMLC_NUM_SERVER": str(servers),
        "DMLC_NUM_WORKER": str(workers),
        "DMLC_INTERFACE": "lo",
        **(env or {}),
    }
    roles = ["scheduler"] + ["server"] * servers + ["worker"] * workers
    results: list[tuple[str, int, str, str]] = []
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as stack:
        # files, not pipes: a role blocked on a full pipe would stall the whole job
        files = [
            tuple(stack.enter_context(tempfile.TemporaryFile("w+")) for _ in "oe") for _ in roles
        ]
        try:
            for role, (out, err) in zip(roles, files):
                procs.append(
                    subprocess.Popen(
                        ["timeout", str(timeout), python, *argv],
                        env=dict(base, DMLC_ROLE=role),
                        stdout=out,
                        stderr=err,
                        text=True,
                    )
                )
            # A role that fails (ps-lite's "bind failed") leaves the others waiting for it
            # until their timeout: stop them all then.
            deadline = time.monotonic() + timeout + 10
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    for p in procs:
                        if p.poll() is None:
                            p.terminate()  # timeout(1) passes it on to its command
                    break
                time.sleep(0.2)
            for role, p, (out, err) in zip(roles, procs, files):
                try:
                    rc = p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    rc = p.wait()
                out.seek(0)
                err.seek(0)
                results.append((role, rc, out.read(), err.read()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    return results


def mxnet_dist(
    devices: int, steps: int, compression: str | None = None
) -> tuple[float, bool] | None:
    """MXNet's ``dist_sync`` median ms/step and whether its first step was right, or ``None``
    where its venv (conformance/setup_mxnet.sh) is absent. ``compression``: ``None`` or
    ``'2bit'`` (``dist_worker.THRESHOLD``)."""
    if not os.path.exists(os.path.join(MXNET_VENV, ".ok")):
        return None
    argv = [os.path.join(HERE, "mxnet_dist.py"), str(devices), str(steps)]
    if compression:
        argv.append(compression)
    # OMP_NUM_THREADS=1: MXNet's faster setting here (2 cores, 5 processes)
    roles = mxnet_job(argv, env={"OMP_NUM_THREADS": "1"})
    out = "".join(stdout for role, _, stdout, _ in roles if role == "worker")
    return _result(out, f"mxnet dist D={devices} ")


def jaxkv_dist(devices: int, steps: int, compression: str | None = None) -> tuple[float, bool]:
    """jaxkv's ``dist_sync`` median ms/step and whether its first step was right."""
    cmd = [sys.executable, "-m", "jaxkv.launch", "-n", str(PROCESSES), "--no-prefix"]
    cmd += ["--devices-per-process", str(devices), __file__, "--worker", str(steps)]
    if compression:
        cmd += ["--compression", compression]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    result = _result(run.stdout, f"jaxkv dist D={devices} ")
    if result is None:
        raise RuntimeError(f"jaxkv dist_sync D={devices} failed:\n{run.stdout}\n{run.stderr}")
    return result


def worker(steps: int, compression: str | None = None) -> None:
    """One process of the jaxkv job: ``dist_worker.py``'s loop, as MXNet's workers run it,
    through ``jaxkv.mx``."""
    import dist_worker
    import jax

    import jaxkv.mx as mx

    dist_worker.run(mx, "jaxkv", len(jax.local_devices()), steps, compression)


def run(steps: int = 7, rounds: int = 2, log=print, compression: str | None = None) -> list[dict]:
    """Both sides at 1 and 2 devices per process, ``rounds`` times back to back; each number is
    the best of its rounds. One row per D: ``{'D', 'mxnet', 'jaxkv', 'ok', 'rounds',
    'compression'}``; ``compression``: ``None`` or ``'2bit'``, on both sides."""
    rows = []
    kind = f" {compression}" if compression else ""
    for devices in (1, 2):
        times: dict[str, list[float]] = {"mxnet": [], "jaxkv": []}
        ok = True
        for r in range(rounds):
            for name, fn in (("mxnet", mxnet_dist), ("jaxkv", jaxkv_dist)):
                log(
                    f"[dist] {PROCESSES} processes x {devices} devices, round {r + 1}/{rounds}: "
                    f"{name} dist_sync{kind} ..."
                )
                result = fn(devices, steps, compression)
                if result is None:
                    log("  not run (no MXNet venv)")
                    continue
                times[name].append(result[0])
                ok = ok and result[1]
                log(f"  {result[0]:.1f} ms{'' if result[1] else ' (WRONG VALUES)'}")
        rows.append(
            {
                "D": devices,
                "mxnet": min(times["mxnet"]) if times["mxnet"] else None,
                "jaxkv": min(times["jaxkv"]) if times["jaxkv"] else None,
                "ok": ok,
                "rounds": times,
                "compression": compression,
            }
        )
    return rows


def lines(rows: list[dict]) -> list[str]:
    """The result lines: one per D, with MXNet/jaxkv (above 1: jaxkv is faster)."""
    out = []
    for row in rows:
        mx_ms = "not run" if row["mxnet"] is None else f"{row['mxnet']:.1f} ms"
        jx_ms = "unavailable" if row["jaxkv"] is None else f"{row['jaxkv']:.1f} ms"
        both = row["mxnet"] is not None and row["jaxkv"] is not None
        ratio = f"{row['mxnet'] / row['jaxkv']:.2f}x" if both else "—"
        kind = f", {row['compression']}" if row.get("compression") else ""
        out.append(
            f"{PROCESSES} processes x {row['D']} device(s){kind}: jaxkv {jx_ms}, "
            f"MXNet {mx_ms}, MXNet/jaxkv {ratio}, values {'ok' if row['ok'] else 'WRONG'}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", type=int, metavar="STEPS", help=argparse.SUPPRESS)
    parser.add_argument("--only", type=int, choices=[1, 2], help="one D, jaxkv only")
    parser.add_argument(
        "--compression",
        choices=["2bit"],
        help="push with 2-bit gradient compression (threshold dist_worker.THRESHOLD)",
    )
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.compression)
    elif args.only:
        print(jaxkv_dist(args.only, args.steps, args.compression), flush=True)
    else:
        rows = run(args.steps, args.rounds, compression=args.compression)
        print("\n".join(lines(rows)), flush=True)


if __name__ == "__main__":
    main()
