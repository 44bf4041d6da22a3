"""The one harness of the kernel tests (tests/kernels/test_<family>.py) and the simulator's
self-test kernel tests (tests/sim/).

* devices: the simulator modes and the Metal GPU (tests/simdev.py; the ``dev`` and
  ``fwd_dev`` fixtures are in tests/kernels/conftest.py);
* one dispatch on a device, with lily.lab.kernels.harness's helpers (``lily doctor`` uses them):
  :func:`run` (explicit bindings) and :func:`run_bound` (buffers at 0.., the argument
  struct at the next index) add their wall time to :data:`TIMES` (printed at the end of a
  verbose run), as :func:`commit` does for a command buffer a test encoded itself;
  :func:`run_encoder` runs an ``enc_*`` encoder of a lily.lab.kernels family module;
* the numpy twins' helpers (random MLX-quantized tensors, bf16 encoding, magnitude bounds,
  references): their home is :mod:`lily.lab.kernels`, which ``lily doctor`` runs on an
  installed package; they are re-exported here so a test imports one module;
* :func:`assert_within`: the per-output first-order error bound check;
* the prefill GEMMs' Metal 4 tensor-operation twins (tests/kernels/test_*_tensor.py): on a
  :class:`TwinDevice` the GEMM builders (``lily._core.encode_gemm`` / ``encode_moe_gemm``,
  given :func:`twin_target`'s pass) encode a GEMM's ``_tensor`` twin, so a family's
  simdgroup suite runs again on the twins; :func:`seq_model` is the simulator's
  exact float32 result on the bfloat operands; :func:`check_bound` / :func:`swiglu_check`
  the GEMM bounds of ``gemm_ref`` / ``swiglu_ref``.
"""

from __future__ import annotations

import time

import numpy as np
from simdev import METAL, ORDERS, THREAD_ORDERS, make_dev  # noqa: F401

from lily import _core
from lily.lab.kernels import harness as lab_harness
from lily.lab.device import constant, download, pack_args, sim_device, upload  # noqa: F401
from lily.lab.kernels.gemm import gemm_ref, swiglu_ref  # noqa: F401
from lily.lab.kernels.harness import (  # noqa: F401
    U, bf16_bits, bf16_operand, bf16_stored, bf16_weights, f32, from_bf16, magnitude, rand_quant,
    run_encoder, to_bf16_bits, upload_bf16, upload_q,
)
from lily.lab.kernels.moe_prefill import MOE_TENSOR_TILES, MOE_TILES  # noqa: F401

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
    """:func:`lily.lab.kernels.harness.run` (one dispatch, committed and waited for), its wall time
    added to ``TIMES``."""
    t0 = time.perf_counter()
    cb = lab_harness.run(dev, kernel, grid, tg, buffers, constants, reads, writes, threadgroups, tgmem, label)
    TIMES[label or kernel] = TIMES.get(label or kernel, 0.0) + time.perf_counter() - t0
    return cb


def run_bound(dev, kernel, grid, tg, buffers, args, reads, writes, threadgroups=True, label=""):
    """:func:`lily.lab.kernels.harness.run_bound` (buffers bound at 0, 1, ..., the argument struct
    next), its wall time added to ``TIMES``."""
    t0 = time.perf_counter()
    cb = lab_harness.run_bound(dev, kernel, grid, tg, buffers, args, reads, writes, threadgroups, label)
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


#: Two *different* kernels that run the same float32 operations in the same order (a fused
#: kernel and the pair it fuses, a prefill kernel and the decode kernel of the same step)
#: agree bit for bit on the simulator, whose kernels are compiled with -ffp-contract=off. On
#: a GPU, Apple's compiler may contract ``a * b + c`` into one fma in one kernel and not in
#: the other, so there they agree within a few units in the last place: CROSS_KERNEL_ULPS of
#: the largest magnitude of the output's row (one head, one token: a contraction's error is
#: relative to its operands, not to a result that cancels), plus one ulp of the stored type
#: for a rounding flipped by that difference. One kernel compared with itself (other chunk
#: sizes, the write-back window) stays bit for bit everywhere: it is the same code.
CROSS_KERNEL_ULPS = 4


def assert_same_arithmetic(dev, got, want, what="", *, ulps=CROSS_KERNEL_ULPS, stored=None):
    """``got`` (one kernel) equals ``want`` (another kernel doing the same operations): bit
    for bit on the simulator, within ``ulps`` float32 ulps of each row's largest magnitude
    (the last axis is the row) on a GPU (:data:`CROSS_KERNEL_ULPS`). ``stored``: ``"bf16"``
    or ``"half"`` when both are such bit patterns (uint16: a K/V cache, a half activation),
    compared as values with one ulp of that type more. NaN (a poisoned, unwritten element)
    must be in the same places."""
    if dev.name == "sim":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    decode = {None: np.asarray, "bf16": from_bf16, "half": lambda b: np.asarray(b, np.uint16).view(np.float16)}[stored]
    a, b = decode(got).astype(np.float64), decode(want).astype(np.float64)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} and {b.shape}"
    nan = np.isnan(a)
    assert (nan == np.isnan(b)).all(), f"{what}: unwritten (NaN) elements differ"
    a, b = np.where(nan, 0.0, a), np.where(nan, 0.0, b)
    big = np.maximum(np.abs(a), np.abs(b))
    tol = ulps * 2.0**-23 * big.max(axis=-1, keepdims=True)
    if stored:  # the float32 difference may flip one rounding to the stored type
        mantissa = {"bf16": 7, "half": 10}[stored]
        tol = tol + np.where(big > 0, 2.0 ** (np.floor(np.log2(np.where(big > 0, big, 1.0))) - mantissa), 0.0)
    err = np.abs(a - b)
    bad = err > tol
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} elements differ by more than {ulps} ulps of their row "
                           f"(worst {(err / np.where(tol > 0, tol, 1)).max():.3g} x the bound)")


def forward_sim():
    """The simulator in dispatch order with out-of-range write detection (``verify_writes``):
    the device of the decode GEMV / norm / embedding / MoE tests."""
    return sim_device(verify_writes=True)


# ----------------------------------------------------------------------------- tensor-operation twins

# The GEMM kernels of metal/gemm.metal and moe_prefill.metal, whose twins are `<name>_tensor`,
# and the names of the tensor-op path's own 128-row expert tiles without their suffix.
TWINS = {"gemm_q4", "gemm_q8", "gemm_q4_add_h", "gemm_q4_add_hs", "gemm_q4_bf16", "gemm_swiglu_q4",
         *(_core.kernel_name(f"moe_gemm_{kind}", q=4, t=T) for kind in ("gate_up", "down") for T in MOE_TENSOR_TILES)}


class _Proxy:
    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        return getattr(self._obj, name)


class _TwinPass(_Proxy):
    def dispatch(self, kernel, *args, **kwargs):
        # a twin's grid and threads are its builder's (they differ from the simdgroup kernel's):
        # a GEMM dispatched by hand here would run the simdgroup kernel, or the twin regridded by
        # a second copy of the geometry
        assert kernel not in TWINS, (f"{kernel} dispatched by hand on a TwinDevice: GEMMs go through the "
                                     "prefill plan's builders (lily._core.encode_gemm / encode_moe_gemm on "
                                     "twin_target(pass)), which pick the twin and its grid")
        return self._obj.dispatch(kernel, *args, **kwargs)


def twin_target(p):
    """(the real compute pass, whether GEMMs run as their tensor twins) of a pass of a
    :class:`TwinDevice` or of a plain device: the kernels' own builders (lily._core.encode_*)
    take the real pass and pick the twins themselves."""
    return (p._obj, True) if isinstance(p, _TwinPass) else (p, False)


class _TwinCommandBuffer(_Proxy):
    def compute_pass(self, *args, **kwargs):
        return _TwinPass(self._obj.compute_pass(*args, **kwargs))


class TwinDevice(_Proxy):
    """A simulator device on which the GEMM builders, given :func:`twin_target`'s pass, encode
    each GEMM's *_tensor twin; a GEMM kernel dispatched by hand on its passes is refused."""

    def command_buffer(self):
        return _TwinCommandBuffer(self._obj.command_buffer())


def seq_model(x, qt=None, index=None, w=None):
    """y = xb wb^T in float32 on the GEMMs' bfloat operands (bf16_operand of x, bf16_weights of
    qt[index], or the given bf16-valued w), products exact, added in increasing k (the
    simulator's order)."""
    xb = bf16_operand(x).astype(np.float32)
    wb = (bf16_weights(qt, index) if w is None else w).astype(np.float32)
    acc = np.zeros((xb.shape[0], wb.shape[0]), np.float32)
    for k in range(xb.shape[1]):
        acc = acc + xb[:, k:k + 1] * wb[None, :, k]
    return acc


def check_bound(got, x, qt, index=None, stored_bf16=False):
    """|got - xb wb^T (float64)| within gemm_ref's bound (tests/kernels/test_gemm.py's docstring);
    stored_bf16: got was stored as bfloat (the routed experts' yx), the rounding added by bf16_stored."""
    exact, tol = gemm_ref(x, qt, index)
    if stored_bf16:
        exact, tol = bf16_stored(exact, tol)
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all()
    err = np.abs(got - exact)
    assert (err <= tol + 1e-30).all(), f"{(err > tol).sum()} outputs out of tolerance, worst err/tol {(err / tol).max():.3g}"


def cdiv(a, b):
    return -(-a // b)


def pitched(a, ld, fill=np.nan):
    out = np.full((a.shape[0], ld), fill, a.dtype)
    out[:, :a.shape[1]] = a
    return out


def swiglu_check(got, x, g_qt, u_qt, index=None, scale=None):
    """Within swiglu_ref's bound of silu(xh Wg^T) * (xh Wu^T) (times the row scale, if any),
    stored as bfloat as the SwiGLU GEMMs store hs / hx (tests/kernels/test_gemm.py's docstring)."""
    want, tol = bf16_stored(*swiglu_ref(x, g_qt, u_qt, index, scale))
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all()
    err = np.abs(got - want)
    assert (err <= tol + 1e-30).all(), f"{(err > tol).sum()} outputs out of tolerance, worst err/tol {(err / tol).max():.3g}"
