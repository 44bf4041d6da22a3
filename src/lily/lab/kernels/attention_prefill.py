"""Prefill attention twins (metal/attention_prefill.metal, attention_prefill_tensor.metal):
the chunk prep and causal attention (direct and split + combine), with :func:`attention_twin`,
the kernels' arithmetic modelled in numpy."""

from __future__ import annotations

import numpy as np

from lily import _core
from lily._core import CONSTANTS, kernel_name, kernel_params
from lily.lab.device import download, pack_args, upload
from lily.lab.kernels.attention import THETA, attention_variant, rope_atol
from lily.lab.kernels.harness import (
    MODEL_CONTEXT, TOY, Mismatch, bf16_bits, bf16_operand, check, close_ratio, f32, from_bf16, run, upload_bf16,
)
from lily.reference import rms_norm, rope, round_bf16

# (Hq, Hkv, D, rotary_dim)
PREFILL_ATTN_DIMS = {
    "real": (16, 2, 256, 64),
    "dims": (8, 1, 256, 64),
    "tiny": (4, 2, 64, 16),
    "wide64": (8, 1, 64, 16),  # D = 64 with 8 query heads per KV head: G = 8, 4, 2
}
PREFILL_EPS = 1e-6
TILE = CONSTANTS["kAttnPrefillTile"]  # KV rows per tile (metal/prefill_args.h)
RESCALE = CONSTANTS["kAttnPrefillRescale"]  # lazy rescale threshold


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
    """Projection outputs of a chunk: qg [M, Hq*2D], k, v [M, Hkv*D], float32 holding bfloat
    values (q_proj, k_proj, v_proj store bfloat: gemm_q4_bf16), so the decode kernels' fp32
    inputs and the chunk kernels' bfloat inputs are the same numbers."""
    return tuple(bf16_operand(rng.standard_normal((M, n))).astype(np.float32)
                 for n in (Hq * 2 * D, Hkv * D, Hkv * D))


class PrefillAttnLayer:
    """Device KV cache and norm weights of one attention layer, and the prefill kernels
    encoded by the prefill chunk's own builders (lily._core.encode_attn_prefill*)."""

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
        """The projections as the chunk kernels read them: bfloat buffers."""
        return tuple(upload_bf16(self.dev, x) for x in (qg, k, v))

    # ---- encoders (into a compute pass p): the prefill chunk's own builders
    # (lily._core.encode_attn_prefill*, csrc/runtime/families/attention_prefill.h)

    def encode_prep(self, p, QG, K, V, p0, M, label=""):
        Hq, Hkv, D = self.Hq, self.Hkv, self.D
        Q = self.dev.buffer(M * Hq * D * (2 if self.tensor else 4))
        args = pack_args("AttnPrefillPrepArgs", num_q_heads=Hq, num_kv_heads=Hkv, rotary_dim=self.rot,
                         capacity=self.cap, p0=p0, rows=M, norm_eps=PREFILL_EPS, log2_theta=float(np.log2(THETA)),
                         q_scale=float(D) ** -0.5, q_group=self.G)
        # tensor: the tensor-op attention's bfloat q (pack_bf16_q)
        _core.encode_attn_prefill_prep(p, args, D, QG, K, V, self.QN, self.KN, self.KC, self.VC, Q,
                                       bf16_q=self.tensor, label=label)
        return Q

    def attn_args(self, p0, M, split_rows=0, num_splits=0):
        return pack_args("AttnPrefillArgs", num_q_heads=self.Hq, num_kv_heads=self.Hkv, capacity=self.cap, p0=p0,
                         rows=M, scale=float(self.D) ** -0.5, split_rows=split_rows, num_splits=num_splits)

    def encode_attn(self, p, Q, QG, p0, M, *, split=None, label=""):
        """split=None: attn_prefill; split=(S, num_splits): split kernel + combine."""
        Hq, D, G = self.Hq, self.D, self.G
        OUT = self.dev.buffer(M * Hq * D * 2)  # bfloat (o_proj's input)
        if split is None:
            _core.encode_attn_prefill(p, self.attn_args(p0, M), D, G, Q, QG, self.KC, self.VC, out=OUT,
                                      tensor=self.tensor, label=label)
            return OUT
        S, ns = split
        assert ns * S >= p0 + M
        ML, PO = self.dev.buffer(ns * M * Hq * 8), self.dev.buffer(ns * M * Hq * D * 4)
        args = self.attn_args(p0, M, S, ns)
        _core.encode_attn_prefill(p, args, D, G, Q, QG, self.KC, self.VC, ml=ML, po=PO, tensor=self.tensor,
                                  label=label)
        _core.encode_attn_prefill_combine(p, args, D, ML, PO, QG, OUT, label=label)
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
        """The attention output (stored bfloat) as float32 [M, Hq*D]."""
        return download(OUT, "bf16", (M, self.Hq * self.D))

    def download_q(self, Q, M):
        """The prep's q as fp32 [M, Hq, D] (on the tensor path: unpack_bf16_q)."""
        if not self.tensor:
            return download(Q, np.float32, (M, self.Hq, self.D))
        return unpack_bf16_q(download(Q, np.uint16, (self.Hq // self.G, M, self.G, self.D)), self.G)

    def attention_only(self, q, qg, p0, split=None):
        M = q.shape[0]
        Q, QG = upload(self.dev, pack_bf16_q(q, self.G) if self.tensor else q), upload_bf16(self.dev, qg)
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


def attention_twin(q, qg, K, V, p0, split_rows=None, halves=False):
    """The prefill attention kernels' arithmetic (metal/attention_prefill.metal and
    attention_prefill_tensor.metal, both on bfloat operands): row i of q [M, Hq, D] over K, V
    [Hkv, >= p0+M, D] (bf16 values, taken as they are: nothing is clipped) rows [0, p0 + i],
    gated, as [M, Hq*D]. Modelled as the kernels compute it: q * scale rounded to bf16, each
    score an fp32 sum of the exact products (8 x 8 significant bits fit in fp32's 24) in order
    over D (the simulator's product order; ``halves``: the tensor-op kernels', each half of D
    summed so and the lower half's sum plus the upper's), keys walked in tiles of TILE from the start of
    each split of ``split_rows`` keys (None: one range), a row's reference max moved only when
    a tile's max exceeds it by more than RESCALE, P = exp(s - m) in fp32 rounded to bf16, l the
    sum of the rounded P; the rest (P V, l, the split merge of attn_prefill_combine, the gate)
    in float64, where the kernel's fp32 accumulation differs from it by float32 rounding. Not
    modelled: the kernels store the result as bfloat (ATTN_OUT_RTOL)."""
    M, Hq, D = q.shape
    Hkv = K.shape[0]
    group = Hq // Hkv
    n = p0 + M
    f32_ = np.float32
    qh = round_bf16(q.astype(f32_) * f32_(1.0 / np.sqrt(D)))
    S = split_rows or n
    segments = [(b, min(b + S, n)) for b in range(0, n, S)]
    pos = p0 + np.arange(M)
    gate = qg.reshape(M, Hq, 2 * D)[:, :, D:].astype(np.float64)
    out = np.empty((M, Hq, D))
    for h in range(Hq):
        k = f32(K[h // group, :n])
        v = V[h // group, :n].astype(np.float64)
        prod = qh[:, h, None, :] * k[None, :, :]  # exact in fp32
        cuts = (0, D // 2, D) if halves else (0, D)
        s = np.zeros((M, n), f32_)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            part = np.zeros((M, n), f32_)
            for d in range(lo, hi):
                part += prod[:, :, d]
            s += part
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
                p = round_bf16(np.exp((st - mref[:, None]).astype(np.float64)).astype(f32_)).astype(np.float64)
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
    with np.errstate(over="ignore"):  # a gate of -1e5: exp overflows, sigmoid = 0
        return (out / (1 + np.exp(-gate))).reshape(M, Hq * D)


def prep_reference(L, qg, k, p0):
    """q [M, Hq, D] and k [M, Hkv, D] after RMSNorm + RoPE (lily.reference helpers)."""
    M, Hq, Hkv, D = qg.shape[0], L.Hq, L.Hkv, L.D
    P = p0 + np.arange(M)
    q = rope(rms_norm(qg.reshape(M, Hq, 2 * D)[:, :, :D], from_bf16(L.qn), PREFILL_EPS), P, L.rot, THETA)
    kk = rope(rms_norm(k.reshape(M, Hkv, D), from_bf16(L.kn), PREFILL_EPS), P, L.rot, THETA)
    return q, kk


# Prefill attention vs its twin on any device: a GPU sums the score products in another order
# than the twin, so a P value may round to the neighbouring bf16 value: one ulp, <= 2^-7 of a
# weight of a convex combination of V rows; |v| < 5 here (tests/kernels/test_attention_prefill.py):
# 8x the 4e-3 that bounded it with half operands (3 significant bits more).
ATTN_ATOL = 3.2e-2
# The output is stored as bfloat (o_proj's input), which the twin leaves in float64: one
# rounding, at most 2^-8 of the value (relative; nothing is clipped).
ATTN_OUT_RTOL = 2.0**-8
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
def _attn_prefill_prep(dev, rng, kernel, size=TOY):
    """Model size: a second chunk of size.rows rows (p0 = size.rows)."""
    bf16_q = kernel.endswith("_qbf")
    D, _ = attention_variant(kernel)
    p0, M = size.pick((11, 6), (size.rows, size.rows))
    L = PrefillAttnLayer(dev, _PREFILL_DIMS[D], p0 + M + 3, rng=rng, tensor=bf16_q)
    qg, k, v = chunk_inputs(rng, M, L.Hq, L.Hkv, L.D)
    QG, K, V = L.input_buffers(qg, k, v)
    _, Q = L.run(lambda p: L.encode_prep(p, QG, K, V, p0, M))
    q_ref, k_ref = prep_reference(L, qg, k, p0)
    # _qbf: q rounded to bf16 (relative error <= 2^-8, bf16's unit roundoff; twice that as
    # the bound)
    atol = rope_atol(p0 + M - 1)
    r = close_ratio(L.download_q(Q, M), q_ref, 2**-7 if bf16_q else 1e-5, atol, f"{kernel} q")
    kc, vc = L.cache()
    rows = slice(p0, p0 + M)
    r = max(r, close_ratio(from_bf16(vc[:, rows]), from_bf16(bf16_bits(v.reshape(M, L.Hkv, L.D)).transpose(1, 0, 2)),
                      0, 0, f"{kernel} cached v"))
    return max(r, close_ratio(from_bf16(kc[:, rows]), round_bf16(k_ref).transpose(1, 0, 2), 2**-7, atol,
                         f"{kernel} cached k"))


@check(*[kernel_name("attn_prefill", s, d=D, g=G) for D in (256, 64) for G in (8, 4, 2) for s in ("", "_tensor")])
def _attn_prefill(dev, rng, kernel, size=TOY):
    """Model size: a second chunk of size.rows rows (p0 = size.rows) over the model's heads
    (head dim 256: 16 query heads, 2 KV heads)."""
    D, G = attention_variant(kernel)
    p0, M = size.pick((13, 11), (size.rows, size.rows))
    tensor = kernel.endswith("_tensor")
    L, q, qg, K, V = _prefill_case(dev, rng, D, G, p0, M, tensor=tensor)
    return close_ratio(L.attention_only(q, qg, p0), attention_twin(q, qg, K, V, p0, halves=tensor), ATTN_OUT_RTOL,
                       ATTN_ATOL, kernel)


@check(*[kernel_name("attn_prefill_split", s, d=D, g=G) for D in (256, 64) for G in (8, 4, 2) for s in ("", "_tensor")],
       "attn_prefill_combine_d256", "attn_prefill_combine_d64")
def _attn_prefill_split(dev, rng, kernel, size=TOY):
    """Model size: a 64-row chunk ending at MODEL_CONTEXT (8192), the context in 8 splits of
    1024 rows (the split path runs a short chunk late in a long context)."""
    p = kernel_params(kernel)
    D, G = p["d"], p.get("g", 8)
    p0, M, S, ns = size.pick((13, 11, 16, 3), (MODEL_CONTEXT - 64, 64, 1024, 8))
    tensor = kernel.endswith("_tensor")
    L, q, qg, K, V = _prefill_case(dev, rng, D, G, p0, M, tensor=tensor)
    got = L.attention_only(q, qg, p0, split=(S, ns))
    return close_ratio(got, attention_twin(q, qg, K, V, p0, split_rows=S, halves=tensor), ATTN_OUT_RTOL, ATTN_ATOL,
                       f"{kernel} (split + combine)")


# ---- which path the tensor-op attention takes (attn_layout_probe_d<D>_tensor)---------------
# the probe's tensors, in its order (metal/attention_prefill_tensor.metal, attn_register_layout)
LAYOUT_TENSORS = ("scores", "P", "O")


def layout_probe(dev, head_dim: int = PREFILL_ATTN_DIMS["real"][2]):
    """Runs attn_layout_probe_d<head_dim>_tensor (one simdgroup) on ``dev``, an apple10 device with
    bfloat tensor ops.

    Returns
    -------
    slots : int32 [3, 32, kAttnLayoutProbeSlots, kAttnLayoutProbeFields]
        Per tensor (:data:`LAYOUT_TENSORS`), lane and slot: valid (1, 0; -1 past the tensor's
        capacity), row, column (-1 where not valid), and the row and column the fragment
        layout puts there (-1: it leaves the slot empty), as the kernel computes them.
    lanes : int32 [3, 32, kAttnLayoutProbeLaneFields]
        Per tensor and lane: the kernel's verdict (1: the fragment layout holds) and the
        tensor's capacity (slots per lane).

    Raises
    ------
    lily._core.UsageError (from the device)
        Where the device offers no bfloat tensor operations, or no such head dim is built (64, 256).
    """
    c = CONSTANTS
    shape = (c["kAttnLayoutProbeTensors"], c["kAttnLayoutProbeThreads"], c["kAttnLayoutProbeSlots"],
             c["kAttnLayoutProbeFields"])
    lanes_shape = (c["kAttnLayoutProbeTensors"], c["kAttnLayoutProbeThreads"], c["kAttnLayoutProbeLaneFields"])
    S, L = dev.buffer(4 * int(np.prod(shape))), dev.buffer(4 * int(np.prod(lanes_shape)))
    run(dev, kernel_name("attn_layout_probe", "_tensor", d=head_dim), 1, c["kAttnLayoutProbeThreads"], [(0, S), (1, L)],
        writes=[S, L])
    return download(S, np.int32, shape), download(L, np.int32, lanes_shape)


def _first_mismatch(slots, lanes):
    """(tensor, lane, slot, (row, col) or None, (row, col) or None) of the first slot whose
    contents differ from what the kernel says the fragment layout puts there, in a tensor and
    lane whose verdict failed; slot None where no recorded slot differs (the capacity does)."""
    for t, lane in zip(*np.nonzero(lanes[:, :, 0] != 1)):
        for i, (valid, row, col, want_row, want_col) in enumerate(slots[t, lane]):
            if valid == -1 and want_row == -1:
                continue  # past the capacity, and the layout needs nothing there
            if valid != 1 or (row, col) != (want_row, want_col):
                return (int(t), int(lane), i, (int(row), int(col)) if valid == 1 else None,
                        (int(want_row), int(want_col)) if want_row >= 0 else None)
        return int(t), int(lane), None, None, None
    return None


def tensor_attention_path(dev, head_dim: int = PREFILL_ATTN_DIMS["real"][2]) -> dict:
    """The path the prefill attention takes on ``dev`` at ``head_dim``, from the device's
    tensor-op support and, on an apple10 device, attn_layout_probe_d<head_dim>_tensor: the same
    check attn_prefill_*_tensor runs (docs/prefill.md, "Attention").

    Returns
    -------
    dict
        ``path``: "registers" (tensor ops, the scores and P in registers: the cooperative
        tensors hold the fragment layout), "threadgroup memory" (tensor ops, the scores and P
        through threadgroup memory) or "simdgroup" (no bfloat tensor ops: simdgroup_matrix);
        ``detail``: one sentence, naming the first mismatch on the threadgroup-memory path;
        ``mismatch``: None, or {tensor, lane, slot, holds, layout} ((row, column) pairs,
        None for an empty slot; slot None where the tensor's capacity differs).
        The runtime's options (gemm_path) may still choose simdgroup.
    """
    if not (dev.supports_tensor_ops and dev.supports_bfloat_tensor_ops):
        why = dev.bfloat_tensor_ops_status if dev.supports_tensor_ops else dev.tensor_ops_status
        return {"path": "simdgroup", "detail": f"simdgroup_matrix (no bfloat tensor ops: {why})", "mismatch": None}
    slots, lanes = layout_probe(dev, head_dim)
    first = _first_mismatch(slots, lanes)
    if first is None:
        return {"path": "registers", "detail": "scores and P in registers (the fragment layout holds)",
                "mismatch": None}
    t, lane, i, holds, want = first
    name = LAYOUT_TENSORS[t]

    def at(rc):
        return "nothing" if rc is None else f"(row {rc[0]}, column {rc[1]})"
    if i is None:
        why = f"the {name} tensor has {lanes[t, lane, 1]} slots per lane in lane {lane}, not the fragment layout's"
    else:
        why = (f"the {name} tensor's slot {i} of lane {lane} holds {at(holds)}; the fragment layout puts "
               f"{at(want)} there")
    return {"path": "threadgroup memory", "detail": f"scores and P through threadgroup memory: {why}",
            "mismatch": {"tensor": name, "lane": lane, "slot": i, "holds": holds, "layout": want}}


@check("attn_layout_probe_d256_tensor", "attn_layout_probe_d64_tensor")
def _attn_layout_probe(dev, rng, kernel, size=TOY):
    """The probe's records describe a layout: each tensor's valid slots over the 32 lanes hold
    every (row, column) of its 16 x 32 tile once, and a lane's verdict is 1 exactly where its
    slots hold the coordinates the kernel wrote as the fragment layout's (0: consistent)."""
    slots, lanes = layout_probe(dev, kernel_params(kernel)["d"])
    for t, name in enumerate(LAYOUT_TENSORS):
        valid = slots[t][slots[t, :, :, 0] == 1]
        cells = sorted(map(tuple, valid[:, 1:3].tolist()))
        want = [(r, c) for r in range(CONSTANTS["kAttnPrefillSlabRows"]) for c in range(TILE)]
        if cells != want:
            raise Mismatch(f"{kernel}: the {name} tensor's valid slots do not cover its tile once", float("inf"))
        for lane in range(lanes.shape[1]):
            rec = slots[t, lane]
            seen = rec[rec[:, 0] != -1]
            holds = bool((seen[:, 0] == (seen[:, 3] >= 0)).all() and (seen[:, 1:3] == seen[:, 3:5]).all())
            if holds != (lanes[t, lane, 0] == 1) and lanes[t, lane, 1] <= rec.shape[0]:
                raise Mismatch(f"{kernel}: the {name} tensor's verdict in lane {lane} disagrees with its slots",
                               float("inf"))
    return 0.0
