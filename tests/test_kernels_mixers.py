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
import time
import types

import numpy as np
from seeding import fresh_rng
from simdev import ORDERS, THREAD_ORDERS, dev, fwd_dev, bf16_bits, from_bf16, f32, args_bytes  # noqa: F401 (fixtures)
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily._device import constant, download, sim_device, upload  # noqa: E402
from lily.reference import ReferenceModel, ReferenceState, rms_norm, rope, round_bf16  # noqa: E402
from lily.sampling import Sampler, SamplingParams, log_softmax  # noqa: E402


# ------------------------------------------------------------------------------ helpers

def run(dev, kernel, grid, tg, buffers, constants=(), reads=(), writes=(), threadgroups=True):
    cb = dev.command_buffer()
    p = cb.compute_pass()
    p.dispatch(kernel, grid, tg, buffers=list(buffers), constants=list(constants),
               reads=list(reads), writes=list(writes), threadgroups=threadgroups)
    cb.commit()
    cb.wait()
    return cb


class StubOracle(ReferenceModel):
    """ReferenceModel whose linear layers return given projection outputs.

    ``linear(x, "<prefix>.<name>")`` returns ``proj[name]`` (``out_proj`` / ``o_proj``
    return their input, so a mixer returns what its output projection would consume);
    ``param("...linear_attn.<name>")`` returns ``params[<name>]``. The mixer math itself is the
    reference's own code (:meth:`ReferenceModel.gated_deltanet`, :meth:`.attention`).
    """

    def __init__(self, cfg, params):  # noqa: D401  (no checkpoint)
        self.cfg = cfg
        self._act = lambda a: a.astype(np.float32, copy=False)
        self.params = params
        self.proj = {}

    def param(self, name):
        return self.params[name.split("_attn.", 1)[1]]

    def linear(self, x, module):
        name = module.rsplit(".", 1)[-1]
        if name in ("out_proj", "o_proj"):
            return x.astype(np.float32)
        return self.proj[name]


def gdn_cfg(Hk, Hv, Dk, Dv, K=4):
    return types.SimpleNamespace(linear_num_key_heads=Hk, linear_num_value_heads=Hv,
                                 linear_key_head_dim=Dk, linear_value_head_dim=Dv,
                                 linear_conv_kernel_dim=K, rms_norm_eps=1e-6,
                                 conv_dim=2 * Hk * Dk + Hv * Dv)


# ------------------------------------------------------------------------------ Gated DeltaNet

GDN_DIMS = {
    "real": (16, 32, 128, 128),
    "dims": (2, 4, 128, 128),
    "tiny": (2, 4, 32, 32),
}


class GdnLayer:
    """Device buffers of one GDN layer plus the oracle with the same weights."""

    def __init__(self, dev, Hk, Hv, Dk, Dv, K=4, seed=0):
        self.dev, self.Hk, self.Hv, self.Dk, self.Dv, self.K = dev, Hk, Hv, Dk, Dv, K
        rng = fresh_rng(seed)
        self.rng = rng
        C = self.conv_dim = 2 * Hk * Dk + Hv * Dv
        conv_w = bf16_bits(rng.normal(0, 0.3, (C, K)))
        dt_bias = bf16_bits(rng.uniform(-5, -2, Hv))
        A_log = np.log(np.exp(rng.uniform(np.log(1.0), np.log(16.0), Hv))).astype(np.float32)
        norm_w = bf16_bits(1 + 0.1 * rng.standard_normal(Dv))
        self.oracle = StubOracle(gdn_cfg(Hk, Hv, Dk, Dv, K), {
            "conv1d.weight": from_bf16(conv_w)[:, :, None],
            "dt_bias": from_bf16(dt_bias), "A_log": A_log, "norm.weight": from_bf16(norm_w)})
        self.w = [upload(dev, conv_w), upload(dev, A_log), upload(dev, dt_bias), upload(dev, norm_w)]
        self.conv = [upload(dev, np.zeros((K - 1, C), np.float32)), dev.buffer((K - 1) * C * 4)]
        self.state = upload(dev, np.zeros((Hv, Dv, Dk), np.float32))
        self.st = ReferenceState(max_context=1 << 20)
        self.st.conv[0] = np.zeros((K - 1, C), np.float32)
        self.st.recurrent[0] = np.zeros((Hv, Dv, Dk), np.float32)
        self.parity = 0
        self.kernel = f"gdn_decode_step_k{Dk}_v{Dv}"
        self.seconds = 0.0

    def random_inputs(self, scale=1.0):
        r = self.rng
        return (f32(r.standard_normal(self.conv_dim) * scale), f32(r.standard_normal(self.Hv * self.Dv)),
                f32(r.standard_normal(self.Hv)), f32(r.standard_normal(self.Hv)))

    def set_state(self, conv, S):
        self.conv[self.parity].write(f32(conv).view(np.uint8).reshape(-1))
        self.state.write(f32(S).view(np.uint8).reshape(-1))
        self.st.conv[0] = f32(conv).copy()
        self.st.recurrent[0] = f32(S).copy()

    def step_device(self, qkv, z, b, a):
        dev = self.dev
        Q, Z, B, A = upload(dev, qkv), upload(dev, z), upload(dev, b), upload(dev, a)
        out = dev.buffer(self.Hv * self.Dv * 4)
        cin, cout = self.conv[self.parity], self.conv[1 - self.parity]
        args = args_bytes(self.Hk, self.Hv, self.K, 1e-6, 1e-6)
        t = time.perf_counter()
        run(dev, self.kernel, self.Hv, 1024,
            buffers=[(0, Q), (1, Z), (2, B), (3, A), (4, self.w[0]), (5, self.w[1]), (6, self.w[2]),
                     (7, self.w[3]), (8, cin), (9, cout), (10, self.state), (11, out)],
            constants=[(12, args)],
            reads=[Q, Z, B, A, *self.w, cin, self.state], writes=[cout, self.state, out])
        self.seconds += time.perf_counter() - t
        self.parity ^= 1
        return download(out, np.float32)

    def step_reference(self, qkv, z, b, a):
        o = self.oracle
        o.proj = {"in_proj_qkv": qkv[None], "in_proj_z": z[None], "in_proj_b": b[None], "in_proj_a": a[None]}
        return o.gated_deltanet(0, np.zeros((1, 1), np.float32), self.st)[0]

    def device_state(self):
        C, K = self.conv_dim, self.K
        return (download(self.conv[self.parity], np.float32, (K - 1, C)),
                download(self.state, np.float32, (self.Hv, self.Dv, self.Dk)))


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
THETA = 1e7


def attn_cfg(Hq, Hkv, D, rot):
    return types.SimpleNamespace(num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D,
                                 rotary_dim=rot, rope_theta=THETA, rms_norm_eps=1e-6)


def heads_per_group(Hq, Hkv):
    """G: query heads per decode threadgroup, the runtime's rule (csrc/runtime/encoder.h):
    the largest of 8, 4, 2 dividing the GQA group (the model's 8: each KV row read once)."""
    return next(g for g in (8, 4, 2) if (Hq // Hkv) % g == 0)


class AttnLayer:
    """Device KV cache + weights of one attention layer, and host-side encoders that
    mirror what the runtime does (docs/kernels.md)."""

    def __init__(self, dev, Hq, Hkv, D, rot, capacity, seed=0):
        self.dev, self.Hq, self.Hkv, self.D, self.rot, self.cap = dev, Hq, Hkv, D, rot, capacity
        self.rng = rng = fresh_rng(seed)
        self.qn = bf16_bits(1 + 0.1 * rng.standard_normal(D))
        self.kn = bf16_bits(1 + 0.1 * rng.standard_normal(D))
        self.QN, self.KN = upload(dev, self.qn), upload(dev, self.kn)
        # cache: random bf16 history; rows are filled by tests as needed
        self.k_hist = bf16_bits(rng.standard_normal((Hkv, capacity, D)))
        self.v_hist = bf16_bits(rng.standard_normal((Hkv, capacity, D)))
        self.KC, self.VC = upload(dev, self.k_hist), upload(dev, self.v_hist)
        self.POS = upload(dev, np.zeros(1, np.uint32))
        self.G = heads_per_group(Hq, Hkv)
        self.seconds = {}

    def _timed(self, name, fn):
        t = time.perf_counter()
        r = fn()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
        return r

    def set_position(self, pos):
        self.POS.write(np.array([pos], np.uint32).view(np.uint8))

    def cache_row_ranges(self, pos):
        """The bytes attn_qk_prep writes: row pos of each KV head, in K and V."""
        row = 2 * self.D
        return [(C, (h * self.cap + pos) * row, row) for C in (self.KC, self.VC) for h in range(self.Hkv)]

    def prep(self, qg, k, v, pos):
        dev, D = self.dev, self.D
        QG, K, V = upload(dev, qg), upload(dev, k), upload(dev, v)
        Q, GATE = dev.buffer(self.Hq * D * 4), dev.buffer(self.Hq * D * 4)
        args = args_bytes(self.Hq, self.Hkv, D, self.rot, self.cap, 1e-6, float(np.log2(THETA)))
        self._timed("attn_qk_prep", lambda: run(
            dev, "attn_qk_prep", self.Hq + self.Hkv, D,
            buffers=[(0, QG), (1, K), (2, V), (3, self.QN), (4, self.KN), (5, self.POS),
                     (6, self.KC), (7, self.VC), (8, Q), (9, GATE)],
            constants=[(10, args)], reads=[QG, K, V, self.QN, self.KN, self.POS],
            writes=[*self.cache_row_ranges(pos), Q, GATE]))
        return Q, GATE

    def decode(self, Q, GATE, n, *, split_threshold=32768, block_rows=1024, extra_blocks=0,
               gate_stride=None):
        """Attention over rows [0, n) (position n - 1 must be set); picks the split path
        when n >= split_threshold. Returns the fp32 [Hq*D] output."""
        dev, D, G, Hq = self.dev, self.D, self.G, self.Hq
        gs = D if gate_stride is None else gate_stride
        OUT = dev.buffer(Hq * D * 4)
        scale = float(D) ** -0.5
        if n < split_threshold:
            args = args_bytes(Hq, self.Hkv, self.cap, gs, scale, 0, 0)
            self._timed("attn_decode", lambda: run(
                dev, f"attn_decode_d{D}_g{G}", Hq // G, 256,
                buffers=[(0, Q), (1, GATE), (2, self.KC), (3, self.VC), (4, self.POS), (5, OUT)],
                constants=[(6, args)], reads=[Q, GATE, self.KC, self.VC, self.POS], writes=[OUT]))
            return download(OUT, np.float32)
        used = -(-n // block_rows)                 # blocks holding rows
        nblocks = used + extra_blocks              # dispatched (surplus ones must not write)
        max_blocks = nblocks
        ML, ACC = dev.buffer(Hq * max_blocks * 8), dev.buffer(Hq * max_blocks * D * 4)
        # exactly the partial slots of the used blocks: verify_writes proves surplus blocks
        # write nothing (a runtime encoding ahead may declare all max_blocks slots instead)
        parts = ([(ML, h * max_blocks * 8, used * 8) for h in range(Hq)]
                 + [(ACC, h * max_blocks * D * 4, used * D * 4) for h in range(Hq)])
        args = args_bytes(Hq, self.Hkv, self.cap, gs, scale, block_rows, max_blocks)
        cargs = args_bytes(Hq, gs, block_rows, max_blocks)
        cb = dev.command_buffer()
        p = cb.compute_pass()
        t = time.perf_counter()
        p.dispatch(f"attn_decode_split_d{D}_g{G}", (Hq // G, nblocks), 256,
                   buffers=[(0, Q), (1, self.KC), (2, self.VC), (3, self.POS), (4, ML), (5, ACC)],
                   constants=[(6, args)], reads=[Q, self.KC, self.VC, self.POS], writes=parts,
                   threadgroups=True)
        p.dispatch(f"attn_combine_d{D}", Hq, D,
                   buffers=[(0, ML), (1, ACC), (2, GATE), (3, self.POS), (4, OUT)],
                   constants=[(5, cargs)], reads=[*parts, GATE, self.POS], writes=[OUT],
                   threadgroups=True)
        cb.commit()
        cb.wait()
        self.seconds["attn_decode_split+combine"] = (self.seconds.get("attn_decode_split+combine", 0.0)
                                                      + time.perf_counter() - t)
        assert cb.counters["barrier_stages"] == 2  # combine waits for the partials
        return download(OUT, np.float32)


    # ---- fused prep + decode (attn_decode_fused / attn_decode_split_fused)

    def fused_args(self, block_rows=0, max_blocks=0):
        return args_bytes(self.Hq, self.Hkv, self.rot, self.cap, 1e-6, float(np.log2(THETA)),
                          float(self.D) ** -0.5, block_rows, max_blocks)

    def cache_prefix_ranges(self, pos):
        """Rows [0, pos) of each KV head, in K and V: what the fused kernels read."""
        row = 2 * self.D
        if pos == 0:
            return []
        return [(C, h * self.cap * row, pos * row) for C in (self.KC, self.VC) for h in range(self.Hkv)]

    def encode_fused(self, p, QG, K, V, POS, pos, *, block_rows=None, extra_blocks=0, label=""):
        """Encodes the fused step at position pos (POS holds it) into pass p, with the
        declared ranges of docs/kernels.md; returns the output buffer [Hq*D] fp32."""
        dev, D, G, Hq = self.dev, self.D, self.G, self.Hq
        OUT = dev.buffer(Hq * D * 4)
        common = [(0, QG), (1, K), (2, V), (3, self.QN), (4, self.KN), (5, POS), (6, self.KC), (7, self.VC)]
        reads = [QG, K, V, self.QN, self.KN, POS, *self.cache_prefix_ranges(pos)]
        if block_rows is None:
            p.dispatch(f"attn_decode_fused_d{D}_g{G}", Hq // G, 256,
                       buffers=common + [(8, OUT)], constants=[(9, self.fused_args())],
                       reads=reads, writes=[*self.cache_row_ranges(pos), OUT], threadgroups=True,
                       label=label)
            return OUT
        n = pos + 1
        used = -(-n // block_rows)
        nblocks = used + extra_blocks
        max_blocks = nblocks
        ML, ACC = dev.buffer(Hq * max_blocks * 8), dev.buffer(Hq * max_blocks * D * 4)
        parts = ([(ML, h * max_blocks * 8, used * 8) for h in range(Hq)]
                 + [(ACC, h * max_blocks * D * 4, used * D * 4) for h in range(Hq)])
        p.dispatch(f"attn_decode_split_fused_d{D}_g{G}", (Hq // G, nblocks), 256,
                   buffers=common + [(8, ML), (9, ACC)], constants=[(10, self.fused_args(block_rows, max_blocks))],
                   reads=reads, writes=[*self.cache_row_ranges(pos), *parts], threadgroups=True,
                   label=label)
        # gate straight from the q_proj output: byte offset 4*D, stride 2*D
        p.dispatch(f"attn_combine_d{D}", Hq, D,
                   buffers=[(0, ML), (1, ACC), (2, QG, 4 * D), (3, POS), (4, OUT)],
                   constants=[(5, args_bytes(Hq, 2 * D, block_rows, max_blocks))],
                   reads=[*parts, (QG, 4 * D, Hq * 2 * D * 4 - 4 * D), POS], writes=[OUT],
                   threadgroups=True, label=label)
        return OUT

    def fused(self, qg, k, v, pos, **kw):
        """One fused step at position pos in its own command buffer; fp32 [Hq*D] out."""
        dev = self.dev
        QG, K, V = upload(dev, qg), upload(dev, k), upload(dev, v)
        self.set_position(pos)
        cb = dev.command_buffer()
        p = cb.compute_pass()
        t = time.perf_counter()
        OUT = self.encode_fused(p, QG, K, V, self.POS, pos, **kw)
        cb.commit()
        cb.wait()
        name = "attn_decode_fused" if kw.get("block_rows") is None else "attn_decode_split_fused+combine"
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
        # prep and attention in one stage (the split path: + the combine)
        assert cb.counters["barrier_stages"] == (1 if kw.get("block_rows") is None else 2)
        return download(OUT, np.float32)


def attention_reference(q, gate, K, V, n, D):
    """float64 softmax attention of q [Hq, D] over K, V [Hkv, >=n, D]; output * sigmoid(gate)."""
    Hq, Hkv = q.shape[0], K.shape[0]
    group = Hq // Hkv
    out = np.empty((Hq, D))
    for h in range(Hq):
        k = K[h // group, :n].astype(np.float64)
        v = V[h // group, :n].astype(np.float64)
        s = k @ q[h].astype(np.float64) * D ** -0.5
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v
    return (out * (1 / (1 + np.exp(-gate.astype(np.float64))))).reshape(-1)


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
    # reference: the oracle's helpers, in the order ReferenceModel.attention applies them
    P = np.array([pos])
    q_ref = rope(rms_norm(qg[None, :, :D], from_bf16(A.qn), 1e-6), P, rot, THETA)[0]
    k_ref = rope(rms_norm(k[None], from_bf16(A.kn), 1e-6), P, rot, THETA)[0]
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


def philox_u(seed: int, counter: int) -> float:
    """numpy model of the kernel's draw: Philox4x32-10, key = seed (lo, hi words),
    counter = (position, 0, 0, 0); u = (first word >> 8) * 2^-24."""
    M = 0xFFFFFFFF
    c = [counter & M, 0, 0, 0]
    k0, k1 = seed & M, (seed >> 32) & M
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & M, (p0 >> 32) ^ c[3] ^ k1, p0 & M]
        k0, k1 = (k0 + 0x9E3779B9) & M, (k1 + 0xBB67AE85) & M
    return (c[0] >> 8) * 2.0 ** -24


def sampler_for(params: SamplingParams, prompt=(), generated=()):
    s = Sampler(params, prompt)
    for t in generated:
        s._counts[int(t)] = s._counts.get(int(t), 0) + 1
    return s


def count_buffer(V, prompt=(), generated=()):
    c = np.zeros(V, np.uint32)
    for t in prompt:
        c[t] |= 0x80000000
    for t in generated:
        c[t] += 1
    return c


def filtered_probs(params: SamplingParams, logits, prompt=(), generated=()):
    """The distribution lily.sampling.Sampler draws from (its own code path, minus the draw)."""
    return sampler_for(params, prompt, generated).probabilities(logits)


def sample_args(V, p: SamplingParams, seed, *, logprobs=False, update_counts=False):
    return args_bytes(V, float(p.temperature), p.top_k, float(p.top_p), float(p.min_p),
                      float(p.presence_penalty), float(p.frequency_penalty), float(p.repetition_penalty),
                      seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, int(logprobs), p.top_logprobs,
                      int(update_counts))


def sample_many(dev, logits, counts, params, seeds, positions, tg=1024, logprobs=False, update_counts=False):
    """One sample_token dispatch per (seed, position), all in one command buffer."""
    V = logits.size
    n = len(seeds)
    L, C = upload(dev, f32(logits)), upload(dev, counts)
    POS = upload(dev, np.asarray(positions, np.uint32))
    TOK = dev.buffer(4 * n)
    k = max(params.top_logprobs, 1)
    LP, IDS = dev.buffer(4 * (1 + params.top_logprobs) * n), dev.buffer(4 * k * n)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    for j, seed in enumerate(seeds):
        lp_bytes = 4 * (1 + params.top_logprobs)
        p.dispatch("sample_token", 1, tg,
                   buffers=[(0, L), (1, C), (2, POS, 4 * j), (3, TOK, 4 * j), (4, LP, lp_bytes * j),
                            (5, IDS, 4 * k * j)],
                   constants=[(6, sample_args(V, params, seed, logprobs=logprobs, update_counts=update_counts))],
                   reads=[L, C, (POS, 4 * j, 4)],
                   writes=[(TOK, 4 * j, 4)]
                   + ([(LP, lp_bytes * j, 4)] if logprobs else [])
                   + ([(LP, lp_bytes * j + 4, lp_bytes - 4), (IDS, 4 * k * j, 4 * k)]
                      if params.top_logprobs else [])
                   + ([C] if update_counts else []),
                   threadgroups=True)
    t = time.perf_counter()
    cb.commit()
    cb.wait()
    dt = time.perf_counter() - t
    toks = download(TOK, np.uint32)
    lps = download(LP, np.float32, (n, 1 + params.top_logprobs))
    ids = download(IDS, np.uint32, (n, k))
    return toks, lps, ids, C, dt


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
    parts = -(-V // slice_)
    L, TOK, PART = upload(dev, logits), dev.buffer(4), dev.buffer(8 * parts)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    p.dispatch("argmax_partial", parts, 256, buffers=[(0, L), (1, PART)], constants=[(2, constant(V, slice_))],
               reads=[L], writes=[PART], threadgroups=True)
    p.dispatch("sample_greedy_combine", 1, min(1024, -(-parts // 32) * 32), buffers=[(0, PART), (1, TOK)],
               constants=[(2, constant(parts, 0))], reads=[PART], writes=[TOK], threadgroups=True)
    cb.commit()
    cb.wait()
    assert cb.counters["barrier_stages"] == 2
    assert download(TOK, np.uint32)[0] == int(np.nanargmax(logits))


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


def sorted_order(probs):
    """The fast path's candidate order: probability descending, id ascending."""
    return np.lexsort((np.arange(probs.size), -probs))


def thread_order(V, tg):
    """The slow path's order: thread t's elements t, t + tg, ... one thread after another."""
    return np.concatenate([np.arange(t, V, tg) for t in range(tg)])


def expected_draws(probs, order, seeds, positions):
    """Tokens the numpy model of the kernel draws, and whether u is near a boundary."""
    p = probs[order]
    csum = np.cumsum(p)
    last = int(np.nonzero(p)[0][-1])
    out = []
    for seed, pos in zip(seeds, positions):
        u = philox_u(seed, pos)
        j = min(int(np.searchsorted(csum, u, side="right")), last)
        out.append((int(order[j]), np.min(np.abs(csum - u)) < 1e-5))
    return out


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
