"""The kernel tests' cross-kernel comparison (harness.assert_same_arithmetic) as a GPU run
takes it: the simulator's branch is numpy's array equality, the GPU's branch cannot run
here, so it is checked on made-up outputs."""

from __future__ import annotations

import types

import numpy as np
import pytest
from harness import CROSS_KERNEL_ULPS, assert_same_arithmetic, bf16_bits

GPU = types.SimpleNamespace(name="metal")
SIM = types.SimpleNamespace(name="sim")


def test_bit_for_bit_on_the_simulator():
    a = np.array([[1.0, -2.0, 3.0]], np.float32)
    b = a.copy()
    b[0, 1] = np.nextafter(b[0, 1], np.float32(0))
    assert_same_arithmetic(SIM, a, a)
    with pytest.raises(AssertionError):
        assert_same_arithmetic(SIM, a, b)


def test_a_few_ulps_of_the_row_on_a_gpu():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 64)).astype(np.float32)
    a[:, 0] = 8.0  # each row's largest magnitude: one ulp of it is 2^-20
    ok = a + np.float32(CROSS_KERNEL_ULPS * 2.0**-20 * 0.9)  # within the bound, even on small elements
    assert_same_arithmetic(GPU, a, ok)
    bad = a.copy()
    bad[2, 5] += np.float32(CROSS_KERNEL_ULPS * 2.0**-20 * 1.5)
    with pytest.raises(AssertionError, match="1 of 256"):
        assert_same_arithmetic(GPU, a, bad)
    nan = a.copy()
    nan[1, 1] = np.nan  # an element one kernel did not write
    with pytest.raises(AssertionError, match="NaN"):
        assert_same_arithmetic(GPU, a, nan)


def test_stored_types_allow_one_flipped_rounding():
    x = np.array([[1.0, 0.5, -3.0]])
    up = x + np.sign(x) * 2.0 ** (np.floor(np.log2(np.abs(x))) - 7)  # one bf16 ulp more
    assert_same_arithmetic(GPU, bf16_bits(x), bf16_bits(up), stored="bf16")
    with pytest.raises(AssertionError):
        assert_same_arithmetic(GPU, bf16_bits(x), bf16_bits(x * (1 + 2.0**-5)), stored="bf16")
    h = np.array([[1.0, 2.0]], np.float16)
    assert_same_arithmetic(GPU, h.view(np.uint16), (h * np.float16(1 + 2.0**-10)).view(np.uint16), stored="half")
    with pytest.raises(AssertionError):
        assert_same_arithmetic(GPU, h.view(np.uint16), (h * np.float16(1 + 2.0**-8)).view(np.uint16), stored="half")
