"""RMSNorm twins (metal/norm.metal): float32 and half-stored outputs, encoded by the prefill
plan's own builder (``lily._core.encode_rms_norm``)."""

from __future__ import annotations

import numpy as np

from lily import _core
from lily.checkpoint import bf16_to_f32
from lily.lab.device import download, upload
from lily.lab.kernels.harness import DEPTH, HALF_MAX, TOY, U, check, half_stored, model, ratio, run_encoder, to_bf16_bits


def norm_half_ref(x, nw_bits, eps=1e-6):
    """(want, tol) of rms_norm_half / moe_combine_norm's xn on the fp32 rows x it normalised:
    float64 RMSNorm, the fp32 bound DEPTH u |want| plus the half rounding (half_stored);
    values beyond +-65504 are stored as +-65504 (want clipped, no extra tolerance)."""
    x64 = np.asarray(x, np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + eps) * bf16_to_f32(nw_bits)
    return half_stored(np.clip(want, -HALF_MAX, HALF_MAX), DEPTH * U * np.abs(want) + 1e-30)


@check("rms_norm", "rms_norm_half")
def _rms_norm(dev, rng, kernel, size=TOY):
    """rms_norm_half: the same norm stored as half (prefill's xn). Model size: size.rows rows
    of the hidden 2048."""
    rows, n = size.pick((3, 256), (size.rows, size.model and model().hidden_size))
    eps = 1e-6
    half = kernel.endswith("_half")
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    w = to_bf16_bits(1 + 0.3 * rng.standard_normal(n))
    X, Wt, O = upload(dev, x), upload(dev, w), dev.buffer((2 if half else 4) * rows * n)
    run_encoder(dev, _core.encode_rms_norm, kernel, X, Wt, O, rows, n, eps, 2 if half else 4)  # as prefill does
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + eps) * bf16_to_f32(w)
    tol = DEPTH * U * np.abs(want) + 1e-30
    if half:
        want, tol = half_stored(want, tol)
    got = download(O, np.float16 if half else np.float32, (rows, n)).astype(np.float32)
    return ratio(got, want, tol, kernel)
