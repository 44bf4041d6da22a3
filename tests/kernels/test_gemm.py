"""Dense prefill GEMMs (metal/gemm.metal) on the Metal simulator against numpy.

gemm_q4, gemm_q8, gemm_q4_add_h, gemm_q4_add_hs, gemm_q4_bf16, gemm_swiglu_q4 (y[m, n] over x[m, k] and W[n, k], row
strides lda / ldy, column blocks of wider matrices). The grouped expert GEMMs
(moe_gemm_*, metal/moe_prefill.metal) are tested in tests/kernels/test_moe_prefill.py with
the tolerances derived here. Weights are random MLX-layout tensors (``rand_quant`` of
lily.lab.kernels.harness: uniform codes, realistic bf16 scales and biases). Every correctness
test runs in the three simulator modes of tests/simdev.py (forward; reverse thread/threadgroup
order with undeclared-read detection; random order), always with out-of-range write
detection, on poisoned (NaN) outputs: bytes a dispatch must not write are checked to still be
NaN.

Operands and tolerances. Both operands are bfloat (metal/gemm_tiles.h): x is bfloat in device
memory (written by its producer rounded from fp32: ``bf16_activations``; nothing is clipped,
so every third row of the inputs holds an element at 10x the half range, ``beyond_half``;
gemm_q4_add_h: the attention's output; gemm_q4_add_hs: the GDN scan's u, staged times a half
factor per group of a row's elements, the fp32 product rounded to bfloat, formed the same way
by ``scaled_operand``); the weight dequantized as ``bfloat(fma(q, s, b))`` (exact q s, one
fp32 rounding, then bf16: ``bf16_weights``); products of bfloats are exact in fp32 and
accumulate in fp32. The reference (``gemm_ref`` of lily.lab.kernels.gemm) models those
roundings exactly and multiplies in float64, so what is left to tolerate is an fp32 GEMM's:
* every output is a sum of K exact products ``wb xb`` in an order that differs from numpy's
  (8x8 products, sequential over k on the simulator, unspecified inside a product on a
  GPU). The first-order bound of a K-term fp32 sum in any order is ``(K - 1) u M`` with
  ``u = 2**-24`` and ``M = sum_i |wb_i| |xb_i|``: we check ``|got - exact| <= (K + 8) u M``.
  Typical errors are ~sqrt(K) u M (worst err/tol is printed: ~0.01-0.1). Not modelling the
  bf16 rounding fails this bound (test_bf16_rounding_is_modelled, test_weights_rounded_once),
  so it stays as tight as the fp32 kernels' was;
* ``_add``: plus one rounding of the sum, ``u |y0 + v|``;
* SwiGLU ``silu(g) u``: the bounds of g and u propagated to first order (|silu'| <= 1.1) plus
  a few roundings of the activation (``swiglu_bound`` of lily.lab.kernels.gemm), then the bf16
  rounding of the stored output (hs, and hx in test_moe_prefill.py: ``bf16_stored``);
* gemm_q4_bf16: the plain bound, then the bf16 rounding of the stored output (``bf16_stored``),
  sums beyond +-65504 kept (bf16 has fp32's range).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from seeding import fresh_rng
from harness import ORDERS, THREAD_ORDERS  # noqa: F401

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import download, pack_args, upload  # noqa: E402
from harness import TIMES, assert_within as check, commit, magnitude, rand_quant, twin_target  # noqa: E402,F401

from lily.lab.kernels.gemm import beyond_half, row_scale, row_scale_operand, scaled_operand, swiglu_ref  # noqa: E402
from lily.lab.kernels.gemm import enc_gemm as lab_enc_gemm  # noqa: E402
from lily.lab.kernels.harness import HALF_MAX, to_bf16_bits, upload_bf16  # noqa: E402
from lily.lab.kernels.gemm import GEMM_BK, GEMM_BM, GEMM_BN, GEMM_SWIGLU_BN, GEMM_TG, gemm_args, gemm_ref  # noqa: E402
from lily.lab.kernels.harness import bf16_weights  # noqa: E402
from lily.lab.kernels.harness import _codes, bf16_operand  # noqa: E402
from lily.lab.kernels.harness import bf16_activations as bact, bf16_stored  # noqa: E402

U = 2.0**-24


# ------------------------------------------------------------------------------ helpers


def qbufs(dev, qt):
    return [upload(dev, qt.weight), upload(dev, qt.scales), upload(dev, qt.biases)]


# ------------------------------------------------------------------------------ dense

DENSE_SHAPES = [  # m, n, k
    (1, 1, 64), (7, 33, 64), (33, 64, 128), (100, 300, 256), (5, 257, 192), (64, 128, 320),
    (40, 1, 512), (13, 32, 2048), (200, 70, 64), (31, 129, 128),
]


def enc_gemm(p, kernel, wb, X, Y, m, n, k, lda, ldy, x_off=0, y_off=0, **operands):
    """x is bfloat; y is bfloat for gemm_swiglu_q4 and gemm_q4_bf16. Encoded by the prefill
    plan's builder (lily.lab.kernels.gemm.enc_gemm; on a TwinDevice its tensor twin);
    ``operands``: its row_scale (SwiGLU), x_scale and x_shift (gemm_q4_add_hs), disjoint."""
    p, tensor = twin_target(p)
    lab_enc_gemm(p, kernel + ("_tensor" if tensor else ""), wb, X, Y, m, n, k, lda, ldy, x_at=x_off, y_at=y_off,
                 label=kernel, **operands)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k", DENSE_SHAPES)
def test_gemm(dev, bits, m, n, k):
    rng = fresh_rng(m, n, k, bits)
    qt = rand_quant(rng, (), n, k, bits)
    x = bact(beyond_half(rng, (m, k)))
    wb = qbufs(dev, qt)
    X, Y = upload_bf16(dev, x), dev.buffer(4 * (m * n + 16))  # poisoned; 16 floats of pad
    cb = dev.command_buffer()
    enc_gemm(cb.compute_pass(), _core.kernel_name("gemm", q=bits), wb, X, Y, m, n, k, k, n)
    commit(cb, _core.kernel_name("gemm", q=bits))
    out = download(Y, np.float32)
    exact, tol = gemm_ref(x, qt)
    check(out[:m * n].reshape(m, n), exact, tol, f"gemm_q{bits} {m}x{n}x{k}")
    assert np.isnan(out[m * n:]).all(), "wrote past the output"


@pytest.mark.parametrize("m,n,k", [(1, 1, 64), (33, 64, 256), (100, 300, 128), (13, 32, 2048)])
def test_gemm_bf16_output(dev, m, n, k):
    """gemm_q4_bf16 (the GDN z, the attention's q|gate, k, v): the fp32 sums stored as bfloat,
    ldy > n (only the block is written), and a row driven past the half range kept as it is
    (rounded to bf16), not clipped."""
    rng = fresh_rng(m, n, k, 16)
    qt = rand_quant(rng, (), n, k, 4)
    x = bact(rng.standard_normal((m, k)))
    if k >= 256:  # the last row aligned with weight row 0: y[-1, 0] = 4e5 sum|w| (sum|w| > 1 at k 256)
        x[-1] = bact(4e5 * np.sign(bf16_weights(qt)[0]))
    ldy = n + 3
    X, Y = upload_bf16(dev, x), dev.buffer(2 * m * ldy)
    cb = dev.command_buffer()
    enc_gemm(cb.compute_pass(), "gemm_q4_bf16", qbufs(dev, qt), X, Y, m, n, k, k, ldy)
    commit(cb, "gemm_q4_bf16")
    out = download(Y, "bf16").reshape(m, ldy)
    assert np.isnan(out[:, n:]).all(), "wrote outside the block"
    exact, tol = gemm_ref(x, qt)
    assert (np.abs(exact[-1, 0]) > 2 * HALF_MAX) == (k >= 256)
    want, tol = bf16_stored(exact, tol)
    check(out[:, :n], want, tol, f"gemm_q4_bf16 {m}x{n}x{k}")


@pytest.mark.parametrize("m,n,k", [(37, 100, 256), (64, 64, 64), (3, 200, 512)])
def test_gemm_strides_and_column_block(dev, m, n, k):
    """x is a column block of a wider matrix (lda > k, bound at an offset) and y a column
    block of a wider output (ldy > n, bound at a column offset); only that block is written."""
    rng = fresh_rng(m, n, k, 77)
    qt = rand_quant(rng, (), n, k, 4)
    lda, xc = k + 12, 8            # x: columns [8, 8 + k) of an [m, k + 12] matrix
    ldy, yc = n + 7, 3             # y: columns [3, 3 + n) of an [m, n + 7] matrix
    xw = bact(beyond_half(rng, (m, lda)))
    wb = qbufs(dev, qt)
    X, Y = upload_bf16(dev, xw), dev.buffer(4 * m * ldy)
    cb = dev.command_buffer()
    enc_gemm(cb.compute_pass(), "gemm_q4", wb, X, Y, m, n, k, lda, ldy, x_off=2 * xc, y_off=4 * yc)
    commit(cb, "gemm_q4 strided")
    out = download(Y, np.float32).reshape(m, ldy)
    exact, tol = gemm_ref(xw[:, xc:xc + k], qt)
    check(out[:, yc:yc + n], exact, tol, f"gemm_q4 strided {m}x{n}x{k}")
    rest = np.ones(ldy, bool)
    rest[yc:yc + n] = False
    assert np.isnan(out[:, rest]).all(), "wrote outside the column block"


@pytest.mark.parametrize("kernel,m,n,k", [
    ("gemm_q4_add_h", 33, 100, 256), ("gemm_q4_add_h", 64, 2048, 128), ("gemm_q4_add_h", 1, 5, 64),
    ("gemm_q4_add_h", 100, 64, 512)])
def test_gemm_add(dev, kernel, m, n, k):
    """y += x W^T onto an existing residual, with ldy > n: o_proj's and the shared down
    projection's bfloat x (gemm_q4_add_h)."""
    rng = fresh_rng(m, n, k, 5)
    qt = rand_quant(rng, (), n, k, 4)
    x = bact(beyond_half(rng, (m, k)))
    ldy = n + 4
    y0 = rng.standard_normal((m, ldy)).astype(np.float32)
    wb = qbufs(dev, qt)
    X, Y = upload_bf16(dev, x), upload(dev, y0)
    cb = dev.command_buffer()
    enc_gemm(cb.compute_pass(), kernel, wb, X, Y, m, n, k, k, ldy)
    commit(cb, kernel)
    out = download(Y, np.float32).reshape(m, ldy)
    v, tol = gemm_ref(x, qt)
    exact = y0[:, :n].astype(np.float64) + v
    tol = tol + 2 * U * np.abs(exact)
    check(out[:, :n], exact, tol, f"{kernel} {m}x{n}x{k}")
    np.testing.assert_array_equal(out[:, n:], y0[:, n:])  # the padding columns untouched


@pytest.mark.parametrize("m,n,k,shift,lda", [
    (33, 100, 256, 5, 256), (1, 5, 64, 4, 64), (100, 64, 512, 5, 512), (64, 130, 128, 2, 128),
    (70, 2048, 128, 6, 192)])
def test_gemm_add_scaled(dev, m, n, k, shift, lda):
    """y += (x * f) W^T (gemm_q4_add_hs: the GDN out_proj on u and its norm factors): x bfloat
    with a half factor per group of 2^shift elements of a row (f <= 1, some subnormal or
    zero), the fp32 product rounded to bfloat while staged; lda > k once (the factors follow
    x's stride). The reference stages the same products (scaled_operand)."""
    rng = fresh_rng(m, n, k, shift, 21)
    qt = rand_quant(rng, (), n, k, 4)
    x = bact(4 * beyond_half(rng, (m, lda)))
    f = rng.uniform(0.0, 1.0, (m, lda >> shift)).astype(np.float16)
    f.flat[::7] = np.float16(2.0**-20)  # subnormal factors
    f.flat[::11] = 0
    ldy = n + 4
    y0 = rng.standard_normal((m, ldy)).astype(np.float32)
    wb = qbufs(dev, qt)
    X, Y, F = upload_bf16(dev, x), upload(dev, y0), upload(dev, f)
    cb = dev.command_buffer()
    enc_gemm(cb.compute_pass(), "gemm_q4_add_hs", wb, X, Y, m, n, k, lda, ldy, x_scale=F, x_shift=shift)
    commit(cb, "gemm_q4_add_hs")
    out = download(Y, np.float32).reshape(m, ldy)
    xs = scaled_operand(x, f, shift)[:, :k]  # the staged products
    v, tol = gemm_ref(xs, qt)
    exact = y0[:, :n].astype(np.float64) + v
    tol = tol + 2 * U * np.abs(exact)
    check(out[:, :n], exact, tol, f"gemm_q4_add_hs {m}x{n}x{k}")
    np.testing.assert_array_equal(out[:, n:], y0[:, n:])  # the padding columns untouched


@pytest.mark.parametrize("m,n,k", [(37, 100, 256), (7, 64, 64), (64, 512, 256), (100, 33, 128)])
def test_gemm_swiglu(dev, m, n, k):
    """silu(x Wg^T) * (x Wu^T) times a strided row scale (the shared gate column of the
    routing weights), stored as bfloat."""
    rng = fresh_rng(m, n, k, 9)
    gq, uq = rand_quant(rng, (), n, k, 4), rand_quant(rng, (), n, k, 4)
    x = bact(beyond_half(rng, (m, k)))
    w, col = row_scale(rng, m)
    wb = qbufs(dev, gq) + qbufs(dev, uq)
    X, Y = upload_bf16(dev, x), dev.buffer(2 * (m * n + 16))  # bfloat output
    cb = dev.command_buffer()
    enc_gemm(cb.compute_pass(), "gemm_swiglu_q4", wb, X, Y, m, n, k, k, n, row_scale=row_scale_operand(dev, w, col))
    commit(cb, "gemm_swiglu_q4")
    out = download(Y, "bf16")
    want, tol = bf16_stored(*swiglu_ref(x, gq, uq, scale=w[:, col]))
    check(out[:m * n].reshape(m, n), want, tol, f"gemm_swiglu_q4 {m}x{n}x{k}")
    assert np.isnan(out[m * n:]).all()


def test_router_and_shared_gate_one_buffer(dev):
    """The MoE router layout: gemm_q8 writes logits[:, :E] and the shared-expert gate (an
    8-bit [1, hidden] matrix) writes logits[:, E], both with ldy = E + 1, in one concurrent
    pass: the declared per-row ranges do not overlap, so both run in one barrier stage."""
    rng = fresh_rng(123)
    m, E, hidden = 45, 32, 256
    router, sgate = rand_quant(rng, (), E, hidden, 8), rand_quant(rng, (), 1, hidden, 8)
    x = bact(rng.standard_normal((m, hidden)))
    X, L = upload_bf16(dev, x), dev.buffer(4 * m * (E + 1))
    cb = dev.command_buffer()
    p = cb.compute_pass()
    enc_gemm(p, "gemm_q8", qbufs(dev, router), X, L, m, E, hidden, hidden, E + 1, disjoint=1)
    enc_gemm(p, "gemm_q8", qbufs(dev, sgate), X, L, m, 1, hidden, hidden, E + 1, y_off=4 * E, disjoint=1)
    commit(cb, "router gemm_q8")
    assert cb.counters["barrier_stages"] == 1
    out = download(L, np.float32).reshape(m, E + 1)
    for q, cols in ((router, slice(0, E)), (sgate, slice(E, E + 1))):
        exact, tol = gemm_ref(x, q)
        check(out[:, cols], exact, tol, "router logits")


def _gemm_q4_stored_bf16(dev, qt, x, n, label):
    """float32 [m, n]: x W^T through gemm_q4 on x [m, k] float32 stored as its producers
    store it (bf16_activations: rounded to nearest even)."""
    m, k = x.shape
    X, Y = upload_bf16(dev, x), dev.buffer(4 * m * n)
    cb = dev.command_buffer()
    enc_gemm(cb.compute_pass(), "gemm_q4", qbufs(dev, qt), X, Y, m, n, k, k, n)
    commit(cb, label)
    return download(Y, np.float32).reshape(m, n)


def test_bf16_rounding_is_modelled(dev):
    """The reference's bf16 rounding is what keeps the bound tight: x = 1 + 2**-9 (between two
    bfloats: it rounds to 1) on a single k block, against the same reference without the
    rounding of x, fails the tolerance; with it, passes. x is stored rounded by its producer
    (every GEMM input is bfloat: test_norm.py, the SwiGLU tests, the attention and GDN
    outputs); gemm_ref rounds the float32 value the same way."""
    rng = fresh_rng(4242)
    m, n, k = 8, 64, GEMM_BK
    qt = rand_quant(rng, (), n, k, 4)
    x = np.full((m, k), 1 + 2.0**-9, np.float32)
    out = _gemm_q4_stored_bf16(dev, qt, x, n, "gemm_q4 rounding")
    exact, tol = gemm_ref(x, qt)
    check(out, exact, tol, "bfloat operands")
    wide = x.astype(np.float64) @ bf16_weights(qt).T  # x not rounded (fp32 operand)
    # most outputs, not all: an output whose random weights nearly cancel moves by less than
    # its tolerance
    assert (np.abs(wide - exact) > tol).mean() > 0.5, "the reference without x's rounding would pass too"


def test_weights_rounded_once(dev):
    """Weights are bfloat(fma(q, s, b)) in fp32 (GemmWItems::put): one rounding of the
    checkpoint's value to bf16. The outputs match that reference and most miss the tolerance
    of one staging the weights unrounded (fp32 operands)."""
    rng = fresh_rng(16384)
    m, n, k = 8, 64, GEMM_BK
    qt = rand_quant(rng, (), n, k, 4)
    x = bact(rng.standard_normal((m, k)))
    out = _gemm_q4_stored_bf16(dev, qt, x, n, "gemm_q4 weights")
    exact, tol = gemm_ref(x, qt)
    check(out, exact, tol, "weights dequantized to bfloat")
    q, s64, b64 = (np.asarray(v, np.float64) for v in _codes(qt))
    w32 = (q * s64 + b64).astype(np.float32).astype(np.float64).reshape(n, k)
    assert (np.abs(bf16_operand(x) @ w32.T - exact) > tol).mean() > 0.5, "unrounded weights would pass too"


def test_nothing_is_clipped(dev):
    """Operands beyond the half range stay what they are (bf16 has fp32's range): an outlier
    activation of 1e6, a row of -7e4, and a weight group beyond the half range (scale 1e4,
    weights up to 1.5e5) give finite outputs equal to the unclipped product, some of them
    beyond 65504 (the former half operands clamped all three)."""
    rng = fresh_rng(65504)
    m, n, k = 5, 40, 128
    qt = rand_quant(rng, (), n, k, 4)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[1, 3], x[2, :] = 1e6, -7e4
    qt.scales[7, 1] = to_bf16_bits(np.float32([1e4]))[0]
    out = _gemm_q4_stored_bf16(dev, qt, x, n, "gemm_q4 beyond half")
    exact, tol = gemm_ref(x, qt)
    check(out, exact, tol, "operands beyond the half range")
    assert np.abs(out).max() > 10 * HALF_MAX


# ------------------------------------------------------------------------------ timing


def test_time_lm_head_shape(fwd_dev):
    """Simulator time of an lm_head-like GEMM (m = 200 rows, vocab 248320, hidden 256, the
    demo model's shape): 1/32 of the columns by default (printed with the extrapolation);
    the whole shape with LILY_GEMM_LM_HEAD=1."""
    m, n_full, k = 200, 248320, 256
    n = n_full if os.environ.get("LILY_GEMM_LM_HEAD") else n_full // 32
    rng = fresh_rng(7)
    qt = rand_quant(rng, (), n, k, 4)
    x = bact(rng.standard_normal((m, k)))
    wb = qbufs(fwd_dev, qt)
    X, Y = upload_bf16(fwd_dev, x), fwd_dev.buffer(4 * m * n)
    cb = fwd_dev.command_buffer()
    enc_gemm(cb.compute_pass(), "gemm_q4", wb, X, Y, m, n, k, k, n)
    t0, c0 = time.perf_counter(), time.process_time()
    cb.commit()
    cb.wait()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"gemm_q4 m={m} n={n} k={k}: {wall:.2f} s wall, {cpu:.2f} s CPU; "
          f"full n={n_full}: ~{wall * n_full / n:.1f} s wall, ~{cpu * n_full / n:.1f} s CPU")
    y = download(Y, np.float32).reshape(m, n)
    cols = rng.choice(n, 64, replace=False)  # spot check
    exact, tol = gemm_ref(x, qt, cols)
    check(y[:, cols], exact, tol, "lm_head shape")
