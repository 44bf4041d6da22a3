"""Prefill MoE twins (metal/moe_prefill.metal, moe_prefill_tensor.metal): the chunk's routing
(clear, top-k, scatter into tile maps by class), the grouped expert GEMMs and the combine."""

from __future__ import annotations

import numpy as np

from lily import _core
from lily._core import kernel_params
from lily.lab.device import download, pack_args, upload
from lily.lab.kernels.gemm import gemm_ref, swiglu_ref
from lily.lab.kernels.gemm import beyond_half
from lily.lab.kernels.harness import (
    TOY, U, Mismatch, bf16_activations, bf16_stored, check, model, rand_quant, ratio, run_encoder, to_bf16_bits,
    upload_bf16,
    upload_q,
)
from lily.lab.kernels.norm import norm_bf16_ref
from lily.reference import sigmoid, softmax

MOE_TENSOR_TILES = _core.EXPERT_TILE_ROWS  # the tile heights (metal/prefill_args.h kExpertTileRows)
# the simdgroup_matrix path's (the taller ones: tensor ops only; PrefillPlan::expert_tile_available)
MOE_TILES = tuple(T for T in MOE_TENSOR_TILES if T <= _core.CONSTANTS["kMoeSimdgroupTileRowsMax"])


def moe_geometry(T: int, tensor: bool) -> tuple[int, int, int]:
    """(threads, gate/up output columns, down output columns) per threadgroup of the grouped
    GEMMs of tile height T on a path (``tensor``: the ``_tensor`` kernels; T = 128 exists on
    that path only), the prefill plan's (lily._core.moe_geometry: the kernels' moe_gemm_threads /
    moe_gemm_bn of metal/prefill_args.h; both kernels run on the same threads)."""
    threads, bn, down_threads, down_bn = _core.moe_geometry(T, tensor or T not in MOE_TILES)
    assert threads == down_threads, "the lab's twins take one thread count for both kernels"
    return threads, bn, down_bn


# The simdgroup_matrix path's geometry per tile height: threads, gate/up and down columns.
MOE_TG, MOE_BN, MOE_DOWN_BN = ({T: moe_geometry(T, False)[i] for T in MOE_TILES} for i in range(3))


def route_tg(E):
    """Threadgroup of moe_route_topk / moe_route_scatter as the prefill plan dispatches them
    (lily._core.moe_route_threads: round_up(E, 32), at most kMoeRouteMaxThreads)."""
    return _core.moe_route_threads(E)


def route_args(M, E, k, norm=True, block_rows=64, tile_rows=32):
    return pack_args("MoeRoutePrefillArgs", rows=M, experts=E, top_k=k, norm_topk=norm, block_rows=block_rows,
                     tile_rows=tile_rows)


def nblocks(M, R):
    return -(-M // R)


# The tile-class rules of metal/prefill_args.h, the kernels' and the host's (through the core).
tile_classes = _core.moe_tile_classes
tail_class = _core.moe_tail_class  # (T, r): the class of an expert's last tile of r rows
class_capacity = _core.moe_class_capacity  # (n, E, T, c): most tiles class c holds for n assignments
class_base = _core.moe_class_base  # (n, E, T, c): first entry of class c's map


def max_tiles(M, k, E, T):
    """Entries of all class maps of a height-T tiling of M rows (lily._core.moe_map_entries)."""
    return _core.moe_map_entries(M * k, E, T)


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
    """moe_route_clear with the prefill chunk's own builder (lily._core.encode_moe_route_clear,
    csrc/runtime/families/moe_prefill.h)."""
    _core.encode_moe_route_clear(p, bc, route_args(M, E, k, True, R, T), label="moe_route_clear")


def enc_topk(p, L, ids, w, bc, M, E, k, norm, R, T, tg=None):
    """moe_route_topk with the chunk's builder; tg: threads (None: route_tg(E))."""
    _core.encode_moe_route_topk(p, L, ids, w, bc, route_args(M, E, k, norm, R, T), threads=tg or 0,
                                label="moe_route_topk")


def enc_scatter(p, ids, bc, perm, tiles, tcount, counts, M, E, k, R, T, tg=None):
    """moe_route_scatter with the chunk's builder; tg: threads (None: route_tg(E))."""
    _core.encode_moe_route_scatter(p, ids, bc, perm, tiles, tcount, counts, route_args(M, E, k, True, R, T),
                                   threads=tg or 0, label="moe_route_scatter")


def combine_args(M, H, k) -> bytes:
    """MoeCombineArgs of M rows of width H with k routed experts each."""
    return pack_args("MoeCombineArgs", rows=M, hidden=H, top_k=k)


def enc_combine(p, h, yx, w, M, H, k, tg=0):
    """moe_combine with the chunk's builder (lily._core.encode_moe_combine): h fp32 [M, H]
    (updated), yx bfloat [M*k, H], w fp32 [M, k+1] (its last column, the shared gate, is not
    read: the shared expert is already in h); tg threads a threadgroup (0: the runtime's)."""
    _core.encode_moe_combine(p, h, yx, w, combine_args(M, H, k), threads=tg, label="moe_combine")


def combine_inputs(rng, M, H, k):
    """Random operands of moe_combine(_norm): h fp32 [M, H], yx bfloat-valued float32
    [M*k, H] (as the down projections store it; some rows beyond the half range), w fp32
    [M, k+1] in [0, 1)."""
    return (rng.standard_normal((M, H)).astype(np.float32), bf16_activations(beyond_half(rng, (M * k, H))),
            rng.random((M, k + 1)).astype(np.float32))


def enc_combine_norm(p, h, yx, w, nw, xn, M, H, k, eps=1e-6, tg=0):
    """moe_combine_norm with the chunk's builder: enc_combine's operands, then xn bfloat [M, H]
    = RMSNorm(h) * nw (bf16 [H]); one threadgroup of tg threads per row (0: the runtime's)."""
    _core.encode_moe_combine(p, h, yx, w, combine_args(M, H, k), norm=nw, xn=xn, eps=eps, threads=tg,
                             label="moe_combine_norm")


def combine_ref(h, yx, w):
    """(want, tol) of moe_combine on the values it reads (yx: the bfloat outputs as stored);
    float64, the bound of tests/kernels/test_moe_prefill.py's docstring."""
    M, k = w.shape[0], w.shape[1] - 1
    H = h.shape[1]
    y3 = yx.astype(np.float64).reshape(M, k, H)
    w64 = w.astype(np.float64)
    terms = np.abs(h) + np.einsum("mj,mjh->mh", np.abs(w64[:, :k]), np.abs(y3))
    want = h + np.einsum("mj,mjh->mh", w64[:, :k], y3)
    return want, (k + 2) * U * terms


def make_routing(rng, M, E, k, T, skew):
    """Random top-k ids [M, k] (distinct per row), the grouped order perm (experts in
    increasing order, slots of one expert in *random* order) and the tile map.
    skew: one expert is chosen by ~90% of the rows and half of the experts never are; else
    every expert is chosen at least once where M * k >= E (so the map holds at least one tile
    per expert whatever the draw)."""
    if skew:
        hot = int(rng.integers(E))
        pool = np.setdiff1d(rng.choice(E, max(k + 1, E // 2), replace=False), [hot])
        ids = np.stack([rng.choice(pool, k, replace=False) for _ in range(M)])
        rows = rng.random(M) < 0.9
        ids[rows, rng.integers(k, size=rows.sum())] = hot
    else:
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)])
        if M * k >= E:  # the first ceil(E / k) rows deal out a permutation of the experts
            deal = rng.permutation(E)
            for r in range(-(-E // k)):
                part = deal[r * k:(r + 1) * k]
                rest = rng.choice(np.setdiff1d(np.arange(E), part), k - len(part), replace=False)
                ids[r] = np.concatenate([part, rest])
            ids = ids[rng.permutation(M)]
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
    return pack_args("MoeGemmArgs", n=n, k=k, m=M, top_k=top_k, experts=E, lda=lda, ldy=ldy, tile_rows=tile_rows)


def _map(cls):
    """The builder's (tiles_at, count_at) of one class map: cls = None (the map and its count
    from offset 0) or (class c, first entry): the map at that entry, its count at TC[c]."""
    return (0, 0) if cls is None else (16 * cls[1], 4 * cls[0])


def enc_moe_gemm_gate_up(p, T, X, P, TL, TC, max_tiles, gb, ub, HX, M, k, E, H, I, lda=None, ldy=None, kernel=None,
                         cls=None, tile_rows=None, tag=0):
    """moe_gemm_gate_up_q4_t{T} over max_tiles tiles with the prefill chunk's own builder
    (lily._core.encode_moe_gemm, csrc/runtime/families/moe_prefill.h). cls: (class, first map
    entry) to read one class map of moe_route_scatter's buffers (tile_rows: the tiling's T;
    tag: the disjoint write tag shared by the classes of one projection)."""
    lda, ldy = lda or H, ldy or I
    kernel = kernel or _core.kernel_name("moe_gemm_gate_up", q=4, t=T)
    tiles_at, count_at = _map(cls)
    _core.encode_moe_gemm(p, kernel, (tuple(gb), tuple(ub)), X, P, TL, TC, HX,
                          moe_args(I, H, M, k, E, lda, ldy, tile_rows or T), max_tiles, tiles_at=tiles_at,
                          count_at=count_at, disjoint=tag)


def enc_moe_gemm_down(p, T, HX, P, TL, TC, max_tiles, db, YX, M, k, E, H, I, lda=None, ldy=None, kernel=None,
                      cls=None, tile_rows=None, tag=0):
    """moe_gemm_down_q4_t{T}: YX bfloat [M*k, ldy]; cls, tile_rows, tag as enc_moe_gemm_gate_up."""
    lda, ldy = lda or I, ldy or H
    kernel = kernel or _core.kernel_name("moe_gemm_down", q=4, t=T)
    tiles_at, count_at = _map(cls)
    _core.encode_moe_gemm(p, kernel, (tuple(db),), HX, P, TL, TC, YX, moe_args(H, I, M, k, E, lda, ldy, tile_rows or T),
                          max_tiles, tiles_at=tiles_at, count_at=count_at, disjoint=tag)


def _route_shape(size, toy, T=32):
    """(M, E, k, R, T) of a routing check: ``toy``, or a chunk of size.rows rows over the
    model's 256 experts, top 8, in the runtime's 64-row blocks."""
    c = size.model and model()
    return size.pick(toy, c and (size.rows, c.num_experts, c.num_experts_per_tok, 64, T))


@check("moe_route_clear")
def _moe_route_clear(dev, rng, kernel, size=TOY):
    M, E, k, R, T = _route_shape(size, (40, 32, 4, 16, 16))
    n = nblocks(M, R) * E
    bc = dev.buffer(4 * n)  # poisoned on the simulator; garbage on a GPU
    bc.write(np.full(n, 0xFFFFFFFF, np.uint32).view(np.uint8))
    run_encoder(dev, enc_clear, bc, M, E, k, R, T)
    got = download(bc, np.uint32)
    if got.any():
        raise Mismatch(f"{kernel}: {int((got != 0).sum())} of {n} counters not cleared", 1.0)
    return 0.0


@check("moe_route_topk")
def _moe_route_topk(dev, rng, kernel, size=TOY):
    M, E, k, R, T = _route_shape(size, (21, 32, 4, 8, 16))
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
def _moe_route_scatter(dev, rng, kernel, size=TOY):
    M, E, k, R, T = _route_shape(size, (37, 8, 4, 8, 32))  # toy: ~18 rows per expert: full tiles and both tail classes
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
def _moe_combine(dev, rng, kernel, size=TOY):
    """moe_combine_norm: h as moe_combine, and xn, the RMSNorm of the h it wrote, as bfloat.
    Model size: size.rows rows of the hidden 2048, top 8."""
    norm = kernel.endswith("_norm")
    c = size.model and model()
    M, H, k = size.pick((9, 256, 4), c and (size.rows, c.hidden_size, c.num_experts_per_tok))
    h, yx, w = combine_inputs(rng, M, H, k)
    Hb, Y, Wt = upload(dev, h), upload_bf16(dev, yx), upload(dev, w)
    if norm:
        nw, XN = to_bf16_bits(1 + 0.3 * rng.standard_normal(H)), dev.buffer(2 * M * H)
        run_encoder(dev, enc_combine_norm, Hb, Y, Wt, upload(dev, nw), XN, M, H, k)
    else:
        run_encoder(dev, enc_combine, Hb, Y, Wt, M, H, k)
    hout = download(Hb, np.float32, (M, H))
    want, tol = combine_ref(h.astype(np.float64), yx, w)
    r = ratio(hout, want, tol, kernel + " h")
    if norm:
        want, tol = norm_bf16_ref(hout, nw)
        r = max(r, ratio(download(XN, "bf16", (M, H)), want, tol, kernel + " xn"))
    return r


def _grouped(kernel):
    """(tile height T) of a grouped GEMM kernel name (..._t16, ..._t32_tensor)."""
    return kernel_params(kernel)["t"]


def _moe_rows(T):
    """Rows of a grouped GEMM check: 23 (every tile partial below T = 32), 80 at T = 128 (~40
    rows per expert: tiles of several 16-row bands, all partial)."""
    return 80 if T == 128 else 23


def _expert_shape(kernel, size):
    """(T, E, k, H, I, M, skew) of a grouped GEMM check: small, or a chunk of size.rows rows
    over the model's 256 experts of 512 from the hidden 2048, top 8, routed with one expert
    taking ~90% of the rows (full tiles of every height, and tails)."""
    T = _grouped(kernel)
    c = size.model and model()
    return size.pick((T, 8, 4, 128, 64, _moe_rows(T), False),
                     c and (T, c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size,
                            size.rows, True))


@check(*[_core.kernel_name("moe_gemm_gate_up", s, q=4, t=T) for T in MOE_TENSOR_TILES for s in ("", "_tensor")
         if s or T in MOE_TILES])
def _moe_gemm_gate_up(dev, rng, kernel, size=TOY):
    T, E, k, H, I, M, skew = _expert_shape(kernel, size)
    _ids, perm, tiles = make_routing(rng, M, E, k, T, skew)
    gq, uq = rand_quant(rng, (E,), I, H, 4), rand_quant(rng, (E,), I, H, 4)
    x = bf16_activations(beyond_half(rng, (M, H)))
    X, P = upload_bf16(dev, x), upload(dev, perm)
    TL, TC, max_tiles = tile_buffers(dev, tiles, len(tiles), M, E, k, T)
    HX = dev.buffer(2 * M * k * I)  # bfloat
    cb = dev.command_buffer()
    enc_moe_gemm_gate_up(cb.compute_pass(), T, X, P, TL, TC, max_tiles, list(upload_q(dev, gq)), list(upload_q(dev, uq)),
                         HX, M, k, E, H, I, kernel=kernel)
    cb.commit()
    cb.wait()
    hx = download(HX, "bf16", (M * k, I))
    r = 0.0
    for e, begin, rows, _ in tiles:
        want, tol = bf16_stored(*swiglu_ref(x[perm[begin:begin + rows] // k], gq, uq, int(e)))
        r = max(r, ratio(hx[begin:begin + rows], want, tol, f"{kernel} expert {e}"))
    return r


@check(*[_core.kernel_name("moe_gemm_down", s, q=4, t=T) for T in MOE_TENSOR_TILES for s in ("", "_tensor")
         if s or T in MOE_TILES])
def _moe_gemm_down(dev, rng, kernel, size=TOY):
    T, E, k, H, I, M, skew = _expert_shape(kernel, size)
    _ids, perm, tiles = make_routing(rng, M, E, k, T, skew)
    dq = rand_quant(rng, (E,), H, I, 4)
    hx = bf16_activations(beyond_half(rng, (M * k, I)))
    HX, P = upload_bf16(dev, hx), upload(dev, perm)
    TL, TC, max_tiles = tile_buffers(dev, tiles, len(tiles), M, E, k, T)
    YX = dev.buffer(2 * M * k * H)  # bfloat
    cb = dev.command_buffer()
    enc_moe_gemm_down(cb.compute_pass(), T, HX, P, TL, TC, max_tiles, list(upload_q(dev, dq)), YX, M, k, E, H, I,
                      kernel=kernel)
    cb.commit()
    cb.wait()
    yx = download(YX, "bf16", (M * k, H))
    r = 0.0
    for e, begin, rows, _ in tiles:
        a = perm[begin:begin + rows]
        want, tol = bf16_stored(*gemm_ref(hx[begin:begin + rows], dq, int(e)))
        r = max(r, ratio(yx[a], want, tol, f"{kernel} expert {e}"))
    return r
