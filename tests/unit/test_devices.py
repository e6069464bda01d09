"""jaxkv/_src/devices.py: a context names the i-th local device of its platform, ids outside
[0, count) are refused, and ``with ctx:`` makes the innermost context current."""

import threading

import jax
import pytest

import jaxkv
from jaxkv._src import devices as device_contexts


def _count(platform):
    """How many local devices of ``platform`` this process has (none where its backend is
    absent)."""
    try:
        return len(jax.local_devices(backend=platform))
    except RuntimeError:
        return 0


@pytest.mark.parametrize("i", [0, 3, 7])
def test_a_cpu_context_names_the_ith_cpu_device(devices, i):
    ctx = jaxkv.cpu(i)
    assert ctx.device == devices[i]
    assert (ctx.device_type, ctx.device_id, repr(ctx)) == ("cpu", i, f"cpu({i})")


@pytest.mark.parametrize("i", [8, -1, 100])
def test_a_cpu_id_outside_zero_to_the_device_count_is_refused(i):
    # 8 CPU devices: 7 is the last (above), 8 is one past it, -1 would wrap round to 7.
    with pytest.raises(jaxkv.KVStoreError) as err:
        jaxkv.cpu(i)
    assert f"cpu({i}) does not exist" in str(err.value)
    assert "8 cpu device(s), expected an id in [0, 8)" in str(err.value)


@pytest.mark.parametrize("i", [1.0, "1", None])
def test_a_device_id_that_is_no_int_is_refused(i):
    with pytest.raises(jaxkv.KVStoreError, match=r"expected an id in \[0, 8\)"):
        jaxkv.Context("cpu", i)


def test_a_gpu_id_at_the_gpu_count_is_refused_even_where_there_is_no_gpu():
    n = _count("gpu")
    with pytest.raises(jaxkv.KVStoreError, match=rf"has {n} gpu device\(s\).*\[0, {n}\)"):
        jaxkv.gpu(n)


@pytest.mark.parametrize("kind", ["tpu", "CPU", "cuda", ""])
def test_an_unknown_device_type_is_refused_naming_the_known_ones(kind):
    with pytest.raises(jaxkv.KVStoreError) as err:
        jaxkv.Context(kind, 0)
    assert str(err.value) == (
        "unknown device type: expected one of ['cpu', 'cpu_pinned', 'cpu_shared', 'gpu'], "
        f"given {kind!r}"
    )


@pytest.mark.parametrize("kind", ["cpu_pinned", "cpu_shared"])
def test_mxnet_host_memory_contexts_name_cpu_devices_and_equal_the_cpu_context(devices, kind):
    ctx = jaxkv.Context(kind, 5)
    assert ctx.device == devices[5] and repr(ctx) == f"{kind}(5)"
    assert ctx == jaxkv.cpu(5) and hash(ctx) == hash(jaxkv.cpu(5))
    assert ctx != jaxkv.cpu(4)


def test_contexts_are_equal_only_to_contexts_of_the_same_device():
    assert jaxkv.cpu(2) == jaxkv.Context("cpu", 2)
    assert jaxkv.cpu(2) != jaxkv.cpu(3)
    assert jaxkv.cpu(2) != "cpu(2)"
    assert len({jaxkv.cpu(i % 3) for i in range(9)}) == 3


def test_a_context_made_from_a_context_copies_its_id_not_the_default():
    ctx = jaxkv.Context(jaxkv.Context("cpu_pinned", 3))
    assert (ctx.device_type, ctx.device_id) == ("cpu_pinned", 3)
    assert ctx == jaxkv.cpu(3)


def test_every_local_cpu_device_gives_back_its_own_context(devices):
    for d in devices:
        ctx = device_contexts.Context.from_device(d)
        assert ctx.device == d and ctx.device_id == d.id and ctx.device_type == "cpu"


class _FakeGpu:
    def __init__(self, platform, n):
        self.platform, self.n = platform, n


@pytest.mark.parametrize("platform", ["gpu", "cuda", "rocm"])
def test_a_cuda_or_rocm_device_gives_a_gpu_context(monkeypatch, platform):
    fakes = [_FakeGpu(platform, n) for n in range(3)]
    real = device_contexts._local_devices
    monkeypatch.setattr(
        device_contexts, "_local_devices", lambda p: list(fakes) if p == "gpu" else real(p)
    )
    ctx = device_contexts.Context.from_device(fakes[2])
    assert (ctx.device_type, ctx.device_id, ctx.device) == ("gpu", 2, fakes[2])
    assert ctx != jaxkv.cpu(2)  # the same index on another platform is another device


def test_the_innermost_with_context_is_current_and_leaving_it_restores_the_outer():
    assert jaxkv.current_context() == jaxkv.cpu(0)  # MXNet's default
    with jaxkv.cpu(1) as outer:
        assert outer == jaxkv.cpu(1)
        with jaxkv.cpu(2):
            assert jaxkv.current_context() == jaxkv.cpu(2)
            with jaxkv.cpu(3):
                assert jaxkv.current_context() == jaxkv.cpu(3)
            assert jaxkv.current_context() == jaxkv.cpu(2)
        assert jaxkv.current_context() == jaxkv.cpu(1)
    assert jaxkv.current_context() == jaxkv.cpu(0)


def test_a_with_context_left_by_an_exception_is_no_longer_current():
    with pytest.raises(RuntimeError), jaxkv.cpu(4):
        raise RuntimeError("inside")
    assert jaxkv.current_context() == jaxkv.cpu(0)


def test_another_thread_does_not_see_this_threads_context():
    seen = []
    with jaxkv.cpu(6):
        thread = threading.Thread(target=lambda: seen.append(jaxkv.current_context()))
        thread.start()
        thread.join()
        assert jaxkv.current_context() == jaxkv.cpu(6)
    assert seen == [jaxkv.cpu(0)]
