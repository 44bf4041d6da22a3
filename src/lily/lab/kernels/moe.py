"""Decode MoE twins (metal/moe.metal): routing, the fused gate/up SwiGLU and down projections
over the selected experts and the shared expert, with random layer weights (:class:`MoeWeights`),
and the batched step's forms (issue 31: the rows' routing with the gate/up of the union of their
experts and of the shared expert, the down projections of several rows), each row compared bit
for bit with its batch-1 dispatches."""

from __future__ import annotations

import numpy as np

from lily import _core
from lily.lab.device import download, pack_args, upload
from lily.lab.kernels.gemm import swiglu_bound
from lily._core import kernel_name, kernel_params
from lily.lab.kernels.gemv import BATCH_SIZES, TG, same_bits
from lily.lab.kernels.harness import (
    DEPTH, QUANT_GROUP, TOY, U, Mismatch, check, magnitude, model, rand_quant, ratio, run_bound, upload_q,
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
        wb, sb = W.inter * W.hidden // 2, W.inter * W.hidden // QUANT_GROUP * 2
        for e in ids:
            for (w, s, bb) in (b["gate"], b["up"]):
                reads += [(w, int(e) * wb, wb), (s, int(e) * sb, sb), (bb, int(e) * sb, sb)]
    p.dispatch("moe_gate_up_swiglu_q4", grid, TG,
               buffers=[(0, X), (1, ids_buf), *[(2 + i, t) for i, t in enumerate([*b["gate"], *b["up"], *b["sgate"], *b["sup"]])],
                        (14, H)],
               constants=[(15, W.args(k))], reads=reads,
               writes=[(H, 0, 4 * (k * W.inter + W.inter_shared))], threadgroups=True,
               label="moe_gate_up_swiglu_q4")


def _dims(W, k):
    """The builders' MoE sizes of layer ``W`` with top-``k`` routing."""
    return dict(hidden=W.hidden, inter=W.inter, inter_shared=W.inter_shared, experts=W.E, top_k=k)


def enc_down(p, W, bufs, H, ids_buf, wts, R, k):
    """Encodes moe_down_q4 (R += the weighted down projections of H) with the decode step's own
    builder (lily._core.encode_moe_down, csrc/runtime/families/moe.h)."""
    _core.encode_moe_down(p, (bufs["down"], bufs["sdown"]), H, ids_buf, wts, R, **_dims(W, k))


def enc_route_gate_up(p, W, bufs, X, L, H, ids_buf, wts, k, norm_topk=True, tg=TG):
    """Encodes moe_route_gate_up_swiglu_q4 with the decode step's own builder
    (lily._core.encode_moe_route_gate_up, csrc/runtime/families/moe.h; docs/kernels.md)."""
    b = bufs
    _core.encode_moe_route_gate_up(p, (b["gate"], b["up"], b["sgate"], b["sup"]), X, L, H, ids_buf, wts,
                                   norm_topk=norm_topk, threads=tg, **_dims(W, k))


def enc_route_gate_up_batch(p, W, bufs, X, L, H, ids_buf, wts, k, n, strides, norm_topk=True):
    """Encodes moe_route_gate_up_batch_q4_b* over ``n`` rows with the decode step's own builder:
    ``strides`` = (xn, logits, h, ids, weights) elements between two rows of X, L (router logits
    | shared gate logit), H, ids_buf and wts (batch_args.h MoeBatchArgs)."""
    b = bufs
    xs, ls, hs, ids_s, ws = strides
    _core.encode_moe_route_gate_up(p, (b["gate"], b["up"], b["sgate"], b["sup"]), X, L, H, ids_buf, wts,
                                   norm_topk=norm_topk, batch_rows=n, x_stride=xs, logits_stride=ls, h_stride=hs,
                                   ids_stride=ids_s, w_stride=ws, **_dims(W, k))


def enc_down_batch(p, W, bufs, H, ids_buf, wts, R, k, n, strides):
    """Encodes moe_down_batch_q4_b* over ``n`` rows with the decode step's own builder:
    ``strides`` = (residual, h, ids, weights) elements between two rows of R, H, ids_buf and wts."""
    rs, hs, ids_s, ws = strides
    _core.encode_moe_down(p, (bufs["down"], bufs["sdown"]), H, ids_buf, wts, R, batch_rows=n, x_stride=rs,
                          h_stride=hs, ids_stride=ids_s, w_stride=ws, **_dims(W, k))


def batch_ids(rng, E, k, n, overlap):
    """Expert ids of ``n`` rows, top-k each (distinct within a row): with ``overlap`` True the
    rows share experts at other slots (row r's picks a rotation of row 0's, one replaced; needs
    E > k), with "same" every row picks row 0's experts in its order, with False the rows are
    disjoint (needs E >= n k)."""
    if overlap == "same":
        rows = [rng.choice(E, k, replace=False)] * n
    elif overlap:
        base = rng.choice(E, k + 1, replace=False)
        rows = [np.roll(np.delete(base, r % (k + 1)), r) for r in range(n)]
    else:
        rows = rng.choice(E, n * k, replace=False).reshape(n, k)
    return np.asarray(rows, np.uint32)


def logits_for(rng, E, ids):
    """Router logits [E + 1] (the last the shared-expert gate) whose top-k are ``ids`` in order."""
    lg = rng.standard_normal(E + 1).astype(np.float32) * 0.5 - 4
    lg[np.asarray(ids, int)] = 4 - 0.5 * np.arange(len(ids)) + 0.1 * rng.random(len(ids))
    return lg.astype(np.float32)


def _run(dev, enc, *a):
    cb = dev.command_buffer()
    enc(cb.compute_pass(), *a)
    cb.commit()
    cb.wait()


def moe_batch_ratio(dev, rng, W, bufs, k, n, overlap=True):
    """The batched MoE block after the router (moe_route_gate_up_batch_q4, moe_down_batch_q4,
    in one pass) over ``n`` strided rows against each row's batch-1 kernels
    (moe_route_gate_up_swiglu_q4, moe_down_q4) on that row alone: raises AssertionError unless
    every row's ids, weights, h and residual are bit-identical to them; returns the worst error
    ratio against float64. ``overlap``: the rows' experts overlap (at other slots) or are
    disjoint (:func:`batch_ids`)."""
    hid, slots = W.hidden, k * W.inter + W.inter_shared
    xs_, ls_, hs_, ids_s, ws_ = hid + 4, W.E + 3, slots + 4, k + 1, k + 3  # strides: padding between rows
    want_ids = batch_ids(rng, W.E, k, n, overlap)
    xs = rng.standard_normal((n, xs_)).astype(np.float32)
    lg = np.zeros((n, ls_), np.float32)
    for b in range(n):
        lg[b, :W.E + 1] = logits_for(rng, W.E, want_ids[b])
    r0 = rng.standard_normal((n, xs_)).astype(np.float32)
    X, L, R = upload(dev, xs.ravel()), upload(dev, lg.ravel()), upload(dev, r0.ravel())
    ID, WT, Hb = dev.buffer(4 * n * ids_s), dev.buffer(4 * n * ws_), dev.buffer(4 * n * hs_)

    def batched(p):
        enc_route_gate_up_batch(p, W, bufs, X, L, Hb, ID, WT, k, n, (xs_, ls_, hs_, ids_s, ws_))
        enc_down_batch(p, W, bufs, Hb, ID, WT, R, k, n, (xs_, hs_, ids_s, ws_))

    _run(dev, batched)
    got_ids = download(ID, np.uint32).reshape(n, ids_s)[:, :k]
    got_w = download(WT, np.float32).reshape(n, ws_)[:, :k + 1]
    got_h = download(Hb, np.float32).reshape(n, hs_)[:, :slots]
    got_r = download(R, np.float32).reshape(n, xs_)
    worst = 0.0
    for b in range(n):
        what = f"n={n} row {b}"
        if not np.array_equal(got_ids[b], want_ids[b]):
            raise AssertionError(f"moe_route_gate_up_batch {what}: picked {got_ids[b].tolist()}, expected {want_ids[b].tolist()}")
        X1, L1, R1 = upload(dev, xs[b, :hid]), upload(dev, lg[b, :W.E + 1]), upload(dev, r0[b, :hid])
        H1, ID1, WT1 = dev.buffer(4 * slots), dev.buffer(4 * k), dev.buffer(4 * (k + 1))
        _run(dev, enc_route_gate_up, W, bufs, X1, L1, H1, ID1, WT1, k)
        _run(dev, enc_down, W, bufs, H1, ID1, WT1, R1, k)
        same_bits(got_ids[b].view(np.float32), download(ID1, np.uint32).view(np.float32), f"moe_route_gate_up_batch {what} ids")
        same_bits(got_w[b], download(WT1, np.float32), f"moe_route_gate_up_batch {what} weights")
        same_bits(got_h[b], download(H1, np.float32), f"moe_route_gate_up_batch {what} h")
        same_bits(got_r[b, :hid], download(R1, np.float32), f"moe_down_batch {what}")
        if not np.array_equal(got_r[b, hid:].view(np.uint32), r0[b, hid:].view(np.uint32)):
            raise AssertionError(f"moe_down_batch {what}: wrote past the row")
        top, w = route_ref(lg[b, :W.E], k)
        worst = max(worst, ratio(got_w[b, :k], w, (16 * U * np.log2(W.E) + 8 * U) * np.abs(w), f"moe_route_gate_up_batch {what}"))
        want, tol = W.swiglu(xs[b, :hid], top)
        worst = max(worst, ratio(got_h[b], want, tol, f"moe_route_gate_up_batch {what} h"))
        d, tol = W.down_sum(got_h[b].astype(np.float64), top, got_w[b].astype(np.float64))
        worst = max(worst, ratio(got_r[b, :hid], r0[b, :hid] + d, tol + DEPTH * U * np.abs(r0[b, :hid]),
                                 f"moe_down_batch {what}"))
    return worst


@check(*[kernel_name(base, q=4, b=b) for base in ("moe_route_gate_up_batch", "moe_down_batch") for b in BATCH_SIZES])
def _moe_batch(dev, rng, kernel, size=TOY):
    """The batched MoE kernels of one b at b - 1 rows (at least 2) with overlapping experts
    (the pair is checked together: the down reads what the gate/up wrote). Model size: the
    model's MoE."""
    W, bufs, k = _moe_case(dev, rng, size)
    return moe_batch_ratio(dev, rng, W, bufs, k, max(2, kernel_params(kernel)["b"] - 1))


@check("moe_route")
def _moe_route(dev, rng, kernel, size=TOY):
    """Model size: 256 experts, top 8, the hidden 2048 (one threadgroup of _core.moe_route_threads(E))."""
    c = size.model and model()
    E, k, hidden = size.pick((32, 8, 128), (c and c.num_experts, c and c.num_experts_per_tok, c and c.hidden_size))
    logits = (rng.standard_normal(E) * 2).astype(np.float32)
    x = rng.standard_normal(hidden).astype(np.float32)
    gate = rand_quant(rng, (), 1, hidden, 8)
    L, X = upload(dev, logits), upload(dev, x)
    GW, GS, GB = upload_q(dev, gate)
    ids, wts = dev.buffer(4 * k), dev.buffer(4 * (k + 1))
    run_bound(dev, kernel, 1, _core.moe_route_threads(E), [L, X, GW, GS, GB, ids, wts],
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
