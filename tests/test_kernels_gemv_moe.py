"""Decode kernels of metal/gemv.metal, metal/norm.metal and metal/moe.metal on the Metal
simulator, each compared with numpy on fresh random inputs (random packed codes, random
bf16 scales and biases, outputs pre-poisoned with NaN by the simulator), and the whole MoE
block (unfused: rms_norm, gemv_q8, moe_route, gate/up, down; fused: norm_gemv_q8,
moe_route_gate_up_swiglu_q4, down) compared with ``lily.reference.ReferenceModel.moe``.

Tolerances (fp32 accumulation order only). Every kernel output is a sum of products that
the kernel accumulates in fp32 in a different order than numpy (per-chunk partial sums,
lane strides, a butterfly over the team, the bias folded as ``b * sum(x)``). The first-order
error bound of any such order is ``depth * u * M`` with ``u = 2**-24`` and ``M`` the sum of
the magnitudes of the terms, here ``M = sum_i (|s| q_i + |b|) |x_i|``; the depth (longest
chain of roundings) is at most 32 (inside a chunk) + 8 (chunks per lane) + 5 (butterfly) +
the fold, < 64. We check ``|got - exact| <= 64 u M`` per output with ``exact`` computed in
float64. One wrong code in a row of 2048 changes the output by ~M/2048 ~ 5e-4 M, far above
64 u M ~ 4e-6 M, so the bound still catches every indexing error. Composite kernels
propagate the bound to first order (see ``_swiglu_bound`` and ``test_moe_block_*``).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
from seeding import fresh_rng
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily._device import constant, download, sim_device, upload  # noqa: E402
from lily.checkpoint import QuantizedTensor, bf16_to_f32  # noqa: E402
from lily.reference import ReferenceModel, sigmoid  # noqa: E402
# the reference helpers and bounds live with lily doctor's kernel checks (one home)
from lily.kernel_check import (  # noqa: E402,F401
    DEPTH, GEMV_ROWS_PER_SG, NORM_EPS, TG, U, enc_embed_norm_gemv,
    GATE_UP_ROWS_PER_SG, MoeWeights, enc_down, enc_gate_up, enc_route_gate_up, swiglu_bound as _swiglu_bound,
    enc_norm_gemv, gemv_grid, magnitude, norm_gemv_args, norm_gemv_grid,
    rand_quant, rms_ref64, route_ref, to_bf16_bits, upload_q)

TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def dev():
    # verify_writes: every byte written outside a dispatch's declared write ranges is an error
    return sim_device(verify_writes=True)


# ----------------------------------------------------------------------------- helpers


def run(dev, kernel, grid, tg, buffers, args, reads, writes, threadgroups=True, label=""):
    cb = dev.command_buffer()
    p = cb.compute_pass()
    idx = len(buffers)
    p.dispatch(kernel, grid, tg, buffers=[(i, b) for i, b in enumerate(buffers)],
               constants=[(idx, args)], reads=list(reads), writes=list(writes),
               threadgroups=threadgroups, label=label)
    t0 = time.perf_counter()
    cb.commit()
    cb.wait()
    TIMES[label or kernel] = TIMES.get(label or kernel, 0.0) + time.perf_counter() - t0
    return cb


def assert_within(got, want, tol, what):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), f"{what}: non-finite outputs at {np.nonzero(~np.isfinite(got))[0][:10]}"
    err = np.abs(got - want)
    bad = err > tol
    assert not bad.any(), (f"{what}: {bad.sum()} outputs out of tolerance; worst err/tol "
                           f"{(err / tol).max():.3g} at {np.argmax(err / tol)}")
    return float((err / tol).max())


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
    run(dev, f"gemv_q{bits}", gemv_grid(rows), TG, [W, S, B, X, Y], constant(rows, cols),
        reads=[W, S, B, X], writes=[(Y, 0, 4 * rows)], label=f"gemv_q{bits}")
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
    run(dev, f"gemv_q{bits}_add", gemv_grid(rows), TG, [W, S, B, X, R], constant(rows, cols),
        reads=[W, S, B, X, R], writes=[R], label=f"gemv_q{bits}_add")
    exact = r0.astype(np.float64) + qt.dequantize().astype(np.float64) @ x.astype(np.float64)
    mag = magnitude(qt) @ np.abs(x.astype(np.float64)) + np.abs(r0)
    assert_within(download(R, np.float32), exact, DEPTH * U * mag, f"gemv_q{bits}_add {rows}x{cols}")


@pytest.mark.parametrize("tg", [32, 128, 256])
def test_gemv_threadgroup_sizes(dev, tg):
    """Any multiple of 32 threads works; the grid is ceil(rows / (R * tg / 32))."""
    rows, cols = 300, 1024
    rng = fresh_rng(tg)
    qt = rand_quant(rng, (), rows, cols, 4)
    x = rng.standard_normal(cols).astype(np.float32)
    W, S, B = upload_q(dev, qt)
    X, Y = upload(dev, x), dev.buffer(4 * rows)
    run(dev, "gemv_q4", -(-rows // (GEMV_ROWS_PER_SG * tg // 32)), tg, [W, S, B, X, Y], constant(rows, cols),
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
    wb, sb = rows * cols // 2, rows * cols // 64 * 2
    cb = dev.command_buffer()
    cb.compute_pass().dispatch(
        "gemv_q4", gemv_grid(rows), TG, buffers=[(0, W, e * wb), (1, S, e * sb), (2, B, e * sb), (3, X), (4, Y)],
        constants=[(5, constant(rows, cols))], reads=[(W, e * wb, wb), (S, e * sb, sb), (B, e * sb, sb), X],
        writes=[Y], threadgroups=True)
    cb.commit()
    cb.wait()
    exact = qt.dequantize(e).astype(np.float64) @ x.astype(np.float64)
    assert_within(download(Y, np.float32), exact, DEPTH * U * (magnitude(qt, e) @ np.abs(x)), "gemv_q4 offset")


# ----------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("vocab,cols", [(3000, 2048), (8192, 256), (100, 128), (37, 64)])
def test_embed(dev, vocab, cols):
    rng = fresh_rng(vocab + cols)
    qt = rand_quant(rng, (), vocab, cols, 4)
    W, S, B = upload_q(dev, qt)
    for tok, want_row in [(0, 0), (vocab - 1, vocab - 1), (vocab // 3, vocab // 3), (vocab + 5, vocab - 1)]:
        T = upload(dev, np.array([tok], np.uint32))
        O = dev.buffer(4 * cols)
        run(dev, "embed_q4", cols // 8, 64, [W, S, B, T, O], constant(cols, vocab),
            reads=[W, S, B, T], writes=[O], threadgroups=False, label="embed_q4")
        want = qt.dequantize(want_row).astype(np.float64)
        mag = magnitude(qt, want_row)
        assert_within(download(O, np.float32), want, 2 * U * mag, f"embed row {tok}")


# ----------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("rows,n,tg", [(1, 2048, 256), (1, 2048, 1024), (1, 256, 256), (16, 256, 64),
                                       (32, 128, 128), (2, 100, 96), (3, 33, 32), (1, 4096, 256)])
def test_rms_norm(dev, rows, n, tg):
    rng = fresh_rng(rows * n + tg)
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    w = to_bf16_bits(1 + 0.3 * rng.standard_normal(n))
    eps = 1e-6
    X, Wt, O = upload(dev, x), upload(dev, w), dev.buffer(4 * rows * n)
    args = constant(n) + np.float32(eps).tobytes()
    run(dev, "rms_norm", rows, tg, [X, Wt, O], args, reads=[X, Wt], writes=[O], label="rms_norm")
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + eps) * bf16_to_f32(w)
    # sum of n positive squares (depth <= n/tg + 5 + 32) feeds rsqrt (halves the relative
    # error), then two products: 64 u relative is a safe first-order bound
    assert_within(download(O, np.float32, (rows, n)), want, DEPTH * U * np.abs(want) + 1e-30, "rms_norm")


def test_rms_norm_in_place(dev):
    rng = fresh_rng(11)
    n = 2048
    x = rng.standard_normal(n).astype(np.float32)
    w = to_bf16_bits(rng.standard_normal(n))
    X, Wt = upload(dev, x), upload(dev, w)
    run(dev, "rms_norm", 1, 256, [X, Wt, X], constant(n) + np.float32(1e-6).tobytes(), reads=[X, Wt], writes=[X])
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64) + 1e-6) * bf16_to_f32(w)
    assert_within(download(X, np.float32), want, DEPTH * U * np.abs(want) + 1e-30, "rms_norm in place")


# ----------------------------------------------------------------------------- moe_route


def run_route(dev, logits, k, x, gate: QuantizedTensor, norm=True, tg=None):
    E, hidden = logits.size, x.size
    L, X = upload(dev, logits.astype(np.float32)), upload(dev, x)
    GW, GS, GB = upload_q(dev, gate)
    ids, wts = dev.buffer(4 * k), dev.buffer(4 * (k + 1))
    tg = tg or min(1024, -(-E // 32) * 32)
    run(dev, "moe_route", 1, tg, [L, X, GW, GS, GB, ids, wts], constant(E, k, hidden, int(norm)),
        reads=[L, X, GW, GS, GB], writes=[ids, wts], label="moe_route")
    return download(ids, np.uint32), download(wts, np.float32)


@pytest.mark.parametrize("E,k,hidden,tg", [(256, 8, 2048, None), (256, 8, 2048, 64), (32, 8, 256, None),
                                           (16, 4, 128, None), (100, 3, 64, 32), (1000, 32, 128, 1024),
                                           (8, 8, 64, None), (256, 1, 2048, 256)])
def test_moe_route(dev, E, k, hidden, tg):
    rng = fresh_rng(E * 31 + k)
    logits = (rng.standard_normal(E) * 2).astype(np.float32)
    x = rng.standard_normal(hidden).astype(np.float32)
    gate = rand_quant(rng, (), 1, hidden, 8)
    ids, wts = run_route(dev, logits, k, x, gate, tg=tg)
    top, w = route_ref(logits, k)
    np.testing.assert_array_equal(ids, top)
    # softmax (sum of E exps, each with relative error ~2u) and one division: 16 u relative
    np.testing.assert_allclose(wts[:k], w, rtol=16 * U * np.log2(E) + 8 * U, atol=0)
    g = gate.dequantize()[0].astype(np.float64) @ x.astype(np.float64)
    gmag = magnitude(gate)[0] @ np.abs(x.astype(np.float64))
    # sigmoid' <= 1/4
    assert abs(wts[k] - sigmoid(g)) <= 0.25 * DEPTH * U * gmag + 4 * U


def test_moe_route_ties_and_no_renorm(dev):
    """Equal probabilities: the lower expert index comes first (argsort(-p, stable))."""
    E, k, hidden = 64, 8, 128
    logits = np.zeros(E, np.float32)
    logits[[5, 9, 40, 41, 63]] = 3.0        # five-way tie at the top
    logits[[2, 3, 50]] = 1.0                # then a three-way tie: fills k = 8
    logits[[60, 7]] = 0.5                   # tied runners-up, not selected
    rng = fresh_rng(0)
    x = rng.standard_normal(hidden).astype(np.float32)
    gate = rand_quant(rng, (), 1, hidden, 8)
    for norm in (True, False):
        ids, wts = run_route(dev, logits, k, x, gate, norm=norm)
        top, w = route_ref(logits, k, norm=norm)
        np.testing.assert_array_equal(ids, top)
        np.testing.assert_array_equal(ids, [5, 9, 40, 41, 63, 2, 3, 50])
        np.testing.assert_allclose(wts[:k], w, rtol=1e-6)


# ----------------------------------------------------------------------------- MoE experts


def commit(cb, label):
    t0 = time.perf_counter()
    cb.commit()
    cb.wait()
    TIMES[label] = TIMES.get(label, 0.0) + time.perf_counter() - t0


MOE_SHAPES = [  # E, hidden, inter, inter_shared, k
    pytest.param(256, 2048, 512, 512, 8, id="real"),
    pytest.param(32, 256, 128, 128, 8, id="demo"),
    pytest.param(16, 128, 64, 64, 4, id="tiny"),
    pytest.param(16, 192, 64, 128, 3, id="ragged"),
]


@pytest.fixture(scope="module")
def moe_cache():
    return {}


def moe_weights(cache, E, hidden, inter, inter_shared, k):
    key = (E, hidden, inter, inter_shared)
    if key not in cache:
        cache.clear()  # keep one set of (possibly 450 MB) weights alive
        cache[key] = MoeWeights(fresh_rng(E + hidden + inter), E, hidden, inter, inter_shared)
    return cache[key]


@pytest.mark.parametrize("E,hidden,inter,inter_shared,k", MOE_SHAPES)
def test_moe_gate_up_swiglu(dev, moe_cache, E, hidden, inter, inter_shared, k):
    W = moe_weights(moe_cache, E, hidden, inter, inter_shared, k)
    rng = fresh_rng(1)
    x = rng.standard_normal(hidden).astype(np.float32)
    ids = rng.choice(E, k, replace=False).astype(np.uint32)
    ids[-1] = E - 1  # the last expert of the stack (offset arithmetic at the end)
    bufs = W.upload(dev)
    X, I = upload(dev, x), upload(dev, ids)
    H = dev.buffer(4 * (k * inter + inter_shared + 16))  # poisoned; 16 floats of pad
    cb = dev.command_buffer()
    enc_gate_up(cb.compute_pass(), W, bufs, X, I, H, k, ids=ids)
    commit(cb, f"moe_gate_up_swiglu_q4[{E}x{inter}x{hidden}]")
    got = download(H, np.float32)
    want, tol = W.swiglu(x, ids)
    assert_within(got[:want.size], want, tol, "moe_gate_up_swiglu_q4")
    assert np.isnan(got[want.size:]).all()


@pytest.mark.parametrize("E,hidden,inter,inter_shared,k", MOE_SHAPES)
def test_moe_down(dev, moe_cache, E, hidden, inter, inter_shared, k):
    W = moe_weights(moe_cache, E, hidden, inter, inter_shared, k)
    rng = fresh_rng(2)
    h = (rng.standard_normal(k * inter + inter_shared) * 0.1).astype(np.float32)
    ids = rng.choice(E, k, replace=False).astype(np.uint32)
    ids[0] = E - 1
    w = rng.random(k + 1).astype(np.float32)
    r0 = rng.standard_normal(hidden).astype(np.float32)
    bufs = W.upload(dev)
    Hb, I, Wt, R = upload(dev, h), upload(dev, ids), upload(dev, w), upload(dev, r0)
    cb = dev.command_buffer()
    enc_down(cb.compute_pass(), W, bufs, Hb, I, Wt, R, k)
    commit(cb, f"moe_down_q4[{E}x{hidden}x{inter}]")
    d, tol = W.down_sum(h.astype(np.float64), ids, w.astype(np.float64))
    assert_within(download(R, np.float32), r0 + d, tol + DEPTH * U * np.abs(r0), "moe_down_q4")


# ----------------------------------------------------------------------------- the MoE block


def encode_moe_block(dev, W, bufs, x, r0, k, norm_topk=True):
    """The decode-step MoE block as a runtime encodes it: one concurrent pass, barriers
    derived from the declared ranges. residual += moe(x). Returns (cb, R, ids, wts)."""
    b = bufs
    X, R = upload(dev, x), upload(dev, r0)
    logits, ids, wts = dev.buffer(4 * W.E), dev.buffer(4 * k), dev.buffer(4 * (k + 1))
    H = dev.buffer(4 * (k * W.inter + W.inter_shared))
    cb = dev.command_buffer()
    p = cb.compute_pass()
    p.dispatch("gemv_q8", gemv_grid(W.E), TG, buffers=[(0, b["router"][0]), (1, b["router"][1]), (2, b["router"][2]),
                                                       (3, X), (4, logits)],
               constants=[(5, constant(W.E, W.hidden))], reads=[*b["router"], X], writes=[logits],
               threadgroups=True, label="router gemv_q8")
    tg = min(1024, -(-W.E // 32) * 32)
    p.dispatch("moe_route", 1, tg, buffers=[(0, logits), (1, X), *[(2 + i, t) for i, t in enumerate(b["shared_gate"])],
                                            (5, ids), (6, wts)],
               constants=[(7, constant(W.E, k, W.hidden, int(norm_topk)))],
               reads=[logits, X, *b["shared_gate"]], writes=[ids, wts], threadgroups=True, label="moe_route")
    enc_gate_up(p, W, b, X, ids, H, k)
    enc_down(p, W, b, H, ids, wts, R, k)
    return cb, R, ids, wts


def oracle_moe(W, x, k):
    """float64 MoE block (router logits exact, then fp32 softmax as the reference) with a
    first-order error bound of an fp32 evaluation in any accumulation order."""
    x64 = x.astype(np.float64)
    logits = W.router.dequantize().astype(np.float64) @ x64
    dl = DEPTH * U * (magnitude(W.router) @ np.abs(x64))
    ids, w = route_ref(logits.astype(np.float32), k)
    # softmax weights: d(log w_j) <= 2 max|dl| after renormalisation, plus roundings
    dw = np.abs(w) * (2 * dl.max() + 16 * U * np.log2(W.E))
    g = W.shared_gate.dequantize()[0].astype(np.float64) @ x64
    sg = sigmoid(g)
    dsg = 0.25 * DEPTH * U * (magnitude(W.shared_gate)[0] @ np.abs(x64)) + 4 * U
    h, dh = W.swiglu(x, ids)
    wts = np.concatenate([w, [sg]])
    y, tol = W.down_sum(h, ids, wts, dh)
    # routing-weight errors times the magnitude of each slot's down projection
    for j, dwj in enumerate(np.concatenate([dw, [dsg]])):
        q, e = (W.down, int(ids[j])) if j < k else (W.sdown, None)
        sl = slice(j * W.inter, (j + 1) * W.inter) if j < k else slice(k * W.inter, None)
        tol += dwj * (magnitude(q, e) @ np.abs(h[sl]))
    return ids, wts, y, tol


class FakeCheckpoint:
    """Duck-typed lily.checkpoint.Checkpoint holding random in-memory tensors, so
    ReferenceModel.moe runs on real-model shapes."""

    def __init__(self, W: MoeWeights, k):
        self.config = SimpleNamespace(num_experts_per_tok=k, norm_topk_prob=True, hidden_size=W.hidden)
        p = "model.layers.0.mlp"
        self.t = {f"{p}.switch_mlp.gate_proj": W.gate, f"{p}.switch_mlp.up_proj": W.up,
                  f"{p}.switch_mlp.down_proj": W.down, f"{p}.shared_expert.gate_proj": W.sgate,
                  f"{p}.shared_expert.up_proj": W.sup, f"{p}.shared_expert.down_proj": W.sdown,
                  f"{p}.gate": W.router, f"{p}.shared_expert_gate": W.shared_gate}

    def quantized(self, module):
        return self.t[module]


# End-to-end tolerance of the MoE block, normwise: |got - exact| <= E2E_RTOL * max|exact|.
# The per-element worst-case bound composed through router -> softmax -> experts -> down
# is ~1e4x pessimistic (it multiplies worst cases of five stages) and would miss a wrong
# low-weight expert. Rounding errors of fp32 sums of n terms of random sign grow like
# sqrt(n) u; the deepest chain here is the 2048-term gate/up dot feeding the 4608-term down
# sum (9 slots x 512), with the bias fold cancelling ~3x: sqrt(4608) * u * 3 ~ 1.2e-5 of the
# term magnitudes, which are ~0.3x of max|y| for these weights -> ~4e-6. We allow 2e-5
# (measured: 3e-7..8e-7, for this kernel chain and for ReferenceModel.moe alike). A wrong
# expert, a dropped shared expert or one wrong 4-bit code moves the output by >= 1e-3 of
# max|y| (test_moe_block_tolerance_is_sensitive).
E2E_RTOL = 2e-5


def check_block(dev, W, ref_model, layer, x, r0, k, what):
    bufs = W.upload(dev)
    cb, R, ids_b, wts_b = encode_moe_block(dev, W, bufs, x, r0, k)
    commit(cb, f"moe block [{what}]")
    assert cb.counters["dispatches"] == 4 and cb.counters["barrier_stages"] == 4, cb.counters
    got = download(R, np.float32).astype(np.float64) - r0  # r0 + y - r0 is exact to u |r0|
    ids, wts, y, _ = oracle_moe(W, x, k)
    np.testing.assert_array_equal(download(ids_b, np.uint32), ids)
    np.testing.assert_allclose(download(wts_b, np.float32), wts, rtol=E2E_RTOL)
    ref = ref_model.moe(layer, x[None].astype(np.float32))[0].astype(np.float64)
    scale = np.abs(y).max()
    slack = 2 * U * np.abs(r0)
    err_exact = assert_within(got, y, E2E_RTOL * scale + slack, f"{what}: MoE block vs float64")
    err_ref = assert_within(got, ref, E2E_RTOL * scale + slack, f"{what}: MoE block vs ReferenceModel.moe")
    return err_exact, err_ref


def test_moe_block_demo_checkpoint(dev, demo_path):
    """Every layer's MoE of the embedded demo checkpoint (real trained packed bytes)."""
    from lily.checkpoint import open_checkpoint
    ck = open_checkpoint(demo_path)
    ref = ReferenceModel(ck)
    c = ck.config
    rng = fresh_rng(3)
    for layer in range(c.num_hidden_layers):
        W = MoeWeights.from_checkpoint(ck, layer)
        assert (W.E, W.hidden, W.inter, W.inter_shared) == (c.num_experts, c.hidden_size, c.moe_intermediate_size,
                                                            c.shared_expert_intermediate_size)
        # a post-attention-norm-like input: unit RMS times a norm weight
        x = (rng.standard_normal(c.hidden_size) * 0.8).astype(np.float32)
        r0 = rng.standard_normal(c.hidden_size).astype(np.float32)
        check_block(dev, W, ref, layer, x, r0, c.num_experts_per_tok, f"demo layer {layer}")


@pytest.mark.parametrize("E,hidden,inter,inter_shared,k", MOE_SHAPES)
def test_moe_block_random(dev, moe_cache, E, hidden, inter, inter_shared, k):
    W = moe_weights(moe_cache, E, hidden, inter, inter_shared, k)
    ref = ReferenceModel(FakeCheckpoint(W, k))
    rng = fresh_rng(4)
    x = rng.standard_normal(hidden).astype(np.float32)
    r0 = rng.standard_normal(hidden).astype(np.float32)
    check_block(dev, W, ref, 0, x, r0, k, f"random E={E} hidden={hidden}")


def test_moe_block_tolerance_is_sensitive(dev, moe_cache):
    """The stated tolerance rejects realistic mistakes: a wrong expert, a dropped shared
    expert, one wrong code."""
    # Fixed inputs: the mistakes below (e.g. one flipped code) are sized for these weights.
    W = MoeWeights(np.random.default_rng(32 + 256 + 128), 32, 256, 128, 128)
    rng = np.random.default_rng(6)
    x = rng.standard_normal(256).astype(np.float32)
    ids, wts, y, _ = oracle_moe(W, x, 8)
    tol = E2E_RTOL * np.abs(y).max()
    h, _ = W.swiglu(x, ids)
    bad_ids = ids.copy()
    bad_ids[7] = next(e for e in range(32) if e not in ids)  # the lowest-weight expert
    wrong_expert, _ = W.down_sum(h, bad_ids, wts)
    no_shared, _ = W.down_sum(h, ids, np.concatenate([wts[:-1], [0.0]]))
    W.down.weight[ids[7], 0, 0] ^= np.uint32(0xF)  # one code of one row of the lowest-weight expert
    try:
        one_code, _ = W.down_sum(h, ids, wts)
    finally:
        W.down.weight[ids[7], 0, 0] ^= np.uint32(0xF)
    for bad in (wrong_expert, no_shared, one_code):
        assert np.abs(bad - y).max() > 10 * tol


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
    run(dev, "rms_norm", 1, 256, [X, Wt, O], constant(cols) + np.float32(NORM_EPS).tobytes(), reads=[X, Wt],
        writes=[O], label="rms_norm")
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


# ----------------------------------------------------------------------------- routing fused into gate/up


def run_route_gate_up(dev, W, bufs, x, logits, k, norm_topk=True, tg=TG):
    """logits: E + 1 floats (router logits, then the shared-expert gate logit)."""
    X, L = upload(dev, x), upload(dev, logits.astype(np.float32))
    n = k * W.inter + W.inter_shared
    H, ids, wts = dev.buffer(4 * (n + 16)), dev.buffer(4 * (k + 4)), dev.buffer(4 * (k + 5))  # poisoned pads
    cb = dev.command_buffer()
    enc_route_gate_up(cb.compute_pass(), W, bufs, X, L, H, ids, wts, k, norm_topk, tg)
    commit(cb, f"moe_route_gate_up_swiglu_q4[{W.E}x{W.inter}x{W.hidden}]")
    h, i, w = download(H, np.float32), download(ids, np.uint32), download(wts, np.float32)
    assert np.isnan(h[n:]).all() and (i[k:] == 0xFFFFFFFF).all() and np.isnan(w[k + 1:]).all(), "wrote past the outputs"
    return h[:n], i[:k], w[:k + 1]


def run_gate_up(dev, W, bufs, x, ids, k):
    X, I = upload(dev, x), upload(dev, np.asarray(ids, np.uint32))
    H = dev.buffer(4 * (k * W.inter + W.inter_shared))
    cb = dev.command_buffer()
    enc_gate_up(cb.compute_pass(), W, bufs, X, I, H, k)
    commit(cb, "moe_gate_up_swiglu_q4")
    return download(H, np.float32)


ROUTE_FUSED_CASES = [  # E, k, hidden, inter, inter_shared, threadgroup
    pytest.param(256, 8, 64, 64, 64, 64, id="real-router"),
    pytest.param(256, 8, 128, 64, 128, 128, id="real-router-tg128"),
    pytest.param(32, 8, 256, 128, 128, 64, id="demo"),
    pytest.param(1000, 32, 64, 64, 64, 64, id="E1000-k32"),
    pytest.param(1024, 8, 64, 64, 64, 256, id="E1024"),
    pytest.param(8, 8, 64, 64, 64, 32, id="k=E"),
    pytest.param(100, 3, 64, 128, 64, 32, id="ragged"),
    pytest.param(256, 1, 64, 64, 64, 64, id="k1"),
]


@pytest.mark.parametrize("E,k,hidden,inter,inter_shared,tg", ROUTE_FUSED_CASES)
def test_moe_route_gate_up_matches_route(dev, E, k, hidden, inter, inter_shared, tg):
    """ids and routing weights bit-identical to moe_route on the same logits; hbuf
    bit-identical to moe_gate_up_swiglu_q4 with those ids, and within the SwiGLU bound of
    float64; weights[k] = sigmoid(logits[E])."""
    rng = fresh_rng(E * 7 + k + tg)
    W = MoeWeights(rng, E, hidden, inter, inter_shared)
    bufs = W.upload(dev)
    x = rng.standard_normal(hidden).astype(np.float32)
    logits = (rng.standard_normal(E + 1) * 2).astype(np.float32)
    for norm in (True, False):
        h, ids, wts = run_route_gate_up(dev, W, bufs, x, logits, k, norm, tg)
        rids, rwts = run_route(dev, logits[:E], k, x, W.shared_gate, norm=norm)
        np.testing.assert_array_equal(ids, rids)
        np.testing.assert_array_equal(wts[:k].view(np.uint32), rwts[:k].view(np.uint32))
        top, w = route_ref(logits[:E], k, norm)
        np.testing.assert_array_equal(ids, top)
        np.testing.assert_allclose(wts[:k], w, rtol=16 * U * np.log2(E) + 8 * U, atol=0)
        assert abs(wts[k] - sigmoid(np.float64(logits[E]))) <= 8 * U
        np.testing.assert_array_equal(h.view(np.uint32), run_gate_up(dev, W, bufs, x, ids, k).view(np.uint32))
        want, tol = W.swiglu(x, ids)
        assert_within(h, want, tol, "moe_route_gate_up_swiglu_q4")


def test_moe_route_gate_up_ties(dev):
    """Tied probabilities: lower expert index first, as moe_route and argsort(-p, stable)."""
    E, k = 64, 8
    rng = fresh_rng(0)
    W = MoeWeights(rng, E, 64, 64, 64)
    bufs = W.upload(dev)
    logits = np.zeros(E + 1, np.float32)
    logits[[5, 9, 40, 41, 63]] = 3.0
    logits[[2, 3, 50]] = 1.0
    logits[[60, 7]] = 0.5
    logits[E] = -0.75
    x = rng.standard_normal(64).astype(np.float32)
    for norm in (True, False):
        h, ids, wts = run_route_gate_up(dev, W, bufs, x, logits, k, norm)
        np.testing.assert_array_equal(ids, [5, 9, 40, 41, 63, 2, 3, 50])
        rids, rwts = run_route(dev, logits[:E], k, x, W.shared_gate, norm=norm)
        np.testing.assert_array_equal(wts[:k].view(np.uint32), rwts[:k].view(np.uint32))
        np.testing.assert_array_equal(h.view(np.uint32), run_gate_up(dev, W, bufs, x, ids, k).view(np.uint32))


# ----------------------------------------------------------------------------- the fused MoE block


def encode_fused_moe_block(dev, W, bufs, h0, nw, k, eps=NORM_EPS, norm_topk=True):
    """The MoE half of a decode layer with the fused kernels, as a runtime encodes it:
    h += moe(rms_norm(h, post_attention_layernorm)) in three dispatches (three stages):
    norm_gemv_q8 (router rows then the shared-gate row into one [E+1] buffer; xn out),
    moe_route_gate_up_swiglu_q4, moe_down_q4."""
    b = bufs
    R, NW = upload(dev, h0), upload(dev, nw)
    XN, L = dev.buffer(4 * W.hidden), dev.buffer(4 * (W.E + 1))
    ids, wts = dev.buffer(4 * k), dev.buffer(4 * (k + 1))
    H = dev.buffer(4 * (k * W.inter + W.inter_shared))
    cb = dev.command_buffer()
    p = cb.compute_pass()
    enc_norm_gemv(p, 8, R, NW, XN, [(W.E, b["router"], (L, 0)), (1, b["shared_gate"], (L, 4 * W.E))], W.hidden,
                  eps=eps, write_xn=True, label="router norm_gemv_q8")
    enc_route_gate_up(p, W, b, XN, L, H, ids, wts, k, norm_topk)
    enc_down(p, W, b, H, ids, wts, R, k)
    return cb, R, XN, ids, wts


def check_fused_block(dev, W, ref_model, layer, h0, nw, k, what, eps=NORM_EPS):
    """Fused block vs the float64 oracle on the xn it computed, and vs ReferenceModel.moe
    on the reference's own float32 rms_norm (E2E_RTOL reasoning: see check_block; the xn
    of the two differ by a few u relative, which moves y by ~1e-7 of max|y|)."""
    from lily.reference import rms_norm
    bufs = W.upload(dev)
    cb, R, XN, ids_b, wts_b = encode_fused_moe_block(dev, W, bufs, h0, nw, k, eps)
    commit(cb, f"fused moe block [{what}]")
    assert cb.counters["dispatches"] == 3 and cb.counters["barrier_stages"] == 3, cb.counters
    xn = download(XN, np.float32)
    want_xn = rms_ref64(h0, nw, eps)
    assert_within(xn, want_xn, DEPTH * U * np.abs(want_xn) + 1e-30, f"{what}: xn")
    got = download(R, np.float32).astype(np.float64) - h0
    ids, wts, y, _ = oracle_moe(W, xn, k)
    np.testing.assert_array_equal(download(ids_b, np.uint32), ids)
    np.testing.assert_allclose(download(wts_b, np.float32), wts, rtol=E2E_RTOL)
    xr = rms_norm(h0[None], bf16_to_f32(nw), eps).astype(np.float32)
    ref = ref_model.moe(layer, xr)[0].astype(np.float64)
    scale = np.abs(y).max()
    slack = 2 * U * np.abs(h0)
    err_exact = assert_within(got, y, E2E_RTOL * scale + slack, f"{what}: fused MoE block vs float64")
    err_ref = assert_within(got, ref, E2E_RTOL * scale + slack, f"{what}: fused MoE block vs ReferenceModel.moe")
    return err_exact, err_ref, download(R, np.float32)


def test_fused_moe_block_demo_checkpoint(dev, demo_path):
    """norm_gemv_q8 -> moe_route_gate_up_swiglu_q4 -> moe_down_q4 on every layer of the
    demo checkpoint (real trained bytes, the layer's post_attention_layernorm weight)."""
    from lily.checkpoint import open_checkpoint
    ck = open_checkpoint(demo_path)
    ref = ReferenceModel(ck)
    c = ck.config
    rng = fresh_rng(13)
    for layer in range(c.num_hidden_layers):
        W = MoeWeights.from_checkpoint(ck, layer)
        nw = np.ascontiguousarray(ck.raw(f"model.layers.{layer}.post_attention_layernorm.weight"))
        h0 = (rng.standard_normal(c.hidden_size) * 2).astype(np.float32)  # a residual stream
        check_fused_block(dev, W, ref, layer, h0, nw, c.num_experts_per_tok, f"demo layer {layer}", c.rms_norm_eps)


@pytest.mark.parametrize("E,hidden,inter,inter_shared,k", MOE_SHAPES)
def test_fused_moe_block_random(dev, moe_cache, E, hidden, inter, inter_shared, k):
    W = moe_weights(moe_cache, E, hidden, inter, inter_shared, k)
    ref = ReferenceModel(FakeCheckpoint(W, k))
    rng = fresh_rng(14)
    h0 = (rng.standard_normal(hidden) * 3).astype(np.float32)
    nw = to_bf16_bits(1 + 0.2 * rng.standard_normal(hidden))
    check_fused_block(dev, W, ref, 0, h0, nw, k, f"random E={E} hidden={hidden}")


@pytest.mark.parametrize("opts", [dict(thread_order="reverse"), dict(thread_order="random", seed=5),
                                  dict(verify_reads=True)], ids=["reverse", "random", "verify_reads"])
def test_fused_moe_block_orders(moe_cache, opts):
    """The fused block gives bit-identical results whatever order threads and threadgroups
    run in (no races, no order-dependent reductions), and reads nothing undeclared."""
    W = moe_weights(moe_cache, 32, 256, 128, 128, 8)
    rng = fresh_rng(15)
    h0 = (rng.standard_normal(256) * 3).astype(np.float32)
    nw = to_bf16_bits(1 + 0.2 * rng.standard_normal(256))
    outs = []
    for dev in (sim_device(verify_writes=True), sim_device(verify_writes=True, **opts)):
        cb, R, XN, ids, wts = encode_fused_moe_block(dev, W, W.upload(dev), h0, nw, 8)
        commit(cb, "fused moe block [orders]")
        outs.append([download(b, np.uint32) for b in (R, XN, ids, wts)])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_report_sim_times():
    """Prints the simulator wall time per kernel collected by the tests above (-s to see)."""
    for name, t in sorted(TIMES.items()):
        print(f"  {name:50s} {t * 1000:9.1f} ms")


# ----------------------------------------------------------------------------- embed + norm_gemv
#
# embed_norm_gemv_q4 (layer 0's first dispatch of the decode step): the embedding lookup
# fused into norm_gemv_q4. It runs the same float32 operations in the same order as
# embed_q4 followed by norm_gemv_q4, so h, xn and every output must be bit-identical.


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
            p.dispatch("embed_q4", cols // 8, 64, buffers=[(0, EW), (1, ES), (2, EB), (3, T), (4, H)],
                       constants=[(5, constant(cols, vocab))], reads=[EW, ES, EB, T], writes=[H],
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
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))
