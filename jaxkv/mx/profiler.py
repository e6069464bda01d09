"""``mx.profiler``: MXNet 1.9.1's profiler over ``jax.profiler``.

``set_config(filename=..., ...)``, ``set_state('run' | 'stop')``, ``pause()``, ``resume()``,
``dump()`` and ``dumps()`` drive a JAX trace (``jax.profiler.start_trace`` / ``stop_trace``):
``filename`` gets a Chrome trace (``chrome://tracing``, https://ui.perfetto.dev) and a directory
beside it JAX's whole trace (TensorBoard's profile plugin, XProf). ``Domain``, ``Task``,
``Frame``, ``Event``, ``Counter``, ``Marker`` and ``Scope`` record their events as
``jax.profiler.TraceAnnotation`` (see :mod:`jaxkv._src.mxnet.profiler`). Refusals raise
:class:`ProfilerArgumentError` (a ``ValueError``) or :class:`ProfilerStateError` (a
``RuntimeError``), both ``jaxkv.KVStoreError``.
"""

from jaxkv._src.mxnet.profiler import Counter as Counter
from jaxkv._src.mxnet.profiler import Domain as Domain
from jaxkv._src.mxnet.profiler import Event as Event
from jaxkv._src.mxnet.profiler import Frame as Frame
from jaxkv._src.mxnet.profiler import Marker as Marker
from jaxkv._src.mxnet.profiler import ProfilerArgumentError as ProfilerArgumentError
from jaxkv._src.mxnet.profiler import ProfilerStateError as ProfilerStateError
from jaxkv._src.mxnet.profiler import Scope as Scope
from jaxkv._src.mxnet.profiler import Task as Task
from jaxkv._src.mxnet.profiler import dump as dump
from jaxkv._src.mxnet.profiler import dump_profile as dump_profile
from jaxkv._src.mxnet.profiler import dumps as dumps
from jaxkv._src.mxnet.profiler import pause as pause
from jaxkv._src.mxnet.profiler import profiler_set_config as profiler_set_config
from jaxkv._src.mxnet.profiler import profiler_set_state as profiler_set_state
from jaxkv._src.mxnet.profiler import resume as resume
from jaxkv._src.mxnet.profiler import set_config as set_config
from jaxkv._src.mxnet.profiler import set_state as set_state

__all__ = [
    "Counter",
    "Domain",
    "Event",
    "Frame",
    "Marker",
    "ProfilerArgumentError",
    "ProfilerStateError",
    "Scope",
    "Task",
    "dump",
    "dump_profile",
    "dumps",
    "pause",
    "profiler_set_config",
    "profiler_set_state",
    "resume",
    "set_config",
    "set_state",
]
