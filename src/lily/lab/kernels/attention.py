"""Decode attention twins (metal/attention.metal): q/k prep, attention over the KV cache
(direct and split + combine) and the fused step, over :class:`AttnLayer`; the fused step and
the combine, which the runtime dispatches, are encoded by the decode step's own builders
(:meth:`AttnLayer.encode_fused`)."""

from __future__ import annotations

import time
import types

import numpy as np

from lily import _core
from lily._core import kernel_name, kernel_params
from lily.lab.device import download, pack_args, upload
from lily.lab.kernels.harness import MODEL_CONTEXT, TOY, bf16_bits, check, close_ratio, f32, from_bf16, run
from lily.reference import rms_norm, rope, round_bf16

# Threads of an attn_decode* threadgroup (metal/mixer_args.h).
ATTN_TG = _core.CONSTANTS["kAttnDecodeThreads"]
THETA = 1e7
SURPLUS_FILL = 0x7FC0DEAD  # a NaN pattern in the split partials' slots no block may write


def attn_cfg(Hq, Hkv, D, rot):
    return types.SimpleNamespace(num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D,
                                 rotary_dim=rot, rope_theta=THETA, rms_norm_eps=1e-6)


def heads_per_group(Hq, Hkv):
    """G: query heads per decode threadgroup, the runtime's rule (csrc/runtime/encoder.h):
    the largest of 8, 4, 2 dividing the GQA group (the model's 8: each KV row read once)."""
    return next(g for g in (8, 4, 2) if (Hq // Hkv) % g == 0)


class AttnLayer:
    """Device KV cache + weights of one attention layer, and the encoders of its kernels: the
    runtime's (the fused step and the combine) and, for the unfused kernels the runtime does
    not dispatch (attn_qk_prep, attn_decode, attn_decode_split), bound dispatches
    (docs/kernels.md)."""

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
        self.partials = []  # (ml, acc, used, max_blocks) of split steps encoded, for check_surplus

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
        args = pack_args("AttnPrepArgs", num_q_heads=self.Hq, num_kv_heads=self.Hkv, head_dim=D, rotary_dim=self.rot,
                         capacity=self.cap, norm_eps=1e-6, log2_theta=float(np.log2(THETA)))
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
            args = pack_args("AttnDecodeArgs", num_q_heads=Hq, num_kv_heads=self.Hkv, capacity=self.cap, gate_stride=gs,
                             scale=scale, block_rows=0, max_blocks=0)
            self._timed("attn_decode", lambda: run(
                dev, kernel_name("attn_decode", d=D, g=G), Hq // G, ATTN_TG,
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
        args = pack_args("AttnDecodeArgs", num_q_heads=Hq, num_kv_heads=self.Hkv, capacity=self.cap, gate_stride=gs,
                         scale=scale, block_rows=block_rows, max_blocks=max_blocks)
        cargs = pack_args("AttnCombineArgs", num_q_heads=Hq, gate_stride=gs, block_rows=block_rows, max_blocks=max_blocks)
        cb = dev.command_buffer()
        p = cb.compute_pass()
        t = time.perf_counter()
        p.dispatch(kernel_name("attn_decode_split", d=D, g=G), (Hq // G, nblocks), ATTN_TG,
                   buffers=[(0, Q), (1, self.KC), (2, self.VC), (3, self.POS), (4, ML), (5, ACC)],
                   constants=[(6, args)], reads=[Q, self.KC, self.VC, self.POS], writes=parts,
                   threadgroups=True)
        _core.encode_attn_combine(p, cargs, D, ML, ACC, GATE, self.POS, OUT)
        cb.commit()
        cb.wait()
        self.seconds["attn_decode_split+combine"] = (self.seconds.get("attn_decode_split+combine", 0.0)
                                                      + time.perf_counter() - t)
        assert cb.counters["barrier_stages"] == 2  # combine waits for the partials
        return download(OUT, np.float32)

    # ---- fused prep + decode (attn_decode_fused / attn_decode_split_fused)

    def fused_args(self, block_rows=0, max_blocks=0):
        return pack_args("AttnFusedArgs", num_q_heads=self.Hq, num_kv_heads=self.Hkv, rotary_dim=self.rot,
                         capacity=self.cap, norm_eps=1e-6, log2_theta=float(np.log2(THETA)),
                         scale=float(self.D) ** -0.5, block_rows=block_rows, max_blocks=max_blocks)

    def encode_fused(self, p, QG, K, V, POS, pos, *, block_rows=None, extra_blocks=0, label=""):
        """Encodes the fused step at position pos (POS holds it) into pass p with the decode
        step's own builders (lily._core.encode_attn_decode_fused, encode_attn_combine:
        csrc/runtime/families/attention.h); returns the output buffer [Hq*D] fp32. Split
        (``block_rows``): ``extra_blocks`` surplus blocks, whose partial slots are filled with
        :data:`SURPLUS_FILL` first; :meth:`check_surplus` proves they wrote nothing there."""
        dev, D, Hq = self.dev, self.D, self.Hq
        OUT = dev.buffer(Hq * D * 4)
        common = (QG, K, V, self.QN, self.KN, POS, self.KC, self.VC, pos)
        if block_rows is None:
            _core.encode_attn_decode_fused(p, self.fused_args(), D, *common, out=OUT, label=label)
            return OUT
        used = -(-(pos + 1) // block_rows)
        max_blocks = used + extra_blocks  # the surplus blocks' slots too: they must stay untouched
        ML, ACC = (upload(dev, np.full(Hq * max_blocks * w, SURPLUS_FILL, np.uint32)) for w in (2, D))
        if extra_blocks:
            self.partials.append((ML, ACC, used, max_blocks))
        _core.encode_attn_decode_fused(p, self.fused_args(block_rows, max_blocks), D, *common, ml=ML, acc=ACC,
                                       extra_blocks=extra_blocks, label=label)
        # gate straight from the q_proj output: byte offset 4*D, stride 2*D
        _core.encode_attn_combine(p, pack_args("AttnCombineArgs", num_q_heads=Hq, gate_stride=2 * D,
                                               block_rows=block_rows, max_blocks=max_blocks),
                                  D, ML, ACC, QG, POS, OUT, gate_at=4 * D, label=label)
        return OUT

    def check_surplus(self):
        """Raises AssertionError if a surplus block of a split step encoded since the last call
        wrote its partial slots (the runtime declares all max_blocks slots written, so the
        hazard checker alone cannot tell)."""
        for ML, ACC, used, max_blocks in self.partials:
            for name, B, w in (("ml", ML, 2), ("acc", ACC, self.D)):
                surplus = download(B, np.uint32).reshape(self.Hq, max_blocks, w)[:, used:]
                if (surplus != SURPLUS_FILL).any():
                    raise AssertionError(f"attn_decode_split_fused: a surplus block wrote its {name} slots")
        self.partials.clear()

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
        self.check_surplus()
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


# one attention shape per kernel variant: head dim D and query heads per threadgroup G
# (Hq, Hkv, D, rotary): the GQA group is one for which the runtime picks that G (heads_per_group)
_ATTN = {(256, 8): (8, 1, 256, 64), (256, 4): (8, 2, 256, 64), (256, 2): (4, 2, 256, 64),
         (64, 4): (8, 2, 64, 16), (64, 2): (4, 2, 64, 16)}
# at a model size: Qwen3.6-35B-A3B's 16 query heads of 256 (2 KV heads: G = 8; 4 and 8 KV
# heads for the other G), the demo model's head dim 64 as above
_ATTN_MODEL = {**_ATTN, (256, 8): (16, 2, 256, 64), (256, 4): (16, 4, 256, 64), (256, 2): (16, 8, 256, 64)}
# rows per block of the model-size split path (the runtime picks about 208 at 8K: split_rows)
_MODEL_BLOCK_ROWS = 256


def _attn_layer(dev, rng, D, G, n, capacity=128, size=TOY):
    """An AttnLayer for variant (D, G) whose cache rows >= n are NaN (reading past the
    context shows up), a random query and gate, and the float32 K/V history."""
    Hq, Hkv, D, rot = size.pick(_ATTN, _ATTN_MODEL)[(D, G)]
    A = AttnLayer(dev, Hq, Hkv, D, rot, capacity, rng=rng)
    nan = np.uint16(0x7FC0)
    k, v = A.k_hist.copy(), A.v_hist.copy()
    k[:, n:], v[:, n:] = nan, nan
    A.KC.write(k.view(np.uint8).reshape(-1))
    A.VC.write(v.view(np.uint8).reshape(-1))
    q, gate = f32(rng.standard_normal((Hq, D))), f32(rng.standard_normal((Hq, D)))
    return A, q, gate, from_bf16(k), from_bf16(v)


def rope_atol(pos: int) -> float:
    """Absolute tolerance of q and k after RoPE at positions up to ``pos``: the kernels compute
    frequencies and angles in float32 (as MLX does), so at position p an angle is off by about
    p 2^-24 rad per unit of frequency, on values of O(1) after the RMSNorm: 1e-5 up to
    position 64, 2e-3 per 4096 positions beyond (tests/kernels/test_attention.py's bound)."""
    return 1e-5 if pos <= 64 else 2e-3 * max(1.0, pos / 4096)


def attention_variant(kernel):
    """(head dim, query heads per threadgroup; 4 for a kernel without one) of an attention
    kernel name (..._d256_g4)."""
    p = kernel_params(kernel)
    return p["d"], p.get("g", 4)


@check(*[kernel_name("attn_decode", d=D, g=G) for D, G in _ATTN])
def _attn_decode(dev, rng, kernel, size=TOY):
    """Model size: the longest context the runtime runs this path at (its split threshold, 256)."""
    D, G = attention_variant(kernel)
    n = size.pick(45, 256)
    A, q, gate, K, V = _attn_layer(dev, rng, D, G, n, max(128, n), size)
    A.set_position(n - 1)
    got = A.decode(upload(dev, q), upload(dev, gate), n)
    return close_ratio(got, attention_reference(q, gate, K, V, n, D), 2e-5, 2e-5, kernel)


@check(*[kernel_name("attn_decode_split", d=D, g=G) for D, G in _ATTN], "attn_combine_d256", "attn_combine_d64")
def _attn_decode_split(dev, rng, kernel, size=TOY):
    """Model size: a context of MODEL_CONTEXT (8192) rows in blocks of 256."""
    D, G = attention_variant(kernel)
    n, block = size.pick((100, 32), (MODEL_CONTEXT, _MODEL_BLOCK_ROWS))
    A, q, gate, K, V = _attn_layer(dev, rng, D, G, n, max(128, n), size)
    A.set_position(n - 1)
    got = A.decode(upload(dev, q), upload(dev, gate), n, split_threshold=1, block_rows=block, extra_blocks=1)
    return close_ratio(got, attention_reference(q, gate, K, V, n, D), 2e-5, 2e-5, f"{kernel} (split + combine)")


@check("attn_qk_prep")
def _attn_qk_prep(dev, rng, kernel, size=TOY):
    """Model size: the model's heads at the last position of MODEL_CONTEXT."""
    Hq, Hkv, D, rot = size.pick(_ATTN[(256, 4)], _ATTN_MODEL[(256, 8)])
    pos = size.pick(37, MODEL_CONTEXT - 1)
    A = AttnLayer(dev, Hq, Hkv, D, rot, size.pick(64, MODEL_CONTEXT), rng=rng)
    qg, k, v = (f32(rng.standard_normal((Hq, 2 * D))), f32(rng.standard_normal((Hkv, D))),
                f32(rng.standard_normal((Hkv, D))))
    A.set_position(pos)
    Q, GATE = A.prep(qg, k, v, pos)
    q_ref, k_ref = qk_prep_reference(A, qg, k, pos)
    atol = rope_atol(pos)
    r = close_ratio(download(Q, np.float32, (Hq, D)), q_ref, 1e-5, atol, f"{kernel} q")
    r = max(r, close_ratio(download(GATE, np.float32, (Hq, D)), qg[:, D:], 0, 0, f"{kernel} gate"))
    kc = download(A.KC, np.uint16, (Hkv, A.cap, D))
    vc = download(A.VC, np.uint16, (Hkv, A.cap, D))
    r = max(r, close_ratio(from_bf16(vc[:, pos]), from_bf16(bf16_bits(v)), 0, 0, f"{kernel} cached v"))
    # one bf16 ulp where a float32 difference can flip the rounding
    return max(r, close_ratio(from_bf16(kc[:, pos]), round_bf16(k_ref), 2**-7, atol, f"{kernel} cached k"))


@check(*[kernel_name(k, d=D, g=G) for k in ("attn_decode_fused", "attn_decode_split_fused") for D, G in _ATTN])
def _attn_decode_fused(dev, rng, kernel, size=TOY):
    """The fused step vs float64 attention over the cache as the kernel left it, with the
    query attn_qk_prep computes for the same token (checked on its own above). Model size:
    the split path at MODEL_CONTEXT (8192) rows in blocks of 256, the direct one at 256."""
    D, G = attention_variant(kernel)
    split = "split" in kernel
    n = size.pick(70, MODEL_CONTEXT if split else 256)
    seed = int(rng.integers(1 << 62))
    A, _, _, _, _ = _attn_layer(dev, np.random.default_rng(seed), D, G, n - 1, max(128, n), size)
    B, _, _, _, _ = _attn_layer(dev, np.random.default_rng(seed), D, G, n - 1, max(128, n), size)
    Hq, Hkv = A.Hq, A.Hkv
    qg, k, v = (f32(rng.standard_normal((Hq, 2 * D))), f32(rng.standard_normal((Hkv, D))),
                f32(rng.standard_normal((Hkv, D))))
    got = A.fused(qg, k, v, n - 1, **({"block_rows": size.pick(16, _MODEL_BLOCK_ROWS), "extra_blocks": 1}
                                      if split else {}))
    B.set_position(n - 1)
    Q, _ = B.prep(qg, k, v, n - 1)
    Kc = from_bf16(download(A.KC, np.uint16, (Hkv, A.cap, D)))
    Vc = from_bf16(download(A.VC, np.uint16, (Hkv, A.cap, D)))
    want = attention_reference(download(Q, np.float32, (Hq, D)), qg[:, D:], Kc, Vc, n, D)
    return close_ratio(got, want, 2e-5, 2e-5, kernel)
