"""jaxkv/_src/mxnet/custom_stores.py: the registry (one class per lower-case name, MXNet's warning
on a second), ``create``'s order (registered names first, names lowered), the virtual subclass
that makes jaxkv's stores ``KVStoreBase``'s, and ``TestStore``'s sums."""

import warnings

import numpy as np
import pytest

import jaxkv
from jaxkv._src.mxnet import custom_stores, kvstore, ndarray


@pytest.fixture(autouse=True)
def _registry(monkeypatch):
    monkeypatch.setattr(
        custom_stores.KVStoreBase, "kv_registry", dict(custom_stores.KVStoreBase.kv_registry)
    )


def test_the_registry_starts_with_mxnets_teststore_only():
    assert custom_stores.KVStoreBase.kv_registry == {"teststore": custom_stores.TestStore}


def test_register_keys_by_the_lower_case_class_name_and_returns_the_class():
    class CamelCase:  # any class, as MXNet: it need not derive from KVStoreBase
        pass

    assert custom_stores.KVStoreBase.register(CamelCase) is CamelCase
    assert custom_stores.KVStoreBase.kv_registry["camelcase"] is CamelCase
    assert type(custom_stores.create("CAMELcase")) is CamelCase


def test_a_second_class_of_a_name_warns_naming_both_and_replaces_the_first():
    first = type("Twin", (), {"__module__": "one"})
    second = type("TWIN", (), {"__module__": "two"})
    custom_stores.KVStoreBase.register(first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        custom_stores.KVStoreBase.register(second)
    assert [str(w.message) for w in caught] == [
        "WARNING: New kvstore two.TWIN is overriding existing kvstore one.Twin"
    ]
    assert caught[0].category is UserWarning
    assert custom_stores.KVStoreBase.kv_registry["twin"] is second


@pytest.mark.parametrize("bad", [None, 3, custom_stores.TestStore()])
def test_register_refuses_a_non_class_and_changes_nothing(bad):
    before = dict(custom_stores.KVStoreBase.kv_registry)
    with pytest.raises(custom_stores.RegisterError, match="expected a class, given"):
        custom_stores.KVStoreBase.register(bad)
    assert custom_stores.KVStoreBase.kv_registry == before


def test_create_lowers_a_built_in_name_for_the_drop_in_store():
    kv = custom_stores.create("Local_Allreduce_CPU")
    assert type(kv) is kvstore.DropInKVStore and kv.type == "local_allreduce_cpu"


def test_create_refuses_a_name_that_is_not_a_str():
    with pytest.raises(custom_stores.StoreNameError, match="expected a str such as 'local'"):
        custom_stores.create(["local"])


def test_jaxkvs_stores_are_virtual_subclasses_and_others_are_not():
    assert issubclass(kvstore.KVStore, custom_stores.KVStoreBase)
    assert issubclass(kvstore.DropInKVStore, custom_stores.KVStoreBase)
    assert not issubclass(ndarray.NDArray, custom_stores.KVStoreBase)
    assert not isinstance(object(), custom_stores.KVStoreBase)


def test_teststore_sums_values_of_several_devices_into_an_out_on_another():
    store = custom_stores.TestStore()
    values = [ndarray.ones((2,), jaxkv.cpu(i)) * (i + 1) for i in (3, 1, 2)]
    out = ndarray.zeros((2,), jaxkv.cpu(5))
    store.pushpull(0, values, out)
    np.testing.assert_array_equal(out.asnumpy(), [9, 9])  # 4 + 2 + 3
    assert out.context == jaxkv.cpu(5)


def test_teststore_pushpull_of_one_value_without_out_changes_nothing():
    store = custom_stores.TestStore()
    value = ndarray.ones((3,))
    store.pushpull(0, value)
    np.testing.assert_array_equal(value.asnumpy(), [1, 1, 1])


def test_teststore_is_capable_is_a_static_method_as_in_mxnet():
    assert custom_stores.TestStore.is_capable("Optimizer") is False
    with pytest.raises(custom_stores.CapabilityError, match="given 'sparse'"):
        custom_stores.TestStore.is_capable("sparse")
