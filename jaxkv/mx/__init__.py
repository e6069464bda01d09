"""The MXNet drop-in: ``import jaxkv.mx as mx`` and MXNet KVStore code runs unchanged.

Provides ``mx.kv.create``, ``mx.nd.*``, ``mx.cpu``, ``mx.gpu``, ``mx.Context``,
``mx.context.current_context``, ``mx.context.num_gpus``, ``mx.optimizer`` (MXNet's ``SGD``
and ``Adam``, with its numbers, for ``kv.set_optimizer``), ``mx.lr_scheduler`` (MXNet's
learning-rate schedulers, with its numbers), ``mx.random`` (``seed`` and MXNet's random
draws), ``mx.profiler`` (MXNet's profiler calls over ``jax.profiler``) and ``mx.kv.KVStoreBase``
(stores written in Python). MXNet's other modules (Gluon, autograd, symbols, the Module API ...)
are not here: asking for one raises an ``AttributeError`` that says where its JAX counterpart
is.
"""

from jaxkv import nd as nd
from jaxkv._src.devices import Context as Context
from jaxkv._src.devices import cpu as cpu
from jaxkv._src.devices import current_context as current_context
from jaxkv._src.devices import gpu as gpu
from jaxkv._src.errors import KVStoreError as MXNetError
from jaxkv.mx import context as context
from jaxkv.mx import kv as kv
from jaxkv.mx import lr_scheduler as lr_scheduler
from jaxkv.mx import optimizer as optimizer
from jaxkv.mx import profiler as profiler
from jaxkv.mx import random as random

kvstore = kv
ndarray = nd

__all__ = [
    "Context",
    "MXNetError",
    "context",
    "cpu",
    "current_context",
    "gpu",
    "kv",
    "kvstore",
    "lr_scheduler",
    "nd",
    "ndarray",
    "optimizer",
    "profiler",
    "random",
]

_GUIDE = "docs/migrating-from-mxnet.md"
# MXNet's modules that jaxkv.mx does not have, each with where a JAX user finds its job.
_ABSENT = {
    "gluon": "Gluon's layers, losses and Trainer belong to flax (nnx or linen) with optax",
    "autograd": "gradients come from jax.grad and jax.value_and_grad",
    "symbol": "a symbolic graph is what jax.jit traces from Python",
    "sym": "a symbolic graph is what jax.jit traces from Python",
    "module": "the Module API's training loop is a jitted step over a KVState",
    "mod": "the Module API's training loop is a jitted step over a KVState",
    "model": "the Module API's training loop is a jitted step over a KVState",
    "io": "data loading belongs to grain or tf.data",
    "recordio": "data loading belongs to grain or tf.data",
    "image": "data loading belongs to grain or tf.data",
    "metric": "metrics belong to clu or your own jitted functions",
    "init": "initialisers are jax.nn.initializers",
    "initializer": "initialisers are jax.nn.initializers",
    "rnn": "recurrent layers belong to flax",
    "contrib": "MXNet's contrib operators have no counterpart here",
    "callback": "the training loop is yours: log from it",
    "monitor": "the training loop is yours: log from it",
    "visualization": "jax.jit(f).lower(...).as_text() shows a computation",
}


def __getattr__(name: str) -> object:
    why = _ABSENT.get(name)
    if why is None:
        raise AttributeError(f"module 'jaxkv.mx' has no attribute {name!r}")
    raise AttributeError(
        f"jaxkv.mx has no {name!r}: jaxkv brings MXNet's KVStore, NDArrays, contexts and "
        f"optimizers to JAX, not the rest of MXNet; {why} (see {_GUIDE}, "
        '"Moving to the functional core")'
    )
