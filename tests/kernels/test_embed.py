"""metal/embed.metal on the Metal simulator (docs/kernels.md ``embed_q4``, docs/prefill.md
``embed_rows_q4``): embedding rows dequantized exactly as ``QuantizedTensor.dequantize``.
"""

from __future__ import annotations

import numpy as np
from seeding import fresh_rng
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import download, pack_args, upload  # noqa: E402
# the reference helpers and bounds live with lily doctor's kernel checks (one home)
from lily.lab.kernels.embed import EMBED_PER_THREAD, EMBED_THREADS  # noqa: E402
from lily.lab.kernels.harness import U, magnitude, rand_quant, upload_q  # noqa: E402
from harness import assert_same_arithmetic, assert_within, forward_sim, run_bound, run_encoder  # noqa: E402


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
        run_bound(dev, "embed_q4", cols // EMBED_PER_THREAD, EMBED_THREADS, [W, S, B, T, O], pack_args("EmbedArgs", cols=cols, vocab=vocab),
                  reads=[W, S, B, T], writes=[O], threadgroups=False, label="embed_q4")
        want = qt.dequantize(want_row).astype(np.float64)
        mag = magnitude(qt, want_row)
        assert_within(download(O, np.float32), want, 2 * U * mag, f"embed row {tok}")


@pytest.mark.parametrize("vocab,cols,rows", [(3000, 2048, 7), (100, 128, 33), (37, 64, 1)])
def test_embed_rows(dev, vocab, cols, rows):
    """Every row of a prefill chunk: the table row of its token (ids >= vocab clamped to the
    last row), within the bound of test_embed and equal to embed_q4's row (another kernel:
    harness.assert_same_arithmetic)."""
    rng = fresh_rng(vocab + cols + rows)
    qt = rand_quant(rng, (), vocab, cols, 4)
    W, S, B = upload_q(dev, qt)
    toks = rng.integers(0, vocab, rows).astype(np.uint32)
    toks[-1] = vocab + 5
    T, O = upload(dev, toks), dev.buffer(4 * rows * cols)
    run_encoder(dev, _core.encode_embed_rows, (W, S, B), T, O, rows, cols, vocab)  # as the prefill chunk does
    got = download(O, np.float32, (rows, cols))
    ids = np.minimum(toks, vocab - 1)
    want = np.stack([qt.dequantize(int(t)) for t in ids]).astype(np.float64)
    assert_within(got, want, 2 * U * np.stack([magnitude(qt, int(t)) for t in ids]), f"embed_rows {rows} rows")
    for r in {0, rows - 1}:
        T1, O1 = upload(dev, toks[r:r + 1]), dev.buffer(4 * cols)
        run_bound(dev, "embed_q4", cols // EMBED_PER_THREAD, EMBED_THREADS, [W, S, B, T1, O1],
                  pack_args("EmbedArgs", cols=cols, vocab=vocab), reads=[W, S, B, T1], writes=[O1], threadgroups=False, label="embed_q4")
        assert_same_arithmetic(dev, got[r], download(O1, np.float32), f"row {r}: embed_rows_q4 vs embed_q4")
