"""Mixer and sampling kernels on the Metal simulator against the numpy reference.

metal/gdn.metal (Gated DeltaNet decode step), metal/attention.metal (q/k prep, decode
attention, split + combine), metal/sample.metal (greedy and sampled token selection).
Every output buffer starts poisoned (the simulator fills new buffers with NaN), so an
element a kernel forgets to write fails the comparison.

Tolerances (all float32 arithmetic on both sides unless noted):
* GDN step: the kernel sums in a different order (simd_sum trees vs numpy einsum) over
  Dk = 128 products of O(1) values: a few float32 ulps, so rtol 1e-4 / atol 1e-5 on one
  step. The 512-step drift test allows 5e-5 absolute on the state (|S| <= ~0.7) and the
  outputs (|o| <= ~4); measured 2.4e-7 and 5.7e-6. The delta rule with unit-norm k, beta in
  (0, 1) and g <= 1 is a contraction, so rounding differences do not accumulate beyond a
  small multiple of one step's.
* attention: the cache holds bf16 values that both sides read exactly; the remaining
  difference is float32 summation order over <= 256-element dot products and a softmax
  over <= a few hundred rows: rtol/atol 2e-5 against a float64 evaluation. Cache rows
  written by attn_qk_prep are compared with the bf16 rounding of the float32 reference,
  allowing one bf16 ulp where a float32 difference of ~1e-7 can flip the rounding.
* fused prep + decode (attn_decode_fused, attn_decode_split_fused): the same float32
  operations in the same order as attn_qk_prep + attn_decode(_split), so the outputs and
  the written cache rows are compared for exact equality with that pair (on the
  simulator; a GPU compiler may contract differently), and with the tolerances above
  against float64 and ReferenceModel.attention.
* RoPE: the kernel computes frequencies and angles in float32 (as MLX does), the reference
  in float64; at positions < 5000 the angle error is < 5000 * 2^-24 * few ~ 1e-3 rad at
  most for the fastest pair, so q/k after RoPE are compared with atol 2e-3 (values are
  O(1) after RMSNorm). Position 0..64 is tight (1e-5).
* sampling: greedy exactly. The sampled path: exactly where the draw is determined
  (top_k = 1, temperature 0); draw by draw against a numpy model of the kernel (Philox u,
  crossing of u * Z in the kernel's order), where float32 (kernel) and float64 (model)
  cumulative masses may disagree only when u lies within 1e-5 of a boundary; and
  statistically (chi-square, alpha 0.001) against lily.sampling's filtered softmax.
  Log-probabilities: atol 1e-4 (float32 log-sum-exp over up to 4000 terms).

Kernel correctness tests run in three simulator modes (fixture ``dev``): forward order,
reverse thread/threadgroup order with undeclared-read detection, random order; all with
out-of-range write detection.
"""

from __future__ import annotations

import math

import numpy as np
from seeding import fresh_rng
from harness import ORDERS, THREAD_ORDERS, bf16_bits, from_bf16, f32, args_bytes  # noqa: F401
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily._device import constant, download, upload  # noqa: E402
from lily.reference import ReferenceState, round_bf16  # noqa: E402
from lily.sampling import SamplingParams, log_softmax  # noqa: E402
# the layer harnesses and float64 references live with lily doctor's kernel checks (one home)
from lily import kernel_check  # noqa: E402
from lily.kernel_check import (  # noqa: E402,F401
    PENALTIES, THETA, StubOracle, attention_reference, attn_cfg, count_buffer, expected_draws, filtered_probs,
    gdn_cfg, heads_per_group, philox_u, qk_prep_reference, run, sample_args, sample_many, sampler_for, sorted_order, thread_order)


# ------------------------------------------------------------------------------ helpers

# ------------------------------------------------------------------------------ Gated DeltaNet

GDN_DIMS = {
    "real": (16, 32, 128, 128),
    "dims": (2, 4, 128, 128),
    "tiny": (2, 4, 32, 32),
}


class GdnLayer(kernel_check.GdnLayer):
    """kernel_check.GdnLayer on fresh random inputs (tests/seeding.py)."""

    def __init__(self, dev, Hk, Hv, Dk, Dv, K=4, seed=0):
        super().__init__(dev, Hk, Hv, Dk, Dv, K, rng=fresh_rng(seed))


@pytest.mark.parametrize("dims", list(GDN_DIMS))
def test_gdn_decode_step_matches_reference(dev, dims):
    Hk, Hv, Dk, Dv = GDN_DIMS[dims]
    L = GdnLayer(dev, Hk, Hv, Dk, Dv, seed=1)
    r = L.rng
    # a non-trivial starting point: random conv history and recurrent state
    L.set_state(r.standard_normal((3, L.conv_dim)), 0.3 * r.standard_normal((Hv, Dv, Dk)))
    for _ in range(2):
        inp = L.random_inputs()
        got = L.step_device(*inp)
        want = L.step_reference(*inp)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        conv, S = L.device_state()
        np.testing.assert_array_equal(conv, L.st.conv[0])  # a copy: exact
        np.testing.assert_allclose(S, L.st.recurrent[0], rtol=1e-4, atol=1e-5)


def test_gdn_decode_drift_512_steps(fwd_dev):
    """512 decode steps from a zero state (dims preset: Dk = Dv = 128) vs the reference."""
    Hk, Hv, Dk, Dv = GDN_DIMS["dims"]
    L = GdnLayer(fwd_dev, Hk, Hv, Dk, Dv, seed=7)
    worst_out = worst_state = 0.0
    for t in range(512):
        inp = L.random_inputs()
        got = L.step_device(*inp)
        want = L.step_reference(*inp)
        worst_out = max(worst_out, float(np.abs(got - want).max()))
        if t % 64 == 63 or t == 511:
            _, S = L.device_state()
            worst_state = max(worst_state, float(np.abs(S - L.st.recurrent[0]).max()))
    assert worst_out < 5e-5, worst_out
    assert worst_state < 5e-5, worst_state


# ------------------------------------------------------------------------------ attention

ATTN_DIMS = {  # Hq, Hkv, D, rotary_dim
    "real": (16, 2, 256, 64),
    "dims": (8, 1, 256, 64),
    "tiny": (4, 2, 64, 16),
}



class AttnLayer(kernel_check.AttnLayer):
    """kernel_check.AttnLayer on fresh random inputs (tests/seeding.py)."""

    def __init__(self, dev, Hq, Hkv, D, rot, capacity, seed=0):
        super().__init__(dev, Hq, Hkv, D, rot, capacity, rng=fresh_rng(seed))


@pytest.mark.parametrize("dims", list(ATTN_DIMS))
@pytest.mark.parametrize("pos", [0, 7, 64, 4000])
def test_attn_qk_prep(dev, dims, pos):
    Hq, Hkv, D, rot = ATTN_DIMS[dims]
    A = AttnLayer(dev, Hq, Hkv, D, rot, capacity=4100, seed=pos)
    r = A.rng
    qg, k, v = (f32(r.standard_normal((Hq, 2 * D))), f32(r.standard_normal((Hkv, D))),
                f32(r.standard_normal((Hkv, D))))
    A.set_position(pos)
    Q, GATE = A.prep(qg, k, v, pos)
    q_ref, k_ref = qk_prep_reference(A, qg, k, pos)
    atol = 1e-5 if pos <= 64 else 2e-3
    np.testing.assert_allclose(download(Q, np.float32, (Hq, D)), q_ref, rtol=1e-5, atol=atol)
    np.testing.assert_array_equal(download(GATE, np.float32, (Hq, D)), qg[:, D:])
    kc = download(A.KC, np.uint16, (Hkv, A.cap, D))
    vc = download(A.VC, np.uint16, (Hkv, A.cap, D))
    np.testing.assert_array_equal(vc[:, pos], bf16_bits(v))
    # one bf16 ulp where a float32 difference can flip the rounding
    np.testing.assert_allclose(from_bf16(kc[:, pos]), round_bf16(k_ref), rtol=2 ** -7, atol=atol)
    others = np.ones(A.cap, bool)
    others[pos] = False
    np.testing.assert_array_equal(kc[:, others], A.k_hist[:, others])
    np.testing.assert_array_equal(vc[:, others], A.v_hist[:, others])


def _poison_rows(A, n):
    """Rows >= n of the cache become NaN: reading past the context shows up."""
    nan = np.uint16(0x7FC0)
    k, v = A.k_hist.copy(), A.v_hist.copy()
    k[:, n:], v[:, n:] = nan, nan
    A.KC.write(k.view(np.uint8).reshape(-1))
    A.VC.write(v.view(np.uint8).reshape(-1))
    return from_bf16(k), from_bf16(v)


@pytest.mark.parametrize("dims", list(ATTN_DIMS))
@pytest.mark.parametrize("n", [1, 31, 33, 200])
def test_attn_decode(dev, dims, n):
    Hq, Hkv, D, rot = ATTN_DIMS[dims]
    A = AttnLayer(dev, Hq, Hkv, D, rot, capacity=256, seed=n)
    K, V = _poison_rows(A, n)
    r = A.rng
    q, gate = f32(r.standard_normal((Hq, D))), f32(r.standard_normal((Hq, D)))
    A.set_position(n - 1)
    got = A.decode(upload(dev, q), upload(dev, gate), n)
    want = attention_reference(q, gate, K, V, n, D)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dims", list(ATTN_DIMS))
@pytest.mark.parametrize("n,block_rows,extra", [(64, 16, 0), (200, 48, 1), (129, 64, 2), (1000, 96, 0)])
def test_attn_decode_split(dev, dims, n, block_rows, extra):
    """The long-context path (threshold 64 here): several blocks, a ragged last block,
    surplus blocks in the grid that must return without writing."""
    Hq, Hkv, D, rot = ATTN_DIMS[dims]
    A = AttnLayer(dev, Hq, Hkv, D, rot, capacity=1024, seed=n)
    K, V = _poison_rows(A, n)
    r = A.rng
    q, gate = f32(r.standard_normal((Hq, D))), f32(r.standard_normal((Hq, D)))
    A.set_position(n - 1)
    Q, GT = upload(dev, q), upload(dev, gate)
    got = A.decode(Q, GT, n, split_threshold=64, block_rows=block_rows, extra_blocks=extra)
    want = attention_reference(q, gate, K, V, n, D)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # the general path on the same inputs agrees to float32 rounding
    general = A.decode(Q, GT, n)
    np.testing.assert_allclose(got, general, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dims", ["real", "tiny"])
def test_attention_prep_and_decode_vs_oracle(dev, dims):
    """attn_qk_prep + attn_decode (gate read straight from the q_proj output, stride 2*D)
    over a bf16 history vs ReferenceModel.attention. The reference keeps the new token's k/v
    in float32, the kernel in bf16 (relative rounding <= 2^-9): atol 1e-2 on O(1) outputs."""
    Hq, Hkv, D, rot = ATTN_DIMS[dims]
    n = 70
    A = AttnLayer(dev, Hq, Hkv, D, rot, capacity=128, seed=3)
    K, V = _poison_rows(A, n - 1)
    r = A.rng
    qg, k, v = (f32(r.standard_normal((Hq, 2 * D))), f32(r.standard_normal((Hkv, D))),
                f32(r.standard_normal((Hkv, D))))
    A.set_position(n - 1)
    Q, _ = A.prep(qg, k, v, n - 1)
    QG = upload(dev, qg)
    # gate from the q_proj output itself: base offset D elements, stride 2*D
    gate_view = dev.buffer(Hq * 2 * D * 4)
    gate_view.write(np.concatenate([qg.reshape(-1)[D:], np.zeros(D, np.float32)]).view(np.uint8))
    got = A.decode(Q, gate_view, n, gate_stride=2 * D)
    del QG

    oracle = StubOracle(attn_cfg(Hq, Hkv, D, rot), {"q_norm.weight": from_bf16(A.qn),
                                                   "k_norm.weight": from_bf16(A.kn)})
    oracle.proj = {"q_proj": qg.reshape(1, -1), "k_proj": k.reshape(1, -1), "v_proj": v.reshape(1, -1)}
    st = ReferenceState(max_context=A.cap, position=n - 1)
    st.keys[0], st.values[0] = K.copy(), V.copy()
    want = oracle.attention(0, np.zeros((1, 1), np.float32), st)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2)


# ------------------------------------------------------------------------------ fused prep + decode

def _fused_case(dev, dims, n, capacity, seed):
    """Two identical layers (same weights, same bf16 history, rows >= n-1 poisoned) and one
    token's projections: one layer for the fused kernel, one for attn_qk_prep + decode."""
    Hq, Hkv, D, rot = ATTN_DIMS[dims]
    A = AttnLayer(dev, Hq, Hkv, D, rot, capacity=capacity, seed=seed)
    B = AttnLayer(dev, Hq, Hkv, D, rot, capacity=capacity, seed=seed)
    K, V = _poison_rows(A, n - 1)
    _poison_rows(B, n - 1)
    r = fresh_rng(1000 + seed)
    qg, k, v = (f32(r.standard_normal((Hq, 2 * D))), f32(r.standard_normal((Hkv, D))),
                f32(r.standard_normal((Hkv, D))))
    return A, B, K, V, qg, k, v


def _check_fused(A, B, got, want_pair, Q, qg, k, v, K, V, n):
    """got (fused) == prep + decode on B, caches identical (row pos is what attn_qk_prep
    writes, nothing else touched), and got vs float64 attention and ReferenceModel.attention."""
    Hq, Hkv, D, rot = A.Hq, A.Hkv, A.D, A.rot
    # the same float32 operations in the same order: equal bit for bit on the simulator
    np.testing.assert_array_equal(got, want_pair)
    kc_a, kc_b = download(A.KC, np.uint16, (Hkv, A.cap, D)), download(B.KC, np.uint16, (Hkv, A.cap, D))
    vc_a, vc_b = download(A.VC, np.uint16, (Hkv, A.cap, D)), download(B.VC, np.uint16, (Hkv, A.cap, D))
    np.testing.assert_array_equal(kc_a, kc_b)
    np.testing.assert_array_equal(vc_a, vc_b)
    np.testing.assert_array_equal(kc_a[:, : n - 1], A.k_hist[:, : n - 1])
    np.testing.assert_array_equal(vc_a[:, : n - 1], A.v_hist[:, : n - 1])
    np.testing.assert_array_equal(vc_a[:, n - 1], bf16_bits(v))
    assert np.isnan(from_bf16(kc_a[:, n:])).all()  # rows past pos untouched (still poisoned)
    # float64 attention over the cache as written (q from attn_qk_prep)
    want64 = attention_reference(Q, qg[:, D:], from_bf16(kc_a), from_bf16(vc_a), n, D)
    np.testing.assert_allclose(got, want64, rtol=2e-5, atol=2e-5)
    # the oracle (new k/v in float32, not bf16): atol 1e-2 as for prep + decode
    oracle = StubOracle(attn_cfg(Hq, Hkv, D, rot), {"q_norm.weight": from_bf16(A.qn),
                                                   "k_norm.weight": from_bf16(A.kn)})
    oracle.proj = {"q_proj": qg.reshape(1, -1), "k_proj": k.reshape(1, -1), "v_proj": v.reshape(1, -1)}
    st = ReferenceState(max_context=A.cap, position=n - 1)
    st.keys[0], st.values[0] = K.copy(), V.copy()
    want = oracle.attention(0, np.zeros((1, 1), np.float32), st)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2)


@pytest.mark.parametrize("dims", list(ATTN_DIMS))
@pytest.mark.parametrize("n", [1, 2, 33, 200])
def test_attn_decode_fused(dev, dims, n):
    """attn_decode_fused (one dispatch) vs attn_qk_prep + attn_decode (two) at context n."""
    A, B, K, V, qg, k, v = _fused_case(dev, dims, n, capacity=256, seed=n)
    got = A.fused(qg, k, v, n - 1)
    B.set_position(n - 1)
    Qb, GATE = B.prep(qg, k, v, n - 1)
    want_pair = B.decode(Qb, GATE, n)
    Q = download(Qb, np.float32, (B.Hq, B.D))
    _check_fused(A, B, got, want_pair, Q, qg, k, v, K, V, n)


@pytest.mark.parametrize("dims", list(ATTN_DIMS))
@pytest.mark.parametrize("n,block_rows,extra", [(2, 1, 1), (64, 16, 0), (200, 48, 1), (129, 64, 2), (33, 8, 0)])
def test_attn_decode_split_fused(dev, dims, n, block_rows, extra):
    """attn_decode_split_fused + attn_combine vs attn_qk_prep + attn_decode_split +
    attn_combine: ragged last blocks ((200, 48): 8 rows; (129, 64): only the new row; (33, 8):
    only the new row), surplus blocks that must write nothing (verify_writes), and the
    non-split fused kernel on the same inputs."""
    A, B, K, V, qg, k, v = _fused_case(dev, dims, n, capacity=256, seed=n + 7)
    got = A.fused(qg, k, v, n - 1, block_rows=block_rows, extra_blocks=extra)
    B.set_position(n - 1)
    Qb, GATE = B.prep(qg, k, v, n - 1)
    want_pair = B.decode(Qb, GATE, n, split_threshold=1, block_rows=block_rows, extra_blocks=extra)
    Q = download(Qb, np.float32, (B.Hq, B.D))
    _check_fused(A, B, got, want_pair, Q, qg, k, v, K, V, n)
    general = A.fused(qg, k, v, n - 1)  # rewrites row pos with the same values
    np.testing.assert_allclose(got, general, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", [False, True])
def test_attn_fused_steps_in_one_pass(dev, split):
    """Three consecutive fused steps (positions p, p+1, p+2) in one concurrent pass: the
    declared ranges (read rows [0, pos), write row pos) alone order them (step t+1 reads the
    row step t appends), one barrier stage per step (split: + one for each combine), and the
    outputs equal three prep + decode steps."""
    dims = "tiny"
    n0 = 30
    A, B, K, V, _, _, _ = _fused_case(dev, dims, n0, capacity=64, seed=5)
    Hq, Hkv, D = A.Hq, A.Hkv, A.D
    r = fresh_rng(9)
    steps = [(f32(r.standard_normal((Hq, 2 * D))), f32(r.standard_normal((Hkv, D))),
              f32(r.standard_normal((Hkv, D)))) for _ in range(3)]
    kw = dict(block_rows=16, extra_blocks=1) if split else {}
    cb = dev.command_buffer()
    p = cb.compute_pass()
    outs = []
    for t, (qg, k, v) in enumerate(steps):
        pos = n0 - 1 + t
        POS = upload(dev, np.array([pos], np.uint32))
        outs.append((POS, A.encode_fused(p, upload(dev, qg), upload(dev, k), upload(dev, v), POS, pos,
                                         label=f"step {t}", **kw)))
    cb.commit()
    cb.wait()
    stages = [rec["stage"] for rec in cb.dispatch_log]
    # split: a step's split kernel shares the previous combine's stage (the row it reads was
    # appended one stage earlier), its combine waits for it
    assert stages == ([0, 1, 1, 2, 2, 3] if split else [0, 1, 2]), cb.dispatch_log
    for t, (qg, k, v) in enumerate(steps):
        pos = n0 - 1 + t
        B.set_position(pos)
        Qb, GATE = B.prep(qg, k, v, pos)
        want = B.decode(Qb, GATE, pos + 1, **({"split_threshold": 1, "block_rows": 16} if split else {}))
        np.testing.assert_array_equal(download(outs[t][1], np.float32), want)
    for C1, C2 in ((A.KC, B.KC), (A.VC, B.VC)):
        np.testing.assert_array_equal(download(C1, np.uint16), download(C2, np.uint16))


# ------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("V", [1, 31, 1000, 248320])
def test_sample_greedy(dev, V):
    rng = fresh_rng(V)
    logits = f32(rng.standard_normal(V) * 3)
    if V > 10:
        logits[[V // 3, V // 2, V - 1]] = logits.max() + 1  # ties -> lowest index
        logits[V // 4] = np.nan                            # NaN never wins
    L, TOK = upload(dev, logits), dev.buffer(4)
    run(dev, "sample_greedy", 1, 1024, buffers=[(0, L), (1, TOK)], constants=[(2, constant(V))],
        reads=[L], writes=[TOK])
    want = int(np.nanargmax(logits))
    assert download(TOK, np.uint32)[0] == want


@pytest.mark.parametrize("V,slice_", [(1, 64), (31, 64), (1000, 64), (1000, 4096), (248320, 4096), (5000, 96)])
def test_argmax_two_stage(dev, V, slice_):
    """argmax_partial (one threadgroup per slice) + sample_greedy_combine, as the runtime runs
    the greedy argmax: the token of sample_greedy (largest logit, lowest index among ties,
    NaN never) with ties across slices, a slice of NaN only, and a ragged last slice."""
    rng = fresh_rng(V, slice_)
    logits = f32(rng.standard_normal(V) * 3)
    if V > 10:
        top = logits.max() + 1
        logits[[V // 3, V // 2, V - 1]] = top  # ties in different slices -> lowest index
        logits[V // 4] = np.nan                 # NaN never wins
    if V > 2 * slice_:
        logits[slice_:2 * slice_] = np.nan      # a slice with no number at all
    token, stages = kernel_check.argmax_two_stage(dev, logits, slice_)
    assert stages == 2
    assert token == int(np.nanargmax(logits))


PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)


def _penalty_case(V, seed, fixed=False):
    # fixed: statistical tests keep their inputs, so their false-alarm rate stays alpha per case
    rng = np.random.default_rng(seed) if fixed else fresh_rng(seed)
    logits = f32(rng.standard_normal(V) * 2)
    prompt = rng.choice(V, 5, replace=False)
    generated = rng.choice(V, 8)
    return logits, prompt, generated


def test_sample_token_temperature0_is_penalised_argmax(dev):
    V = 3000
    logits, prompt, generated = _penalty_case(V, 0)
    top = np.argsort(-logits)[:6]
    generated = np.concatenate([generated, top[:3], top[:3]])   # penalise the leaders
    params = SamplingParams(temperature=0.0, **PENALTIES)
    toks, *_ = sample_many(dev, logits, count_buffer(V, prompt, generated), params, [1], [5])
    want = int(np.argmax(sampler_for(params, prompt, generated).process(logits)))
    assert toks[0] == want and want not in top[:3]


def test_sample_token_top_k1_equals_greedy(dev):
    V = 5000
    logits = f32(fresh_rng(1).standard_normal(V))
    params = SamplingParams(temperature=0.8, top_k=1)
    toks, *_ = sample_many(dev, logits, count_buffer(V), params, list(range(8)), list(range(8)))
    assert (toks == np.argmax(logits)).all()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02, **PENALTIES),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.1),
])
def test_sample_token_exact_draws_fast_path(dev, params):
    """V = 50 (all tokens are candidates): the token is where the cumulative filtered mass,
    in (probability desc, id asc) order, first exceeds u * Z; u from the numpy Philox model."""
    V = 50
    logits, prompt, generated = _penalty_case(V, 2)
    probs = filtered_probs(params, logits, prompt, generated)
    seeds = [int(s) for s in fresh_rng(3).integers(0, 2**63, 200)]
    positions = list(range(100, 300))
    toks, *_ = sample_many(dev, logits, count_buffer(V, prompt, generated), params, seeds, positions, tg=64)
    assert (probs[toks] > 0).all()
    for tok, (want, near) in zip(toks, expected_draws(probs, sorted_order(probs), seeds, positions)):
        assert tok == want or near  # float32 vs float64 mass can differ only next to a boundary


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=0.995),           # nucleus of ~2900 tokens > 1024
    SamplingParams(temperature=1.0, top_k=2000, min_p=0.5),  # top_k > 1024, no top-p
    SamplingParams(temperature=0.5),                         # no filter at all
])
def test_sample_token_exact_draws_slow_path(dev, params):
    """Filtered sets wider than the 1024 candidates: draws in (thread, element) order."""
    V, tg = 3000, 64
    rng = fresh_rng(11)
    logits = f32(rng.standard_normal(V) * 0.3)
    probs = filtered_probs(params, logits)
    assert (probs > 0).sum() > 1024 or params.min_p > 0
    seeds = list(range(60))
    positions = [5] * 60
    toks, *_ = sample_many(dev, logits, count_buffer(V), params, seeds, positions, tg=tg)
    assert (probs[toks] > 0).all()
    for tok, (want, near) in zip(toks, expected_draws(probs, thread_order(V, tg), seeds, positions)):
        assert tok == want or near


def _chi2_critical(df, z=3.09):  # alpha = 0.001, Wilson-Hilferty
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("tg,N", [(1024, 400), (128, 3000)])
def test_sample_token_distribution_chi_square(fwd_dev, tg, N):
    """N seeds (1024 threads as in production; 128 threads for a larger sample at the
    simulator's cost), several elements per thread (V = 3000): the empirical distribution matches
    the filtered softmax of lily.sampling (chi-square, alpha 0.001); tokens outside the
    filtered support never appear."""
    V = 3000
    logits, prompt, generated = _penalty_case(V, 4, fixed=True)
    logits[:40] += 4.0  # a head of ~40 plausible tokens
    params = SamplingParams(temperature=0.8, top_k=30, top_p=0.92, min_p=0.01, **PENALTIES)
    probs = filtered_probs(params, logits, prompt, generated)
    seeds = list(range(1, N + 1))
    toks, *_ = sample_many(fwd_dev, logits, count_buffer(V, prompt, generated), params, seeds, [7] * N, tg=tg)
    assert (probs[toks] > 0).all()
    obs = np.bincount(toks, minlength=V).astype(np.float64)
    exp_ = probs * N
    big = exp_ >= 5
    stat = ((obs[big] - exp_[big]) ** 2 / exp_[big]).sum()
    rest_o, rest_e = obs[~big].sum(), exp_[~big].sum()
    df = int(big.sum()) - 1
    if rest_e >= 5:
        stat += (rest_o - rest_e) ** 2 / rest_e
        df += 1
    assert stat < _chi2_critical(df), (stat, df)


def test_sample_token_reproducible_and_counts(fwd_dev):
    V = 2000
    logits = f32(fresh_rng(5).standard_normal(V))
    params = SamplingParams(temperature=1.0, top_p=0.95)
    a, *_ = sample_many(fwd_dev, logits, count_buffer(V), params, [42, 42, 43, 42], [10, 10, 10, 11])
    assert a[0] == a[1]
    b, *_ = sample_many(fwd_dev, logits, count_buffer(V), params, [42], [10])
    assert b[0] == a[0]
    many, *_ = sample_many(fwd_dev, logits, count_buffer(V), params, list(range(40)), [10] * 40)
    assert len(set(many.tolist())) > 5
    # the per-session count buffer gets +1 at the drawn token
    counts = count_buffer(V, prompt=[3])
    toks, _, _, C, _ = sample_many(fwd_dev, logits, counts, params, [9], [0], update_counts=True)
    want = counts.copy()
    want[toks[0]] += 1
    np.testing.assert_array_equal(download(C, np.uint32), want)


def test_sample_token_logprobs(dev):
    V = 4000
    logits = f32(fresh_rng(6).standard_normal(V) * 4)
    params = SamplingParams(temperature=0.9, top_k=50, top_logprobs=5, logprobs=True)
    toks, lps, ids, *_ = sample_many(dev, logits, count_buffer(V), params, [11, 12], [1, 2], logprobs=True)
    for tok, lp, ii in zip(toks, lps, ids):
        want = sampler_for(params).logprob(logits, int(tok))
        assert abs(lp[0] - want.logprob) < 1e-4
        np.testing.assert_array_equal(ii, [t for t, _ in want.top])
        np.testing.assert_allclose(lp[1:], [v for _, v in want.top], atol=1e-4)


def test_sample_token_real_vocab(fwd_dev):
    """The real vocabulary (248320), Qwen-style settings: the token is in the nucleus and the
    draw is the one the numpy model of the kernel's order predicts."""
    V = 248320
    rng = fresh_rng(8)
    logits = f32(rng.standard_normal(V) * 2)
    logits[rng.choice(V, 30, replace=False)] += 9
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, top_logprobs=3, logprobs=True)
    probs = filtered_probs(params, logits)
    toks, lps, ids, _, dt = sample_many(fwd_dev, logits, count_buffer(V), params, [1, 2, 3], [0, 0, 0],
                                        logprobs=True)
    assert (probs[toks] > 0).all()
    np.testing.assert_array_equal(ids[0], np.argsort(-logits, kind="stable")[:3])
    lsm = log_softmax(logits)
    np.testing.assert_allclose(lps[:, 0], lsm[toks], atol=1e-4)


# ------------------------------------------------------------------------------ composition

def test_mixers_in_one_pass_with_derived_barriers(dev):
    """Two GDN steps (conv state ping-pong) and attention prep -> decode -> greedy in one
    concurrent pass: the declared ranges alone order the dependent dispatches (GDN step 2
    after step 1 through the state and conv buffers; decode after prep through the appended
    cache row; the greedy pick after decode), and the results equal the reference."""
    Hk, Hv, Dk, Dv = GDN_DIMS["tiny"]
    G = GdnLayer(dev, Hk, Hv, Dk, Dv, seed=21)
    Hq, Hkv, D, rot = ATTN_DIMS["tiny"]
    n = 40
    A = AttnLayer(dev, Hq, Hkv, D, rot, capacity=64, seed=22)
    K, V = _poison_rows(A, n - 1)
    A.set_position(n - 1)
    r = A.rng
    qg, k, v = (f32(r.standard_normal((Hq, 2 * D))), f32(r.standard_normal((Hkv, D))),
                f32(r.standard_normal((Hkv, D))))
    steps = [G.random_inputs() for _ in range(2)]

    cb = dev.command_buffer()
    p = cb.compute_pass()
    gdn_out = []
    for t, (qkv, z, b, a) in enumerate(steps):
        Q_, Z_, B_, A_ = upload(dev, qkv), upload(dev, z), upload(dev, b), upload(dev, a)
        O_ = dev.buffer(Hv * Dv * 4)
        cin, cout = G.conv[t % 2], G.conv[1 - t % 2]
        p.dispatch(G.kernel, Hv, 1024,
                   buffers=[(0, Q_), (1, Z_), (2, B_), (3, A_), (4, G.w[0]), (5, G.w[1]), (6, G.w[2]),
                            (7, G.w[3]), (8, cin), (9, cout), (10, G.state), (11, O_)],
                   constants=[(12, args_bytes(Hk, Hv, 4, 1e-6, 1e-6))],
                   reads=[Q_, Z_, B_, A_, *G.w, cin, G.state], writes=[cout, G.state, O_],
                   threadgroups=True, label=f"gdn step {t}")
        gdn_out.append((O_, Q_, Z_, B_, A_))
    QG, Kb, Vb = upload(dev, qg), upload(dev, k), upload(dev, v)
    Qo, GATE, OUT, TOK = dev.buffer(Hq * D * 4), dev.buffer(Hq * D * 4), dev.buffer(Hq * D * 4), dev.buffer(4)
    p.dispatch("attn_qk_prep", Hq + Hkv, D,
               buffers=[(0, QG), (1, Kb), (2, Vb), (3, A.QN), (4, A.KN), (5, A.POS), (6, A.KC), (7, A.VC),
                        (8, Qo), (9, GATE)],
               constants=[(10, args_bytes(Hq, Hkv, D, rot, A.cap, 1e-6, float(np.log2(THETA))))],
               reads=[QG, Kb, Vb, A.QN, A.KN, A.POS], writes=[*A.cache_row_ranges(n - 1), Qo, GATE],
               threadgroups=True)
    rows = [(C, h * A.cap * 2 * D, n * 2 * D) for C in (A.KC, A.VC) for h in range(Hkv)]
    p.dispatch(f"attn_decode_d{D}_g{A.G}", Hq // A.G, 256,
               buffers=[(0, Qo), (1, GATE), (2, A.KC), (3, A.VC), (4, A.POS), (5, OUT)],
               constants=[(6, args_bytes(Hq, Hkv, A.cap, D, float(D) ** -0.5, 0, 0))],
               reads=[Qo, GATE, A.POS, *rows], writes=[OUT], threadgroups=True)
    p.dispatch("sample_greedy", 1, 1024, buffers=[(0, OUT), (1, TOK)], constants=[(2, constant(Hq * D))],
               reads=[OUT], writes=[TOK], threadgroups=True)
    cb.commit()
    cb.wait()
    # stages are derived in encoding order: gdn 0 | gdn 1 (state, conv) with prep beside it
    # (independent) | decode (reads the appended row) | greedy (reads the output)
    stages = [rec["stage"] for rec in cb.dispatch_log]
    assert stages == [0, 1, 1, 2, 3], cb.dispatch_log

    for (O_, *_), inp in zip(gdn_out, steps):
        np.testing.assert_allclose(download(O_, np.float32), G.step_reference(*inp), rtol=1e-4, atol=1e-5)
    oracle = StubOracle(attn_cfg(Hq, Hkv, D, rot), {"q_norm.weight": from_bf16(A.qn),
                                                   "k_norm.weight": from_bf16(A.kn)})
    oracle.proj = {"q_proj": qg.reshape(1, -1), "k_proj": k.reshape(1, -1), "v_proj": v.reshape(1, -1)}
    st = ReferenceState(max_context=A.cap, position=n - 1)
    st.keys[0], st.values[0] = K.copy(), V.copy()
    want = oracle.attention(0, np.zeros((1, 1), np.float32), st)[0]
    got = download(OUT, np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2)
    assert download(TOK, np.uint32)[0] == int(np.argmax(got))
