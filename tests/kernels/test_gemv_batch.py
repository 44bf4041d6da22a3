"""The batched decode GEMVs of metal/gemv.metal (issue 31): ``norm_gemv_batch_q*_b*``,
``gemv_batch_q*_b*_add`` and ``gemv_gated_batch_q*_b*_add`` load each weight chunk once for up
to b rows of a batched decode step. Every row's outputs must be bit-identical to its batch-1
kernel's on that row alone (the same dispatch geometry), and within the float64 bound of the
batch-1 twins; rows are strided (padding between rows), the row count is below the kernel's b
where it can be (the rows past it must not be written: the declared ranges cover only the rows
given), and every case runs in the simulator's three thread orders with its hazard checks
(tests/simdev.py). The helpers are lily doctor's checks (lily.lab.kernels.gemv)."""

from __future__ import annotations

import pytest
from seeding import fresh_rng

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.kernels.gemv import (  # noqa: E402
    BATCH_MAX_ROWS, NORM_GEMV_ROWS_PER_SG, ROUTER_SPLITS, batch_size, gemv_batch_ratio, norm_gemv_batch_ratio,
)


# The decode step's norm_gemv geometries: the wide projections (8 rows per simdgroup), the
# router (1 row shared by 2 simdgroups) and lm_head (256 threads); n = 1 runs the 2-row
# kernel with one row, 3 the 4-row kernel with three.
@pytest.mark.parametrize("bits,rps,splits,tg", [
    pytest.param(4, NORM_GEMV_ROWS_PER_SG, 1, 64, id="proj-q4"),
    pytest.param(8, 1, ROUTER_SPLITS, 64, id="router-q8"),
    pytest.param(8, NORM_GEMV_ROWS_PER_SG, 1, 256, id="lm_head-q8"),
])
@pytest.mark.parametrize("n", [1, 3, BATCH_MAX_ROWS])
def test_norm_gemv_batch_rows_equal_batch_1(dev, bits, rps, splits, tg, n):
    rng = fresh_rng(bits * 1000 + rps * 100 + tg + n)
    # the model's 2048 columns: 64 chunks per row at 4 bits, 128 at 8, so every lane runs
    # chunks past the first one it loads before the norm
    assert norm_gemv_batch_ratio(dev, rng, bits, n, cols=2048, tg=tg, rps=rps, splits=splits) <= 1.0


@pytest.mark.parametrize("gated", [False, True], ids=["o_proj", "out_proj"])
@pytest.mark.parametrize("bits,n", [(4, 2), (4, 5), (8, BATCH_MAX_ROWS)])
def test_gemv_batch_rows_equal_batch_1(dev, gated, bits, n):
    rng = fresh_rng(bits * 100 + n * 10 + gated)
    assert gemv_batch_ratio(dev, rng, bits, n, gated, rows=100, Hv=8, Dv=128, splits=4) <= 1.0


def test_batch_size_picks_the_smallest_kernel():
    assert [batch_size(n) for n in range(1, BATCH_MAX_ROWS + 1)] == [2, 2, 4, 4, 8, 8, 8, 8]
    for bad in (0, BATCH_MAX_ROWS + 1):
        with pytest.raises(ValueError, match="1 to 8 rows"):
            batch_size(bad)
