"""Random KVStore programs, as plain JSON-able data (stdlib only: imported by both venvs).

A program is made from one integer seed::

    {"id": 7, "store": "local", "key_kind": "int",
     "ops": [{"op": "create", "type": "local"},
             {"op": "init", "key": [3, 5], "value": [V, V]},
             {"op": "push", "key": 3, "value": [V, V, V]},
             {"op": "pull", "key": [3, 3], "out": [O, [O, O]]}, ...]}

``V`` describes a value, ``{"shape": [2, 3], "fill": 2, "ramp": 1, "ctx": 4}``: element ``i``
(in row-major order) is ``fill + ramp * i``, on ``cpu(ctx)``; ``O`` describes an ``out``,
``{"shape": [2, 3], "ctx": 1}`` (zeros on ``cpu(ctx)``). Every number is a small integer, so sums
and the updaters' halves are exact in float32. Where a ``value`` or ``out`` is a list, it mirrors
MXNet's forms: one per key, a per-device list, or one per-device list per key.

Ops: ``create``, ``init``, ``push``, ``pull``, ``pushpull`` (``out`` may be ``None``: pull into
the pushed values), ``broadcast``, ``set_updater`` (``name`` is one of :data:`UPDATERS`).

The generator keeps a model of the store (which keys exist, their shapes, how many devices each
key was first pushed from) so that most ops are valid, and it adds invalid ops on purpose. Each
op may carry annotations, used only by the harness to classify outcomes:

- ``note``: what is unusual about the op (``"unknown key"``, ``"duplicate init"``, ...);
- ``defect``: one of :data:`DEFECTS`: MXNet 1.9.1 is known to behave wrongly on this op, so its
  outcome may differ from jaxkv's without that being a disagreement;
- ``taint``: keys (``"*"``: the whole store) whose MXNet state may be wrong after this op because
  of that defect, so later differences on them are consequences of it, ``taint_defect`` says which.

Usage: ``python programs.py --seed 42`` prints program 42 as JSON (what ``run_program.py``
reads); ``--n 5`` prints programs ``seed .. seed+4``, one per line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

INT_KEYS = [0, 3, 5, 7, 9, 12]
STR_KEYS = ["a", "b", "w", "emb", "x1", "bias"]
# Never initialised by any program, so always an unknown key.
NEVER = {"int": 99, "str": "zz"}
SHAPES = [[2], [3], [1], [2, 3], [3, 2], [4, 1], [2, 2, 2]]
NUM_CONTEXTS = 8  # cpu(0) .. cpu(7)
STORE_TYPES = ["local", "device"]
DEVICE_COUNTS = [1, 1, 2, 2, 3, 4, 8]

# In-place updaters by name; run_program.py defines them (they need NDArrays).
UPDATERS = {
    "add2": "stored += input * 2",
    "sub_half": "stored[:] = stored - 0.5 * input",
    "assign": "stored[:] = input",
    "neg_add": "stored[:] = input - stored",
    "scale_add": "stored *= 2; stored += input",
    "by_key": "stored += input * (2 if key in (3, 7, 12) else 1)",
    "iadd_return": "stored += input; return stored",
}

D1, D2, D3, D4, D5, D6 = "D1", "D2", "D3", "D4", "D5", "D6"
DEFECTS = {
    D1: "(1) a push from a different number of devices than the key's earlier pushes",
    D2: "(2) a failed pull/push of an unknown key leaves a trace: a later init of that key fails "
    "as a duplicate (and on an empty store it fixes the key kind)",
    D3: "(3) a wrong-shaped push, a wrong-shaped out or create('bogus') is accepted silently",
    D4: "(4) init of one key with a list of values",
    D5: "(5) a failed call on several keys is partly applied",
    D6: "(6) after a push from several devices with no updater, the stored value shares the "
    "reduction buffer: the next such push overwrites it before the updater runs",
}


def num_elements(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def materialize(desc: dict) -> list:
    """The value a ``V`` describes, as a nested list of floats of ``desc['shape']``."""
    flat = [float(desc["fill"] + desc["ramp"] * i) for i in range(num_elements(desc["shape"]))]
    for size in reversed(desc["shape"][1:]):
        flat = [flat[i : i + size] for i in range(0, len(flat), size)]
    return flat


def keys_of(op: dict) -> list:
    """The keys an op names (none for ``create`` and ``set_updater``)."""
    key = op.get("key")
    if key is None:
        return []
    return list(key) if isinstance(key, list) else [key]


class _Generator:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        rng = self.rng
        self.seed = seed
        self.kind = rng.choice(["int", "str"])
        self.other = "str" if self.kind == "int" else "int"
        self.pool = list(INT_KEYS if self.kind == "int" else STR_KEYS)
        self.other_pool = STR_KEYS if self.kind == "int" else INT_KEYS
        # Some programs may push a key from a varying number of devices (MXNet defect 1:
        # they often crash MXNet, so only some programs do it).
        self.vary_devices = rng.random() < 0.12
        self.shapes: dict = {}  # initialised key -> shape (jaxkv's view: the intended one)
        self.counts: dict = {}  # key -> number of values of its first push
        self.poisoned: set = set()  # keys MXNet has seen fail as unknown (defect 2)
        self.mx_kind: str | None = None  # the key kind MXNet has fixed, by any op on a key
        self.updater: str | None = None
        # Keys whose stored value MXNet keeps in its reduction buffer (defect 6).
        self.aliased: set = set()
        self.ops: list[dict] = []

    # -- descriptions -----------------------------------------------------------------------
    def ctx(self) -> int:
        return self.rng.randrange(NUM_CONTEXTS)

    def value(self, shape, ctx=None) -> dict:
        rng = self.rng
        return {
            "shape": list(shape),
            "fill": rng.randint(-3, 5),
            "ramp": rng.choice([0, 0, 1, -1, 2]),
            "ctx": self.ctx() if ctx is None else ctx,
        }

    def out(self, shape, ctx=None) -> dict:
        return {"shape": list(shape), "ctx": self.ctx() if ctx is None else ctx}

    def contexts(self, n: int) -> list[int]:
        """``n`` contexts, distinct unless sometimes (two values on one device)."""
        if n <= NUM_CONTEXTS and self.rng.random() < 0.9:
            return self.rng.sample(range(NUM_CONTEXTS), n)
        return [self.ctx() for _ in range(n)]

    def wrong_shape(self, shape) -> list[int]:
        return list(self.rng.choice([s for s in SHAPES if s != list(shape)]))

    # -- keys --------------------------------------------------------------------------------
    def known(self) -> list:
        return sorted(self.shapes, key=str)

    def free(self) -> list:
        return [k for k in self.pool if k not in self.shapes]

    def key_list(self, keys: list, dup_ok: bool, pushed: bool = False) -> list:
        """1–3 keys from ``keys``, with a duplicate sometimes.

        For a push (``pushed``), only a key whose pushes have several values may repeat (a
        repeat adds a value), unless this program varies device counts anyway.
        """
        rng = self.rng
        chosen = rng.sample(keys, min(len(keys), rng.randint(1, 3)))
        repeatable = [
            k for k in chosen if not pushed or self.vary_devices or self.counts.get(k, 2) >= 2
        ]
        if dup_ok and repeatable and rng.random() < 0.2:
            chosen.insert(rng.randrange(len(chosen) + 1), rng.choice(repeatable))
        return chosen

    def fix_kind(self, keys: list) -> str | None:
        """MXNet fixes its key kind at the first op that reaches its C API with keys.

        Returns a taint reason when this op fixes it to the other kind (defect 2).
        """
        kinds = {"str" if isinstance(k, str) else "int" for k in keys}
        if self.mx_kind is None and len(kinds) == 1:
            self.mx_kind = kinds.pop()
            if self.mx_kind != self.kind:
                return D2
        return None

    # -- value and out structures -----------------------------------------------------------
    def per_key(self, items: list) -> object:
        """What one occurrence of a key gets: one item, a list of one, or a list."""
        if len(items) == 1 and self.rng.random() < 0.7:
            return items[0]
        return items

    def push_values(self, keys: list, single: bool, op: dict) -> object:
        """Values for pushing ``keys`` (a list, maybe with duplicates), per MXNet's forms."""
        rng = self.rng
        occurrences: dict = {}
        for k in keys:
            occurrences[k] = occurrences.get(k, 0) + 1
        splits: dict = {}
        for k, occ in occurrences.items():
            first = self.counts.get(k)
            n = first if first is not None else rng.choice(DEVICE_COUNTS)
            if self.vary_devices and first is not None and rng.random() < 0.4:
                n = rng.choice([c for c in DEVICE_COUNTS if c != first])
            n = max(n, occ)
            if first is None:
                self.counts[k] = n
            elif n != first:
                op["defect"] = D1
                op.setdefault("taint", []).append(k)
                op["note"] = "different number of devices"
            if self.updater is None:
                # MXNet stores the reduced value itself: a buffer it reuses when n > 1.
                (self.aliased.add if n > 1 else self.aliased.discard)(k)
            elif k in self.aliased and n > 1 and self.updater != "assign":
                op.setdefault("defect", D6)
                op.setdefault("taint", []).append(k)
                op.setdefault("note", "updater on a value aliased by MXNet's reduction buffer")
            # Split n values among the occurrences, at least one each.
            parts = [1] * occ
            for _ in range(n - occ):
                parts[rng.randrange(occ)] += 1
            ctxs = self.contexts(n)
            splits[k] = [ctxs[sum(parts[:i]) : sum(parts[: i + 1])] for i in range(occ)]
        seen: dict = {}
        values = []
        for k in keys:
            i = seen.get(k, 0)
            seen[k] = i + 1
            values.append(self.per_key([self.value(self.shapes[k], c) for c in splits[k][i]]))
        return values[0] if single else values

    def device_values(self, k, shape) -> object:
        """Values for one key from as many devices as its first push (one if none yet)."""
        return self.per_key([self.value(shape, c) for c in self.contexts(self.counts.get(k, 1))])

    def outs(self, keys: list, single: bool, shape_of=None) -> object:
        rng = self.rng
        shape_of = shape_of or (lambda k: self.shapes[k])
        outs = [
            self.per_key([self.out(shape_of(k)) for _ in range(rng.choice([1, 1, 1, 2, 3]))])
            for k in keys
        ]
        return outs[0] if single else outs

    def keys_arg(self, keys: list, single: bool) -> object:
        return keys[0] if single else keys

    # -- valid ops ----------------------------------------------------------------------------
    def op_init(self, broadcast: bool = False) -> dict:
        rng = self.rng
        free = self.free()
        single = rng.random() < 0.6
        keys = [rng.choice(free)] if single else rng.sample(free, min(len(free), rng.randint(1, 3)))
        shapes = {k: rng.choice(SHAPES) for k in keys}
        values = [self.per_key([self.value(shapes[k])]) for k in keys]
        op = {
            "op": "broadcast" if broadcast else "init",
            "key": self.keys_arg(keys, single),
            "value": values[0] if single else values,
        }
        if broadcast:
            op["out"] = self.outs(keys, single, shape_of=lambda k: shapes[k])
        taint_kind = self.fix_kind(keys)
        poisoned = [k for k in keys if k in self.poisoned]
        if poisoned:
            # MXNet refuses the init as a duplicate; keys before it may be initialised.
            op["defect"] = D2
            op["note"] = "init after a failed op on the key"
            op["taint"] = list(keys)
        elif taint_kind:
            op["defect"] = D2
            op["taint"] = ["*"]
        self.shapes.update(shapes)
        self.aliased.difference_update(keys)
        return op

    def op_push(self, kind: str) -> dict:
        rng = self.rng
        single = rng.random() < 0.5
        known = self.known()
        keys = [rng.choice(known)] if single else self.key_list(known, True, pushed=True)
        op: dict = {"op": kind, "key": self.keys_arg(keys, single)}
        op["value"] = self.push_values(keys, single, op)
        if kind == "pushpull":
            op["out"] = None if rng.random() < 0.3 else self.outs(keys, single)
        self.fix_kind(keys)
        return op

    def op_pull(self) -> dict:
        rng = self.rng
        single = rng.random() < 0.5
        keys = [rng.choice(self.known())] if single else self.key_list(self.known(), True)
        self.fix_kind(keys)
        return {"op": "pull", "key": self.keys_arg(keys, single), "out": self.outs(keys, single)}

    def op_set_updater(self) -> dict:
        self.updater = self.rng.choice(sorted(UPDATERS))
        return {"op": "set_updater", "name": self.updater}

    # -- invalid ops ---------------------------------------------------------------------------
    def op_unknown(self) -> dict:
        """A pull, push or pushpull naming a key that was never initialised."""
        rng = self.rng
        unknown = rng.choice(self.free() + [NEVER[self.kind]])
        known = self.known()
        keys = [unknown]
        if known and rng.random() < 0.5:
            keys = self.key_list(known, False)
            keys.insert(rng.randrange(len(keys) + 1), unknown)
        single = len(keys) == 1 and rng.random() < 0.7
        kind = rng.choice(["pull", "pull", "push", "pushpull"])
        shape_of = lambda k: self.shapes.get(k, [2])
        op: dict = {"op": kind, "key": self.keys_arg(keys, single), "note": "unknown key"}
        if kind == "pull":
            op["out"] = self.outs(keys, single, shape_of)
        else:
            vals = [self.device_values(k, shape_of(k)) for k in keys]
            op["value"] = vals[0] if single else vals
            if kind == "pushpull":
                op["out"] = self.outs(keys, single, shape_of)
            valid = [k for k in keys if k in self.shapes]
            if valid:
                op["taint"] = valid
                op["taint_defect"] = D5
        self.poisoned.add(unknown)
        if self.fix_kind(keys):
            op["taint"] = ["*"]
            op["taint_defect"] = D2
        return op

    def op_duplicate_init(self) -> dict:
        rng = self.rng
        known, free = self.known(), self.free()
        if free and rng.random() < 0.3:
            k = rng.choice(free)  # the same new key twice in one call
            keys = [k, k]
        else:
            keys = [rng.choice(known)]
            if free and rng.random() < 0.4:
                keys.insert(rng.randrange(2), rng.choice(free))
        single = len(keys) == 1 and rng.random() < 0.7
        shape_of = lambda k: self.shapes.get(k) or rng.choice(SHAPES)
        shapes = {k: shape_of(k) for k in keys}
        vals = [self.value(shapes[k]) for k in keys]
        broadcast = rng.random() < 0.25
        op = {
            "op": "broadcast" if broadcast else "init",
            "key": self.keys_arg(keys, single),
            "value": vals[0] if single else vals,
            "note": "duplicate init",
        }
        if broadcast:
            op["out"] = self.outs(keys, single, lambda k: shapes[k])
        new = [k for k in keys if k not in self.shapes]
        if new:
            op["taint"] = new
            op["taint_defect"] = D5
        self.fix_kind(keys)
        return op

    def op_other_kind(self) -> dict:
        rng = self.rng
        other = rng.choice(self.other_pool)
        kind = rng.choice(["init", "pull", "push"] if self.shapes else ["pull", "push"])
        keys = [other]
        known = self.known()
        if kind != "init" and known and rng.random() < 0.3:
            keys = [rng.choice(known), other]  # a mixed list
        elif kind == "init" and rng.random() < 0.3 and self.free():
            keys = [rng.choice(self.free()), other]
        single = len(keys) == 1
        shape = rng.choice(SHAPES)
        shape_of = lambda k: self.shapes.get(k, shape)
        op: dict = {"op": kind, "key": self.keys_arg(keys, single), "note": "other key kind"}
        if kind == "pull":
            op["out"] = self.outs(keys, single, shape_of)
        else:
            vals = [self.value(shape_of(k)) for k in keys]
            op["value"] = vals[0] if single else vals
        if self.fix_kind(keys):
            op["taint"] = ["*"]
            op["taint_defect"] = D2
        return op

    def op_wrong_shape_push(self) -> dict:
        rng = self.rng
        k = rng.choice(self.known())
        shape = self.shapes[k]
        n = self.counts.get(k, 1)
        ctxs = self.contexts(n)
        bad = rng.randrange(n) if rng.random() < 0.4 else None  # just one bad, or all bad
        vals = [
            self.value(shape if bad is not None and i != bad else self.wrong_shape(shape), c)
            for i, c in enumerate(ctxs)
        ]
        self.counts.setdefault(k, n)
        self.fix_kind([k])
        op = {
            "op": "push",
            "key": k,
            "value": vals[0] if n == 1 and rng.random() < 0.5 else vals,
            "note": "wrong-shaped push",
            "defect": D3,
            "taint": [k],
        }
        if rng.random() < 0.3:
            op.update(op="pushpull", out=None)
        return op

    def op_wrong_shape_out(self) -> dict:
        rng = self.rng
        keys = self.key_list(self.known(), False)
        bad = rng.choice(keys)
        shape_of = lambda k: self.shapes[k] if k != bad else self.wrong_shape(self.shapes[k])
        single = len(keys) == 1
        self.fix_kind(keys)
        return {
            "op": "pull",
            "key": self.keys_arg(keys, single),
            "out": self.outs(keys, single, shape_of),
            "note": "wrong-shaped out",
            "defect": D3,
        }

    def op_wrong_shape_broadcast(self) -> dict:
        k = self.rng.choice(self.free())
        shape = self.rng.choice(SHAPES)
        self.fix_kind([k])
        return {
            "op": "broadcast",
            "key": k,
            "value": self.value(shape),
            "out": self.out(self.wrong_shape(shape)),
            "note": "broadcast to a wrong-shaped out",
            "taint": [k],
            "taint_defect": D5,
        }

    def op_init_list(self) -> dict:
        rng = self.rng
        k = rng.choice(self.free())
        shape = rng.choice(SHAPES)
        vals = [self.value(shape) for _ in range(rng.randint(2, 3))]
        op = {
            "op": "init",
            "key": k,
            "value": vals,
            "note": "one key, several values",
            "defect": D4,
            "taint": [k],
        }
        if rng.random() < 0.3:
            op["op"] = "broadcast"
            op["out"] = self.out(shape)
        self.fix_kind([k])
        return op

    def op_count_mismatch(self) -> dict:
        rng = self.rng
        keys = self.key_list(self.known(), False)
        if len(keys) < 2:
            keys = keys * 2
        kind = rng.choice(["pull", "push"])
        n = rng.choice([k for k in range(1, 5) if k != len(keys)])
        shape = self.shapes[keys[0]]
        op: dict = {"op": kind, "key": keys, "note": "keys and values do not pair"}
        if kind == "pull":
            op["out"] = [self.out(shape) for _ in range(n)]
        else:
            op["value"] = [self.value(shape) for _ in range(n)]
        return op

    # -- the program ---------------------------------------------------------------------------
    def next_op(self) -> dict:
        rng = self.rng
        known, free = self.known(), self.free()
        choices: list[tuple[float, object]] = []
        if free:
            choices += [(30 if not known else 8, self.op_init), (3, lambda: self.op_init(True))]
        # On an empty store, an op on a key of the other kind fixes MXNet's key kind (defect 2),
        # which spoils the rest of the program: keep that rare.
        choices += [(3, self.op_unknown), (1.5 if known else 0.3, self.op_other_kind)]
        if known:
            choices += [
                (25, lambda: self.op_push("push")),
                (22, self.op_pull),
                (10, lambda: self.op_push("pushpull")),
                (6, self.op_set_updater),
                (2, self.op_duplicate_init),
                (1, self.op_wrong_shape_push),
                (1, self.op_wrong_shape_out),
                (1, self.op_count_mismatch),
            ]
            if free:
                choices += [(0.7, self.op_init_list), (0.7, self.op_wrong_shape_broadcast)]
        total = sum(w for w, _ in choices)
        pick = rng.random() * total
        for w, make in choices:
            pick -= w
            if pick < 0:
                return make()
        return choices[-1][1]()

    def generate(self) -> dict:
        rng = self.rng
        store = "bogus" if rng.random() < 0.01 else rng.choice(STORE_TYPES)
        create = {"op": "create", "type": store}
        if store == "bogus":
            create.update(note="unknown store type", defect=D3, taint=["*"])
        ops = [create]
        for _ in range(rng.randint(5, 15)):
            ops.append(self.next_op())
        return {"id": self.seed, "store": store, "key_kind": self.kind, "ops": ops}


def generate(seed: int) -> dict:
    """The program of ``seed`` (the same on every Python and platform)."""
    return _Generator(seed).generate()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the (first) program's seed")
    parser.add_argument("--n", type=int, default=1, help="how many programs (JSON lines if > 1)")
    args = parser.parse_args(argv)
    if args.n == 1:
        json.dump(generate(args.seed), sys.stdout, indent=1)
        print()
    else:
        for i in range(args.n):
            print(json.dumps(generate(args.seed + i)))


if __name__ == "__main__":
    main()
