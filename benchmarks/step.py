"""The benchmark's step section: an in-jit training step on one device, jaxkv beside optax."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import eager  # benchmarks/eager.py: the key sets and the GPU section's CPU override
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxkv

# Timed and checked as the eager sections are (benchmarks/eager.py: time_rows, compare), with
# their rounds, warm-up, value-check steps and tolerance.
ROUNDS, WARMUP, CHECK_STEPS, TOLERANCE = (
    eager.ROUNDS,
    eager.WARMUP,
    eager.CHECK_STEPS,
    eager.TOLERANCE,
)
LR = {"adam": 1e-3, "sgd": 1e-2}
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(LR["adam"]),
    "sgd": lambda: optax.sgd(LR["sgd"]),
}

PROXY, FULL, ACCEL = "cpu proxy", "cpu full", "accelerator"
STEPS = {PROXY: 200, FULL: 20, ACCEL: 200}  # timed steps per row and round, at most
# Seconds of timed steps per key set and optimizer (all rows, all rounds): where the rows are
# slow, fewer steps are timed (never fewer than MIN_STEPS), so the section's time is bounded.
# The full-size CPU set's time goes mostly to compiling (about 5 to 12 s a row on 2 cores).
BUDGET_S = {PROXY: 20.0, FULL: 6.0, ACCEL: 8.0}
MIN_STEPS = {PROXY: 20, FULL: 5, ACCEL: 7}

HAND = "hand-written optax"
OFLAT = "optax.flatten(opt)"
VIEWS = "flat params + views"
PER_KEY = "jaxkv per key"
FLAT = "jaxkv flat"
AUTO = "jaxkv auto"
TORCH = {
    "adam": ("torch Adam(fused=True), step only", "torch Adam(foreach=True), step only"),
    "sgd": ("torch SGD(foreach=True), step only",),
}
JAX_ROWS = (HAND, OFLAT, VIEWS, PER_KEY, FLAT, AUTO)
JAXKV_ROWS = (PER_KEY, FLAT, AUTO)
NO_FLAT = "this jaxkv has no flat layout"
# (optimizer, row, baseline, at least this many times faster than the baseline) per key set.
GOALS = {
    PROXY: [("adam", FLAT, HAND, 4.0), ("sgd", FLAT, HAND, 2.0)],
    ACCEL: [
        ("adam", FLAT, HAND, 4.0),
        ("adam", FLAT, TORCH["adam"][0], 1.5),
        ("sgd", FLAT, HAND, 2.0),
        ("sgd", FLAT, TORCH["sgd"][0], 1.0),
    ],
}

Step = Callable[[], None]
Values = Callable[[], list]
# A row's builder: (initial values by key, check) -> (step, values). With check, a torch row's
# step computes its gradients by autograd first (timed, it steps with gradients already set).
Build = Callable[[dict, bool], tuple[Step, Values]]


def _loss(params, x):
    """The forward: reads every parameter, ``sum_k vdot(v_k, v_k) * x`` (AD gives ``2 x v_k``)."""
    return sum(jnp.vdot(v, v) for v in jax.tree.leaves(params)) * x


def _put(init: dict, dev: jax.Device) -> dict:
    return {k: jax.device_put(v, dev, may_alias=False) for k, v in init.items()}  # donated


def _runner(fn: Callable, box: list, x: jax.Array, values: Callable[[Any], list]):
    """(step, values) of a jitted step ``box = fn(*box, x)`` that waits for its result."""

    def step():
        out = fn(*box, x)
        box[:] = out if isinstance(out, tuple) else [out]
        jax.block_until_ready(box[0])

    return step, lambda: values(box[0])


# -- rows: each factory makes its jitted step once per key set, so the check reuses it --------
def hand_written(dev: jax.Device, opt: optax.GradientTransformation) -> Build:
    """optax over the dict of tensors: ``opt.update`` of AD's gradients, then
    ``optax.apply_updates``; params and optimizer state donated."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, x):
        u, s = opt.update(jax.grad(_loss)(p, x), s, p)
        return optax.apply_updates(p, u), s

    def build(init: dict, check: bool = False) -> tuple[Step, Values]:
        p = _put(init, dev)
        box = [p, jax.device_put(opt.init(p), dev)]
        return _runner(step, box, jax.device_put(jnp.float32(1.0), dev), lambda p: list(p.values()))

    return build


def optax_flatten(dev: jax.Device, opt: optax.GradientTransformation) -> Build:
    """``optax.flatten(opt)`` over the same dict (it ravels gradients and state inside)."""
    return hand_written(dev, optax.flatten(opt))


def flat_views(dev: jax.Device, opt: optax.GradientTransformation, shapes: list) -> Build:
    """A flat step by hand: the params in one buffer, the forward reading per-tensor views of it
    (static slices + reshapes, as ``ravel_pytree``'s unravel), AD's per-tensor gradients
    concatenated, the optimizer on the flat buffer."""
    sizes = [int(np.prod(s)) for s in shapes]
    offsets = np.cumsum([0, *sizes]).tolist()

    def unravel(fp):
        return [fp[o : o + n].reshape(s) for o, n, s in zip(offsets, sizes, shapes)]

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(fp, s, x):
        g = jnp.concatenate([jnp.ravel(t) for t in jax.grad(_loss)(unravel(fp), x)])
        u, s = opt.update(g, s, fp)
        return optax.apply_updates(fp, u), s

    def build(init: dict, check: bool = False) -> tuple[Step, Values]:
        flat = np.concatenate([np.ravel(v) for v in init.values()])
        fp = jax.device_put(flat, dev, may_alias=False)
        box = [fp, jax.device_put(opt.init(fp), dev)]
        return _runner(step, box, jax.device_put(jnp.float32(1.0), dev), _unflatten)

    def _unflatten(fp) -> list:
        host = np.asarray(fp)
        return [host[o : o + n].reshape(s) for o, n, s in zip(offsets, sizes, shapes)]

    return build


def flat_layout_reason() -> str:
    """'' where ``jaxkv.empty`` takes ``layout=``, else why the jaxkv flat row is not run."""
    try:
        params = inspect.signature(jaxkv.empty).parameters
    except (TypeError, ValueError):
        params = {}
    return "" if "layout" in params else NO_FLAT


def jaxkv_step(dev: jax.Device, opt: optax.GradientTransformation, layout: str | None) -> Build:
    """A jaxkv state over ``[dev]`` (``jaxkv.empty([dev], layout=layout)`` where ``layout``)
    with ``jaxkv.init_optimizer``; the jitted step pulls every key, takes AD's gradients of the
    loss and pushes them with ``updater=opt``; the state donated."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, x):
        p = {k: jaxkv.pull(state, k) for k in state.keys()}
        return jaxkv.push(state, jax.grad(_loss)(p, x), updater=opt)

    def build(init: dict, check: bool = False) -> tuple[Step, Values]:
        empty = jaxkv.empty([dev]) if layout is None else jaxkv.empty([dev], layout=layout)
        state = jaxkv.init_optimizer(jaxkv.init(empty, _put(init, dev)), opt)
        values = lambda s: [np.asarray(v) for v in jaxkv.pull(s, list(init))]
        return _runner(step, [state], jax.device_put(jnp.float32(1.0), dev), values)

    return build


def _torch(dev: jax.Device) -> tuple[Any, Any, str]:
    """(torch, torch device, "") where the torch rows can run beside ``dev`` (CPU tensors on a
    CPU device, CUDA tensors on a GPU), else (None, None, why not)."""
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


def torch_step(torch: Any, tdev: Any, row: str, lr: float) -> Build:
    """A torch optimizer over the tensors: timed, ``opt.step()`` alone with the gradients
    already set (AD's gradients at the start), then ``torch.cuda.synchronize()`` on CUDA; for
    the check, each step first sets the gradients by autograd of the same loss."""
    make = {
        TORCH["adam"][0]: lambda p: torch.optim.Adam(p, lr=lr, fused=True),
        TORCH["adam"][1]: lambda p: torch.optim.Adam(p, lr=lr, foreach=True),
        TORCH["sgd"][0]: lambda p: torch.optim.SGD(p, lr=lr, foreach=True),
    }[row]

    def sync():
        if tdev.type == "cuda":
            torch.cuda.synchronize(tdev)

    def build(init: dict, check: bool = False) -> tuple[Step, Values]:
        params = [torch.tensor(v, device=tdev, requires_grad=True) for v in init.values()]
        opt = make(params)
        for p in params:
            p.grad = 2 * p.detach()
        opt.step()  # fails here where this torch cannot run the optimizer on tdev
        sync()
        if check:  # start again from the initial values, gradients by autograd
            params = [torch.tensor(v, device=tdev, requires_grad=True) for v in init.values()]
            opt = make(params)

        def step():
            if check:
                opt.zero_grad()
                (sum((p * p).sum() for p in params) * 1.0).backward()
            opt.step()
            sync()

        return step, lambda: [p.detach().cpu().numpy() for p in params]

    return build


# -- timing -------------------------------------------------------------------------------------
def check_values(builders: dict[str, Build], init: dict, log) -> dict[str, Any]:
    """Every row's parameters after ``CHECK_STEPS`` steps from ``init``, each row built afresh:
    {name: {"max_diff": the largest |difference| from the hand-written row's, "ok": within
    TOLERANCE}, or why it could not be compared}."""
    got: dict[str, Any] = {}
    for name, build in builders.items():
        try:
            step, values = build(init, True)
            for _ in range(CHECK_STEPS):
                step()
            got[name] = [np.asarray(v) for v in values()]
        except Exception as e:
            got[name] = f"failed: {eager.reason(e)}"
    return eager.compare(got, HAND, log)


# -- the section -------------------------------------------------------------------------------
def _device(name: str) -> tuple[jax.Device | None, bool, str]:
    """(device, forced onto CPU, why skipped) for a key set."""
    if name != ACCEL:
        return jax.devices("cpu")[0], False, ""
    if jax.default_backend() != "cpu":
        return jax.devices()[0], False, ""
    if os.environ.get(eager.FORCE_ENV) == "1":
        return jax.devices("cpu")[0], True, ""
    why = f"no accelerator (JAX's default backend is cpu; {eager.FORCE_ENV}=1 runs it on CPU 0)"
    return None, False, why


def _shapes(name: str) -> list[tuple[int, ...]]:
    full = eager.key_sets("gpu")[0][1]  # ResNet-50's 193 tensors
    return eager.cut(full) if name == PROXY else full


def run(counter, steps: int | None = None, log=print) -> dict:
    """The section: every row with adam and with sgd on three key sets.

    cpu proxy: CPU device 0, ResNet-50's 193 tensors with every dimension cut to at most 2, so
      the rows time the per-tensor cost of the step alone. cpu full: CPU device 0, the full
      tensors (25.6M float32). accelerator: the accelerator's first device, the full tensors
      (skipped where JAX's default backend is cpu, unless ``JAXKV_BENCH_GPU_ON_CPU=1``).

    ``steps``: timed steps per round of the proxy and accelerator sets (the budget may take
    fewer). Returns {"sets": [...]} for :func:`lines`, :func:`report` and :func:`failed`."""
    flat_why = flat_layout_reason()
    sets = []
    for name in (PROXY, FULL, ACCEL):
        dev, forced, why = _device(name)
        if dev is None:
            log(f"[step] {name}: skipped: {why}")
            sets.append({"name": name, "skipped": why})
            continue
        shapes = _shapes(name)
        nbytes = 4 * sum(int(np.prod(s)) for s in shapes)
        s: dict[str, Any] = {
            "name": name,
            "device": str(dev),
            "device_kind": dev.device_kind,
            "forced": forced,
            "keys": len(shapes),
            "MB": nbytes / 1e6,
            "opts": {},
        }
        torch, tdev, torch_why = _torch(dev)
        s["torch"] = torch_why or f"torch {torch.__version__} on {tdev}"
        log(
            f"[step] {name}: {dev} (device kind {dev.device_kind})"
            + (f", forced onto CPU by {eager.FORCE_ENV}=1" if forced else "")
            + f", {len(shapes)} tensors, {nbytes / 1e6:.3f} MB; {s['torch']}"
        )
        rng = np.random.default_rng(0)
        init = {k: rng.standard_normal(sh, dtype=np.float32) for k, sh in enumerate(shapes)}
        kind = FULL if forced else name  # forced onto CPU: timed as the full CPU set
        n = STEPS[FULL] if kind == FULL else (steps or STEPS[kind])
        for oname, make in OPTIMIZERS.items():
            opt = make()
            builders: dict[str, Build] = {
                HAND: hand_written(dev, opt),
                OFLAT: optax_flatten(dev, opt),
                VIEWS: flat_views(dev, opt, shapes),
                PER_KEY: jaxkv_step(dev, opt, "keys" if not flat_why else None),
            }
            broken: dict[str, str] = {}
            if flat_why:
                broken[FLAT] = broken[AUTO] = flat_why
            else:
                builders[FLAT] = jaxkv_step(dev, opt, "flat")
                builders[AUTO] = jaxkv_step(dev, opt, "auto")
            if torch is not None:
                for row in TORCH[oname]:
                    builders[row] = torch_step(torch, tdev, row, LR[oname])
            log(f"  [step] {name} {oname} ({len(builders)} rows) ...")
            if flat_why:
                log(f"    {FLAT}: not run: {flat_why}")
            rows: dict[str, Step] = {}
            for row, build in builders.items():
                try:
                    rows[row] = build(init, False)[0]
                except Exception as e:  # e.g. torch's fused Adam where this torch has none
                    broken[row] = eager.reason(e)
                    log(f"    {row}: not run: {broken[row]}")
            timed = eager.time_rows(rows, counter, n, MIN_STEPS[kind], BUDGET_S[kind], log)
            del rows
            checked = {r: b for r, b in builders.items() if r in timed["rows"]}
            s["opts"][oname] = {
                "steps": timed["steps"],
                "rows": timed["rows"],
                "skipped": {**broken, **timed["skipped"]},
                "values": check_values(checked, init, log),
            }
        sets.append(s)
    return {"sets": sets}


def failed(res: dict) -> bool:
    """Whether the hand-written or a jaxkv row failed (the flat row not run because this jaxkv
    has no flat layout is not a failure), or a jaxkv row's values differ."""
    for s in res["sets"]:
        for o in s.get("opts", {}).values():
            for name in (HAND, *JAXKV_ROWS):
                if name in o["skipped"] and o["skipped"][name] != NO_FLAT:
                    return True
            for name in JAXKV_ROWS:
                check = o["values"].get(name)
                if name in o["rows"] and (not isinstance(check, dict) or not check["ok"]):
                    return True
    return False


# -- output ------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None else f"{a / b:.2f}x"


def _row_names(oname: str) -> tuple[str, ...]:
    return (*JAX_ROWS, *TORCH[oname])


def goals(res: dict) -> list[str]:
    """Each goal that applies with its status (a row at least so many times faster than a
    baseline: baseline ms / row ms), and the full CPU set's jaxkv per key beside flat."""
    out = []
    for s in res["sets"]:
        if "skipped" in s:
            continue
        forced = " (forced onto CPU)" if s["forced"] else ""
        for oname, row, base, limit in GOALS.get(s["name"], []):
            o = s["opts"][oname]
            than = f">= {limit:g}x faster than" if limit != 1 else "no slower than"
            goal = f"{s['name']}{forced} {oname}: {row} {than} {base}"
            r, b = o["rows"].get(row), o["rows"].get(base)
            if r is None or b is None:
                why = "; ".join(
                    f"{n}: {o['skipped'].get(n, 'not run')}"
                    for n in (row, base)
                    if n not in o["rows"]
                )
                out.append(f"{goal}: not measured ({why})")
                continue
            ratio = b["ms"] / r["ms"]
            out.append(f"{goal}: {ratio:.2f}x, {'met' if ratio >= limit else 'MISSED'}")
        if s["name"] == FULL:
            for oname, o in s["opts"].items():
                per, flat, auto = (o["rows"].get(n) for n in (PER_KEY, FLAT, AUTO))
                both = [
                    f"{n} " + (f"{r['ms']:.1f} ms" if r else f"not run ({o['skipped'].get(n, '')})")
                    for n, r in ((PER_KEY, per), (FLAT, flat), (AUTO, auto))
                ]
                if per and auto:
                    ratio = auto["ms"] / per["ms"]
                    status = "met" if ratio <= 1.05 else "MISSED"
                    verdict = f"auto / per key {ratio:.2f}x (goal <= 1.05x): {status}"
                else:
                    verdict = "auto / per key: not measured"
                out.append(f"{s['name']} {oname}: {', '.join(both)}; {verdict}")
    return out


def where(s: dict) -> str:
    """Where a key set ran, in words."""
    if "skipped" in s:
        return f"skipped: {s['skipped']}"
    forced = f", forced onto CPU by {eager.FORCE_ENV}=1" if s["forced"] else ""
    return (
        f"{s['device']} (device kind {s['device_kind']}){forced}, {s['keys']} tensors, "
        f"{s['MB']:.3f} MB; {s['torch']}"
    )


def _table(s: dict, oname: str) -> list[dict]:
    """One dict per row of a key set and optimizer: name, ms, rounds, compiles, ratio, values;
    or name and why it was not run."""
    o = s["opts"][oname]
    hand = o["rows"].get(HAND, {}).get("ms")
    out = []
    for name in _row_names(oname):
        r = o["rows"].get(name)
        if r is None:
            if name in o["skipped"]:
                out.append({"name": name, "not run": o["skipped"][name]})
            continue
        out.append(
            {
                "name": name,
                "ms": r["ms"],
                "rounds": r["rounds"],
                "compiles": r["compiles"],
                "hand": "1.00x" if name == HAND else _ratio(hand, r["ms"]),
                "values": "reference" if name == HAND else eager.values_text(o["values"].get(name)),
            }
        )
    return out


def lines(res: dict) -> list[str]:
    """The section's result lines: where each key set ran, one line per row, the goals."""
    out = []
    for s in res["sets"]:
        out.append(f"[step] {s['name']}: {where(s)}")
        for oname in s.get("opts", {}):
            label = f"{s['name']} {oname}"
            for r in _table(s, oname):
                if "not run" in r:
                    out.append(f"{label:<16} {r['name']:<36} not run: {r['not run']}")
                    continue
                out.append(
                    f"{label:<16} {r['name']:<36} {r['ms']:9.3f} ms  {r['hand']:>7} "
                    f"hand-written/this  compiles {r['compiles']:<3} "
                    f"{r['values'] if r['values'] != 'reference' else ''}".rstrip()
                )
    out += [f"goal: {g}" for g in goals(res)]
    return out


TITLE = (
    "In-jit training step on one device: AD of a loss over ResNet-50's 193 tensors, then the "
    "optimizer"
)


def report(res: dict) -> list[str]:
    """The section's part of results.md: what it measures, a table, the goals."""
    out = [
        f"{TITLE}. Key sets: "
        + "; ".join(f"{s['name']}: {where(s)}" for s in res["sets"])
        + ". Every row runs the same step: the loss `sum_k vdot(w_k, w_k) * x` reads every "
        "parameter, `jax.grad` gives the gradients, then the optimizer (`optax.adam(1e-3)`, "
        "`optax.sgd(1e-2)`), all in one `jax.jit` with the params and optimizer state donated. "
        f"Rows: {HAND} (a dict of 193 arrays; `opt.update`, `optax.apply_updates`); {OFLAT} "
        f"over the same dict; {VIEWS} (the params in one buffer, the forward reading per-tensor "
        "slices + reshapes of it, the gradients concatenated, the optimizer on the buffer); "
        f"{PER_KEY} (`jaxkv.init_optimizer(jaxkv.init(jaxkv.empty([dev], layout='keys'), "
        "params), opt)`, the step pulls every key and `jaxkv.push(state, grads, updater=opt)`, "
        f"the state donated); {FLAT} and {AUTO} (the same with `layout='flat'` and "
        "`layout='auto'`, the default); torch (CPU tensors on the "
        "CPU sets, CUDA on the accelerator): `optimizer.step()` alone with the gradients already "
        "set, then `torch.cuda.synchronize()` on CUDA. ms/step: median of the steps of a round "
        f"(the rows interleaved step by step after {WARMUP} warm-up steps each), best of "
        f"{ROUNDS} rounds; hand-written / this > 1 means faster than hand-written optax; "
        "compiles: during the timed steps; values: each row's params after "
        f"{CHECK_STEPS} steps from the same random values (torch's gradients by autograd), "
        f"against the hand-written row's, ok within {TOLERANCE:g} of the largest |value|.",
        "",
        "| key set | optimizer | row | steps | ms/step | hand-written / this | compiles | "
        "values | " + " | ".join(f"round {i + 1} ms" for i in range(ROUNDS)) + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * ROUNDS,
    ]
    for s in res["sets"]:
        for oname, o in s.get("opts", {}).items():
            for r in _table(s, oname):
                if "not run" in r:
                    cells = [s["name"], oname, r["name"], "", f"not run: {r['not run']}"]
                    cells = [c.replace("|", "\\|") for c in cells]
                    out.append("| " + " | ".join(cells + [""] * (3 + ROUNDS)) + " |")
                    continue
                rounds = [f"{t:.3f}" for t in r["rounds"]]
                cells = [s["name"], oname, r["name"], str(o["steps"]), f"{r['ms']:.3f}"]
                cells += [r["hand"], str(r["compiles"]), r["values"].replace("|", "\\|"), *rounds]
                out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out += [f"- goal: {g}" for g in goals(res)]
    return out
