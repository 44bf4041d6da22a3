"""GEMV twins (metal/gemv.metal): the quantized GEMVs, the gated GEMV of the Gated DeltaNet
out_proj, and the fused RMSNorm + GEMV (norm_gemv, embed_norm_gemv) of the decode step."""

from __future__ import annotations

import numpy as np

from lily.checkpoint import bf16_to_f32, f32_to_bf16
from lily import _core
from lily._core import kernel_name, kernel_params
from lily.lab.device import download, pack_args, upload
from lily.lab.kernels.harness import (
    DEPTH, TOY, U, check, f32, from_bf16, gemv_exact, magnitude, model, rand_quant, ratio, run, run_bound,
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
MAX_MATRICES = _core.CONSTANTS["kNormGemvMaxMatrices"]  # of one norm_gemv dispatch


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


def norm_gemv_args(rows, cols, eps, write_xn, rps=NORM_GEMV_ROWS_PER_SG, splits=1):
    """NormGemvArgs of up to MAX_MATRICES matrices of ``rows`` rows (the other slots unused),
    ``rps`` rows per simdgroup shared by ``splits`` simdgroups."""
    rows = list(rows) + [0] * (MAX_MATRICES - len(rows))
    return pack_args("NormGemvArgs", rows=rows, cols=cols, eps=eps, write_xn=write_xn, rows_per_simdgroup=rps,
                     k_splits=splits)


def _bind(i, spec):
    return (i, spec[0], spec[1]) if isinstance(spec, tuple) else (i, spec)


def enc_norm_gemv(p, bits, X, NW, XN, mats, cols, eps=NORM_EPS, write_xn=True, tg=TG, extra=0, label=None,
                  rps=NORM_GEMV_ROWS_PER_SG, splits=1):
    """Encodes norm_gemv_q{bits} with its declared ranges (docs/kernels.md).
    mats: up to four (rows, (W, S, B), Y), each binding a Buffer or (Buffer, offset, size).
    Slots past len(mats) are unused (rows 0) and bound to arbitrary buffers."""
    rows = [m[0] for m in mats]
    buffers = [(0, X), (1, NW), (2, XN)]
    reads, writes = [X, NW], ([XN] if write_xn else [])
    for i in range(MAX_MATRICES):
        if i < len(mats):
            r, wsb, Y = mats[i]
            specs = [*wsb, Y]
            if r:
                reads += list(wsb)
                y = Y if isinstance(Y, tuple) else (Y, 0)
                writes.append((y[0], y[1], 4 * r))
        else:
            specs = [X, X, X, X]  # unused slot: bound (the simulator requires it), never accessed
        buffers += [_bind(3 + 4 * i + j, sp) for j, sp in enumerate(specs)]
    p.dispatch(kernel_name("norm_gemv", q=bits), norm_gemv_grid(rows, tg, rps, splits) + extra, tg,
               buffers=buffers, constants=[(19, norm_gemv_args(rows, cols, eps, write_xn, rps, splits))],
               reads=reads, writes=writes, threadgroups=True, label=label or kernel_name("norm_gemv", q=bits))


def rms_ref64(x, nw_bits, eps=NORM_EPS):
    x64 = np.asarray(x, np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64) + eps) * bf16_to_f32(nw_bits).astype(np.float64)


def enc_embed_norm_gemv(p, EW, ES, EB, T, H, NW, XN, mats, cols, vocab, write_xn, eps=NORM_EPS):
    """Encodes embed_norm_gemv_q4 (the decode step's first dispatch: the token's embedding
    row into H, then norm_gemv_q4 on it). mats: up to four (rows, (W, S, B) or None, Y); the
    slots past len(mats) are bound to NW (unused: rows 0)."""
    mats = list(mats) + [(0, None, NW)] * (MAX_MATRICES - len(mats))
    rows = [r for r, _, _ in mats]
    buffers = [(0, H), (1, NW), (2, XN), (20, EW), (21, ES), (22, EB), (23, T)]
    reads, writes = [NW, EW, ES, EB, T], [H] + ([XN] if write_xn else [])
    for i, (r, wsb, Y) in enumerate(mats):
        specs = [*(wsb if wsb is not None else (NW, NW, NW)), Y]
        buffers += [(3 + 4 * i + j, sp) for j, sp in enumerate(specs)]
        if r:
            reads += list(wsb)
            writes.append(Y)
    p.dispatch("embed_norm_gemv_q4", norm_gemv_grid(rows), TG, buffers=buffers,
               constants=[(19, norm_gemv_args(rows, cols, eps, write_xn)),
                          (24, pack_args("EmbedArgs", cols=cols, vocab=vocab))],
               reads=reads, writes=writes, threadgroups=True, label="embed_norm_gemv_q4")


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
    run_bound(dev, kernel, gemv_grid(rows), TG, [W, S, B, X, Y], gemv_args(rows, cols),
         reads=[W, S, B, X] + ([Y] if add else []), writes=[Y])
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
    run(dev, kernel, gemv_grid(rows, tg), tg,
        buffers=list(enumerate([W, S, B, Y, R])) + [(6, SSQ), (7, Z), (8, NW)],
        constants=[(5, gemv_args(rows, cols)), (9, pack_args("GatedNormArgs", head_dim=Dv, splits=splits, eps=eps))],
        reads=[W, S, B, Y, R, SSQ, Z, NW], writes=[R], label=kernel)
    x = gated_x64(y, ssq, z, nw, Dv, eps)
    exact, mag = gemv_exact(qt, x)
    exact = exact + r0
    tol = (DEPTH + 8) * U * mag + 2 * U * np.abs(exact)
    return ratio(download(R, np.float32), exact, tol, f"{kernel} {rows}x{cols} Dv={Dv} NS={splits}")


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
