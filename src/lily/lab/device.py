"""Thin helpers over the native device layer (``lily._core``) for tests and tools.

The device layer itself is C++ (``csrc/gpu``); see ``docs/device-layer.md``. This module
only converts between numpy arrays and device buffers.
"""

from __future__ import annotations

import numpy as np

from lily import _core


def devices() -> list[str]:
    """Names of the native devices compiled into this build, e.g. ``['sim']``."""
    return list(_core.compiled_devices())


def sim_device(**options):
    """The Metal simulator (see ``lily._core.sim_device`` for ``options``)."""
    if "sim" not in devices():
        raise RuntimeError("this build of lily has no simulator device (LILY_SIM=OFF)")
    return _core.sim_device(**options)


def upload(device, array) -> "_core.Buffer":
    """A new buffer holding a copy of ``array`` (made C-contiguous)."""
    a = np.ascontiguousarray(array)
    buf = device.buffer(a.nbytes)
    if a.nbytes:
        buf.write(a.reshape(-1).view(np.uint8))
    return buf


def download(buf, dtype, shape=None, offset: int = 0) -> np.ndarray:
    """A numpy copy of a buffer's contents (from byte ``offset``) as ``dtype``/``shape``."""
    dtype = np.dtype(dtype)
    count = -1 if shape is None else int(np.prod(shape)) * dtype.itemsize
    out = np.frombuffer(buf.read(offset, count), dtype=dtype).copy()
    return out if shape is None else out.reshape(shape)


def constant(*values, dtype=np.uint32) -> bytes:
    """Inline constant bytes for a ``constant T& [[buffer(n)]]`` argument."""
    return np.asarray(values, dtype=dtype).tobytes()
