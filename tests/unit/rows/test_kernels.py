"""jaxkv/_src/rows/kernels.py: the all-to-all route of each id, edges included, and an
updater's own errors where the touched rows are updated."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.rows import kernels


def _plan(ids, block, parts, c):
    dest, local = kernels.plan(np.asarray(ids, np.int32), block, parts, c)
    return np.asarray(dest).tolist(), np.asarray(local).tolist()


def test_a_route_exactly_full_puts_every_id_in_its_own_slot():
    # 2 owners of 4 rows each, C = 3 slots per owner; this device asks owner 0 for exactly 3.
    dest, local = _plan([2, 0, 1], block=4, parts=2, c=3)
    assert dest == [0, 1, 2]
    assert local == [2, 0, 1, 4, 4, 4]  # owner 1's slots unused (4: the block, no row)


def test_full_routes_to_every_owner_and_padding():
    # Owner 1 gets rows 5, 7, 4 (as its rows 1, 3, 0); -1 and 8 lie outside the table.
    dest, local = _plan([5, 1, 7, -1, 0, 4, 8], block=4, parts=2, c=3)
    assert dest == [3, 0, 4, 6, 1, 5, 6]
    assert local == [1, 0, 4, 1, 3, 0]


@pytest.mark.parametrize("c", [3, 4])
def test_a_route_with_room_to_spare(c):
    dest, local = _plan([6, 6], block=4, parts=2, c=c)
    assert dest == [c, c + 1]
    assert local == [4] * c + [2, 2] + [4] * (c - 2)


def test_duplicate_ids_are_summed_once_and_ids_outside_the_table_update_nothing():
    ids = np.array([3, 0, 3, 5, -1, 0, 3, 4], np.int32)  # 5 rows: 5 and -1 lie outside
    rows = np.arange(16, dtype=np.float32).reshape(8, 2)
    unique, summed = kernels.dedupe(ids, rows, 5)
    unique, summed = np.asarray(unique), np.asarray(summed)
    assert unique.tolist() == [0, 3, 4, 5, 5, 5, 5, 5]  # distinct ids, padded with 5
    np.testing.assert_array_equal(summed[0], rows[1] + rows[5])
    np.testing.assert_array_equal(summed[1], rows[0] + rows[2] + rows[6])
    np.testing.assert_array_equal(summed[2], rows[7])
    table = np.asarray(kernels.put(jnp.zeros((5, 2), jnp.float32), unique, summed))
    np.testing.assert_array_equal(table[[1, 2]], 0)  # nothing but ids 0, 3 and 4 changed


def test_rows_outside_a_block_read_as_zeros_and_writes_there_are_dropped():
    block = jnp.arange(6, dtype=jnp.float32).reshape(3, 2) + 1  # rows 4, 5, 6 of a table
    got = np.asarray(kernels.take(block, np.array([3, 4, 6, 7]), lo=4))
    np.testing.assert_array_equal(got, [[0, 0], [1, 2], [5, 6], [0, 0]])
    put = np.asarray(kernels.put(block, np.array([3, 6, 7]), np.full((3, 2), 9.0), lo=4))
    np.testing.assert_array_equal(put, [[1, 2], [3, 4], [9, 9]])


@pytest.mark.standard_promotion  # (optax's Adam)
def test_summed_rows_update_through_ids_told_sorted_and_distinct_as_a_model_of_lazy_adam():
    # The ids a push sums (several pairs, or an owner's rows from every device) come out of the
    # sum sorted and distinct; the padding after them made distinct past the table, the
    # optimizer's gathers and scatters are told so, as a push of distinct ids is.
    import jax

    table = np.random.default_rng(1).normal(size=(16, 4)).astype(np.float32)
    ids = np.array([9, 2, 9, -1, 15, 2, 16, 0], np.int32)  # repeated, outside the table
    rows = np.arange(32, dtype=np.float32).reshape(8, 4) / 10
    opt = optax.adam(0.1)
    state = opt.init({"e": jnp.asarray(table)})

    def run(t, s, i, r):
        return kernels.update_rows("e", kernels.Where(), t, s, i, r, 16, opt)[:2]

    new, new_state = jax.jit(run)(jnp.asarray(table), state, ids, rows)
    grad = np.zeros_like(table)
    for i, r in zip(ids, rows):
        if 0 <= i < 16:
            grad[i] += r
    touched = np.array([0, 2, 9, 15])
    updates, dense_state = opt.update({"e": jnp.asarray(grad)}, state, {"e": jnp.asarray(table)})
    want = np.asarray(optax.apply_updates({"e": jnp.asarray(table)}, updates)["e"])
    np.testing.assert_allclose(np.asarray(new)[touched], want[touched], rtol=1e-6)
    rest = np.setdiff1d(np.arange(16), touched)
    np.testing.assert_array_equal(np.asarray(new)[rest], table[rest])  # lazy: only those rows
    for got, model in zip(jax.tree.leaves(new_state), jax.tree.leaves(dense_state)):
        if np.ndim(model) == 2:  # a moment: its touched rows, the others as they were (zeros)
            np.testing.assert_allclose(np.asarray(got)[touched], np.asarray(model)[touched])
            np.testing.assert_array_equal(np.asarray(got)[rest], 0.0)
    hlo = jax.jit(run).lower(jnp.asarray(table), state, ids, rows).compile().as_text()
    assert hlo.count("unique_indices=true") >= 3  # the scatters of the rows, m and v
    assert hlo.count("indices_are_sorted=true") >= 6  # and their gathers (none before)


# -- a big table's rows touched a cache line at a time before they are gathered -------------------
def _gathers(fn, *args):
    import jax

    # (a function of its own each time: JAX would reuse a trace of ``fn`` made under another
    # bound)
    return jax.jit(lambda *a: fn(*a)).lower(*args).compile().as_text().count(" gather(")


@pytest.mark.parametrize("big", [False, True])
def test_a_big_tables_gather_touches_its_rows_first_and_reads_the_same_rows(monkeypatch, big):
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the rows are touched first on a CPU only")
    table = np.random.default_rng(0).normal(size=(64, 48)).astype(np.float32)  # 3 lines a row
    table[5] = 0.0  # a row of zeros (the touch tests its elements against zero)
    table[7, 0] = np.nan
    # (a small table here, the bound lowered: what a table of 16 MiB or more does)
    monkeypatch.setattr(kernels, "TOUCH_MIN_BYTES", table.nbytes if big else table.nbytes + 1)
    x = jnp.asarray(table)
    ids = np.array([9, 5, 70, 7, -3, 63, 5], np.int32)  # repeated, past the table, negative
    got = np.asarray(kernels.take(x, ids))
    want = np.where(((ids >= 0) & (ids < 64))[:, None], table[np.clip(ids, 0, 63)], 0.0)
    np.testing.assert_array_equal(got, want)
    block = np.asarray(kernels.take(x, ids, lo=4))  # the table as rows 4.. of a bigger one
    inside = (ids - 4 >= 0) & (ids - 4 < 64)
    np.testing.assert_array_equal(
        block, np.where(inside[:, None], table[np.clip(ids - 4, 0, 63)], 0.0)
    )
    # sorted distinct ids, padded past the table: the one-device push's gather
    ordered = np.array([0, 5, 7, 40, 63, 64, 65], np.int32)
    got = np.asarray(kernels._Sorted().take(x, ordered))
    np.testing.assert_array_equal(got[:5], table[ordered[:5]])
    np.testing.assert_array_equal(got[5:], 0.0)
    # a negative first id (the touch's zero is made of it) changes none of the ids
    first = np.array([-3, 9, 64, 6], np.int32)  # 64 past the table: read as zeros
    np.testing.assert_array_equal(
        np.asarray(kernels._touched(x, jnp.asarray(first))),
        first,  # noqa: SLF001
    )
    # XLA keeps the touch (a gather more than without it), only where the table is big enough
    for fn, i in [(kernels.take, ids), (kernels._Sorted().take, ordered)]:
        with_touch = _gathers(fn, x, i)
        monkeypatch.setattr(kernels, "TOUCH_MIN_BYTES", 1 << 62)
        assert with_touch == _gathers(fn, x, i) + (1 if big else 0)
        monkeypatch.setattr(kernels, "TOUCH_MIN_BYTES", table.nbytes if big else table.nbytes + 1)


@pytest.mark.parametrize("width", [16, 40])
def test_rows_of_one_cache_line_or_part_of_one_are_gathered_without_a_touch(monkeypatch, width):
    # 64-byte rows: the gather itself reads each line once; 160: the last line is a part
    x = jnp.ones((64, width), jnp.float32)
    ids = np.arange(8, dtype=np.int32)
    plain = _gathers(kernels.take, x, ids)
    monkeypatch.setattr(kernels, "TOUCH_MIN_BYTES", 0)
    assert _gathers(kernels.take, x, ids) == plain


# -- an updater's own errors, where update_rows runs it -------------------------------------------
def _raising(key, pushed, stored):
    raise ValueError("this updater refuses")


def _returning_none(key, pushed, stored):
    return None


def _returning_a_row(key, pushed, stored):
    return stored[0]


def _update_raising(updates, state, params=None):
    raise ValueError("this optimizer refuses")


def _update_rows(updater, opt_state=None):
    table = jnp.arange(8, dtype=jnp.float32).reshape(4, 2)
    ids = jnp.array([1, 3, 1], jnp.int32)
    return kernels.update_rows(
        "e", kernels.Where(), table, opt_state, ids, jnp.ones((3, 2)), 4, updater
    )


def test_an_updater_that_raises_is_a_kvstore_error_naming_the_key_and_the_updater():
    with pytest.raises(jaxkv.KVStoreError, match=r"key 'e': the updater _raising raised Val") as e:
        _update_rows(_raising)
    assert isinstance(e.value.__cause__, ValueError)


def test_an_optax_update_that_raises_is_a_kvstore_error_naming_the_key_and_the_optimizer():
    tx = optax.GradientTransformation(optax.init_empty_state, _update_raising)
    with pytest.raises(jaxkv.KVStoreError, match=r"'e'.*the optimizer .*_update_raising") as e:
        _update_rows(tx, optax.EmptyState())
    assert isinstance(e.value.__cause__, ValueError)


def test_an_updater_that_returns_none_or_another_shape_is_named():
    with pytest.raises(jaxkv.KVStoreError, match=r"the updater _returning_none returned None"):
        _update_rows(_returning_none)
    with pytest.raises(jaxkv.ShapeError, match=r"\(the updater: _returning_a_row\)"):
        _update_rows(_returning_a_row)


# -- the processes' agreement riding in a routed push's first all-to-all ---------------------------
def _routed(dtype, words=None, back=0):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()[:4]
    mesh = Mesh(np.array(devices), ("d",))
    split = NamedSharding(mesh, PartitionSpec("d"))
    rng = np.random.default_rng(5)
    table = jax.device_put(jnp.asarray(rng.normal(size=(32, 4)), dtype), split)
    opt = optax.adam(0.1)
    state = opt.init({"e": table})
    # 6 ids a device: repeated within and across devices, and padding (-1)
    ids = rng.integers(-1, 32, size=24).astype(np.int32)
    rows = jnp.asarray(rng.normal(size=(24, 4)), dtype)
    fn = kernels.routed_push(mesh, "d", "e", opt, False, 6, back, 0 if words is None else 7)
    more = () if words is None else (jax.device_put(np.asarray(words, np.int32).ravel(), split),)
    out = fn(table, state, jax.device_put(ids, split), jax.device_put(rows, split), None, *more)
    return (table, state), out


@pytest.mark.standard_promotion  # (optax's Adam)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])  # ids a column of the rows, or apart
def test_a_routed_push_whose_processes_agree_updates_as_one_without_an_agreement(dtype):
    import jax

    words = np.tile(np.array([kernels.AGREE, 7, 9, -1, 2**30, 5, 6], np.int32), (4, 1))
    _, want = _routed(dtype)
    _, got = _routed(dtype, words)
    assert np.asarray(got[-1]).tolist() == [True] * 4  # agreed, on every device
    for a, b in zip(jax.tree.leaves(got[:-1]), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.standard_promotion
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("who", [0, 3])
@pytest.mark.parametrize("why", ["a word differs", "refused"])
def test_a_routed_push_whose_processes_disagree_changes_nothing_and_says_so_everywhere(
    dtype, who, why
):
    # One device's agreement differs from the others' (a digest, a count that does not fit)
    # or says it refuses: the table and every leaf of its optimizer state (the step count too)
    # are as they were, and every device says they did not agree.
    import jax

    words = np.tile(np.array([kernels.AGREE, 7, 9, -1, 2**30, 5, 6], np.int32), (4, 1))
    if why == "refused":
        words[who, 0] = 1
    else:
        words[who, 6] = 8  # (the last word: the one past the first row behind the rows)
    before, got = _routed(dtype, words)
    assert np.asarray(got[-1]).tolist() == [False] * 4
    for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- a push into a table kept whole on every device, from every device ---------------------------
def _collectives(text):
    return sum(text.count(f" {op}(") for op in ("all-gather", "all-reduce", "all-to-all"))


@pytest.mark.standard_promotion  # (optax's Adam)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])  # ids a column of the rows, or apart
def test_a_push_into_a_whole_table_from_every_device_is_one_gather_and_sums_as_numpy(dtype):
    """Each device's ids and rows (repeated within and across devices, padding -1) reach every
    device in one all-gather (where XLA alone gathered the ids and all-reduced the scattered
    rows: two collectives, each a wait for every process across processes), and the table and
    Adam's moments are those of the summed rows, as NumPy sums them."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    split = NamedSharding(mesh, PartitionSpec("d"))
    whole = NamedSharding(mesh, PartitionSpec())
    rng = np.random.default_rng(9)
    start = rng.normal(size=(32, 4)).astype(np.float32)
    table = jax.device_put(jnp.asarray(start, dtype), whole)
    opt = optax.adam(0.1)
    state = jax.device_put(opt.init({"e": table}), whole)
    ids = rng.integers(-1, 32, size=24).astype(np.int32)  # 6 a device
    rows = rng.normal(size=(24, 4)).astype(np.float32)
    fn = kernels.own_push(mesh, "d", "e", 32, False, opt, False)
    pushed = jax.device_put(jnp.asarray(rows, dtype), split)
    args = (table, state, jax.device_put(ids, split), pushed)
    text = fn.lower(*args, None).compile().as_text()
    assert _collectives(text) == (1 if jnp.dtype(dtype).itemsize == 4 else 2), text
    got, new_state = fn(*args, None)
    # the model: each distinct valid id's rows summed, then Adam on those rows alone (lazy)
    valid = ids >= 0
    summed = np.zeros((32, 4), np.float32)
    np.add.at(summed, ids[valid], np.asarray(jnp.asarray(rows, dtype), np.float32)[valid])
    touched = np.unique(ids[valid])
    grads = {"e": jnp.asarray(summed[touched], dtype)}
    old = {"e": jnp.asarray(start, dtype)[touched]}
    sub = jax.tree.map(lambda x: x[touched] if x.ndim == 2 else x, opt.init(old))
    updates, _ = opt.update(grads, sub, old)
    want = np.asarray(jnp.asarray(start, dtype)).copy()
    want[touched] = np.asarray(optax.apply_updates(old, updates)["e"])
    np.testing.assert_allclose(np.asarray(got, np.float32), want.astype(np.float32), rtol=1e-6)
    untouched = np.setdiff1d(np.arange(32), touched)
    mu = np.asarray(new_state[0].mu["e"])
    assert np.array_equal(mu[untouched], np.zeros((untouched.size, 4)))
