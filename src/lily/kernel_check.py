"""One run of each shipped kernel against its numpy reference (``lily doctor``).

Every check builds small fresh random inputs, dispatches one kernel of the shipped library
on a native device (``metal``, or ``sim`` on Linux) and compares the outputs with a numpy
evaluation in float64, against the same first-order error bounds the kernel tests use
(tests/test_kernels_*.py import the reference helpers from here: one home for them).

    results = run_checks(device)            # every kernel of device.kernel_names()
    for r in results: print(r.kernel, r.status, r.error)

A result's ``error`` is the worst ratio of |got - exact| to the kernel's tolerance (PASS
when <= 1), or for exact kernels (argmax, routing ids) 0 or 1. Kernels whose name starts
with ``st_`` are the simulator's self-test kernels (metal/selftest*.metal), not part of the
model; they are not checked here.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lily._device import constant, download, upload
from lily.checkpoint import QuantizedTensor, bf16_to_f32
from lily.errors import InvalidParameterError
from lily.reference import ReferenceModel, ReferenceState, softmax

U = 2.0**-24          # fp32 unit roundoff
DEPTH = 64            # accumulation depth bound of the GEMV-like kernels (tests/test_kernels_gemv_moe.py)
GEMV_ROWS_PER_SG = 8  # kGemvRowsPerSimdgroup (metal/common.h)
TG = 64               # threads per threadgroup used for the GEMV-like kernels
GEMM_BM, GEMM_BN, GEMM_TG = 32, 64, 128  # dense GEMM tile and threads (metal/gemm.metal, gemm_tensor.metal)

SELFTEST_PREFIX = "st_"

#: Shipped kernels that have no check here yet: ``lily doctor`` reports them as NO CHECK.
#: tests/test_doctor.py keeps this list exact, so a new kernel without a check fails a test.
PENDING = frozenset({
    "attn_prefill_combine_d256", "attn_prefill_combine_d64", "attn_prefill_d256_g2", "attn_prefill_d256_g4",
    "attn_prefill_d256_g8", "attn_prefill_d64_g2", "attn_prefill_d64_g4", "attn_prefill_d64_g8",
    "attn_prefill_prep_d256", "attn_prefill_prep_d64", "attn_prefill_split_d256_g2", "attn_prefill_split_d256_g4",
    "attn_prefill_split_d256_g8", "attn_prefill_split_d64_g2", "attn_prefill_split_d64_g4",
    "attn_prefill_split_d64_g8", "embed_norm_gemv_q4", "embed_rows_q4", "gdn_conv_chunk", "gdn_scan_k128_v128",
    "gdn_scan_k32_v32", "gemm_swiglu_q4", "gemm_swiglu_q4_tensor", "moe_combine", "moe_down_q4",
    "moe_gate_up_swiglu_q4", "moe_gemm_down_q4_t16", "moe_gemm_down_q4_t16_tensor", "moe_gemm_down_q4_t32",
    "moe_gemm_down_q4_t32_tensor", "moe_gemm_gate_up_q4_t16", "moe_gemm_gate_up_q4_t16_tensor",
    "moe_gemm_gate_up_q4_t32", "moe_gemm_gate_up_q4_t32_tensor", "moe_route_clear", "moe_route_gate_up_swiglu_q4",
    "moe_route_scatter", "moe_route_topk", "norm_gemv_q4", "norm_gemv_q8", "sample_token", "tensor_ops_probe",
})


# ----------------------------------------------------------------------------- references


def to_bf16_bits(x) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def rand_quant(rng, lead, rows, cols, bits, name="w") -> QuantizedTensor:
    """Random MLX-layout tensor [*lead, rows, cols]: uniform codes, realistic bf16 scales
    (weights ~ +-0.03) and biases (about -scale * 2**(bits-1), so w is centred)."""
    shape = (*lead, rows)
    words = rng.integers(0, 2**32, size=(*shape, cols * bits // 32), dtype=np.uint64).astype(np.uint32)
    g = (*shape, cols // 64)
    s = (rng.random(g, dtype=np.float32) * 0.004 + 0.0005)
    b = -s * (2 ** (bits - 1) - 0.5) + rng.standard_normal(g, dtype=np.float32) * 0.002
    return QuantizedTensor(name, words, to_bf16_bits(s), to_bf16_bits(b), bits, 64)


def magnitude(qt: QuantizedTensor, index=None) -> np.ndarray:
    """(|s| q + |b|) as float64 [*, rows, cols]: the per-term magnitudes the kernels sum."""
    w, s, b = qt.weight, qt.scales, qt.biases
    if index is not None:
        w, s, b = w[index], s[index], b[index]
    per = 32 // qt.bits
    q = (w[..., None] >> (np.arange(per, dtype=np.uint32) * qt.bits)) & np.uint32((1 << qt.bits) - 1)
    q = q.reshape(*w.shape[:-1], -1).astype(np.float64)
    qg = q.reshape(*q.shape[:-1], -1, 64)
    m = qg * np.abs(bf16_to_f32(s)).astype(np.float64)[..., None] + np.abs(bf16_to_f32(b)).astype(np.float64)[..., None]
    return m.reshape(q.shape)


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
def bf16_bits(x) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even."""
    from lily.reference import round_bf16
    return (round_bf16(np.asarray(x, np.float32)).view(np.uint32) >> 16).astype(np.uint16)


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


class GdnLayer:
    """Device buffers of one GDN layer plus the oracle with the same weights."""

    def __init__(self, dev, Hk, Hv, Dk, Dv, K=4, seed=0, rng=None):
        self.dev, self.Hk, self.Hv, self.Dk, self.Dv, self.K = dev, Hk, Hv, Dk, Dv, K
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


THETA = 1e7

def attn_cfg(Hq, Hkv, D, rot):
    return types.SimpleNamespace(num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D,
                                 rotary_dim=rot, rope_theta=THETA, rms_norm_eps=1e-6)


def heads_per_group(Hq, Hkv):
    """G: query heads per decode threadgroup (4, or the whole GQA group if smaller)."""
    return min(4, Hq // Hkv)


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


def _run(dev, kernel, grid, tg, buffers, args, reads, writes, threadgroups=True):
    """``run`` with buffers bound at 0, 1, ... and the constant bytes ``args`` after them."""
    return run(dev, kernel, grid, tg, list(enumerate(buffers)), [(len(buffers), args)], reads, writes, threadgroups)


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
    _run(dev, kernel, gemv_grid(rows), TG, [W, S, B, X, Y], constant(rows, cols),
         reads=[W, S, B, X] + ([Y] if add else []), writes=[Y])
    exact = qt.dequantize().astype(np.float64) @ x.astype(np.float64)
    mag = magnitude(qt) @ np.abs(x.astype(np.float64))
    if add:
        exact, mag = exact + r0, mag + np.abs(r0)
    return ratio(download(Y, np.float32), exact, DEPTH * U * mag, f"{kernel} {rows}x{cols}")


@check("embed_q4")
def _embed(dev, rng, kernel):
    vocab, cols = 100, 128
    qt = rand_quant(rng, (), vocab, cols, 4)
    W, S, B = upload_q(dev, qt)
    tok = int(rng.integers(vocab))
    T, O = upload(dev, np.array([tok], np.uint32)), dev.buffer(4 * cols)
    _run(dev, kernel, cols // 8, 64, [W, S, B, T, O], constant(cols, vocab), reads=[W, S, B, T], writes=[O],
         threadgroups=False)
    return ratio(download(O, np.float32), qt.dequantize(tok).astype(np.float64), 2 * U * magnitude(qt, tok),
                 f"{kernel} row {tok}")


@check("rms_norm")
def _rms_norm(dev, rng, kernel):
    rows, n, eps = 3, 256, 1e-6
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    w = to_bf16_bits(1 + 0.3 * rng.standard_normal(n))
    X, Wt, O = upload(dev, x), upload(dev, w), dev.buffer(4 * rows * n)
    _run(dev, kernel, rows, 64, [X, Wt, O], constant(n) + np.float32(eps).tobytes(), reads=[X, Wt], writes=[O])
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + eps) * bf16_to_f32(w)
    return ratio(download(O, np.float32, (rows, n)), want, DEPTH * U * np.abs(want) + 1e-30, kernel)


@check("moe_route")
def _moe_route(dev, rng, kernel):
    E, k, hidden = 32, 8, 128
    logits = (rng.standard_normal(E) * 2).astype(np.float32)
    x = rng.standard_normal(hidden).astype(np.float32)
    gate = rand_quant(rng, (), 1, hidden, 8)
    L, X = upload(dev, logits), upload(dev, x)
    GW, GS, GB = upload_q(dev, gate)
    ids, wts = dev.buffer(4 * k), dev.buffer(4 * (k + 1))
    _run(dev, kernel, 1, 32, [L, X, GW, GS, GB, ids, wts], constant(E, k, hidden, 1),
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
    _run(dev, kernel, 1, 1024, [L, TOK], constant(V), reads=[L], writes=[TOK])
    got, want = int(download(TOK, np.uint32)[0]), int(np.argmax(logits))
    if got != want:
        raise Mismatch(f"{kernel}: token {got}, expected {want} (argmax, lowest index on ties)", 1.0)
    return 0.0


@check("gemm_q4", "gemm_q8", "gemm_q4_add", "gemm_q4_tensor", "gemm_q8_tensor", "gemm_q4_add_tensor")
def _gemm(dev, rng, kernel):
    bits, add = int(kernel[6]), "_add" in kernel
    m, n, k = 33, 70, 128
    qt = rand_quant(rng, (), n, k, bits)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y0 = rng.standard_normal((m, n)).astype(np.float32)
    W, S, B = upload_q(dev, qt)
    X = upload(dev, x)
    Y = upload(dev, y0) if add else dev.buffer(4 * m * n)
    _run(dev, kernel, (-(-n // GEMM_BN), -(-m // GEMM_BM)), GEMM_TG, [W, S, B, X, Y], constant(m, n, k, k, n),
         reads=[W, S, B, X] + ([Y] if add else []), writes=[Y])
    x64 = x.astype(np.float64)
    exact = x64 @ qt.dequantize().astype(np.float64).T
    tol = (k + 8) * U * (np.abs(x64) @ magnitude(qt).T)
    if add:
        exact = exact + y0
        tol = tol + 2 * U * np.abs(exact)
    return ratio(download(Y, np.float32, (m, n)), exact, tol, f"{kernel} {m}x{n}x{k}")


@check("gdn_decode_step_k128_v128", "gdn_decode_step_k32_v32")
def _gdn_decode_step(dev, rng, kernel):
    Dk = int(kernel.split("_k")[1].split("_")[0])
    L = GdnLayer(dev, 2, 4, Dk, Dk, rng=rng)
    L.set_state(rng.standard_normal((3, L.conv_dim)), 0.3 * rng.standard_normal((4, Dk, Dk)))
    inp = L.random_inputs()
    got = L.step_device(*inp)
    want = L.step_reference(*inp)
    r = _close(got, want, 1e-4, 1e-5, f"{kernel} output")
    return max(r, _close(L.device_state()[1], L.st.recurrent[0], 1e-4, 1e-5, f"{kernel} state"))


# one attention shape per kernel variant: head dim D and query heads per threadgroup G
_ATTN = {(256, 4): (8, 1, 256, 64), (256, 2): (4, 2, 256, 64), (64, 4): (8, 2, 64, 16), (64, 2): (4, 2, 64, 16)}


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
    from lily.reference import rms_norm, rope, round_bf16
    Hq, Hkv, D, rot = _ATTN[(256, 4)]
    pos = 37
    A = AttnLayer(dev, Hq, Hkv, D, rot, 64, rng=rng)
    qg, k, v = (f32(rng.standard_normal((Hq, 2 * D))), f32(rng.standard_normal((Hkv, D))),
                f32(rng.standard_normal((Hkv, D))))
    A.set_position(pos)
    Q, GATE = A.prep(qg, k, v, pos)
    P = np.array([pos])
    q_ref = rope(rms_norm(qg[None, :, :D], from_bf16(A.qn), 1e-6), P, rot, THETA)[0]
    k_ref = rope(rms_norm(k[None], from_bf16(A.kn), 1e-6), P, rot, THETA)[0]
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


# ----------------------------------------------------------------------------- running


def shipped_kernels(dev) -> list[str]:
    """The model's kernels in ``dev``'s library (its self-test kernels left out), sorted."""
    return sorted(k for k in dev.kernel_names() if not k.startswith(SELFTEST_PREFIX))


def run_checks(dev, kernels: list[str] | None = None, seed: int | None = None,
               progress: Callable[[Result], None] | None = None) -> list[Result]:
    """Checks ``kernels`` (default: every shipped kernel of ``dev``) once each.

    ``seed`` fixes the random inputs (default: fresh ones). Unknown names raise
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
    seq = np.random.SeedSequence(seed)
    results = []
    for name, child in zip(names, seq.spawn(len(names))):
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

