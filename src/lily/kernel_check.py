"""One run of each shipped kernel against its numpy reference (``lily doctor``).

Every check builds small fresh random inputs, dispatches one kernel of the shipped library
on a native device (``metal``, or ``sim`` on Linux) and compares the outputs with a numpy
evaluation in float64, against the same first-order error bounds the kernel tests use
(tests/kernels/ import the reference helpers from here, through tests/harness.py:
one home for them).

    results = run_checks(device)            # every kernel of device.kernel_names()
    for r in results: print(r.kernel, r.status, r.error)

A result's ``error`` is the worst ratio of |got - exact| to the kernel's tolerance (PASS
when <= 1), or for exact kernels (argmax, routing ids) 0 or 1. Kernels whose name starts
with ``st_`` are the simulator's self-test kernels (metal/selftest*.metal, registered only in
the simulator, never in the shipped metallib), not part of the model; they are not checked
here.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from lily._device import constant, download, upload
from lily.checkpoint import QuantizedTensor, bf16_to_f32, f32_to_bf16, gdn_state_floats
from lily.errors import InvalidParameterError
from lily.reference import (
    ReferenceModel,
    ReferenceState,
    l2_norm,
    rms_norm,
    rope,
    round_bf16,
    sigmoid,
    silu,
    softmax,
)
from lily.sampling import Sampler, SamplingParams

U = 2.0**-24          # fp32 unit roundoff
DEPTH = 64            # accumulation depth bound of the GEMV-like kernels (tests/kernels/test_moe.py)
GEMV_ROWS_PER_SG = 4  # kGemvRowsPerSimdgroup (metal/common.h)
COMBINE_TG = 256  # attn_combine: 8 simdgroups per (head, 32 columns) (metal/attention.metal)
NORM_GEMV_ROWS_PER_SG = 8  # NormGemvArgs.rows_per_simdgroup of the wide projections (csrc/runtime/decode.cpp)
TG = 64               # threads per threadgroup used for the GEMV-like kernels
GATE_UP_ROWS_PER_SG = 4  # kGateUpRowsPerSimdgroup (metal/common.h)
GEMM_BM, GEMM_BN, GEMM_TG = 64, 64, 128  # dense GEMM tile and threads (metal/gemm.metal)
GEMM_TENSOR_BM, GEMM_TENSOR_TG = 128, 256  # rows and threads of their tensor-op twins (gemm_tensor.metal)
GEMM_SWIGLU_BN = 32  # output columns per threadgroup of gemm_swiglu_q4(_tensor)
GEMM_BK = 64         # k per GEMM step (kGemmBK, metal/gemm_tiles.h)
HALF_MAX = 65504.0   # the GEMMs clamp their half operands to +-HALF_MAX (kGemmHalfMax)
# Grouped GEMM kernels per tile height T: threads of both kernels, output columns per
# threadgroup of gate/up and of down (csrc/runtime/prefill.cpp moe_geometry). T = 128: the
# tensor-op path only (moe_gemm_*_q4_t128_tensor, no simdgroup_matrix twin).
MOE_TG = {16: 64, 32: 128, 64: 128, 128: 256}
MOE_BN = {16: 64, 32: 64, 64: 32, 128: 32}
MOE_DOWN_BN = {16: 64, 32: 64, 64: 64, 128: 64}
MOE_TILES = (16, 32, 64)
MOE_TENSOR_TILES = MOE_TILES + (128,)

SELFTEST_PREFIX = "st_"

#: Shipped kernels that have no check here yet: ``lily doctor`` reports them as NO CHECK.
#: tests/test_doctor.py keeps this list exact, so a new kernel without a check fails a test.
PENDING: frozenset[str] = frozenset()


# ----------------------------------------------------------------------------- references


to_bf16_bits = bf16_bits = f32_to_bf16  # float32 -> bf16 bit patterns (lily.checkpoint); the tests' names


def rand_quant(rng, lead, rows, cols, bits, name="w") -> QuantizedTensor:
    """Random MLX-layout tensor [*lead, rows, cols]: uniform codes, realistic bf16 scales
    (weights ~ +-0.03) and biases (about -scale * 2**(bits-1), so w is centred)."""
    shape = (*lead, rows)
    words = rng.integers(0, 2**32, size=(*shape, cols * bits // 32), dtype=np.uint64).astype(np.uint32)
    g = (*shape, cols // 64)
    s = (rng.random(g, dtype=np.float32) * 0.004 + 0.0005)
    b = -s * (2 ** (bits - 1) - 0.5) + rng.standard_normal(g, dtype=np.float32) * 0.002
    return QuantizedTensor(name, words, to_bf16_bits(s), to_bf16_bits(b), bits, 64)


def _codes(qt: QuantizedTensor, index=None):
    """(q, s, b) as float64: codes [*, rows, groups, 64], scales and biases [*, rows, groups, 1]."""
    w, s, b = qt.weight, qt.scales, qt.biases
    if index is not None:
        w, s, b = w[index], s[index], b[index]
    per = 32 // qt.bits
    q = (w[..., None] >> (np.arange(per, dtype=np.uint32) * qt.bits)) & np.uint32((1 << qt.bits) - 1)
    q = q.reshape(*w.shape[:-1], -1).astype(np.float64)
    qg = q.reshape(*q.shape[:-1], -1, 64)
    return qg, bf16_to_f32(s).astype(np.float64)[..., None], bf16_to_f32(b).astype(np.float64)[..., None]


def magnitude(qt: QuantizedTensor, index=None) -> np.ndarray:
    """(|s| q + |b|) as float64 [*, rows, cols]: the per-term magnitudes the kernels sum."""
    q, s, b = _codes(qt, index)
    return (q * np.abs(s) + np.abs(b)).reshape(*q.shape[:-2], -1)


def half_operand(x) -> np.ndarray:
    """x as the prefill GEMMs stage it (gemm_half, metal/gemm_tiles.h): clamped to +-65504,
    rounded to half (nearest even); float64."""
    return half_activations(x).astype(np.float64)


def half_activations(x) -> np.ndarray:
    """x as the producers of the prefill GEMMs' inputs store it (rms_norm_half, the SwiGLU
    GEMMs: gemm_half of metal/common.h): clamped to +-65504, rounded to half; float16."""
    return np.clip(np.asarray(x, np.float32), -HALF_MAX, HALF_MAX).astype(np.float16)


def gemm_geometry(kernel: str) -> tuple[int, int]:
    """(rows per threadgroup, threads per threadgroup) of dense GEMM ``kernel``: 64 and 128
    (gemm.metal), 128 and 256 for the tensor-op twins (``*_tensor``, gemm_tensor.metal)."""
    return (GEMM_TENSOR_BM, GEMM_TENSOR_TG) if kernel.endswith("_tensor") else (GEMM_BM, GEMM_TG)


def half_stored(want, tol):
    """(want, tol) of an fp32 result within tol of want, stored as half (nearest): the
    rounding adds at most 2**-11 of the stored magnitude, or 2**-25 for subnormals."""
    want = np.asarray(want, np.float64)
    return want, tol + 2.0**-11 * (np.abs(want) + tol) + 2.0**-25


def gdn_stored(want, tol, f=None):
    """(want, tol) of a gated-norm output within tol of want (fp32 math) as out_proj stages it
    (metal/gdn_prefill.metal): half(u * f_s) with u = gemm_half(want / f_s) and f_s rounded to
    half, three half roundings (at most ~3 * 2**-11 of the magnitude, or 2**-25 each for
    subnormals; a subnormal f_s, a split holding < 2**-28 of its head's y^2, is not met by
    random inputs). ``f``: the splits' float64 factors per output (GdnPrefillLayer.scan_reference
    with factors=True): u saturates at +-65504 before the factor (stored 65504 f_s); without
    it the outputs are taken as not saturating."""
    want = np.asarray(want, np.float64)
    want = np.clip(want, -HALF_MAX, HALF_MAX) if f is None else np.clip(want / f, -HALF_MAX, HALF_MAX) * f
    return want, tol + 3.01 * 2.0**-11 * (np.abs(want) + tol) + 3 * 2.0**-25


def half_weights(qt: QuantizedTensor, index=None) -> tuple[np.ndarray, np.ndarray]:
    """(wh, dw) float64 [*, rows, cols]: the dequantized weights as the prefill GEMMs stage
    them (gemm_load_w, metal/gemm_tiles.h), and dw = |wh - wf|, where wf is the weight a GPU
    gives and wh may not: a group whose extremes b and s (2^bits - 1) + b stay within
    +-65504 is dequantized as fma(q, half(s), half(b)) in half, which a GPU rounds once
    (wf = half(q s_h + b_h)) and the simulator and numpy round through fp32 first (wh =
    half(fp32(q s_h + b_h)); q s_h is exact in fp32); any other group in fp32 and clamped,
    wh = half(clamp(fp32(fp32(s q) + b))) stepwise, wf with the fp32 fma a GPU compiler may
    contract it to."""
    q, s, b = _codes(qt, index)
    top = float((1 << qt.bits) - 1)
    s32, b32 = s.astype(np.float32), b.astype(np.float32)
    sat = np.maximum(np.abs(b32), np.abs(s32 * np.float32(top) + b32)) > HALF_MAX
    with np.errstate(over="ignore"):
        sh, bh = s32.astype(np.float16).astype(np.float64), b32.astype(np.float16).astype(np.float64)
    in_half = np.where(sat, 0.0, q * sh + bh)  # exact in float64
    stepwise = np.where(sat, half_operand((q * s).astype(np.float32) + b32),
                        in_half.astype(np.float32).astype(np.float16))
    fused = np.where(sat, half_operand((q * s + b).astype(np.float32)), in_half.astype(np.float16))
    wh, wf = stepwise.astype(np.float64), fused.astype(np.float64)
    return wh.reshape(*q.shape[:-2], -1), np.abs(wh - wf).reshape(*q.shape[:-2], -1)


def upload_q(dev, qt: QuantizedTensor):
    """The weight, scales and biases of a quantized tensor as three device buffers."""
    return upload(dev, qt.weight), upload(dev, qt.scales), upload(dev, qt.biases)


def gemv_grid(rows: int) -> int:
    """Threadgroups of a GEMV-like dispatch of ``rows`` outputs with ``TG`` threads."""
    return -(-rows // (GEMV_ROWS_PER_SG * TG // 32))


def route_ref(logits, k, norm=True):
    """lily.reference.ReferenceModel.moe's routing on float32 logits: (expert ids, weights)."""
    p = softmax(logits.astype(np.float32)[None])[0]
    top = np.argsort(-p, kind="stable")[:k]
    w = p[top]
    return top, (w / w.sum() if norm else w)


# ----------------------------------------------------------------------------- host encoding
def from_bf16(bits) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exact."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32)


def args_bytes(*fields) -> bytes:
    """A constant struct of 4-byte fields: Python ints -> uint32, floats -> float32."""
    return b"".join(np.float32(v).tobytes() if isinstance(v, float) else np.uint32(v).tobytes()
                    for v in fields)


# ----------------------------------------------------------------------------- layer harnesses

def run(dev, kernel, grid, tg, buffers=(), constants=(), reads=(), writes=(), threadgroups=True,
        tgmem=(), label=""):
    """One dispatch of ``kernel`` in its own command buffer, committed and waited for.

    ``buffers`` and ``constants`` are ``(index, buffer[, offset])`` / ``(index, bytes)``
    bindings, ``tgmem`` ``(index, bytes)`` of threadgroup memory; ``grid`` counts
    threadgroups when ``threadgroups`` else threads. Returns the command buffer."""
    cb = dev.command_buffer()
    p = cb.compute_pass()
    p.dispatch(kernel, grid, tg, buffers=list(buffers), constants=list(constants), threadgroup_memory=list(tgmem),
               reads=list(reads), writes=list(writes), threadgroups=threadgroups, label=label)
    cb.commit()
    cb.wait()
    return cb


def run_bound(dev, kernel, grid, tg, buffers, args, reads, writes, threadgroups=True, label=""):
    """:func:`run` with ``buffers`` bound at 0, 1, ... and the argument struct ``args`` (bytes,
    or None for none) at the next index."""
    return run(dev, kernel, grid, tg, list(enumerate(buffers)), [] if args is None else [(len(buffers), args)],
               reads, writes, threadgroups, label=label)


def run_encoder(dev, enc, *a, **kw):
    """``enc(compute_pass, *a, **kw)`` (an ``enc_*`` encoder of this module) on a fresh
    command buffer, committed and waited for; returns the command buffer."""
    cb = dev.command_buffer()
    enc(cb.compute_pass(), *a, **kw)
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

    def __init__(self, cfg, params):  # no checkpoint
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


GDN_SCAN_FOLD = 2.0**-40  # gdn_scan folds its pending decay once c * g < this (kGdnScanFold)


def gdn_state_bytes(S, c=None):
    """The device layout of a GDN recurrent state (metal/gdn_prefill.metal, "Lazy decay"):
    S' float32 [Hv, Dv, Dk] then the pending decay c float32 [Hv, Dv] (the state is
    c * S' per row), as bytes. ``c``: scalar, [Hv] or [Hv, Dv] (default 1)."""
    S = f32(S)
    return np.concatenate([S.reshape(-1), gdn_rows(c, S.shape[:2]).reshape(-1)]).view(np.uint8)


def gdn_rows(c, shape):
    """A pending decay given as a scalar, per head [Hv] or per row [Hv, Dv] (None: 1), as
    float32 [Hv, Dv]."""
    c = np.asarray(1.0 if c is None else c, np.float64)
    return f32(np.broadcast_to(c[:, None] if c.ndim == 1 else c, shape))


def gdn_state_parts(buf, Hv, Dv, Dk):
    """S' [Hv, Dv, Dk] and c [Hv, Dv] (float32) of a device state buffer ``buf``."""
    raw = download(buf, np.float32, (gdn_state_floats(Hv, Dv, Dk),))
    return raw[:Hv * Dv * Dk].reshape(Hv, Dv, Dk), raw[Hv * Dv * Dk:].reshape(Hv, Dv)


def gdn_folded(Sp, c):
    """The recurrent state c * S' in float64 (exact: a product of two float32)."""
    return np.asarray(c, np.float64)[..., None] * Sp


GDN_DECODE_SPLITS = 4  # threadgroups per value head of gdn_decode_step (Runtime::kGdnDecodeSplits)


def gdn_ring_entry(Hk, Hv, Dk, Dv) -> int:
    """Floats of one ring entry of the state write-back window (metal/mixer_args.h GdnRing,
    through the core): delta [Hv*Dv] | normalised k [Hk*Dk] | g [Hv]."""
    from lily import _core
    return _core.gdn_ring_entry_floats(Hk, Hv, Dk, Dv)


def gdn_decode_dispatch(p, kernel, Hk, Hv, Dv, K, qkv, b, a, weights, cin, cout, state, out, ssq, ring,
                        splits=GDN_DECODE_SPLITS, label="", pending=0, write_back=True):
    """Encodes gdn_decode_step on compute pass ``p`` as the runtime does (csrc/runtime/decode.cpp):
    grid (Hv, splits), Dv / splits * 8 threads (4 state rows per simdgroup). ``weights``: the
    conv_w, A_log and dt_bias buffers; ``out``: y = S q, fp32 [Hv*Dv]; ``ssq``: fp32 [Hv, splits],
    each split's sum of y^2. ``ring``: the layer's ring of pending updates; the step replays
    ``pending`` entries, then writes the state back (``write_back``) or appends its entry."""
    entry = gdn_ring_entry(Hk, Hv, int(kernel.split("_k")[1].split("_")[0]), Dv) * 4
    reads = [qkv, b, a, *weights, cin, state] + ([(ring, 0, pending * entry)] if pending else [])
    writes = [cout, out, ssq] + ([state] if write_back else [(ring, pending * entry, entry)])
    p.dispatch(kernel, (Hv, splits, 1), (Dv // splits * 8, 1, 1),
               buffers=list(enumerate([qkv, b, a, *weights, cin, cout, state, out, ssq])) + [(12, ring)],
               constants=[(11, args_bytes(Hk, Hv, K, 1e-6, pending, int(write_back)))],
               reads=reads, writes=writes, threadgroups=True, label=label or kernel)


def gdn_writeback_dispatch(p, Hk, Hv, Dk, Dv, K, state, ring, pending, splits=GDN_DECODE_SPLITS):
    """Encodes gdn_state_writeback as the runtime does: the state after ``pending`` ring entries."""
    kernel = f"gdn_state_writeback_k{Dk}_v{Dv}"
    p.dispatch(kernel, (Hv, splits, 1), (Dv // splits * 8, 1, 1), buffers=[(0, state), (1, ring)],
               constants=[(2, args_bytes(Hk, Hv, K, 1e-6, pending, 1))],
               reads=[state, (ring, 0, pending * gdn_ring_entry(Hk, Hv, Dk, Dv) * 4)], writes=[state],
               threadgroups=True, label=kernel)


def gdn_gated_norm32(y, ssq, z, norm_w_bits, Dv, eps=1e-6):
    """The gated RMSNorm gemv_gated_q*_add applies while loading out_proj's input, in float32
    and its order: per head ss = the partials summed in order, inv = 1 / sqrt(ss / Dv + eps),
    then ((y * inv) * norm_w) * silu(z). y, z: [Hv*Dv]; ssq: [Hv, NS]. Returns [Hv*Dv]."""
    y, z = f32(y).reshape(-1, Dv), f32(z).reshape(-1, Dv)
    parts = f32(ssq).reshape(len(y), -1)
    ss = np.zeros(len(y), np.float32)
    for j in range(parts.shape[1]):
        ss = f32(ss + parts[:, j])
    inv = f32(np.float32(1.0) / np.sqrt(f32(ss / np.float32(Dv) + np.float32(eps))))
    gate = f32(z / (np.float32(1.0) + np.exp(-z)))
    return f32(f32(f32(y * inv[:, None]) * from_bf16(norm_w_bits)) * gate).reshape(-1)


def gdn_split_ssq(y, Dv, splits):
    """float64 sum of y^2 over each split's Dv / splits rows: [Hv, splits]."""
    return (np.asarray(y, np.float64).reshape(-1, splits, Dv // splits) ** 2).sum(-1)


def gdn_window_pair(dev, Hk, Hv, Dk, Dv, window, rng):
    """Two :class:`GdnLayer` with the same weights and the same random starting state (conv
    history, S' with a random pending decay c per head, one head c = 0: S = 0), one writing
    its state back every step, the other every ``window`` steps; draws from ``rng``."""
    seed = int(rng.integers(1 << 62))
    every, windowed = (GdnLayer(dev, Hk, Hv, Dk, Dv, rng=np.random.default_rng(seed), window=w) for w in (1, window))
    c = 2.0 ** -rng.uniform(0, 40, Hv)
    c[0] = 0.0
    conv = rng.standard_normal((every.K - 1, every.conv_dim))
    Sp = 0.3 * rng.standard_normal((Hv, Dv, Dk)) / np.where(c > 0, c, 1)[:, None, None]
    for L in (every, windowed):
        L.set_state(conv, Sp, c)
    return every, windowed


class GdnLayer:
    """Device buffers of one GDN layer plus the oracle with the same weights."""

    def __init__(self, dev, Hk, Hv, Dk, Dv, K=4, seed=0, rng=None, window=1):
        self.dev, self.Hk, self.Hv, self.Dk, self.Dv, self.K = dev, Hk, Hv, Dk, Dv, K
        # the state is written back every ``window`` steps (the runtime's state_window)
        self.window, self.pending = window, 0
        self.ring = dev.buffer(max(1, window - 1) * gdn_ring_entry(Hk, Hv, Dk, Dv) * 4)
        rng = rng if rng is not None else np.random.default_rng(seed)
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
        self.norm_w = norm_w
        self.conv = [upload(dev, np.zeros((K - 1, C), np.float32)), dev.buffer((K - 1) * C * 4)]
        self.state = upload(dev, np.zeros(gdn_state_floats(Hv, Dv, Dk), np.float32))  # S' and c: zero, S = 0
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

    def set_state(self, conv, S, c=None):
        """Conv state and recurrent state S' = ``S`` with pending decay ``c`` (scalar, [Hv]
        or [Hv, Dv]; default 1) on the device; the oracle starts from c * S'. Drops pending steps."""
        self.pending = 0
        self.conv[self.parity].write(f32(conv).view(np.uint8).reshape(-1))
        raw = gdn_state_bytes(S, c)
        self.state.write(raw)
        self.st.conv[0] = f32(conv).copy()
        self.st.recurrent[0] = f32(gdn_folded(*self.state_parts()))

    def step_encode(self, p, qkv, z, b, a, splits=GDN_DECODE_SPLITS, label=""):
        """Encodes one step on compute pass ``p`` (conv state parity flips); returns the y and
        ssq buffers (gdn_decode_dispatch). ``z`` is not read: out_proj applies it (:meth:`normed`)."""
        dev = self.dev
        Q, B, A = upload(dev, qkv), upload(dev, b), upload(dev, a)
        out, ssq = dev.buffer(self.Hv * self.Dv * 4), dev.buffer(self.Hv * splits * 4)
        cin, cout = self.conv[self.parity], self.conv[1 - self.parity]
        write_back = self.pending + 1 == self.window
        gdn_decode_dispatch(p, self.kernel, self.Hk, self.Hv, self.Dv, self.K, Q, B, A, self.w[:3],
                            cin, cout, self.state, out, ssq, self.ring, splits, label, self.pending, write_back)
        self.pending = 0 if write_back else self.pending + 1
        self.parity ^= 1
        return out, ssq

    def write_back(self, splits=GDN_DECODE_SPLITS):
        """Runs gdn_state_writeback if steps are pending (the state then holds every step)."""
        if self.pending:
            cb = self.dev.command_buffer()
            gdn_writeback_dispatch(cb.compute_pass(), self.Hk, self.Hv, self.Dk, self.Dv, self.K, self.state,
                                   self.ring, self.pending, splits)
            cb.commit()
            cb.wait()
            self.pending = 0

    def normed(self, out, ssq, z):
        """The gated-norm output (out_proj's input, gdn_gated_norm32) from a step's buffers;
        also keeps y and ssq (float32) as ``last_y`` / ``last_ssq``."""
        self.last_y, self.last_ssq = download(out, np.float32), download(ssq, np.float32)
        return gdn_gated_norm32(self.last_y, self.last_ssq, z, self.norm_w, self.Dv)

    def step_device(self, qkv, z, b, a, splits=GDN_DECODE_SPLITS):
        """One step on the device; returns the gated-norm output [Hv*Dv] (:meth:`normed`)."""
        cb = self.dev.command_buffer()
        p = cb.compute_pass()
        t = time.perf_counter()
        out, ssq = self.step_encode(p, qkv, z, b, a, splits)
        cb.commit()
        cb.wait()
        self.seconds += time.perf_counter() - t
        return self.normed(out, ssq, z)

    def step_reference(self, qkv, z, b, a):
        o = self.oracle
        o.proj = {"in_proj_qkv": qkv[None], "in_proj_z": z[None], "in_proj_b": b[None], "in_proj_a": a[None]}
        return o.gated_deltanet(0, np.zeros((1, 1), np.float32), self.st)[0]

    def state_parts(self):
        """S' [Hv, Dv, Dk] and c [Hv, Dv] as the device holds them, once written back."""
        self.write_back()
        return gdn_state_parts(self.state, self.Hv, self.Dv, self.Dk)

    def device_state(self):
        """The conv state and the recurrent state c * S' (float64)."""
        C, K = self.conv_dim, self.K
        return download(self.conv[self.parity], np.float32, (K - 1, C)), gdn_folded(*self.state_parts())


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

    def __init__(self, dev, Hq, Hkv, D, rot, capacity, seed=0, rng=None):
        self.dev, self.Hq, self.Hkv, self.D, self.rot, self.cap = dev, Hq, Hkv, D, rot, capacity
        self.rng = rng = rng if rng is not None else np.random.default_rng(seed)
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
        p.dispatch(f"attn_combine_d{D}", (Hq, D // 32), COMBINE_TG,
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
        p.dispatch(f"attn_combine_d{D}", (Hq, D // 32), COMBINE_TG,
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


def qk_prep_reference(A, qg, k, pos):
    """q [Hq, D] and k [Hkv, D] after RMSNorm + RoPE at position pos (lily.reference's
    helpers, in the order ReferenceModel.attention applies them) for layer A."""
    D, P = A.D, np.array([pos])
    q_ref = rope(rms_norm(qg[None, :, :D], from_bf16(A.qn), 1e-6), P, A.rot, THETA)[0]
    k_ref = rope(rms_norm(k[None], from_bf16(A.kn), 1e-6), P, A.rot, THETA)[0]
    return q_ref, k_ref


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


# ----------------------------------------------------------------------------- prefill attention

# (Hq, Hkv, D, rotary_dim)
PREFILL_ATTN_DIMS = {
    "real": (16, 2, 256, 64),
    "dims": (8, 1, 256, 64),
    "tiny": (4, 2, 64, 16),
    "wide64": (8, 1, 64, 16),  # D = 64 with 8 query heads per KV head: G = 8, 4, 2
}
PREFILL_EPS = 1e-6
TILE = 32  # KV rows per tile (kTile)
QROWS = 64  # (row, head) pairs per threadgroup (kRows)
RESCALE = 8.0  # lazy rescale threshold (kRescale)


def pack_bf16_q(q, G):
    """The tensor-op attention's query operand (attn_prefill_prep_d<D>_qbf): q [M, Hq, D] fp32
    times the softmax scale D^-0.5 in fp32, rounded to bf16 (nearest even), as bf16 bit
    patterns (uint16) laid out [Hq / G, M, G, D] (a threadgroup's pairs are consecutive rows)."""
    M, Hq, D = q.shape
    qs = bf16_bits(f32(q) * np.float32(float(D) ** -0.5))
    return np.ascontiguousarray(qs.reshape(M, Hq // G, G, D).transpose(1, 0, 2, 3))


def unpack_bf16_q(qb, G):
    """pack_bf16_q's inverse up to its rounding: [Hq / G, M, G, D] bf16 bits -> q [M, Hq, D]
    fp32 (divided by the scale, a power of two for D = 64 and 256: exact), so that the twin's
    bf16(q * scale) gives back the kernel's operand."""
    Hg, M, _, D = qb.shape
    return f32(from_bf16(qb) / np.float32(float(D) ** -0.5)).transpose(1, 0, 2, 3).reshape(M, Hg * G, D)


def chunk_inputs(rng, M, Hq, Hkv, D):
    """Projection outputs of a chunk: qg [M, Hq*2D], k, v [M, Hkv*D], float32 holding half
    values (q_proj, k_proj, v_proj store half: gemm_q4_half), so the decode kernels' fp32
    inputs and the chunk kernels' half inputs are the same numbers."""
    return tuple(half_operand(rng.standard_normal((M, n))).astype(np.float32)
                 for n in (Hq * 2 * D, Hkv * D, Hkv * D))


class PrefillAttnLayer:
    """Device KV cache and norm weights of one attention layer, and encoders for the prefill
    kernels with the declared ranges of docs/prefill.md."""

    def __init__(self, dev, dims, capacity, seed=0, *, G=None, history=None, rng=None, tensor=False):
        self.dev = dev
        self.tensor = tensor  # the attention kernels' tensor-op variants (*_tensor)
        self.Hq, self.Hkv, self.D, self.rot = PREFILL_ATTN_DIMS[dims]
        self.cap = capacity
        self.G = G if G is not None else min(8, self.Hq // self.Hkv)
        rng = rng if rng is not None else np.random.default_rng(seed)
        D = self.D
        self.qn = bf16_bits(1 + 0.1 * rng.standard_normal(D))
        self.kn = bf16_bits(1 + 0.1 * rng.standard_normal(D))
        self.QN, self.KN = upload(dev, self.qn), upload(dev, self.kn)
        if history is None:
            history = (bf16_bits(rng.standard_normal((self.Hkv, capacity, D))),
                       bf16_bits(rng.standard_normal((self.Hkv, capacity, D))))
        self.k_hist, self.v_hist = (h.copy() for h in history)
        self.KC, self.VC = upload(dev, self.k_hist), upload(dev, self.v_hist)

    def poison_from(self, n):
        """Cache rows >= n become NaN (reading past the causal range shows up)."""
        nan = np.uint16(0x7FC0)
        self.k_hist[:, n:], self.v_hist[:, n:] = nan, nan
        self.KC.write(self.k_hist.view(np.uint8).reshape(-1))
        self.VC.write(self.v_hist.view(np.uint8).reshape(-1))

    def cache(self):
        shape = (self.Hkv, self.cap, self.D)
        return download(self.KC, np.uint16, shape), download(self.VC, np.uint16, shape)

    def rows(self, r0, r1):
        """Byte ranges of cache rows [r0, r1) of every KV head, in K and V."""
        row = 2 * self.D
        if r1 <= r0:
            return []
        return [(C, (h * self.cap + r0) * row, (r1 - r0) * row) for C in (self.KC, self.VC)
                for h in range(self.Hkv)]

    def input_buffers(self, qg, k, v):
        """The projections as the chunk kernels read them: half buffers (saturated)."""
        return tuple(upload(self.dev, half_activations(x)) for x in (qg, k, v))

    # ---- encoders (into a compute pass p)

    def encode_prep(self, p, QG, K, V, p0, M, label=""):
        Hq, Hkv, D = self.Hq, self.Hkv, self.D
        Q = self.dev.buffer(M * Hq * D * (2 if self.tensor else 4))
        args = args_bytes(Hq, Hkv, self.rot, self.cap, p0, M, PREFILL_EPS, float(np.log2(THETA)),
                          float(D) ** -0.5, self.G)
        sfx = "_qbf" if self.tensor else ""  # the tensor-op attention's bfloat q (pack_bf16_q)
        p.dispatch(f"attn_prefill_prep_d{D}{sfx}", (-(-M // 8), Hq + Hkv), 256,
                   buffers=[(0, QG), (1, K), (2, V), (3, self.QN), (4, self.KN), (5, self.KC),
                            (6, self.VC), (7, Q)],
                   constants=[(8, args)], reads=[QG, K, V, self.QN, self.KN],
                   writes=[Q, *self.rows(p0, p0 + M)], threadgroups=True, label=label)
        return Q

    def attn_args(self, p0, M, split_rows=0, num_splits=0):
        return args_bytes(self.Hq, self.Hkv, self.cap, p0, M, float(self.D) ** -0.5,
                          split_rows, num_splits)

    def encode_attn(self, p, Q, QG, p0, M, *, split=None, label=""):
        """split=None: attn_prefill; split=(S, num_splits): split kernel + combine."""
        Hq, D, G = self.Hq, self.D, self.G
        OUT = self.dev.buffer(M * Hq * D * 2)  # half (o_proj's input)
        sfx = "_tensor" if self.tensor else ""
        threads = 256  # both paths (kThreads)
        blocks = -(-M // (QROWS // G))
        reads = [Q, *self.rows(0, p0 + M)]
        if split is None:
            p.dispatch(f"attn_prefill_d{D}_g{G}{sfx}", (blocks, Hq // G), threads,
                       buffers=[(0, Q), (1, QG), (2, self.KC), (3, self.VC), (4, OUT)],
                       constants=[(5, self.attn_args(p0, M))], reads=[*reads, QG], writes=[OUT],
                       threadgroups=True, label=label)
            return OUT
        S, ns = split
        assert ns * S >= p0 + M
        ML, PO = self.dev.buffer(ns * M * Hq * 8), self.dev.buffer(ns * M * Hq * D * 4)
        args = self.attn_args(p0, M, S, ns)
        p.dispatch(f"attn_prefill_split_d{D}_g{G}{sfx}", (blocks, Hq // G, ns), threads,
                   buffers=[(0, Q), (1, self.KC), (2, self.VC), (3, ML), (4, PO)],
                   constants=[(5, args)], reads=reads, writes=[ML, PO], threadgroups=True,
                   label=label)
        p.dispatch(f"attn_prefill_combine_d{D}", (Hq, M), D,
                   buffers=[(0, ML), (1, PO), (2, QG), (3, OUT)], constants=[(4, args)],
                   reads=[ML, PO, QG], writes=[OUT], threadgroups=True, label=label)
        return OUT

    # ---- one-shot helpers (own command buffer)

    def run(self, fn):
        cb = self.dev.command_buffer()
        p = cb.compute_pass()
        r = fn(p)
        cb.commit()
        cb.wait()
        return cb, r

    def prefill(self, qg, k, v, p0, split=None):
        """prep + attention of one chunk in one pass; returns (out [M, Hq*D], q [M, Hq, D], cb)."""
        M = qg.shape[0]
        QG, K, V = self.input_buffers(qg, k, v)

        def enc(p):
            Q = self.encode_prep(p, QG, K, V, p0, M, label="prep")
            return Q, self.encode_attn(p, Q, QG, p0, M, split=split, label="attn")

        cb, (Q, OUT) = self.run(enc)
        return self.download_out(OUT, M), self.download_q(Q, M), cb

    def download_out(self, OUT, M):
        """The attention output (stored half) as float32 [M, Hq*D]."""
        return download(OUT, np.float16, (M, self.Hq * self.D)).astype(np.float32)

    def download_q(self, Q, M):
        """The prep's q as fp32 [M, Hq, D] (on the tensor path: unpack_bf16_q)."""
        if not self.tensor:
            return download(Q, np.float32, (M, self.Hq, self.D))
        return unpack_bf16_q(download(Q, np.uint16, (self.Hq // self.G, M, self.G, self.D)), self.G)

    def attention_only(self, q, qg, p0, split=None):
        M = q.shape[0]
        Q, QG = upload(self.dev, pack_bf16_q(q, self.G) if self.tensor else q), upload(self.dev, half_activations(qg))
        _, OUT = self.run(lambda p: self.encode_attn(p, Q, QG, p0, M, split=split))
        return self.download_out(OUT, M)


def attention64(q, qg, K, V, p0):
    """float64 causal attention: row i of q [M, Hq, D] over K, V [Hkv, >= p0+M, D] rows
    [0, p0 + i]; output * sigmoid(gate) as [M, Hq*D]."""
    M, Hq, D = q.shape
    Hkv = K.shape[0]
    group = Hq // Hkv
    gate = qg.reshape(M, Hq, 2 * D)[:, :, D:].astype(np.float64)
    out = np.empty((M, Hq, D))
    for h in range(Hq):
        k = K[h // group, : p0 + M].astype(np.float64)
        v = V[h // group, : p0 + M].astype(np.float64)
        s = q[:, h].astype(np.float64) @ k.T * D ** -0.5                       # [M, p0+M]
        s = np.where(np.arange(p0 + M)[None, :] <= (p0 + np.arange(M))[:, None], s, -np.inf)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (e / e.sum(axis=1, keepdims=True)) @ v
    return (out / (1 + np.exp(-gate))).reshape(M, Hq * D)


def attention_twin(q, qg, K, V, p0, split_rows=None, *, bf16=False):
    """The prefill attention kernels' arithmetic (metal/attention_prefill.metal, bf16=False;
    attention_prefill_tensor.metal, bf16=True): row i of q [M, Hq, D] over K, V [Hkv, >= p0+M,
    D] (bf16 values; within the half range for bf16=False, else clipped to it first, as the
    kernel's tiles are) rows [0, p0 + i], gated, as [M, Hq*D]. Modelled as the kernel
    computes it: q * scale rounded to the operand type (half, or bf16 with bf16=True; K, V
    bf16 -> half exact, or taken as they are), each score an fp32 sum of the exact products
    (11 x 11 or 8 x 8 significant bits fit in fp32's 24) in order over D (the simulator's
    product order), keys walked in tiles of TILE from the start of each split of
    ``split_rows`` keys (None: one range), a row's reference max moved only when a tile's max
    exceeds it by more than RESCALE, P = exp(s - m) in fp32 rounded to the operand type, l
    the sum of the rounded P; the rest (P V, l, the split merge of attn_prefill_combine, the
    gate) in float64, where the kernel's fp32 accumulation differs from it by float32
    rounding. Not modelled: the kernels store the result as half (ATTN_OUT_RTOL)."""
    M, Hq, D = q.shape
    Hkv = K.shape[0]
    group = Hq // Hkv
    n = p0 + M
    f16, f32_ = np.float16, np.float32

    def operand(x):  # fp32 -> the matrix operand type, as fp32 values
        return round_bf16(x) if bf16 else x.astype(f16).astype(f32_)

    qh = operand(q.astype(f32_) * f32_(1.0 / np.sqrt(D)))
    S = split_rows or n
    segments = [(b, min(b + S, n)) for b in range(0, n, S)]
    pos = p0 + np.arange(M)
    gate = qg.reshape(M, Hq, 2 * D)[:, :, D:].astype(np.float64)
    out = np.empty((M, Hq, D))
    for h in range(Hq):
        k = f32(K[h // group, :n]) if bf16 else K[h // group, :n].astype(f16).astype(f32_)
        v = V[h // group, :n].astype(np.float64)
        prod = qh[:, h, None, :] * k[None, :, :]  # exact in fp32
        s = np.zeros((M, n), f32_)
        for d in range(D):
            s += prod[:, :, d]
        s = np.where(np.arange(n)[None, :] <= pos[:, None], s, f32_(-np.inf))
        parts = []
        for b, e in segments:
            m = np.full(M, -np.inf, f32_)
            l, o = np.zeros(M), np.zeros((M, D))
            for t0 in range(b, e, TILE):
                st = s[:, t0:min(t0 + TILE, e)]
                mx = st.max(axis=1)
                jump = mx > m + f32_(RESCALE)
                with np.errstate(invalid="ignore", over="ignore"):  # entries np.where drops
                    corr = np.where(jump & (m != -np.inf), np.exp((m - mx).astype(np.float64)), 1.0)
                m = np.where(jump, mx, m)
                mref = np.where(m == -np.inf, f32_(0), m)
                p = operand(np.exp((st - mref[:, None]).astype(np.float64)).astype(f32_)).astype(np.float64)
                l = l * corr + p.sum(axis=1)
                o = o * corr[:, None] + p @ v[t0:t0 + st.shape[1]]
            parts.append((m.astype(np.float64), l, o))
        ns = np.minimum(pos // S + 1, len(segments))  # splits holding keys <= pos (the combine's)
        ms = np.stack([pm for pm, _, _ in parts])
        ms = np.where(np.arange(len(parts))[:, None] < ns[None, :], ms, -np.inf)
        mx = ms.max(axis=0)
        w = np.exp(ms - mx[None, :])
        L = sum(w[z] * parts[z][1] for z in range(len(parts)))
        O = sum(w[z][:, None] * parts[z][2] for z in range(len(parts)))
        out[:, h] = O / L[:, None]
    return (out / (1 + np.exp(-gate))).reshape(M, Hq * D)


def prep_reference(L, qg, k, p0):
    """q [M, Hq, D] and k [M, Hkv, D] after RMSNorm + RoPE (lily.reference helpers)."""
    M, Hq, Hkv, D = qg.shape[0], L.Hq, L.Hkv, L.D
    P = p0 + np.arange(M)
    q = rope(rms_norm(qg.reshape(M, Hq, 2 * D)[:, :, :D], from_bf16(L.qn), PREFILL_EPS), P, L.rot, THETA)
    kk = rope(rms_norm(k.reshape(M, Hkv, D), from_bf16(L.kn), PREFILL_EPS), P, L.rot, THETA)
    return q, kk


# ----------------------------------------------------------------------------- prefill Gated DeltaNet

GDN_PREFILL_DIMS = {  # Hk, Hv, Dk, Dv
    "real": (16, 32, 128, 128),
    "dims": (2, 4, 128, 128),
    "tiny": (2, 4, 32, 32),
}
GDN_K = 4          # conv taps (the model's and every preset's linear_conv_kernel_dim)
GDN_EPS = 1e-6     # rms_norm_eps and the L2-norm eps
GDN_SCAN_LANES = 4  # lanes per state row of gdn_scan (kGdnScanLanesPerRow, metal/prefill_args.h)
SPARE_ROWS = 3     # chunk buffers hold M + SPARE_ROWS rows; only M are declared


def rows_buffer(dev, x, spare=SPARE_ROWS, dtype=np.float32):
    """A device buffer holding the rows of ``x`` (as ``dtype``) followed by ``spare`` poisoned
    rows, and the declared range of the real rows."""
    x = np.ascontiguousarray(x, dtype)
    row = x[0].nbytes if x.ndim > 1 else x.itemsize
    buf = dev.buffer(x.nbytes + spare * row)
    buf.write(x.reshape(-1).view(np.uint8))
    return buf, (buf, 0, x.nbytes)


def rows_out_buffer(dev, rows, width, spare=SPARE_ROWS, itemsize=4):
    buf = dev.buffer((rows + spare) * width * itemsize)
    return buf, (buf, 0, rows * width * itemsize)


class GdnPrefillLayer:
    """Weights, session state (two conv-state buffers, the recurrent state) and inputs of one
    GDN layer on the device, with the encoders of the prefill and decode kernels."""

    def __init__(self, dev, dims, seed=0, rng=None):
        self.dev = dev
        self.Hk, self.Hv, self.Dk, self.Dv = Hk, Hv, Dk, Dv = GDN_PREFILL_DIMS[dims]
        self.C = C = 2 * Hk * Dk + Hv * Dv
        self.rng = r = rng if rng is not None else np.random.default_rng(seed)
        self.conv_w = bf16_bits(r.normal(0, 0.3, (C, GDN_K)))
        self.dt_bias = bf16_bits(r.uniform(-5, -2, Hv))
        self.A_log = f32(r.uniform(0.0, np.log(16.0), Hv))
        self.norm_w = bf16_bits(1 + 0.1 * r.standard_normal(Dv))
        self.W = [upload(dev, self.conv_w), upload(dev, self.A_log), upload(dev, self.dt_bias),
                  upload(dev, self.norm_w)]
        self.CS = [dev.buffer((GDN_K - 1) * C * 4), dev.buffer((GDN_K - 1) * C * 4)]  # conv state by parity
        self.S = dev.buffer(gdn_state_floats(Hv, Dv, Dk) * 4)  # S' then c
        # the library's scan for these dims; its name gives RV, the state rows per threadgroup
        self.scan_kernel = next(n for n in dev.kernel_names() if n.startswith(f"gdn_scan_k{Dk}_v{Dv}_r"))
        self.RV = int(self.scan_kernel.rsplit("_r", 1)[1])
        self.S_splits = Dv // self.RV  # splits of a head: the scan's sums of y^2 and norm factors per split
        self.norm_kernel = f"gdn_norm_scale_v{Dv}_r{self.RV}"
        self.decode_kernel = f"gdn_decode_step_k{Dk}_v{Dv}"
        self.ring = dev.buffer(gdn_ring_entry(Hk, Hv, Dk, Dv) * 4)  # bound; every step writes back

    # ---- state and inputs
    def set_state(self, conv, S, parity=0, c=None):
        """Conv state (buffer ``parity``) and recurrent state S' = ``S`` with pending decay
        ``c`` (scalar, [Hv] or [Hv, Dv]; default 1): the state is c * S'
        (:meth:`state`)."""
        self.CS[parity].write(f32(conv).view(np.uint8).reshape(-1))
        self.S.write(gdn_state_bytes(S, c))

    def random_state(self, parity=0, c=None):
        """A random conv state and S' (|S| ~ 0.3 / c), pending decay ``c`` (default 1).
        Returns the conv state and the recurrent state c * S' (float32 S' itself when c is
        None; float64 otherwise)."""
        r = self.rng
        conv = f32(r.standard_normal((GDN_K - 1, self.C)))
        S = f32(0.3 * r.standard_normal((self.Hv, self.Dv, self.Dk)))
        if c is not None:  # S' = S / c (rows with c = 0 hold S = 0 whatever S' is)
            cr = gdn_rows(c, S.shape[:2])[..., None]
            S = f32(np.where(cr > 0, S / np.where(cr > 0, cr, 1), S))
        self.set_state(conv, S, parity, c)
        return conv, (S if c is None else self.state())

    def conv_state(self, parity):
        return download(self.CS[parity], np.float32, (GDN_K - 1, self.C))

    def state_parts(self):
        """S' [Hv, Dv, Dk] and c [Hv, Dv] as the device holds them."""
        return gdn_state_parts(self.S, self.Hv, self.Dv, self.Dk)

    def state(self):
        """The recurrent state c * S' (float64; exact from the device's float32 parts)."""
        return gdn_folded(*self.state_parts())

    def inputs(self, M):
        """Random projections qkv, z, b, a (float32); z holds half values (in_proj_z stores
        half), so the decode step's fp32 z and the chunk's half z are the same numbers."""
        r = self.rng
        return (f32(r.standard_normal((M, self.C))), half_operand(r.standard_normal((M, self.Hv * self.Dv))).astype(np.float32),
                f32(r.standard_normal((M, self.Hv))), f32(r.standard_normal((M, self.Hv))))

    def input_buffers(self, qkv, z, b, a):
        """The projections as the chunk kernels read them (rows_buffer pairs): z half, the
        others fp32."""
        return (rows_buffer(self.dev, qkv), rows_buffer(self.dev, z, dtype=np.float16),
                rows_buffer(self.dev, b), rows_buffer(self.dev, a))

    # ---- encoders (declared ranges as the runtime will declare them)
    def encode_scan(self, p, qkv, cin, z, b, a, outs, M):
        """gdn_scan (conv inline from ``qkv`` and the conv state ``cin``; u (half) and the
        splits' sums of y^2 (fp32)) then gdn_norm_scale (the splits' half factors), as the
        runtime does. ``qkv``, ``z``, ``b``, ``a``: (buffer, declared range) pairs from
        rows_buffer; ``outs``: out_buffers(M)."""
        (O, o_rng), (SS, ss_rng), (F, f_rng) = outs
        # RV * kGdnScanLanesPerRow threads; one thread per (token, head) in the norm scale
        p.dispatch(self.scan_kernel, (self.Hv, self.Dv // self.RV, 1), (self.RV * GDN_SCAN_LANES, 1, 1),
                   buffers=list(enumerate([qkv[0], self.W[0], cin, b[0], a[0], self.W[1], self.W[2], self.S, O]))
                   + [(10, z[0]), (11, self.W[3]), (12, SS)],
                   constants=[(9, args_bytes(self.Hk, self.Hv, M, GDN_EPS, GDN_EPS))],
                   reads=[qkv[1], self.W[0], cin, b[1], a[1], self.W[1], self.W[2], self.S, z[1], self.W[3]],
                   writes=[self.S, o_rng, ss_rng], threadgroups=True, label=self.scan_kernel)
        p.dispatch(self.norm_kernel, -(-M * self.Hv // 256), 256, buffers=[(0, SS), (1, F)],
                   constants=[(2, args_bytes(self.Hk, self.Hv, M, GDN_EPS, GDN_EPS))],
                   reads=[ss_rng], writes=[f_rng], threadgroups=True, label=self.norm_kernel)

    def encode_conv_state(self, p, qkv, M, cin, cout, tg=256):
        """gdn_conv_state: the conv state after M rows of ``qkv`` (may be ``cin`` itself)."""
        tail = min(M, GDN_K - 1) * self.C * 4  # declared: only the last K-1 rows it copies
        p.dispatch("gdn_conv_state", -(-self.C // tg), tg,
                   buffers=[(0, qkv[0]), (1, cin), (2, cout)], constants=[(3, args_bytes(self.C, M))],
                   reads=[(qkv[0], M * self.C * 4 - tail, tail), cin], writes=[cout], threadgroups=True,
                   label="gdn_conv_state")

    def chunk(self, qkv, z, b, a, p0):
        """One chunk at positions p0 .. p0+M-1: the scan (conv state buffer p0 % 2), the norm
        scale and the next conv state (buffer (p0+M) % 2), in one concurrent pass (barriers
        from the declared ranges). Returns the gated-norm output as out_proj stages it
        [M, Hv*Dv] (:meth:`normed`)."""
        dev, M = self.dev, len(qkv)
        Q, Z, B, A = self.input_buffers(qkv, z, b, a)
        outs = self.out_buffers(M)
        cin, cout = self.CS[p0 % 2], self.CS[(p0 + M) % 2]
        cb = dev.command_buffer()
        p = cb.compute_pass()
        self.encode_scan(p, Q, cin, Z, B, A, outs, M)
        self.encode_conv_state(p, Q, M, cin, cout)
        cb.commit()
        cb.wait()
        assert [rec["stage"] for rec in cb.dispatch_log] == [0, 1, 1]
        return self.normed(outs, M)[:M]

    def out_buffers(self, M):
        """The scan's u (half) and sums of y^2 (fp32, per split) and the norm scale's factors
        (half, per split) for M rows, with spare rows (rows_out_buffer pairs)."""
        return (rows_out_buffer(self.dev, M, self.Hv * self.Dv, itemsize=2),
                rows_out_buffer(self.dev, M, self.Hv * self.S_splits),
                rows_out_buffer(self.dev, M, self.Hv * self.S_splits, itemsize=2))

    def normed(self, outs, M):
        """The gated-norm output as out_proj (gemm_q4_add_hs) stages it, half(u * f) per element
        (numpy's float16 product: the GEMM's half multiply), from ``outs`` (out_buffers) as
        float32 [M + SPARE_ROWS, Hv*Dv]."""
        u = download(outs[0][0], np.float16, (M + SPARE_ROWS, self.Hv * self.Dv))
        f = download(outs[2][0], np.float16, (M + SPARE_ROWS, self.Hv * self.S_splits))
        return (u * np.repeat(f, self.RV, axis=1)).astype(np.float32)

    def decode_step(self, qkv, z, b, a, pos):
        """gdn_decode_step on one token at position pos (conv state pos % 2 -> (pos+1) % 2),
        then the gated norm out_proj applies on load (gdn_gated_norm32)."""
        dev = self.dev
        Q, B, A = upload(dev, qkv), upload(dev, b), upload(dev, a)
        out, ssq = dev.buffer(self.Hv * self.Dv * 4), dev.buffer(self.Hv * GDN_DECODE_SPLITS * 4)
        cin, cout = self.CS[pos % 2], self.CS[(pos + 1) % 2]
        cb = dev.command_buffer()
        p = cb.compute_pass()
        gdn_decode_dispatch(p, self.decode_kernel, self.Hk, self.Hv, self.Dv, GDN_K, Q, B, A, self.W[:3],
                            cin, cout, self.S, out, ssq, self.ring)
        cb.commit()
        cb.wait()
        return gdn_gated_norm32(download(out, np.float32), download(ssq, np.float32), z, self.norm_w, self.Dv)

    # ---- references
    def oracle(self):
        cfg = types.SimpleNamespace(linear_num_key_heads=self.Hk, linear_num_value_heads=self.Hv,
                                    linear_key_head_dim=self.Dk, linear_value_head_dim=self.Dv,
                                    linear_conv_kernel_dim=GDN_K, rms_norm_eps=GDN_EPS, conv_dim=self.C)
        return StubOracle(cfg, {"conv1d.weight": from_bf16(self.conv_w)[:, :, None],
                                "dt_bias": from_bf16(self.dt_bias), "A_log": self.A_log,
                                "norm.weight": from_bf16(self.norm_w)})

    def conv_reference(self, qkv, conv_state):
        """float64 silu(causal conv) over [state | qkv]; the new state (last K-1 inputs); and
        the per-element magnitude sum_j |w_j x_j| for the tolerance."""
        w = from_bf16(self.conv_w).astype(np.float64)
        seq = np.concatenate([conv_state, qkv]).astype(np.float64)
        M = len(qkv)
        terms = [seq[j:j + M] * w[:, j] for j in range(GDN_K)]
        return silu(sum(terms)), f32(seq[-(GDN_K - 1):]), sum(np.abs(t) for t in terms)

    def scan_reference(self, conv, z, b, a, S, factors=False):
        """float64 scan of one chunk from the conv output (docs/model.md; the reference's loop).

        Returns the outputs o [M, Hv*Dv], the new state, and per output the error scale
        ``kappa * (|o| + |norm_w * silu(z)|)`` where ``kappa = rms_v(sum_k |S_vk q_k|) /
        rms_v(y_v)`` is the cancellation factor of the head's y = S q (the RMSNorm divides by
        rms(y), so an error relative to the terms of y is amplified by kappa). ``factors``: also
        the splits' norm factors sqrt(p_s / Dv + eps) / rms(y) per output (gdn_stored)."""
        Hk, Hv, Dk, Dv, M = self.Hk, self.Hv, self.Dk, self.Dv, len(conv)
        conv = conv.astype(np.float64)
        q = conv[:, :Hk * Dk].reshape(M, Hk, Dk)
        k = conv[:, Hk * Dk:2 * Hk * Dk].reshape(M, Hk, Dk)
        v = conv[:, 2 * Hk * Dk:].reshape(M, Hv, Dv)
        q = np.repeat(l2_norm(q, GDN_EPS) / np.sqrt(Dk), Hv // Hk, axis=1)
        k = np.repeat(l2_norm(k, GDN_EPS), Hv // Hk, axis=1)
        beta = sigmoid(b.astype(np.float64))
        g = np.exp(-np.exp(self.A_log.astype(np.float64))
                   * np.logaddexp(0.0, a + from_bf16(self.dt_bias).astype(np.float64)))
        S = S.astype(np.float64)
        y = np.empty((M, Hv, Dv))
        mag = np.empty((M, Hv, Dv))
        for t in range(M):
            S = S * g[t][:, None, None]
            delta = (v[t] - np.einsum("hvk,hk->hv", S, k[t])) * beta[t][:, None]
            S = S + delta[:, :, None] * k[t][:, None, :]
            y[t] = np.einsum("hvk,hk->hv", S, q[t])
            mag[t] = np.einsum("hvk,hk->hv", np.abs(S), np.abs(q[t]))
        rms = np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + GDN_EPS)
        gate = from_bf16(self.norm_w) * silu(z.astype(np.float64).reshape(M, Hv, Dv))
        o = y / rms * gate
        kappa = np.sqrt(np.mean(mag * mag, axis=-1, keepdims=True)) / rms
        scale = kappa * (np.abs(o) + np.abs(gate))
        out = o.reshape(M, Hv * Dv), S, scale.reshape(M, Hv * Dv)
        if not factors:
            return out
        p = (y * y).reshape(M, Hv, self.S_splits, self.RV).sum(-1)
        f = np.repeat(np.sqrt(p / Dv + GDN_EPS), self.RV, axis=-1).reshape(M, Hv, Dv) / rms
        return (*out, f.reshape(M, Hv * Dv))


# ----------------------------------------------------------------------------- norm + GEMV

NORM_EPS = 1e-6


def norm_gemv_grid(rows, tg=TG, rps=NORM_GEMV_ROWS_PER_SG):
    """Threadgroups of a norm_gemv dispatch with ``rps`` rows per simdgroup: each matrix
    padded to whole threadgroups."""
    per = rps * tg // 32
    return sum(-(-r // per) for r in rows)


def norm_gemv_args(rows, cols, eps, write_xn, rps=NORM_GEMV_ROWS_PER_SG):
    """NormGemvArgs {rows[4], cols, eps, write_xn, rows_per_simdgroup} (32 bytes)."""
    rows = list(rows) + [0] * (4 - len(rows))
    return constant(*rows, cols) + np.float32(eps).tobytes() + constant(int(write_xn), rps)


def _bind(i, spec):
    return (i, spec[0], spec[1]) if isinstance(spec, tuple) else (i, spec)


def enc_norm_gemv(p, bits, X, NW, XN, mats, cols, eps=NORM_EPS, write_xn=True, tg=TG, extra=0, label=None,
                  rps=NORM_GEMV_ROWS_PER_SG):
    """Encodes norm_gemv_q{bits} with its declared ranges (docs/kernels.md).
    mats: up to four (rows, (W, S, B), Y), each binding a Buffer or (Buffer, offset, size).
    Slots past len(mats) are unused (rows 0) and bound to arbitrary buffers."""
    rows = [m[0] for m in mats]
    buffers = [(0, X), (1, NW), (2, XN)]
    reads, writes = [X, NW], ([XN] if write_xn else [])
    for i in range(4):
        if i < len(mats):
            r, wsb, Y = mats[i]
            specs = [*wsb, Y]
            if r:
                reads += list(wsb)
                y = Y if isinstance(Y, tuple) else (Y, 0)
                writes.append((y[0], y[1], 4 * r))
        else:
            specs = [X, X, X, X]  # unused slot: bound (the simulator requires it), never accessed
        buffers += [_bind(3 + 4 * i + j, sp) for j, sp in enumerate(specs)]
    p.dispatch(f"norm_gemv_q{bits}", norm_gemv_grid(rows, tg, rps) + extra, tg, buffers=buffers,
               constants=[(19, norm_gemv_args(rows, cols, eps, write_xn, rps))], reads=reads, writes=writes,
               threadgroups=True, label=label or f"norm_gemv_q{bits}")


def rms_ref64(x, nw_bits, eps=NORM_EPS):
    x64 = np.asarray(x, np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64) + eps) * bf16_to_f32(nw_bits).astype(np.float64)


def enc_embed_norm_gemv(p, EW, ES, EB, T, H, NW, XN, mats, cols, vocab, write_xn, eps=NORM_EPS):
    """Encodes embed_norm_gemv_q4 (the decode step's first dispatch: the token's embedding
    row into H, then norm_gemv_q4 on it). mats: up to four (rows, (W, S, B) or None, Y); the
    slots past len(mats) are bound to NW (unused: rows 0)."""
    mats = list(mats) + [(0, None, NW)] * (4 - len(mats))
    rows = [r for r, _, _ in mats]
    buffers = [(0, H), (1, NW), (2, XN), (20, EW), (21, ES), (22, EB), (23, T)]
    reads, writes = [NW, EW, ES, EB, T], [H] + ([XN] if write_xn else [])
    for i, (r, wsb, Y) in enumerate(mats):
        specs = [*(wsb if wsb is not None else (NW, NW, NW)), Y]
        buffers += [(3 + 4 * i + j, sp) for j, sp in enumerate(specs)]
        if r:
            reads += list(wsb)
            writes.append(Y)
    p.dispatch("embed_norm_gemv_q4", norm_gemv_grid(rows), TG, buffers=buffers,
               constants=[(19, norm_gemv_args(rows, cols, eps, write_xn)), (24, constant(cols, vocab))],
               reads=reads, writes=writes, threadgroups=True, label="embed_norm_gemv_q4")


# ----------------------------------------------------------------------------- GEMM

def gemm_bound(K):
    """First-order relative error bound of a K-term fp32 dot product in the GEMM kernels' order."""
    return (K + 8) * U


def gemm_ref(x, qt: QuantizedTensor, index=None):
    """(exact, tol) of y = x W^T as the prefill GEMMs compute it (metal/gemm_tiles.h): both
    operands rounded to half (half_operand, half_weights), each product exact in fp32 (11 x
    11 significant bits), summed in fp32 in some order. exact is the float64 product of the
    rounded operands; tol = (K + 8) u M with M = |xh| |wh|^T (gemm_bound: the fp32 sum in any
    order) plus |xh| dw^T (a contracted dequantization). The half rounding itself is modelled,
    not tolerated, so the bound stays that of an fp32 GEMM."""
    xh = half_operand(x)
    wh, dw = half_weights(qt, index)
    ax = np.abs(xh)
    return xh @ wh.T, gemm_bound(x.shape[-1]) * (ax @ np.abs(wh).T) + ax @ dw.T


def swiglu_bound(g, u, dg, du):
    """h = silu(g) * u and a first-order bound of its error for |g err| <= dg, |u err| <= du:
    |silu'| <= 1.1, plus a few roundings of the activation itself."""
    h = silu(g) * u
    return h, 1.1 * np.abs(u) * dg + np.abs(silu(g)) * du + 8 * U * np.abs(h)


def swiglu_ref(x, g_q, u_q, index=None, scale=None):
    """silu(x Wg^T) * (x Wu^T) in float64 from the prefill GEMMs' half operands (gemm_ref)
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


ROW_SCALE_BINDING = 9  # gemm_swiglu_q4(_tensor): g at buffer(9), GemmRowScaleArgs at buffer(10)


def row_scale(rng, m, ld=3, col=2):
    """A row scale as gemm_swiglu_q4 reads it: column ``col`` of fp32 [m, ld] in [0, 1) (the
    routing weights' shared-gate column). Returns (the [m, ld] array, the column index)."""
    return rng.random((m, ld)).astype(np.float32), col


def row_scale_bindings(dev, w, col):
    """gemm_swiglu_q4's row-scale bindings for column ``col`` of ``w`` fp32 [m, ld]: the
    buffer bound at the column (ROW_SCALE_BINDING), GemmRowScaleArgs {ld} after it, and the
    range the kernel reads. Returns (buffers, constants, reads) for :func:`run` or a pass's
    dispatch."""
    m, ld = w.shape
    G, off = upload(dev, w), 4 * col
    return ([(ROW_SCALE_BINDING, G, off)], [(ROW_SCALE_BINDING + 1, constant(ld))],
            [(G, off, 4 * ((m - 1) * ld + 1))])


# ----------------------------------------------------------------------------- decode MoE

class MoeWeights:
    """Random MoE weights of one layer in the checkpoint's layout."""

    def __init__(self, rng, E, hidden, inter, inter_shared):
        self.E, self.hidden, self.inter, self.inter_shared = E, hidden, inter, inter_shared
        self.gate = rand_quant(rng, (E,), inter, hidden, 4, "switch_mlp.gate_proj")
        self.up = rand_quant(rng, (E,), inter, hidden, 4, "switch_mlp.up_proj")
        self.down = rand_quant(rng, (E,), hidden, inter, 4, "switch_mlp.down_proj")
        self.sgate = rand_quant(rng, (), inter_shared, hidden, 4, "shared_expert.gate_proj")
        self.sup = rand_quant(rng, (), inter_shared, hidden, 4, "shared_expert.up_proj")
        self.sdown = rand_quant(rng, (), hidden, inter_shared, 4, "shared_expert.down_proj")
        self.router = rand_quant(rng, (), E, hidden, 8, "gate")
        self.shared_gate = rand_quant(rng, (), 1, hidden, 8, "shared_expert_gate")

    @classmethod
    def from_checkpoint(cls, ck, layer):
        self = cls.__new__(cls)
        p = f"model.layers.{layer}.mlp"
        self.gate = ck.quantized(f"{p}.switch_mlp.gate_proj")
        self.up = ck.quantized(f"{p}.switch_mlp.up_proj")
        self.down = ck.quantized(f"{p}.switch_mlp.down_proj")
        self.sgate = ck.quantized(f"{p}.shared_expert.gate_proj")
        self.sup = ck.quantized(f"{p}.shared_expert.up_proj")
        self.sdown = ck.quantized(f"{p}.shared_expert.down_proj")
        self.router = ck.quantized(f"{p}.gate")
        self.shared_gate = ck.quantized(f"{p}.shared_expert_gate")
        self.E, self.inter, self.hidden = self.gate.weight.shape[0], self.gate.weight.shape[1], self.down.weight.shape[1]
        self.inter_shared = self.sgate.weight.shape[0]
        return self

    def upload(self, dev):
        self.bufs = {n: upload_q(dev, getattr(self, n)) for n in
                     ("gate", "up", "down", "sgate", "sup", "sdown", "router", "shared_gate")}
        return self.bufs

    def args(self, k):
        return constant(self.hidden, self.inter, self.inter_shared, self.E, k)

    # float64 oracle pieces, with first-order error magnitudes
    def swiglu(self, x, ids):
        """h [k*inter + inter_shared] (float64) and its error bound."""
        x64, ax = x.astype(np.float64), np.abs(x.astype(np.float64))
        hs, tols = [], []
        mats = [(self.gate, self.up, int(e)) for e in ids] + [(self.sgate, self.sup, None)]
        for g_q, u_q, e in mats:
            g = g_q.dequantize(e).astype(np.float64) @ x64
            u = u_q.dequantize(e).astype(np.float64) @ x64
            dg, du = DEPTH * U * (magnitude(g_q, e) @ ax), DEPTH * U * (magnitude(u_q, e) @ ax)
            h, tol = swiglu_bound(g, u, dg, du)
            hs.append(h)
            tols.append(tol)
        return np.concatenate(hs), np.concatenate(tols)

    def down_sum(self, h, ids, w, dh=None):
        """sum_j w_j Wd_j h_j (float64) and its error bound (plus dh propagated)."""
        k = len(ids)
        out = np.zeros(self.hidden)
        tol = np.zeros(self.hidden)
        dh = np.zeros_like(h) if dh is None else dh
        for j in range(k + 1):
            if j < k:
                q, e, sl = self.down, int(ids[j]), slice(j * self.inter, (j + 1) * self.inter)
            else:
                q, e, sl = self.sdown, None, slice(k * self.inter, k * self.inter + self.inter_shared)
            mag = magnitude(q, e)
            out += w[j] * (q.dequantize(e).astype(np.float64) @ h[sl])
            tol += abs(w[j]) * (DEPTH * U * (mag @ np.abs(h[sl])) + mag @ dh[sl])
        return out, tol


def enc_gate_up(p, W, bufs, X, ids_buf, H, k, ids=None):
    """Encodes moe_gate_up_swiglu_q4 with its declared ranges (docs/kernels.md).
    ids: known expert ids to declare exact expert slices, else whole stacks."""
    b = bufs
    rows = max(W.inter, W.inter_shared)
    grid = (-(-rows // (GATE_UP_ROWS_PER_SG * TG // 32)), k + 1)
    reads = [X, ids_buf, *b["sgate"], *b["sup"]]
    if ids is None:
        reads += [*b["gate"], *b["up"]]
    else:
        wb, sb = W.inter * W.hidden // 2, W.inter * W.hidden // 64 * 2
        for e in ids:
            for (w, s, bb) in (b["gate"], b["up"]):
                reads += [(w, int(e) * wb, wb), (s, int(e) * sb, sb), (bb, int(e) * sb, sb)]
    p.dispatch("moe_gate_up_swiglu_q4", grid, TG,
               buffers=[(0, X), (1, ids_buf), *[(2 + i, t) for i, t in enumerate([*b["gate"], *b["up"], *b["sgate"], *b["sup"]])],
                        (14, H)],
               constants=[(15, W.args(k))], reads=reads,
               writes=[(H, 0, 4 * (k * W.inter + W.inter_shared))], threadgroups=True,
               label="moe_gate_up_swiglu_q4")


def enc_down(p, W, bufs, H, ids_buf, wts, R, k):
    b = bufs
    p.dispatch("moe_down_q4", gemv_grid(W.hidden), TG,
               buffers=[(0, H), (1, ids_buf), (2, wts), *[(3 + i, t) for i, t in enumerate([*b["down"], *b["sdown"]])],
                        (9, R)],
               constants=[(10, W.args(k))],
               reads=[(H, 0, 4 * (k * W.inter + W.inter_shared)), ids_buf, (wts, 0, 4 * (k + 1)),
                      *b["down"], *b["sdown"], R],
               writes=[R], threadgroups=True, label="moe_down_q4")


def enc_route_gate_up(p, W, bufs, X, L, H, ids_buf, wts, k, norm_topk=True, tg=TG):
    """Encodes moe_route_gate_up_swiglu_q4 with its declared ranges (docs/kernels.md)."""
    b = bufs
    rows = max(W.inter, W.inter_shared)
    grid = (-(-rows // (GATE_UP_ROWS_PER_SG * tg // 32)), k + 1)
    experts = [*b["gate"], *b["up"], *b["sgate"], *b["sup"]]
    p.dispatch("moe_route_gate_up_swiglu_q4", grid, tg,
               buffers=[(0, X), (1, L), *[(2 + i, t) for i, t in enumerate(experts)], (14, H), (15, ids_buf), (16, wts)],
               constants=[(17, constant(W.hidden, W.inter, W.inter_shared, W.E, k, int(norm_topk)))],
               reads=[X, (L, 0, 4 * (W.E + 1)), *experts],
               writes=[(H, 0, 4 * (k * W.inter + W.inter_shared)), (ids_buf, 0, 4 * k), (wts, 0, 4 * (k + 1))],
               threadgroups=True, label="moe_route_gate_up_swiglu_q4")


# ----------------------------------------------------------------------------- prefill routing

def route_tg(E):
    """Recommended threadgroup of moe_route_topk / moe_route_scatter: round_up(E, 32)."""
    return min(1024, -(-E // 32) * 32)


def route_args(M, E, k, norm=True, block_rows=64, tile_rows=32):
    return constant(M, E, k, int(norm), block_rows, tile_rows)


def nblocks(M, R):
    return -(-M // R)


# Tile classes of the grouped expert GEMMs (metal/prefill_args.h, "Tile classes"; mirrored
# here as the oracle of moe_route_scatter): class c of a height-T tiling has height T >> c.

def tile_classes(T):
    return 1 if T >= 128 else 3 if T >= 64 else 2 if T >= 32 else 1


def tail_class(T, r):
    """The class of an expert's last tile of r rows (1 <= r <= T): the smallest that holds it."""
    heights = [T >> c for c in range(tile_classes(T))]
    return max(c for c, h in enumerate(heights) if r <= h)


def class_capacity(n, E, T, c):
    """Most tiles class c can hold for n assignments over E experts."""
    lo = (T >> (c + 1)) + 1 if c + 1 < tile_classes(T) else 1
    tails = min(E, n // lo)
    return tails if c > 0 else min(n // lo, n // T + tails)


def class_base(n, E, T, c):
    """First entry of class c's map in the tile-map buffer."""
    return sum(class_capacity(n, E, T, i) for i in range(c))


def max_tiles(M, k, E, T):
    """Entries of all class maps of a height-T tiling of M rows."""
    return class_base(M * k, E, T, tile_classes(T))


def route_ref_rows(logits, k, norm=True):
    """lily.reference.ReferenceModel.moe's routing of float32 logits [M, E(+1)]."""
    E = logits.shape[1] - 1
    p = softmax(logits[:, :E].astype(np.float32))
    top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, top, axis=-1)
    if norm:
        w = w / w.sum(axis=-1, keepdims=True)
    return top.astype(np.uint32), w


def block_hist(ids, E, R):
    """Histogram [blocks, E] of the assignments of each block of R rows."""
    M = ids.shape[0]
    out = np.zeros((nblocks(M, R), E), np.uint32)
    for b in range(out.shape[0]):
        out[b] = np.bincount(ids[b * R:(b + 1) * R].ravel(), minlength=E)
    return out


def tiles_ref(counts, T):
    """The tile maps of the grouped order, one [n_c, 4] array per class c: each expert's
    full T-row tiles in class 0, its remainder r (if any) as one tile of class tail_class(T, r);
    experts in order within a class."""
    start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    maps = [[] for _ in range(tile_classes(T))]
    for e, c in enumerate(int(x) for x in counts):
        for t in range(c // T):
            maps[0].append((e, start[e] + t * T, T, 0))
        if c % T:
            maps[tail_class(T, c % T)].append((e, start[e] + c - c % T, c % T, 0))
    return [np.array(m, np.uint32).reshape(-1, 4) for m in maps]


def enc_clear(p, bc, M, E, k, R, T):
    n = nblocks(M, R) * E
    p.dispatch("moe_route_clear", n, 256, buffers=[(0, bc)], constants=[(1, route_args(M, E, k, True, R, T))],
               writes=[(bc, 0, 4 * n)], label="moe_route_clear")


def enc_topk(p, L, ids, w, bc, M, E, k, norm, R, T, tg=None):
    p.dispatch("moe_route_topk", M, tg or route_tg(E),
               buffers=[(0, L), (1, ids), (2, w), (3, bc)],
               constants=[(4, route_args(M, E, k, norm, R, T))],
               reads=[(L, 0, 4 * M * (E + 1)), (bc, 0, 4 * nblocks(M, R) * E)],
               writes=[(ids, 0, 4 * M * k), (w, 0, 4 * M * (k + 1)), (bc, 0, 4 * nblocks(M, R) * E)],
               threadgroups=True, label="moe_route_topk")


def enc_scatter(p, ids, bc, perm, tiles, tcount, counts, M, E, k, R, T, tg=None):
    p.dispatch("moe_route_scatter", nblocks(M, R), tg or route_tg(E),
               buffers=[(0, ids), (1, bc), (2, perm), (3, tiles), (4, tcount), (5, counts)],
               constants=[(6, route_args(M, E, k, True, R, T))],
               reads=[(ids, 0, 4 * M * k), (bc, 0, 4 * nblocks(M, R) * E)],
               writes=[(perm, 0, 4 * M * k), (tiles, 0, 16 * max_tiles(M, k, E, T)), (tcount, 0, 4 * tile_classes(T)),
                       (counts, 0, 4 * E)],
               threadgroups=True, label="moe_route_scatter")


def enc_combine(p, h, yx, w, M, H, k, tg=64):
    """moe_combine: h fp32 [M, H] (updated), yx half [M*k, H], w fp32 [M, k+1] (its last
    column, the shared gate, is not read: the shared expert is already in h)."""
    p.dispatch("moe_combine", (H // 4, M), (tg, 1),
               buffers=[(0, h), (1, yx), (2, w)], constants=[(3, constant(M, H, k))],
               reads=[(h, 0, 4 * M * H), (yx, 0, 2 * M * k * H), (w, 0, 4 * M * (k + 1))],
               writes=[(h, 0, 4 * M * H)], label="moe_combine")


def combine_inputs(rng, M, H, k):
    """Random operands of moe_combine(_norm): h fp32 [M, H], yx half [M*k, H] (as the down
    projections store it), w fp32 [M, k+1] in [0, 1)."""
    return (rng.standard_normal((M, H)).astype(np.float32), half_activations(rng.standard_normal((M * k, H))),
            rng.random((M, k + 1)).astype(np.float32))


def enc_combine_norm(p, h, yx, w, nw, xn, M, H, k, eps=1e-6, tg=256):
    """moe_combine_norm: enc_combine's operands, then xn half [M, H] = RMSNorm(h) * nw (bf16
    [H]); one threadgroup of tg threads per row."""
    p.dispatch("moe_combine_norm", M, tg,
               buffers=[(0, h), (1, yx), (2, w), (4, nw), (5, xn)],
               constants=[(3, constant(M, H, k)), (6, constant(H) + np.float32(eps).tobytes())],
               reads=[(h, 0, 4 * M * H), (yx, 0, 2 * M * k * H), (w, 0, 4 * M * (k + 1)), (nw, 0, 2 * H)],
               writes=[(h, 0, 4 * M * H), (xn, 0, 2 * M * H)], threadgroups=True, label="moe_combine_norm")


def norm_half_ref(x, nw_bits, eps=1e-6):
    """(want, tol) of rms_norm_half / moe_combine_norm's xn on the fp32 rows x it normalised:
    float64 RMSNorm, the fp32 bound DEPTH u |want| plus the half rounding (half_stored);
    values beyond +-65504 are stored as +-65504 (want clipped, no extra tolerance)."""
    x64 = np.asarray(x, np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + eps) * bf16_to_f32(nw_bits)
    return half_stored(np.clip(want, -HALF_MAX, HALF_MAX), DEPTH * U * np.abs(want) + 1e-30)


def combine_ref(h, yx, w):
    """(want, tol) of moe_combine on the values it reads (yx: the half outputs as stored);
    float64, the bound of tests/kernels/test_moe_prefill.py's docstring."""
    M, k = w.shape[0], w.shape[1] - 1
    H = h.shape[1]
    y3 = yx.astype(np.float64).reshape(M, k, H)
    w64 = w.astype(np.float64)
    terms = np.abs(h) + np.einsum("mj,mjh->mh", np.abs(w64[:, :k]), np.abs(y3))
    want = h + np.einsum("mj,mjh->mh", w64[:, :k], y3)
    return want, (k + 2) * U * terms


# ----------------------------------------------------------------------------- sampling

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
                      int(update_counts), int(bool(p.logit_bias)))


def dense_bias(params: SamplingParams, V: int) -> np.ndarray:
    """``params.logit_bias`` as the runtime's per-session buffer: float32 ``[V]``, 0 elsewhere."""
    b = np.zeros(V, np.float32)
    ids, vals = params.bias_arrays()
    b[ids] = vals
    return b


def sample_many(dev, logits, counts, params, seeds, positions, tg=1024, logprobs=False, update_counts=False):
    """One sample_token dispatch per (seed, position), all in one command buffer; with
    ``params.logit_bias`` the dense bias buffer is bound and declared read (else bound only)."""
    V = logits.size
    n = len(seeds)
    L, C = upload(dev, f32(logits)), upload(dev, counts)
    B = upload(dev, dense_bias(params, V)) if params.logit_bias else L
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
                            (5, IDS, 4 * k * j), (7, B)],
                   constants=[(6, sample_args(V, params, seed, logprobs=logprobs, update_counts=update_counts))],
                   reads=[L, C, (POS, 4 * j, 4)] + ([B] if params.logit_bias else []),
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


PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.3}


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


# ----------------------------------------------------------------------------- grouped (MoE) GEMM

def make_routing(rng, M, E, k, T, skew):
    """Random top-k ids [M, k] (distinct per row), the grouped order perm (experts in
    increasing order, slots of one expert in *random* order) and the tile map.
    skew: one expert is chosen by ~90% of the rows and half of the experts never are."""
    if skew:
        hot = int(rng.integers(E))
        pool = np.setdiff1d(rng.choice(E, max(k + 1, E // 2), replace=False), [hot])
        ids = np.stack([rng.choice(pool, k, replace=False) for _ in range(M)])
        rows = rng.random(M) < 0.9
        ids[rows, rng.integers(k, size=rows.sum())] = hot
    else:
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)])
    flat = ids.reshape(-1).astype(np.uint32)
    perm = []
    tiles = []
    for e in range(E):
        a = np.nonzero(flat == e)[0]
        rng.shuffle(a)
        for b in range(0, len(a), T):
            tiles.append((e, len(perm) + b, min(T, len(a) - b), 0))
        perm.extend(a.tolist())
    return ids.astype(np.uint32), np.asarray(perm, np.uint32), np.asarray(tiles, np.uint32).reshape(-1, 4)


def tile_buffers(dev, tiles, count, M, E, k, T):
    """tiles [max_tiles] with the entries past `count` set to stale but plausible tiles
    (slots 0..T of another expert than the first tile's): a kernel that ran them would
    overwrite slots of the first tile with wrong values."""
    max_tiles = -(-M * k // T) + min(E, M * k)
    assert len(tiles) <= max_tiles
    stale = (int(tiles[0, 0]) + 1) % E
    tl = np.tile(np.array([stale, 0, T, 0], np.uint32), (max_tiles, 1))
    tl[:count] = tiles[:count]
    return upload(dev, tl), upload(dev, np.array([count], np.uint32)), max_tiles


def moe_args(n, k, M, top_k, E, lda, ldy, tile_rows):
    return constant(n, k, M, top_k, E, lda, ldy, tile_rows)


def _map_ranges(TL, TC, max_tiles, cls):
    """Bindings and read ranges of one class map: cls = None (the whole buffers, one map) or
    (class c, first entry): the map at that entry, its count at TC[c]."""
    if cls is None:
        return [(2, TL), (3, TC)], [TL, TC]
    c, base = cls
    return [(2, TL, 16 * base), (3, TC, 4 * c)], [(TL, 16 * base, 16 * max_tiles), (TC, 4 * c, 4)]


def enc_moe_gemm_gate_up(p, T, X, P, TL, TC, max_tiles, gb, ub, HX, M, k, E, H, I, lda=None, ldy=None, kernel=None,
                         cls=None, tile_rows=None, tag=0):
    """moe_gemm_gate_up_q4_t{T} over max_tiles tiles. cls: (class, first map entry) to read one
    class map of moe_route_scatter's buffers (tile_rows: the tiling's T; tag: the disjoint
    write tag shared by the classes of one projection)."""
    lda, ldy = lda or H, ldy or I
    kernel = kernel or f"moe_gemm_gate_up_q4_t{T}"
    maps, map_reads = _map_ranges(TL, TC, max_tiles, cls)
    p.dispatch(kernel, (max_tiles, -(-I // MOE_BN[T])), MOE_TG[T],
               buffers=[(0, X), (1, P), *maps, *[(4 + i, b) for i, b in enumerate(gb + ub)], (10, HX)],
               constants=[(11, moe_args(I, H, M, k, E, lda, ldy, tile_rows or T))],
               reads=[(X, 0, 2 * ((M - 1) * lda + H)), P, *map_reads, *gb, *ub],
               writes=[(HX, 0, 2 * ((M * k - 1) * ldy + I), tag)], threadgroups=True, label=kernel)


def enc_moe_gemm_down(p, T, HX, P, TL, TC, max_tiles, db, YX, M, k, E, H, I, lda=None, ldy=None, kernel=None,
                      cls=None, tile_rows=None, tag=0):
    """moe_gemm_down_q4_t{T}: YX half [M*k, ldy]; cls, tile_rows, tag as enc_moe_gemm_gate_up."""
    lda, ldy = lda or I, ldy or H
    kernel = kernel or f"moe_gemm_down_q4_t{T}"
    maps, map_reads = _map_ranges(TL, TC, max_tiles, cls)
    p.dispatch(kernel, (max_tiles, -(-H // MOE_DOWN_BN[T])), MOE_TG[T],
               buffers=[(0, HX), (1, P), *maps, *[(4 + i, b) for i, b in enumerate(db)], (7, YX)],
               constants=[(8, moe_args(H, I, M, k, E, lda, ldy, tile_rows or T))],
               reads=[(HX, 0, 2 * ((M * k - 1) * lda + I)), P, *map_reads, *db],
               writes=[(YX, 0, 2 * ((M * k - 1) * ldy + H), tag)], threadgroups=True, label=kernel)


# ----------------------------------------------------------------------------- results


class Mismatch(Exception):
    """A kernel's output is outside its tolerance (the message says where and by how much)."""

    def __init__(self, message: str, error: float):
        super().__init__(message)
        self.error = error


@dataclass
class Result:
    """The outcome of one kernel's check.

    ``status``: PASS, FAIL (outputs outside tolerance), ERROR (the dispatch raised) or
    NO CHECK (the library has a kernel this module has no check for). ``error``: worst
    |got - exact| / tolerance (None when not measured). ``seconds``: wall time of the check.
    """

    kernel: str
    status: str
    error: float | None = None
    detail: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"kernel": self.kernel, "status": self.status, "error": self.error, "detail": self.detail,
                "seconds": round(self.seconds, 3)}


def ratio(got, exact, tol, what: str) -> float:
    """Worst |got - exact| / tol; raises Mismatch on a non-finite output or a ratio > 1."""
    got = np.asarray(got, np.float64)
    if not np.isfinite(got).all():
        raise Mismatch(f"{what}: non-finite outputs at {np.argwhere(~np.isfinite(got))[:5].ravel().tolist()}",
                       float("inf"))
    err = np.abs(got - np.asarray(exact, np.float64))
    tol = np.broadcast_to(np.asarray(tol, np.float64), err.shape)
    r = np.divide(err, tol, out=np.where(err > 0, np.inf, 0.0), where=tol > 0)  # tol 0: exact
    worst = float(r.max()) if r.size else 0.0
    if worst > 1:
        raise Mismatch(f"{what}: {int((r > 1).sum())} of {r.size} outputs out of tolerance; worst err/tol "
                       f"{worst:.3g} at {np.unravel_index(int(np.argmax(r)), r.shape)}", worst)
    return worst


def _close(got, want, rtol, atol, what):
    """Worst error ratio against numpy's allclose tolerance atol + rtol * |want|."""
    want = np.asarray(want, np.float64)
    return ratio(got, want, atol + rtol * np.abs(want), what)


# ----------------------------------------------------------------------------- checks

CHECKS: dict[str, Callable] = {}


def check(*kernels: str):
    """Registers a check ``f(dev, rng, kernel) -> worst error ratio`` for ``kernels``."""
    def register(fn):
        for k in kernels:
            CHECKS[k] = fn
        return fn
    return register


@check("gemv_q4", "gemv_q8", "gemv_q4_add", "gemv_q8_add")
def _gemv(dev, rng, kernel):
    bits, add = int(kernel[6]), kernel.endswith("_add")
    rows, cols = 100, 256
    qt = rand_quant(rng, (), rows, cols, bits)
    x = rng.standard_normal(cols).astype(np.float32)
    r0 = rng.standard_normal(rows).astype(np.float32)
    W, S, B = upload_q(dev, qt)
    X = upload(dev, x)
    Y = upload(dev, r0) if add else dev.buffer(4 * rows)
    run_bound(dev, kernel, gemv_grid(rows), TG, [W, S, B, X, Y], constant(rows, cols),
         reads=[W, S, B, X] + ([Y] if add else []), writes=[Y])
    exact = qt.dequantize().astype(np.float64) @ x.astype(np.float64)
    mag = magnitude(qt) @ np.abs(x.astype(np.float64))
    if add:
        exact, mag = exact + r0, mag + np.abs(r0)
    return ratio(download(Y, np.float32), exact, DEPTH * U * mag, f"{kernel} {rows}x{cols}")


def gated_x64(y, ssq, z, norm_w_bits, Dv, eps=1e-6):
    """float64 gated RMSNorm of y (docs/model.md): y / sqrt(ss / Dv + eps) * norm_w * silu(z),
    ss of a head = the sum of its partials ``ssq`` [Hv, NS]."""
    y, z = np.asarray(y, np.float64).reshape(-1, Dv), np.asarray(z, np.float64).reshape(-1, Dv)
    ss = np.asarray(ssq, np.float64).reshape(len(y), -1).sum(1)
    w = from_bf16(norm_w_bits).astype(np.float64)
    return (y / np.sqrt(ss / Dv + eps)[:, None] * w * z / (1 + np.exp(-z))).reshape(-1)


def gemv_gated_ratio(dev, rng, kernel, rows, Hv, Dv, splits, tg=TG, eps=1e-6):
    """gemv_gated_q*_add on random weights, y (with each split's float32 sum of y^2 as ssq), z,
    norm weight and residual, against float64; returns the worst error ratio. Bound: the GEMV's
    DEPTH u per |W| |x'| term plus 8 u for x' itself (a square root, a division, three products
    and the SiLU, each within an ulp or two) and 2 u of the residual."""
    bits, cols = int(kernel.split("_q")[1][0]), Hv * Dv
    qt = rand_quant(rng, (), rows, cols, bits)
    y, z = f32(rng.standard_normal(cols) * 0.3), f32(rng.standard_normal(cols) * 2)
    ssq = f32((f32(y).reshape(Hv, splits, Dv // splits) ** 2).sum(-1))
    nw = f32_to_bf16(f32(1 + 0.1 * rng.standard_normal(Dv)))
    r0 = f32(rng.standard_normal(rows))
    W, S, B = upload_q(dev, qt)
    Y, SSQ, Z, NW, R = upload(dev, y), upload(dev, ssq), upload(dev, z), upload(dev, nw), upload(dev, r0)
    run(dev, kernel, -(-rows // (GEMV_ROWS_PER_SG * tg // 32)), tg,
        buffers=list(enumerate([W, S, B, Y, R])) + [(6, SSQ), (7, Z), (8, NW)],
        constants=[(5, constant(rows, cols)), (9, args_bytes(Dv, splits, eps))],
        reads=[W, S, B, Y, R, SSQ, Z, NW], writes=[R], label=kernel)
    x = gated_x64(y, ssq, z, nw, Dv, eps)
    exact = qt.dequantize().astype(np.float64) @ x + r0
    mag = magnitude(qt) @ np.abs(x)
    tol = (DEPTH + 8) * U * mag + 2 * U * np.abs(exact)
    return ratio(download(R, np.float32), exact, tol, f"{kernel} {rows}x{cols} Dv={Dv} NS={splits}")


@check("gemv_gated_q4_add", "gemv_gated_q8_add")
def _gemv_gated(dev, rng, kernel):
    return gemv_gated_ratio(dev, rng, kernel, 100, 4, 64, 4)


@check("embed_q4")
def _embed(dev, rng, kernel):
    vocab, cols = 100, 128
    qt = rand_quant(rng, (), vocab, cols, 4)
    W, S, B = upload_q(dev, qt)
    tok = int(rng.integers(vocab))
    T, O = upload(dev, np.array([tok], np.uint32)), dev.buffer(4 * cols)
    run_bound(dev, kernel, cols // 8, 64, [W, S, B, T, O], constant(cols, vocab), reads=[W, S, B, T], writes=[O],
         threadgroups=False)
    return ratio(download(O, np.float32), qt.dequantize(tok).astype(np.float64), 2 * U * magnitude(qt, tok),
                 f"{kernel} row {tok}")


@check("rms_norm", "rms_norm_half")
def _rms_norm(dev, rng, kernel):
    """rms_norm_half: the same norm stored as half (prefill's xn)."""
    rows, n, eps = 3, 256, 1e-6
    half = kernel.endswith("_half")
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    w = to_bf16_bits(1 + 0.3 * rng.standard_normal(n))
    X, Wt, O = upload(dev, x), upload(dev, w), dev.buffer((2 if half else 4) * rows * n)
    run_bound(dev, kernel, rows, 64, [X, Wt, O], constant(n) + np.float32(eps).tobytes(), reads=[X, Wt], writes=[O])
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + eps) * bf16_to_f32(w)
    tol = DEPTH * U * np.abs(want) + 1e-30
    if half:
        want, tol = half_stored(want, tol)
    got = download(O, np.float16 if half else np.float32, (rows, n)).astype(np.float32)
    return ratio(got, want, tol, kernel)


@check("moe_route")
def _moe_route(dev, rng, kernel):
    E, k, hidden = 32, 8, 128
    logits = (rng.standard_normal(E) * 2).astype(np.float32)
    x = rng.standard_normal(hidden).astype(np.float32)
    gate = rand_quant(rng, (), 1, hidden, 8)
    L, X = upload(dev, logits), upload(dev, x)
    GW, GS, GB = upload_q(dev, gate)
    ids, wts = dev.buffer(4 * k), dev.buffer(4 * (k + 1))
    run_bound(dev, kernel, 1, 32, [L, X, GW, GS, GB, ids, wts], constant(E, k, hidden, 1),
         reads=[L, X, GW, GS, GB], writes=[ids, wts])
    top, w = route_ref(logits, k)
    got_ids, got_w = download(ids, np.uint32), download(wts, np.float32)
    if not np.array_equal(got_ids, top):
        raise Mismatch(f"{kernel}: picked experts {got_ids.tolist()}, expected {top.tolist()}", 1.0)
    from lily.reference import sigmoid
    g = gate.dequantize()[0].astype(np.float64) @ x.astype(np.float64)
    gmag = magnitude(gate)[0] @ np.abs(x.astype(np.float64))
    r = ratio(got_w[:k], w, (16 * U * np.log2(E) + 8 * U) * np.abs(w), f"{kernel} weights")
    return max(r, ratio(got_w[k:], [sigmoid(g)], 0.25 * DEPTH * U * gmag + 4 * U, f"{kernel} shared gate"))


@check("sample_greedy")
def _sample_greedy(dev, rng, kernel):
    V = 1000
    logits = (rng.standard_normal(V) * 3).astype(np.float32)
    logits[[V // 3, V // 2]] = logits.max() + 1  # a tie: the lower index wins
    L, TOK = upload(dev, logits), dev.buffer(4)
    run_bound(dev, kernel, 1, 1024, [L, TOK], constant(V), reads=[L], writes=[TOK])
    got, want = int(download(TOK, np.uint32)[0]), int(np.argmax(logits))
    if got != want:
        raise Mismatch(f"{kernel}: token {got}, expected {want} (argmax, lowest index on ties)", 1.0)
    return 0.0


def argmax_two_stage(dev, logits: np.ndarray, slice_: int, bias: np.ndarray | None = None) -> tuple[int, int]:
    """The runtime's greedy argmax on ``dev`` over float32 ``logits`` ``[V]`` (plus float32
    ``bias`` ``[V]`` when given: argmax_partial_bias): argmax_partial (256 threads per slice
    of ``slice_`` logits), then sample_greedy_combine in one threadgroup. Returns (token,
    barrier stages of the command buffer)."""
    V = logits.size
    parts = -(-V // slice_)
    L, TOK, PART = upload(dev, logits), dev.buffer(4), dev.buffer(8 * parts)
    B = [upload(dev, f32(bias))] if bias is not None else []
    cb = dev.command_buffer()
    p = cb.compute_pass()
    p.dispatch("argmax_partial_bias" if B else "argmax_partial", parts, 256,
               buffers=[(0, L), (1, PART)] + [(3, b) for b in B], constants=[(2, constant(V, slice_))],
               reads=[L, *B], writes=[PART], threadgroups=True)
    p.dispatch("sample_greedy_combine", 1, min(1024, -(-parts // 32) * 32), buffers=[(0, PART), (1, TOK)],
               constants=[(2, constant(parts, 0))], reads=[PART], writes=[TOK], threadgroups=True)
    cb.commit()
    cb.wait()
    return int(download(TOK, np.uint32)[0]), cb.counters["barrier_stages"]


@check("argmax_partial", "argmax_partial_bias", "sample_greedy_combine")
def _argmax_two_stage(dev, rng, kernel):
    """The runtime's greedy argmax: partials over slices of 64 logits, then the combine
    (argmax_partial_bias: over logits + a bias that lifts one token and bans the leaders)."""
    V, slice_ = 1000, 64
    logits = (rng.standard_normal(V) * 3).astype(np.float32)
    logits[[V // 3, V // 2]] = logits.max() + 1  # a tie across slices: the lower index wins
    bias = None
    if kernel == "argmax_partial_bias":
        bias = np.zeros(V, np.float32)
        bias[[V // 3, V // 2]] = -100.0
        bias[int(rng.integers(V))] += 7.5
    got = argmax_two_stage(dev, logits, slice_, bias)[0]
    want = int(np.argmax(logits if bias is None else logits + bias))
    if got != want:
        raise Mismatch(f"{kernel}: token {got}, expected {want} (argmax, lowest index on ties)", 1.0)
    return 0.0


@check("gemm_q4", "gemm_q8", "gemm_q4_add_h", "gemm_q4_half", "gemm_q4_add_hs", "gemm_q4_tensor", "gemm_q8_tensor",
       "gemm_q4_add_h_tensor", "gemm_q4_half_tensor", "gemm_q4_add_hs_tensor")
def _gemm(dev, rng, kernel):
    """gemm_q4_half: y stored as half (the GDN z, the attention's q|gate, k, v);
    gemm_q4_add_hs: x times a half scale per 32 elements of a row (the GDN out_proj)."""
    bits, add, half_y, scaled = int(kernel[6]), "_add" in kernel, "_half" in kernel, "_add_hs" in kernel
    m, n, k = 33, 70, 128
    qt = rand_quant(rng, (), n, k, bits)
    x = half_activations(rng.standard_normal((m, k)))  # half activations (their producers convert)
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    W, S, B = upload_q(dev, qt)
    X = upload(dev, x)
    Y = upload(dev, y0) if add else dev.buffer((2 if half_y else 4) * m * n)
    bm, tg = gemm_geometry(kernel)
    grid, bufs = (-(-n // GEMM_BN), -(-m // bm)), [W, S, B, X, Y]
    if scaled:
        shift = 5
        f = rng.uniform(0.0, 1.0, (m, k >> shift)).astype(np.float16)
        F = upload(dev, f)
        run(dev, kernel, grid, tg, [*enumerate(bufs), (6, F)], [(5, constant(m, n, k, k, n)), (7, constant(shift))],
            reads=[W, S, B, X, Y, F], writes=[Y])
        x = x * np.repeat(f, 1 << shift, axis=1)  # the staged half product (float16 x float16)
    else:
        run_bound(dev, kernel, grid, tg, bufs, constant(m, n, k, k, n),
                  reads=[W, S, B, X] + ([Y] if add else []), writes=[Y])
    exact, tol = gemm_ref(x, qt)
    if add:
        exact = exact + y0
        tol = tol + 2 * U * np.abs(exact)
    if half_y:
        exact, tol = half_stored(exact, tol)
    got = download(Y, np.float16 if half_y else np.float32, (m, n)).astype(np.float32)
    return ratio(got, exact, tol, f"{kernel} {m}x{n}x{k}")


@check("gdn_decode_step_k128_v128", "gdn_decode_step_k32_v32")
def _gdn_decode_step(dev, rng, kernel):
    Dk = int(kernel.split("_k")[1].split("_")[0])
    L = GdnLayer(dev, 2, 4, Dk, Dk, rng=rng)
    c = 2.0 ** -rng.uniform(0, 40, 4)  # pending decays (S = c S', S ~ 0.3): the step applies c
    L.set_state(rng.standard_normal((3, L.conv_dim)), 0.3 * rng.standard_normal((4, Dk, Dk)) / c[:, None, None], c)
    inp = L.random_inputs()
    got = L.step_device(*inp)
    want = L.step_reference(*inp)
    r = _close(got, want, 1e-4, 1e-5, f"{kernel} output")
    ssq = gdn_split_ssq(L.last_y, L.Dv, GDN_DECODE_SPLITS)
    r = max(r, _close(L.last_ssq.reshape(ssq.shape), ssq, 1e-5, 1e-6, f"{kernel} ssq"))
    return max(r, _close(L.device_state()[1], L.st.recurrent[0], 1e-4, 1e-5, f"{kernel} state"))


@check("gdn_state_writeback_k128_v128", "gdn_state_writeback_k32_v32")
def _gdn_state_writeback(dev, rng, kernel):
    """The write-back window (docs/decode.md): steps that replay the ring (window 4) and the
    write-back of the steps left pending give, bit for bit, the outputs and the state of
    writing the state back every step. On a GPU this also checks that the compiler treats the
    replayed update as the step's own (same contraction into fused multiply-adds)."""
    Dk = int(kernel.split("_k")[1].split("_")[0])
    every, windowed = gdn_window_pair(dev, 2, 4, Dk, Dk, 4, rng)
    r = 0.0
    for t in range(6):  # the windowed layer writes back at step 3 and has 2 steps pending at the end
        inp = every.random_inputs()
        want, got = every.step_device(*inp), windowed.step_device(*inp)
        r = max(r, ratio(got, want, 0.0, f"{kernel}: step {t} output"),
                ratio(windowed.last_y, every.last_y, 0.0, f"{kernel}: step {t} y"))
    assert windowed.pending == 2
    for want, got, what in zip(every.state_parts(), windowed.state_parts(), ("S'", "c")):
        r = max(r, ratio(got, want, 0.0, f"{kernel}: written-back {what}"))
    return r


# one attention shape per kernel variant: head dim D and query heads per threadgroup G
# (Hq, Hkv, D, rotary): the GQA group is one for which the runtime picks that G (heads_per_group)
_ATTN = {(256, 8): (8, 1, 256, 64), (256, 4): (8, 2, 256, 64), (256, 2): (4, 2, 256, 64),
         (64, 4): (8, 2, 64, 16), (64, 2): (4, 2, 64, 16)}


def _attn_layer(dev, rng, D, G, n, capacity=128):
    """An AttnLayer for variant (D, G) whose cache rows >= n are NaN (reading past the
    context shows up), a random query and gate, and the float32 K/V history."""
    Hq, Hkv, D, rot = _ATTN[(D, G)]
    A = AttnLayer(dev, Hq, Hkv, D, rot, capacity, rng=rng)
    nan = np.uint16(0x7FC0)
    k, v = A.k_hist.copy(), A.v_hist.copy()
    k[:, n:], v[:, n:] = nan, nan
    A.KC.write(k.view(np.uint8).reshape(-1))
    A.VC.write(v.view(np.uint8).reshape(-1))
    q, gate = f32(rng.standard_normal((Hq, D))), f32(rng.standard_normal((Hq, D)))
    return A, q, gate, from_bf16(k), from_bf16(v)


def _variant(kernel):
    """(head dim, query heads per threadgroup) of an attention kernel name (..._d256_g4)."""
    import re
    m = re.search(r"_d(\d+)(?:_g(\d+))?$", kernel)
    return int(m.group(1)), int(m.group(2) or 4)


@check(*[f"attn_decode_d{D}_g{G}" for D, G in _ATTN])
def _attn_decode(dev, rng, kernel):
    D, G = _variant(kernel)
    n = 45
    A, q, gate, K, V = _attn_layer(dev, rng, D, G, n)
    A.set_position(n - 1)
    got = A.decode(upload(dev, q), upload(dev, gate), n)
    return _close(got, attention_reference(q, gate, K, V, n, D), 2e-5, 2e-5, kernel)


@check(*[f"attn_decode_split_d{D}_g{G}" for D, G in _ATTN], "attn_combine_d256", "attn_combine_d64")
def _attn_decode_split(dev, rng, kernel):
    D, G = _variant(kernel)
    n = 100
    A, q, gate, K, V = _attn_layer(dev, rng, D, G, n)
    A.set_position(n - 1)
    got = A.decode(upload(dev, q), upload(dev, gate), n, split_threshold=1, block_rows=32, extra_blocks=1)
    return _close(got, attention_reference(q, gate, K, V, n, D), 2e-5, 2e-5, f"{kernel} (split + combine)")


@check("attn_qk_prep")
def _attn_qk_prep(dev, rng, kernel):
    Hq, Hkv, D, rot = _ATTN[(256, 4)]
    pos = 37
    A = AttnLayer(dev, Hq, Hkv, D, rot, 64, rng=rng)
    qg, k, v = (f32(rng.standard_normal((Hq, 2 * D))), f32(rng.standard_normal((Hkv, D))),
                f32(rng.standard_normal((Hkv, D))))
    A.set_position(pos)
    Q, GATE = A.prep(qg, k, v, pos)
    q_ref, k_ref = qk_prep_reference(A, qg, k, pos)
    r = _close(download(Q, np.float32, (Hq, D)), q_ref, 1e-5, 1e-5, f"{kernel} q")
    r = max(r, _close(download(GATE, np.float32, (Hq, D)), qg[:, D:], 0, 0, f"{kernel} gate"))
    kc = download(A.KC, np.uint16, (Hkv, A.cap, D))
    vc = download(A.VC, np.uint16, (Hkv, A.cap, D))
    r = max(r, _close(from_bf16(vc[:, pos]), from_bf16(bf16_bits(v)), 0, 0, f"{kernel} cached v"))
    # one bf16 ulp where a float32 difference can flip the rounding
    return max(r, _close(from_bf16(kc[:, pos]), round_bf16(k_ref), 2**-7, 1e-5, f"{kernel} cached k"))


@check(*[f"attn_decode_fused_d{D}_g{G}" for D, G in _ATTN], *[f"attn_decode_split_fused_d{D}_g{G}" for D, G in _ATTN])
def _attn_decode_fused(dev, rng, kernel):
    """The fused step vs float64 attention over the cache as the kernel left it, with the
    query attn_qk_prep computes for the same token (checked on its own above)."""
    D, G = _variant(kernel)
    n = 70
    seed = int(rng.integers(1 << 62))
    A, _, _, _, _ = _attn_layer(dev, np.random.default_rng(seed), D, G, n - 1)
    B, _, _, _, _ = _attn_layer(dev, np.random.default_rng(seed), D, G, n - 1)
    Hq, Hkv = A.Hq, A.Hkv
    qg, k, v = (f32(rng.standard_normal((Hq, 2 * D))), f32(rng.standard_normal((Hkv, D))),
                f32(rng.standard_normal((Hkv, D))))
    got = A.fused(qg, k, v, n - 1, **({"block_rows": 16, "extra_blocks": 1} if "split" in kernel else {}))
    B.set_position(n - 1)
    Q, _ = B.prep(qg, k, v, n - 1)
    Kc = from_bf16(download(A.KC, np.uint16, (Hkv, A.cap, D)))
    Vc = from_bf16(download(A.VC, np.uint16, (Hkv, A.cap, D)))
    want = attention_reference(download(Q, np.float32, (Hq, D)), qg[:, D:], Kc, Vc, n, D)
    return _close(got, want, 2e-5, 2e-5, kernel)


def _norm_gemv_ratio(kernel, x, nw, XN, qts, mats):
    """Worst error ratio of a norm_gemv's xn (vs float64 RMSNorm of x) and of its matrix
    outputs (vs float64 products with the xn the kernel wrote)."""
    want_xn = rms_ref64(x, nw)
    xn = download(XN, np.float32)
    r = ratio(xn, want_xn, DEPTH * U * np.abs(want_xn) + 1e-30, f"{kernel} xn")
    xin = xn.astype(np.float64)
    for qt, (rows, _, Y) in zip(qts, mats):
        r = max(r, ratio(download(Y, np.float32), qt.dequantize().astype(np.float64) @ xin,
                         DEPTH * U * (magnitude(qt) @ np.abs(xin)), f"{kernel} {rows}x{xin.size}"))
    return r


@check("norm_gemv_q4", "norm_gemv_q8")
def _norm_gemv(dev, rng, kernel):
    bits, cols = int(kernel[-1]), 128
    x = (rng.standard_normal(cols) * 2).astype(np.float32)
    nw = to_bf16_bits(1 + 0.2 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), r, cols, bits) for r in (40, 7)]
    X, NW, XN = upload(dev, x), upload(dev, nw), dev.buffer(4 * cols)
    mats = [(qt.weight.shape[0], upload_q(dev, qt), dev.buffer(4 * qt.weight.shape[0])) for qt in qts]
    cb = dev.command_buffer()
    # q8: the router's geometry (one row per simdgroup, csrc/runtime/decode.cpp kRouterRows)
    enc_norm_gemv(cb.compute_pass(), bits, X, NW, XN, mats, cols, write_xn=True,
                  rps=1 if bits == 8 else NORM_GEMV_ROWS_PER_SG)
    cb.commit()
    cb.wait()
    return _norm_gemv_ratio(kernel, x, nw, XN, qts, mats)


@check("embed_norm_gemv_q4")
def _embed_norm_gemv(dev, rng, kernel):
    vocab, cols = 50, 128
    emb = rand_quant(rng, (), vocab, cols, 4, "embed")
    nw = to_bf16_bits(1 + 0.2 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), r, cols, 4) for r in (24, 9)]
    tok = int(rng.integers(vocab))
    EW, ES, EB = upload_q(dev, emb)
    T, NW, H, XN = upload(dev, np.array([tok], np.uint32)), upload(dev, nw), dev.buffer(4 * cols), dev.buffer(4 * cols)
    mats = [(q.weight.shape[0], upload_q(dev, q), dev.buffer(4 * q.weight.shape[0])) for q in qts]
    cb = dev.command_buffer()
    enc_embed_norm_gemv(cb.compute_pass(), EW, ES, EB, T, H, NW, XN, mats, cols, vocab, write_xn=True)
    cb.commit()
    cb.wait()
    h = download(H, np.float32)
    r = ratio(h, emb.dequantize(tok).astype(np.float64), 2 * U * magnitude(emb, tok), f"{kernel} embedding row {tok}")
    return max(r, _norm_gemv_ratio(kernel, h, nw, XN, qts, mats))


@check("embed_rows_q4")
def _embed_rows(dev, rng, kernel):
    vocab, cols, M = 60, 128, 5
    qt = rand_quant(rng, (), vocab, cols, 4)
    toks = rng.integers(0, vocab, M).astype(np.uint32)
    W, S, B = upload_q(dev, qt)
    T, O = upload(dev, toks), dev.buffer(4 * M * cols)
    run_bound(dev, kernel, (cols // 8, M), 64, [W, S, B, T, O], constant(cols, vocab), reads=[W, S, B, T], writes=[O],
         threadgroups=False)
    want = np.stack([qt.dequantize(int(t)) for t in toks]).astype(np.float64)
    tol = 2 * U * np.stack([magnitude(qt, int(t)) for t in toks])
    return ratio(download(O, np.float32, (M, cols)), want, tol, f"{kernel} {M} rows")


@check("gemm_swiglu_q4", "gemm_swiglu_q4_tensor")
def _gemm_swiglu(dev, rng, kernel):
    m, n, k = 21, 70, 128
    gq, uq = rand_quant(rng, (), n, k, 4), rand_quant(rng, (), n, k, 4)
    x = half_activations(rng.standard_normal((m, k)))
    w, col = row_scale(rng, m)
    sb, sc, sr = row_scale_bindings(dev, w, col)
    bufs = [*upload_q(dev, gq), *upload_q(dev, uq)]
    X, Y = upload(dev, x), dev.buffer(2 * m * n)  # half in, half out
    bm, tg = gemm_geometry(kernel)
    run(dev, kernel, (-(-n // GEMM_SWIGLU_BN), -(-m // bm)), tg, [*enumerate([*bufs, X, Y]), *sb],
        [(8, constant(m, n, k, k, n)), *sc], reads=[*bufs, X, *sr], writes=[Y])
    want, tol = half_stored(*swiglu_ref(x, gq, uq, scale=w[:, col]))
    return ratio(download(Y, np.float16, (m, n)).astype(np.float32), want, tol, f"{kernel} {m}x{n}x{k}")


@check("sample_token")
def _sample_token(dev, rng, kernel):
    """Draw by draw against the numpy model of the kernel (Philox u, crossing of u * Z in
    probability order) on penalised, filtered logits; a draw may differ only where u lies
    within 1e-5 of a boundary of the cumulative mass (float32 vs float64). Twice: without and
    with a logit bias (a few nudges and a ban on the most likely token, which is never drawn)."""
    V = 50
    logits = (rng.standard_normal(V) * 2).astype(np.float32)
    prompt, generated = rng.choice(V, 5, replace=False), rng.choice(V, 8)
    base = SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02, **PENALTIES)
    nudged = rng.choice(V, 4, replace=False)
    bias = {int(t): float(b) for t, b in zip(nudged, rng.uniform(-3, 3, 4))} | {int(np.argmax(logits)): -100.0}
    seeds = [int(s) for s in rng.integers(0, 2**63, 24)]
    positions = list(range(100, 124))
    for params in (base, replace(base, logit_bias=bias)):
        probs = filtered_probs(params, logits, prompt, generated)
        toks, *_ = sample_many(dev, logits, count_buffer(V, prompt, generated), params, seeds, positions, tg=64)
        bad = [(int(t), w) for t, (w, near) in zip(toks, expected_draws(probs, sorted_order(probs), seeds, positions))
               if t != w and not near]
        what = " with a logit bias" if params.logit_bias else ""
        if bad:
            raise Mismatch(f"{kernel}{what}: {len(bad)} of {len(toks)} draws differ from the numpy model "
                           f"(got, want): {bad[:5]}", float(len(bad)))
    return 0.0


def _probe_ratio(out, a, b, what):
    return ratio(download(out, np.float32, (32, 64)), a @ b, gemm_bound(GEMM_BK) * (np.abs(a) @ np.abs(b)), what)


@check("tensor_ops_probe")
def _tensor_ops_probe(dev, rng, kernel):
    """For x float32 [64, 64] (metal/gemm_tensor.metal): out = h(x[:32]) h(x)^T (h =
    half_operand) against an fp32 sum's bound."""
    x = rng.standard_normal((64, GEMM_BK)).astype(np.float32)
    X, O = upload(dev, x), dev.buffer(32 * 64 * 4)
    run(dev, kernel, 1, 128, [(0, X), (1, O)], reads=[X], writes=[O])
    xh = half_operand(x)
    return _probe_ratio(O, xh[:32], xh.T, kernel)


@check("tensor_ops_probe_bfloat")
def _tensor_ops_probe_bfloat(dev, rng, kernel):
    """For xb bfloat [64, 64] (metal/attention_prefill_tensor.metal): out_qk = xb[:32] xb^T,
    out_pv = xb[:32] xb; the worse of the two against an fp32 sum's bound."""
    bits = f32_to_bf16(rng.standard_normal((64, GEMM_BK)).astype(np.float32))
    XB = upload(dev, bits)
    QK, PV = (dev.buffer(32 * 64 * 4) for _ in range(2))
    run(dev, kernel, 1, 128, [(0, XB), (1, QK), (2, PV)], reads=[XB], writes=[QK, PV])
    xb = bf16_to_f32(bits).astype(np.float64)
    return max(_probe_ratio(QK, xb[:32], xb.T, f"{kernel} out_qk"), _probe_ratio(PV, xb[:32], xb, f"{kernel} out_pv"))


def _moe_case(dev, rng):
    E, hidden, inter, inter_shared, k = 16, 128, 64, 64, 4
    W = MoeWeights(rng, E, hidden, inter, inter_shared)
    return W, W.upload(dev), k


@check("moe_gate_up_swiglu_q4")
def _moe_gate_up(dev, rng, kernel):
    W, bufs, k = _moe_case(dev, rng)
    x = rng.standard_normal(W.hidden).astype(np.float32)
    ids = rng.choice(W.E, k, replace=False).astype(np.uint32)
    X, ID, H = upload(dev, x), upload(dev, ids), dev.buffer(4 * (k * W.inter + W.inter_shared))
    cb = dev.command_buffer()
    enc_gate_up(cb.compute_pass(), W, bufs, X, ID, H, k, ids=ids)
    cb.commit()
    cb.wait()
    want, tol = W.swiglu(x, ids)
    return ratio(download(H, np.float32), want, tol, kernel)


@check("moe_down_q4")
def _moe_down(dev, rng, kernel):
    W, bufs, k = _moe_case(dev, rng)
    h = (rng.standard_normal(k * W.inter + W.inter_shared) * 0.1).astype(np.float32)
    ids = rng.choice(W.E, k, replace=False).astype(np.uint32)
    w = rng.random(k + 1).astype(np.float32)
    r0 = rng.standard_normal(W.hidden).astype(np.float32)
    Hb, ID, Wt, R = upload(dev, h), upload(dev, ids), upload(dev, w), upload(dev, r0)
    cb = dev.command_buffer()
    enc_down(cb.compute_pass(), W, bufs, Hb, ID, Wt, R, k)
    cb.commit()
    cb.wait()
    d, tol = W.down_sum(h.astype(np.float64), ids, w.astype(np.float64))
    return ratio(download(R, np.float32), r0 + d, tol + DEPTH * U * np.abs(r0), kernel)


@check("moe_route_gate_up_swiglu_q4")
def _moe_route_gate_up(dev, rng, kernel):
    from lily.reference import sigmoid
    W, bufs, k = _moe_case(dev, rng)
    x = rng.standard_normal(W.hidden).astype(np.float32)
    logits = (rng.standard_normal(W.E + 1) * 2).astype(np.float32)
    X, L = upload(dev, x), upload(dev, logits)
    H, ID, WT = dev.buffer(4 * (k * W.inter + W.inter_shared)), dev.buffer(4 * k), dev.buffer(4 * (k + 1))
    cb = dev.command_buffer()
    enc_route_gate_up(cb.compute_pass(), W, bufs, X, L, H, ID, WT, k)
    cb.commit()
    cb.wait()
    top, w = route_ref(logits[:W.E], k)
    ids = download(ID, np.uint32)
    if not np.array_equal(ids, top):
        raise Mismatch(f"{kernel}: picked experts {ids.tolist()}, expected {top.tolist()}", 1.0)
    wts = download(WT, np.float32)
    r = ratio(wts[:k], w, (16 * U * np.log2(W.E) + 8 * U) * np.abs(w), f"{kernel} weights")
    r = max(r, ratio(wts[k:], [sigmoid(np.float64(logits[W.E]))], 8 * U, f"{kernel} shared gate"))
    want, tol = W.swiglu(x, top)
    return max(r, ratio(download(H, np.float32), want, tol, f"{kernel} h"))


@check("moe_route_clear")
def _moe_route_clear(dev, rng, kernel):
    M, E, k, R, T = 40, 32, 4, 16, 16
    n = nblocks(M, R) * E
    bc = dev.buffer(4 * n)  # poisoned on the simulator; garbage on a GPU
    bc.write(np.full(n, 0xFFFFFFFF, np.uint32).view(np.uint8))
    run_encoder(dev, enc_clear, bc, M, E, k, R, T)
    got = download(bc, np.uint32)
    if got.any():
        raise Mismatch(f"{kernel}: {int((got != 0).sum())} of {n} counters not cleared", 1.0)
    return 0.0


@check("moe_route_topk")
def _moe_route_topk(dev, rng, kernel):
    from lily.reference import sigmoid
    M, E, k, R, T = 21, 32, 4, 8, 16
    logits = (np.round(rng.standard_normal((M, E + 1)) * 32) / 16).astype(np.float32)  # on a grid: no near-ties
    L, ids, w = upload(dev, logits), dev.buffer(4 * M * k), dev.buffer(4 * M * (k + 1))
    bc = upload(dev, np.zeros(nblocks(M, R) * E, np.uint32))
    run_encoder(dev, enc_topk, L, ids, w, bc, M, E, k, True, R, T)
    top, wr = route_ref_rows(logits, k)
    got_ids = download(ids, np.uint32, (M, k))
    if not np.array_equal(got_ids, top):
        raise Mismatch(f"{kernel}: top-k picks differ in rows {np.nonzero((got_ids != top).any(1))[0].tolist()}", 1.0)
    got_w = download(w, np.float32, (M, k + 1))
    r = ratio(got_w[:, :k], wr, (16 * U * np.log2(E) + 8 * U) * np.abs(wr), f"{kernel} weights")
    r = max(r, ratio(got_w[:, k], sigmoid(logits[:, E].astype(np.float64)), 8 * U, f"{kernel} shared gate"))
    if not np.array_equal(download(bc, np.uint32).reshape(-1, E), block_hist(top, E, R)):
        raise Mismatch(f"{kernel}: block histogram differs", 1.0)
    return r


@check("moe_route_scatter")
def _moe_route_scatter(dev, rng, kernel):
    M, E, k, R, T = 37, 8, 4, 8, 32  # ~18 rows per expert: full tiles and both tail classes
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.uint32)
    n = M * k
    I, bc = upload(dev, ids), upload(dev, block_hist(ids, E, R))
    perm, tiles, tcount, counts = (dev.buffer(4 * n), dev.buffer(16 * max_tiles(M, k, E, T)),
                                   dev.buffer(4 * tile_classes(T)), dev.buffer(4 * E))
    run_encoder(dev, enc_scatter, I, bc, perm, tiles, tcount, counts, M, E, k, R, T)
    want_counts = np.bincount(ids.ravel(), minlength=E).astype(np.uint32)
    got_counts = download(counts, np.uint32)
    p = download(perm, np.uint32)
    flat = ids.ravel()
    want_maps = tiles_ref(want_counts, T)
    nts = download(tcount, np.uint32)
    got_tiles = download(tiles, np.uint32).reshape(-1, 4)
    problems = []
    if not np.array_equal(got_counts, want_counts):
        problems.append("expert counts")
    if not np.array_equal(np.sort(p), np.arange(n, dtype=np.uint32)):
        problems.append("perm is not a permutation of the assignments")
    elif (np.diff(flat[p].astype(np.int64)) < 0).any():
        problems.append("perm does not group the assignments by expert")
    for c, want in enumerate(want_maps):
        base, nt = class_base(n, E, T, c), int(nts[c])
        if nt != len(want) or not np.array_equal(got_tiles[base:base + nt], want):
            problems.append(f"tile map of class {c} ({nt} tiles, expected {len(want)})")
    if problems:
        raise Mismatch(f"{kernel}: " + "; ".join(problems), 1.0)
    return 0.0


@check("moe_combine", "moe_combine_norm")
def _moe_combine(dev, rng, kernel):
    """moe_combine_norm: h as moe_combine, and xn, the RMSNorm of the h it wrote, as half."""
    norm = kernel.endswith("_norm")
    M, H, k = 9, 256, 4
    h, yx, w = combine_inputs(rng, M, H, k)
    Hb, Y, Wt = (upload(dev, a) for a in (h, yx, w))
    if norm:
        nw, XN = to_bf16_bits(1 + 0.3 * rng.standard_normal(H)), dev.buffer(2 * M * H)
        run_encoder(dev, enc_combine_norm, Hb, Y, Wt, upload(dev, nw), XN, M, H, k)
    else:
        run_encoder(dev, enc_combine, Hb, Y, Wt, M, H, k)
    hout = download(Hb, np.float32, (M, H))
    want, tol = combine_ref(h.astype(np.float64), yx, w)
    r = ratio(hout, want, tol, kernel + " h")
    if norm:
        want, tol = norm_half_ref(hout, nw)
        r = max(r, ratio(download(XN, np.float16, (M, H)).astype(np.float32), want, tol, kernel + " xn"))
    return r


def _grouped(kernel):
    """(tile height T) of a grouped GEMM kernel name (..._t16, ..._t32_tensor)."""
    import re
    return int(re.search(r"_t(\d+)", kernel).group(1))


def _moe_rows(T):
    """Rows of a grouped GEMM check: 23 (every tile partial below T = 32), 80 at T = 128 (~40
    rows per expert: tiles of several 16-row bands, all partial)."""
    return 80 if T == 128 else 23


@check(*[f"moe_gemm_gate_up_q4_t{T}{s}" for T in MOE_TILES for s in ("", "_tensor")], "moe_gemm_gate_up_q4_t128_tensor")
def _moe_gemm_gate_up(dev, rng, kernel):
    T, E, k, H, I = _grouped(kernel), 8, 4, 128, 64
    M = _moe_rows(T)
    _ids, perm, tiles = make_routing(rng, M, E, k, T, False)
    gq, uq = rand_quant(rng, (E,), I, H, 4), rand_quant(rng, (E,), I, H, 4)
    x = half_activations(rng.standard_normal((M, H)))
    X, P = upload(dev, x), upload(dev, perm)
    TL, TC, max_tiles = tile_buffers(dev, tiles, len(tiles), M, E, k, T)
    HX = dev.buffer(2 * M * k * I)  # half
    cb = dev.command_buffer()
    enc_moe_gemm_gate_up(cb.compute_pass(), T, X, P, TL, TC, max_tiles, list(upload_q(dev, gq)), list(upload_q(dev, uq)),
                         HX, M, k, E, H, I, kernel=kernel)
    cb.commit()
    cb.wait()
    hx = download(HX, np.float16, (M * k, I)).astype(np.float32)
    r = 0.0
    for e, begin, rows, _ in tiles:
        want, tol = half_stored(*swiglu_ref(x[perm[begin:begin + rows] // k], gq, uq, int(e)))
        r = max(r, ratio(hx[begin:begin + rows], want, tol, f"{kernel} expert {e}"))
    return r


@check(*[f"moe_gemm_down_q4_t{T}{s}" for T in MOE_TILES for s in ("", "_tensor")], "moe_gemm_down_q4_t128_tensor")
def _moe_gemm_down(dev, rng, kernel):
    T, E, k, H, I = _grouped(kernel), 8, 4, 128, 64
    M = _moe_rows(T)
    _ids, perm, tiles = make_routing(rng, M, E, k, T, False)
    dq = rand_quant(rng, (E,), H, I, 4)
    hx = half_activations(rng.standard_normal((M * k, I)) * 0.1)
    HX, P = upload(dev, hx), upload(dev, perm)
    TL, TC, max_tiles = tile_buffers(dev, tiles, len(tiles), M, E, k, T)
    YX = dev.buffer(2 * M * k * H)  # half
    cb = dev.command_buffer()
    enc_moe_gemm_down(cb.compute_pass(), T, HX, P, TL, TC, max_tiles, list(upload_q(dev, dq)), YX, M, k, E, H, I,
                      kernel=kernel)
    cb.commit()
    cb.wait()
    yx = download(YX, np.float16, (M * k, H)).astype(np.float32)
    r = 0.0
    for e, begin, rows, _ in tiles:
        a = perm[begin:begin + rows]
        want, tol = half_stored(*gemm_ref(hx[begin:begin + rows], dq, int(e)))
        r = max(r, ratio(yx[a], want, tol, f"{kernel} expert {e}"))
    return r


# Prefill attention vs its twin on any device: a GPU sums the score products in another order
# than the twin, so a P value may round to the neighbouring operand value: one ulp, <= 2^-10 of
# a weight of a convex combination of V rows with half operands (the simdgroup kernels), 2^-7
# with bf16 (the tensor-op kernels: 3 significant bits fewer, 8x); |v| < 5 here
# (tests/kernels/test_attention_prefill.py).
ATTN_HALF_ATOL = 4e-3
ATTN_BF16_ATOL = 8 * ATTN_HALF_ATOL
# The output is stored as half (gemm_half: o_proj's input), which the twin leaves in float64:
# one rounding, at most 2^-11 of the value (relative; values stay far inside the half range).
ATTN_OUT_RTOL = 2.0**-11
# one shape per prefill attention variant (head dim D, query heads per threadgroup G)
_PREFILL_DIMS = {256: "real", 64: "wide64"}


def _prefill_case(dev, rng, D, G, p0, M, tensor=False):
    L = PrefillAttnLayer(dev, _PREFILL_DIMS[D], p0 + M + 9, G=G, rng=rng, tensor=tensor)
    L.poison_from(p0 + M)
    q = f32(rng.standard_normal((M, L.Hq, L.D)))
    qg = chunk_inputs(rng, M, L.Hq, L.Hkv, L.D)[0]
    kc, vc = L.cache()
    return L, q, qg, from_bf16(kc), from_bf16(vc)


@check("attn_prefill_prep_d256", "attn_prefill_prep_d64", "attn_prefill_prep_d256_qbf", "attn_prefill_prep_d64_qbf")
def _attn_prefill_prep(dev, rng, kernel):
    bf16_q = kernel.endswith("_qbf")
    D, _ = _variant(kernel.removesuffix("_qbf"))
    p0, M = 11, 6
    L = PrefillAttnLayer(dev, _PREFILL_DIMS[D], p0 + M + 3, rng=rng, tensor=bf16_q)
    qg, k, v = chunk_inputs(rng, M, L.Hq, L.Hkv, L.D)
    QG, K, V = L.input_buffers(qg, k, v)
    _, Q = L.run(lambda p: L.encode_prep(p, QG, K, V, p0, M))
    q_ref, k_ref = prep_reference(L, qg, k, p0)
    # _qbf: q rounded to bf16 (relative error <= 2^-8, bf16's unit roundoff; twice that as
    # the bound)
    r = _close(L.download_q(Q, M), q_ref, 2**-7 if bf16_q else 1e-5, 1e-5, f"{kernel} q")
    kc, vc = L.cache()
    rows = slice(p0, p0 + M)
    r = max(r, _close(from_bf16(vc[:, rows]), from_bf16(bf16_bits(v.reshape(M, L.Hkv, L.D)).transpose(1, 0, 2)),
                      0, 0, f"{kernel} cached v"))
    return max(r, _close(from_bf16(kc[:, rows]), round_bf16(k_ref).transpose(1, 0, 2), 2**-7, 1e-5,
                         f"{kernel} cached k"))


@check(*[f"attn_prefill_d{D}_g{G}{s}" for D in (256, 64) for G in (8, 4, 2) for s in ("", "_tensor")])
def _attn_prefill(dev, rng, kernel):
    import re
    D, G = (int(x) for x in re.search(r"_d(\d+)_g(\d+)", kernel).groups())
    p0, M = 13, 11
    tensor = kernel.endswith("_tensor")
    L, q, qg, K, V = _prefill_case(dev, rng, D, G, p0, M, tensor=tensor)
    return _close(L.attention_only(q, qg, p0), attention_twin(q, qg, K, V, p0, bf16=tensor), ATTN_OUT_RTOL,
                  ATTN_BF16_ATOL if tensor else ATTN_HALF_ATOL, kernel)


@check(*[f"attn_prefill_split_d{D}_g{G}{s}" for D in (256, 64) for G in (8, 4, 2) for s in ("", "_tensor")],
       "attn_prefill_combine_d256", "attn_prefill_combine_d64")
def _attn_prefill_split(dev, rng, kernel):
    import re
    D = int(re.search(r"_d(\d+)", kernel).group(1))
    g = re.search(r"_g(\d+)", kernel)
    G = int(g.group(1)) if g else 8
    p0, M, S, ns = 13, 11, 16, 3
    tensor = kernel.endswith("_tensor")
    L, q, qg, K, V = _prefill_case(dev, rng, D, G, p0, M, tensor=tensor)
    got = L.attention_only(q, qg, p0, split=(S, ns))
    return _close(got, attention_twin(q, qg, K, V, p0, split_rows=S, bf16=tensor), ATTN_OUT_RTOL,
                  ATTN_BF16_ATOL if tensor else ATTN_HALF_ATOL, f"{kernel} (split + combine)")


@check("gdn_conv_state")
def _gdn_conv_state(dev, rng, kernel):
    L = GdnPrefillLayer(dev, "tiny", rng=rng)
    worst = 0.0
    for M, out in ((2, 0), (7, 1)):  # in place (M < K-1 keeps old rows) and into the other buffer
        state_in = f32(rng.standard_normal((GDN_K - 1, L.C)))
        L.set_state(state_in, np.zeros((L.Hv, L.Dv, L.Dk)), parity=0)
        qkv = L.inputs(M)[0]
        cb = dev.command_buffer()
        L.encode_conv_state(cb.compute_pass(), rows_buffer(dev, qkv), M, L.CS[0], L.CS[out], tg=96)
        cb.commit()
        cb.wait()
        worst = max(worst, ratio(L.conv_state(out), L.conv_reference(qkv, state_in)[1], 0, f"{kernel} (M = {M})"))
    return worst


@check("gdn_scan_k128_v128_r32", "gdn_scan_k32_v32_r16", "gdn_norm_scale_v128_r32", "gdn_norm_scale_v32_r16")
def _gdn_scan(dev, rng, kernel):
    """The scan (conv inline) and the norm scale run together (the scale's input is the scan's
    sums of y^2); the output checked is the gated norm as out_proj stages it."""
    L = GdnPrefillLayer(dev, "dims" if "128" in kernel else "tiny", rng=rng)
    M = 9
    conv0, S0 = L.random_state(c=2.0 ** -rng.uniform(0, 40, L.Hv))  # pending decays: folds too
    qkv, z, b, a = L.inputs(M)
    Q, Z, B, A = L.input_buffers(qkv, z, b, a)
    outs = L.out_buffers(M)
    cb = dev.command_buffer()
    L.encode_scan(cb.compute_pass(), Q, L.CS[0], Z, B, A, outs, M)
    cb.commit()
    cb.wait()
    want_o, want_S, scale = L.scan_reference(L.conv_reference(qkv, conv0)[0], z, b, a, S0)
    r = ratio(L.normed(outs, M)[:M], *gdn_stored(want_o, 64 * U * scale), f"{kernel} outputs")
    return max(r, ratio(L.state(), want_S, 1e-5, f"{kernel} state"))


# ----------------------------------------------------------------------------- running


def shipped_kernels(dev) -> list[str]:
    """The model's kernels in ``dev``'s library (its self-test kernels left out), sorted."""
    return sorted(k for k in dev.kernel_names() if not k.startswith(SELFTEST_PREFIX))


def kernel_seed(seed: int, kernel: str) -> np.random.SeedSequence:
    """The seed of ``kernel``'s inputs: depends on (seed, name) only, not on which other
    kernels run or in what order."""
    return np.random.SeedSequence(seed, spawn_key=tuple(kernel.encode()))


def run_checks(dev, kernels: list[str] | None = None, seed: int | None = None,
               progress: Callable[[Result], None] | None = None) -> list[Result]:
    """Checks ``kernels`` (default: every shipped kernel of ``dev``) once each.

    ``seed`` (a non-negative int) fixes the random inputs (default: fresh ones). Each
    kernel's generator comes from (seed, kernel name) alone, so checking a subset draws the
    same inputs for a kernel as checking all of them. Unknown names raise
    InvalidParameterError (a ValueError);
    a kernel without a check gives a NO CHECK result. ``progress`` is called per result.
    """
    names = shipped_kernels(dev)
    if kernels is not None:
        unknown = [k for k in kernels if k not in names]
        if unknown:
            raise InvalidParameterError(f"unknown kernel(s) {', '.join(unknown)}; this library has: "
                                        f"{', '.join(names)}")
        names = list(kernels)
    if seed is None:
        seed = np.random.SeedSequence().entropy
    results = []
    for name in names:
        child = kernel_seed(seed, name)
        fn = CHECKS.get(name)
        t0 = time.perf_counter()
        if fn is None:
            res = Result(name, "NO CHECK", detail="no reference check for this kernel yet")
        else:
            try:
                res = Result(name, "PASS", fn(dev, np.random.default_rng(child), name))
            except Mismatch as e:
                res = Result(name, "FAIL", e.error, str(e))
            except Exception as e:  # noqa: BLE001 (a dispatch error is a finding to report, not a crash)
                res = Result(name, "ERROR", None, f"{type(e).__name__}: {e}")
        res.seconds = time.perf_counter() - t0
        results.append(res)
        if progress:
            progress(res)
    return results

