"""metal/norm.metal (``rms_norm``, docs/kernels.md; ``rms_norm_bf16``, the bfloat xn of
prefill, docs/prefill.md) on the Metal simulator against a float64 RMSNorm, encoded by the
prefill plan's own builder (``lily._core.encode_rms_norm``).
"""

from __future__ import annotations

import numpy as np
from seeding import fresh_rng
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import download, upload  # noqa: E402
from lily.checkpoint import bf16_to_f32  # noqa: E402
# the reference helpers and bounds live with lily doctor's kernel checks (one home)
from lily.lab.kernels.harness import DEPTH, U, bf16_stored, to_bf16_bits  # noqa: E402
from harness import assert_within, forward_sim, run_encoder  # noqa: E402


@pytest.fixture(scope="module")
def dev():
    return forward_sim()


# ----------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("rows,n,tg", [(1, 2048, 256), (1, 2048, 1024), (1, 256, 256), (16, 256, 64),
                                       (32, 128, 128), (2, 100, 96), (3, 33, 32), (1, 4096, 256)])
def test_rms_norm(dev, rows, n, tg):
    rng = fresh_rng(rows * n + tg)
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    w = to_bf16_bits(1 + 0.3 * rng.standard_normal(n))
    eps = 1e-6
    X, Wt, O = upload(dev, x), upload(dev, w), dev.buffer(4 * rows * n)
    run_encoder(dev, _core.encode_rms_norm, "rms_norm", X, Wt, O, rows, n, eps, 4, threads=tg)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + eps) * bf16_to_f32(w)
    # sum of n positive squares (depth <= n/tg + 5 + 32) feeds rsqrt (halves the relative
    # error), then two products: 64 u relative is a safe first-order bound
    assert_within(download(O, np.float32, (rows, n)), want, DEPTH * U * np.abs(want) + 1e-30, "rms_norm")


def test_rms_norm_in_place(dev):
    rng = fresh_rng(11)
    n = 2048
    x = rng.standard_normal(n).astype(np.float32)
    w = to_bf16_bits(rng.standard_normal(n))
    X, Wt = upload(dev, x), upload(dev, w)
    run_encoder(dev, _core.encode_rms_norm, "rms_norm", X, Wt, X, 1, n, 1e-6, 4)  # out aliases x
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64) + 1e-6) * bf16_to_f32(w)
    assert_within(download(X, np.float32), want, DEPTH * U * np.abs(want) + 1e-30, "rms_norm in place")


@pytest.mark.parametrize("rows,n,tg", [(5, 2048, 256), (3, 33, 32), (16, 256, 64)])
def test_rms_norm_bf16(dev, rows, n, tg):
    """rms_norm_bf16 stores the normed rows as bfloat (the prefill GEMMs' input): within the
    fp32 bound plus the bf16 rounding, and a weight that takes a row beyond +-65504 keeps the
    value (bf16 has fp32's range: nothing is clipped)."""
    rng = fresh_rng(rows, n, tg, 16)
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    # x[0, 1] = 10 (the row's rms is ~3) times the weight 3e5: beyond the half range after the
    # norm for every draw (a random x[:, 1] stayed inside it for ~0.5% of draws at 3 rows)
    x[0, 1] = 10.0
    wf = 1 + 0.3 * rng.standard_normal(n)
    wf[1] = 3e5
    w = to_bf16_bits(wf)
    eps = 1e-6
    X, Wt, O = upload(dev, x), upload(dev, w), dev.buffer(2 * rows * n)
    run_encoder(dev, _core.encode_rms_norm, "rms_norm_bf16", X, Wt, O, rows, n, eps, 2, threads=tg)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + eps) * bf16_to_f32(w)
    got = download(O, "bf16", (rows, n)).astype(np.float64)
    assert (np.abs(want[:, 1]) > 65504).any() and (np.abs(got[:, 1]) > 65504).any(), "clipped"
    want, tol = bf16_stored(want, DEPTH * U * np.abs(want) + 1e-30)
    assert_within(got, want, tol, "rms_norm_bf16")
