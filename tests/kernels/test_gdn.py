"""metal/gdn.metal (the Gated DeltaNet decode step, docs/kernels.md) on the Metal simulator
against the numpy reference.

Every output buffer starts poisoned (the simulator fills new buffers with NaN), so an
element a kernel forgets to write fails the comparison.

Tolerances (all float32 arithmetic on both sides unless noted):
* GDN step: the kernel writes y = S q and each split's sum of y^2 (grid Hv x NS); the
  gated RMSNorm is applied in float32 on the host as out_proj's load does
  (twins.gdn_gated_norm32; gemv_gated_q*_add has its own test in test_gemv.py). The
  per-split sums of squares: rtol 1e-5 (32 or fewer squares, a different order). The
  kernel sums in a different order (simd_sum trees vs numpy einsum) over
  Dk = 128 products of O(1) values: a few float32 ulps, so rtol 1e-4 / atol 1e-5 on one
  step. The device state is S' and a pending decay c per row (S = c S', gdn_scan's lazy
  decay); the step decays by c g and leaves c = 1, so it starts from random c here (0, i.e.
  S = 0, and tiny ones included) against the reference started from c S'. The 512-step
  drift test allows 5e-5 absolute on the state (|S| <= ~0.7) and the outputs (|o| <= ~4);
  measured 2.4e-7 and 5.7e-6. The delta rule with unit-norm k, beta in (0, 1) and g <= 1
  is a contraction, so rounding differences do not accumulate beyond a small multiple of
  one step's.

Kernel correctness tests run in three simulator modes (fixture ``dev``): forward order,
reverse thread/threadgroup order with undeclared-read detection, random order; all with
out-of-range write detection.
"""

from __future__ import annotations


import numpy as np
from seeding import fresh_rng
from harness import ORDERS, THREAD_ORDERS, bf16_bits, from_bf16, f32  # noqa: F401
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

# the layer harnesses and float64 references live with lily doctor's kernel checks (one home)
from lily.lab.device import download  # noqa: E402
from lily.lab.kernels import gdn as twins  # noqa: E402




# ------------------------------------------------------------------------------ Gated DeltaNet

GDN_DIMS = {
    "real": (16, 32, 128, 128),
    "dims": (2, 4, 128, 128),
    "tiny": (2, 4, 32, 32),
}


class GdnLayer(twins.GdnLayer):
    """twins.GdnLayer on fresh random inputs (tests/seeding.py)."""

    def __init__(self, dev, Hk, Hv, Dk, Dv, K=4, seed=0, window=1):
        super().__init__(dev, Hk, Hv, Dk, Dv, K, rng=fresh_rng(seed), window=window)


@pytest.mark.parametrize("dims,splits", [(d, twins.GDN_DECODE_SPLITS) for d in GDN_DIMS] +
                         [("dims", 1), ("dims", 2), ("tiny", 8)])
def test_gdn_decode_step_matches_reference(dev, dims, splits):
    """Each head's Dv state rows split over ``splits`` threadgroups (the runtime's 4, and
    others): the output is y plus each split's sum of y^2, normalised here as out_proj does
    (twins.gdn_gated_norm32) and compared with the reference's gated-norm output."""
    Hk, Hv, Dk, Dv = GDN_DIMS[dims]
    L = GdnLayer(dev, Hk, Hv, Dk, Dv, seed=1)
    r = L.rng
    # a non-trivial starting point: random conv history, recurrent state S' and pending decay
    # c per head (one head 0: S = 0; one tiny, S' large), S = c S' ~ 0.3
    c = 2.0 ** -r.uniform(0, 40, Hv)
    c[0], c[-1] = 0.0, 2.0**-40
    Sp = 0.3 * r.standard_normal((Hv, Dv, Dk)) / np.where(c > 0, c, 1)[:, None, None]
    L.set_state(r.standard_normal((3, L.conv_dim)), Sp, c)
    assert not L.st.recurrent[0][0].any()
    for _ in range(2):
        inp = L.random_inputs()
        got = L.step_device(*inp, splits=splits)
        want = L.step_reference(*inp)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(L.last_ssq.reshape(Hv, splits), twins.gdn_split_ssq(L.last_y, Dv, splits),
                                   rtol=1e-5)
        conv, S = L.device_state()
        np.testing.assert_array_equal(conv, L.st.conv[0])  # a copy: exact
        np.testing.assert_allclose(S, L.st.recurrent[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(L.state_parts()[1], 1.0)  # the step leaves S itself


@pytest.mark.parametrize("dims,window", [("real", 4), ("dims", 2), ("dims", 5), ("tiny", 3), ("tiny", 16)])
def test_gdn_write_back_window_is_bit_exact(dev, dims, window):
    """The state written back every ``window`` steps (the ring replayed by each step, what is
    pending written back by gdn_state_writeback) against every step: outputs, sums of squares
    and the written-back state equal bit for bit, from a state with random pending decays
    (one head S = 0), over two windows and a partial one."""
    Hk, Hv, Dk, Dv = GDN_DIMS[dims]
    every, windowed = twins.gdn_window_pair(dev, Hk, Hv, Dk, Dv, window, fresh_rng(3))
    steps = 2 * window + window // 2 + 1
    for t in range(steps):
        inp = every.random_inputs()
        np.testing.assert_array_equal(windowed.step_device(*inp), every.step_device(*inp), err_msg=f"step {t}")
        np.testing.assert_array_equal(windowed.last_y, every.last_y)
        np.testing.assert_array_equal(windowed.last_ssq, every.last_ssq)
        # the windowed state is untouched between write-backs
        assert windowed.pending == (t + 1) % window
    Sp_w, c_w = windowed.state_parts()  # runs gdn_state_writeback for the pending steps
    Sp_e, c_e = every.state_parts()
    np.testing.assert_array_equal(Sp_w, Sp_e)
    np.testing.assert_array_equal(c_w, c_e)
    np.testing.assert_array_equal(c_w, 1.0)


def test_gdn_write_back_leaves_the_state_until_the_window_ends(fwd_dev):
    """A step inside a window leaves S' and c as they were (only its ring entry is written);
    the window's last step writes the state back."""
    Hk, Hv, Dk, Dv = GDN_DIMS["tiny"]
    L = twins.GdnLayer(fwd_dev, Hk, Hv, Dk, Dv, rng=fresh_rng(4), window=3)
    r = L.rng
    L.set_state(r.standard_normal((3, L.conv_dim)), 0.3 * r.standard_normal((Hv, Dv, Dk)), 0.5)
    before = download(L.state, np.float32).copy()
    for _ in range(2):
        L.step_device(*L.random_inputs())
        np.testing.assert_array_equal(download(L.state, np.float32), before)
    L.step_device(*L.random_inputs())
    after = download(L.state, np.float32)
    assert L.pending == 0 and not np.array_equal(after, before)
    np.testing.assert_array_equal(after[Hv * Dv * Dk:], 1.0)


def test_gdn_decode_drift_512_steps(fwd_dev):
    """512 decode steps from a zero state (dims preset: Dk = Dv = 128) vs the reference, the
    state written back every 16 steps (the runtime's default state_window)."""
    Hk, Hv, Dk, Dv = GDN_DIMS["dims"]
    L = GdnLayer(fwd_dev, Hk, Hv, Dk, Dv, seed=7, window=16)
    worst_out = worst_state = 0.0
    for t in range(512):
        inp = L.random_inputs()
        got = L.step_device(*inp)
        want = L.step_reference(*inp)
        worst_out = max(worst_out, float(np.abs(got - want).max()))
        if t % 64 == 63 or t == 511:
            _, S = L.device_state()
            worst_state = max(worst_state, float(np.abs(S - L.st.recurrent[0]).max()))
    assert worst_out < 5e-5, worst_out
    assert worst_state < 5e-5, worst_state
