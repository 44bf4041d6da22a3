"""Prefill attention kernels (metal/attention_prefill.metal, attention_prefill_tensor.metal) on
the Metal simulator.

attn_prefill_prep_d<D> (q/k RMSNorm, partial RoPE, bf16 K/V rows of the chunk appended to the
cache), attn_prefill_d<D>_g<G>[_tensor] (causal flash attention of the chunk over the cache,
gated) and the KV-split path attn_prefill_split_d<D>_g<G>[_tensor] + attn_prefill_combine_d<D>,
against their numpy twin (twins.attention_twin), float64 numpy attention,
lily.reference's rms_norm / rope / ReferenceModel.attention, and the decode kernels
(attn_qk_prep, attn_decode). The projections qg, k, v are fresh random bfloat values
(twins.chunk_inputs): the chunk kernels read them as bfloat, as q_proj, k_proj and v_proj
store them (gemm_q4_bf16), the decode kernels and the references as the same fp32 numbers.
Every output buffer starts poisoned (the simulator fills
new buffers with NaN) and cache rows past the chunk are NaN, so an element a kernel forgets
to write, or a row it reads past the causal range, fails the comparison. Shapes are chosen so
that M is not a multiple of the query block (64/G rows) and p0 + M is not a multiple of the
KV tile (32 rows).

Tolerances:
* prep vs attn_qk_prep (decode): the same float32 operations in the same order (same simd
  sums over the same 32 elements, partial sums added in the same order, the same frequency
  and angle expressions), so q and the cache rows are compared for exact equality on the
  simulator (a GPU compiler may contract differently: at most float32 rounding and a 1-ulp
  flip of a bf16 cache value).
* prep vs lily.reference (rms_norm, rope with float64 angles): the kernel's angles are
  float32 (as MLX): at position p the angle error is ~p * 2^-24 rad, so atol 1e-5 at
  positions <= 64 and 2e-3 up to a few thousand (values are O(1) after RMSNorm), rtol 1e-5.
  Cache rows: the bf16 rounding of the reference, with one bf16 ulp (rtol 2^-7) where a
  float32 difference can flip the rounding.
* attention vs twins.attention_twin (the numpy twin) over the cache as written: both paths
  run Q K^T and P V on bf16 operands with fp32 accumulation (as MLX's NAX attention: nothing
  is converted, nothing clipped); the twin rounds q * scale and P to bf16 as the kernels do,
  takes K/V as they are, sums each score in fp32 in the simulator's order over D (every
  product is exact in fp32), walks the keys in the kernels' 32-row tiles (per split) with
  their lazy rescale threshold; the rest in float64: rtol/atol 2e-5 on the simulator
  (measured <= 2.7e-7). On a GPU the score sums run in another order and a P value may round
  to the neighbouring bf16 value: ATTN_ATOL (2^-7 of a weight).
* the twin vs float64 attention (and split vs plain, and prefill vs the fp32 decode kernel):
  the bf16 rounding of q and P, measured <= 5.4e-3 on O(1) outputs with |v| < 5; BF16_ATOL
  3.2e-2 (8x the 4e-3 of the half operands before: 3 significant bits fewer). Split vs plain
  differ because each split keeps its own reference max, so P rounds differently.
* tensor-op vs simdgroup kernels on the same inputs: the same bf16 operands, tiles and
  softmax, but the tensor kernels split D over two simdgroups (as MLX's attention_nax_dsplit)
  and add the halves' fp32 sums, so a score may differ by fp32 rounding and a P value round to
  its bf16 neighbour: BF16_ATOL (the twin models the halves: ``halves=True``, 2e-5).
* prep + attention vs ReferenceModel.attention: the oracle keeps the chunk's k/v in float32,
  the cache holds them in bf16 (relative rounding <= 2^-8): rtol 2^-8 plus atol 1e-2 (as
  decode: a row that attends mostly to its own v is off by up to 2^-8 of itself, |v| ~5),
  plus the operand rounding: atol 1e-2 + BF16_ATOL.
* attn_prefill_prep_d<D>_qbf vs the fp32 prep: exactly pack_bf16_q of its q (bf16 rounding
  of q * scale in fp32, nearest even), and the same cache rows. These, and the prefill prep
  vs the decode prep (attn_qk_prep) row by row, are different kernels doing the same float32
  operations: bit for bit on the simulator, within a few ulps on a GPU
  (harness.assert_same_arithmetic: a GPU compiler may contract each kernel differently).
* a chunk of M rows vs M one-row chunks: every (row, head) sees the same KV tiles in the same
  order, extra fully masked tiles contribute exact zeros (and an exact identity rescale), and
  rows of the query matrix are independent in the products, so the results agree to float32
  rounding (asserted: rtol 1e-6, atol 1e-7; measured bit-identical on the simulator); the
  caches and q are equal bit for bit (the same prep kernel, whose rows do not depend on M).
* one-row prefill chunk vs attn_decode (fp32) at the same position: BF16_ATOL.
* the kernels store their output as bfloat (o_proj's input; the split partials stay fp32):
  every comparison with an unrounded value (the twin, float64, decode) adds the rounding,
  rtol 2^-8 (OUT_RTOL), two kernel outputs rtol 2^-7; nothing is clipped (values beyond
  +-65504 in the cache, the projections and the output stay what they are).

Kernel correctness tests run in three simulator modes (fixture ``dev``): forward order,
reverse thread/threadgroup order with undeclared-read detection, random order; all with
out-of-range write detection. The real-size case runs in forward order only (time budget).
"""

from __future__ import annotations

import types

import numpy as np
from seeding import fresh_rng
from harness import ORDERS, THREAD_ORDERS, assert_same_arithmetic, bf16_bits, from_bf16, f32  # noqa: F401
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import download, pack_args, sim_device, upload  # noqa: E402
from lily.reference import ReferenceModel, ReferenceState, round_bf16  # noqa: E402
# the layer harness and float64 references live with lily doctor's kernel checks (one home)
from lily.lab.kernels import attention_prefill as twins  # noqa: E402
from lily.lab.kernels.attention import ATTN_TG, THETA  # noqa: E402,F401
from lily.lab.kernels.attention_prefill import (  # noqa: E402,F401
    TILE, attention64, attention_twin, chunk_inputs, pack_bf16_q, prep_reference,
)
from lily.lab.kernels.harness import HALF_MAX  # noqa: E402,F401
from lily.lab.kernels.attention_prefill import PREFILL_EPS as EPS  # noqa: E402


# bf16 operands vs float64 attention (module docstring): measured <= 5.4e-3 on these shapes
# (|v| < 5); the rounding errors of q and P are independent and average out over D and the
# keys, so a statistical margin of ~6x.
BF16_ATOL = twins.ATTN_ATOL
# the output stored as bfloat (o_proj's input): one rounding, <= 2^-8 relative
OUT_RTOL = twins.ATTN_OUT_RTOL


def twin_tol(dev):
    """Kernel vs attention_twin: on the simulator the same fp32 operations in the same order
    (float32 accumulation vs the twin's float64: 2e-5); on a GPU the score sums run in
    another order, so a P value may round to the neighbouring bf16 value (up to 2^-7 of a
    weight): twins' ATTN_ATOL. Both plus the bfloat store of the output (OUT_RTOL, relative)."""
    if dev.name == "sim":
        return dict(rtol=2e-5 + OUT_RTOL, atol=2e-5)
    return dict(rtol=OUT_RTOL, atol=BF16_ATOL)


class Layer(twins.PrefillAttnLayer):
    """twins.PrefillAttnLayer on fresh random weights (tests/seeding.py)."""

    def __init__(self, dev, dims, capacity, seed, *, G=None, history=None):
        super().__init__(dev, dims, capacity, G=G, history=history, rng=fresh_rng(seed))


# ------------------------------------------------------------------------------ helpers

def attn_cfg(Hq, Hkv, D, rot):
    return types.SimpleNamespace(num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D,
                                 rotary_dim=rot, rope_theta=THETA, rms_norm_eps=EPS)


class StubOracle(ReferenceModel):
    """ReferenceModel.attention with given projection outputs (``proj``) and norm weights;
    ``o_proj`` returns its input, so the mixer returns the gated attention output."""

    def __init__(self, cfg, params, proj):  # noqa: D401  (no checkpoint)
        self.cfg = cfg
        self._act = lambda a: a.astype(np.float32, copy=False)
        self.params, self.proj = params, proj

    def param(self, name):
        return self.params[name.rsplit(".", 2)[-2]]

    def linear(self, x, module):
        name = module.rsplit(".", 1)[-1]
        return x.astype(np.float32) if name == "o_proj" else self.proj[name]


def decode_prep(L, qg, k, v, pos):
    """attn_qk_prep (the decode kernel) for one row at position pos on layer L; q [Hq, D]."""
    Hq, Hkv, D = L.Hq, L.Hkv, L.D
    QG, K, V = upload(L.dev, qg.reshape(Hq, 2 * D)), upload(L.dev, k), upload(L.dev, v)
    POS = upload(L.dev, np.array([pos], np.uint32))
    Q, GATE = L.dev.buffer(Hq * D * 4), L.dev.buffer(Hq * D * 4)
    args = pack_args("AttnPrepArgs", num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, rotary_dim=L.rot, capacity=L.cap,
                     norm_eps=EPS, log2_theta=float(np.log2(THETA)))
    L.run(lambda p: p.dispatch(
        "attn_qk_prep", Hq + Hkv, D,
        buffers=[(0, QG), (1, K), (2, V), (3, L.QN), (4, L.KN), (5, POS), (6, L.KC), (7, L.VC),
                 (8, Q), (9, GATE)],
        constants=[(10, args)], reads=[QG, K, V, L.QN, L.KN, POS],
        writes=[*L.rows(pos, pos + 1), Q, GATE], threadgroups=True))
    return download(Q, np.float32, (Hq, D))


# ------------------------------------------------------------------------------ prep

@pytest.mark.parametrize("dims", ["real", "tiny"])
@pytest.mark.parametrize("p0,M", [(0, 1), (0, 13), (37, 9), (4000, 5)])
def test_attn_prefill_prep(dev, dims, p0, M):
    """q and cache rows p0 .. p0+M-1 vs lily.reference, and what the decode kernel
    attn_qk_prep writes row by row (harness.assert_same_arithmetic); every other cache row
    untouched."""
    cap = p0 + M + 7
    A = Layer(dev, dims, cap, seed=p0 + M)
    B = Layer(dev, dims, cap, seed=p0 + M)  # same weights and history
    qg, k, v = chunk_inputs(fresh_rng(1, p0, M), M, A.Hq, A.Hkv, A.D)
    QG, K, V = A.input_buffers(qg, k, v)
    _, Q = A.run(lambda p: A.encode_prep(p, QG, K, V, p0, M))
    q = download(Q, np.float32, (M, A.Hq, A.D))
    kc, vc = A.cache()

    q_ref, k_ref = prep_reference(A, qg, k, p0)
    atol = 1e-5 if p0 + M <= 65 else 2e-3
    np.testing.assert_allclose(q, q_ref, rtol=1e-5, atol=atol)
    chunk = slice(p0, p0 + M)
    np.testing.assert_array_equal(vc[:, chunk], bf16_bits(v.reshape(M, A.Hkv, A.D)).transpose(1, 0, 2))
    np.testing.assert_allclose(from_bf16(kc[:, chunk]), round_bf16(k_ref).transpose(1, 0, 2),
                               rtol=2 ** -7, atol=atol)
    others = np.ones(cap, bool)
    others[chunk] = False
    np.testing.assert_array_equal(kc[:, others], A.k_hist[:, others])
    np.testing.assert_array_equal(vc[:, others], A.v_hist[:, others])

    # the decode kernel, one row at a time, on the twin layer: the same q and caches (bit for
    # bit on the simulator, within a few ulps on a GPU: harness.assert_same_arithmetic)
    for i in range(M):
        qd = decode_prep(B, qg[i], k[i], v[i], p0 + i)
        assert_same_arithmetic(dev, q[i], qd, f"q row {i}: attn_prefill_prep vs attn_qk_prep")
    kb, vb = B.cache()
    assert_same_arithmetic(dev, kc, kb, "k cache: attn_prefill_prep vs attn_qk_prep", stored="bf16")
    np.testing.assert_array_equal(vc, vb)  # v is stored as given: a copy


@pytest.mark.parametrize("dims,G", [("real", 8), ("real", 2), ("tiny", 2)])
@pytest.mark.parametrize("p0,M", [(0, 13), (37, 9)])
def test_attn_prefill_prep_bf16_q(dev, dims, G, p0, M):
    """attn_prefill_prep_d<D>_qbf (the tensor-op attention's query operand) writes exactly
    pack_bf16_q of the fp32 variant's q: q * scale rounded to bf16 in the [Hq / G, M, G, D]
    layout, q elements beyond the half range (a large q_norm weight) included (bf16 has fp32's
    range: no clamp), and the same cache rows (harness.assert_same_arithmetic)."""
    cap = p0 + M + 5
    A = Layer(dev, dims, cap, seed=p0 + M, G=G)
    B = Layer(dev, dims, cap, seed=p0 + M, G=G)  # same weights and history
    for L in (A, B):  # q element 3 of every head ~ +-1e7 * N(0, 1) before the scale: mostly beyond half
        L.qn[3] = bf16_bits(np.array([1e7]))[0]
        L.QN.write(L.qn.view(np.uint8).reshape(-1))
    B.tensor = True
    qg, k, v = chunk_inputs(fresh_rng(8, p0, M), M, A.Hq, A.Hkv, A.D)
    QG, K, V = A.input_buffers(qg, k, v)
    _, Q = A.run(lambda p: A.encode_prep(p, QG, K, V, p0, M))
    _, QB = B.run(lambda p: B.encode_prep(p, QG, K, V, p0, M))
    q = download(Q, np.float32, (M, A.Hq, A.D))
    qb = download(QB, np.uint16, (A.Hq // G, M, G, A.D))
    assert (np.abs(q[:, :, 3]) * A.D ** -0.5 > 2 * HALF_MAX).any()  # values half could not hold
    assert_same_arithmetic(dev, qb, pack_bf16_q(q, G), "q: attn_prefill_prep _qbf vs fp32", stored="bf16")
    kc, vc = A.cache()
    kb, vb = B.cache()
    assert_same_arithmetic(dev, kc, kb, "k cache: attn_prefill_prep _qbf vs fp32", stored="bf16")
    np.testing.assert_array_equal(vc, vb)  # v is stored as given: a copy


# ------------------------------------------------------------------------------ attention

def _attn_case(dev, dims, G, p0, M, seed):
    """A layer with random bf16 cache rows [0, p0 + M) (NaN beyond), random q and random bfloat qg."""
    L = Layer(dev, dims, p0 + M + 9, seed=seed, G=G)
    L.poison_from(p0 + M)
    r = fresh_rng(2, seed)
    q = f32(r.standard_normal((M, L.Hq, L.D)))
    qg = chunk_inputs(r, M, L.Hq, L.Hkv, L.D)[0]
    kc, vc = L.cache()
    return L, q, qg, from_bf16(kc), from_bf16(vc)


# every (D, G) instantiation: D = 256 with G = 8 (the model), 4, 2; D = 64 with 8, 4, 2
DG = [("real", 8), ("real", 4), ("real", 2), ("dims", 8), ("wide64", 8), ("wide64", 4),
      ("wide64", 2), ("tiny", 2)]


# (61, 70): several KV tiles, a block boundary inside a tile, the last tile partial (for the
# model's G = 8 and the tiny preset's G = 2 only: time budget)
CASES = [(dims, G, p0, M) for dims, G in DG for p0, M in [(0, 1), (0, 37), (29, 19)]] + \
    [("real", 8, 61, 70), ("tiny", 2, 61, 70)]


@pytest.mark.parametrize("dims,G,p0,M", CASES)
def test_attn_prefill(dev, dims, G, p0, M):
    """vs the bf16-rounding twin (tight) and float64 attention (the bf16-rounding bound)."""
    L, q, qg, K, V = _attn_case(dev, dims, G, p0, M, seed=100 * G + p0 + M)
    got = L.attention_only(q, qg, p0)
    twin = attention_twin(q, qg, K, V, p0)
    np.testing.assert_allclose(got, twin, **twin_tol(dev))
    np.testing.assert_allclose(twin, attention64(q, qg, K, V, p0), rtol=0, atol=BF16_ATOL)


# (p0, M, S, num_splits): S a multiple of the tile and not, smaller than a tile too; surplus
# splits (past the last row, they must write nothing the combine reads); a short chunk after
# a longer prefix
SPLITS = [(0, 37, 16, 3), (29, 19, 20, 4), (100, 5, 24, 6), (70, 9, 64, 2)]
# every split shape for the model's (D, G) and the tiny preset's; one for the other
# instantiations (the split geometry does not depend on G; time budget under ASan)
SPLIT_CASES = [(dims, G, *s) for dims, G in [("real", 8), ("tiny", 2)] for s in SPLITS] + \
    [(dims, G, *SPLITS[1]) for dims, G in [("real", 4), ("real", 2), ("wide64", 8), ("wide64", 4)]]


@pytest.mark.parametrize("dims,G,p0,M,S,ns", SPLIT_CASES)
def test_attn_prefill_split(dev, dims, G, p0, M, S, ns):
    """attn_prefill_split + attn_prefill_combine vs the twin with the same splits, and vs
    attn_prefill (each split has its own reference max, so P rounds differently: the
    bf16-rounding bound)."""
    L, q, qg, K, V = _attn_case(dev, dims, G, p0, M, seed=7 * G + p0 + S)
    got = L.attention_only(q, qg, p0, split=(S, ns))
    np.testing.assert_allclose(got, attention_twin(q, qg, K, V, p0, split_rows=S), **twin_tol(dev))
    plain = L.attention_only(q, qg, p0)
    np.testing.assert_allclose(got, plain, rtol=2 * OUT_RTOL, atol=BF16_ATOL)


# ------------------------------------------------------------------------------ prep + attention

def _oracle(L, qg, k, v, K_prefix, V_prefix, p0):
    """ReferenceModel.attention on the chunk with a float32 copy of the bf16 prefix."""
    M = qg.shape[0]
    oracle = StubOracle(attn_cfg(L.Hq, L.Hkv, L.D, L.rot),
                        {"q_norm": from_bf16(L.qn), "k_norm": from_bf16(L.kn)},
                        {"q_proj": qg, "k_proj": k, "v_proj": v})
    st = ReferenceState(max_context=L.cap, position=p0)
    st.keys[0], st.values[0] = K_prefix.copy(), V_prefix.copy()
    return oracle.attention(0, np.zeros((M, 1), np.float32), st)


@pytest.mark.parametrize("dims", ["real", "tiny"])
@pytest.mark.parametrize("p0,M,split", [(0, 21, None), (45, 11, None), (45, 11, (16, 4))])
def test_prefill_chunk_vs_oracle(dev, dims, p0, M, split):
    """prep + attention of a chunk in one concurrent pass (the attention waits for the KV
    append: one barrier, derived from the declared ranges) against ReferenceModel.attention,
    and against float64 attention over the cache as written."""
    L = Layer(dev, dims, p0 + M + 5, seed=p0 + 3 * M)
    L.poison_from(p0)  # rows >= p0: NaN until the prep writes them
    K0, V0 = (from_bf16(c) for c in L.cache())
    qg, k, v = chunk_inputs(fresh_rng(3, p0, M), M, L.Hq, L.Hkv, L.D)
    got, q, cb = L.prefill(qg, k, v, p0, split=split)
    assert [r["stage"] for r in cb.dispatch_log] == ([0, 1] if split is None else [0, 1, 2])
    kc, vc = L.cache()
    S = None if split is None else split[0]
    np.testing.assert_allclose(got, attention_twin(q, qg, from_bf16(kc), from_bf16(vc), p0, split_rows=S),
                               **twin_tol(dev))
    assert np.isnan(from_bf16(kc[:, p0 + M:])).all()  # rows past the chunk still poisoned
    want = _oracle(L, qg, k, v, np.nan_to_num(K0), np.nan_to_num(V0), p0)
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-2 + BF16_ATOL)


@pytest.mark.parametrize("dims", ["real", "wide64", "tiny"])
def test_chunk_equals_single_row_chunks(dev, dims):
    """A chunk of M rows at p0 gives the outputs of M one-row chunks at p0, p0+1, ...
    (up to summation-order rounding) and leaves the same cache bit for bit."""
    p0, M = 23, 11
    A = Layer(dev, dims, p0 + M + 3, seed=11)
    A.poison_from(p0)
    B = Layer(dev, dims, p0 + M + 3, seed=11, history=(A.k_hist, A.v_hist))
    qg, k, v = chunk_inputs(fresh_rng(4), M, A.Hq, A.Hkv, A.D)
    got, q, _ = A.prefill(qg, k, v, p0)
    for i in range(M):
        row, qrow, _ = B.prefill(qg[i:i + 1], k[i:i + 1], v[i:i + 1], p0 + i)
        np.testing.assert_array_equal(qrow[0], q[i])
        np.testing.assert_allclose(row[0], got[i], rtol=1e-6, atol=1e-7)
    for a, b in zip(A.cache(), B.cache()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dims", ["real", "tiny"])
def test_one_row_chunk_matches_decode(dev, dims):
    """After a prefill chunk, a one-row prefill chunk at position n equals the decode step
    (attn_qk_prep + attn_decode) at n: the same cache row bit for bit, the same output up to
    summation order."""
    p0, M = 0, 40
    A = Layer(dev, dims, 48, seed=12)
    A.poison_from(0)
    qg, k, v = chunk_inputs(fresh_rng(5), M + 1, A.Hq, A.Hkv, A.D)
    A.prefill(qg[:M], k[:M], v[:M], p0)
    B = Layer(dev, dims, 48, seed=12, history=A.cache())
    got, _, _ = A.prefill(qg[M:], k[M:], v[M:], M)
    # decode on the twin: prep at position M, then attention over rows [0, M]
    q = decode_prep(B, qg[M], k[M], v[M], M)
    Hq, D = B.Hq, B.D
    G = min(4, Hq // B.Hkv)
    Q, QG = upload(B.dev, q), upload(B.dev, qg[M])
    POS = upload(B.dev, np.array([M], np.uint32))
    OUT = B.dev.buffer(Hq * D * 4)
    B.run(lambda p: p.dispatch(
        _core.kernel_name("attn_decode", d=D, g=G), Hq // G, ATTN_TG,
        buffers=[(0, Q), (1, QG, 4 * D), (2, B.KC), (3, B.VC), (4, POS), (5, OUT)],
        constants=[(6, pack_args("AttnDecodeArgs", num_q_heads=Hq, num_kv_heads=B.Hkv, capacity=B.cap, gate_stride=2 * D,
                                  scale=float(D) ** -0.5, block_rows=0, max_blocks=0))],
        reads=[Q, (QG, 4 * D, Hq * 2 * D * 4 - 4 * D), *B.rows(0, M + 1), POS], writes=[OUT],
        threadgroups=True))
    np.testing.assert_allclose(got[0], download(OUT, np.float32), rtol=OUT_RTOL, atol=BF16_ATOL)
    for a, b in zip(A.cache(), B.cache()):
        np.testing.assert_array_equal(a, b)


def test_consecutive_chunks_in_one_pass(dev):
    """Two chunks (rows [0, 19) then [19, 32)) encoded into one concurrent pass: the declared
    ranges alone order them (chunk 2's attention reads the rows chunk 1 appended; chunk 2's
    prep writes rows chunk 1's attention does not read, so it shares that stage), and the
    results equal the two chunks run one by one."""
    dims, M1, M2 = "tiny", 19, 13
    A = Layer(dev, dims, 40, seed=13)
    A.poison_from(0)
    B = Layer(dev, dims, 40, seed=13, history=(A.k_hist, A.v_hist))
    chunks = [chunk_inputs(fresh_rng(6, i), m, A.Hq, A.Hkv, A.D) for i, m in enumerate((M1, M2))]
    cb = dev.command_buffer()
    p = cb.compute_pass()
    outs, p0 = [], 0
    for t, (qg, k, v) in enumerate(chunks):
        M = qg.shape[0]
        QG, K, V = A.input_buffers(qg, k, v)
        Q = A.encode_prep(p, QG, K, V, p0, M, label=f"prep {t}")
        outs.append(A.encode_attn(p, Q, QG, p0, M, label=f"attn {t}"))
        p0 += M
    cb.commit()
    cb.wait()
    assert [r["stage"] for r in cb.dispatch_log] == [0, 1, 1, 2], cb.dispatch_log
    p0 = 0
    for t, (qg, k, v) in enumerate(chunks):
        want, _, _ = B.prefill(qg, k, v, p0)
        np.testing.assert_array_equal(A.download_out(outs[t], qg.shape[0]), want)
        p0 += qg.shape[0]
    for a, b in zip(A.cache(), B.cache()):
        np.testing.assert_array_equal(a, b)


def test_real_size_chunk(fwd_dev):
    """One larger case at the model's dimensions (16 q / 2 KV heads of 256, G = 8): a chunk of
    50 rows after a 200-row prefix, plain and split (3 splits of 96 rows), vs float64."""
    p0, M = 200, 50
    L, q, qg, K, V = _attn_case(fwd_dev, "real", 8, p0, M, seed=14)
    np.testing.assert_allclose(L.attention_only(q, qg, p0), attention_twin(q, qg, K, V, p0),
                               **twin_tol(fwd_dev))
    np.testing.assert_allclose(L.attention_only(q, qg, p0, split=(96, 3)),
                               attention_twin(q, qg, K, V, p0, split_rows=96), **twin_tol(fwd_dev))


# ------------------------------------------------------------------------------ tensor-op path

#: Cooperative-tensor layouts of the simulator: "sim", an adversarial one (the tensor kernels
#: keep scores and P in threadgroup memory), and "nax", the fragment layout of M5's tensor ops
#: (scores and P in registers: attend_tensor's check holds; docs/prefill.md, "Attention").
LAYOUTS = ("sim", "nax")


@pytest.fixture(scope="module", params=[(o, lay) for lay in LAYOUTS for o in ORDERS],
                ids=lambda p: "-".join(p))
def tdev(request):
    """The simulator as an apple10 GPU (M5: the *_tensor kernels exist) in each mode of ORDERS
    (the hazard checker on), with each cooperative-tensor layout of LAYOUTS."""
    order, layout = request.param
    return sim_device(gpu_family="apple10", tensor_layout=layout, **THREAD_ORDERS[order])


@pytest.mark.parametrize("dims,G,p0,M,split", [
    ("real", 8, 0, 1, None), ("real", 8, 61, 70, None), ("real", 8, 29, 19, (20, 4)), ("real", 2, 100, 5, (64, 2)),
    ("real", 4, 0, 37, None), ("wide64", 4, 29, 19, (20, 4)), ("tiny", 2, 61, 70, None), ("tiny", 2, 100, 5, (24, 6))])
def test_attn_prefill_tensor(tdev, dims, G, p0, M, split):
    """attn_prefill[_split]_d<D>_g<G>_tensor (+ combine) vs the bf16-operand twin with the
    tensor kernels' score sums (each half of D in order, the halves added: ``halves``; the
    same tolerance on the simulator), the twin vs float64 attention (BF16_ATOL), and the
    simdgroup kernels on the same inputs: the same bf16 operands, the scores summed in
    another order, so a P value may round to its bf16 neighbour (BF16_ATOL)."""
    L, q, qg, K, V = _attn_case(tdev, dims, G, p0, M, seed=13 * G + p0 + M)
    S = None if split is None else split[0]
    L.tensor = True
    got = L.attention_only(q, qg, p0, split=split)
    twin = attention_twin(q, qg, K, V, p0, split_rows=S, halves=True)
    np.testing.assert_allclose(got, twin, **twin_tol(tdev))
    np.testing.assert_allclose(twin, attention64(q, qg, K, V, p0), rtol=0, atol=BF16_ATOL)
    L.tensor = False
    np.testing.assert_allclose(got, L.attention_only(q, qg, p0, split=split), rtol=2 * OUT_RTOL, atol=BF16_ATOL)


def test_prefill_chunk_tensor_vs_oracle(tdev):
    """prep + the tensor-op attention in one pass vs the twin and ReferenceModel.attention."""
    p0, M = 45, 11
    L = Layer(tdev, "real", p0 + M + 5, seed=p0 + 5 * M)
    L.tensor = True
    L.poison_from(p0)
    K0, V0 = (from_bf16(c) for c in L.cache())
    qg, k, v = chunk_inputs(fresh_rng(7, p0, M), M, L.Hq, L.Hkv, L.D)
    got, q, _ = L.prefill(qg, k, v, p0)
    kc, vc = L.cache()
    np.testing.assert_allclose(got, attention_twin(q, qg, from_bf16(kc), from_bf16(vc), p0, halves=True),
                               **twin_tol(tdev))
    want = _oracle(L, qg, k, v, np.nan_to_num(K0), np.nan_to_num(V0), p0)
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-2 + BF16_ATOL)


# ------------------------------------------------------------------------------ beyond the half range

def _beyond_half(L, p0, M):
    """Cache values beyond the half range (|x| > 65504; bf16 holds up to ~3.4e38): V row 5 of
    KV head 0 all 1e6 (and row 6 exactly 65536, the first bf16 above half's maximum), K
    elements of rows 2 and p0 + M - 1 at +-3e5. Returns the float K, V."""
    big = bf16_bits(np.array([1e6, 65536.0, 3e5, -3e5]))
    L.v_hist[0, 5], L.v_hist[0, 6] = big[0], big[1]
    L.k_hist[:, 2, :4] = big[2]
    L.k_hist[:, p0 + M - 1, 4:8] = big[3]
    L.KC.write(L.k_hist.view(np.uint8).reshape(-1))
    L.VC.write(L.v_hist.view(np.uint8).reshape(-1))
    return tuple(from_bf16(c) for c in L.cache())


def _check_large_values(d, tensor, dims, G, p0, M, split):
    """Finite outputs equal to the twin on the cache as it is (bf16 operands hold it on both
    paths: nothing is clipped), away from the twin on a cache clamped to +-65504 (what the
    half operands of the simdgroup kernels did), some beyond the half range."""
    L, q, qg, _, _ = _attn_case(d, dims, G, p0, M, seed=17 * G + p0 + M)
    L.tensor = tensor
    K, V = _beyond_half(L, p0, M)
    got = L.attention_only(q, qg, p0, split=split)
    assert np.isfinite(got).all()
    S = None if split is None else split[0]
    want = attention_twin(q, qg, K, V, p0, split_rows=S, halves=tensor)
    assert np.abs(want).max() > 1000  # rows attending to the large V rows see them
    clamped = attention_twin(q, qg, np.clip(K, -HALF_MAX, HALF_MAX), np.clip(V, -HALF_MAX, HALF_MAX), p0,
                             split_rows=S, halves=tensor)
    assert np.abs(want - clamped).max() > 100
    np.testing.assert_allclose(got, want, **twin_tol(d))


LARGE = [("real", 8, 29, 19, None), ("real", 8, 29, 19, (20, 4)), ("tiny", 2, 61, 70, None)]


@pytest.mark.parametrize("dims,G,p0,M,split", LARGE)
def test_attn_prefill_large_values(dev, dims, G, p0, M, split):
    """A K/V cache value beyond the half range is taken as it is by the simdgroup kernels'
    bfloat tiles (no conversion, no clamp): finite outputs equal to the twin."""
    _check_large_values(dev, False, dims, G, p0, M, split)


@pytest.mark.parametrize("dims,G,p0,M,split", LARGE)
def test_attn_prefill_tensor_large_values(tdev, dims, G, p0, M, split):
    """The tensor-op kernels take the same cache values as bf16 operands as they are: finite
    outputs equal to the bf16 twin on the unclamped cache."""
    _check_large_values(tdev, True, dims, G, p0, M, split)


# ------------------------------------------------------------------------------ large projections

def _check_large_projections(d, tensor):
    """q_proj and k_proj outputs beyond the half range, as gemm_q4_bf16 stores them (bfloat:
    kept): a quarter of the elements of qg (query and gate) and k at +-1e5. The prep's
    RMSNorm stays finite (sum of squares <= D * 1e10 in fp32) and its q matches
    lily.reference on the same values (the normed elements are O(2): atol 1e-4); a gate of
    -1e5 zeroes its output element (sigmoid = 0), +1e5 passes it; the output matches the twin
    over the cache as written."""
    p0, M = 29, 19
    L = Layer(d, "real", p0 + M + 5, seed=19 + tensor)
    L.tensor = tensor
    L.poison_from(p0)
    r = fresh_rng(9, tensor)
    qg, k, v = chunk_inputs(r, M, L.Hq, L.Hkv, L.D)
    for x in (qg, k):
        big = r.random(x.shape) < 0.25
        x[big] = round_bf16(np.where(r.random(big.sum()) < 0.5, -1e5, 1e5))
    got, q, _ = L.prefill(qg, k, v, p0)
    assert np.isfinite(got).all() and np.isfinite(q).all()
    q_ref, _ = prep_reference(L, qg, k, p0)
    np.testing.assert_allclose(q, q_ref, rtol=2 ** -7 if tensor else 1e-5, atol=1e-4)
    kc, vc = L.cache()
    want = attention_twin(q, qg, from_bf16(kc), from_bf16(vc), p0, halves=tensor)
    np.testing.assert_allclose(got, want, **twin_tol(d))
    gate = qg.reshape(M, L.Hq, 2 * L.D)[:, :, L.D:].reshape(M, -1)
    assert (got[gate < -HALF_MAX] == 0).all() and (got[gate > HALF_MAX] != 0).any()


def test_prefill_reads_large_projections(dev):
    _check_large_projections(dev, False)


def test_prefill_tensor_reads_large_projections(tdev):
    _check_large_projections(tdev, True)


# ---- which path the tensor-op attention takes (attn_layout_probe_d<D>_tensor, tensor_attention_path) --

@pytest.mark.parametrize("D", [256, 64])
def test_attention_path_tensor_registers_on_the_fragment_layout(D):
    """On the simulator with the M5's fragment layout (tensor_layout="nax") every lane's
    scores, P and O tensors hold it: the register path, and the probe's records are consistent
    (its doctor check)."""
    dev = sim_device(gpu_family="apple10", tensor_layout="nax")
    got = twins.tensor_attention_path(dev, D)
    assert got["path"] == "registers" and got["mismatch"] is None, got
    assert "in registers" in got["detail"]
    assert twins._attn_layout_probe(dev, None, f"attn_layout_probe_d{D}_tensor") == 0.0


def test_attention_path_tensor_threadgroup_memory_names_the_mismatch():
    """With the simulator's own (adversarial) layout the threadgroup-memory path, naming the
    first slot that differs: tensor, lane, slot, what it holds and what the layout puts there,
    as the probe recorded them."""
    dev = sim_device(gpu_family="apple10")
    got = twins.tensor_attention_path(dev)
    assert got["path"] == "threadgroup memory", got
    mm = got["mismatch"]
    assert mm["tensor"] in twins.LAYOUT_TENSORS and 0 <= mm["lane"] < 32 and mm["slot"] is not None
    assert mm["holds"] != mm["layout"]
    slots, _ = twins.layout_probe(dev)
    rec = slots[twins.LAYOUT_TENSORS.index(mm["tensor"]), mm["lane"], mm["slot"]]
    assert (tuple(rec[1:3]) if rec[0] == 1 else None) == mm["holds"]
    assert (tuple(rec[3:5]) if rec[3] >= 0 else None) == mm["layout"]
    where = f"the {mm['tensor']} tensor's slot {mm['slot']} of lane {mm['lane']} holds"
    assert where in got["detail"] and "the fragment layout puts" in got["detail"]
    assert twins._attn_layout_probe(dev, None, "attn_layout_probe_d256_tensor") == 0.0


def test_attention_path_tensor_simdgroup_without_tensor_ops():
    """apple9 (no tensor ops): the simdgroup path, saying why, without dispatching the probe."""
    got = twins.tensor_attention_path(sim_device(gpu_family="apple9"))
    assert got["path"] == "simdgroup" and "no bfloat tensor ops" in got["detail"], got
