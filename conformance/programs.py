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

A row-sparse value adds ``"stype": "row_sparse"`` and ``"make"``: ``"rows"`` (MXNet's
``row_sparse_array((data, ids), shape=..., ctx=...)`` with the row ids ``"rows"``, as an
``"ids_dtype"`` array: ``int64`` or MXNet's default ``float32``; ``data`` is ``fill + ramp * i``
over ``(len(rows), *shape[1:])``), ``"ones"`` (``ones(shape).tostype('row_sparse') * fill``:
every row), ``"tostype"`` (the dense value's ``tostype('row_sparse')``: its non-zero rows) or
``"zeros"`` (``sparse.zeros('row_sparse', shape)``: no row). A row-sparse out is
``{"shape": ..., "ctx": ..., "stype": "row_sparse"}`` (``sparse.zeros``).

Ops: ``create``, ``init``, ``push``, ``pull`` (``ignore_sparse`` may be given), ``pushpull``
(``out`` may be ``None``: pull into the pushed values), ``broadcast``, ``set_updater`` (``name``
is one of :data:`UPDATERS`), ``set_optimizer`` (``name``: ``SGD`` or ``Adam``, ``args``: its
keyword arguments, ``scheduler``: an optional ``[class, arguments]`` of ``mx.lr_scheduler``),
``set_learning_rate`` (``how``: ``"set_learning_rate"`` or ``"lr"``, the store's optimizer's
learning rate changed between pushes) and ``row_sparse_pull`` (``row_ids``: an id array
``{"ids": [...], "dtype": "int64" | "float32", "ctx": c}``, or a list of them mirroring
``out``).

Programs come in families (``"features"``): plain ones (the dense store), ``"optimizer"`` ones
(``set_optimizer`` between the updaters), and ``"rows"`` ones (row-sparse values, pushes by rows,
``row_sparse_pull``, ``pull`` with ``ignore_sparse``, and ``set_optimizer`` but no
``set_updater``). Ops after a ``set_optimizer`` carry ``"approx": true``: their values come from
float32 arithmetic, and the harness compares them with a tolerance.

The generator keeps a model of the store (which keys exist, their shapes, how many devices each
key was first pushed from) so that most ops are valid, and it adds invalid ops on purpose. Each
op may carry annotations, used only by the harness to classify outcomes:

- ``note``: what is unusual about the op (``"unknown key"``, ``"duplicate init"``, ...);
- ``defect``: one of :data:`DEFECTS`: MXNet 1.9.1 is known to behave wrongly on this op, so its
  outcome may differ from jaxkv's without that being a disagreement;
- ``taint``: keys (``"*"``: the whole store) whose MXNet state may be wrong after this op because
  of that defect, so later differences on them are consequences of it, ``taint_defect`` says which.
- ``differs``: one of :data:`DIFFERENCES`: jaxkv differs from MXNet here on purpose (or MXNet
  lacks the feature), so the outcomes may differ; ``taint`` may name keys whose states then
  differ (with ``taint_defect`` the same label).

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

# Row-sparse values need a row dimension and something after it: the 2-D and 3-D shapes of
# SHAPES, and one taller table.
ROW_SHAPES = [[2, 3], [3, 2], [4, 1], [2, 2, 2], [6, 2]]
# How often a program is of each family (see the module docstring).
ROWS_SHARE = 0.15
OPTIMIZER_SHARE = 0.25
# Numbers compare exactly, except after set_optimizer: then within this (float32 arithmetic; the
# two are meant to agree bit for bit, and the harness counts how many do).
RTOL = ATOL = 1e-6

D1, D2, D3, D4, D5, D6 = "D1", "D2", "D3", "D4", "D5", "D6"
D7, D8, D9, D10 = "D7", "D8", "D9", "D10"
X1, X2, X3, X4, X5, X6 = "X1", "X2", "X3", "X4", "X5", "X6"
DEFECTS = {
    D1: "(1) a push from a different number of devices than the key's earlier pushes",
    D2: "(2) a failed pull/push of an unknown key leaves a trace: a later init of that key fails "
    "as a duplicate (and on an empty store it fixes the key kind)",
    D3: "(3) a wrong-shaped push, a wrong-shaped out or create('bogus') is accepted silently",
    D4: "(4) init of one key with a list of values",
    D5: "(5) a failed call on several keys is partly applied",
    D6: "(6) after a push from several devices (or of row-sparse values) with no updater, the "
    "stored value shares the reduction buffer: the next such push overwrites it before the "
    "updater or optimizer runs",
    D7: "(7) a row-sparse value with unsorted row ids is kept unsorted (MXNet requires sorted "
    "ids but does not sort them; jaxkv sorts): pushes lose or misplace rows",
    D8: "(8) a row-sparse value with a repeated row id is accepted, and its sums and updates go "
    "wrong (jaxkv refuses it)",
    D9: "(9) row_sparse_pull with a row id outside [0, rows) is accepted (the out lists the bad "
    "id) or aborts the process (jaxkv refuses)",
    D10: "(10) a push from several devices of values of the other storage type (row-sparse or "
    "dense) than the key's first such push: refused ('Storage type mismatch') or summed wrong",
}
# Where jaxkv differs from MXNet on purpose, or MXNet lacks what jaxkv does. X2 and X6 are
# recognised by the harness from the outcomes (the generator does not model which rows MXNet
# stores); the others are marked by the generator.
DIFFERENCES = {
    X1: "(X1) row_sparse_pull into a dense out: MXNet refuses it, and so does the drop-in "
    "(jaxkv.mx); jaxkv.KVStore fills it (the rows asked for, others zero)",
    X2: "(X2) a row-sparse out pulled from a key that stores no rows: MXNet's lists no rows, "
    "jaxkv's lists the ids asked for, as zero rows (the dense values agree)",
    X3: "(X3) row_sparse_pull of a key MXNet stores dense (initialised dense, or last assigned "
    "a dense push with no updater): MXNet refuses it, jaxkv fills the outs",
    X4: "(X4) with set_optimizer, jaxkv updates the keys of one push as one optimizer group and "
    "refuses a later push of part of a group, or across groups; MXNet updates key by key",
    X5: "(X5) MXNet's SGD and Adam refuse a row-sparse gradient for a row-sparse stored weight "
    "that lacks rows ('only implemented for RowSparse weights with all rows'); jaxkv updates",
    X6: "(X6) pull(ignore_sparse=False) into a row-sparse out: MXNet's out lists the rows it "
    "stores, zero rows too, jaxkv's the non-zero rows (the dense values agree)",
}
OPTIMIZERS = ["SGD", "Adam"]
# mx.lr_scheduler schedules a set_optimizer may carry: (class, keyword arguments).
SCHEDULES = [
    ["FactorScheduler", {"step": 2, "factor": 0.5, "base_lr": 0.2}],
    ["FactorScheduler", {"step": 1, "factor": 0.9, "warmup_steps": 2, "warmup_begin_lr": 0.01}],
    ["MultiFactorScheduler", {"step": [2, 4], "factor": 0.3, "base_lr": 0.4}],
    ["PolyScheduler", {"max_update": 6, "base_lr": 0.3, "pwr": 2, "final_lr": 0.01}],
    ["CosineScheduler", {"max_update": 5, "base_lr": 0.2, "warmup_steps": 1}],
]


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


def row_sparse(desc) -> bool:
    return isinstance(desc, dict) and desc.get("stype") == "row_sparse"


def stored_rows(desc: dict) -> list[int]:
    """The row ids a row-sparse value ``desc`` stores, in its order (MXNet keeps it as given)."""
    make = desc["make"]
    if make == "rows":
        return list(desc["rows"])
    if make == "ones":
        return list(range(desc["shape"][0]))
    if make == "zeros":
        return []
    dense = materialize(desc)  # tostype: the rows with a value other than zero
    return [i for i, row in enumerate(dense) if any(x != 0 for x in _flat(row))]


def _flat(x) -> list:
    return [y for z in x for y in _flat(z)] if isinstance(x, list) else [x]


def row_data(desc: dict) -> list:
    """The rows of a ``make == "rows"`` value, ``(len(rows), *shape[1:])`` as nested lists."""
    rows = desc["rows"]
    return materialize(dict(desc, shape=[len(rows), *desc["shape"][1:]])) if rows else []


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
        self.updater: str | None = None  # an UPDATERS name, "optimizer", or None
        # Keys whose stored value MXNet keeps in its reduction buffer (defect 6): "dense" (after
        # a push from several devices) or "rows" (after a push of row-sparse values).
        self.aliased: dict = {}
        self.ops: list[dict] = []
        # The families (see the module docstring).
        self.rows = rng.random() < ROWS_SHARE
        if self.rows:  # fewer keys: jaxkv compiles a row push per key, shape and row count
            self.pool = self.pool[:4]
        self.optimizers = rng.random() < (0.6 if self.rows else OPTIMIZER_SHARE)
        # Rows programs that also make invalid row-sparse values now and then (defects 7, 8).
        self.unsorted = self.rows and rng.random() < 0.12
        self.repeated = self.rows and rng.random() < 0.05
        self.stype: dict = {}  # key -> MXNet's storage type of the stored value
        self.full: dict = {}  # key -> whether MXNet's row-sparse stored value holds every row
        # key -> whether its first push from several devices was row-sparse (defect 10)
        self.buffer_rows: dict = {}
        self.groups: list = []  # jaxkv's optimizer groups (frozensets of keys), since set_optimizer
        self.approx = False  # whether values may be inexact (after set_optimizer)
        self.scheduled = False  # whether the store's optimizer has a learning-rate schedule
        self.pushed = False  # whether a push has been generated

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

    def out(self, shape, ctx=None, rows: bool = False) -> dict:
        out = {"shape": list(shape), "ctx": self.ctx() if ctx is None else ctx}
        if rows:
            out["stype"] = "row_sparse"
        return out

    def rows_value(self, shape, ctx=None, init: bool = False, count: int | None = None) -> dict:
        """A row-sparse value of ``shape``; for an ``init``, often one with every row;
        ``count`` rows when given (mostly: a push's devices push as many rows each, which
        keeps jaxkv's compilations few)."""
        rng = self.rng
        n = shape[0]
        desc = self.value(shape, ctx)
        desc["stype"] = "row_sparse"
        pick = rng.random()
        if init and pick < 0.35:
            desc["make"] = "ones"
            desc["fill"] = rng.choice([-2, -1, 1, 2, 3, 0.5])
            del desc["ramp"]
            return desc
        if pick < 0.08:
            desc["make"] = "tostype"
            return desc
        if pick < 0.11 and not init:
            desc.update(make="zeros")
            del desc["fill"], desc["ramp"]
            return desc
        desc["make"] = "rows"
        if init and rng.random() < 0.45:
            rows = list(range(n))
        elif count is not None and rng.random() < 0.85:
            rows = sorted(rng.sample(range(n), count))
        else:
            rows = sorted(rng.sample(range(n), rng.randint(0 if rng.random() < 0.04 else 1, n)))
        desc["rows"] = rows
        desc["ids_dtype"] = rng.choice(["int64", "float32"])
        return desc

    def out_tree(self, shape, rows_share: float) -> object:
        """One key's outs: one out or a list, each row-sparse with probability ``rows_share``."""
        rng = self.rng
        outs = [
            self.out(shape, rows=rng.random() < rows_share)
            for _ in range(rng.choice([1, 1, 1, 2, 3]))
        ]
        return self.per_key(outs)

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

    def push_values(self, keys: list, single: bool, op: dict, rows: frozenset = frozenset()):
        """Values for pushing ``keys`` (a list, maybe with duplicates), per MXNet's forms;
        row-sparse ones for the keys in ``rows``."""
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
            sparse = k in rows
            if n > 1 and self.buffer_rows.setdefault(k, sparse) != sparse:
                op.setdefault("defect", D10)
                op.setdefault("taint", []).append(k)
                op.setdefault("note", "a storage type other than the first push's")
            if self.updater is None:
                # MXNet stores the reduced value itself: a buffer it reuses when n > 1, and
                # always for row-sparse values.
                if sparse or n > 1:
                    self.aliased[k] = "rows" if sparse else "dense"
                else:
                    self.aliased.pop(k, None)
            elif (
                k in self.aliased
                and self.updater != "assign"
                and (n > 1 or sparse or self.aliased[k] == "rows")
            ):
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
        pushed: dict = {}  # key -> its value descriptions
        counts = {k: min(rng.choice([1, 2]), self.shapes[k][0]) for k in occurrences}
        for k in keys:
            i = seen.get(k, 0)
            seen[k] = i + 1
            shape = self.shapes[k]
            made = [
                self.rows_value_checked(shape, c, op, keys, count=counts[k])
                if k in rows
                else self.value(shape, c)
                for c in splits[k][i]
            ]
            pushed.setdefault(k, []).extend(made)
            values.append(self.per_key(made))
        for k, descs in pushed.items():
            self.model_push(k, descs, op)
        return values[0] if single else values

    def model_push(self, k, descs: list, op: dict) -> None:
        """What a push of ``descs`` to ``k`` does to MXNet's stored value's storage type."""
        sparse = row_sparse(descs[0])
        if self.updater is None:  # the stored value becomes the merged one, of the first's type
            self.stype[k] = "row_sparse" if sparse else "default"
            if sparse:
                union = {r for d in descs for r in stored_rows(d)}
                self.full[k] = union == set(range(self.shapes[k][0]))
        elif (
            self.updater == "optimizer"
            and self.stype.get(k) == "row_sparse"
            and not self.full.get(k)
            and sparse
        ):
            # (A dense gradient for such a weight falls back to a dense update, whose non-zero
            # rows MXNet then keeps: the weight is still counted as lacking rows.)
            op.setdefault("differs", X5)
            op.setdefault("taint", []).append(k)
            op.setdefault("taint_defect", X5)
            op.setdefault("note", "row-sparse gradient for a weight that lacks rows")

    def rows_value_checked(
        self, shape, ctx, op: dict, keys: list, init: bool = False, count: int | None = None
    ) -> dict:
        """A row-sparse value; in some programs, with unsorted (defect 7) or repeated (defect
        8) row ids, the op marked."""
        rng = self.rng
        desc = self.rows_value(shape, ctx, init=init, count=count)
        rows = desc.get("rows") or []
        if self.unsorted and len(rows) >= 2 and rng.random() < 0.3:
            while rows == sorted(rows):
                rng.shuffle(rows)
            op.setdefault("defect", D7)
            op.setdefault("note", "unsorted row ids")
            op["taint"] = sorted(set(op.get("taint", [])) | set(keys), key=str)
        if self.repeated and rows and rng.random() < 0.3:
            rows.insert(rng.randrange(len(rows) + 1), rng.choice(rows))
            op["defect"] = D8  # jaxkv refuses the whole call
            op["note"] = "a repeated row id"
            op["taint"] = sorted(set(op.get("taint", [])) | set(keys), key=str)
        return desc

    def device_values(self, k, shape) -> object:
        """Values for one key from as many devices as its first push (one if none yet)."""
        return self.per_key([self.value(shape, c) for c in self.contexts(self.counts.get(k, 1))])

    def outs(self, keys: list, single: bool, shape_of=None, rows_share: float = 0) -> object:
        """Outs for ``keys``; in rows programs, a table's outs are row-sparse with probability
        ``rows_share``."""
        shape_of = shape_of or (lambda k: self.shapes[k])
        share = lambda k: rows_share if self.rows and len(shape_of(k)) >= 2 else 0  # noqa: E731
        outs = [self.out_tree(shape_of(k), share(k)) for k in keys]
        return outs[0] if single else outs

    def keys_arg(self, keys: list, single: bool) -> object:
        return keys[0] if single else keys

    # -- valid ops ----------------------------------------------------------------------------
    def op_init(self, broadcast: bool = False) -> dict:
        rng = self.rng
        free = self.free()
        single = rng.random() < 0.6
        keys = [rng.choice(free)] if single else rng.sample(free, min(len(free), rng.randint(1, 3)))
        op: dict = {"op": "broadcast" if broadcast else "init", "key": self.keys_arg(keys, single)}
        shapes, values = {}, []
        for k in keys:
            if self.rows and rng.random() < 0.6:  # a table, often row-sparse
                shapes[k] = rng.choice(ROW_SHAPES)
                if rng.random() < 0.6:
                    v = self.rows_value_checked(shapes[k], self.ctx(), op, keys, init=True)
                    self.stype[k] = "row_sparse"
                    self.full[k] = sorted(set(stored_rows(v))) == list(range(shapes[k][0]))
                    values.append(self.per_key([v]))
                    continue
            else:
                shapes[k] = rng.choice(SHAPES)
            self.stype[k] = "default"
            values.append(self.per_key([self.value(shapes[k])]))
        op["value"] = values[0] if single else values
        if broadcast:
            op["out"] = self.outs(keys, single, shape_of=lambda k: shapes[k], rows_share=0.3)
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
        for k in keys:
            self.aliased.pop(k, None)
        return op

    def rows_keys(self, keys: list) -> frozenset:
        """Which of ``keys`` a push gives row-sparse values (rows programs, tables only, and
        only with no updater or an optimizer)."""
        if not self.rows or self.updater not in (None, "optimizer"):
            return frozenset()
        rng = self.rng
        tables = sorted({k for k in keys if len(self.shapes[k]) >= 2}, key=str)
        # Mostly the storage type of the key's earlier pushes (defect 10 otherwise).
        chosen = []
        for k in tables:
            if k in self.buffer_rows:
                sparse = self.buffer_rows[k] == (rng.random() < 0.9)
            else:
                sparse = rng.random() < 0.65
            if sparse:
                chosen.append(k)
        return frozenset(chosen)

    @staticmethod
    def group_parts(keys: list, rows: frozenset) -> list:
        """The optimizer groups jaxkv's push of ``keys`` updates: each key pushed row-sparse
        alone, the others together."""
        distinct = list(dict.fromkeys(keys))
        parts = [frozenset([k]) for k in distinct if k in rows]
        dense = frozenset(k for k in distinct if k not in rows)
        return parts + ([dense] if dense else [])

    def groups_ok(self, parts: list) -> bool:
        """Whether jaxkv accepts a push of ``parts`` under its optimizer groups (difference X4):
        always, since jaxkv updates key by key under MXNet's optimizers, as MXNet does (X4 is
        left for optax transformations, which the programs do not set)."""
        return True
        for part in parts:  # (optax's groups, kept for a program that sets an optax optimizer)
            touched = [g for g in self.groups if g & part]
            if touched and touched != [part]:
                return False
        return True

    def op_push(self, kind: str) -> dict:
        rng = self.rng
        known = self.known()
        for _ in range(6):  # under an optimizer, mostly pushes that jaxkv's groups accept
            single = rng.random() < 0.5
            keys = [rng.choice(known)] if single else self.key_list(known, True, pushed=True)
            if self.updater == "optimizer" and self.groups and rng.random() < 0.4:
                keys = sorted(rng.choice(self.groups), key=str)
                rng.shuffle(keys)
                single = len(keys) == 1 and rng.random() < 0.5
            rows = self.rows_keys(keys)
            parts = self.group_parts(keys, rows)
            if self.updater != "optimizer" or self.groups_ok(parts) or rng.random() < 0.1:
                break
        op: dict = {"op": kind, "key": self.keys_arg(keys, single)}
        if self.updater == "optimizer":
            if self.groups_ok(parts):
                self.groups += [p for p in parts if p not in self.groups]
            else:
                op["differs"] = X4
                op["note"] = "a push across jaxkv's optimizer groups"
                op["taint"] = sorted(set(keys), key=str)
                op["taint_defect"] = X4
        op["value"] = self.push_values(keys, single, op, rows)
        if kind == "pushpull":
            op["out"] = None if rng.random() < 0.3 else self.outs(keys, single, rows_share=0.3)
        self.fix_kind(keys)
        return op

    def op_pull(self) -> dict:
        rng = self.rng
        single = rng.random() < 0.5
        keys = [rng.choice(self.known())] if single else self.key_list(self.known(), True)
        self.fix_kind(keys)
        op = {
            "op": "pull",
            "key": self.keys_arg(keys, single),
            "out": self.outs(keys, single, rows_share=0.4),
        }
        if self.rows and rng.random() < 0.7:
            op["ignore_sparse"] = rng.random() < 0.4
        return op

    def row_ids(self, k, ctx: int) -> dict:
        """Row ids to pull of ``k``: often repeated and unsorted, as int64 or float32."""
        rng = self.rng
        n = self.shapes[k][0]
        if rng.random() < 0.3:
            ids = sorted(rng.sample(range(n), rng.randint(1, n)))
        else:
            ids = [rng.randrange(n) for _ in range(rng.randint(1, n + 2))]
        ctx = ctx if rng.random() < 0.8 else self.ctx()
        return {"ids": ids, "dtype": rng.choice(["int64", "float32"]), "ctx": ctx}

    def op_row_sparse_pull(self) -> dict:
        rng = self.rng
        tables = [k for k in self.known() if len(self.shapes[k]) >= 2]
        stored = [k for k in tables if self.stype.get(k) == "row_sparse"]
        pool = stored if stored and rng.random() < 0.9 else tables
        single = rng.random() < 0.6
        keys = [rng.choice(pool)] if single else self.key_list(pool, True)
        op: dict = {"op": "row_sparse_pull", "key": self.keys_arg(keys, single)}
        dense = rng.random() < 0.06  # one dense out (difference X1)
        outs, ids = [], []
        for k in keys:
            mine = [self.out(self.shapes[k], rows=True) for _ in range(rng.choice([1, 1, 2, 3]))]
            if dense:
                dense = False
                mine[rng.randrange(len(mine))].pop("stype")
                op["differs"] = X1
                op["note"] = "a dense out"
            per_out = [self.row_ids(k, o["ctx"]) for o in mine]
            shaped = self.per_key(mine)
            outs.append(shaped)
            if not isinstance(shaped, list):  # one out: one id array, or a list of one
                ids.append(per_out[0] if not single or rng.random() < 0.5 else [per_out[0]])
            elif single and rng.random() < 0.5:  # one id array for all the outs
                ids.append(per_out[0] if rng.random() < 0.6 else [per_out[0]])
            else:
                ids.append(per_out)
        if rng.random() < 0.03:
            where = ids[0] if isinstance(ids[0], dict) else ids[0][0]
            where["ids"].append(self.shapes[keys[0]][0])
            op["defect"] = D9
            op["note"] = "a row id out of range"
            op["taint"] = sorted(set(keys), key=str)  # MXNet reads past the table (it may abort)
        op["out"] = outs[0] if single else outs
        op["row_ids"] = ids[0] if single else ids
        if any(self.stype.get(k) != "row_sparse" for k in keys):
            op.setdefault("differs", X3)
            op.setdefault("note", "a key MXNet stores dense")
        self.fix_kind(keys)
        return op

    def op_set_updater(self) -> dict:
        self.updater = self.rng.choice(sorted(UPDATERS))
        return {"op": "set_updater", "name": self.updater}

    def op_set_optimizer(self) -> dict:
        rng = self.rng
        name = rng.choice(OPTIMIZERS)
        if name == "SGD":
            args: dict = {
                "learning_rate": rng.choice([0.5, 0.25, 0.1]),
                "momentum": rng.choice([0.0, 0.0, 0.5, 0.9]),
                "wd": rng.choice([0.0, 0.0, 0.01, 0.1]),
            }
        else:
            args = {
                "learning_rate": rng.choice([0.1, 0.01]),
                "beta1": rng.choice([0.9, 0.8]),
                "beta2": rng.choice([0.999, 0.99]),
                "wd": rng.choice([0.0, 0.0, 0.01]),
            }
        if rng.random() < 0.3:
            args["rescale_grad"] = rng.choice([0.5, 0.25])
        if rng.random() < 0.25:
            args["clip_gradient"] = rng.choice([1.0, 2.5])
        if rng.random() < 0.7:
            args["lazy_update"] = rng.random() < 0.5
        op = {"op": "set_optimizer", "name": name, "args": args}
        self.scheduled = rng.random() < 0.35
        if self.scheduled:  # a learning-rate schedule, driven by the optimizer's num_update
            op["scheduler"] = rng.choice(SCHEDULES)
            if rng.random() < 0.5:  # SGD then runs from the schedule's base_lr
                args.pop("learning_rate")
        self.updater = "optimizer"
        self.groups = []  # a new optimizer: jaxkv drops the groups and their states
        self.approx = True
        return op

    def op_set_learning_rate(self) -> dict:
        """``opt.set_learning_rate(lr)`` on the store's optimizer (MXNet raises under a
        schedule, and so must jaxkv), or ``opt.lr = lr``."""
        how = "set_learning_rate" if self.rng.random() < 0.7 else "lr"
        return {"op": "set_learning_rate", "how": how, "lr": self.rng.choice([0.3, 0.05, 0.01])}

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
            if not self.rows:
                choices.append((6, self.op_set_updater))
            if self.optimizers:
                # Early, before pushes (with no updater) leave MXNet's values aliased (defect 6).
                early = self.updater is None and not self.pushed
                choices.append((25 if early else 3, self.op_set_optimizer))
                if self.updater == "optimizer":
                    choices.append((3 if self.scheduled else 2, self.op_set_learning_rate))
            if any(len(self.shapes[k]) >= 2 for k in known) and self.rows:
                # Mostly of keys MXNet stores row-sparse (it refuses the others: X3).
                stored = any(self.stype.get(k) == "row_sparse" for k in known)
                choices.append((20 if stored else 1.5, self.op_row_sparse_pull))
            choices += [
                (25, lambda: self.op_push("push")),
                (22, self.op_pull),
                (10, lambda: self.op_push("pushpull")),
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
            op = self.next_op()
            self.pushed = self.pushed or op["op"] in ("push", "pushpull")
            if self.approx:
                op["approx"] = True
            ops.append(op)
        features = [f for f, on in (("rows", self.rows), ("optimizer", self.optimizers)) if on]
        return {
            "id": self.seed,
            "store": store,
            "key_kind": self.kind,
            "features": features,
            "ops": ops,
        }


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
