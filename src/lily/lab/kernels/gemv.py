"""GEMV twins (metal/gemv.metal): the quantized GEMVs, the gated GEMV of the Gated DeltaNet
out_proj, and the fused RMSNorm + GEMV (norm_gemv, embed_norm_gemv) of the decode step, and
their batched forms over several rows of a batched decode step (issue 31), each row compared
bit for bit with its batch-1 dispatch; encoded by the decode step's own builders
(:func:`enc_gemv_add`, :func:`enc_norm_gemv`)."""

from __future__ import annotations

import numpy as np

from lily.checkpoint import bf16_to_f32, f32_to_bf16
from lily import _core
from lily._core import kernel_name, kernel_params
from lily.lab.device import download, pack_args, upload
from lily.lab.kernels.harness import (
    DEPTH, TOY, U, check, f32, from_bf16, gemv_exact, magnitude, model, rand_quant, ratio, run_bound, run_encoder,
    to_bf16_bits, upload_q,
)

GEMV_ROWS_PER_SG = _core.CONSTANTS["kGemvRowsPerSimdgroup"]  # metal/decode_args.h
GEMV_SPLIT_K = _core.CONSTANTS["kGemvSplitK"]  # simdgroups sharing a row group in gemv_q*, moe_down_q4
# NormGemvArgs.rows_per_simdgroup of the wide projections, k_splits of the one-row-per-simdgroup
# router and threads per threadgroup of the GEMV-like kernels, as the decode step dispatches
# them (DecodePlan, csrc/runtime/decode.h)
NORM_GEMV_ROWS_PER_SG = _core.CONSTANTS["kNormGemvRows"]
ROUTER_SPLITS = _core.CONSTANTS["kRouterSplits"]
TG = _core.CONSTANTS["kGemvThreads"]
LM_HEAD_THREADS = _core.CONSTANTS["kLmHeadThreads"]  # norm_gemv's threadgroup for lm_head (decode.h)
MAX_MATRICES = _core.CONSTANTS["kNormGemvMaxMatrices"]  # of one norm_gemv dispatch
BATCH_MAX_ROWS = _core.CONSTANTS["kBatchMaxRows"]  # rows of a batched kernel at most (batch_args.h)
#: The batched kernels' ``b`` for ``rows`` rows, the runtime's rule (lily._core.batch_size):
#: the smallest built size that holds them; ValueError for rows outside 1..BATCH_MAX_ROWS.
batch_size = _core.batch_size
BATCH_SIZES = tuple(sorted({batch_size(n) for n in range(1, BATCH_MAX_ROWS + 1)}))  # gemv.metal's b values


def gemv_args(rows: int, cols: int) -> bytes:
    """GemvArgs of a [rows, cols] GEMV."""
    return pack_args("GemvArgs", rows=rows, cols=cols)


def gemv_grid(rows: int, tg: int = TG) -> int:
    """Threadgroups of a gemv_q* or moe_down_q4 dispatch of ``rows`` outputs with ``tg``
    threads (kGemvSplitK simdgroups per group of GEMV_ROWS_PER_SG rows)."""
    return -(-rows // (GEMV_ROWS_PER_SG * tg // 32 // GEMV_SPLIT_K))


NORM_EPS = 1e-6


def norm_gemv_grid(rows, tg=TG, rps=NORM_GEMV_ROWS_PER_SG, splits=1):
    """Threadgroups of a norm_gemv dispatch with ``rps`` rows per simdgroup and ``splits``
    simdgroups per row group: each matrix padded to whole threadgroups."""
    per = rps * tg // 32 // splits
    return sum(-(-r // per) for r in rows)


def _matrices(mats, y_strides, unused):
    """(rows, weights or None, Y or (Y, offset[, size])) -> the builder's (weights, Y, rows, y_at,
    y_stride); ``unused`` stands in for the weights of a slot of 0 rows given as None."""
    out = []
    for i, (r, wsb, Y) in enumerate(mats):
        Y, y_at = (Y[0], Y[1]) if isinstance(Y, tuple) else (Y, 0)
        out.append((tuple(wsb) if wsb is not None else (unused,) * 3, Y, r, y_at, y_strides[i]))
    return out


def enc_norm_gemv(p, bits, X, NW, XN, mats, cols, eps=NORM_EPS, write_xn=True, tg=TG, extra=0, label=None,
                  rps=NORM_GEMV_ROWS_PER_SG, splits=1, batch=None):
    """Encodes norm_gemv_q{bits} with the decode step's own builder (lily._core.encode_norm_gemv,
    csrc/runtime/families/gemv.h; docs/kernels.md). mats: up to four (rows, (W, S, B), Y), each
    of W, S, B a Buffer or (Buffer, offset, size), Y a Buffer or (Buffer, offset); a matrix of
    0 rows is bound only. ``extra``: surplus threadgroups (they exit).

    ``batch = (n, x_stride, y_strides)``: norm_gemv_batch_q{bits}_b{batch_size(n)} over ``n``
    rows, row r's x / xn at float ``r * x_stride`` of X / XN and its output of matrix m at float
    ``r * y_strides[m]`` of that matrix's Y (batch_args.h NormGemvBatchArgs)."""
    n, x_stride, y_strides = batch if batch is not None else (0, 0, [0] * len(mats))
    _core.encode_norm_gemv(p, X, NW, XN, _matrices(mats, y_strides, X), cols, eps, bits=bits, write_xn=write_xn,
                           rows_per_simdgroup=rps, k_splits=splits, threads=tg, batch_rows=n, x_stride=x_stride,
                           extra_groups=extra, label=label or "")


def enc_gemv_add(p, bits, W, S, B, X, Y, rows, cols, tg=TG, batch=None, gated=None):
    """Encodes gemv_q{bits}_add (y += W x) with the decode step's own builder
    (lily._core.encode_gemv_add, csrc/runtime/families/gemv.h), or with ``gated = (SSQ, Z,
    NW, head_dim, splits, eps)`` gemv_gated_q{bits}_add (x normalised on load: GatedNormArgs).
    ``batch = (n, x_stride, y_stride, ssq_stride)``: the batched kernel over ``n`` rows (row r's
    x and z at float ``r * x_stride``, y at ``r * y_stride``, ssq at ``r * ssq_stride``:
    batch_args.h GemvBatchArgs)."""
    n, x_stride, y_stride, ssq_stride = batch if batch is not None else (0, 0, 0, 0)
    _core.encode_gemv_add(p, (W, S, B), X, Y, rows, cols, bits=bits, gated=gated, batch_rows=n, x_stride=x_stride,
                          y_stride=y_stride, ssq_stride=ssq_stride, threads=tg)


def rms_ref64(x, nw_bits, eps=NORM_EPS):
    x64 = np.asarray(x, np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64) + eps) * bf16_to_f32(nw_bits).astype(np.float64)


def enc_embed_norm_gemv(p, EW, ES, EB, T, H, NW, XN, mats, cols, vocab, write_xn, eps=NORM_EPS):
    """Encodes embed_norm_gemv_q4 (the decode step's first dispatch: the token's embedding
    row into H, then norm_gemv_q4 on it) with the decode step's own builder
    (lily._core.encode_norm_gemv with ``embed``). mats: up to four (rows, (W, S, B) or None, Y);
    a matrix of 0 rows is bound only."""
    _core.encode_norm_gemv(p, H, NW, XN, _matrices(mats, [0] * len(mats), NW), cols, eps, write_xn=write_xn,
                           embed=((EW, ES, EB), T, vocab, 0))


@check("gemv_q4", "gemv_q8", "gemv_q4_add", "gemv_q8_add")
def _gemv(dev, rng, kernel, size=TOY):
    """Model size: the attention's o_proj (hidden x 16 heads of 256)."""
    bits, add = kernel_params(kernel)["q"], kernel.endswith("_add")
    m = size.model and model()
    rows, cols = size.pick((100, 256), (m and m.hidden_size, m and m.num_attention_heads * m.head_dim))
    qt = rand_quant(rng, (), rows, cols, bits)
    x = rng.standard_normal(cols).astype(np.float32)
    r0 = rng.standard_normal(rows).astype(np.float32)
    W, S, B = upload_q(dev, qt)
    X = upload(dev, x)
    Y = upload(dev, r0) if add else dev.buffer(4 * rows)
    if add:  # the decode step's encoder (o_proj)
        run_encoder(dev, enc_gemv_add, bits, W, S, B, X, Y, rows, cols)
    else:  # gemv_q*: no runtime dispatch of its own
        run_bound(dev, kernel, gemv_grid(rows), TG, [W, S, B, X, Y], gemv_args(rows, cols), reads=[W, S, B, X],
                  writes=[Y])
    exact, mag = gemv_exact(qt, x)
    if add:
        exact, mag = exact + r0, mag + np.abs(r0)
    return ratio(download(Y, np.float32), exact, DEPTH * U * mag, f"{kernel} {rows}x{cols}")


def gated_x64(y, ssq, z, norm_w_bits, Dv, eps=1e-6):
    """float64 gated RMSNorm of y (docs/model.md): y / sqrt(ss / Dv + eps) * norm_w * silu(z),
    ss of a head = the sum of its partials ``ssq`` [Hv, NS]."""
    y, z = np.asarray(y, np.float64).reshape(-1, Dv), np.asarray(z, np.float64).reshape(-1, Dv)
    ss = np.asarray(ssq, np.float64).reshape(len(y), -1).sum(1)
    w = from_bf16(norm_w_bits).astype(np.float64)
    return (y / np.sqrt(ss / Dv + eps)[:, None] * w * z / (1 + np.exp(-z))).reshape(-1)


def gemv_gated_ratio(dev, rng, kernel, rows, Hv, Dv, splits, tg=TG, eps=1e-6):
    """gemv_gated_q*_add on random weights, y (with each split's float32 sum of y^2 as ssq), z,
    norm weight and residual, against float64; returns the worst error ratio. Bound: the GEMV's
    DEPTH u per |W| |x'| term plus 8 u for x' itself (a square root, a division, three products
    and the SiLU, each within an ulp or two) and 2 u of the residual."""
    bits, cols = kernel_params(kernel)["q"], Hv * Dv
    qt = rand_quant(rng, (), rows, cols, bits)
    y, z = f32(rng.standard_normal(cols) * 0.3), f32(rng.standard_normal(cols) * 2)
    ssq = f32((f32(y).reshape(Hv, splits, Dv // splits) ** 2).sum(-1))
    nw = f32_to_bf16(f32(1 + 0.1 * rng.standard_normal(Dv)))
    r0 = f32(rng.standard_normal(rows))
    W, S, B = upload_q(dev, qt)
    Y, SSQ, Z, NW, R = upload(dev, y), upload(dev, ssq), upload(dev, z), upload(dev, nw), upload(dev, r0)
    run_encoder(dev, enc_gemv_add, bits, W, S, B, Y, R, rows, cols, tg, gated=(SSQ, Z, NW, Dv, splits, eps))
    exact, tol = _gemv_add_bound(qt, r0, gated_x64(y, ssq, z, nw, Dv, eps), 8)
    return ratio(download(R, np.float32), exact, tol, f"{kernel} {rows}x{cols} Dv={Dv} NS={splits}")


def _gemv_add_bound(qt, r0, x64, extra=0):
    """The exact r0 + W x (float64) and its bound: DEPTH u per |W| |x| term (plus ``extra`` u for
    an x computed on load, the gated norm's 8) and 2 u of the residual."""
    exact, mag = gemv_exact(qt, x64)
    exact = exact + r0
    return exact, (DEPTH + extra) * U * mag + 2 * U * np.abs(exact)


def same_bits(got, want, what: str) -> None:
    """Check that a batched row is bit-identical to its batch-1 dispatch.

    Parameters
    ----------
    got, want : array_like
        The row's batched result and its batch-1 result, compared as float32 bit patterns
        (so ``-0.0`` differs from ``0.0`` and equal NaNs match).
    what : str
        Names the row in the error.

    Raises
    ------
    AssertionError
        When any element's bits differ.
    """
    if not np.array_equal(np.asarray(got, np.float32).view(np.uint32), np.asarray(want, np.float32).view(np.uint32)):
        raise AssertionError(f"{what}: differs from the row's batch-1 result")


def norm_gemv_batch_ratio(dev, rng, bits, n, rows=(96, 1, 37), cols=256, tg=TG, rps=NORM_GEMV_ROWS_PER_SG,
                          splits=1):
    """norm_gemv_batch_q{bits} over ``n`` rows (strided x, xn and outputs, one matrix set)
    against each row's batch-1 norm_gemv_q{bits} dispatch at the same geometry: raises
    AssertionError unless every row's xn and outputs are bit-identical to it; returns the
    worst error ratio of the batched rows against float64 (:func:`_norm_gemv_ratio`)."""
    x_stride, y_strides = cols + 4, [r + 3 for r in rows]
    xs = (rng.standard_normal((n, x_stride)) * 2).astype(np.float32)
    nw = to_bf16_bits(1 + 0.2 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), r, cols, bits) for r in rows]
    wsb = [upload_q(dev, qt) for qt in qts]
    NW, X, XN = upload(dev, nw), upload(dev, xs.ravel()), dev.buffer(4 * n * x_stride)
    Ys = [dev.buffer(4 * n * ys) for ys in y_strides]
    geometry = dict(write_xn=True, tg=tg, rps=rps, splits=splits)
    run_encoder(dev, enc_norm_gemv, bits, X, NW, XN, list(zip(rows, wsb, Ys)), cols,
                batch=(n, x_stride, y_strides), **geometry)
    xn_all = download(XN, np.float32).reshape(n, x_stride)
    ys_all = [download(Y, np.float32).reshape(n, ys) for Y, ys in zip(Ys, y_strides)]
    worst = 0.0
    for b in range(n):
        X1, XN1 = upload(dev, xs[b, :cols]), dev.buffer(4 * cols)
        mats = [(r, w, dev.buffer(4 * r)) for r, w in zip(rows, wsb)]
        run_encoder(dev, enc_norm_gemv, bits, X1, NW, XN1, mats, cols, **geometry)
        what = f"norm_gemv_batch_q{bits} n={n} row {b}"
        same_bits(xn_all[b, :cols], download(XN1, np.float32), f"{what} xn")
        for m, (r, _, Y1) in enumerate(mats):
            same_bits(ys_all[m][b, :r], download(Y1, np.float32), f"{what} matrix {m}")
        worst = max(worst, _norm_gemv_ratio(what, xs[b, :cols], nw, XN1, qts, mats))
    return worst


def gemv_batch_ratio(dev, rng, bits, n, gated, rows=100, Hv=4, Dv=64, splits=4, tg=TG, eps=1e-6):
    """gemv_batch_q{bits}_add (or with ``gated`` gemv_gated_batch_q{bits}_add, cols = Hv Dv,
    ``splits`` partial sums of squares per head) over ``n`` rows (strided x, z, ssq and
    residuals) against each row's batch-1 kernel: raises AssertionError unless every row is
    bit-identical to it; returns the worst error ratio against float64."""
    cols = Hv * Dv
    x_stride, y_stride, ssq_stride = cols + 8, rows + 5, Hv * splits + 2
    qt = rand_quant(rng, (), rows, cols, bits)
    W, S, B = upload_q(dev, qt)
    xs = f32(rng.standard_normal((n, x_stride)) * (0.3 if gated else 1.0))
    zs = f32(rng.standard_normal((n, x_stride)) * 2)
    r0 = f32(rng.standard_normal((n, y_stride)))
    ssq = np.zeros((n, ssq_stride), np.float32)
    for b in range(n):
        ssq[b, :Hv * splits] = (xs[b, :cols].reshape(Hv, splits, Dv // splits) ** 2).sum(-1).ravel()
    nw = f32_to_bf16(f32(1 + 0.1 * rng.standard_normal(Dv)))
    NW = upload(dev, nw)

    def gate(SSQ, Z):
        return (SSQ, Z, NW, Dv, splits, eps) if gated else None

    X, R, SSQ, Z = upload(dev, xs.ravel()), upload(dev, r0.ravel()), upload(dev, ssq.ravel()), upload(dev, zs.ravel())
    run_encoder(dev, enc_gemv_add, bits, W, S, B, X, R, rows, cols, tg, batch=(n, x_stride, y_stride, ssq_stride),
                gated=gate(SSQ, Z))
    got = download(R, np.float32).reshape(n, y_stride)
    worst = 0.0
    for b in range(n):
        X1, R1 = upload(dev, xs[b, :cols]), upload(dev, r0[b, :rows])
        SSQ1, Z1 = upload(dev, ssq[b, :Hv * splits]), upload(dev, zs[b, :cols])
        run_encoder(dev, enc_gemv_add, bits, W, S, B, X1, R1, rows, cols, tg, gated=gate(SSQ1, Z1))
        what = f"{'gemv_gated' if gated else 'gemv'}_batch_q{bits}_add n={n} row {b}"
        same_bits(got[b, :rows], download(R1, np.float32), what)
        x64 = (gated_x64(xs[b, :cols], ssq[b, :Hv * splits].reshape(Hv, splits), zs[b, :cols], nw, Dv, eps)
               if gated else xs[b, :cols].astype(np.float64))
        exact, tol = _gemv_add_bound(qt, r0[b, :rows], x64, 8 if gated else 0)
        worst = max(worst, ratio(got[b, :rows], exact, tol, what))
    return worst


@check(*[kernel_name("norm_gemv_batch", q=q, b=b) for q in (4, 8) for b in BATCH_SIZES])
def _norm_gemv_batch(dev, rng, kernel, size=TOY):
    """Model size: q4 a DeltaNet layer's four input projections, then lm_head (the vocabulary's
    rows, LM_HEAD_THREADS a threadgroup); q8 the router and the shared-expert gate at the
    router's geometry."""
    p = kernel_params(kernel)
    n = max(2, p["b"] - 1)
    if not size.model:
        return norm_gemv_batch_ratio(dev, rng, p["q"], n, rows=(40, 7), cols=128)
    m = model()
    if p["q"] == 8:
        return norm_gemv_batch_ratio(dev, rng, 8, n, rows=(m.num_experts, 1), cols=m.hidden_size, rps=1,
                                     splits=ROUTER_SPLITS)
    return max(norm_gemv_batch_ratio(dev, rng, 4, n, rows=_gdn_in_proj_rows(m), cols=m.hidden_size),
               norm_gemv_batch_ratio(dev, rng, 4, n, rows=(m.vocab_size,), cols=m.hidden_size, tg=LM_HEAD_THREADS))


@check(*[kernel_name(base, "_add", q=q, b=b) for base in ("gemv_batch", "gemv_gated_batch") for q in (4, 8)
         for b in BATCH_SIZES])
def _gemv_batch(dev, rng, kernel, size=TOY):
    """Model size: the gated one the DeltaNet out_proj (as :func:`_gemv_gated`), the other the
    attention's o_proj (hidden x 16 heads of 256)."""
    p, gated = kernel_params(kernel), kernel.startswith("gemv_gated")
    n = max(2, p["b"] - 1)
    if not size.model:
        return gemv_batch_ratio(dev, rng, p["q"], n, gated, rows=40, Hv=2, Dv=64)
    from lily.lab.kernels.gdn import GDN_DECODE_SPLITS
    m = model()
    if gated:
        return gemv_batch_ratio(dev, rng, p["q"], n, True, rows=m.hidden_size, Hv=m.linear_num_value_heads,
                                Dv=m.linear_value_head_dim, splits=GDN_DECODE_SPLITS)
    return gemv_batch_ratio(dev, rng, p["q"], n, False, rows=m.hidden_size, Hv=m.num_attention_heads,
                            Dv=m.head_dim)


@check("gemv_gated_q4_add", "gemv_gated_q8_add")
def _gemv_gated(dev, rng, kernel, size=TOY):
    """Model size: the DeltaNet out_proj (hidden x 32 value heads of 128, the decode step's
    splits of each head's sum of squares)."""
    if not size.model:
        return gemv_gated_ratio(dev, rng, kernel, 100, 4, 64, 4)
    from lily.lab.kernels.gdn import GDN_DECODE_SPLITS
    m = model()
    return gemv_gated_ratio(dev, rng, kernel, m.hidden_size, m.linear_num_value_heads, m.linear_value_head_dim,
                            GDN_DECODE_SPLITS)


def _norm_gemv_ratio(kernel, x, nw, XN, qts, mats):
    """Worst error ratio of a norm_gemv's xn (vs float64 RMSNorm of x) and of its matrix
    outputs (vs float64 products with the xn the kernel wrote)."""
    want_xn = rms_ref64(x, nw)
    xn = download(XN, np.float32)
    r = ratio(xn, want_xn, DEPTH * U * np.abs(want_xn) + 1e-30, f"{kernel} xn")
    for qt, (rows, _, Y) in zip(qts, mats):
        exact, mag = gemv_exact(qt, xn)
        r = max(r, ratio(download(Y, np.float32), exact, DEPTH * U * mag, f"{kernel} {rows}x{xn.size}"))
    return r


def _gdn_in_proj_rows(m) -> tuple[int, ...]:
    """The DeltaNet's four input projections (qkv, z, b, a): a decode layer's first norm_gemv."""
    Hv, Dv = m.linear_num_value_heads, m.linear_value_head_dim
    return (2 * m.linear_num_key_heads * m.linear_key_head_dim + Hv * Dv, Hv * Dv, Hv, Hv)


@check("norm_gemv_q4", "norm_gemv_q8")
def _norm_gemv(dev, rng, kernel, size=TOY):
    """Model size: q4 the final norm and the lm_head (the vocabulary's 248,320 rows), q8 the
    router (256 experts) and the shared-expert gate."""
    bits = kernel_params(kernel)["q"]
    m = size.model and model()
    cols = size.pick(128, m and m.hidden_size)
    shapes = size.pick((40, 7), m and ((m.vocab_size,) if bits == 4 else (m.num_experts, 1)))
    x = (rng.standard_normal(cols) * 2).astype(np.float32)
    nw = to_bf16_bits(1 + 0.2 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), r, cols, bits) for r in shapes]
    X, NW, XN = upload(dev, x), upload(dev, nw), dev.buffer(4 * cols)
    mats = [(qt.weight.shape[0], upload_q(dev, qt), dev.buffer(4 * qt.weight.shape[0])) for qt in qts]
    cb = dev.command_buffer()
    # q8: the router's geometry (one row per two simdgroups, csrc/runtime/decode.cpp kRouterRows)
    enc_norm_gemv(cb.compute_pass(), bits, X, NW, XN, mats, cols, write_xn=True,
                  rps=1 if bits == 8 else NORM_GEMV_ROWS_PER_SG, splits=ROUTER_SPLITS if bits == 8 else 1)
    cb.commit()
    cb.wait()
    return _norm_gemv_ratio(kernel, x, nw, XN, qts, mats)


@check("embed_norm_gemv_q4")
def _embed_norm_gemv(dev, rng, kernel, size=TOY):
    """Model size: the vocabulary's embedding and layer 0's DeltaNet input projections."""
    m = size.model and model()
    vocab, cols = size.pick((50, 128), (m and m.vocab_size, m and m.hidden_size))
    emb = rand_quant(rng, (), vocab, cols, 4, "embed")
    nw = to_bf16_bits(1 + 0.2 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), r, cols, 4) for r in size.pick((24, 9), m and _gdn_in_proj_rows(m))]
    tok = int(rng.integers(vocab))
    EW, ES, EB = upload_q(dev, emb)
    T, NW, H, XN = upload(dev, np.array([tok], np.uint32)), upload(dev, nw), dev.buffer(4 * cols), dev.buffer(4 * cols)
    mats = [(q.weight.shape[0], upload_q(dev, q), dev.buffer(4 * q.weight.shape[0])) for q in qts]
    cb = dev.command_buffer()
    enc_embed_norm_gemv(cb.compute_pass(), EW, ES, EB, T, H, NW, XN, mats, cols, vocab, write_xn=True)
    cb.commit()
    cb.wait()
    h = download(H, np.float32)
    r = ratio(h, emb.dequantize(tok).astype(np.float64), 2 * U * magnitude(emb, tok), f"{kernel} embedding row {tok}")
    return max(r, _norm_gemv_ratio(kernel, h, nw, XN, qts, mats))
