"""jaxkv/_src/core/collectives.py and verified.py across processes on CPU devices: the
reduce-scatter that replaces gloo's (an all-to-all and a sum; over several axes an all-reduce and
a slice) gives lax.psum_scatter's values, all_gather's gradient is that sum, and verified sums
pass right sums and refuse wrong ones, naming the values and the device whose part was wrong, at
whole at every run or an N-th of each at every run.

One process stands in for a job: ``reduce_scatter_safe`` and ``JAXKV_VERIFY_SUMS`` are set as
across processes on CPU devices."""

import functools
import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxkv._src.core import collectives, verified
from jaxkv._src.state import policy

N = 4  # devices


@pytest.fixture
def as_across_processes(monkeypatch):
    monkeypatch.setattr(collectives, "reduce_scatter_safe", lambda: False)
    monkeypatch.setenv(verified.ENV_VERIFY_SUMS, "1")


@pytest.fixture(autouse=True)
def _no_failed_arrays_left():
    """The wrong sums' arrays, held by the caught errors' tracebacks (a cycle with the test's
    frame), freed with the test: a later test's ``nd.waitall`` would raise their errors."""
    yield
    gc.collect()


def _mesh():
    return Mesh(np.array(jax.devices("cpu")[:N]), ("kv",))


def _run(fn, x):
    body = jax.shard_map(fn, mesh=_mesh(), in_specs=P("kv"), out_specs=P("kv"))
    return np.asarray(jax.jit(body)(x))


def _blocks(shape, seed=0):
    return (
        np.random.default_rng(seed).integers(-50, 50, (N * shape[0], *shape[1:])).astype(np.float32)
    )


@pytest.mark.parametrize("tiled", [True, False])
def test_the_all_to_all_in_place_of_a_reduce_scatter_gives_its_values(as_across_processes, tiled):
    x = _blocks((N * 3, 5)) if tiled else _blocks((N, 6))

    def fn(safe, b):
        if safe:
            return jax.lax.psum_scatter(b, "kv", scatter_dimension=0, tiled=tiled)
        return collectives.psum_scatter(b, "kv", tiled=tiled, what="key 'w'")

    want = _run(functools.partial(fn, True), x)
    got = _run(functools.partial(fn, False), x)
    np.testing.assert_array_equal(got, want)
    assert collectives.reduce_scatter_safe() is False


@pytest.mark.parametrize("dim", [0, 1])
def test_over_two_axes_or_along_another_dimension_it_gives_the_same_values(
    as_across_processes, dim
):
    """Over a 2 x 2 mesh's two axes at once (an all-reduce and a slice), and along axis 1 of
    the value (the all-to-all), the values of ``lax.psum_scatter``."""
    mesh = Mesh(np.array(jax.devices("cpu")[:N]).reshape(2, 2), ("a", "b"))
    x = _blocks((N * 2, 8))
    for axis in (("a", "b"), "b"):

        def fn(b, safe, axis=axis):
            if safe:
                return jax.lax.psum_scatter(b, axis, scatter_dimension=dim, tiled=True)
            return collectives.psum_scatter(b, axis, scatter_dimension=dim, tiled=True)

        def run(safe, axis=axis):
            body = jax.shard_map(
                functools.partial(fn, safe=safe),
                mesh=mesh,
                in_specs=P(("a", "b")),
                out_specs=P(("a", "b")),
            )
            return np.asarray(jax.jit(body)(x))

        np.testing.assert_array_equal(run(False), run(True), err_msg=str(axis))


def test_the_gathers_gradient_is_the_sum_of_every_devices_gradient(as_across_processes):
    x = _blocks((3, 4))
    data = _blocks((N * 3, 4), seed=1)  # device d's data: rows d*N*3 .. (d+1)*N*3

    def grads(gather):
        def fn(block, mine):
            return jax.grad(lambda b: jnp.sum(gather(b) * mine))(block)

        body = jax.shard_map(fn, mesh=_mesh(), in_specs=(P("kv"), P("kv")), out_specs=P("kv"))
        return np.asarray(jax.jit(body)(x, data))

    got = grads(lambda b: collectives.all_gather(b, "kv", tiled=True, what="key 'w'"))
    want = grads(lambda b: jax.lax.all_gather(b, "kv", tiled=True))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, data.reshape(N, N * 3, 4).sum(0))


@pytest.mark.parametrize("kind", ["reduce-scatter", "all-reduce"])
def test_a_right_sum_passes_its_checksum(as_across_processes, kind):
    x = np.random.default_rng(2).standard_normal((N * N * 64, 33)).astype(np.float32) * 1e3

    def fn(b):
        if kind == "all-reduce":
            return collectives.fused_psum([b], "kv", what="key 'w'")[0]
        return collectives.psum_scatter(b, "kv", tiled=True, what="key 'w'")

    got = _run(fn, x)
    whole = x.reshape(N, N * 64, 33).sum(0, dtype=np.float64)
    np.testing.assert_allclose(got.reshape(-1, 33)[: N * 64], whole, rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("wrong", [1, 0, 3])
def test_a_wrong_part_of_a_sum_fails_its_checksum_naming_the_key_and_device(
    as_across_processes, wrong
):
    """The reduce-scatter's defect: a few elements at the end of one device's part."""
    x = _blocks((N * 256, 8))

    def fn(b):
        out = jax.lax.psum_scatter(b, "kv", scatter_dimension=0, tiled=True)
        me = jax.lax.axis_index("kv")
        out = out.at[-1, -3:].add(jnp.where(me == wrong, 7.0, 0.0))
        verified.check_sum(b, out, "kv", "key 'w'", owners=(0, 0, 1, 1))
        return out

    with pytest.raises(Exception, match="SumError") as caught:
        _run(fn, x)
    text = str(caught.value)
    assert "key 'w'" in text and f"device {wrong} (process {(0, 0, 1, 1)[wrong]})" in text
    assert "segment 63 of 64" in text


@pytest.mark.parametrize("wrong", [None, 0, 1])
def test_several_sums_are_checked_with_one_all_gather_naming_the_wrong_one(
    as_across_processes, wrong
):
    """A push of many keys across processes: every key's check rides one all-gather."""
    xs = [_blocks((1, 8)), _blocks((1, 16), seed=1)]

    def step(wrong):
        def fn(a, b):
            outs = [jax.lax.psum(a, "kv"), jax.lax.psum(b, "kv")]
            if wrong is not None:
                me = jax.lax.axis_index("kv")
                outs[wrong] = outs[wrong].at[0, -1].add(jnp.where(me == 2, 9.0, 0.0))
            verified.check_sums([(a, outs[0], "key 'a'"), (b, outs[1], "key 'b'")], "kv")
            return outs

        return jax.jit(jax.shard_map(fn, mesh=_mesh(), in_specs=P("kv"), out_specs=P("kv")))

    body = step(wrong)
    assert body.lower(*xs).as_text().count("stablehlo.all_gather") == 1
    if wrong is None:
        got = body(*xs)
        np.testing.assert_array_equal(np.asarray(got[0])[:1], xs[0].sum(0, keepdims=True))
        return
    with pytest.raises(Exception, match="SumError") as caught:
        jax.block_until_ready(body(*xs))
    assert f"key '{'ab'[wrong]}'" in str(caught.value) and "device 2" in str(caught.value)
    # A right run after it leaves no error behind for the process's exit to raise again.
    jax.block_until_ready(step(None)(*xs))
    jax.effects_barrier()


def test_a_non_finite_sum_is_not_refused(as_across_processes):
    x = _blocks((N, 8))
    x[0, 0] = np.inf
    got = _run(lambda b: collectives.psum_scatter(b, "kv", tiled=True, what="key 'w'"), x)
    assert np.isinf(got[0, 0])


def test_the_checksums_compare_on_the_host():
    """``_compare`` directly: the tolerance follows the dtype's rounding and the scale."""
    totals = np.array([[[10.0, 20.0]], [[1e3, 1e3]]])  # expected, scale: 1 part, 2 segments
    verified._compare(  # noqa: SLF001
        totals,
        np.array([[10.0, 20.0], [10.0, 20.0]]),
        what="w",
        owners=None,
        eps=1e-7,
        devices=2,
        whole=True,
    )
    with pytest.raises(verified.SumError, match=r"device 1: in segment 1 of 2"):
        verified._compare(  # noqa: SLF001
            totals,
            np.array([[10.0, 20.0], [10.0, 21.0]]),
            what="w",
            owners=None,
            eps=1e-7,
            devices=2,
            whole=True,
        )


@pytest.mark.parametrize(
    ("where", "caught"),
    [
        ((0, 0), [True, False, False, True, False, False, True]),  # the first slice of a segment
        ((-1, -1), [False, False, True, False, False, True, False]),  # the last
        (None, [True] * 7),  # the whole part wrong
    ],
)
def test_each_run_checks_another_nth_of_every_segment(
    as_across_processes, monkeypatch, where, caught
):
    """``JAXKV_VERIFY_SUMS=3``: each run checks a third of each segment of each sum, the next
    third at the next run, so that in 3 runs every element has been checked; a part that is
    wrong throughout is caught at every run."""
    monkeypatch.setenv(verified.ENV_VERIFY_SUMS, "3")
    x = _blocks((N * 6144, 8))  # each device's part: 64 segments of 768 elements, in 3 slices

    def fn(b):
        out = jax.lax.psum_scatter(b, "kv", scatter_dimension=0, tiled=True)
        off = jnp.where(jax.lax.axis_index("kv") == 1, 5.0, 0.0)
        out = out + off if where is None else out.at[where].add(off)
        verified.check_sum(b, out, "kv", "key 'w'")
        return out

    step = jax.jit(jax.shard_map(fn, mesh=_mesh(), in_specs=P("kv"), out_specs=P("kv")))
    # No conditional takes the values summed: the only one calls the host with the checksums.
    assert step.lower(x).as_text().count("stablehlo.case") == 1
    raised = []
    for _ in range(7):
        try:
            jax.block_until_ready(step(x))
        except Exception as e:  # noqa: BLE001 (JAX raises the callback's SumError in its own)
            assert "SumError" in str(e) and "device 1" in str(e), str(e)
            raised.append(True)
        else:
            raised.append(False)
    assert raised == caught
    # After a failed run, a run that passes leaves no error behind: a later barrier, and the
    # process's exit, no longer raise the old SumError.
    if not all(caught):
        while True:
            try:
                jax.block_until_ready(step(x))
                break
            except Exception:  # noqa: BLE001, S112 (a run whose slice holds the wrong element)
                continue
        jax.effects_barrier()


def test_a_pushs_sums_share_one_check(as_across_processes, monkeypatch):
    """``sum_over_devices`` of big blocks reduce-scattered one by one, big ones all-reduced and
    small ones fused: one all-gather of the checksums for them all, and one count of the runs,
    whether every sum is checked whole or a slice of each."""
    big = policy.SCATTER_FUSE_BELOW
    xs = [_blocks((big // 8, 8)), _blocks((N, 8), seed=1), _blocks((N * 4, 3), seed=2)]

    for setting, callbacks in (("1", 1), ("10", 2)):  # the report; and the count of runs
        monkeypatch.setenv(verified.ENV_VERIFY_SUMS, setting)

        def fn(a, b, c):
            return tuple(collectives.sum_over_devices([a, b, c], [True, False, True], "kv"))

        body = jax.jit(jax.shard_map(fn, mesh=_mesh(), in_specs=P("kv"), out_specs=P("kv")))
        text = body.lower(*xs).as_text()
        assert text.count("stablehlo.all_gather") == 1, setting
        assert len(re.findall(r"custom_call @\w*python_cpu_callback", text)) == callbacks
        got = body(*xs)
        want = xs[0].reshape(N, -1, 8).sum(0)
        np.testing.assert_allclose(np.asarray(got[0]).reshape(N, -1, 8)[0], want[: big // 8 // N])


@pytest.mark.parametrize(
    ("setting", "every"), [("0", 0), ("1", 1), ("7", 7), (" 2 ", 2), ("", 0), (None, 0)]
)
def test_verify_every_reads_its_setting(monkeypatch, setting, every):
    if setting is None:
        monkeypatch.delenv(verified.ENV_VERIFY_SUMS, raising=False)
    else:
        monkeypatch.setenv(verified.ENV_VERIFY_SUMS, setting)
    assert verified.verify_every() == every  # unset in one process: none
    assert verified.verify_sums() == (every > 0)


@pytest.mark.parametrize("setting", ["yes", "-1", "1.5"])
def test_a_setting_that_is_not_a_count_is_refused(monkeypatch, setting):
    monkeypatch.setenv(verified.ENV_VERIFY_SUMS, setting)
    with pytest.raises(verified.KVStoreError, match="JAXKV_VERIFY_SUMS"):
        verified.verify_every()


@pytest.mark.parametrize("layout", ["keys", "flat"])
@pytest.mark.parametrize("wrong", [None, 1])
def test_jaxkvs_own_push_has_no_host_callback_and_a_wrong_sum_raises_at_the_next_call(
    as_across_processes, monkeypatch, layout, wrong
):
    """jaxkv's own eager push (core/checked.py): its computation holds no host callback (one
    makes XLA:CPU run it synchronously at dispatch), its checks' verdicts come back as outputs,
    and a wrong part of a sum raises SumError, naming the key and the device, at the next call
    of jaxkv once the push has finished (or at an MXNet out's read); right sums raise nothing."""
    import jaxkv
    from jaxkv._src.core import checked

    real = collectives._all_to_all_sum

    def corrupted(x, axis, dim):
        out = real(x, axis, dim)
        return out + jnp.where(jax.lax.axis_index(axis) == wrong, 7.0, 0.0)

    if wrong is not None:
        monkeypatch.setattr(collectives, "_all_to_all_sum", corrupted)
    devices = jax.devices("cpu")[:N]
    store = jaxkv.empty(devices, layout=layout, bigarray_bound=64)  # reduce-scattered
    shape = (N * 8, 16 if wrong is None else 32)  # (a computation of its own: none cached)
    state = jaxkv.init(store, {"w": jnp.zeros(shape)})
    grads = [jax.device_put(np.full(shape, d + 1, np.float32), devices[d]) for d in range(N)]
    traced = []
    monkeypatch.setattr(jax.debug, "callback", lambda *a, **k: traced.append(a))
    state = jaxkv.push(state, "w", grads)
    assert traced == []  # no host callback traced into jaxkv's own computation
    jax.block_until_ready(state)
    if wrong is None:
        state = jaxkv.push(state, "w", grads)
        checked.settle(wait=True)
        np.testing.assert_array_equal(
            np.asarray(jaxkv.pull(state, "w")), np.full((N * 8, 16), 10)
        )  # the sum replaces
        return
    # (the computation serves every key of its shapes: the key is the push's, named at the
    # later call that finds the wrong sum)
    said = rf"^key 'w': .* failed its checksum on device {wrong}:"
    with pytest.raises(verified.SumError, match=said):
        jaxkv.push(state, "w", grads)
    checked.settle(wait=True)  # nothing left for the process's exit


def test_a_jaxkv_computation_with_no_check_is_a_plain_jit_and_one_with_a_check_stays_checked(
    as_across_processes,
):
    """``checked.jit``: a computation whose trace holds no checked sum (a row kernel that only
    gathers) runs as a plain jit, with no run count passed and no verdicts returned; one
    whose trace holds a check keeps returning its verdicts, compared at the next call."""
    from jaxkv._src.core import checked

    mesh = _mesh()
    x = jnp.asarray(_blocks((N * 4, 3)))

    def gathers(b):
        return jax.lax.all_gather(b, "kv", tiled=True)[:4]

    def sums(b):
        return collectives.psum_scatter(b, "kv", tiled=True, what="key 'w'")

    plain = checked.jit(
        checked.shard_map(gathers, mesh=mesh, in_specs=P("kv"), out_specs=P("kv")),
        verified.verify_every(),
    )
    summing = checked.jit(
        checked.shard_map(sums, mesh=mesh, in_specs=P("kv"), out_specs=P("kv")),
        verified.verify_every(),
    )
    for _ in range(2):
        got = plain(x)
        np.testing.assert_array_equal(np.asarray(got), np.tile(np.asarray(x)[:4], (N, 1)))
    assert plain.plain is not None and next(plain.runs) == 0  # no count, no verdicts
    before = len(checked._pending)
    summing(x)
    assert summing.plain is None and len(checked._pending) == before + 1
    checked.settle(wait=True)


# -- the keys each device's call sums, compared in the same all-gather ----------------------------
def test_the_keys_digest_is_the_same_in_any_order_and_another_for_other_keys():
    from jaxkv._src.core import checked

    d = checked.digest(["a", "b", 3])
    assert d == checked.digest([3, "b", "a"]) == checked.digest({"b": 0, 3: 1, "a": 2})
    assert 0 < d < 2**24  # (exact in float32)
    assert len({checked.digest(k) for k in ("a", "b", ["a"], ["a", "a"], 3, "3")}) == 5
    assert checked.digest("a") == checked.digest(["a"])
    assert checked.digest(None) == 0


@pytest.mark.parametrize("other", [None, 0, 3])
def test_a_sum_whose_devices_summed_other_keys_fails_its_check_naming_them(
    as_across_processes, monkeypatch, other
):
    """In jaxkv's own computations each device's keys (one process's call: the same on its
    devices) ride in the checksums' all-gather: a device whose keys differ (another process
    pushing another key of the same shape, played here by one device's digest) fails the
    check, though the sum itself is right, naming the keys of this call."""
    from jaxkv._src.core import checked

    digest = checked.keys_digest

    def per_device():  # device ``other`` made another call than the rest
        mine = digest()
        if other is None:
            return mine
        return jnp.where(jax.lax.axis_index("kv") == other, mine + 1, mine)

    monkeypatch.setattr(checked, "keys_digest", per_device)
    x = _blocks((N, 8))

    def fn(b):
        out = jax.lax.psum(b, "kv")
        verified.check_sum(b, out, "kv", "an all-reduce")
        return out

    split = P("kv")
    mapped = checked.shard_map(fn, mesh=_mesh(), in_specs=split, out_specs=split)
    body = checked.jit(mapped, verified.verify_every())
    with checked.naming(["w", "v"]):
        got = body(jax.device_put(x, jax.sharding.NamedSharding(_mesh(), split)))
    want = x.reshape(N, N, 8).sum(0)
    np.testing.assert_array_equal(np.asarray(got).reshape(N, N, 8)[0], want)  # the sum is right
    if other is None:
        checked.settle(wait=True)
        return
    with pytest.raises(verified.SumError) as caught:
        checked.settle(wait=True)
    text = str(caught.value)
    assert text.startswith("keys ['w', 'v']: ") and "mixed the values of different keys" in text
    named = "device 1, device 2, device 3" if other == 0 else "device 3"
    assert f"{named} pushed other keys than device 0" in text, text
