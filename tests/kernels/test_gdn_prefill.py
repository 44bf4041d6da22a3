"""Gated DeltaNet prefill kernels (metal/gdn_prefill.metal) on the Metal simulator.

``gdn_scan_k{Dk}_v{Dv}_r{RV}`` (causal conv + SiLU inline from qkv and the conv state, L2
norms, gates, delta rule with the recurrent state in registers, each head split over Dv / RV
threadgroups, then the per-element part of the gated RMSNorm: u, bfloat, and each split's sum of
y^2), ``gdn_norm_scale_v{Dv}_r{RV}`` (the splits' half norm factors, which out_proj applies to u
while staging it: the output checked is that product, ``GdnPrefillLayer.normed``) and
``gdn_conv_state``
(the next conv state, possibly in place) against numpy references built from
``lily.reference`` (its ``silu``, ``sigmoid``, ``l2_norm`` and, for the whole layer,
``ReferenceModel.gated_deltanet`` itself with the projections stubbed), and against the decode
kernel ``gdn_decode_step`` run token by token. Inputs are fresh random draws per run
(``fresh_rng``); z is bfloat, as in_proj_z (gemm_q4_bf16) stores it, the other projections
fp32. Every output buffer starts poisoned (NaN); chunk buffers are allocated for more rows
than the chunk uses and only the chunk's rows are declared, so a read or write past row M
is caught (``verify_reads`` / ``verify_writes``).

Tolerances:
* conv: the new conv state is a copy, exact. The conv output is internal to the scan: four
  products and a sum in float32, then SiLU, within ``2^-20 (sum_j |w_j x_j| + |out|)`` of
  float64 (16 u relative to the terms), which the scan bounds below absorb (the kernel's
  q, k, v differ from the float64 ones by that much before the L2 norms).
* scan (+ gated norm) vs the float64 conv and scan: per token the kernel does float32 dot
  products over Dk and Dv <= 128 terms
  (q, k unit norm, |S| <= ~1). An output o = y / rms(y) * w * silu(z) inherits the rounding of
  y = S q relative to its terms sum_k |S_vk q_k|, amplified by the cancellation factor
  kappa = rms_v(sum_k |S_vk q_k|) / rms_v(y_v) (up to ~200 on the tiny preset, where Dk = 32
  and a fresh state is rank one), plus the relative error of rms(y). So each output must be
  within ``64 u kappa (|o| + |w silu(z)|)`` (u = 2^-24; measured <= 10 u kappa (...) over
  many seeds), then the roundings of the staged output (u bfloat, its split's factor f <= 1
  half and their product bfloat: at most ~(2 2^-8 + 2^-11) of its magnitude more,
  ``gdn_stored``); nothing is clipped (test_gated_norm_beyond_half drives outputs past the
  half range). The state update S -> g S (I - beta k k^T) + ... is non-expansive (unit-norm
  k, beta in (0, 1)) and damped by g < 1 (typically 0.6 .. 0.97 with these A_log and
  dt_bias, as in the model), so a state error stays within a few per-step roundings /
  (1 - g) however long the chunk: the state within ``1e-5`` absolute (~170 u at |S| ~ 1;
  measured <= 1e-6). The drift tests (384 tokens in six chunks at Dk = Dv = 128, 504
  tokens in three chunks at 32) check the same bounds after every chunk.
* conv + scan vs ``ReferenceModel.gated_deltanet`` (the float32 oracle, which also sums the
  conv taps in another order): both sides round, so twice the float64 bounds (128 u kappa
  (...) and 2e-5); the conv state exactly.
* against ``gdn_decode_step``: the inline conv performs the decode step's float32 operations
  in the same order (conv state exact); the scan sums each dot product as per-lane float4 partials
  and two shuffle-add levels over the 4 lanes of a row (the decode step: 32-lane
  simd_sum), so outputs and state are held to twice the float64 bounds. Two chunks equal one
  chunk of the same tokens exactly (the arithmetic of a token does not depend on where its
  chunk starts). The decode step's output stays fp32, so the chunk's bfloat output differs from
  it by the bfloat roundings as well.
* the lazy decay (the device state is S' and a pending decay c per row, S = c S'; read as
  the float64 product c S', exact): the tests that start from c != 1 (c = 0 meaning S = 0,
  c near the fold threshold 2^-40) and drive folds (g ~ e^-15, g = 0) hold the same float64
  bounds: a fold or a product by c is one more float32 rounding per scalar, not per state
  element. Two chunks equal one in S' and c bit for bit.

Correctness tests run in three simulator modes (fixture ``dev``): forward order, reverse
thread/threadgroup order with undeclared-read detection, random order; all with
out-of-range write detection. The long drift run uses the forward order only.
"""

from __future__ import annotations


import numpy as np
from seeding import fresh_rng
from harness import ORDERS, THREAD_ORDERS, bf16_bits, from_bf16, f32  # noqa: F401
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import download, upload  # noqa: E402
from lily.reference import ReferenceState, silu  # noqa: E402
# the layer harness and float64 references live with lily doctor's kernel checks (one home)
from lily.lab.kernels import gdn_prefill as twins  # noqa: E402
from lily.lab.kernels.gdn_prefill import SPARE_ROWS, rows_buffer  # noqa: E402,F401
from lily.lab.kernels.harness import U  # noqa: E402,F401
from lily.lab.kernels.gdn_prefill import GDN_EPS as EPS, GDN_K as K, GDN_PREFILL_DIMS as GDN_DIMS  # noqa: E402,F401
from lily.lab.kernels.gdn_prefill import rows_out_buffer as out_buffer  # noqa: E402,F401
from lily.lab.kernels.harness import StubOracle  # noqa: E402,F401
from lily.lab.kernels.gdn_prefill import gdn_stored  # noqa: E402
from lily.lab.kernels.harness import HALF_MAX, bf16_round  # noqa: E402


class Layer(twins.GdnPrefillLayer):
    """twins.GdnPrefillLayer on fresh random weights (tests/seeding.py)."""

    def __init__(self, dev, dims, seed):
        super().__init__(dev, dims, rng=fresh_rng(seed))


# ------------------------------------------------------------------------------ helpers

def assert_outputs_close(got, want, scale, c=64, what="outputs"):
    """|got - want| <= c u scale per element (scale from scan_reference), for the gated
    norm as out_proj stages it: plus its bfloat and half roundings (``gdn_stored``)."""
    want, bound = gdn_stored(want, c * U * scale)
    assert np.isfinite(got).all(), f"{what}: non-finite outputs"
    err = np.abs(got - want)
    assert np.all(err <= bound), f"{what}: worst error / bound = {float((err / bound).max()):.3g}"


def assert_state_close(got, want, atol=1e-5, what="state"):
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=what)


# ------------------------------------------------------------------------------ gdn_conv_state

@pytest.mark.parametrize("dims,M,tg", [
    ("tiny", 1, 256),     # shorter than the state: the new state keeps old rows
    ("tiny", 2, 96),      # partial threadgroup
    ("tiny", 5, 96),
    ("real", 37, 256),
])
@pytest.mark.parametrize("in_place", [False, True])
def test_conv_state(dev, dims, M, tg, in_place):
    """The conv state after a chunk: the last K-1 rows of [state | qkv], exactly, in place
    or into the other buffer (the input then left unchanged)."""
    L = Layer(dev, dims, seed=11)
    state_in = f32(L.rng.standard_normal((K - 1, L.C)))
    L.set_state(state_in, np.zeros((L.Hv, L.Dv, L.Dk)), parity=0)
    qkv = L.inputs(M)[0]
    cout = L.CS[0] if in_place else L.CS[1]
    cb = dev.command_buffer()
    L.encode_conv_state(cb.compute_pass(), rows_buffer(dev, qkv), M, L.CS[0], cout, tg=tg)
    cb.commit()
    cb.wait()
    np.testing.assert_array_equal(download(cout, np.float32, (K - 1, L.C)), L.conv_reference(qkv, state_in)[1])
    if not in_place:
        np.testing.assert_array_equal(L.conv_state(0), state_in)


# ------------------------------------------------------------------------------ gdn_scan

@pytest.mark.parametrize("dims,M", [("tiny", 1), ("tiny", 5), ("tiny", 9), ("tiny", 64), ("tiny", 100),
                                    ("dims", 1), ("dims", 7), ("dims", 16), ("dims", 17), ("dims", 100),
                                    ("real", 13)])
def test_scan_matches_float64(dev, dims, M):
    """The scan (conv inline) and the gated norm from a random recurrent and conv state on
    random projections, against the float64 conv and scan."""
    L = Layer(dev, dims, seed=12)
    conv0, S0 = L.random_state()
    qkv, z, b, a = L.inputs(M)
    Q, Z, B, A = L.input_buffers(qkv, z, b, a)
    outs = L.out_buffers(M)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    L.encode_scan(p, Q, L.CS[0], Z, B, A, outs, M)
    cb.commit()
    cb.wait()
    got = L.normed(outs, M)
    want_o, want_S, scale = L.scan_reference(L.conv_reference(qkv, conv0)[0], z, b, a, S0)
    assert_outputs_close(got[:M], want_o, scale)
    assert_state_close(L.state(), want_S)
    assert np.isnan(got[M:]).all()
    splits = L.Hv * L.S_splits
    assert np.isnan(download(outs[1][0], np.float32, (M + SPARE_ROWS, splits))[M:]).all()
    f = download(outs[2][0], np.float16, (M + SPARE_ROWS, splits))
    assert np.isnan(f[M:]).all() and (f[:M] <= 1).all()  # f_s = inv / a_s <= 1
    np.testing.assert_array_equal(L.conv_state(0), conv0)   # the scan only reads the conv state


def test_gated_norm_beyond_half(dev):
    """Gated-norm outputs beyond the half range (a norm weight of 2^17): u is stored as the
    rounded value (bfloat: nothing is clipped) and staged times its split's factor f <= 1."""
    L = Layer(dev, "tiny", seed=17)
    L.norm_w = bf16_bits(np.full(L.Dv, 2.0**17))
    L.W[3] = upload(dev, L.norm_w)
    conv0, S0 = L.random_state()
    inp = L.inputs(5)
    got = L.chunk(*inp, p0=0)
    want, _, scale = L.scan_reference(L.conv_reference(inp[0], conv0)[0], *inp[1:], S0)
    assert (np.abs(got) > HALF_MAX).mean() > 0.1
    assert_outputs_close(got, want, scale)


def test_gated_norm_reads_large_z(dev):
    """z as in_proj_z (gemm_q4_bf16) leaves it: bfloat, so a sum beyond the half range stays
    what it is (+-1e5 here, a quarter of the values). silu of those stays finite (1e5 and
    -0): the outputs match the reference on the same z, past the half range where z = 1e5,
    and zero where z = -1e5."""
    L = Layer(dev, "dims", seed=18)
    conv0, S0 = L.random_state()
    qkv, z, b, a = L.inputs(5)
    big = L.rng.random(z.shape) < 0.25
    z = np.where(big, np.where(L.rng.random(z.shape) < 0.5, -1e5, 1e5), z).astype(np.float32)
    z = bf16_round(z)
    got = L.chunk(qkv, z, b, a, p0=0)
    with np.errstate(over="ignore"):  # exp(1e5) in the reference's silu: inf, silu = -0
        want, _, scale = L.scan_reference(L.conv_reference(qkv, conv0)[0], z, b, a, S0)
    assert (np.abs(got) > HALF_MAX).any() and (got[z < -HALF_MAX] == 0).all()
    assert_outputs_close(got, want, scale)


@pytest.mark.parametrize("dims,M", [("tiny", 1), ("tiny", 5), ("tiny", 33),
                                    ("dims", 1), ("dims", 8), ("dims", 13), ("dims", 24)])
def test_chunk_matches_decode_steps(dev, dims, M):
    """conv + scan + gated norm over M tokens against M gdn_decode_step dispatches from a
    random state, at an odd start position (an even M updates the conv state in place).
    The conv state is a copy (exact); the scan sums its dot products in another order than
    the decode step, so outputs and state agree within the float64 bounds of both sides."""
    L = Layer(dev, dims, seed=13)
    p0 = 7
    conv0, S0 = L.random_state(parity=p0 % 2)
    inp = L.inputs(M)
    got = L.chunk(*inp, p0=p0)
    got_S, got_conv = L.state(), L.conv_state((p0 + M) % 2)

    L.set_state(conv0, S0, parity=p0 % 2)
    want = np.stack([L.decode_step(*(x[t] for x in inp), pos=p0 + t) for t in range(M)])
    *_, scale = L.scan_reference(L.conv_reference(inp[0], conv0)[0], *inp[1:], S0)
    assert_outputs_close(got, want, scale, c=128, what="chunk vs decode steps")
    assert_state_close(got_S, L.state(), atol=2e-5, what="state: chunk vs decode steps")
    np.testing.assert_array_equal(got_conv, L.conv_state((p0 + M) % 2))


def check_vs_oracle(L, inp, conv0, S0, got, got_S, got_conv):
    """The chunk's outputs and states against ReferenceModel.gated_deltanet (float32 oracle)
    on the same inputs and starting state; the error scale from the float64 references."""
    o = L.oracle()
    st = ReferenceState(max_context=1 << 20)
    st.conv[0], st.recurrent[0] = conv0.copy(), S0.copy()
    o.proj = dict(zip(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), inp))
    want = o.gated_deltanet(0, np.zeros((len(got), 1), np.float32), st)
    conv, _, _ = L.conv_reference(inp[0], conv0)
    *_, scale = L.scan_reference(conv, *inp[1:], S0)
    assert_outputs_close(got, want, scale, c=128, what="outputs vs the oracle")
    assert_state_close(got_S, st.recurrent[0], atol=2e-5, what="state vs the oracle")
    np.testing.assert_array_equal(got_conv, st.conv[0])


@pytest.mark.parametrize("dims,split", [("tiny", (37, 64)), ("tiny", (64, 5)), ("dims", (12, 13)),
                                        ("dims", (1, 30)), ("dims", (8, 9)), ("dims", (3, 5, 16))])
def test_two_chunks_equal_one(dev, dims, split):
    """Conv and recurrent state carried across chunks (conv state in place when a chunk has
    even length) give exactly the single long chunk's outputs and states; both match the
    oracle (ReferenceModel.gated_deltanet)."""
    L = Layer(dev, dims, seed=14)
    conv0, S0 = L.random_state(parity=0)
    M = sum(split)
    inp = L.inputs(M)
    whole = L.chunk(*inp, p0=0)
    whole_S, whole_conv = L.state(), L.conv_state(M % 2)

    whole_parts = L.state_parts()

    L.set_state(conv0, S0, parity=0)
    parts, p0 = [], 0
    for m in split:
        parts.append(L.chunk(*(x[p0:p0 + m] for x in inp), p0=p0))
        p0 += m
        if p0 < M:  # the cut carries pending decays c != 1 (c = 1 only on a head that folded
            assert (L.state_parts()[1] < 1).any()  # at the chunk's last token)
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    for got, want in zip(L.state_parts(), whole_parts):  # S' and c, bit for bit
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(L.conv_state(M % 2), whole_conv)

    check_vs_oracle(L, inp, conv0, S0, whole, whole_S, whole_conv)


def fold_inputs(L, M, zero_at=()):
    """Random projections whose gates make the lazy decay fold: per head a target -ln g
    (head 0 ~0.1, the model's usual memory; head 1 ~15, so c g falls below 2^-40 every
    second token; the others as drawn) and g = 0 exactly (softplus(1e4) A) on head 2 at the
    tokens ``zero_at``."""
    qkv, z, b, a = L.inputs(M)
    A = np.exp(L.A_log.astype(np.float64))
    dtb = from_bf16(L.dt_bias).astype(np.float64)
    for h, target in ((0, 0.1), (1, 15.0)):  # softplus(x) ~ x for x >> 1, log1p(e^x) otherwise
        x = np.log(np.expm1(target * np.maximum(1 + 0.2 * L.rng.standard_normal(M), 0.2) / A[h]))
        a[:, h] = x - dtb[h]
    a[list(zero_at), 2] = 1e4
    return qkv, z, b, a


@pytest.mark.parametrize("dims,M", [("tiny", 1), ("tiny", 40), ("dims", 2), ("dims", 21)])
def test_lazy_decay_folds(dev, dims, M):
    """The lazy decay from pending decays c != 1 (c = 0 on head 0: S = 0 whatever S' holds;
    2^-39, one step from a fold, on head 1) with gates that fold (head 1 every second token,
    g = 0 on head 2) against the float64 scan from S = c S'; c stays in [2^-40, 1] and is 1
    after a fold."""
    L = Layer(dev, dims, seed=19)
    c0 = np.array([0.0, 2.0**-39, 0.5, 2.0**-20] + [1.0] * (L.Hv - 4))
    conv0, S0 = L.random_state(c=c0)
    assert not S0[0].any()
    inp = fold_inputs(L, M, zero_at=[M // 2])
    got = L.chunk(*inp, p0=0)
    want_o, want_S, scale = L.scan_reference(L.conv_reference(inp[0], conv0)[0], *inp[1:], S0)
    assert_outputs_close(got, want_o, scale)
    assert_state_close(L.state(), want_S)
    c = L.state_parts()[1]
    assert (c >= twins.GDN_SCAN_FOLD).all() and (c <= 1).all()
    assert (c[0] < 1).all() if M > 1 else (c[0] == 1).all()  # folded at token 0 (c = 0), then lazy
    if M == 1:
        assert (c[1] == 1).all() and (c[2] == 1).all()       # 2^-39 g and 0 g both fold


@pytest.mark.parametrize("dims,m1,n,m2", [("tiny", 9, 3, 20), ("dims", 5, 2, 7)])
def test_prefill_decode_prefill(dev, dims, m1, n, m2):
    """A chunk (leaving pending decays c != 1), n decode steps (which apply c and leave
    c = 1), another chunk, from a state with pending decays, on folding gates: every output
    and the state against the float64 scan over all m1 + n + m2 tokens (chunk outputs are
    bfloat, decode outputs fp32: both within the float64 bounds of both sides)."""
    L = Layer(dev, dims, seed=20)
    c0 = 2.0 ** -L.rng.uniform(0, 40, L.Hv)
    c0[0] = 0.5  # head 0 (slow decay) does not fold in the first chunk: c < 1 at the cut
    conv0, S0 = L.random_state(parity=1, c=c0)
    M = m1 + n + m2
    inp = fold_inputs(L, M, zero_at=[m1 + n + 1])
    outs = [L.chunk(*(x[:m1] for x in inp), p0=1)]
    assert (L.state_parts()[1][0] < 1).all()
    for t in range(m1, m1 + n):
        outs.append(L.decode_step(*(x[t] for x in inp), pos=1 + t)[None])
        np.testing.assert_array_equal(L.state_parts()[1], 1.0)
    outs.append(L.chunk(*(x[m1 + n:] for x in inp), p0=1 + m1 + n))
    want_o, want_S, scale = L.scan_reference(L.conv_reference(inp[0], conv0)[0], *inp[1:], S0)
    assert_outputs_close(np.concatenate(outs), want_o, scale, c=128, what="chunk, decode steps, chunk")
    assert_state_close(L.state(), want_S, atol=2e-5)


def test_chunk_vs_oracle_real_dims(dev):
    """Real dims (Hk=16, Hv=32, Dk=Dv=128), conv + scan against ReferenceModel.gated_deltanet."""
    L = Layer(dev, "real", seed=15)
    conv0, S0 = L.random_state(parity=1)
    M = 6
    inp = L.inputs(M)
    got = L.chunk(*inp, p0=1)
    check_vs_oracle(L, inp, conv0, S0, got, L.state(), L.conv_state(1))   # M even: in place


@pytest.mark.parametrize("dims,chunks", [("dims", (1, 100, 64, 5, 150, 64)), ("tiny", (400, 3, 101))])
def test_drift_several_chunks(fwd_dev, dims, chunks):
    """Hundreds of tokens from a zero state in chunks of varied length (Dk = Dv = 128: 384
    tokens in six chunks; Dk = Dv = 32: a 400-token chunk and two more, 504 tokens) against
    the float64 references carried across the chunks."""
    L = Layer(fwd_dev, dims, seed=16)
    conv_st = np.zeros((K - 1, L.C), np.float32)
    S = np.zeros((L.Hv, L.Dv, L.Dk))
    L.set_state(conv_st, S, parity=0)
    p0 = 0
    worst_o = worst_S = 0.0
    for m in chunks:
        qkv, z, b, a = L.inputs(m)
        got = L.chunk(qkv, z, b, a, p0=p0)
        want_conv, conv_st, _ = L.conv_reference(qkv, conv_st)
        # the references continue from the float64 recurrent state and the exact conv state
        want_o, S, scale = L.scan_reference(want_conv, z, b, a, S)
        got_S = L.state()
        assert_outputs_close(got, want_o, scale, what=f"outputs of the chunk at {p0}")
        assert_state_close(got_S, S, what=f"state after the chunk at {p0}")
        worst_o = max(worst_o, float(np.abs(got - want_o).max()))
        worst_S = max(worst_S, float(np.abs(got_S - S).max()))
        p0 += m
        np.testing.assert_array_equal(L.conv_state(p0 % 2), conv_st)
    print(f"drift over {p0} tokens: outputs {worst_o:.2e}, state {worst_S:.2e}")


# ------------------------------------------------------------------------------ structure

def test_scan_grid_fills_an_m5_max():
    """From the recorded counters of a real-dims chunk (record-only): three GDN dispatches
    per layer (no conv kernel: the scan convolves inline; no gated-norm pass: the scan and
    out_proj apply it); the scan runs as at least 2x the M5 Max's 40 GPU cores of
    threadgroups (each head split over Dv / RV threadgroups), the norm scale covers every
    (token, head) pair and out_proj reads u with its factors (gemm_q4_add_hs)."""
    from lily.native_backend import count_prefill_chunk
    from lily.lab.estimate import QWEN36_35B_A3B, machine
    from lily.checkpoint import parse_config
    rows = 512
    recs = count_prefill_chunk(parse_config(QWEN36_35B_A3B), rows)["records"]
    scans = [r for r in recs if r["kernel"].startswith("gdn_scan_")]
    norms = [r for r in recs if r["kernel"].startswith("gdn_norm_scale_")]
    states = [r for r in recs if r["kernel"] == "gdn_conv_state"]
    outs = [r for r in recs if "out_proj" in r["label"]]
    assert len(scans) == len(norms) == len(states) == len(outs) == 30
    assert {r["kernel"] for r in recs if r["kernel"].startswith("gdn_")} == {
        "gdn_scan_k128_v128_r32", "gdn_norm_scale_v128_r32", "gdn_conv_state"}  # the conv is inline
    assert {r["kernel"] for r in outs} == {"gemm_q4_add_hs"}
    for r in scans:
        assert int(np.prod(r["groups"])) >= 2 * machine("m5max").cores
        assert r["groups"] == (32, 4, 1) and r["threads"] == (128, 1, 1)
        assert r["threads"][0] == 32 * twins.GDN_SCAN_LANES  # the twin dispatches as the runtime
        assert r["threadgroup_memory"] <= 16 * 1024
    for r in norms:
        assert int(np.prod(r["groups"])) * int(np.prod(r["threads"])) >= rows * 32
