"""Gated DeltaNet decode twins (metal/gdn.metal): the device layout of the recurrent state,
the decode step and the state write-back window, as the runtime encodes them, and
:class:`GdnLayer`, one layer's buffers with the reference oracle on the same weights."""

from __future__ import annotations

import time
import types

import numpy as np

from lily import _core
from lily._core import kernel_params
from lily.checkpoint import gdn_state_floats
from lily.lab.device import download, upload
from lily.lab.kernels.harness import (
    TOY, StubOracle, bf16_bits, check, close_ratio, f32, from_bf16, model, ratio,
)
from lily.reference import ReferenceState


def gdn_cfg(Hk, Hv, Dk, Dv, K=4):
    return types.SimpleNamespace(linear_num_key_heads=Hk, linear_num_value_heads=Hv,
                                 linear_key_head_dim=Dk, linear_value_head_dim=Dv,
                                 linear_conv_kernel_dim=K, rms_norm_eps=1e-6,
                                 conv_dim=2 * Hk * Dk + Hv * Dv)


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


GDN_DECODE_SPLITS = _core.CONSTANTS["kGdnDecodeSplits"]  # threadgroups per value head of gdn_decode_step


def gdn_ring_entry(Hk, Hv, Dk, Dv) -> int:
    """Floats of one ring entry of the state write-back window (metal/mixer_args.h GdnRing,
    through the core): delta [Hv*Dv] | normalised k [Hk*Dk] | g [Hv]."""
    return _core.gdn_ring_entry_floats(Hk, Hv, Dk, Dv)


def gdn_decode_dispatch(p, Hk, Hv, Dk, Dv, K, qkv, b, a, weights, cin, cout, state, out, ssq, ring,
                        splits=GDN_DECODE_SPLITS, label="", pending=0, write_back=True):
    """Encodes gdn_decode_step_k{Dk}_v{Dv} on compute pass ``p`` with the decode plan's own
    builder (``lily._core.encode_gdn_decode_step``, csrc/runtime/families/gdn.h): grid (Hv,
    splits). ``weights``: the conv_w, A_log and dt_bias buffers; ``out``: y = S q, fp32
    [Hv*Dv]; ``ssq``: fp32 [Hv, splits], each split's sum of y^2. ``ring``: the layer's ring of
    pending updates; the step replays ``pending`` entries, then writes the state back
    (``write_back``) or appends its entry."""
    _core.encode_gdn_decode_step(p, Hk, Hv, Dk, Dv, K, tuple(weights), qkv, b, a, cin, cout, state, ring, out, ssq,
                                 splits=splits, pending=pending, write_back=write_back, label=label)


def gdn_writeback_dispatch(p, Hk, Hv, Dk, Dv, K, state, ring, pending, splits=GDN_DECODE_SPLITS):
    """Encodes gdn_state_writeback with the decode plan's builder: the state after ``pending``
    ring entries."""
    _core.encode_gdn_state_writeback(p, Hk, Hv, Dk, Dv, K, state, ring, pending, splits=splits)


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
        gdn_decode_dispatch(p, self.Hk, self.Hv, self.Dk, self.Dv, self.K, Q, B, A, self.w[:3],
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


def _gdn_heads(Dk, size):
    """(Hk, Hv) of a check: 2 and 4, or at a model size with the model's Dk (128) its 16 and 32."""
    c = size.model and model()
    return (c.linear_num_key_heads, c.linear_num_value_heads) if c and Dk == c.linear_key_head_dim else (2, 4)


@check("gdn_decode_step_k128_v128", "gdn_decode_step_k32_v32")
def _gdn_decode_step(dev, rng, kernel, size=TOY):
    """Model size: the model's 16 key and 32 value heads of 128 (k32: the demo's dims, as small)."""
    Dk = kernel_params(kernel)["k"]
    Hk, Hv = _gdn_heads(Dk, size)
    L = GdnLayer(dev, Hk, Hv, Dk, Dk, rng=rng)
    c = 2.0 ** -rng.uniform(0, 40, Hv)  # pending decays (S = c S', S ~ 0.3): the step applies c
    L.set_state(rng.standard_normal((3, L.conv_dim)), 0.3 * rng.standard_normal((Hv, Dk, Dk)) / c[:, None, None], c)
    inp = L.random_inputs()
    got = L.step_device(*inp)
    want = L.step_reference(*inp)
    r = close_ratio(got, want, 1e-4, 1e-5, f"{kernel} output")
    ssq = gdn_split_ssq(L.last_y, L.Dv, GDN_DECODE_SPLITS)
    r = max(r, close_ratio(L.last_ssq.reshape(ssq.shape), ssq, 1e-5, 1e-6, f"{kernel} ssq"))
    return max(r, close_ratio(L.device_state()[1], L.st.recurrent[0], 1e-4, 1e-5, f"{kernel} state"))


@check("gdn_state_writeback_k128_v128", "gdn_state_writeback_k32_v32")
def _gdn_state_writeback(dev, rng, kernel, size=TOY):
    """The write-back window (docs/decode.md): steps that replay the ring (window 4) and the
    write-back of the steps left pending give, bit for bit, the outputs and the state of
    writing the state back every step. On a GPU this also checks that the compiler treats the
    replayed update as the step's own (same contraction into fused multiply-adds). Model size:
    the model's heads and the runtime's window of 16 (a full ring replayed)."""
    Dk = kernel_params(kernel)["k"]
    Hk, Hv = _gdn_heads(Dk, size)
    if size.model:
        from lily.native_backend import default_state_window
        window = default_state_window()
    else:
        window = 4
    every, windowed = gdn_window_pair(dev, Hk, Hv, Dk, Dk, window, rng)
    r = 0.0
    for t in range(window + 2):  # the windowed layer writes back after `window` steps, 2 pending at the end
        inp = every.random_inputs()
        want, got = every.step_device(*inp), windowed.step_device(*inp)
        r = max(r, ratio(got, want, 0.0, f"{kernel}: step {t} output"),
                ratio(windowed.last_y, every.last_y, 0.0, f"{kernel}: step {t} y"))
    assert windowed.pending == 2
    for want, got, what in zip(every.state_parts(), windowed.state_parts(), ("S'", "c")):
        r = max(r, ratio(got, want, 0.0, f"{kernel}: written-back {what}"))
    return r
