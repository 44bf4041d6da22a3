"""The one harness of the kernel tests (tests/kernels/test_<family>.py) and the simulator's
self-test kernel tests (tests/sim/).

* devices: the simulator modes and the Metal GPU (tests/simdev.py; the ``dev`` and
  ``fwd_dev`` fixtures are in tests/kernels/conftest.py);
* one dispatch on a device: :func:`run` (explicit bindings), :func:`run_bound` (buffers at
  0.., the argument struct at the next index), :func:`run_encoder` (an encoder function of
  lily.kernel_check on a fresh command buffer), :func:`commit` (wait, and add the wall time
  to :data:`TIMES`, printed at the end of a verbose run);
* the numpy twins' helpers (random MLX-quantized tensors, bf16 encoding, magnitude bounds,
  references): their home is :mod:`lily.kernel_check`, which ``lily doctor`` runs on an
  installed package; they are re-exported here so a test imports one module;
* :func:`assert_within`: the per-output first-order error bound check.
"""

from __future__ import annotations

import time

import numpy as np
from simdev import METAL, ORDERS, THREAD_ORDERS, make_dev  # noqa: F401

from lily._device import constant, download, sim_device, upload  # noqa: F401
from lily.kernel_check import (  # noqa: F401
    U, args_bytes, bf16_bits, f32, from_bf16, magnitude, rand_quant, to_bf16_bits, upload_q)

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
    """One dispatch of ``kernel`` in its own command buffer, committed and waited for.

    ``buffers`` and ``constants`` are ``(index, buffer[, offset])`` / ``(index, bytes)``
    bindings; ``grid`` counts threadgroups when ``threadgroups`` else threads."""
    cb = dev.command_buffer()
    cb.compute_pass().dispatch(kernel, grid, tg, buffers=list(buffers), constants=list(constants),
                               threadgroup_memory=list(tgmem), reads=list(reads), writes=list(writes),
                               threadgroups=threadgroups, label=label)
    return commit(cb, label or kernel)


def run_bound(dev, kernel, grid, tg, buffers, args, reads, writes, threadgroups=True, label=""):
    """:func:`run` with ``buffers`` bound at 0, 1, ... and the argument struct ``args``
    (bytes, or None for none) at the next index."""
    return run(dev, kernel, grid, tg, list(enumerate(buffers)),
               [] if args is None else [(len(buffers), args)], reads, writes, threadgroups, label=label)


def run_encoder(dev, enc, *a, **kw):
    """``enc(compute_pass, *a, **kw)`` on a fresh command buffer, committed and waited for."""
    cb = dev.command_buffer()
    enc(cb.compute_pass(), *a, **kw)
    cb.commit()
    cb.wait()
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
