"""jaxkv/_src/mxnet/optimizers/catalog.py: every MXNet 1.9.1 optimizer registered under its name,
and MXNet's public names that jaxkv does not have named as such."""

import pytest

import jaxkv.mx as mx
from jaxkv._src.mxnet.optimizers import catalog
from jaxkv._src.mxnet.optimizers import optimizer as _optimizer


@pytest.mark.parametrize("name", _optimizer.MXNET_OPTIMIZERS)
def test_every_mxnet_optimizer_is_created_by_its_name(name):
    opt = (
        mx.optimizer.create(name, learning_rate=0.1)
        if name != "test"
        else mx.optimizer.create(name)
    )
    assert isinstance(opt, _optimizer.Optimizer)
    assert type(opt).__name__.lower() == name


def test_the_modules_names_are_mxnets():
    """Its classes are MXNet's (GroupAdaGrad is mx.optimizer.contrib's in MXNet)."""
    assert set(catalog.__all__) - {"MXNET_NAMES", "GroupAdaGrad"} <= set(catalog.MXNET_NAMES)
    for name in catalog.__all__:
        assert hasattr(catalog, name)
