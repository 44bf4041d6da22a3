"""The one harness of the kernel tests (tests/kernels/test_<family>.py) and the simulator's
self-test kernel tests (tests/sim/).

* devices: the simulator modes and the Metal GPU (tests/simdev.py; the ``dev`` and
  ``fwd_dev`` fixtures are in tests/kernels/conftest.py);
* one dispatch on a device, with lily.kernel_check's helpers (``lily doctor`` uses them):
  :func:`run` (explicit bindings) and :func:`run_bound` (buffers at 0.., the argument
  struct at the next index) add their wall time to :data:`TIMES` (printed at the end of a
  verbose run), as :func:`commit` does for a command buffer a test encoded itself;
  :func:`run_encoder` runs an ``enc_*`` encoder of lily.kernel_check;
* the numpy twins' helpers (random MLX-quantized tensors, bf16 encoding, magnitude bounds,
  references): their home is :mod:`lily.kernel_check`, which ``lily doctor`` runs on an
  installed package; they are re-exported here so a test imports one module;
* :func:`assert_within`: the per-output first-order error bound check.
"""

from __future__ import annotations

import time

import numpy as np
from simdev import METAL, ORDERS, THREAD_ORDERS, make_dev  # noqa: F401

from lily import kernel_check
from lily._device import constant, download, sim_device, upload  # noqa: F401
from lily.kernel_check import (  # noqa: F401
    U, args_bytes, bf16_bits, f32, from_bf16, magnitude, rand_quant, run_encoder, to_bf16_bits, upload_q)

#: Simulator wall time per dispatch label (seconds), summed over the session.
TIMES: dict[str, float] = {}


def commit(cb, label):
    """Commits ``cb``, waits, and adds its wall time to ``TIMES[label]``."""
    t0 = time.perf_counter()
    cb.commit()
    cb.wait()
    TIMES[label] = TIMES.get(label, 0.0) + time.perf_counter() - t0
    return cb


def run(dev, kernel, grid, tg, buffers=(), constants=(), reads=(), writes=(), threadgroups=True,
        tgmem=(), label=""):
    """:func:`lily.kernel_check.run` (one dispatch, committed and waited for), its wall time
    added to ``TIMES``."""
    t0 = time.perf_counter()
    cb = kernel_check.run(dev, kernel, grid, tg, buffers, constants, reads, writes, threadgroups, tgmem, label)
    TIMES[label or kernel] = TIMES.get(label or kernel, 0.0) + time.perf_counter() - t0
    return cb


def run_bound(dev, kernel, grid, tg, buffers, args, reads, writes, threadgroups=True, label=""):
    """:func:`lily.kernel_check.run_bound` (buffers bound at 0, 1, ..., the argument struct
    next), its wall time added to ``TIMES``."""
    t0 = time.perf_counter()
    cb = kernel_check.run_bound(dev, kernel, grid, tg, buffers, args, reads, writes, threadgroups, label)
    TIMES[label or kernel] = TIMES.get(label or kernel, 0.0) + time.perf_counter() - t0
    return cb


def assert_within(got, want, tol, what):
    """Every output finite and ``|got - want| <= tol`` (elementwise, float64); returns the
    worst ratio err/tol."""
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), f"{what}: non-finite outputs at {np.argwhere(~np.isfinite(got))[:5].tolist()}"
    err = np.abs(got - want)
    bad = err > tol
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} outputs out of tolerance; worst err/tol "
                           f"{(err / tol).max():.3g} at {np.unravel_index(np.argmax(err / tol), err.shape)}")
    return float((err / tol).max())


def forward_sim():
    """The simulator in dispatch order with out-of-range write detection (``verify_writes``):
    the device of the decode GEMV / norm / embedding / MoE tests."""
    return sim_device(verify_writes=True)
