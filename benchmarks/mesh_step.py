"""The benchmark's mesh section: the 2-axis in-jit training step of ``examples/flax_mesh.py``
(a flax MLP on a 2 x 4 mesh ``("data", "model")``: data parallel along "data", its hidden layers
tensor parallel along "model", each device holding only its Megatron blocks), with jaxkv beside
the same step written by hand.

Rows, each one jitted ``jax.shard_map`` step over the whole mesh, the state donated, both on the
same local layout (``hidden_0``'s kernel ``P(None, "model")`` and bias ``P("model")``,
``hidden_1``'s kernel ``P("model", None)``, the rest replicated; ``shard_map`` hands each device
its blocks, and the modules take them as they are, slicing nothing):
  hand-written pmean  the parameter tree in that layout, replicated along "data", and Adam's
                      state likewise (its moments in their parameters' layout,
                      ``optax.tree_map_params``); AD with respect to a copy of the blocks
                      varying along "data" (``jax.lax.pcast``) gives each row of the mesh the
                      gradient of its half of the batch, ``jax.lax.pmean`` over "data" averages
                      it, and ``optax.adam``'s ``update`` and ``optax.apply_updates`` run on each
                      device's blocks
  jaxkv               the example's step: the tree given to ``jaxkv.init`` in that layout, which
                      the store keeps, adding "data" on dimension 0 of both hidden kernels (the
                      example's ``bigarray_bound``: the elements of hidden_0's kernel block), and
                      of their Adam moments (ZeRO over tensor parallelism: 1/8 of each per
                      device); ``jaxkv.pull(state, params, axis_name="data")`` gives each device
                      its blocks, the same forward and AD, ``jaxkv.push(state, grads,
                      updater=adam, axis_name="data")`` on a store with ``reduce="mean"``

Both rows take the example's model and batch (1024 rows of 16 features), once at the example's
hidden width (128) and once wider (1024). Each ms/step is the median of the timed steps of a
round after warm-up, the best of 3 rounds; within a round the rows are interleaved step by step
(the order alternating). Compiles are counted over the timed rounds; state is the bytes on the
mesh's first device; diff is the largest relative difference of jaxkv's final parameters from
the hand-written step's (both take the same steps from the same parameters).

Run as a script (on 8 simulated CPU devices) it prints the section.
"""

from __future__ import annotations

import os
import sys

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import gpt_step  # noqa: E402 (the rounds of interleaved steps, shared)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxkv  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "flax_mesh.py")
ROWS = ("hand-written pmean", "jaxkv")
WIDTHS = (128, 1024)  # the example's hidden width, and a wider one
ROUNDS = 3
STEPS = 50  # timed steps per round at least (a step takes milliseconds)


def example():
    """``examples/flax_mesh.py`` as a module."""
    return gpt_step.load("flax_mesh", EXAMPLE)


def hand_written_step(ex, mesh, params, tx):
    """The example's step by hand on the same local layout, without jaxkv:
    ``step((params, opt_state), x, y) -> (carry, loss)``; and the carry's ``PartitionSpec``s
    (the parameters' Megatron layout, Adam's moments in it too, replicated along "data")."""
    model = ex.MLP(ex.hidden_of(params), model_axis="model")
    param_specs = ex.tensor_parallel_specs(params)
    opt_specs = optax.tree_map_params(
        tx, lambda _, spec: spec, tx.init(params), param_specs, transform_non_params=lambda _: P()
    )

    def step(carry, x, y):
        p, s = carry  # this device's blocks, and their moments
        # AD with respect to a copy varying along "data" gives this row's own gradient
        # (complete over "model", as in the example); pmean averages the two rows'.
        mine = jax.lax.pcast(p, "data", to="varying")
        loss, g = jax.value_and_grad(lambda q: ex.loss_fn(model, q, x, y))(mine)
        g = jax.lax.pmean(g, "data")
        updates, s = tx.update(g, s, p)
        return (optax.apply_updates(p, updates), s), jax.lax.pmean(loss, "data")

    specs = (param_specs, opt_specs)
    sharded = jax.shard_map(
        step, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=(specs, P())
    )
    return jax.jit(sharded, donate_argnums=0), specs


class _Row:
    """One row: a jitted step, its carried state and the batch."""

    def __init__(self, step, carry, x, y):
        self.step, self.carry, self.x, self.y = step, carry, x, y

    def __call__(self):
        self.carry, loss = self.step(self.carry, self.x, self.y)
        jax.block_until_ready((self.carry, loss))


def _rows(ex, mesh, hidden: int) -> dict[str, _Row]:
    params, tx = ex.init_params(hidden=hidden), ex.make_optimizer()
    x, y = ex.put_batch(mesh, *ex.make_data())
    step, specs = hand_written_step(ex, mesh, params, tx)
    carry = (params, tx.init(params))
    carry = jax.tree.map(lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec)), carry, specs)
    hand = _Row(step, carry, x, y)
    state = ex.make_store(mesh, params, tx)
    kv = _Row(ex.make_step(state, params, tx), state, x, y)
    return {"hand-written pmean": hand, "jaxkv": kv}


def _along(state, axis: str) -> list[str]:
    """The keys whose stored value is split along the mesh axis ``axis``."""
    return [
        k
        for k in state.keys()
        if any(axis in (e if isinstance(e, tuple) else (e,)) for e in state[k].sharding.spec if e)
    ]


def _max_rel_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v))) / np.max(np.abs(v)))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def run(counter, steps: int = STEPS, rounds: int = ROUNDS, log=print) -> dict:
    """Times both rows at each width, counting compiles with ``counter``
    (bench.CompileCounter); returns {"widths": {hidden: {"rows": {name: {...}}, ...}}}."""
    ex = example()
    mesh = ex.make_mesh(jax.devices("cpu"))
    steps = max(steps, STEPS)
    out: dict = {"widths": {}, "mesh": dict(mesh.shape), "batch": ex.BATCH, "steps": steps}
    for hidden in WIDTHS:
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam casts implicitly
            res = _run_width(ex, mesh, hidden, counter, steps, rounds, log)
        out["widths"][hidden] = res
    return out


def _run_width(ex, mesh, hidden, counter, steps, rounds, log) -> dict:
    rows = _rows(ex, mesh, hidden)
    # Warm-up (two steps a row), then the rounds, the rows interleaved step by step.
    timed = gpt_step.timed(rows, counter, steps, rounds, log, f"mesh hidden {hidden}")
    times, compiles = timed["times"], timed["compiles"]
    hand_params = rows["hand-written pmean"].carry[0]
    state = rows["jaxkv"].carry
    first = mesh.devices.flat[0]
    return {
        "rows": {
            name: {
                "ms": min(times[name]),
                "rounds": times[name],
                "compiles": compiles[name],
                "state_bytes": gpt_step.device_bytes(rows[name].carry, first),
            }
            for name in rows
        },
        "max_rel_diff": _max_rel_diff(jaxkv.pull(state, hand_params), hand_params),
        "split": {axis: _along(state, axis) for axis in mesh.axis_names},
    }


def lines(res: dict) -> list[str]:
    """The section as printed by ``bench.py --only mesh``: one line per width and row."""
    out = []
    for hidden, w in res["widths"].items():
        hand, kv = w["rows"]["hand-written pmean"], w["rows"]["jaxkv"]
        for name, r in w["rows"].items():
            out.append(
                f"2-axis in-jit step  hidden {hidden:<5} {name:<18} {r['ms']:7.2f} ms/step  "
                f"compiles {r['compiles']}  state {r['state_bytes'] / 1e6:.2f} MB/device  "
                f"rounds {', '.join(f'{t:.2f}' for t in r['rounds'])}"
            )
        out.append(
            f"2-axis in-jit step  hidden {hidden:<5} hand-written / jaxkv = "
            f"{hand['ms'] / kv['ms']:.2f}x  (max rel. diff of the params {w['max_rel_diff']:.1e}; "
            + "; ".join(
                f"jaxkv splits along {axis!r}: {', '.join(keys) or 'none'}"
                for axis, keys in w["split"].items()
            )
            + ")"
        )
    return out


def report(res: dict) -> list[str]:
    """The section of results.md: what the rows compare, then one table row per width and row."""
    mesh = " x ".join(f"{n} {a!r}" for a, n in res["mesh"].items())
    lines_ = [
        f"2-axis in-jit step: the training step of `examples/flax_mesh.py` on a {mesh} mesh of "
        f"CPU devices (a flax MLP, 16 features, two hidden layers split Megatron-style along "
        f"'model', each device holding its blocks, a batch of {res['batch']} rows split along "
        "'data', `optax.adam`), in one jitted `jax.shard_map` step. hand-written pmean keeps the "
        "parameter blocks and Adam's state in that layout, replicated along 'data', averages "
        "the gradients with `jax.lax.pmean` over 'data' and applies optax by hand; jaxkv is the "
        "example's step (`jaxkv.pull`/`jaxkv.push` with `axis_name='data'`, `reduce='mean'`; "
        "the store keeps the 'model' layout and adds 'data' on both hidden kernels, and on their "
        "Adam moments: 1/8 of each per device). ms/step: median of "
        f"{res['steps']} steps after warm-up, best of {ROUNDS} rounds, the rows interleaved step "
        "by step; compiles: during the timed rounds; state: bytes on the mesh's first device; "
        "diff: the largest relative difference of jaxkv's final parameters from the "
        "hand-written step's.",
        "",
        "| 2-axis in-jit step | hidden | ms/step | hand-written / this | compiles | "
        "state MB/device | diff | " + " | ".join(f"round {i + 1} ms" for i in range(ROUNDS)) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * ROUNDS,
    ]
    for hidden, w in res["widths"].items():
        base = w["rows"]["hand-written pmean"]["ms"]
        for name in ROWS:
            r = w["rows"][name]
            diff = "—" if name == ROWS[0] else f"{w['max_rel_diff']:.1e}"
            lines_.append(
                f"| {name} | {hidden} | {r['ms']:.2f} | {base / r['ms']:.2f}x | {r['compiles']} | "
                f"{r['state_bytes'] / 1e6:.2f} | {diff} | "
                + " | ".join(f"{t:.2f}" for t in r["rounds"])
                + " |"
            )
    return lines_


def main() -> None:
    sys.path.insert(0, HERE)
    from bench import CompileCounter  # noqa: PLC0415

    print("\n".join(lines(run(CompileCounter, log=lambda m: print(m, flush=True)))))


if __name__ == "__main__":
    main()
