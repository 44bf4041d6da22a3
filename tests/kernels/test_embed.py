"""metal/embed.metal on the Metal simulator (docs/kernels.md ``embed_q4``, docs/prefill.md
``embed_rows_q4``): embedding rows dequantized exactly as ``QuantizedTensor.dequantize``.
"""

from __future__ import annotations

import numpy as np
from seeding import fresh_rng
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily._device import constant, download, upload  # noqa: E402
# the reference helpers and bounds live with lily doctor's kernel checks (one home)
from lily.kernel_check import (  # noqa: E402
    U, magnitude, rand_quant, upload_q)
from harness import assert_within, forward_sim, run_bound  # noqa: E402


@pytest.fixture(scope="module")
def dev():
    return forward_sim()


# ----------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("vocab,cols", [(3000, 2048), (8192, 256), (100, 128), (37, 64)])
def test_embed(dev, vocab, cols):
    rng = fresh_rng(vocab + cols)
    qt = rand_quant(rng, (), vocab, cols, 4)
    W, S, B = upload_q(dev, qt)
    for tok, want_row in [(0, 0), (vocab - 1, vocab - 1), (vocab // 3, vocab // 3), (vocab + 5, vocab - 1)]:
        T = upload(dev, np.array([tok], np.uint32))
        O = dev.buffer(4 * cols)
        run_bound(dev, "embed_q4", cols // 8, 64, [W, S, B, T, O], constant(cols, vocab),
            reads=[W, S, B, T], writes=[O], threadgroups=False, label="embed_q4")
        want = qt.dequantize(want_row).astype(np.float64)
        mag = magnitude(qt, want_row)
        assert_within(download(O, np.float32), want, 2 * U * mag, f"embed row {tok}")
