"""Gated DeltaNet prefill kernels (metal/gdn_prefill.metal) on the Metal simulator.

``gdn_conv_chunk`` (causal depthwise conv + SiLU over a chunk, conv state carried in and out,
possibly in place) and ``gdn_scan_k{Dk}_v{Dv}`` (L2 norms, gates, delta rule with the
recurrent state in registers, gated RMSNorm) against numpy references built from
``lily.reference`` (its ``silu``, ``sigmoid``, ``l2_norm`` and, for the whole layer,
``ReferenceModel.gated_deltanet`` itself with the projections stubbed), and against the decode
kernel ``gdn_decode_step`` run token by token. Inputs are fresh random draws per run
(``fresh_rng``). Every output buffer starts poisoned (NaN); chunk buffers are allocated for
more rows than the chunk uses and only the chunk's rows are declared, so a read or write
past row M is caught (``verify_reads`` / ``verify_writes``).

Tolerances:
* conv vs float64: four products and a sum in float32 (error <= 4 u sum|w x|, u = 2^-24),
  then SiLU (exp and a division, a few ulps of the result, its slope is at most 1.1): each
  output within ``2^-20 * (sum_j |w_j x_j| + |out|)``. The new conv state is a copy: exact.
* scan vs float64: per token the kernel does float32 dot products over Dk and Dv <= 128 terms
  (q, k unit norm, |S| <= ~1). An output o = y / rms(y) * w * silu(z) inherits the rounding of
  y = S q relative to its terms sum_k |S_vk q_k|, amplified by the cancellation factor
  kappa = rms_v(sum_k |S_vk q_k|) / rms_v(y_v) (up to ~200 on the tiny preset, where Dk = 32
  and a fresh state is rank one), plus the relative error of rms(y). So each output must be
  within ``64 u kappa (|o| + |w silu(z)|)`` (u = 2^-24; measured <= 10 u kappa (...) over
  many seeds). The state update S -> g S (I - beta k k^T) + ... is non-expansive (unit-norm
  k, beta in (0, 1)) and damped by g < 1 (typically 0.6 .. 0.97 with these A_log and
  dt_bias, as in the model), so a state error stays within a few per-step roundings /
  (1 - g) however long the chunk: the state within ``1e-5`` absolute (~170 u at |S| ~ 1;
  measured <= 1e-6). The drift tests (384 tokens in six chunks at Dk = Dv = 128, 504
  tokens in three chunks at 32) check the same bounds after every chunk.
* conv + scan vs ``ReferenceModel.gated_deltanet`` (the float32 oracle, which also sums the
  conv taps in another order): both sides round, so twice the float64 bounds (128 u kappa
  (...) and 2e-5); the conv state exactly.
* against ``gdn_decode_step``: the prefill kernels perform the decode step's float32
  operations in the same order with the same simd_sum reductions, so on the simulator M
  tokens of a chunk equal M decode steps exactly (outputs, recurrent state, conv state); so
  do two chunks and one chunk of the same tokens. (A GPU compiler may contract differently
  in two kernels; exactness is a simulator property.)

Correctness tests run in three simulator modes (fixture ``dev``): forward order, reverse
thread/threadgroup order with undeclared-read detection, random order; all with
out-of-range write detection. The long drift run uses the forward order only.
"""

from __future__ import annotations


import numpy as np
from seeding import fresh_rng
from harness import ORDERS, THREAD_ORDERS, bf16_bits, from_bf16, f32, args_bytes  # noqa: F401
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily._device import download  # noqa: E402
from lily.reference import ReferenceState, silu  # noqa: E402
# the layer harness and float64 references live with lily doctor's kernel checks (one home)
from lily import kernel_check  # noqa: E402
from lily.kernel_check import SPARE_ROWS, U, rows_buffer  # noqa: E402,F401
from lily.kernel_check import GDN_EPS as EPS, GDN_K as K, GDN_PREFILL_DIMS as GDN_DIMS  # noqa: E402,F401
from lily.kernel_check import StubOracle, rows_out_buffer as out_buffer  # noqa: E402,F401


class Layer(kernel_check.GdnPrefillLayer):
    """kernel_check.GdnPrefillLayer on fresh random weights (tests/seeding.py)."""

    def __init__(self, dev, dims, seed):
        super().__init__(dev, dims, rng=fresh_rng(seed))


# ------------------------------------------------------------------------------ helpers

def assert_outputs_close(got, want, scale, c=64, what="outputs"):
    """|got - want| <= c u scale per element (scale from scan_reference)."""
    err = np.abs(got - want)
    bound = c * U * scale
    assert np.all(err <= bound), f"{what}: worst error / bound = {float((err / bound).max()):.3g}"


def assert_state_close(got, want, atol=1e-5, what="state"):
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=what)


# ------------------------------------------------------------------------------ gdn_conv_chunk

@pytest.mark.parametrize("dims,M,rb,tg", [
    ("tiny", 1, 16, 256),     # shorter than the state: the new state keeps old rows
    ("tiny", 2, 1, 96),       # rows_per_thread below K-1 acts as K-1; partial threadgroup
    ("tiny", 5, 3, 96),       # two row blocks, the second reads its window from qkv
    ("dims", 64, 16, 256),
    ("dims", 100, 7, 256),    # ragged last row block
    ("real", 37, 16, 256),
])
@pytest.mark.parametrize("in_place", [False, True])
def test_conv_chunk(dev, dims, M, rb, tg, in_place):
    L = Layer(dev, dims, seed=11)
    state_in = f32(L.rng.standard_normal((K - 1, L.C)))
    L.set_state(state_in, np.zeros((L.Hv, L.Dv, L.Dk)), parity=0)
    qkv = L.inputs(M)[0]
    Q, CO = rows_buffer(dev, qkv), out_buffer(dev, M, L.C)
    cout = L.CS[0] if in_place else L.CS[1]
    cb = dev.command_buffer()
    p = cb.compute_pass()
    L.encode_conv(p, Q, M, L.CS[0], cout, CO, rb=rb, tg=tg)
    cb.commit()
    cb.wait()
    want, want_state, mag = L.conv_reference(qkv, state_in)
    got = download(CO[0], np.float32, (M + SPARE_ROWS, L.C))
    err = np.abs(got[:M] - want)
    bound = 2.0 ** -20 * (mag + np.abs(want))
    assert np.all(err <= bound), float((err / bound).max())
    assert np.isnan(got[M:]).all()                       # rows past the chunk untouched
    np.testing.assert_array_equal(download(cout, np.float32, (K - 1, L.C)), want_state)
    if not in_place:
        np.testing.assert_array_equal(L.conv_state(0), state_in)


# ------------------------------------------------------------------------------ gdn_scan

@pytest.mark.parametrize("dims,M", [("tiny", 1), ("tiny", 5), ("tiny", 64), ("tiny", 100),
                                    ("dims", 1), ("dims", 5), ("dims", 100), ("real", 13)])
def test_scan_matches_float64(dev, dims, M):
    """The scan alone from a random state on random post-SiLU activations."""
    L = Layer(dev, dims, seed=12)
    _, S0 = L.random_state()
    conv = f32(silu(L.rng.standard_normal((M, L.C))))
    _, z, b, a = L.inputs(M)
    CO, Z, B, A = (rows_buffer(dev, x) for x in (conv, z, b, a))
    O = out_buffer(dev, M, L.Hv * L.Dv)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    L.encode_scan(p, CO, Z, B, A, O, M)
    cb.commit()
    cb.wait()
    got = download(O[0], np.float32, (M + SPARE_ROWS, L.Hv * L.Dv))
    want_o, want_S, scale = L.scan_reference(conv, z, b, a, S0)
    assert_outputs_close(got[:M], want_o, scale)
    assert_state_close(L.state(), want_S)
    assert np.isnan(got[M:]).all()


@pytest.mark.parametrize("dims,M", [("tiny", 1), ("tiny", 5), ("tiny", 33),
                                    ("dims", 1), ("dims", 5), ("dims", 13), ("dims", 24)])
def test_chunk_equals_decode_steps(dev, dims, M):
    """conv + scan over M tokens == M gdn_decode_step dispatches, bit for bit (outputs,
    recurrent state, conv state), from a random state; chunk at an odd start position (an
    even M updates the conv state in place; M = 24 is two whole blocks of TB = 12)."""
    L = Layer(dev, dims, seed=13)
    p0 = 7
    conv0, S0 = L.random_state(parity=p0 % 2)
    inp = L.inputs(M)
    got, _ = L.chunk(*inp, p0=p0)
    got_S, got_conv = L.state(), L.conv_state((p0 + M) % 2)

    L.set_state(conv0, S0, parity=p0 % 2)
    want = np.stack([L.decode_step(*(x[t] for x in inp), pos=p0 + t) for t in range(M)])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_S, L.state())
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
                                        ("dims", (1, 30))])
def test_two_chunks_equal_one(dev, dims, split):
    """Conv and recurrent state carried across chunks (conv state in place when a chunk has
    even length) give exactly the single long chunk's outputs and states; both match the
    oracle (ReferenceModel.gated_deltanet)."""
    L = Layer(dev, dims, seed=14)
    conv0, S0 = L.random_state(parity=0)
    M = sum(split)
    inp = L.inputs(M)
    whole, _ = L.chunk(*inp, p0=0)
    whole_S, whole_conv = L.state(), L.conv_state(M % 2)

    L.set_state(conv0, S0, parity=0)
    parts, p0 = [], 0
    for m in split:
        parts.append(L.chunk(*(x[p0:p0 + m] for x in inp), p0=p0)[0])
        p0 += m
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    np.testing.assert_array_equal(L.state(), whole_S)
    np.testing.assert_array_equal(L.conv_state(M % 2), whole_conv)

    check_vs_oracle(L, inp, conv0, S0, whole, whole_S, whole_conv)


def test_chunk_vs_oracle_real_dims(dev):
    """Real dims (Hk=16, Hv=32, Dk=Dv=128), conv + scan against ReferenceModel.gated_deltanet."""
    L = Layer(dev, "real", seed=15)
    conv0, S0 = L.random_state(parity=1)
    M = 6
    inp = L.inputs(M)
    got, _ = L.chunk(*inp, p0=1)
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
        got, got_conv = L.chunk(qkv, z, b, a, p0=p0)
        want_conv, conv_st, _ = L.conv_reference(qkv, conv_st)
        np.testing.assert_allclose(got_conv, want_conv, rtol=1e-6, atol=1e-6)
        # the scan reference continues from the float64 state, on the device's conv output
        want_o, S, scale = L.scan_reference(got_conv, z, b, a, S)
        got_S = L.state()
        assert_outputs_close(got, want_o, scale, what=f"outputs of the chunk at {p0}")
        assert_state_close(got_S, S, what=f"state after the chunk at {p0}")
        worst_o = max(worst_o, float(np.abs(got - want_o).max()))
        worst_S = max(worst_S, float(np.abs(got_S - S).max()))
        p0 += m
        np.testing.assert_array_equal(L.conv_state(p0 % 2), conv_st)
    print(f"drift over {p0} tokens: outputs {worst_o:.2e}, state {worst_S:.2e}")
