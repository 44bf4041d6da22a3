"""Embedding twins (metal/embed.metal): one row (embed_q4, which the runtime does not dispatch:
decode fuses it into embed_norm_gemv_q4) and a chunk's rows (embed_rows_q4, encoded by the
prefill plan's own builder, ``lily._core.encode_embed_rows``)."""

from __future__ import annotations

import numpy as np

from lily import _core
from lily.lab.device import download, pack_args, upload
from lily.lab.kernels.harness import TOY, U, check, magnitude, model, rand_quant, ratio, run_bound, run_encoder, upload_q

# embed_q4's threadgroup and values per thread (metal/decode_args.h)
EMBED_THREADS = _core.CONSTANTS["kEmbedThreads"]
EMBED_PER_THREAD = _core.CONSTANTS["kEmbedValuesPerThread"]


@check("embed_q4")
def _embed(dev, rng, kernel, size=TOY):
    """Model size: the vocabulary's 248,320 rows of the hidden 2048, a token in the last 1024."""
    c = size.model and model()
    vocab, cols = size.pick((100, 128), (c and c.vocab_size, c and c.hidden_size))
    qt = rand_quant(rng, (), vocab, cols, 4)
    W, S, B = upload_q(dev, qt)
    tok = int(rng.integers(vocab - size.pick(vocab, 1024), vocab))
    T, O = upload(dev, np.array([tok], np.uint32)), dev.buffer(4 * cols)
    run_bound(dev, kernel, cols // EMBED_PER_THREAD, EMBED_THREADS, [W, S, B, T, O], pack_args("EmbedArgs", cols=cols, vocab=vocab),
              reads=[W, S, B, T], writes=[O], threadgroups=False)
    return ratio(download(O, np.float32), qt.dequantize(tok).astype(np.float64), 2 * U * magnitude(qt, tok),
                 f"{kernel} row {tok}")


@check("embed_rows_q4")
def _embed_rows(dev, rng, kernel, size=TOY):
    """Model size: size.rows tokens of the whole vocabulary."""
    c = size.model and model()
    vocab, cols, M = size.pick((60, 128, 5), (c and c.vocab_size, c and c.hidden_size, size.rows))
    qt = rand_quant(rng, (), vocab, cols, 4)
    toks = rng.integers(0, vocab, M).astype(np.uint32)
    W, S, B = upload_q(dev, qt)
    T, O = upload(dev, toks), dev.buffer(4 * M * cols)
    run_encoder(dev, _core.encode_embed_rows, (W, S, B), T, O, M, cols, vocab)
    want = np.stack([qt.dequantize(int(t)) for t in toks]).astype(np.float64)
    tol = 2 * U * np.stack([magnitude(qt, int(t)) for t in toks])
    return ratio(download(O, np.float32, (M, cols)), want, tol, f"{kernel} {M} rows")
