"""metal/attention.metal (q/k prep, decode attention, split + combine, fused prep + decode;
docs/kernels.md) on the Metal simulator against the numpy reference, and the decode mixers
(GDN step, attention, greedy pick) composed in one pass.

Every output buffer starts poisoned (the simulator fills new buffers with NaN), so an
element a kernel forgets to write fails the comparison.

Tolerances (all float32 arithmetic on both sides unless noted):
* attention: the cache holds bf16 values that both sides read exactly; the remaining
  difference is float32 summation order over <= 256-element dot products and a softmax
  over <= a few hundred rows: rtol/atol 2e-5 against a float64 evaluation. Cache rows
  written by attn_qk_prep are compared with the bf16 rounding of the float32 reference,
  allowing one bf16 ulp where a float32 difference of ~1e-7 can flip the rounding.
* fused prep + decode (attn_decode_fused, attn_decode_split_fused): the same float32
  operations in the same order as attn_qk_prep + attn_decode(_split), but other kernels
  (harness.assert_same_arithmetic): the written cache rows equal that pair's bit for bit on
  the simulator and within CROSS_KERNEL_ULPS (4) of their head's largest value plus one bf16
  ulp on a GPU, where the compiler may contract each kernel differently; the outputs the
  same on the simulator and within ATTN_CROSS_ULPS (256) on a GPU (a few ulps of q, carried
  through 256-term score sums and the softmax); and with the tolerances above against
  float64 and ReferenceModel.attention.
* RoPE: the kernel computes frequencies and angles in float32 (as MLX does), the reference
  in float64; at positions < 5000 the angle error is < 5000 * 2^-24 * few ~ 1e-3 rad at
  most for the fastest pair, so q/k after RoPE are compared with atol 2e-3 (values are
  O(1) after RMSNorm). Position 0..64 is tight (1e-5).

Kernel correctness tests run in three simulator modes (fixture ``dev``): forward order,
reverse thread/threadgroup order with undeclared-read detection, random order; all with
out-of-range write detection.
"""

from __future__ import annotations


import numpy as np
from seeding import fresh_rng
from harness import ORDERS, THREAD_ORDERS, assert_same_arithmetic, bf16_bits, from_bf16, f32  # noqa: F401
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import download, pack_args, upload  # noqa: E402
from lily.reference import ReferenceState, round_bf16  # noqa: E402
# the layer harnesses and float64 references live with lily doctor's kernel checks (one home)
from lily.lab.kernels import attention as twins  # noqa: E402
from lily.lab.kernels.attention import ATTN_TG, THETA, attention_reference, attn_cfg, qk_prep_reference  # noqa: E402
from lily.lab.kernels.harness import StubOracle  # noqa: E402
from lily.lab.kernels.sample import SAMPLER_THREADS  # noqa: E402


from test_gdn import GDN_DIMS, GdnLayer  # noqa: E402 (the composition test)


# ------------------------------------------------------------------------------ attention

#: Fused vs unfused attention outputs on a GPU (module docstring): ulps of a head's largest output.
ATTN_CROSS_ULPS = 256

ATTN_DIMS = {  # Hq, Hkv, D, rotary_dim
    "real": (16, 2, 256, 64),
    "dims": (8, 1, 256, 64),
    "tiny": (4, 2, 64, 16),
}



class AttnLayer(twins.AttnLayer):
    """twins.AttnLayer on fresh random inputs (tests/seeding.py)."""

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


def _decode_case(dev, dims, n, capacity):
    """A layer at position n-1 (seed n; cache rows >= n poisoned), its float32 history K, V
    and one token's q and gate (Hq, D) for attn_decode."""
    Hq, Hkv, D, rot = ATTN_DIMS[dims]
    A = AttnLayer(dev, Hq, Hkv, D, rot, capacity=capacity, seed=n)
    K, V = _poison_rows(A, n)
    q, gate = f32(A.rng.standard_normal((Hq, D))), f32(A.rng.standard_normal((Hq, D)))
    A.set_position(n - 1)
    return A, K, V, q, gate


@pytest.mark.parametrize("dims", list(ATTN_DIMS))
@pytest.mark.parametrize("n", [1, 31, 33, 200])
def test_attn_decode(dev, dims, n):
    A, K, V, q, gate = _decode_case(dev, dims, n, capacity=256)
    got = A.decode(upload(dev, q), upload(dev, gate), n)
    want = attention_reference(q, gate, K, V, n, A.D)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dims", list(ATTN_DIMS))
@pytest.mark.parametrize("n,block_rows,extra", [(64, 16, 0), (200, 48, 1), (129, 64, 2), (1000, 96, 0)])
def test_attn_decode_split(dev, dims, n, block_rows, extra):
    """The long-context path (threshold 64 here): several blocks, a ragged last block,
    surplus blocks in the grid that must return without writing."""
    A, K, V, q, gate = _decode_case(dev, dims, n, capacity=1024)
    Q, GT = upload(dev, q), upload(dev, gate)
    got = A.decode(Q, GT, n, split_threshold=64, block_rows=block_rows, extra_blocks=extra)
    want = attention_reference(q, gate, K, V, n, A.D)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # the general path on the same inputs agrees to float32 rounding
    general = A.decode(Q, GT, n)
    np.testing.assert_allclose(got, general, rtol=1e-5, atol=1e-6)


def _check_oracle(A, got, qg, k, v, K, V, n):
    """got (one token at position n-1 of layer A, from projections qg, k, v over the history
    K, V) vs ReferenceModel.attention. The oracle keeps the new token's k/v in float32, the
    kernels in bf16 (relative rounding <= 2^-8, bf16's unit roundoff): at n = 1 the output is
    the rounded v times sigmoid(gate), off by up to 2^-8 of itself, and v reaches ~5 over
    thousands of normal draws, so rtol 2^-8 on top of atol 1e-2 (the softmax weights' share
    on O(1) outputs)."""
    oracle = StubOracle(attn_cfg(A.Hq, A.Hkv, A.D, A.rot), {"q_norm.weight": from_bf16(A.qn),
                                                           "k_norm.weight": from_bf16(A.kn)})
    oracle.proj = {"q_proj": qg.reshape(1, -1), "k_proj": k.reshape(1, -1), "v_proj": v.reshape(1, -1)}
    st = ReferenceState(max_context=A.cap, position=n - 1)
    st.keys[0], st.values[0] = K.copy(), V.copy()
    want = oracle.attention(0, np.zeros((1, 1), np.float32), st)[0]
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-2)


@pytest.mark.parametrize("dims", ["real", "tiny"])
def test_attention_prep_and_decode_vs_oracle(dev, dims):
    """attn_qk_prep + attn_decode (gate read straight from the q_proj output, stride 2*D)
    over a bf16 history vs ReferenceModel.attention. The reference keeps the new token's k/v
    in float32, the kernel in bf16 (relative rounding <= 2^-8): as _check_oracle."""
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
    _check_oracle(A, got, qg, k, v, K, V, n)


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
    Hkv, D = A.Hkv, A.D
    # the same float32 operations in the same order: equal bit for bit on the simulator
    assert_same_arithmetic(A.dev, got.reshape(-1, D), want_pair.reshape(-1, D), "fused vs prep + decode",
                           ulps=ATTN_CROSS_ULPS)
    kc_a, kc_b = download(A.KC, np.uint16, (Hkv, A.cap, D)), download(B.KC, np.uint16, (Hkv, A.cap, D))
    vc_a, vc_b = download(A.VC, np.uint16, (Hkv, A.cap, D)), download(B.VC, np.uint16, (Hkv, A.cap, D))
    assert_same_arithmetic(A.dev, kc_a, kc_b, "k cache: fused vs attn_qk_prep", stored="bf16")
    np.testing.assert_array_equal(vc_a, vc_b)  # v is stored as given: a copy
    np.testing.assert_array_equal(kc_a[:, : n - 1], A.k_hist[:, : n - 1])
    np.testing.assert_array_equal(vc_a[:, : n - 1], A.v_hist[:, : n - 1])
    np.testing.assert_array_equal(vc_a[:, n - 1], bf16_bits(v))
    assert np.isnan(from_bf16(kc_a[:, n:])).all()  # rows past pos untouched (still poisoned)
    # float64 attention over the cache as written (q from attn_qk_prep)
    want64 = attention_reference(Q, qg[:, D:], from_bf16(kc_a), from_bf16(vc_a), n, D)
    np.testing.assert_allclose(got, want64, rtol=2e-5, atol=2e-5)
    _check_oracle(A, got, qg, k, v, K, V, n)


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
    A.check_surplus()
    stages = [rec["stage"] for rec in cb.dispatch_log]
    # split: a step's split kernel shares the previous combine's stage (the row it reads was
    # appended one stage earlier), its combine waits for it
    assert stages == ([0, 1, 1, 2, 2, 3] if split else [0, 1, 2]), cb.dispatch_log
    for t, (qg, k, v) in enumerate(steps):
        pos = n0 - 1 + t
        B.set_position(pos)
        Qb, GATE = B.prep(qg, k, v, pos)
        want = B.decode(Qb, GATE, pos + 1, **({"split_threshold": 1, "block_rows": 16} if split else {}))
        assert_same_arithmetic(dev, download(outs[t][1], np.float32).reshape(-1, A.D), want.reshape(-1, A.D),
                               f"step {t}: fused vs prep + decode", ulps=ATTN_CROSS_ULPS)
    D = A.D
    assert_same_arithmetic(dev, download(A.KC, np.uint16).reshape(-1, D), download(B.KC, np.uint16).reshape(-1, D),
                           "k cache: fused vs attn_qk_prep", stored="bf16")
    np.testing.assert_array_equal(download(A.VC, np.uint16), download(B.VC, np.uint16))


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
        gdn_out.append((*G.step_encode(p, qkv, z, b, a, label=f"gdn step {t}"), z))
    QG, Kb, Vb = upload(dev, qg), upload(dev, k), upload(dev, v)
    Qo, GATE, OUT, TOK = dev.buffer(Hq * D * 4), dev.buffer(Hq * D * 4), dev.buffer(Hq * D * 4), dev.buffer(4)
    p.dispatch("attn_qk_prep", Hq + Hkv, D,
               buffers=[(0, QG), (1, Kb), (2, Vb), (3, A.QN), (4, A.KN), (5, A.POS), (6, A.KC), (7, A.VC),
                        (8, Qo), (9, GATE)],
               constants=[(10, pack_args("AttnPrepArgs", num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, rotary_dim=rot,
                                          capacity=A.cap, norm_eps=1e-6, log2_theta=float(np.log2(THETA))))],
               reads=[QG, Kb, Vb, A.QN, A.KN, A.POS], writes=[*A.cache_row_ranges(n - 1), Qo, GATE],
               threadgroups=True)
    rows = [(C, h * A.cap * 2 * D, n * 2 * D) for C in (A.KC, A.VC) for h in range(Hkv)]
    p.dispatch(_core.kernel_name("attn_decode", d=D, g=A.G), Hq // A.G, ATTN_TG,
               buffers=[(0, Qo), (1, GATE), (2, A.KC), (3, A.VC), (4, A.POS), (5, OUT)],
               constants=[(6, pack_args("AttnDecodeArgs", num_q_heads=Hq, num_kv_heads=Hkv, capacity=A.cap, gate_stride=D,
                                         scale=float(D) ** -0.5, block_rows=0, max_blocks=0))],
               reads=[Qo, GATE, A.POS, *rows], writes=[OUT], threadgroups=True)
    p.dispatch("sample_greedy", 1, SAMPLER_THREADS, buffers=[(0, OUT), (1, TOK)],
               constants=[(2, pack_args("SampleGreedyArgs", vocab=Hq * D))], reads=[OUT], writes=[TOK], threadgroups=True)
    cb.commit()
    cb.wait()
    # stages are derived in encoding order: gdn 0 | gdn 1 (state, conv) with prep beside it
    # (independent) | decode (reads the appended row) | greedy (reads the output)
    stages = [rec["stage"] for rec in cb.dispatch_log]
    assert stages == [0, 1, 1, 2, 3], cb.dispatch_log

    for (O_, SSQ, z), inp in zip(gdn_out, steps):
        np.testing.assert_allclose(G.normed(O_, SSQ, z), G.step_reference(*inp), rtol=1e-4, atol=1e-5)
    oracle = StubOracle(attn_cfg(Hq, Hkv, D, rot), {"q_norm.weight": from_bf16(A.qn),
                                                   "k_norm.weight": from_bf16(A.kn)})
    oracle.proj = {"q_proj": qg.reshape(1, -1), "k_proj": k.reshape(1, -1), "v_proj": v.reshape(1, -1)}
    st = ReferenceState(max_context=A.cap, position=n - 1)
    st.keys[0], st.values[0] = K.copy(), V.copy()
    want = oracle.attention(0, np.zeros((1, 1), np.float32), st)[0]
    got = download(OUT, np.float32)
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-2)
    assert download(TOK, np.uint32)[0] == int(np.argmax(got))
