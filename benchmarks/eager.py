"""The benchmark's eager sections: SGD push + pull on one device, jaxkv beside hand-written JAX."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import jaxkv
import jaxkv.mx as mx

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = os.path.join(HERE, "data", "resnet50_shapes.json")  # ResNet-50 v1's 193 tensors
LR = 0.01
STEPS = 200  # timed steps per row and round, at most (see BUDGET_S)
ROUNDS = 3
WARMUP = 3  # untimed steps per row first: the first two compile (the second sees the first's)
CHECK_STEPS = 5  # steps of the value check, from random values with random gradients
# The largest |difference| from the hand-written values that is "ok", relative to the largest
# |value| (at least 1): about 80 float32 roundings, for updaters that fuse or round differently.
TOLERANCE = 1e-5
FORCE_ENV = "JAXKV_BENCH_GPU_ON_CPU"  # =1: the GPU section runs on CPU device 0 (to test it)
FORCED_STEPS = 10  # timed steps per round of the GPU section forced onto CPU

HAND = "hand-written jit"
FUNCTIONAL = "jaxkv functional"
IMPERATIVE = "jaxkv imperative"
TORCH = "torch foreach"
FLOOR = "copy floor"
# Each jaxkv row's goal: at most this many times the hand-written row's ms/step (issue 48's
# "eager host cost": <= 1.2x for the functional and the imperative store alike).
GOALS = {
    "proxy": {FUNCTIONAL: 1.2, IMPERATIVE: 1.2},
    "gpu": {FUNCTIONAL: 1.2, IMPERATIVE: 1.2},
}
# Seconds of timed steps one key set may take (all rows, all rounds): where the rows are slow,
# fewer steps than STEPS are timed (never fewer than MIN_STEPS), so a section's time is bounded.
BUDGET_S = {"proxy": 30.0, "gpu": 12.0}
MIN_STEPS = 20

Step = Callable[[], None]
Values = Callable[[], list]


def _resnet50() -> list[tuple[int, ...]]:
    with open(SHAPES) as f:
        return [tuple(s) for s in json.load(f)]


def cut(shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The same keys with every dimension cut to at most 2 (so at most 16 elements each)."""
    return [tuple(min(d, 2) for d in s) for s in shapes]


def key_sets(section: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(name, shapes) of the two key sets: full size on an accelerator, cut for the proxy."""
    full = [("resnet50", _resnet50()), ("1000 x 16x16", [(16, 16)] * 1000)]
    if section == "gpu":
        return full
    return [("resnet50 cut", cut(full[0][1])), ("1000 x 2x2", cut(full[1][1]))]


# -- rows: each builder takes numpy initial values and gradients, and returns (step, values) ---
@jax.jit
def _copy(params):
    return jax.tree.map(lambda w: w + 0, params)


_update = jax.jit(lambda p, g: jax.tree.map(lambda w, g: w - LR * g, p, g), donate_argnums=0)


def hand_written(dev: jax.Device, init: list, grads: list) -> tuple[Step, Values]:
    """A jitted tree update ``w - lr * g`` (params donated), a jitted copy of the result out,
    then ``block_until_ready``: what a JAX user writes instead of a store."""
    box = [[jax.device_put(x, dev, may_alias=False) for x in init]]  # donated: never numpy's
    g = [jax.device_put(x, dev) for x in grads]

    def step():
        box[0] = _update(box[0], g)
        jax.block_until_ready(_copy(box[0]))

    return step, lambda: box[0]


def functional(dev: jax.Device, init: list, grads: list) -> tuple[Step, Values]:
    """``jaxkv.pushpull`` with ``optax.sgd`` on a store over ``[dev]``; gradients already on
    ``dev``; waits for the pulled values; each step's state is the next one's."""
    keys = list(range(len(init)))
    sgd = optax.sgd(LR)
    box = [jaxkv.init(jaxkv.empty([dev]), keys, [jax.device_put(x, dev) for x in init])]
    g = [jax.device_put(x, dev) for x in grads]

    def step():
        box[0], pulled = jaxkv.pushpull(box[0], keys, g, updater=sgd, devices=[dev])
        jax.block_until_ready(pulled)

    return step, lambda: jaxkv.pull(box[0], keys)


def imperative(dev: jax.Device, init: list, grads: list) -> tuple[Step, Values]:
    """MXNet's API through ``jaxkv.mx``: a ``device`` store over ``dev``'s context
    (``mx.cpu(0)``, ``mx.gpu(0)``) with ``set_optimizer(optax.sgd)``, ``kv.push`` of every key,
    ``kv.pull`` into NDArrays, ``mx.nd.waitall()``.

    The store is made with ``mx.kv.KVStore('device', devices=[ctx])``: ``create('device')``
    spans every local device of JAX's default backend (8 simulated CPU devices in bench.py)."""
    keys = list(range(len(init)))
    ctx = mx.Context.from_device(dev)
    kv = mx.kv.KVStore("device", devices=[ctx])
    kv.init(keys, [mx.nd.array(x, ctx) for x in init])
    kv.set_optimizer(optax.sgd(LR))
    g = [mx.nd.array(x, ctx) for x in grads]
    outs = [mx.nd.zeros(x.shape, ctx) for x in init]

    def step():
        kv.push(keys, g)
        kv.pull(keys, out=outs)
        mx.nd.waitall()

    return step, lambda: [o.asnumpy() for o in outs]


def _torch(dev: jax.Device) -> tuple[Any, Any, str]:
    """(torch, torch device, "") where the torch row can run beside ``dev``, else
    (None, None, why not). On a CPU device (the forced GPU section) it runs on torch's CPU."""
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:
        return None, None, f"torch is not importable ({e})"
    if dev.platform == "cpu":
        return torch, torch.device("cpu"), ""
    if dev.platform != "gpu":
        return None, None, f"torch has no {dev.platform} backend"
    if not torch.cuda.is_available():
        return None, None, f"torch {torch.__version__} has no CUDA"
    return torch, torch.device("cuda", getattr(dev, "local_hardware_id", None) or 0), ""


def torch_foreach(torch: Any, tdev: Any) -> Callable[[list, list], tuple[Step, Values]]:
    """The PyTorch row's builder: ``torch._foreach_add_(params, grads, alpha=-lr)``,
    ``torch._foreach_copy_(outs, params)``, then ``torch.cuda.synchronize()``."""

    def build(init: list, grads: list) -> tuple[Step, Values]:
        params = [torch.tensor(x, device=tdev) for x in init]
        g = [torch.tensor(x, device=tdev) for x in grads]
        outs = [torch.zeros(x.shape, device=tdev) for x in init]

        def step():
            torch._foreach_add_(params, g, alpha=-LR)
            torch._foreach_copy_(outs, params)
            if tdev.type == "cuda":
                torch.cuda.synchronize()

        return step, lambda: [p.cpu().numpy() for p in params]

    return build


def copy_bandwidth(dev: jax.Device, reps: int = 10) -> float:
    """GB/s of a jitted elementwise op over one big buffer on ``dev`` (bytes read + written),
    the best of ``reps``: 256 MB on an accelerator, 64 MB on a CPU. The buffer is donated, so
    the op writes where it reads (a fresh output buffer would cost a CPU its page faults)."""
    n = (64 if dev.platform == "cpu" else 256) * 2**20 // 4
    box = [jax.device_put(np.ones(n, np.float32), dev, may_alias=False)]
    nbytes = box[0].nbytes
    op = jax.jit(lambda x: x * 1.0000001, donate_argnums=0)

    def step():
        box[0] = op(box[0])
        jax.block_until_ready(box[0])

    step()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return 2 * nbytes / min(times) / 1e9


# -- timing -------------------------------------------------------------------------------------
def reason(e: BaseException) -> str:
    """Why a row failed, in one line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def time_rows(rows: dict[str, Step], counter, steps: int, least: int, budget: float, log) -> dict:
    """Times ``rows``: ``ROUNDS`` rounds of ``steps`` steps each, the rows interleaved step by
    step (the order alternating), so a shared machine's drifting load falls on every row alike.

    Each row first takes ``WARMUP`` untimed steps; where their last steps say the rounds would
    take over ``budget`` seconds, fewer steps are timed (at least ``least``). Returns
    {"rows": {name: {"ms", "rounds", "compiles"}}, "skipped": {name: reason}, "steps"}: "ms" is
    the best round's median ms/step; "compiles" counts the timed steps' XLA compilations
    (``counter``: bench.CompileCounter)."""
    skipped: dict[str, str] = {}
    live: dict[str, Step] = {}
    per_step = 0.0  # seconds of one step of every row, from the last warm-up steps
    for name, step in rows.items():
        try:
            t0 = time.perf_counter()
            for _ in range(WARMUP):
                t = time.perf_counter()
                step()
            per_step += time.perf_counter() - t
            live[name] = step
            log(f"    {name}: warm-up ({WARMUP} steps, compiles) {time.perf_counter() - t0:.2f} s")
        except Exception as e:  # a failing row is a finding: reported, never timed
            skipped[name] = reason(e)
            log(f"    {name}: FAILED {skipped[name]}")
    fit = int(budget / max(per_step * ROUNDS, 1e-9))
    steps = max(min(steps, fit), min(steps, least))
    times: dict[str, list[float]] = {n: [] for n in live}
    compiles = dict.fromkeys(live, 0)
    with counter() as c:
        for r in range(ROUNDS):
            samples: dict[str, list[float]] = {n: [] for n in live}
            for i in range(steps):
                order = list(live)
                for name in order if i % 2 == 0 else order[::-1]:
                    before = c.count
                    try:
                        t = time.perf_counter()
                        live[name]()
                        samples[name].append(time.perf_counter() - t)
                    except Exception as e:
                        skipped[name] = reason(e)
                        log(f"    {name}: FAILED {skipped[name]}")
                        del live[name], times[name]
                        continue
                    compiles[name] += c.count - before
            for name in live:
                times[name].append(float(np.median(samples[name]) * 1e3))
            log(
                f"    round {r + 1}/{ROUNDS}, {steps} steps each: "
                + ", ".join(f"{n} {times[n][-1]:.3f} ms" for n in live)
            )
    timed = {
        name: {"ms": min(times[name]), "rounds": times[name], "compiles": compiles[name]}
        for name in live
    }
    return {"rows": timed, "skipped": skipped, "steps": steps}


def check_values(builders: dict[str, Callable], shapes: list, log) -> dict[str, Any]:
    """Every row's values after ``CHECK_STEPS`` steps from the same random values with the same
    random gradients, each row built afresh: {name: {"max_diff": the largest |difference| from
    the hand-written row's values, "ok": within TOLERANCE}, or why it could not be compared}."""
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    grads = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    got: dict[str, Any] = {}
    for name, build in builders.items():
        try:
            step, values = build(init, grads)
            for _ in range(CHECK_STEPS):
                step()
            got[name] = [np.asarray(v) for v in values()]
        except Exception as e:
            got[name] = f"failed: {reason(e)}"
    return compare(got, HAND, log)


def compare(got: dict[str, Any], hand: str, log) -> dict[str, Any]:
    """Each row's values in ``got`` (a list of arrays, or why there are none) against row
    ``hand``'s: {name: {"max_diff": the largest |difference|, "ok": within TOLERANCE of the
    largest |value|}, or why it could not be compared}; logged."""
    ref = got.get(hand)
    out: dict[str, Any] = {}
    for name, vals in got.items():
        if name == hand:
            continue
        if isinstance(vals, str) or not isinstance(ref, list):
            out[name] = vals if isinstance(vals, str) else f"no hand-written values ({ref})"
        else:
            diff = max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(vals, ref))
            scale = max([1.0] + [float(np.max(np.abs(b), initial=0.0)) for b in ref])
            out[name] = {"max_diff": diff, "ok": diff <= TOLERANCE * scale}
    log(
        f"    values after {CHECK_STEPS} steps vs {hand}: "
        + ", ".join(f"{n} {values_text(v)}" for n, v in out.items())
    )
    return out


def values_text(check: Any) -> str:
    """A row's value check as printed: "values ok" or the largest difference."""
    if check is None:
        return ""
    if isinstance(check, str):
        return f"values not checked: {check}"
    diff = check["max_diff"]
    if check["ok"]:
        return "values ok" + (f" (max |diff| {diff:.1e})" if diff else "")
    return f"VALUES DIFFER: max |diff| {diff:.3g}"


# -- the sections ------------------------------------------------------------------------------
def _device(section: str) -> tuple[jax.Device | None, bool, str]:
    """(device, forced onto CPU, why skipped) for a section."""
    if section == "proxy":
        return jax.devices("cpu")[0], False, ""
    if jax.default_backend() != "cpu":
        return jax.devices()[0], False, ""
    if os.environ.get(FORCE_ENV) == "1":
        return jax.devices("cpu")[0], True, ""
    why = f"no accelerator (JAX's default backend is cpu; {FORCE_ENV}=1 runs it on CPU device 0)"
    return None, False, why


def run(section: str, counter, steps: int | None = None, log=print) -> dict:
    """One section, ``'proxy'`` or ``'gpu'``, with every row timed on both key sets.

    proxy: CPU device 0, key sets cut to at most 16 elements per key, so the rows measure the
      host's and the per-buffer cost alone; rows: hand-written, jaxkv functional, imperative.
    gpu: the accelerator's first device (skipped where JAX's default backend is cpu, unless
      ``JAXKV_BENCH_GPU_ON_CPU=1``), the full key sets; the rows above, PyTorch's foreach ops
      and the copy floor (5 passes over the bytes at :func:`copy_bandwidth`'s GB/s).
    """
    dev, forced, why = _device(section)
    res: dict[str, Any] = {"section": section, "sets": [], "goals": GOALS[section]}
    if dev is None:
        res["skipped"] = why
        return res
    steps = steps or (FORCED_STEPS if forced else STEPS)
    res.update(device=str(dev), platform=dev.platform, device_kind=dev.device_kind, forced=forced)
    builders: dict[str, Callable] = {
        HAND: lambda i, g: hand_written(dev, i, g),
        FUNCTIONAL: lambda i, g: functional(dev, i, g),
        IMPERATIVE: lambda i, g: imperative(dev, i, g),
    }
    not_run: dict[str, str] = {}
    bw = None
    log(
        f"[{section}] on {dev} (device kind {dev.device_kind})"
        + (f", forced onto CPU by {FORCE_ENV}=1" if forced else "")
    )
    if section == "gpu":
        torch, tdev, why = _torch(dev)
        if torch is None:
            not_run[TORCH] = why
            log(f"  {TORCH}: not run: {why}")
        else:
            builders[TORCH] = torch_foreach(torch, tdev)
            res["torch"] = f"torch {torch.__version__} on {tdev}"
        log(f"  copy bandwidth of {dev} ...")
        bw = copy_bandwidth(dev)
        log(f"    {bw:.1f} GB/s")
        res["bandwidth"] = bw
    for name, shapes in key_sets(section):
        nbytes = 4 * sum(int(np.prod(s)) for s in shapes)
        log(f"  [{section}] {name}: {len(shapes)} keys, {nbytes / 1e6:.3f} MB ...")
        init = [np.zeros(s, np.float32) for s in shapes]
        grads = [np.ones(s, np.float32) for s in shapes]
        rows: dict[str, Step] = {}
        broken: dict[str, str] = dict(not_run)
        for row, build in builders.items():
            try:
                rows[row] = build(init, grads)[0]
            except Exception as e:
                broken[row] = reason(e)
                log(f"    {row}: FAILED {broken[row]}")
        timed = time_rows(rows, counter, steps, MIN_STEPS, BUDGET_S[section], log)
        del rows
        checked = {n: b for n, b in builders.items() if n in timed["rows"]}
        kset = {
            "name": name,
            "keys": len(shapes),
            "MB": nbytes / 1e6,
            "steps": timed["steps"],
            "rows": timed["rows"],
            "skipped": {**broken, **timed["skipped"]},
            "values": check_values(checked, shapes, log),
        }
        if bw:
            kset["floor"] = 5 * nbytes / (bw * 1e9) * 1e3
        res["sets"].append(kset)
    return res


def failed(res: dict) -> bool:
    """Whether a hand-written or jaxkv row failed, or a jaxkv row's values differ."""
    for s in res["sets"]:
        if any(n in s["skipped"] for n in (HAND, FUNCTIONAL, IMPERATIVE)):
            return True
        for name in (FUNCTIONAL, IMPERATIVE):
            check = s["values"].get(name)
            if not isinstance(check, dict) or not check["ok"]:
                return True
    return False


# -- output ------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None else f"{a / b:.2f}x"


_VS = {"hand": "hand-written", "torch": "torch", "floor": "floor"}


def _table(s: dict) -> list[dict]:
    """One dict per row of a key set: name, ms, rounds, compiles, the ratios, values."""
    hand = s["rows"].get(HAND, {}).get("ms")
    torch = s["rows"].get(TORCH, {}).get("ms")
    out = []
    for name in (HAND, FUNCTIONAL, IMPERATIVE, TORCH):
        r = s["rows"].get(name)
        if r is None:
            if name in s["skipped"]:
                out.append({"name": name, "not run": s["skipped"][name]})
            continue
        jk = name in (FUNCTIONAL, IMPERATIVE)
        out.append(
            {
                "name": name,
                "ms": r["ms"],
                "rounds": r["rounds"],
                "compiles": r["compiles"],
                "hand": _ratio(r["ms"], hand),
                "torch": _ratio(r["ms"], torch) if jk else "",
                "floor": _ratio(r["ms"], s.get("floor")) if jk else "",
                "values": values_text(s["values"].get(name)) if name != HAND else "reference",
            }
        )
    if "floor" in s:
        out.append(
            {
                "name": FLOOR,
                "ms": s["floor"],
                "rounds": [],
                "compiles": "",
                "hand": "",
                "torch": "",
                "floor": "1.00x",
                "values": "",
            }
        )
    return out


def goals(res: dict) -> list[str]:
    """Each goal (a jaxkv row at most so many times the hand-written row) with its status."""
    lines = []
    for s in res["sets"]:
        hand = s["rows"].get(HAND)
        for name, limit in res["goals"].items():
            r = s["rows"].get(name)
            goal = f"{s['name']}: {name} <= {limit}x {HAND}"
            if r is None or hand is None:
                lines.append(f"{goal}: not measured")
                continue
            ratio = r["ms"] / hand["ms"]
            lines.append(f"{goal}: {ratio:.2f}x, {'met' if ratio <= limit else 'MISSED'}")
    return lines


def where(res: dict) -> str:
    """Where a section ran, in words."""
    if "skipped" in res:
        return f"skipped: {res['skipped']}"
    forced = f", forced onto CPU by {FORCE_ENV}=1" if res["forced"] else ""
    extra = f", copy bandwidth {res['bandwidth']:.1f} GB/s" if "bandwidth" in res else ""
    extra += f", {res['torch']}" if "torch" in res else ""
    return f"{res['device']} (device kind {res['device_kind']}){forced}{extra}"


def lines(res: dict) -> list[str]:
    """The section's result lines: where it ran, one line per row and key set, the goals."""
    out = [f"[{res['section']}] {where(res)}"]
    for s in res["sets"]:
        label = f"{s['name']} ({s['keys']} keys, {s['MB']:.3f} MB)"
        for r in _table(s):
            if "not run" in r:
                out.append(f"{label:<36} {r['name']:<18} not run: {r['not run']}")
                continue
            ratios = "  ".join(
                f"{r[k]} {_VS[k]}" for k in ("hand", "torch", "floor") if r[k] and r["name"] != HAND
            )
            compiles = f"compiles {r['compiles']}" if r["compiles"] != "" else ""
            out.append(
                f"{label:<36} {r['name']:<18} {r['ms']:9.3f} ms  {ratios:<46} {compiles:<11} "
                f"{r['values'] if r['values'] != 'reference' else ''}".rstrip()
            )
    out += [f"goal: {g}" for g in goals(res)]
    return out


TITLES = {
    "proxy": "CPU proxy: SGD push + pull on one CPU device",
    "gpu": "GPU: SGD push + pull on the accelerator's first device",
}
ABOUT = {
    "proxy": (
        "ResNet-50's 193 keys and 1000 keys of 16x16 with every dimension cut to at most 2 (at "
        "most 16 elements a key), so what is timed is the host's work and the per-buffer cost "
        "alone."
    ),
    "gpu": (
        "ResNet-50's 193 tensors (25.6M float32) and 1000 keys of 16x16. PyTorch: "
        "`torch._foreach_add_(params, grads, alpha=-lr)`, `torch._foreach_copy_(outs, params)`, "
        "`torch.cuda.synchronize()`. Copy floor: 5 passes over the bytes (read w and g, write "
        "w, read w, write the copy) at the GB/s of a jitted elementwise op over one big buffer."
    ),
}


def report(res: dict) -> list[str]:
    """The section's part of results.md: what it measures, a table, the goals."""
    title = TITLES[res["section"]]
    if "skipped" in res:
        return [f"{title}: {where(res)}."]
    lines_ = [
        f"{title}: {where(res)}. {ABOUT[res['section']]} Rows: {HAND} (one jitted tree update "
        "`w - lr * g` with the params donated, then a jitted copy `w + 0` of the result, then "
        "`block_until_ready`), jaxkv functional (`jaxkv.pushpull(state, keys, grads, "
        "updater=optax.sgd(lr), devices=[dev])`, each step's state kept, the pulled values "
        "waited for) and jaxkv imperative (`jaxkv.mx`: `mx.kv.KVStore('device', "
        "devices=[ctx])` over the device's context, `set_optimizer(optax.sgd(lr))`, "
        f"`kv.push`, `kv.pull(out=...)`, `mx.nd.waitall()`); lr = {LR}. ms/step: median of the "
        "steps of a round (the rows interleaved "
        f"step by step after {WARMUP} warm-up steps each), best of {ROUNDS} rounds; compiles: "
        "during the timed steps; values: each row's values after "
        f"{CHECK_STEPS} steps from the same random values and gradients, against the "
        "hand-written row's.",
        "",
        "| key set | row | steps | ms/step | / hand-written | / torch | / floor | compiles | "
        "values | " + " | ".join(f"round {i + 1} ms" for i in range(ROUNDS)) + " |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * ROUNDS,
    ]
    for s in res["sets"]:
        label = f"{s['name']} ({s['keys']} keys, {s['MB']:.3f} MB)"
        for r in _table(s):
            if "not run" in r:
                cells = [label, r["name"], "", f"not run: {r['not run']}".replace("|", "/")]
                lines_.append("| " + " | ".join(cells + [""] * (5 + ROUNDS)) + " |")
                continue
            rounds = [f"{t:.3f}" for t in r["rounds"]] + [""] * (ROUNDS - len(r["rounds"]))
            cells = [label, r["name"], str(s["steps"]) if r["rounds"] else "", f"{r['ms']:.3f}"]
            cells += [r["hand"] if r["name"] != HAND else "1.00x", r["torch"], r["floor"]]
            cells += [str(r["compiles"]), r["values"].replace("|", "/"), *rounds]
            lines_.append("| " + " | ".join(cells) + " |")
    lines_.append("")
    lines_ += [f"- goal: {g}" for g in goals(res)]
    return lines_
