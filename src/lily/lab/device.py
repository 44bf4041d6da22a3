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
    """A numpy copy of a buffer's contents (from byte ``offset``) as ``dtype``/``shape``;
    ``dtype="bf16"``: bfloat16 elements, returned as float32 (exact)."""
    if isinstance(dtype, str) and dtype == "bf16":
        return (download(buf, np.uint16, shape, offset).astype(np.uint32) << 16).view(np.float32)
    dtype = np.dtype(dtype)
    count = -1 if shape is None else int(np.prod(shape)) * dtype.itemsize
    out = np.frombuffer(buf.read(offset, count), dtype=dtype).copy()
    return out if shape is None else out.reshape(shape)


def constant(*values, dtype=np.uint32) -> bytes:
    """Inline constant bytes for a ``constant T& [[buffer(n)]]`` argument that is not one of
    the argument structs (those: :func:`pack_args`)."""
    return np.asarray(values, dtype=dtype).tobytes()


def pack_args(struct: str, **fields) -> bytes:
    """The bytes of argument struct ``struct`` of metal/*_args.h, each field by name.

    The layout (field names, types, offsets, size) is the C++ struct's own
    (``lily._core.KERNEL_ARGS``, checked against the struct in csrc/runtime/kernel_args.h).
    A ``uint`` field takes an integer in [0, 2**32) or a bool (a flag), a ``float`` field a
    number, an array field a sequence of its length. Raises ValueError naming an unknown
    struct, a missing or unknown field, or a value that does not fit."""
    layout = _core.KERNEL_ARGS.get(struct)
    if layout is None:
        raise ValueError(f"unknown argument struct {struct!r} (known: {', '.join(sorted(_core.KERNEL_ARGS))})")
    size, spec = layout
    names = [f[0] for f in spec]
    missing, unknown = [n for n in names if n not in fields], sorted(set(fields) - set(names))
    if missing or unknown:
        raise ValueError(f"{struct}: " + "; ".join(
            part for part in (missing and f"missing {', '.join(missing)}", unknown and f"no field {', '.join(unknown)}")
            if part) + f" (fields: {', '.join(names)})")
    out = bytearray(size)
    for name, kind, offset, count in spec:
        value = fields[name]
        values = list(value) if count > 1 else [value]
        if len(values) != count:
            raise ValueError(f"{struct}.{name}: {count} values, got {len(values)}")
        if kind == "uint" and not all(isinstance(v, (int, np.integer)) and 0 <= v < 2**32 for v in values):
            raise ValueError(f"{struct}.{name} is a uint: an integer in [0, 2**32) (or a bool), got {value!r}")
        if kind == "float" and not all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
                                       for v in values):
            raise ValueError(f"{struct}.{name} is a float, got {value!r}")
        out[offset:offset + 4 * count] = np.asarray(values, np.uint32 if kind == "uint" else np.float32).tobytes()
    return bytes(out)
