"""The Gluon/Module loop: MXNet training code's own KVStore calls, jaxkv beside MXNet 1.9.1.

What a training script does with a store when the store runs the optimizer
(``update_on_kvstore=True``), on ResNet-50's 193 parameter tensors at full size
(benchmarks/data/resnet50_shapes.json), each held on 8 devices (``mx.cpu(0)`` ..
``mx.cpu(7)``: jaxkv's 8 simulated CPU devices, MXNet's cpu contexts)::

    kv = mx.kv.create("device")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4))
    for i, w in enumerate(weights):             # start-up: one key at a time,
        kv.init(i, w[0])                        # then the first step
    for i in range(193):                        # each step
        kv.push(i, grads[i], priority=-i)       # the 8 devices' gradients of key i
        kv.pull(i, out=weights[i], priority=-i) # the new weight, onto the 8 devices
    mx.nd.waitall()

The init and push + pull calls are those of the Module API (``mxnet/model.py``:
``_initialize_kvstore``, ``_update_params_on_kvstore``); Gluon's Trainer in 1.9.1 makes the
same calls per key with the same priorities, with ``broadcast`` and ``pushpull`` in their place.
Weights start from a function of the key and each device's gradient of key i is
``(i % 7 + 1) * 1e-3`` everywhere, the same on both sides.

Measured, each side in a process of its own (``JAX_PLATFORMS=cpu`` for jaxkv; MXNet with its
venv's python, benchmarks/mxnet_gluon.py, "not run" where the venv is absent):

- start-up: seconds of the one-by-one init and of the first step; jaxkv's XLA compiles
  (``jax_log_compiles`` records); the process's peak resident set (``ru_maxrss``) beside the
  bytes the store and the arrays must hold (weights and momentum, plus 8 outs and 8 gradients
  of every key) and its resident set before any of them existed;
- the steady step: the median of at least 7 steps after one warm-up step, ms;
- values: a sample of a few keys' weights after every step, each side's against a NumPy model
  of MXNet's SGD, and jaxkv's against MXNet's (largest absolute difference), and whether every
  device's out holds the same;
- the same loop with ``dist_sync`` in 2 processes, 1 device each (``--gluon-dist-devices 1 2``
  adds 2): jaxkv's started by ``python -m jaxkv.launch``, MXNet's with a scheduler and 2
  servers (benchmarks/dist.py's ``mxnet_job``).

jaxkv runs with ``JAXKV_LAYOUT=auto`` (its default) and ``JAXKV_LAYOUT=keys``, one row each
(``JAXKV_BENCH_GLUON_LAYOUTS=auto,keys,flat`` picks others). A side that has not finished its
start-up in ``--gluon-timeout`` seconds (default 900, or ``JAXKV_BENCH_GLUON_TIMEOUT``), or its
steps in ``STEPS_TIMEOUT`` more, or whose processes hold more than ``--gluon-mem-gb`` GB
(default 80% of the memory available when the section starts), is stopped and reported as such,
with how far it got and its compiles so far; the section goes on.

    python benchmarks/gluon.py [--scale K] [--keys N] [--steps 7] [--timeout S] [--mem-gb G]
        [--dist-devices 1 [2]]
    python benchmarks/bench.py --only gluon [--gluon-scale K] [--gluon-keys N] ...

``--scale K`` divides every dimension by K (at least 1); ``--keys N`` takes the first N keys.

This module imports only the standard library and NumPy at the top: MXNet's side
(benchmarks/mxnet_gluon.py, in MXNet's venv) imports it for the same loop.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = os.path.join(HERE, "data", "resnet50_shapes.json")  # ResNet-50 v1's 193 tensors
MXNET_VENV = os.environ.get("MXNET_VENV", os.path.join(HERE, "..", ".venv-mxnet"))
D = 8  # devices of the local store
LR, MOMENTUM, WD = 0.1, 0.9, 1e-4
STEPS = 7
TIMEOUT_ENV = "JAXKV_BENCH_GLUON_TIMEOUT"
LAYOUTS_ENV = "JAXKV_BENCH_GLUON_LAYOUTS"
TIMEOUT = int(os.environ.get(TIMEOUT_ENV, "900"))  # seconds for one side's start-up
STEPS_TIMEOUT = 600  # seconds for its steps and checks after the start-up
PROCESSES = 2  # of the dist_sync jobs by default, as benchmarks/dist.py (MXNet: as many servers)
EVENT = "gluon-event "  # the prefix of a child's result lines on stdout
HEARTBEAT_S = 10.0
PROGRESS_KEYS = 20  # a progress event every this many keys of the init and the first step
SAMPLE = 256  # about this many elements of each sampled key are compared


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the workload, the same on both sides ------------------------------------------------------
def shapes(scale: int = 1, keys: int | None = None) -> list[tuple[int, ...]]:
    """ResNet-50's tensors, every dimension divided by ``scale`` (at least 1), the first
    ``keys`` of them (all where None)."""
    with open(SHAPES) as f:
        full = [tuple(s) for s in json.load(f)]
    return [tuple(max(1, d // scale) for d in s) for s in full[:keys]]


def weight(i: int, shape: tuple[int, ...]) -> np.ndarray:
    """Key ``i``'s initial weight: small float32 values, a function of the key and position."""
    flat = (np.arange(int(np.prod(shape))) % 17 - 8).astype(np.float32)
    return (flat * np.float32(0.01 / (i % 5 + 1))).reshape(shape)


def grad_value(i: int) -> float:
    """Every element of every device's gradient of key ``i``."""
    return (i % 7 + 1) * 1e-3


def sample_keys(n: int) -> list[int]:
    """The keys whose values are compared: the first two, the middle one and the last."""
    return sorted({0, min(1, n - 1), n // 2, n - 1})


def stride(shape: tuple[int, ...]) -> int:
    return max(1, int(np.prod(shape)) // SAMPLE)


def data_bytes(shapes: list[tuple[int, ...]], devices: int) -> dict[str, int]:
    """What the loop must hold: the stored weights and SGD's momentum, and ``devices`` outs and
    ``devices`` gradients of every key (float32)."""
    one = sum(int(np.prod(s)) for s in shapes) * 4
    return {"set": one, "store": 2 * one, "outs": devices * one, "grads": devices * one}


def model(i: int, shape: tuple[int, ...], pushes: int, steps: int) -> np.ndarray:
    """Key ``i``'s sampled weight after ``steps`` steps of MXNet's SGD, in float32, each step's
    gradient the sum of ``pushes`` devices' (``jaxkv/_src/mxnet/optimizer.py``'s SGD says the
    formula)."""
    f = np.float32
    w = weight(i, shape).ravel()[:: stride(shape)].copy()
    g = f(0)
    for _ in range(pushes):
        g = f(g + f(grad_value(i)))
    mom = np.zeros_like(w)
    lr_g, lr_wd = f(f(LR) * f(1.0)) * g, f(LR) * f(WD)
    for _ in range(steps):
        mom = f(MOMENTUM) * mom - lr_wd * w - lr_g
        w = w + mom
    return w


# -- one side's process: the loop, its events on stdout ----------------------------------------
class Events:
    """A child's events, one JSON line each on stdout (``EVENT`` first), from any thread; and a
    heartbeat every ``HEARTBEAT_S`` seconds with the phase and the compiles so far."""

    def __init__(self, compiles=None) -> None:
        self.on = True  # rank 0 only, in a dist job
        self.compiles = compiles or (lambda: None)
        self.phase = "set-up"
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._done = threading.Event()

    def emit(self, kind: str, **fields) -> None:
        if not self.on:
            return
        fields = {
            "event": kind,
            "phase": self.phase,
            "elapsed": time.perf_counter() - self.t0,
            "compiles": self.compiles(),
            "maxrss": maxrss(),
            **fields,
        }
        with self._lock:
            print(EVENT + json.dumps(fields), flush=True)

    def start_heartbeat(self) -> None:
        def beat():
            while not self._done.wait(HEARTBEAT_S):
                self.emit("heartbeat")

        threading.Thread(target=beat, daemon=True).start()

    def stop(self) -> None:
        self._done.set()


def maxrss() -> int:
    """The process's peak resident set so far, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> bool:
    """Start the process's peak resident set afresh from now (Linux's ``clear_refs``: 5 resets
    ``VmHWM``, and ``ru_maxrss`` with it: read the start-up's peak first); False where that is
    not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_since_reset() -> int:
    """The peak resident set since :func:`reset_peak` (``VmHWM``), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def written() -> int:
    """Bytes this process has written, sockets included (gloo's and ps-lite's messages)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def state_bytes(kv) -> int | None:
    """Bytes of stored values and optimizer state on this process's devices (jaxkv's store),
    or None where the process holds none of its own (MXNet's workers: its servers do)."""
    if not type(kv).__module__.startswith("jaxkv"):
        return None
    state = kv.state
    import jax

    leaves = jax.tree_util.tree_leaves(state)
    return sum(s.data.nbytes for x in leaves for s in getattr(x, "addressable_shards", ()))


def loop(mx, kvtype: str, devices: int, work: list, steps: int, events: Events) -> None:
    """The timed loop through ``mx`` (``mxnet`` or ``jaxkv.mx``): start-up, one warm-up step,
    ``steps`` timed steps, then the sampled values; emits ``startup`` then ``result``."""
    kv = mx.kv.create(kvtype)
    events.on = kv.rank == 0
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=LR, momentum=MOMENTUM, wd=WD))
    ctxs = [mx.cpu(d) for d in range(devices)]
    mx.nd.zeros((1,), ctx=ctxs[0]).asnumpy()  # the runtime started: the baseline's part
    base = rss()
    events.start_heartbeat()
    events.emit("progress", msg=f"{len(work)} keys x {devices} devices: making the arrays")
    weights, grads = [], []
    for i, s in enumerate(work):
        w = weight(i, s)
        weights.append([mx.nd.array(w, ctx=c, dtype="float32") for c in ctxs])
        grads.append([mx.nd.full(s, grad_value(i), ctx=c, dtype="float32") for c in ctxs])
    mx.nd.waitall()

    def step(progress: bool = False) -> None:
        for i in range(len(work)):
            kv.push(i, grads[i], priority=-i)
            kv.pull(i, out=weights[i], priority=-i)
            if progress and (i + 1) % PROGRESS_KEYS == 0:
                events.emit("progress", keys=i + 1, of=len(work))
        mx.nd.waitall()

    def sample() -> tuple[dict[str, list[float]], bool]:
        """The sampled keys' weights on the first device, and whether every device agrees."""
        samples, same = {}, True
        for i in sample_keys(len(work)):
            outs = [o.asnumpy() for o in weights[i]]
            same = same and all(np.array_equal(o, outs[0]) for o in outs[1:])
            samples[str(i)] = [float(x) for x in outs[0].ravel()[:: stride(work[i])]]
        return samples, same

    def since(before: int | None) -> int | None:
        return None if before is None else events.compiles() - before

    events.phase = "init"
    before = events.compiles()
    t = time.perf_counter()
    for i, w in enumerate(weights):
        kv.init(i, w[0])
        if (i + 1) % PROGRESS_KEYS == 0:
            events.emit("progress", keys=i + 1, of=len(work))
    mx.nd.waitall()
    init_s = time.perf_counter() - t
    init_compiles = since(before)
    events.phase = "first step"
    t = time.perf_counter()
    step(progress=True)
    first_s = time.perf_counter() - t
    startup_compiles = since(before)
    first, first_same = sample()  # after the first step, its gradients as pushed
    events.emit(
        "startup",
        init_s=init_s,
        first_step_s=first_s,
        init_compiles=init_compiles,
        startup_compiles=startup_compiles,
        samples=first,
        outs_agree=first_same,
        base_rss=base,
        workers=kv.num_workers,
    )
    events.phase = "steps"
    steady = reset_peak()  # the steps' own peak from here, beside the whole run's
    before = events.compiles()
    step()  # warm-up
    warmup_compiles = since(before)
    before = events.compiles()
    times = []
    sent = written()
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    sent = (written() - sent) / steps
    step_compiles = since(before)
    events.phase = "values"
    samples, same = sample()
    # MXNet's dist store with one device per worker pulls into the pushed gradient's buffer
    # (benchmarks/dist_worker.py): later steps then push weights, and only the first step's
    # values can be checked. Where the gradients changed, the last values are not compared.
    kept = all(
        bool((g.asnumpy() == np.float32(grad_value(i))).all())
        for i in sample_keys(len(work))
        for g in grads[i]
    )
    events.emit(
        "result",
        step_ms=float(np.median(times) * 1e3),
        step_rounds=[x * 1e3 for x in times],
        steps_total=steps + 2,
        warmup_compiles=warmup_compiles,
        step_compiles=step_compiles,
        samples=samples,
        outs_agree=bool(same and first_same),
        grads_kept=kept,
        workers=kv.num_workers,
        steps_peak=peak_since_reset() if steady else None,
        sent_per_step=sent,
        state_bytes=state_bytes(kv),
    )
    events.stop()


def child_parser() -> argparse.ArgumentParser:
    """The arguments of one side's process (this file with ``--side jaxkv``, or
    benchmarks/mxnet_gluon.py)."""
    p = argparse.ArgumentParser(description="one side of the Gluon/Module loop")
    p.add_argument("--kv", default="device", choices=["device", "dist_sync"])
    p.add_argument("--devices", type=int, default=D)
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--keys", type=int)
    p.add_argument("--steps", type=int, default=STEPS)
    return p


def jaxkv_side(args: argparse.Namespace) -> None:
    """jaxkv's process: counts XLA compiles from before its first computation."""
    import logging

    import jax

    if args.kv == "device":  # a dist job's devices are set by jaxkv.launch when jaxkv joins it
        jax.config.update("jax_num_cpu_devices", args.devices)
    count = [0]

    class Counter(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "Compiling" in record.getMessage():
                count[0] += 1

    logger = logging.getLogger("jax")
    logger.addHandler(Counter(logging.DEBUG))
    logger.propagate = False  # keep stderr quiet: one record per compile
    jax.config.update("jax_log_compiles", True)

    import jaxkv.mx as mx

    events = Events(lambda: count[0])
    loop(mx, args.kv, args.devices, shapes(args.scale, args.keys), args.steps, events)


# -- the driver: each side in a process of its own, watched --------------------------------------
def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (jaxkv.launch starts its workers in sessions of their
    own, so a process group would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _tree_rss(pid: int) -> int:
    total = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 * 2**30


def _stop(proc) -> None:
    """SIGTERM to the child's process group (jaxkv.launch passes it on to its workers), then
    SIGKILL to the whole group after 15 s."""
    import signal
    import subprocess

    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def watch(cmd: list[str], env: dict, label: str, timeout: float, mem: int, log=log) -> dict:
    """Run ``cmd`` in a session of its own and follow its events; stop it where its start-up
    passes ``timeout`` seconds, its steps ``STEPS_TIMEOUT`` more, or its processes' resident
    sets together pass ``mem`` bytes. Returns ``{'startup', 'result', 'last', 'stopped',
    'error', 'peak_tree_rss', 'wall_s'}``."""
    import queue
    import subprocess
    import tempfile

    out: dict = {"startup": None, "result": None, "last": None, "stopped": None, "error": None}
    peak = 0
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )
        events: queue.Queue = queue.Queue()

        def read() -> None:
            for line in proc.stdout:
                if line.startswith(EVENT):
                    events.put(json.loads(line[len(EVENT) :]))
            events.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        t0 = time.monotonic()
        deadline, finished = t0 + timeout, False
        while not finished:
            try:
                ev = events.get(timeout=1.0)
            except queue.Empty:
                ev = False
            if ev is None:
                finished = True
            elif ev:
                out["last"] = ev
                kind = ev["event"]
                if kind == "startup":
                    out["startup"] = ev
                    deadline = time.monotonic() + STEPS_TIMEOUT
                    compiles = ev.get("startup_compiles")
                    log(
                        f"  [{label}] start-up {ev['init_s'] + ev['first_step_s']:.1f} s (init "
                        f"{ev['init_s']:.1f} s, first step {ev['first_step_s']:.1f} s)"
                        + ("" if compiles is None else f", {compiles} compiles")
                    )
                elif kind == "result":
                    out["result"] = ev
                    log(f"  [{label}] steady step {ev['step_ms']:.1f} ms")
                elif kind == "progress" or (kind == "heartbeat" and ev["elapsed"] > 60):
                    where = f" {ev['keys']}/{ev['of']} keys" if "keys" in ev else ""
                    log(
                        f"  [{label}] {ev['phase']}{where}{': ' + ev['msg'] if 'msg' in ev else ''}"
                        f" ({ev['elapsed']:.0f} s{_compiles_text(ev)}, "
                        f"peak RSS {ev['maxrss'] / 1e9:.2f} GB)"
                    )
            peak = max(peak, _tree_rss(proc.pid))
            if finished:
                break
            if peak > mem:
                out["stopped"] = f"stopped at {peak / 1e9:.1f} GB resident (limit {mem / 1e9:.1f})"
            elif time.monotonic() > deadline:
                what = "its steps" if out["startup"] else "its start-up"
                limit = STEPS_TIMEOUT if out["startup"] else timeout
                out["stopped"] = f"did not finish {what} in {limit:.0f} s"
            if out["stopped"]:
                log(f"  [{label}] {out['stopped']}: stopping it")
                _stop(proc)
                break
        rc = proc.wait()
        reader.join(timeout=10)
        while not events.empty():  # events written before the stop
            ev = events.get()
            if ev:
                out["last"] = ev
                if ev["event"] in ("startup", "result"):
                    out[ev["event"]] = ev
        out["wall_s"] = time.monotonic() - t0
        out["peak_tree_rss"] = peak
        if rc and not out["stopped"]:
            err.seek(0)
            tail = err.read()[-3000:]
            out["error"] = f"exit status {rc}: {tail.strip().splitlines()[-1] if tail else ''}"
            log(f"  [{label}] failed ({out['error']}); its stderr ends:\n{tail}")
    return out


def _compiles_text(ev: dict) -> str:
    return "" if ev.get("compiles") is None else f", {ev['compiles']} compiles since it started"


def _child_args(kv: str, devices: int, scale: int, keys: int | None, steps: int) -> list[str]:
    argv = ["--kv", kv, "--devices", str(devices), "--scale", str(scale), "--steps", str(steps)]
    return argv + ([] if keys is None else ["--keys", str(keys)])


def has_mxnet() -> bool:
    return os.path.exists(os.path.join(MXNET_VENV, ".ok"))


def run_jaxkv(
    layout: str, kv: str, devices: int, opts: dict, log=log, processes: int = PROCESSES
) -> dict:
    """jaxkv's side in a process of its own (a ``jaxkv.launch`` job of ``processes`` for
    dist_sync), with ``JAXKV_LAYOUT=layout`` and ``JAX_PLATFORMS=cpu``."""
    argv = [__file__, "--side", "jaxkv"]
    argv += _child_args(kv, devices, opts["scale"], opts["keys"], opts["steps"])
    if kv == "device":
        cmd = [sys.executable, *argv]
    else:
        cmd = [sys.executable, "-m", "jaxkv.launch", "-n", str(processes), "--no-prefix"]
        cmd += ["--devices-per-process", str(devices), *argv]
    env = dict(os.environ, JAXKV_LAYOUT=layout, JAX_PLATFORMS="cpu")
    label = f"jaxkv {kv} {layout}" + (f" {processes}x{devices}" if kv != "device" else "")
    return watch(cmd, env, label, opts["timeout"], opts["mem"], log=log)


def run_mxnet(
    kv: str, devices: int, opts: dict, log=log, processes: int = PROCESSES
) -> dict | None:
    """MXNet's side with its venv's python, or None where that venv is absent; dist_sync as
    a parameter-server job (a scheduler, ``processes`` servers and as many workers) on
    loopback."""
    if not has_mxnet():
        return None
    python = os.path.join(MXNET_VENV, "bin", "python")
    argv = [os.path.join(HERE, "mxnet_gluon.py")]
    argv += _child_args(kv, devices, opts["scale"], opts["keys"], opts["steps"])
    if kv == "device":
        label, env = f"mxnet {kv}", dict(os.environ)
        return watch([python, *argv], env, label, opts["timeout"], opts["mem"], log=log)
    import dist

    out: dict = {"startup": None, "result": None, "last": None, "stopped": None, "error": None}
    t0 = time.monotonic()
    for attempt in range(2):
        roles = dist.mxnet_job(
            argv,
            servers=processes,
            workers=processes,
            env={"OMP_NUM_THREADS": "1"},  # MXNet's faster setting here (benchmarks/dist.py)
            timeout=int(opts["timeout"] + STEPS_TIMEOUT),
        )
        # ps-lite's roles bind ports of their own choosing: one taken meanwhile fails the job
        if attempt or not any("bind failed" in stderr for _, _, _, stderr in roles):
            break
        log(f"  [mxnet {kv}] a role failed to bind its port; once more")
    out["wall_s"] = time.monotonic() - t0
    for role, rc, stdout, stderr in roles:
        for line in stdout.splitlines():
            if line.startswith(EVENT):
                ev = json.loads(line[len(EVENT) :])
                out["last"] = ev
                if ev["event"] in ("startup", "result"):
                    out[ev["event"]] = ev
        if rc == 124 and out["stopped"] is None:  # timeout(1)'s status: mxnet_job stopped it
            out["stopped"] = f"did not finish in {opts['timeout'] + STEPS_TIMEOUT:.0f} s"
        elif rc and out["error"] is None:
            out["error"] = f"{role} exit status {rc}: {stderr.strip()[-300:]}"
    if out["stopped"]:
        log(f"  [mxnet {kv}] {out['stopped']}")
    elif out["error"]:
        log(f"  [mxnet {kv}] failed: {out['error']}")
    elif out["result"]:
        s, r = out["startup"], out["result"]
        log(
            f"  [mxnet {kv}] start-up {s['init_s'] + s['first_step_s']:.1f} s, steady step "
            f"{r['step_ms']:.1f} ms"
        )
    return out


def _checked(res: dict | None) -> list[tuple[dict, int]]:
    """A side's comparable samples: (samples, steps taken) after the first step, and after the
    last where its gradients stayed as pushed."""
    out = []
    s, r = res and res.get("startup"), res and res.get("result")
    if s:
        out.append((s["samples"], 1))
    if r and r["grads_kept"]:
        out.append((r["samples"], r["steps_total"]))
    return out


def _diff(a: dict[str, list[float]], b: dict[str, list[float]] | dict[str, np.ndarray]) -> float:
    return max(
        float(np.max(np.abs(np.asarray(a[k], np.float32) - np.asarray(b[k], np.float32))))
        for k in a
    )


def check(res: dict | None, work: list, pushes: int) -> dict:
    """A side's sampled values against the NumPy model: the largest |difference| (None where
    it has none), after which steps, and whether every device's out agreed."""
    checked = _checked(res)
    if not checked:
        return {"model": None, "steps": [], "agree": None}
    diff = max(
        _diff(got, {k: model(int(k), work[int(k)], pushes, n) for k in got}) for got, n in checked
    )
    r = res.get("result") or res["startup"]
    return {"model": diff, "steps": [n for _, n in checked], "agree": r["outs_agree"]}


def versus(a: dict | None, b: dict | None) -> float | None:
    """The largest |difference| between two sides' samples after the same steps, or None."""
    theirs = dict((n, got) for got, n in _checked(b))
    diffs = [_diff(got, theirs[n]) for got, n in _checked(a) if n in theirs]
    return max(diffs) if diffs else None


def layouts() -> list[str]:
    return [x.strip() for x in os.environ.get(LAYOUTS_ENV, "auto,keys").split(",") if x.strip()]


def run_section(
    scale: int = 1,
    keys: int | None = None,
    steps: int = STEPS,
    timeout: float = TIMEOUT,
    mem_gb: float | None = None,
    dist_devices: tuple[int, ...] = (1,),
    log=log,
    dist_processes: tuple[int, ...] = (PROCESSES,),
) -> dict:
    """Every row: jaxkv (each layout) and MXNet with the ``device`` store on D devices, then
    with ``dist_sync`` in each of ``dist_processes`` processes of each of ``dist_devices``
    devices (jaxkv in its first layout only, but at PROCESSES processes)."""
    work = shapes(scale, keys)
    mem = int(mem_gb * 1e9) if mem_gb else int(0.8 * available_bytes())
    opts = {"scale": scale, "keys": keys, "steps": max(steps, STEPS), "timeout": timeout}
    opts["mem"] = mem
    rows = []
    setups = [("device", D, 1)]
    setups += [("dist_sync", d, p) for p in dist_processes for d in dist_devices]
    for kv, devices, procs in setups:
        pushes = devices * procs
        every = layouts() if kv == "device" or procs == PROCESSES else layouts()[:1]
        sides = [(f"jaxkv, JAXKV_LAYOUT={lay}", "jaxkv", lay) for lay in every]
        sides.append(("MXNet 1.9.1", "mxnet", None))
        results: dict[str, dict | None] = {}
        for name, side, layout in sides:
            log(
                f"[gluon] {name}: {kv} store, "
                + (f"{procs} processes x {devices}" if kv != "device" else f"{devices}")
                + f" device(s), {len(work)} keys (scale 1/{scale}) ..."
            )
            if side == "jaxkv":
                results[name] = run_jaxkv(layout, kv, devices, opts, log=log, processes=procs)
            else:
                results[name] = run_mxnet(kv, devices, opts, log=log, processes=procs)
                if results[name] is None:
                    log("  not run (no MXNet venv)")
        mxnet = results["MXNet 1.9.1"]
        for name, res in results.items():
            rows.append(
                {
                    "name": name,
                    "kv": kv,
                    "devices": devices,
                    "processes": procs,
                    "res": res,
                    "check": check(res, work, pushes),
                    "vs_mxnet": None if name.startswith("MXNet") else versus(res, mxnet),
                    "mxnet": mxnet,
                }
            )
    return {
        "rows": rows,
        "scale": scale,
        "keys": len(work),
        "steps": opts["steps"],
        "timeout": timeout,
        "mem": mem,
        "data": data_bytes(work, D),
        "elements": sum(int(np.prod(s)) for s in work),
    }


# -- the report ----------------------------------------------------------------------------------
def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}" if x >= 0.1 else f"{x:.3f}"


def _mb(x: int) -> str:
    return f"{x / 1e6:.0f}" if x >= 1e7 else f"{x / 1e6:.2f}"


def _outcome(res: dict | None) -> str | None:
    """Why a side has no numbers ("not run", "did not finish ..."), or None where it has."""
    if res is None:
        return "not run (no MXNet venv)"
    if res.get("result"):
        return None
    last = res.get("last") or {}
    where = f"in {last.get('phase', 'set-up')}"
    if "keys" in last:
        where += f" (key {last['keys']}/{last['of']} at the last report)"
    compiles = f", {last['compiles']} compiles so far" if last.get("compiles") is not None else ""
    if res.get("stopped"):
        return f"{res['stopped']} ({where}{compiles})"
    text = f"failed {where}{compiles}: {res.get('error')}".replace("|", "/")
    return " ".join(text.split())[:300]  # one line: a table's cell


def _compiles(s: dict | None, r: dict | None) -> str:
    """A jaxkv row's compiles: start-up (of which init), warm-up step, timed steps."""
    if not s or s.get("startup_compiles") is None:
        return ""
    out = f"{s['startup_compiles']} ({s['init_compiles']} in init)"
    if r:
        out += f" / {r['warmup_compiles']} / {r['step_compiles']}"
    return out


def held_bytes(row: dict, one: int) -> int:
    """The bytes a row's process must hold, ``one`` the bytes of one set of weights: the
    stored weights and momentum (but in MXNet's dist_sync workers: its servers hold them), and
    an out and a gradient of every key per device."""
    store = 0 if row["kv"] == "dist_sync" and row["name"].startswith("MXNet") else 2
    return (store + 2 * row["devices"]) * one


def _peak(row: dict, one: int) -> tuple[str, str]:
    """The peak-RSS cells: (start-up, steps in MB; each above the start over the data held).
    The steps' peak is their own (``steps_peak``: reset once the start-up was over)."""
    res = row["res"] or {}
    s, r, last = res.get("startup"), res.get("result"), res.get("last")
    if not s:
        return (f"{last['maxrss'] / 1e6:.0f} (so far)" if last else "—"), ""
    held = held_bytes(row, one)
    start = s["maxrss"]
    steps = r and (r.get("steps_peak") or r["maxrss"])
    mb = f"{start / 1e6:.0f}, " + (f"{steps / 1e6:.0f}" if steps else "—")
    above = f"{(start - s['base_rss']) / held:.2f}x, " + (
        f"{(steps - s['base_rss']) / held:.2f}x" if steps else "—"
    )
    return mb, above


def report(sec: dict) -> list[str]:
    """The section of results.md: one row per side and store."""
    data = sec["data"]
    held = data["store"] + data["outs"] + data["grads"]
    size = "full size" if sec["scale"] == 1 else f"every dimension divided by {sec['scale']}"
    lines = [
        "## The Gluon/Module loop",
        "",
        "MXNet training code's KVStore calls with the optimizer on the store, as the Module API "
        "makes them (benchmarks/gluon.py; MXNet: benchmarks/mxnet_gluon.py): ResNet-50's "
        f"{'first ' if sec['keys'] < 193 else ''}{sec['keys']} tensors ({size}: "
        f"{sec['elements']:,} float32), each on {D} devices (dist_sync: on each process's), "
        "`kv.set_optimizer(SGD(learning_rate=0.1, momentum=0.9, wd=1e-4))`. Start-up: "
        "`kv.init(i, w)` key by key, then the first step. A step: per key, "
        "`kv.push(i, grads, priority=-i)` then `kv.pull(i, out=weights, priority=-i)`; then "
        f"`mx.nd.waitall()`. Steady: the median of {sec['steps']} steps after a warm-up step. "
        "Each side in a process of its own, stopped where its start-up passes "
        f"{sec['timeout']:.0f} s or its processes hold more than {sec['mem'] / 1e9:.1f} GB. "
        "Compiles (jaxkv's XLA compiles): start-up (of which init) / warm-up step / the timed "
        "steps. Values: 4 keys' weights, sampled after the first step and after the last, "
        "against a NumPy model of MXNet's SGD and jaxkv's against MXNet's (largest absolute "
        "difference; after the last step only where the pushed gradients stayed as they were: "
        "MXNet's dist store with one device per worker pulls into the pushed gradient); "
        "'outs agree': every device's copy of those keys holds the same.",
        "",
        f"Data the `device` loop must hold: {_mb(held)} MB (stored weights and momentum "
        f"{_mb(data['store'])} MB, {D} outs and {D} gradients of every key "
        f"{_mb(data['outs'] + data['grads'])} MB). Peak RSS: the process's peak resident set "
        "during start-up (`ru_maxrss`) and during the steps alone (`VmHWM`, reset once the "
        "start-up was over); 'above start / data': each peak less the resident set once the "
        "runtime had started (before any array existed), over the "
        "data the process must hold (in dist_sync: per worker, its devices' outs and "
        "gradients, and the stored weights and momentum but in MXNet's workers, whose servers "
        "hold them).",
        "",
        "| store | side | start-up s | init s | first step s | compiles | steady ms/step | "
        "MXNet / this | peak RSS MB (start-up, steps) | above start / data (start-up, steps) | "
        "values vs model | vs MXNet | outs agree |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sec["rows"]:
        res = row["res"]
        store = row["kv"]
        if row["kv"] != "device":
            store = f"dist_sync {row['processes']}x{row['devices']}"
        s, r = res and res.get("startup"), res and res.get("result")
        why = _outcome(res)
        total = init = first = ms = "—"
        if s:
            init, first = _s(s["init_s"]), _s(s["first_step_s"])
            total = _s(s["init_s"] + s["first_step_s"])
        else:
            total = why or "—"
        if r:
            ms = f"{r['step_ms']:.1f}"
        elif s:
            ms = why or "—"
        mx_r = row["mxnet"] and row["mxnet"].get("result")
        mine = not row["name"].startswith("MXNet")
        ratio = f"{mx_r['step_ms'] / r['step_ms']:.2f}x" if r and mx_r and mine else ""
        peak, above = _peak(row, data["set"])
        chk = row["check"]
        model_cell = "—"
        if chk["model"] is not None:
            after = "last" if len(chk["steps"]) > 1 else "first step only"
            model_cell = f"{chk['model']:.1e} ({after})"
        vs = "" if row["vs_mxnet"] is None else f"{row['vs_mxnet']:.1e}"
        agree = "—" if chk["agree"] is None else ("yes" if chk["agree"] else "NO")
        lines.append(
            f"| {store} | {row['name']} | {total} | {init} | {first} | {_compiles(s, r)} | "
            f"{ms} | {ratio} | {peak} | {above} | {model_cell} | {vs} | {agree} |"
        )
    lines += [
        "",
        "dist_sync: P x D is P processes on this machine, each with D devices of its own; "
        "MXNet's store lives in P server processes (started with a scheduler, as "
        "benchmarks/dist.py does), jaxkv's in the workers (started by "
        "`python -m jaxkv.launch`). Times and peak RSS are rank 0's.",
    ]
    return lines


def processes_lines(sec: dict) -> list[str]:
    """The Gluon loop's rows of the "many processes" section: per process count, jaxkv's
    dist_sync step (its first layout) beside MXNet's, and each one's steps' peak RSS."""
    one = sec["data"]["set"]
    by_p: dict[int, dict[str, dict]] = {}
    first = f"jaxkv, JAXKV_LAYOUT={layouts()[0]}"
    for row in sec["rows"]:
        if (
            row["kv"] == "dist_sync"
            and row["devices"] == 1
            and row["name"] in (first, "MXNet 1.9.1")
        ):
            by_p.setdefault(row["processes"], {})[row["name"]] = row
    if not by_p:
        return []
    lines = [
        "The Gluon/Module loop across processes (the section below: ResNet-50's 193 tensors, "
        "SGD with momentum on the store, `kv.push(i, grads)` then `kv.pull(i, out=weights)` "
        f"key by key), `dist_sync` in P processes of one CPU device each: jaxkv ({first}, "
        "gloo, `python -m jaxkv.launch`) beside MXNet 1.9.1 (P workers, P servers). Steady "
        "step: rank 0's median; steps' peak RSS: rank 0's, and over the data a worker must "
        "hold (its out and gradient of every key, and for jaxkv the stored weights and "
        "momentum, counted whole); state: the stored weights and momentum on rank 0's devices "
        "(MXNet's workers hold none: its P servers hold 1/P each); sent: the bytes rank 0 "
        "wrote per timed step, sockets included (`/proc/self/io`'s wchar, which counts gloo's "
        "writes; MXNet's ps-lite sends through ZeroMQ's `send` calls, which it does not count: "
        "an MXNet worker pushes every gradient, 97.6 MB a step, whatever P). jaxkv's collectives "
        "are not counted here (its held calls run as several computations a step).",
        "",
        "| processes | jaxkv ms/step | MXNet ms/step | MXNet / jaxkv | jaxkv steps' peak RSS MB "
        "(over data) | MXNet worker's (over data) | jaxkv state MB / process (of the store) | "
        "jaxkv MB sent / step / process | jaxkv values vs model |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(by_p):
        mine, theirs = by_p[p].get(first), by_p[p].get("MXNet 1.9.1")

        def ms(row: dict | None) -> float | None:
            r = row and row["res"] and row["res"].get("result")
            return r["step_ms"] if r else None

        def rss(row: dict | None) -> str:
            if row is None:
                return "—"
            res = row["res"]
            s, r = res and res.get("startup"), res and res.get("result")
            if not (s and r):
                return _outcome(res) or "—"
            steps = r.get("steps_peak") or r["maxrss"]
            return f"{steps / 1e6:.0f} ({(steps - s['base_rss']) / held_bytes(row, one):.2f}x)"

        def result(row: dict | None, field: str) -> float | None:
            r = row and row["res"] and row["res"].get("result")
            return r.get(field) if r else None

        a, b = ms(mine), ms(theirs)
        chk = mine["check"]["model"] if mine else None
        held = result(mine, "state_bytes")
        store = 2 * one  # the weights and SGD's momentum
        state = "—" if held is None else f"{held / 2**20:.1f} ({held / store:.3f})"
        sent = result(mine, "sent_per_step")
        sent_cell = "—" if sent is None else f"{sent / 2**20:.1f}"
        lines.append(
            f"| {p} | {_s_ms(a, mine)} | {_s_ms(b, theirs)} | "
            f"{f'{b / a:.2f}x' if a and b else ''} | {rss(mine)} | {rss(theirs)} | {state} | "
            f"{sent_cell} | {'—' if chk is None else f'{chk:.1e}'} |"
        )
    return lines


def _s_ms(x: float | None, row: dict | None) -> str:
    if x is not None:
        return f"{x:.1f}"
    return (_outcome(row["res"]) if row else None) or "—"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["jaxkv"], help=argparse.SUPPRESS)
    parser.add_argument("--kv", default="device", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=D, help=argparse.SUPPRESS)
    parser.add_argument("--scale", type=int, default=1, help="divide every dimension by this")
    parser.add_argument("--keys", type=int, help="take only the first N keys")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="start-up limit, s")
    parser.add_argument("--mem-gb", type=float, help="memory limit of one side's processes")
    parser.add_argument("--dist-devices", type=int, nargs="*", default=[1])
    parser.add_argument("--dist-processes", type=int, nargs="*", default=[PROCESSES])
    args = parser.parse_args()
    if args.side == "jaxkv":
        jaxkv_side(args)
        return
    sec = run_section(
        args.scale,
        args.keys,
        args.steps,
        args.timeout,
        args.mem_gb,
        tuple(args.dist_devices),
        dist_processes=tuple(args.dist_processes),
    )
    print("\n".join([*report(sec), "", *processes_lines(sec)]), flush=True)


if __name__ == "__main__":
    main()
