"""metal/moe.metal (decode MoE: ``moe_route``, the gate/up kernels, ``moe_down_q4``) on the
Metal simulator, each compared with numpy on fresh random inputs (random packed codes, random
bf16 scales and biases, outputs pre-poisoned with NaN by the simulator), and the whole MoE
block (unfused: rms_norm, gemv_q8, moe_route, gate/up, down; fused: norm_gemv_q8,
moe_route_gate_up_swiglu_q4, down) compared with ``lily.reference.ReferenceModel.moe``;
the fused gate/up kernel's routing pinned to registers (no threadgroup barrier).
The GEMV, norm and embedding kernels are in test_gemv.py, test_norm.py and test_embed.py.

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

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from seeding import fresh_rng
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import download, pack_args, sim_device, upload  # noqa: E402
from lily.checkpoint import QuantizedTensor, bf16_to_f32  # noqa: E402
from lily.reference import ReferenceModel, sigmoid  # noqa: E402
# the reference helpers and bounds live with lily doctor's kernel checks (one home)
from lily.lab.kernels.gemm import swiglu_bound as _swiglu_bound  # noqa: E402
from lily.lab.kernels.gemv import NORM_EPS, TG, enc_norm_gemv, gemv_grid, rms_ref64  # noqa: E402
from lily.lab.kernels.harness import DEPTH, U, magnitude, rand_quant, to_bf16_bits, upload_q  # noqa: E402
from lily.lab.kernels.moe import (  # noqa: E402
    MoeWeights, enc_down, enc_gate_up, enc_route_gate_up, route_args, route_ref,
)
from harness import assert_same_arithmetic, assert_within, commit, run_bound  # noqa: E402

METAL_SRC = Path(__file__).resolve().parents[2] / "metal"


@pytest.fixture(scope="module")
def dev():
    # verify_writes: every byte written outside a dispatch's declared write ranges is an error
    return sim_device(verify_writes=True)


# ----------------------------------------------------------------------------- moe_route


def run_route(dev, logits, k, x, gate: QuantizedTensor, norm=True, tg=None):
    E, hidden = logits.size, x.size
    L, X = upload(dev, logits.astype(np.float32)), upload(dev, x)
    GW, GS, GB = upload_q(dev, gate)
    ids, wts = dev.buffer(4 * k), dev.buffer(4 * (k + 1))
    tg = tg or _core.moe_route_threads(E)
    run_bound(dev, "moe_route", 1, tg, [L, X, GW, GS, GB, ids, wts], route_args(E, k, hidden, norm),
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
    """The decode-step MoE block in its unfused reference form, which the runtime never runs
    (it encodes the fused moe_route_gate_up_swiglu_q4 after norm_gemv_q8's router: docs/kernels.md
    "Unfused reference kernels"): the router gemv_q8, moe_route, moe_gate_up_swiglu_q4 and
    moe_down_q4 (the one the step runs, through its builder) in one concurrent pass, barriers
    derived from the declared ranges.
    residual += moe(x). Returns (cb, R, ids, wts)."""
    b = bufs
    X, R = upload(dev, x), upload(dev, r0)
    logits, ids, wts = dev.buffer(4 * W.E), dev.buffer(4 * k), dev.buffer(4 * (k + 1))
    H = dev.buffer(4 * (k * W.inter + W.inter_shared))
    cb = dev.command_buffer()
    p = cb.compute_pass()
    p.dispatch("gemv_q8", gemv_grid(W.E), TG, buffers=[(0, b["router"][0]), (1, b["router"][1]), (2, b["router"][2]),
                                                       (3, X), (4, logits)],
               constants=[(5, pack_args("GemvArgs", rows=W.E, cols=W.hidden))], reads=[*b["router"], X], writes=[logits],
               threadgroups=True, label="router gemv_q8")
    tg = _core.moe_route_threads(W.E)
    p.dispatch("moe_route", 1, tg, buffers=[(0, logits), (1, X), *[(2 + i, t) for i, t in enumerate(b["shared_gate"])],
                                            (5, ids), (6, wts)],
               constants=[(7, route_args(W.E, k, W.hidden, norm_topk))],
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
    """ids equal to moe_route's on the same logits and routing weights the same (bit for
    bit on the simulator, a few ulps on a GPU: harness.assert_same_arithmetic); hbuf the same
    as moe_gate_up_swiglu_q4's with those ids, and within the SwiGLU bound of float64;
    weights[k] = sigmoid(logits[E])."""
    rng = fresh_rng(E * 7 + k + tg)
    W = MoeWeights(rng, E, hidden, inter, inter_shared)
    bufs = W.upload(dev)
    x = rng.standard_normal(hidden).astype(np.float32)
    logits = (rng.standard_normal(E + 1) * 2).astype(np.float32)
    for norm in (True, False):
        h, ids, wts = run_route_gate_up(dev, W, bufs, x, logits, k, norm, tg)
        rids, rwts = run_route(dev, logits[:E], k, x, W.shared_gate, norm=norm)
        np.testing.assert_array_equal(ids, rids)
        assert_same_arithmetic(dev, wts[:k], rwts[:k], "routing weights: fused vs moe_route")
        top, w = route_ref(logits[:E], k, norm)
        np.testing.assert_array_equal(ids, top)
        np.testing.assert_allclose(wts[:k], w, rtol=16 * U * np.log2(E) + 8 * U, atol=0)
        assert abs(wts[k] - sigmoid(np.float64(logits[E]))) <= 8 * U
        assert_same_arithmetic(dev, h, run_gate_up(dev, W, bufs, x, ids, k), "hbuf: fused vs moe_gate_up_swiglu_q4")
        want, tol = W.swiglu(x, ids)
        assert_within(h, want, tol, "moe_route_gate_up_swiglu_q4")


@pytest.mark.parametrize("E,tied,want", [
    (64, ([5, 9, 40, 41, 63], [2, 3, 50], [60, 7]), [5, 9, 40, 41, 63, 2, 3, 50]),
    # lane 5's registers 1, 3, 4 and 6 (experts 37, 101, 133, 197) tie: the lane's tree must keep
    # the lowest register whichever side of a comparison it sits on
    (256, ([133, 37, 197, 101], [250, 6], [70, 71, 72]), [37, 101, 133, 197, 6, 250, 70, 71]),
], ids=["E64", "E256-registers"])
def test_moe_route_gate_up_ties(dev, E, tied, want):
    """Tied probabilities: lower expert index first, as moe_route and argsort(-p, stable)."""
    k = 8
    rng = fresh_rng(0)
    W = MoeWeights(rng, E, 64, 64, 64)
    bufs = W.upload(dev)
    logits = np.zeros(E + 1, np.float32)
    for group, value in zip(tied, (3.0, 1.0, 0.5)):
        logits[group] = value
    logits[E] = -0.75
    x = rng.standard_normal(64).astype(np.float32)
    for norm in (True, False):
        h, ids, wts = run_route_gate_up(dev, W, bufs, x, logits, k, norm)
        np.testing.assert_array_equal(ids, want)
        rids, rwts = run_route(dev, logits[:E], k, x, W.shared_gate, norm=norm)
        assert_same_arithmetic(dev, wts[:k], rwts[:k], "routing weights: fused vs moe_route")
        assert_same_arithmetic(dev, h, run_gate_up(dev, W, bufs, x, ids, k), "hbuf: fused vs moe_gate_up_swiglu_q4")


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


# ----------------------------------------------------------------------------- structure


def _body(src: str, start: str) -> str:
    """The text of the braced body that follows `start` in `src`."""
    i = src.index("{", src.index(start))
    depth = 0
    for j in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            return src[i:j + 1]
    raise AssertionError(f"unbalanced braces after {start!r}")


def test_fused_gate_up_routes_without_barriers():
    """Each simdgroup of moe_route_gate_up_swiglu_q4 computes its routing in registers
    (route_topk_simd): no threadgroup barrier or threadgroup array stands between a
    threadgroup's start and its first expert weight load."""
    moe = (METAL_SRC / "moe.metal").read_text()
    route = (METAL_SRC / "route.h").read_text()
    kernel = _body(moe, "kernel void moe_route_gate_up_swiglu_q4(")
    simd = _body(route, "inline RoutePicks route_topk_simd(")
    assert re.search(r"\broute_topk_simd<\w+>\(", kernel) and not re.search(r"\broute_topk\(", kernel)
    for text in (kernel, simd, _body(moe, "inline void gate_up_slot(")):
        assert "threadgroup_barrier" not in text
        assert not re.search(r"\bthreadgroup\s+\w+\s*[\*\w]", text)
