"""The multi-process row of ``make bench``: ResNet-50's 193 tensors pushed from D devices and
pulled back to D devices per step, in 2 processes on this machine, MXNet 1.9.1 ``dist_sync``
(2 servers) beside jaxkv ``dist_sync`` (gloo), for D = 1 and 2 devices per process.

    python benchmarks/dist.py [--steps 7] [--rounds 2]        # prints both, with ratios
    python -m jaxkv.launch -n 2 --devices-per-process D benchmarks/dist.py --worker STEPS

MXNet's ``tools/launch.py`` hangs under Python 3.11 and its tracker picks eth0's address, so
:func:`mxnet_dist` starts the roles itself (``DMLC_*`` variables, loopback only), each under a
timeout. jaxkv's processes start through ``python -m jaxkv.launch``, as a user starts them.
Each side's worker checks the first step's values before timing.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

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


def mxnet_dist(devices: int, steps: int) -> tuple[float, bool] | None:
    """MXNet's ``dist_sync`` median ms/step and whether its first step was right, or ``None``
    where its venv (conformance/setup_mxnet.sh) is absent."""
    python = os.path.join(MXNET_VENV, "bin", "python")
    if not os.path.exists(os.path.join(MXNET_VENV, ".ok")):
        return None
    env = dict(
        os.environ,
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(_free_port()),
        DMLC_NUM_SERVER=str(SERVERS),
        DMLC_NUM_WORKER=str(PROCESSES),
        DMLC_INTERFACE="lo",
        OMP_NUM_THREADS="1",  # MXNet's faster setting here (2 cores, 5 processes)
    )
    script = os.path.join(HERE, "mxnet_dist.py")
    roles = ["scheduler"] + ["server"] * SERVERS + ["worker"] * PROCESSES
    procs = [
        subprocess.Popen(
            ["timeout", str(TIMEOUT), python, script, str(devices), str(steps)],
            env=dict(env, DMLC_ROLE=role),
            stdout=subprocess.PIPE if role == "worker" else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for role in roles
    ]
    out = ""
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=TIMEOUT + 10)
            out += stdout or ""
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return _result(out, f"mxnet dist D={devices} ")


def jaxkv_dist(devices: int, steps: int) -> tuple[float, bool] | None:
    """jaxkv's ``dist_sync`` median ms/step and whether its first step was right."""
    cmd = [sys.executable, "-m", "jaxkv.launch", "-n", str(PROCESSES)]
    cmd += ["--devices-per-process", str(devices), __file__, "--worker", str(steps)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    result = _result(run.stdout, f"jaxkv dist D={devices} ")
    if result is None:
        raise RuntimeError(f"jaxkv dist_sync D={devices} failed:\n{run.stdout}\n{run.stderr}")
    return result


def worker(steps: int) -> None:
    """One process of the jaxkv job: ``dist_worker.py``'s loop, as MXNet's workers run it,
    through ``jaxkv.mx``."""
    import dist_worker
    import jax

    import jaxkv.mx as mx

    dist_worker.run(mx, "jaxkv", len(jax.local_devices()), steps)


def run(steps: int = 7, rounds: int = 2, log=print) -> list[dict]:
    """Both sides at 1 and 2 devices per process, ``rounds`` times back to back; each number is
    the best of its rounds. One row per D: ``{'D', 'mxnet', 'jaxkv', 'ok', 'rounds'}``."""
    rows = []
    for devices in (1, 2):
        times: dict[str, list[float]] = {"mxnet": [], "jaxkv": []}
        ok = True
        for r in range(rounds):
            for name, fn in (("mxnet", mxnet_dist), ("jaxkv", jaxkv_dist)):
                log(
                    f"[dist] {PROCESSES} processes x {devices} devices, round {r + 1}/{rounds}: "
                    f"{name} dist_sync ..."
                )
                result = fn(devices, steps)
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
                "jaxkv": min(times["jaxkv"]),
                "ok": ok,
                "rounds": times,
            }
        )
    return rows


def lines(rows: list[dict]) -> list[str]:
    """The result lines: one per D, with MXNet/jaxkv (above 1: jaxkv is faster)."""
    out = []
    for row in rows:
        ratio = "—" if row["mxnet"] is None else f"{row['mxnet'] / row['jaxkv']:.2f}x"
        mx_ms = "not run" if row["mxnet"] is None else f"{row['mxnet']:.1f} ms"
        out.append(
            f"{PROCESSES} processes x {row['D']} device(s): jaxkv {row['jaxkv']:.1f} ms, "
            f"MXNet {mx_ms}, MXNet/jaxkv {ratio}, values {'ok' if row['ok'] else 'WRONG'}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", type=int, metavar="STEPS", help=argparse.SUPPRESS)
    parser.add_argument("--only", type=int, choices=[1, 2], help="one D, jaxkv only")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
    elif args.only:
        print(jaxkv_dist(args.only, args.steps), flush=True)
    else:
        print("\n".join(lines(run(args.steps, args.rounds))), flush=True)


if __name__ == "__main__":
    main()
