"""RMSNorm twins (metal/norm.metal): float32 and bfloat-stored outputs, encoded by the prefill
plan's own builder (``lily._core.encode_rms_norm``)."""

from __future__ import annotations

import numpy as np

from lily import _core
from lily.checkpoint import bf16_to_f32
from lily.lab.device import download, upload
from lily.lab.kernels.harness import DEPTH, TOY, U, bf16_stored, check, model, ratio, run_encoder, to_bf16_bits


def norm_bf16_ref(x, nw_bits, eps=1e-6):
    """(want, tol) of rms_norm_bf16 / moe_combine_norm's xn on the fp32 rows x it normalised:
    float64 RMSNorm, the fp32 bound DEPTH u |want| plus the bf16 rounding (bf16_stored);
    nothing is clipped (bf16 has fp32's range)."""
    x64 = np.asarray(x, np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + eps) * bf16_to_f32(nw_bits)
    return bf16_stored(want, DEPTH * U * np.abs(want) + 1e-30)


@check("rms_norm", "rms_norm_bf16")
def _rms_norm(dev, rng, kernel, size=TOY):
    """rms_norm_bf16: the same norm stored as bfloat (prefill's xn), with norm weights that
    drive some outputs past the half range (kept, not clipped). Model size: size.rows rows of
    the hidden 2048."""
    rows, n = size.pick((3, 256), (size.rows, size.model and model().hidden_size))
    eps = 1e-6
    bf = kernel.endswith("_bf16")
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    wf = 1 + 0.3 * rng.standard_normal(n)
    if bf:
        wf[::17] = 3e5  # RMS-normed values ~ 1: outputs of ~3e5, 5x the half range
    w = to_bf16_bits(wf)
    X, Wt, O = upload(dev, x), upload(dev, w), dev.buffer((2 if bf else 4) * rows * n)
    run_encoder(dev, _core.encode_rms_norm, kernel, X, Wt, O, rows, n, eps, 2 if bf else 4)  # as prefill does
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + eps) * bf16_to_f32(w)
    tol = DEPTH * U * np.abs(want) + 1e-30
    if bf:
        want, tol = bf16_stored(want, tol)
    got = download(O, "bf16" if bf else np.float32, (rows, n))
    return ratio(got, want, tol, kernel)
