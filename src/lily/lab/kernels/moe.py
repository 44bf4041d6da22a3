"""Decode MoE twins (metal/moe.metal): routing, the fused gate/up SwiGLU and down projections
over the selected experts and the shared expert, with random layer weights (:class:`MoeWeights`)."""

from __future__ import annotations

import numpy as np

from lily import _core
from lily.lab.device import download, pack_args, upload
from lily.lab.kernels.gemm import swiglu_bound
from lily.lab.kernels.gemv import TG, gemv_grid
from lily.lab.kernels.harness import (
    DEPTH, TOY, U, Mismatch, check, magnitude, model, rand_quant, ratio, run_bound, upload_q,
)
from lily.reference import sigmoid, softmax

GATE_UP_ROWS_PER_SG = _core.CONSTANTS["kGateUpRowsPerSimdgroup"]  # metal/decode_args.h


def route_args(E, k, hidden, norm=True) -> bytes:
    """RouteArgs of moe_route over E experts, top-k, a shared-expert gate row of ``hidden``."""
    return pack_args("RouteArgs", experts=E, top_k=k, hidden=hidden, norm_topk=norm)


def route_ref(logits, k, norm=True):
    """lily.reference.ReferenceModel.moe's routing on float32 logits: (expert ids, weights)."""
    p = softmax(logits.astype(np.float32)[None])[0]
    top = np.argsort(-p, kind="stable")[:k]
    w = p[top]
    return top, (w / w.sum() if norm else w)


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
        return pack_args("MoeArgs", hidden=self.hidden, inter=self.inter, inter_shared=self.inter_shared, experts=self.E,
                         top_k=k)

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
               constants=[(17, pack_args("MoeRouteArgs", hidden=W.hidden, inter=W.inter, inter_shared=W.inter_shared,
                                          experts=W.E, top_k=k, norm_topk=norm_topk))],
               reads=[X, (L, 0, 4 * (W.E + 1)), *experts],
               writes=[(H, 0, 4 * (k * W.inter + W.inter_shared)), (ids_buf, 0, 4 * k), (wts, 0, 4 * (k + 1))],
               threadgroups=True, label="moe_route_gate_up_swiglu_q4")


@check("moe_route")
def _moe_route(dev, rng, kernel, size=TOY):
    """Model size: 256 experts, top 8, the hidden 2048 (one threadgroup of round_up(E, 32))."""
    c = size.model and model()
    E, k, hidden = size.pick((32, 8, 128), (c and c.num_experts, c and c.num_experts_per_tok, c and c.hidden_size))
    logits = (rng.standard_normal(E) * 2).astype(np.float32)
    x = rng.standard_normal(hidden).astype(np.float32)
    gate = rand_quant(rng, (), 1, hidden, 8)
    L, X = upload(dev, logits), upload(dev, x)
    GW, GS, GB = upload_q(dev, gate)
    ids, wts = dev.buffer(4 * k), dev.buffer(4 * (k + 1))
    run_bound(dev, kernel, 1, -(-E // 32) * 32 if size.model else 32, [L, X, GW, GS, GB, ids, wts],
              route_args(E, k, hidden),
         reads=[L, X, GW, GS, GB], writes=[ids, wts])
    top, w = route_ref(logits, k)
    got_ids, got_w = download(ids, np.uint32), download(wts, np.float32)
    if not np.array_equal(got_ids, top):
        raise Mismatch(f"{kernel}: picked experts {got_ids.tolist()}, expected {top.tolist()}", 1.0)
    g = gate.dequantize()[0].astype(np.float64) @ x.astype(np.float64)
    gmag = magnitude(gate)[0] @ np.abs(x.astype(np.float64))
    r = ratio(got_w[:k], w, (16 * U * np.log2(E) + 8 * U) * np.abs(w), f"{kernel} weights")
    return max(r, ratio(got_w[k:], [sigmoid(g)], 0.25 * DEPTH * U * gmag + 4 * U, f"{kernel} shared gate"))


def _moe_case(dev, rng, size=TOY):
    """Random layer weights: 16 experts of 64 from 128, top 4; model size: 256 experts of 512
    from the hidden 2048 (and a shared expert of 512), top 8."""
    c = size.model and model()
    E, hidden, inter, inter_shared, k = size.pick(
        (16, 128, 64, 64, 4), c and (c.num_experts, c.hidden_size, c.moe_intermediate_size,
                                     c.shared_expert_intermediate_size, c.num_experts_per_tok))
    W = MoeWeights(rng, E, hidden, inter, inter_shared)
    return W, W.upload(dev), k


@check("moe_gate_up_swiglu_q4")
def _moe_gate_up(dev, rng, kernel, size=TOY):
    W, bufs, k = _moe_case(dev, rng, size)
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
def _moe_down(dev, rng, kernel, size=TOY):
    W, bufs, k = _moe_case(dev, rng, size)
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
def _moe_route_gate_up(dev, rng, kernel, size=TOY):
    W, bufs, k = _moe_case(dev, rng, size)
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
