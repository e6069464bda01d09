"""MXNet-style device contexts over JAX devices.

``cpu(i)`` and ``gpu(i)`` name the i-th local JAX device of that platform (in a multi-process job,
of this process). A context that names a device that does not exist is refused when it is made.
"""

from __future__ import annotations

import functools
import threading

import jax

from jaxkv._src.errors import KVStoreError

__all__ = ["Context", "cpu", "current_context", "gpu", "num_gpus"]

_PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cpu_pinned": "cpu", "cpu_shared": "cpu"}
_DEFAULT = threading.local()


def _local_devices(platform: str) -> list[jax.Device]:
    try:
        return list(jax.local_devices(backend=platform))
    except RuntimeError:  # JAX raises when the backend is absent (no GPU on this machine).
        return []


class Context:
    """A device, named as MXNet names it: ``Context('cpu', 1)`` is the second local CPU device.

    Args:
      device_type: ``'cpu'`` or ``'gpu'`` (or another ``Context``, which is copied).
      device_id: index among this process's devices of that platform.

    Raises:
      KVStoreError: the platform is unknown, or it has no device with that index.

    Examples:
      >>> import jaxkv
      >>> jaxkv.cpu(0)
      cpu(0)
      >>> jaxkv.Context('cpu', 1) == jaxkv.cpu(1)
      True
    """

    __slots__ = ("device_type", "device_id", "device")
    device_type: str
    device_id: int
    device: jax.Device

    def __init__(self, device_type: str | Context, device_id: int = 0) -> None:
        if isinstance(device_type, Context):
            device_id = device_type.device_id
            device_type = device_type.device_type
        if device_type not in _PLATFORMS:
            raise KVStoreError(
                f"unknown device type: expected one of {sorted(_PLATFORMS)}, given {device_type!r}"
            )
        devices = _local_devices(_PLATFORMS[device_type])
        if not isinstance(device_id, int) or not 0 <= device_id < len(devices):
            raise KVStoreError(
                f"{device_type}({device_id}) does not exist: this process has {len(devices)} "
                f"{_PLATFORMS[device_type]} device(s), expected an id in [0, {len(devices)})"
            )
        self.device_type = device_type
        self.device_id = device_id
        self.device = devices[device_id]

    @classmethod
    def from_device(cls, device: jax.Device) -> Context:
        """The context that names a local JAX ``device``."""
        platform = "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
        index = _local_devices(platform).index(device)
        return cls(platform, index)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Context) and self.device == other.device

    def __hash__(self) -> int:
        return hash(self.device)

    def __repr__(self) -> str:
        return f"{self.device_type}({self.device_id})"

    def __enter__(self) -> Context:
        stack = getattr(_DEFAULT, "stack", None)
        if stack is None:
            stack = _DEFAULT.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _DEFAULT.stack.pop()


def cpu(device_id: int = 0) -> Context:
    """The ``device_id``-th local CPU device."""
    return Context("cpu", device_id)


def gpu(device_id: int = 0) -> Context:
    """The ``device_id``-th local GPU device; refused where there is none."""
    return Context("gpu", device_id)


def num_gpus() -> int:
    """How many GPUs this process has: its local JAX GPU devices, those ``gpu(i)`` names (MXNet's
    ``mx.context.num_gpus()``; 0 where JAX has no GPU backend).

    Examples:
      >>> import jax, jaxkv.mx as mx
      >>> mx.context.num_gpus() == len([d for d in jax.local_devices() if d.platform == "gpu"])
      True
    """
    return len(_local_devices("gpu"))


def current_context() -> Context:
    """The innermost ``with ctx:`` context, else ``cpu(0)`` as in MXNet."""
    stack = getattr(_DEFAULT, "stack", None)
    return stack[-1] if stack else _cpu0()


@functools.cache  # (every NDArray made without ctx= asks it: one lookup of the devices)
def _cpu0() -> Context:
    return cpu(0)
