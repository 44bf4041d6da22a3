"""Gated DeltaNet prefill twins (metal/gdn_prefill.metal): the chunk scan with its inline
convolution, the norm scale and the conv state, over :class:`GdnPrefillLayer`."""

from __future__ import annotations

import types

import numpy as np

from lily import _core
from lily.checkpoint import gdn_state_floats
from lily.lab.device import download, upload
from lily.lab.kernels.gdn import (
    GDN_DECODE_SPLITS, gdn_decode_dispatch, gdn_folded, gdn_gated_norm32, gdn_ring_entry, gdn_rows,
    gdn_state_bytes, gdn_state_parts,
)
from lily.lab.kernels.harness import (
    TOY, U, StubOracle, bf16_bits, bf16_operand, bf16_round, check, f32, from_bf16, ratio,
)
from lily.reference import l2_norm, sigmoid, silu


def gdn_stored(want, tol):
    """(want, tol) of a gated-norm output within tol of want (fp32 math) as out_proj stages it
    (metal/gdn_prefill.metal): bfloat(u * f_s) with u = bfloat(want / f_s) and f_s rounded to
    half, two bfloat roundings and a half one (at most ~(2 * 2**-8 + 2**-11) of the magnitude,
    or 2**-25 for a subnormal f_s, a split holding < 2**-28 of its head's y^2, which random
    inputs do not meet). Nothing is clipped: bf16 has fp32's range."""
    want = np.asarray(want, np.float64)
    return want, tol + 1.01 * (2 * 2.0**-8 + 2.0**-11) * (np.abs(want) + tol) + 3 * 2.0**-25


GDN_SCAN_FOLD = _core.CONSTANTS["kGdnScanFold"]  # gdn_scan folds its pending decay once c * g < this


GDN_PREFILL_DIMS = {  # Hk, Hv, Dk, Dv
    "real": (16, 32, 128, 128),
    "dims": (2, 4, 128, 128),
    "tiny": (2, 4, 32, 32),
}
GDN_K = _core.CONSTANTS["kGdnConvTaps"]  # conv taps (the model's and every preset's linear_conv_kernel_dim)
GDN_EPS = 1e-6     # rms_norm_eps and the L2-norm eps
GDN_SCAN_LANES = _core.CONSTANTS["kGdnScanLanesPerRow"]  # lanes per state row of gdn_scan
GDN_CONV_STATE_THREADS = _core.CONSTANTS["kGdnConvStateThreads"]  # gdn_conv_state's threadgroup (prefill_args.h)
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
        self.RV = _core.gdn_scan_rows(Dv)  # state rows per scan threadgroup, as the prefill plan picks them
        self.S_splits = Dv // self.RV  # splits of a head: the scan's sums of y^2 and norm factors per split
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
        """Random projections qkv, z, b, a (float32); z holds bfloat values (in_proj_z stores
        bfloat), so the decode step's fp32 z and the chunk's bfloat z are the same numbers."""
        r = self.rng
        return (f32(r.standard_normal((M, self.C))), bf16_operand(r.standard_normal((M, self.Hv * self.Dv))).astype(np.float32),
                f32(r.standard_normal((M, self.Hv))), f32(r.standard_normal((M, self.Hv))))

    def input_buffers(self, qkv, z, b, a):
        """The projections as the chunk kernels read them (rows_buffer pairs): z bfloat, the
        others fp32."""
        return (rows_buffer(self.dev, qkv), rows_buffer(self.dev, bf16_bits(z), dtype=np.uint16),
                rows_buffer(self.dev, b), rows_buffer(self.dev, a))

    # ---- encoders: the prefill plan's own builders (csrc/runtime/families/gdn_prefill.h)
    def encode_scan(self, p, qkv, cin, z, b, a, outs, M):
        """gdn_scan (conv inline from ``qkv`` and the conv state ``cin``; u (bfloat) and the splits'
        sums of y^2) then gdn_norm_scale (the splits' half factors), as the prefill chunk encodes
        them (``lily._core.encode_gdn_scan`` / ``encode_gdn_norm_scale``). ``qkv``, ``z``, ``b``,
        ``a``: (buffer, declared range) pairs from rows_buffer; ``outs``: out_buffers(M)."""
        (O, _), (SS, _), (F, _) = outs
        dims = (self.Hk, self.Hv, self.Dk, self.Dv, GDN_K)
        _core.encode_gdn_scan(p, *dims, tuple(self.W), qkv[0], b[0], a[0], z[0], cin, self.S, O, SS, M, GDN_EPS)
        _core.encode_gdn_norm_scale(p, *dims, SS, F, M, GDN_EPS)

    def encode_conv_state(self, p, qkv, M, cin, cout, tg=GDN_CONV_STATE_THREADS):
        """gdn_conv_state: the conv state after M rows of ``qkv`` (may be ``cin`` itself), as the
        prefill chunk encodes it (``lily._core.encode_gdn_conv_state``; ``tg`` threads per
        threadgroup)."""
        _core.encode_gdn_conv_state(p, self.Hk, self.Hv, self.Dk, self.Dv, GDN_K, qkv[0], cin, cout, M, threads=tg)

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
        """The scan's u (bfloat) and sums of y^2 (fp32, per split) and the norm scale's factors
        (half, per split) for M rows, with spare rows (rows_out_buffer pairs)."""
        return (rows_out_buffer(self.dev, M, self.Hv * self.Dv, itemsize=2),
                rows_out_buffer(self.dev, M, self.Hv * self.S_splits),
                rows_out_buffer(self.dev, M, self.Hv * self.S_splits, itemsize=2))

    def normed(self, outs, M):
        """The gated-norm output as out_proj (gemm_q4_add_hs) stages it, bfloat(u * f) per
        element (the fp32 product rounded once: the GEMM's staging), from ``outs``
        (out_buffers) as float32 [M + SPARE_ROWS, Hv*Dv]."""
        u = download(outs[0][0], "bf16", (M + SPARE_ROWS, self.Hv * self.Dv))
        f = download(outs[2][0], np.float16, (M + SPARE_ROWS, self.Hv * self.S_splits)).astype(np.float32)
        return bf16_round(u * np.repeat(f, self.RV, axis=1))

    def decode_step(self, qkv, z, b, a, pos):
        """gdn_decode_step on one token at position pos (conv state pos % 2 -> (pos+1) % 2),
        then the gated norm out_proj applies on load (gdn_gated_norm32)."""
        dev = self.dev
        Q, B, A = upload(dev, qkv), upload(dev, b), upload(dev, a)
        out, ssq = dev.buffer(self.Hv * self.Dv * 4), dev.buffer(self.Hv * GDN_DECODE_SPLITS * 4)
        cin, cout = self.CS[pos % 2], self.CS[(pos + 1) % 2]
        cb = dev.command_buffer()
        p = cb.compute_pass()
        gdn_decode_dispatch(p, self.Hk, self.Hv, self.Dk, self.Dv, GDN_K, Q, B, A, self.W[:3],
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

    def scan_reference(self, conv, z, b, a, S):
        """float64 scan of one chunk from the conv output (docs/model.md; the reference's loop).

        Returns the outputs o [M, Hv*Dv], the new state, and per output the error scale
        ``kappa * (|o| + |norm_w * silu(z)|)`` where ``kappa = rms_v(sum_k |S_vk q_k|) /
        rms_v(y_v)`` is the cancellation factor of the head's y = S q (the RMSNorm divides by
        rms(y), so an error relative to the terms of y is amplified by kappa)."""
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
        return o.reshape(M, Hv * Dv), S, scale.reshape(M, Hv * Dv)


@check("gdn_conv_state")
def _gdn_conv_state(dev, rng, kernel, size=TOY):
    """Model size: the model's conv channels (8192) after a chunk of size.rows rows."""
    L = GdnPrefillLayer(dev, size.pick("tiny", "real"), rng=rng)
    worst = 0.0
    for M, out in ((2, 0), (size.pick(7, size.rows), 1)):  # in place (M < K-1 keeps old rows) and into the other buffer
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
def _gdn_scan(dev, rng, kernel, size=TOY):
    """The scan (conv inline) and the norm scale run together (the scale's input is the scan's
    sums of y^2); the output checked is the gated norm as out_proj stages it. Model size: the
    model's 16 key and 32 value heads of 128 (k32: the demo's dims) over size.rows tokens."""
    L = GdnPrefillLayer(dev, ("real" if size.model else "dims") if "128" in kernel else "tiny", rng=rng)
    M = size.pick(9, size.rows)
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
