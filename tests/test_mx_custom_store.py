"""Stores written in Python through ``import jaxkv.mx as mx``: MXNet 1.9.1's ``KVStoreBase``, its
``register`` decorator and ``mx.kv.create(name)``, which makes a registered store first, and
MXNet's own ``'teststore'``, as MXNet's test_kvstore_custom.py uses them (``broadcast`` and
``pushpull`` into single and listed outs, over values on several devices, and the calls a store
without an optimizer refuses)."""

import warnings

import numpy as np
import pytest

import jaxkv
import jaxkv.mx as mx

SHAPE = (4, 4)


@pytest.fixture(autouse=True)
def _registry():
    """Whatever a test registers is gone after it."""
    saved = dict(mx.kv.KVStoreBase.kv_registry)
    yield
    mx.kv.KVStoreBase.kv_registry.clear()
    mx.kv.KVStoreBase.kv_registry.update(saved)


def _all(a, x):
    np.testing.assert_array_equal(a.asnumpy(), np.full(a.shape, x, np.float32))


def test_teststore_is_registered_as_in_mxnet():
    kv = mx.kv.create("teststore")
    assert kv.type == "teststore" and kv.rank == 0 and kv.num_workers == 1
    assert isinstance(kv, mx.kv.KVStoreBase)
    assert type(kv).is_capable("optimizer") is False and kv.is_capable("OPTIMIZER") is False


def test_teststore_refuses_an_unknown_capability_as_mxnet_error_and_value_error():
    with pytest.raises(mx.MXNetError, match="unknown capability") as caught:
        mx.kv.create("teststore").is_capable("compression")
    assert isinstance(caught.value, ValueError)


def test_teststore_has_no_optimizer():
    kv = mx.kv.create("teststore")
    with pytest.raises(NotImplementedError):
        kv.set_optimizer(mx.optimizer.create("sgd"))
    with pytest.raises(NotImplementedError):
        kv.save_optimizer_states("states")
    with pytest.raises(NotImplementedError):
        kv.load_optimizer_states("states")


@pytest.mark.parametrize("key", [3, "a"])
def test_teststore_broadcast_fills_one_out_or_each_of_a_list(key):
    kv = mx.kv.create("teststore")
    out = mx.nd.zeros(SHAPE)
    kv.broadcast(key, mx.nd.ones(SHAPE) * 2, out)
    _all(out, 2)
    outs = [mx.nd.zeros(SHAPE, mx.cpu(i)) for i in range(3)]
    kv.broadcast(key + key, mx.nd.ones(SHAPE) * 3, outs)
    for i, o in enumerate(outs):
        _all(o, 3)
        assert o.context == mx.cpu(i)


def test_teststore_pushpull_sums_values_from_several_devices_into_each_out():
    kv = mx.kv.create("teststore")
    vals = [mx.nd.ones(SHAPE, mx.cpu(i)) * (i + 1) for i in range(4)]
    outs = [mx.nd.zeros(SHAPE, mx.cpu(i)) for i in range(4)]
    kv.pushpull(3, vals, out=outs)
    for i, o in enumerate(outs):
        _all(o, 1 + 2 + 3 + 4)
        assert o.context == mx.cpu(i)
    for i, v in enumerate(vals):  # the values are left as they were
        _all(v, i + 1)


def test_teststore_pushpull_without_out_writes_the_sum_into_each_value():
    kv = mx.kv.create("teststore")
    vals = [mx.nd.ones(SHAPE, mx.cpu(i)) for i in range(4)]
    kv.pushpull("a", vals)
    for v in vals:
        _all(v, 4)
    kv.pushpull("a", vals)  # again: 4 * 4
    for v in vals:
        _all(v, 16)


def test_teststore_pushpull_of_one_value_copies_it_into_the_outs():
    kv = mx.kv.create("teststore")
    outs = [mx.nd.zeros((1,)), mx.nd.zeros((1,))]
    kv.pushpull(1, mx.nd.ones((1,)) * 5, out=outs)
    for o in outs:
        _all(o, 5)


def test_a_registered_class_is_created_by_its_lower_case_name_in_any_case():
    @mx.kv.KVStoreBase.register
    class MyStore(mx.kv.KVStoreBase):
        made = 0

        def __init__(self):
            MyStore.made += 1

    assert mx.kv.KVStoreBase.kv_registry["mystore"] is MyStore
    for name in ("mystore", "MyStore", "MYSTORE"):
        assert type(mx.kv.create(name)) is MyStore
    assert MyStore.made == 3  # a new store each time


def test_a_registered_store_comes_before_a_built_in_type_of_that_name():
    @mx.kv.KVStoreBase.register
    class Local(mx.kv.KVStoreBase):
        pass

    assert type(mx.kv.create("local")) is Local
    del mx.kv.KVStoreBase.kv_registry["local"]
    assert mx.kv.create("local").type == "local"


def test_registering_a_name_again_replaces_the_class_with_mxnets_warning():
    with pytest.warns(UserWarning, match=r"New kvstore .*\.TestStore is overriding existing"):

        @mx.kv.KVStoreBase.register
        class TestStore(mx.kv.KVStoreBase):
            @property
            def type(self):
                return "mine"

    assert mx.kv.create("teststore").type == "mine"


def test_register_refuses_what_is_not_a_class_as_mxnet_asserts():
    with pytest.raises(AssertionError, match="expected a class"):
        mx.kv.KVStoreBase.register(mx.kv.create("teststore"))
    with pytest.raises(mx.MXNetError):
        mx.kv.KVStoreBase.register("teststore")


def test_create_refuses_a_name_that_is_not_a_str_as_mxnet_error_and_type_error():
    for bad in (3, None, b"local"):
        with pytest.raises(TypeError, match="expected a str"):
            mx.kv.create(bad)
        with pytest.raises(mx.MXNetError):
            mx.kv.create(bad)


def test_built_in_types_are_found_in_any_case_as_mxnet_lowers_the_name():
    assert mx.kv.create("Device").type == "device"
    assert mx.kv.create("LOCAL").type == "local"
    with pytest.raises(jaxkv.KVStoreError, match="unknown KVStore type 'nosuch'"):
        mx.kv.create("NoSuch")


def test_the_drop_in_stores_are_kvstorebases_and_the_base_refuses_what_it_lacks():
    assert isinstance(mx.kv.create("device"), mx.kv.KVStoreBase)
    assert isinstance(jaxkv.create("local"), mx.kv.KVStoreBase)
    assert mx.kv.KVStoreBase.OPTIMIZER == "optimizer"
    assert mx.kv.create("local").is_capable(mx.kv.KVStoreBase.OPTIMIZER)
    base = mx.kv.KVStoreBase()
    for call in (
        lambda: base.broadcast(3, mx.nd.ones((1,)), mx.nd.ones((1,))),
        lambda: base.pushpull(3, mx.nd.ones((1,))),
        lambda: base.set_optimizer(None),
        lambda: base.is_capable("optimizer"),
        lambda: base.save_optimizer_states("f"),
        lambda: base.load_optimizer_states("f"),
        lambda: base.type,
        lambda: base.rank,
        lambda: base.num_workers,
    ):
        with pytest.raises(NotImplementedError):
            call()


def test_a_partial_store_runs_what_it_defines():
    @mx.kv.KVStoreBase.register
    class Doubling(mx.kv.KVStoreBase):
        def pushpull(self, key, value, out=None, priority=0):
            out[:] = value * 2

    out = mx.nd.zeros((2,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a new name: no warning
        kv = mx.kv.create("doubling")
    kv.pushpull(0, mx.nd.ones((2,)), out)
    _all(out, 2)
    with pytest.raises(NotImplementedError):
        kv.broadcast(0, mx.nd.ones((2,)), out)
