"""Dense GEMM twins (metal/gemm.metal, gemm_tensor.metal): the prefill GEMMs on bfloat operands,
the SwiGLU GEMM with its row scale, and the tensor-op probes; the GEMMs encoded by the prefill
plan's own builder (:func:`enc_gemm`)."""

from __future__ import annotations

import numpy as np

from lily import _core
from lily._core import kernel_params
from lily.checkpoint import QuantizedTensor, bf16_to_f32, f32_to_bf16
from lily.lab.device import download, pack_args, upload
from lily.lab.kernels.harness import (
    HALF_MAX, TOY, U, bf16_activations, bf16_round, bf16_operand, bf16_stored, bf16_weights, check, model, rand_quant,
    ratio, run, run_encoder, upload_bf16, upload_q,
)
from lily.reference import silu

# The GEMM geometry of metal/gemm_args.h (lily._core.CONSTANTS): dense block rows, columns
# and threads (gemm.metal), those of the tensor-op twins (gemm_tensor.metal), SwiGLU's columns
# of gate and of up, the k step.
_C = _core.CONSTANTS
GEMM_BM, GEMM_BN, GEMM_TG = _C["kGemmBM"], _C["kGemmBN"], _C["kGemmThreads"]
GEMM_TENSOR_BM, GEMM_TENSOR_TG = _C["kGemmTensorBM"], _C["kGemmTensorThreads"]
GEMM_SWIGLU_BN = _C["kGemmSwigluBN"]
GEMM_BK = _C["kGemmBK"]


def gemm_args(m: int, n: int, k: int, lda: int | None = None, ldy: int | None = None) -> bytes:
    """GemmArgs of y[m, n] (=|+=) x[m, k] W^T; row strides lda (default k) and ldy (default n)."""
    return pack_args("GemmArgs", m=m, n=n, k=k, lda=k if lda is None else lda, ldy=n if ldy is None else ldy)


def gemm_geometry(kernel: str) -> tuple[int, int]:
    """(rows per threadgroup, threads per threadgroup) of dense GEMM ``kernel``: kGemmBM and
    kGemmThreads (gemm.metal), kGemmTensorBM and kGemmTensorThreads for the tensor-op twins
    (``*_tensor``, gemm_tensor.metal; metal/gemm_args.h)."""
    return (GEMM_TENSOR_BM, GEMM_TENSOR_TG) if kernel.endswith("_tensor") else (GEMM_BM, GEMM_TG)


def gemm_bound(K):
    """First-order relative error bound of a K-term fp32 dot product in the GEMM kernels' order."""
    return (K + 8) * U


def gemm_ref(x, qt: QuantizedTensor, index=None):
    """(exact, tol) of y = x W^T as the prefill GEMMs compute it (metal/gemm_tiles.h): both
    operands rounded to bfloat (bf16_operand, bf16_weights), each product exact in fp32 (8 x 8
    significant bits), summed in fp32 in some order. exact is the float64 product of the
    rounded operands; tol = (K + 8) u |xb| |wb|^T (gemm_bound: the fp32 sum in any order). The
    bf16 rounding itself is modelled, not tolerated, so the bound stays that of an fp32 GEMM,
    whatever the magnitudes (nothing is clipped)."""
    xb = bf16_operand(x)
    wb = bf16_weights(qt, index)
    return xb @ wb.T, gemm_bound(x.shape[-1]) * (np.abs(xb) @ np.abs(wb).T)


def swiglu_bound(g, u, dg, du):
    """h = silu(g) * u and a first-order bound of its error for |g err| <= dg, |u err| <= du:
    |silu'| <= 1.1, plus a few roundings of the activation itself."""
    with np.errstate(over="ignore"):  # silu of a large negative gate: exp overflows, x / inf = -0
        sg = silu(g)
    h = sg * u
    return h, 1.1 * np.abs(u) * dg + np.abs(sg) * du + 8 * U * np.abs(h)


def swiglu_ref(x, g_q, u_q, index=None, scale=None):
    """silu(x Wg^T) * (x Wu^T) in float64 from the prefill GEMMs' bfloat operands (gemm_ref)
    and its first-order error bound; with ``scale`` (fp32 [m], gemm_swiglu_q4's row scale)
    each row times its scale, one more fp32 rounding."""
    g, dg = gemm_ref(x, g_q, index)
    u, du = gemm_ref(x, u_q, index)
    h, tol = swiglu_bound(g, u, dg, du)
    if scale is None:
        return h, tol
    s = np.asarray(scale, np.float64)[:, None]
    h = h * s
    return h, tol * np.abs(s) + U * np.abs(h)


def beyond_half(rng, shape, reach=10.0):
    """Standard normal values, one element of every third row set to +-``reach`` times the
    largest half (65504): inputs outside half's range, as activations of Qwen-family
    checkpoints can be (llama.cpp #26223, vLLM #33972; docs/prefill.md, "Operand precision"),
    which nothing may clip; the other rows keep the bound tight for ordinary values."""
    rows = rng.standard_normal(shape).reshape(-1, shape[-1])
    big = np.arange(0, rows.shape[0], 3)
    rows[big, rng.integers(0, shape[-1], big.size)] = reach * HALF_MAX * rng.choice([-1.0, 1.0], big.size)
    return rows.reshape(shape).astype(np.float32)


def scaled_operand(x, s, shift):
    """The A operand of gemm_q4_add_hs: bfloat x times its half scale s per 2^shift elements,
    the fp32 product rounded to bfloat once (gemm_tiles.h GemmAScaled)."""
    return bf16_round(np.asarray(x, np.float32) * np.repeat(np.asarray(s, np.float32), 1 << shift, axis=1))


def row_scale(rng, m, ld=3, col=2):
    """A row scale as gemm_swiglu_q4 reads it: column ``col`` of fp32 [m, ld] in [0, 1) (the
    routing weights' shared-gate column). Returns (the [m, ld] array, the column index)."""
    return rng.random((m, ld)).astype(np.float32), col


def row_scale_operand(dev, w, col):
    """gemm_swiglu_q4's row scale, column ``col`` of ``w`` fp32 [m, ld], as :func:`enc_gemm`
    takes it: (the buffer, the column, ld)."""
    return upload(dev, w), col, w.shape[1]


def enc_gemm(p, kernel, wb, X, Y, m, n, k, lda=None, ldy=None, x_at=0, y_at=0, x_scale=None, x_shift=0,
             row_scale=None, disjoint=0, label=""):
    """Encodes dense GEMM ``kernel`` (gemm_q4, gemm_q8, gemm_q4_add_h, gemm_q4_add_hs,
    gemm_q4_bf16, gemm_swiglu_q4, or a ``_tensor`` twin) on compute pass ``p`` with the prefill
    plan's own builder (lily._core.encode_gemm / encode_gemm_swiglu, csrc/runtime/families/
    gemm.h): its grid, bindings and declared ranges. ``wb``: the weight's (weight, scales,
    biases) buffers, gate's then up's for SwiGLU; X bfloat rows of ``lda`` (default k)
    elements from byte ``x_at``, Y rows of ``ldy`` (default n) from byte ``y_at``;
    ``x_scale``/``x_shift``: gemm_q4_add_hs's half factors; ``row_scale``: SwiGLU's
    (:func:`row_scale_operand`); ``disjoint``: a nonzero tag for GEMMs writing disjoint
    columns of one Y in one stage."""
    tensor, strides = kernel.endswith("_tensor"), dict(lda=lda or 0, ldy=ldy or 0)
    if kernel.startswith("gemm_swiglu"):
        G, col, ld = row_scale
        _core.encode_gemm_swiglu(p, tuple(wb[:3]), tuple(wb[3:]), X, Y, m, n, k, G, 4 * col, ld, tensor=tensor,
                                 label=label, **strides)
    else:
        _core.encode_gemm(p, tuple(wb), X, Y, m, n, k, bits=kernel_params(kernel)["q"], add="_add" in kernel,
                          bf16_y="_bf16" in kernel, x_scale=x_scale, x_shift=x_shift, tensor=tensor, x_at=x_at,
                          y_at=y_at, disjoint=disjoint, label=label, **strides)


@check("gemm_q4", "gemm_q8", "gemm_q4_add_h", "gemm_q4_bf16", "gemm_q4_add_hs", "gemm_q4_tensor", "gemm_q8_tensor",
       "gemm_q4_add_h_tensor", "gemm_q4_bf16_tensor", "gemm_q4_add_hs_tensor")
def _gemm(dev, rng, kernel, size=TOY):
    """gemm_q4_bf16: y stored as bfloat (the GDN z, the attention's q|gate, k, v);
    gemm_q4_add_hs: x times a half scale per 32 elements of a row (the GDN out_proj). Rows
    reach 10x the half range (nothing is clipped). Model size, a chunk of size.rows rows
    through: gemm_q4 and _bf16 the attention's q|gate projection (16 heads of 2 x 256 from the
    hidden 2048), _add_h its o_proj, _add_hs the DeltaNet out_proj (32 value heads of 128 to
    the hidden), gemm_q8 the router (256 experts)."""
    bits, add, bf_y, scaled = kernel_params(kernel)["q"], "_add" in kernel, "_bf16" in kernel, "_add_hs" in kernel
    if size.model:
        c = model()
        H = c.hidden_size
        n, k = ((H, c.linear_num_value_heads * c.linear_value_head_dim) if scaled else
                (H, c.num_attention_heads * c.head_dim) if add else
                (c.num_experts, H) if bits == 8 else (2 * c.num_attention_heads * c.head_dim, H))
        m = size.rows
    else:
        m, n, k = 33, 70, 128
    qt = rand_quant(rng, (), n, k, bits)
    x = bf16_activations(beyond_half(rng, (m, k)))  # bf16 activations (their producers round)
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    W, S, B = upload_q(dev, qt)
    X = upload_bf16(dev, x)
    Y = upload(dev, y0) if add else dev.buffer((2 if bf_y else 4) * m * n)
    if scaled:
        shift = 5
        f = rng.uniform(0.0, 1.0, (m, k >> shift)).astype(np.float16)
        run_encoder(dev, enc_gemm, kernel, (W, S, B), X, Y, m, n, k, x_scale=upload(dev, f), x_shift=shift)
        x = scaled_operand(x, f, shift)
    else:
        run_encoder(dev, enc_gemm, kernel, (W, S, B), X, Y, m, n, k)
    exact, tol = gemm_ref(x, qt)
    if add:
        exact = exact + y0
        tol = tol + 2 * U * np.abs(exact)
    if bf_y:
        exact, tol = bf16_stored(exact, tol)
    got = download(Y, "bf16" if bf_y else np.float32, (m, n))
    return ratio(got, exact, tol, f"{kernel} {m}x{n}x{k}")


@check("gemm_swiglu_q4", "gemm_swiglu_q4_tensor")
def _gemm_swiglu(dev, rng, kernel, size=TOY):
    """Model size: the shared expert's gate and up (512 from the hidden 2048) on size.rows rows."""
    c = size.model and model()
    m, n, k = size.pick((21, 70, 128), (size.rows, c and c.shared_expert_intermediate_size, c and c.hidden_size))
    gq, uq = rand_quant(rng, (), n, k, 4), rand_quant(rng, (), n, k, 4)
    x = bf16_activations(beyond_half(rng, (m, k)))
    w, col = row_scale(rng, m)
    X, Y = upload_bf16(dev, x), dev.buffer(2 * m * n)  # bfloat in, bfloat out
    run_encoder(dev, enc_gemm, kernel, [*upload_q(dev, gq), *upload_q(dev, uq)], X, Y, m, n, k,
                row_scale=row_scale_operand(dev, w, col))
    want, tol = bf16_stored(*swiglu_ref(x, gq, uq, scale=w[:, col]))
    return ratio(download(Y, "bf16", (m, n)), want, tol, f"{kernel} {m}x{n}x{k}")


def _probe_ratio(out, a, b, what):
    return ratio(download(out, np.float32, (32, 64)), a @ b, gemm_bound(GEMM_BK) * (np.abs(a) @ np.abs(b)), what)


@check("tensor_ops_probe")
def _tensor_ops_probe(dev, rng, kernel, size=TOY):
    """For x float32 [64, kGemmBK] (metal/gemm_tensor.metal): out = b(x[:32]) b(x)^T (b =
    bf16_operand) against an fp32 sum's bound."""
    x = rng.standard_normal((64, GEMM_BK)).astype(np.float32)
    X, O = upload(dev, x), dev.buffer(32 * 64 * 4)
    run(dev, kernel, 1, 128, [(0, X), (1, O)], reads=[X], writes=[O])
    xb = bf16_operand(x)
    return _probe_ratio(O, xb[:32], xb.T, kernel)


@check("tensor_ops_probe_bfloat")
def _tensor_ops_probe_bfloat(dev, rng, kernel, size=TOY):
    """For xb bfloat [64, 64] (metal/attention_prefill_tensor.metal): out_qk = xb[:32] xb^T,
    out_pv = xb[:32] xb; the worse of the two against an fp32 sum's bound."""
    bits = f32_to_bf16(rng.standard_normal((64, GEMM_BK)).astype(np.float32))
    XB = upload(dev, bits)
    QK, PV = (dev.buffer(32 * 64 * 4) for _ in range(2))
    run(dev, kernel, 1, 128, [(0, XB), (1, QK), (2, PV)], reads=[XB], writes=[QK, PV])
    xb = bf16_to_f32(bits).astype(np.float64)
    return max(_probe_ratio(QK, xb[:32], xb.T, f"{kernel} out_qk"), _probe_ratio(PV, xb[:32], xb, f"{kernel} out_pv"))
