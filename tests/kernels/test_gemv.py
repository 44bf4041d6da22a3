"""metal/gemv.metal on the Metal simulator (docs/kernels.md "GEMV, MoE, norm, embedding"):
``gemv_q*`` (+ ``_add``), ``norm_gemv_q*`` (at every rows-per-simdgroup setting; the router's
logits unchanged by it) and ``embed_norm_gemv_q4``, each compared with numpy on fresh random
inputs (random packed codes, random bf16 scales and biases, outputs pre-poisoned with NaN by
the simulator, which runs with verify_writes), and the geometry of the decode dispatches
pinned on the recorded plan of the real model.

Tolerances: the first-order float32 bound ``|got - exact| <= 64 u M`` per output, derived
in tests/kernels/test_moe.py's docstring (which shares the GEMV layout).
"""

from __future__ import annotations

import math

import numpy as np
from seeding import fresh_rng
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import download, pack_args, upload  # noqa: E402
from lily.checkpoint import QuantizedTensor, bf16_to_f32  # noqa: E402
from lily.reference import ReferenceModel  # noqa: E402
# the reference helpers and bounds live with lily doctor's kernel checks (one home)
from lily.lab.kernels.gemv import (  # noqa: E402
    GEMV_ROWS_PER_SG, NORM_EPS, NORM_GEMV_ROWS_PER_SG, TG, _norm_gemv_ratio, enc_embed_norm_gemv, enc_gemv_add,
    enc_norm_gemv, gemv_args, gemv_gated_ratio, gemv_grid, norm_gemv_grid, rms_ref64,
)
from lily.lab.kernels.embed import EMBED_PER_THREAD, EMBED_THREADS  # noqa: E402
from lily.lab.kernels.harness import DEPTH, QUANT_GROUP, U, magnitude, rand_quant, to_bf16_bits, upload_q  # noqa: E402
from harness import assert_same_arithmetic, assert_within, commit, forward_sim, run_bound, run_encoder  # noqa: E402
from simdev import ORDERS, make_dev  # noqa: E402


@pytest.fixture(scope="module")
def dev():
    return forward_sim()


# ----------------------------------------------------------------------------- gemv

GEMV_SHAPES = [
    (2048, 2048), (512, 2048), (2048, 512), (2048, 4096), (4096, 2048), (3000, 2048),  # real model
    (256, 2048), (1024, 2048),                                                        # router, shared gate_up
    (128, 128), (256, 256), (64, 128), (128, 64), (32, 256),                           # small presets
    (33, 128), (100, 256), (1, 64), (7, 192), (33, 320), (17, 2048),                   # ragged
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,cols", GEMV_SHAPES)
def test_gemv(dev, bits, rows, cols):
    rng = fresh_rng(rows * 7919 + cols + bits)
    qt = rand_quant(rng, (), rows, cols, bits)
    x = rng.standard_normal(cols).astype(np.float32)
    W, S, B = upload_q(dev, qt)
    X = upload(dev, x)
    pad = 8
    Y = dev.buffer(4 * (rows + pad))  # poisoned (NaN); the pad must stay untouched
    run_bound(dev, _core.kernel_name("gemv", q=bits), gemv_grid(rows), TG, [W, S, B, X, Y], gemv_args(rows, cols),
        reads=[W, S, B, X], writes=[(Y, 0, 4 * rows)], label=_core.kernel_name("gemv", q=bits))
    out = download(Y, np.float32)
    exact = qt.dequantize().astype(np.float64) @ x.astype(np.float64)
    mag = magnitude(qt) @ np.abs(x.astype(np.float64))
    assert_within(out[:rows], exact, DEPTH * U * mag, f"gemv_q{bits} {rows}x{cols}")
    assert np.isnan(out[rows:]).all(), "wrote past the last row"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,cols", [(2048, 4096), (2048, 2048), (256, 512), (33, 128), (100, 64)])
def test_gemv_add_residual(dev, bits, rows, cols):
    rng = fresh_rng(rows + cols * 3 + bits)
    qt = rand_quant(rng, (), rows, cols, bits)
    x = rng.standard_normal(cols).astype(np.float32)
    r0 = rng.standard_normal(rows).astype(np.float32)
    W, S, B = upload_q(dev, qt)
    X, R = upload(dev, x), upload(dev, r0)
    run_encoder(dev, enc_gemv_add, bits, W, S, B, X, R, rows, cols)  # the decode step's encoder
    exact = r0.astype(np.float64) + qt.dequantize().astype(np.float64) @ x.astype(np.float64)
    mag = magnitude(qt) @ np.abs(x.astype(np.float64)) + np.abs(r0)
    assert_within(download(R, np.float32), exact, DEPTH * U * mag, f"gemv_q{bits}_add {rows}x{cols}")


# gemv_gated_q*_add: out_proj of a GDN layer, the gated RMSNorm applied to x on load
# (lily.lab.kernels.gemv.gemv_gated_ratio: bound and reference).
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,Hv,Dv,splits,tg", [
    (2048, 32, 128, 4, 64),                                       # the model's out_proj
    (2048, 32, 128, 1, 64), (256, 4, 128, 2, 128), (33, 4, 32, 4, 64), (100, 2, 64, 8, 256),
])
def test_gemv_gated(dev, bits, rows, Hv, Dv, splits, tg):
    rng = fresh_rng(rows * 31 + Hv * Dv + splits + bits)
    assert gemv_gated_ratio(dev, rng, _core.kernel_name("gemv_gated", "_add", q=bits), rows, Hv, Dv, splits, tg) <= 1.0


@pytest.mark.parametrize("order", ORDERS)
def test_gemv_gated_under_hazard_orders(order):
    """The same in each of the simulator's orders (reverse: undeclared reads detected)."""
    assert gemv_gated_ratio(make_dev(order), fresh_rng(5), "gemv_gated_q4_add", 300, 4, 128, 4) <= 1.0


@pytest.mark.parametrize("tg", [64, 128, 256])
def test_gemv_threadgroup_sizes(dev, tg):
    """Any multiple of 64 threads works (kGemvSplitK simdgroups share each group of rows); the
    grid is ceil(rows / (R * tg / 64))."""
    rows, cols = 300, 1024
    rng = fresh_rng(tg)
    qt = rand_quant(rng, (), rows, cols, 4)
    x = rng.standard_normal(cols).astype(np.float32)
    W, S, B = upload_q(dev, qt)
    X, Y = upload(dev, x), dev.buffer(4 * rows)
    assert gemv_grid(rows, tg) == -(-rows // (GEMV_ROWS_PER_SG * tg // 64))
    run_bound(dev, "gemv_q4", gemv_grid(rows, tg), tg, [W, S, B, X, Y], gemv_args(rows, cols),
        reads=[W, S, B, X], writes=[Y])
    exact = qt.dequantize().astype(np.float64) @ x.astype(np.float64)
    assert_within(download(Y, np.float32), exact, DEPTH * U * (magnitude(qt) @ np.abs(x)), "gemv_q4 tg")


def test_gemv_weight_offsets(dev):
    """Weights bound at an offset into a larger buffer (one expert of a stack, or a tensor
    inside a mapped file), as a runtime binds them."""
    rng = fresh_rng(5)
    E, rows, cols, e = 4, 64, 256, 2
    qt = rand_quant(rng, (E,), rows, cols, 4)
    x = rng.standard_normal(cols).astype(np.float32)
    W, S, B = upload_q(dev, qt)
    X, Y = upload(dev, x), dev.buffer(4 * rows)
    wb, sb = rows * cols // 2, rows * cols // QUANT_GROUP * 2
    cb = dev.command_buffer()
    cb.compute_pass().dispatch(
        "gemv_q4", gemv_grid(rows), TG, buffers=[(0, W, e * wb), (1, S, e * sb), (2, B, e * sb), (3, X), (4, Y)],
        constants=[(5, gemv_args(rows, cols))], reads=[(W, e * wb, wb), (S, e * sb, sb), (B, e * sb, sb), X],
        writes=[Y], threadgroups=True)
    cb.commit()
    cb.wait()
    exact = qt.dequantize(e).astype(np.float64) @ x.astype(np.float64)
    assert_within(download(Y, np.float32), exact, DEPTH * U * (magnitude(qt, e) @ np.abs(x)), "gemv_q4 offset")


# ----------------------------------------------------------------------------- norm_gemv
#
# norm_gemv_q{4,8}: RMSNorm of the raw residual fused into up to four GEMVs. Tolerances:
# the normalised vector xn (sum of n squares, rsqrt, two products) is within 64 u |xn| of
# the exact one, like rms_norm. When the kernel writes xn, the outputs are checked against
# W @ xn_written (the values every threadgroup used, bit for bit) with the GEMV bound
# 64 u M; otherwise against W @ xn_exact with 128 u M (64 u M for the GEMV plus
# sum |w| 64 u |xn| <= 64 u M for the norm).

def check_norm_gemv(dev, bits, x, nw, qts, write_xn, tg=TG, extra=0, offsets=False, what=""):
    """Runs norm_gemv on the matrices qts (None: an unused slot) and checks every output;
    returns (xn written or None, outputs)."""
    cols = x.size
    X, NW = upload(dev, x), upload(dev, nw)
    XN = dev.buffer(4 * cols + 64)  # poisoned; 16 floats of pad
    pad = 8
    mats, ys = [], []
    for qt in qts:
        if qt is None:
            Y = dev.buffer(4 * pad)
            mats.append((0, (X, X, X), Y))
            ys.append(Y)
            continue
        rows = qt.weight.shape[0]
        if offsets:  # bound at an offset into a larger buffer, as a runtime binds a tensor of a file
            lead = 48
            bound = []
            for a in (qt.weight, qt.scales, qt.biases):
                raw = np.concatenate([np.full(lead, 0xAB, np.uint8), a.reshape(-1).view(np.uint8)])
                bound.append((upload(dev, raw), lead, a.nbytes))
            wsb = tuple(bound)
        else:
            wsb = upload_q(dev, qt)
        Y = dev.buffer(4 * (rows + 2 * pad))
        mats.append((rows, wsb, (Y, 4 * pad)))  # output bound at an offset, pad on both sides
        ys.append(Y)
    cb = dev.command_buffer()
    enc_norm_gemv(cb.compute_pass(), bits, X, NW, XN, mats, cols, write_xn=write_xn, tg=tg, extra=extra)
    commit(cb, f"norm_gemv_q{bits}[{'+'.join(str(q.weight.shape[0]) if q is not None else '0' for q in qts)}x{cols}]")
    assert cb.counters["dispatches"] == 1
    xn_all = download(XN, np.float32)
    want_xn = rms_ref64(x, nw)
    if write_xn:
        assert_within(xn_all[:cols], want_xn, DEPTH * U * np.abs(want_xn) + 1e-30, f"{what} xn")
        assert np.isnan(xn_all[cols:]).all(), "xn: wrote past the vector"
        xin, depth = xn_all[:cols].astype(np.float64), DEPTH
    else:
        assert np.isnan(xn_all).all(), "xn written with write_xn = 0"
        xin, depth = want_xn, 2 * DEPTH
    outs = []
    for qt, Y in zip(qts, ys):
        got = download(Y, np.float32)
        if qt is None:
            assert np.isnan(got).all(), "an unused slot's output was written"
            outs.append(None)
            continue
        rows = qt.weight.shape[0]
        exact = qt.dequantize().astype(np.float64) @ xin
        mag = magnitude(qt) @ np.abs(xin)
        assert_within(got[pad:pad + rows], exact, depth * U * mag, f"{what} norm_gemv_q{bits} {rows}x{cols}")
        assert np.isnan(got[:pad]).all() and np.isnan(got[pad + rows:]).all(), "wrote outside the rows"
        outs.append(got[pad:pad + rows])
    return (xn_all[:cols] if write_xn else None), outs


NORM_GEMV_CASES = [  # bits, rows per matrix (0 = unused slot), cols, write_xn
    pytest.param(4, (8192, 4096, 32, 32), 2048, False, id="gdn-real"),        # in_proj_qkv, z, b, a
    pytest.param(4, (8192, 512, 512), 2048, False, id="attn-real"),           # q_proj (with gate), k, v
    pytest.param(8, (256, 1), 2048, True, id="router-real"),                  # mlp.gate, shared_expert_gate
    pytest.param(4, (3000,), 2048, False, id="lm_head-slice"),                # final norm + lm_head rows
    pytest.param(4, (1024, 512, 4, 4), 256, True, id="gdn-demo"),
    pytest.param(4, (4096, 256, 256), 256, False, id="attn-demo"),
    pytest.param(8, (32, 1), 256, True, id="router-demo"),
    pytest.param(4, (128, 64, 8, 8), 128, True, id="tiny"),
    pytest.param(4, (1, 7, 0, 33), 64, True, id="ragged-a"),
    pytest.param(8, (17, 0, 0, 100), 192, True, id="ragged-b"),
    pytest.param(4, (0, 5), 320, False, id="ragged-c"),
    pytest.param(8, (33,), 320, True, id="ragged-d"),
    pytest.param(4, (100, 1, 1, 1), 1024, True, id="ragged-e"),
    pytest.param(8, (15, 16, 17, 3), 64, False, id="ragged-f"),
]


@pytest.mark.parametrize("bits,rows,cols,write_xn", NORM_GEMV_CASES)
def test_norm_gemv(dev, bits, rows, cols, write_xn):
    rng = fresh_rng(sum(rows) * 31 + cols + bits)
    x = (rng.standard_normal(cols) * 3).astype(np.float32)  # a raw residual (RMS ~3)
    nw = to_bf16_bits(1 + 0.3 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), r, cols, bits) if r else None for r in rows]
    check_norm_gemv(dev, bits, x, nw, qts, write_xn, what=str(rows))


@pytest.mark.parametrize("tg", [32, 128, 256])
def test_norm_gemv_threadgroup_sizes(dev, tg):
    """Any multiple of 32 threads; the grid follows the threadgroup size (8 rows per simdgroup)."""
    rng = fresh_rng(tg + 1)
    cols = 1024
    x = rng.standard_normal(cols).astype(np.float32)
    nw = to_bf16_bits(rng.standard_normal(cols))
    qts = [rand_quant(rng, (), r, cols, 4) for r in (300, 17)] + [None, rand_quant(rng, (), 40, cols, 4)]
    check_norm_gemv(dev, 4, x, nw, qts, True, tg=tg, what=f"tg {tg}")


def test_norm_gemv_extra_threadgroups_and_offsets(dev):
    """Threadgroups past the last matrix do nothing; weights bound at (unaligned-to-file)
    offsets of larger buffers, outputs at offsets."""
    rng = fresh_rng(77)
    cols = 512
    x = rng.standard_normal(cols).astype(np.float32)
    nw = to_bf16_bits(1 + 0.1 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), r, cols, 8) for r in (20, 3)]
    check_norm_gemv(dev, 8, x, nw, qts, True, extra=5, offsets=True, what="extra+offsets")


@pytest.mark.parametrize("bits,write_xn,tg", [(4, False, 64), (8, False, 128), (4, True, 32), (8, True, 256)])
def test_norm_gemv_scale_is_exact(dev, bits, write_xn, tg):
    """All-positive terms (positive x, norm weight, scales and biases): then |y| = M and the
    bound 128 u M is 128 u |y|, so a norm scale off by more than ~1e-5 in any threadgroup
    (a different rsqrt per threadgroup, a wrong mean or eps) fails, which random-sign data
    with ~50x cancellation would not show."""
    rng = fresh_rng(bits * 10 + tg)
    cols = 1024
    x = (np.abs(rng.standard_normal(cols)) + 0.1).astype(np.float32)
    nw = to_bf16_bits(0.5 + rng.random(cols))
    qts = []
    for r in (70, 0, 9, 33):
        if not r:
            qts.append(None)
            continue
        qt = rand_quant(rng, (), r, cols, bits)
        s = bf16_to_f32(qt.scales)
        qts.append(QuantizedTensor("pos", qt.weight, qt.scales, to_bf16_bits(s * (0.5 + rng.random(s.shape))), bits, 64))
    check_norm_gemv(dev, bits, x, nw, qts, write_xn, tg=tg, what="positive")


def test_norm_gemv_xn_matches_rms_norm(dev):
    """The xn norm_gemv writes is the rms_norm of the residual (to rounding: the sum of
    squares is taken in another order)."""
    rng = fresh_rng(12)
    cols = 2048
    x = (rng.standard_normal(cols) * 5).astype(np.float32)
    nw = to_bf16_bits(1 + 0.3 * rng.standard_normal(cols))
    xn, _ = check_norm_gemv(dev, 8, x, nw, [rand_quant(rng, (), 16, cols, 8)], True)
    X, Wt, O = upload(dev, x), upload(dev, nw), dev.buffer(4 * cols)
    run_encoder(dev, _core.encode_rms_norm, "rms_norm", X, Wt, O, 1, cols, NORM_EPS, 4)
    from lily.reference import rms_norm
    ref = rms_norm(x[None], bf16_to_f32(nw), NORM_EPS)[0].astype(np.float64)
    for other in (download(O, np.float32), ref):
        assert_within(xn, other, 2 * DEPTH * U * np.abs(other) + 1e-30, "xn vs rms_norm")


def test_norm_gemv_demo_checkpoint(dev, demo_path):
    """The demo checkpoint's projections behind each norm (GDN layer 0, the first attention
    layer, the router of layer 1, the final norm + lm_head) against lily.reference
    (rms_norm then linear, float32) and float64."""
    from lily.checkpoint import open_checkpoint
    from lily.reference import rms_norm
    ck = open_checkpoint(demo_path)
    ref = ReferenceModel(ck)
    c = ck.config
    att = c.full_attention_layers[0]
    groups = [
        (4, "model.layers.0.input_layernorm.weight", [f"model.layers.0.linear_attn.in_proj_{n}" for n in ("qkv", "z", "b", "a")], False),
        (4, f"model.layers.{att}.input_layernorm.weight", [f"model.layers.{att}.self_attn.{n}_proj" for n in "qkv"], False),
        (8, "model.layers.1.post_attention_layernorm.weight", ["model.layers.1.mlp.gate", "model.layers.1.mlp.shared_expert_gate"], True),
        (4, "model.norm.weight", ["lm_head"], False),
    ]
    rng = fresh_rng(8)
    for bits, norm_name, modules, write_xn in groups:
        x = (rng.standard_normal(c.hidden_size) * 2).astype(np.float32)
        nw = np.ascontiguousarray(ck.raw(norm_name))
        qts = [ck.quantized(m) for m in modules]
        assert all(q.bits == bits for q in qts)
        _, outs = check_norm_gemv(dev, bits, x, nw, qts, write_xn, what=norm_name)
        xr = rms_norm(x[None], ref.param(norm_name), c.rms_norm_eps)
        x64 = np.abs(rms_ref64(x, nw, c.rms_norm_eps))
        for m, qt, got in zip(modules, qts, outs):
            want = ref.linear(xr, m)[0].astype(np.float64)
            # the reference's own float32 matmul (any order, <= cols terms deep) and norm
            tol = (2 * DEPTH + c.hidden_size) * U * (magnitude(qt) @ x64)
            assert_within(got, want, tol, f"{m} vs ReferenceModel")


# ----------------------------------------------------------------------------- norm_gemv rows per simdgroup
#
# NormGemvArgs carries the rows each simdgroup computes (the router runs 1, the wide
# projections and lm_head NORM_GEMV_ROWS_PER_SG): same bound at every setting.


def run_norm_gemv(dev, bits, x, nw, qts, rps, tg=64, splits=1):
    cols = x.size
    X, NW, XN = upload(dev, x), upload(dev, nw), dev.buffer(4 * cols)
    mats = [(qt.weight.shape[0], upload_q(dev, qt), dev.buffer(4 * qt.weight.shape[0])) for qt in qts]
    run_encoder(dev, enc_norm_gemv, bits, X, NW, XN, mats, cols, write_xn=True, tg=tg, rps=rps, splits=splits)
    return X, NW, XN, mats


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rps", [1, 2, 4, 8])
@pytest.mark.parametrize("tg", [32, 64, 256])
def test_norm_gemv_rows_per_simdgroup(dev, bits, rps, tg):
    """Router-shaped matrices (E rows plus the one-row shared gate) and a ragged third at
    every rows-per-simdgroup setting and threadgroup size: within 64 u M of float64."""
    rng = fresh_rng(bits * 100 + rps * 10 + tg)
    cols = 256
    x = (rng.standard_normal(cols) * 2).astype(np.float32)
    nw = to_bf16_bits(1 + 0.2 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), r, cols, bits) for r in (96, 1, 37)]
    _, _, XN, mats = run_norm_gemv(dev, bits, x, nw, qts, rps, tg)
    assert _norm_gemv_ratio(f"norm_gemv_q{bits} rps={rps} tg={tg}", x, nw, XN, qts, mats) <= 1.0


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rps", [1, 8])
def test_norm_gemv_split_k(dev, bits, rps):
    """Two simdgroups per group of rows (k_splits = 2, the router's geometry), ragged matrices,
    a threadgroup of 128: within 64 u M of float64."""
    rng = fresh_rng(bits * 10 + rps)
    cols = 512
    x = (rng.standard_normal(cols) * 2).astype(np.float32)
    nw = to_bf16_bits(1 + 0.2 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), r, cols, bits) for r in (96, 1, 37)]
    _, _, XN, mats = run_norm_gemv(dev, bits, x, nw, qts, rps, tg=128, splits=2)
    assert _norm_gemv_ratio(f"norm_gemv_q{bits} rps={rps} split-K", x, nw, XN, qts, mats) <= 1.0


@pytest.mark.parametrize("splits", [1, 2])
def test_router_logits_independent_of_rows_per_simdgroup(dev, splits):
    """With >= 32 chunks per row and split every lane of a team strides the same chunks
    whatever the rows per simdgroup, so the router's logits (and the experts they pick) are
    bit-identical at 1 and at 8 rows per simdgroup, at either split-K."""
    rng = fresh_rng(257)
    cols = 1024  # q8: 64 chunks of 16 bytes per row
    x = (rng.standard_normal(cols) * 2).astype(np.float32)
    nw = to_bf16_bits(1 + 0.2 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), 64, cols, 8), rand_quant(rng, (), 1, cols, 8)]
    outs = []
    for rps in (1, NORM_GEMV_ROWS_PER_SG):
        _, _, XN, mats = run_norm_gemv(dev, 8, x, nw, qts, rps, splits=splits)
        outs.append([download(XN, np.float32)] + [download(m[2], np.float32) for m in mats])
    for a, b in zip(*outs):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_norm_gemv_grid_follows_rows_per_simdgroup():
    assert norm_gemv_grid([256, 1], 64, 1) == 128 + 1
    assert norm_gemv_grid([256, 1], 64, 1, 2) == 256 + 1
    assert norm_gemv_grid([256, 1], 64, 8) == 16 + 1
    assert norm_gemv_grid([300], 256, 4) == math.ceil(300 / 32)


# ----------------------------------------------------------------------------- embed + norm_gemv
#
# embed_norm_gemv_q4 (layer 0's first dispatch of the decode step): the embedding lookup
# fused into norm_gemv_q4. It runs the same float32 operations in the same order as
# embed_q4 followed by norm_gemv_q4, so h, xn and every output are bit-identical on the
# simulator and within a few ulps on a GPU (harness.assert_same_arithmetic).


@pytest.mark.parametrize("vocab,cols,rows,write_xn", [
    pytest.param(300, 2048, (512, 256, 32, 32), False, id="gdn-like"),
    pytest.param(64, 256, (1024, 512, 4, 4), True, id="demo-like"),
    pytest.param(33, 128, (17, 0, 5, 1), False, id="ragged"),
])
def test_embed_norm_gemv_equals_embed_then_norm_gemv(dev, vocab, cols, rows, write_xn):
    rng = fresh_rng(vocab + cols)
    emb = rand_quant(rng, (), vocab, cols, 4, "embed")
    nw = to_bf16_bits(1 + 0.3 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), r, cols, 4) if r else None for r in rows]
    tok = int(rng.integers(0, vocab))
    EW, ES, EB = upload_q(dev, emb)
    T, NW = upload(dev, np.array([tok], np.uint32)), upload(dev, nw)
    mats_q = [upload_q(dev, q) if q is not None else None for q in qts]

    def outputs(fused: bool):
        H, XN = dev.buffer(4 * cols), dev.buffer(4 * cols)
        ys = [dev.buffer(4 * max(r, 1)) for r in rows]
        cb = dev.command_buffer()
        p = cb.compute_pass()
        if not fused:
            p.dispatch("embed_q4", cols // EMBED_PER_THREAD, EMBED_THREADS, buffers=[(0, EW), (1, ES), (2, EB), (3, T), (4, H)],
                       constants=[(5, pack_args("EmbedArgs", cols=cols, vocab=vocab))], reads=[EW, ES, EB, T], writes=[H],
                       threadgroups=False, label="embed_q4")
            mats = [(r, m if m is not None else (H, H, H), Y) for r, m, Y in zip(rows, mats_q, ys)]
            enc_norm_gemv(p, 4, H, NW, XN, mats, cols, write_xn=write_xn)
        else:
            enc_embed_norm_gemv(p, EW, ES, EB, T, H, NW, XN, list(zip(rows, mats_q, ys)), cols, vocab, write_xn)
        commit(cb, "embed_norm_gemv_q4" if fused else "embed_q4 + norm_gemv_q4")
        assert cb.counters["dispatches"] == (1 if fused else 2)
        return [download(H, np.float32), download(XN, np.float32)] + [
            download(Y, np.float32)[:r] for r, Y in zip(rows, ys)]

    want, got = outputs(False), outputs(True)
    np.testing.assert_allclose(got[0], emb.dequantize()[tok], rtol=1e-6, atol=1e-7)
    for name, g, w in zip(("h", "xn", "y0", "y1", "y2", "y3"), got, want):
        assert_same_arithmetic(dev, g, w, f"{name}: embed_norm_gemv_q4 vs embed_q4 + norm_gemv_q4")


# ----------------------------------------------------------------------------- decode dispatch geometry
#
# Structure pinned on the recorded decode plan of the real model (lily.native_backend.count_decode_step):
# the router's norm_gemv_q8 spans the GPU, every bandwidth-heavy dispatch fills an M5 Max.


@pytest.fixture(scope="module")
def step():
    from lily.native_backend import count_decode_step
    from lily.lab.estimate import model_config
    return count_decode_step(model_config(), 4096)["records"]


def occupancy_m5max(rec):
    from lily.lab.estimate import machine, occupancy
    return occupancy(machine("m5max"), math.prod(rec["groups"]), math.prod(rec["threads"]))


def test_router_dispatch_spans_the_gpu(step):
    """The router (norm_gemv_q8, 257 rows) runs one row per simdgroup: >= 3x the M5 Max's
    40 cores in threadgroups (17 at 8 rows per simdgroup)."""
    routers = [r for r in step if "router" in r["label"]]
    assert len(routers) == 40
    for r in routers:
        assert r["kernel"] == "norm_gemv_q8"
        assert math.prod(r["groups"]) >= 3 * 40
        assert occupancy_m5max(r) >= 0.8


def test_bandwidth_heavy_decode_dispatches_fill_an_m5max(step):
    """Every decode dispatch moving >= 1 MB keeps all 40 cores of an M5 Max at >= 256
    threads (lily.lab.estimate.occupancy 1.0), the Gated DeltaNet recurrence included (4
    threadgroups per value head: 128)."""
    assert any(r["kernel"].startswith("gdn_decode_step") for r in step)
    for r in step:
        if r["work"]["bytes"] < 1e6:
            continue
        assert occupancy_m5max(r) == 1.0, (r["label"], r["groups"], r["threads"])
