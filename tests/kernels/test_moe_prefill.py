"""The MoE prefill family (metal/moe_prefill.metal) on the Metal simulator: expert routing
of a chunk and the grouped expert GEMMs.

Routing: ``moe_route_clear``, ``moe_route_topk`` (softmax, top-k, weights, shared gate, block
histogram), ``moe_route_scatter`` (scans, stable scatter into the grouped order, the tile map
and count of every tile class, per-expert counts) and ``moe_combine``, each against numpy on
fresh random inputs (and, for the scatter, loads with a remainder at every class edge, one
expert taking every row, every expert reached, empty experts), then the
whole chain in one command buffer (one concurrent pass, barriers derived from the declared
ranges), run as two chunks encoded ahead on the same buffers. Every output buffer starts
poisoned (NaN / 0xFFFFFFFF), and has a poisoned tail that must stay untouched.

Tolerances and exactness:
* expert ids, the histogram, ``perm``, the tile maps and ``tile_count`` of every tile class
  (``lily.lab.kernels.moe_prefill.tiles_ref``: full T-row tiles in class 0, each expert's remainder in
  the smallest class T >> c holding it) are integers and are compared exactly (``perm`` is
  deterministic: within an expert, increasing assignment index, i.e. numpy
  ``argsort(ids.ravel(), kind="stable")``).
* Top-k picks are compared exactly with ``lily.reference``'s routing (float32 softmax,
  ``argsort(-p, kind="stable")``). To make that comparison well posed, the random logits lie
  on a grid of 1/16: two distinct logits then differ by a factor >= e^(1/16) in p, far beyond
  any float32 rounding, and equal logits give exactly equal p on both sides, so both sides
  break the tie to the lower index (ties are frequent on the grid; dedicated tests add more).
  Off-grid logits would give a ~1% chance per 16K picks that a near-tie within rounding
  flips an order (not a bug).
* Routing weights: the kernel's softmax sums E exps in another order than numpy; each exp
  and the division add a few u (u = 2^-24) of relative error and the sum ~log2(E) u, so
  rtol 16 u log2(E) + 8 u (the decode kernel test's bound). Against the decode kernel
  ``moe_route`` the picks are compared exactly and the weights bit for bit on the simulator
  (same route_topk code), within a few ulps on a GPU (another kernel:
  harness.assert_same_arithmetic).
* Shared gate ``w[:, k] = sigmoid(logit)``: float32 exp and division, |error| <= 8 u.
* ``moe_combine_norm``: h as ``moe_combine``; xn, the RMSNorm of the h it wrote, within
  rms_norm_bf16's bound (``norm_bf16_ref``: DEPTH u |want| plus the bf16 rounding); and bit
  for bit moe_combine followed by rms_norm_bf16 at the same thread count (the row code is
  shared: rms_row of metal/common.h) on the simulator, a few ulps on a GPU (other kernels).
* ``moe_combine``: reads the routed expert outputs ``yx`` as bfloat (as the down projections
  store them; each value converts to float32 exactly) and h, w as float32 (the shared
  expert is already in h); k products and k+1 terms summed in float32 in a fixed order; the
  first-order bound of recursive summation is (k+1) u sum|terms|; we allow (k+2) u
  sum|terms| per element against float64 on the bfloat values it read.

Grouped expert GEMMs ``moe_gemm_gate_up_q4_t{T}``, ``moe_gemm_down_q4_t{T}`` over a tile map
(skewed expert loads, empty experts, arbitrary slot order inside an expert, tile_count <
max_tiles with plausible but stale tile entries past it, a real-model-shaped layer), and
the gate/up -> down chain in one concurrent pass; and the tile classes end to end: the
scatter's maps, then one gate/up and one down dispatch per class, the classes of a projection
in one barrier stage (their writes share a disjoint-write tag), also with the dispatches of
each stage run in reverse / random order. Random MLX-layout weights
(``rand_quant``); references ``gemm_ref`` / ``swiglu_ref`` of lily.lab.kernels.gemm, which model
the bfloat operands; tolerances are the fp32 bounds derived in tests/kernels/test_gemm.py's
docstring (the same tiles, metal/gemm_tiles.h). Inputs reach 10x the half range on every third
row (``beyond_half``: nothing is clipped). Both projections store bfloat outputs (gate/up hx,
down yx: fp32 sums rounded to nearest), so both bounds get the rounding of the stored value
added (``bf16_stored``: 2^-8 of its magnitude). In the chain,
hx is the kernel's own gate/up output, so the down kernel is checked with that bound on
exactly the values it read. Slots of tiles past tile_count must stay poisoned (NaN).

Kernel tests run in the three simulator modes of the ``dev`` fixture (forward; reverse
thread/threadgroup order with undeclared-read detection; random order), all with
out-of-range write detection; the chain test also runs the dispatches of each barrier
stage in reverse / random order.
"""

from __future__ import annotations

import math

import numpy as np
from seeding import fresh_rng
from harness import ORDERS, THREAD_ORDERS, run_encoder as run1  # noqa: F401
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import download, pack_args, sim_device, upload  # noqa: E402
from lily.reference import sigmoid  # noqa: E402
from lily.lab.kernels.harness import to_bf16_bits  # noqa: E402,F401
from lily.lab.kernels.moe_prefill import (  # noqa: E402,F401
    block_hist, class_base, class_capacity, combine_inputs, combine_ref, max_tiles, nblocks, route_args, route_tg,
    tile_classes, tiles_ref,
)
from lily.lab.kernels.norm import norm_bf16_ref  # noqa: E402,F401
from lily.lab.kernels.moe_prefill import route_ref_rows as route_ref  # noqa: E402
from lily.lab.kernels.gemm import beyond_half, gemm_ref, swiglu_ref  # noqa: E402
from lily.lab.kernels.moe_prefill import MOE_TILES, make_routing, tile_buffers  # noqa: E402
from lily.lab.kernels.harness import bf16_activations as bact, bf16_stored, upload_bf16  # noqa: E402
from lily.lab.kernels import moe_prefill  # noqa: E402
from harness import assert_same_arithmetic, assert_within as check, commit, rand_quant, twin_target, upload_q  # noqa: E402


def _on_target(enc, kind):
    """``enc`` (the prefill chunk's builder of a grouped GEMM) on a pass of a plain device or
    of a harness.TwinDevice (test_moe_prefill_tensor.py), whose twins the builder picks by name."""
    def run(p, T, *args, kernel=None, **kw):
        p, tensor = twin_target(p)
        kernel = kernel or _core.kernel_name(f"moe_gemm_{kind}", q=4, t=T)
        if tensor and not kernel.endswith("_tensor"):
            kernel += "_tensor"
        return enc(p, T, *args, kernel=kernel, **kw)
    return run


enc_gate_up = _on_target(moe_prefill.enc_moe_gemm_gate_up, "gate_up")
enc_down = _on_target(moe_prefill.enc_moe_gemm_down, "down")


def _real_pass(enc):
    """``enc`` (the chunk's routing or combine builder, no tensor twin) on the real pass under a
    harness.TwinDevice's."""
    return lambda p, *args, **kw: enc(twin_target(p)[0], *args, **kw)


enc_clear, enc_topk, enc_scatter, enc_combine, enc_combine_norm = (
    _real_pass(getattr(moe_prefill, f"enc_{n}")) for n in ("clear", "topk", "scatter", "combine", "combine_norm"))

U = 2.0**-24
POISON = np.uint32(0xFFFFFFFF)
PAD = 8  # poisoned elements after every output, which must stay untouched
MAX_BLOCK_SLOTS = _core.CONSTANTS["kMoeRouteMaxBlockSlots"]  # metal/prefill_args.h


@pytest.fixture(scope="module", params=ORDERS)
def chain_dev(request):
    """As ``dev``, and the dispatches of a barrier stage run in reverse / random order."""
    opts = dict(THREAD_ORDERS[request.param])
    if request.param != "forward":
        opts["order"] = request.param
    return sim_device(**opts)


# ------------------------------------------------------------------------------ helpers

def out_buffer(dev, n, itemsize=4):
    """A poisoned buffer of n elements + PAD (the dispatches declare only the n)."""
    return dev.buffer(itemsize * (n + PAD))


def grid_logits(rng, M, E, scale=2.0, step=1.0 / 16):
    """Router logits [M, E+1] on a grid of `step` (see the module docstring)."""
    return (np.round(rng.standard_normal((M, E + 1)) * scale / step) * step).astype(np.float32)


def assert_untouched(arr, n, what):
    tail = arr.reshape(-1)[n:]
    assert (tail.view(np.uint32) == POISON).all(), f"{what}: wrote past its {n} elements"


def check_grouping(ids, perm, tiles, tile_count, counts, E, T, tails=True):
    """perm, the tile maps of every class and the histogram against numpy and their
    invariants. tails: the poisoned elements past each output (and map entries past each
    class's tile_count) are untouched. Returns the maps by class."""
    M, k = ids.shape
    n = M * k
    flat = ids.ravel()
    classes = tile_classes(T)
    if tails:
        assert_untouched(perm, n, "perm")
        assert_untouched(counts, E, "counts")
        assert_untouched(tile_count, classes, "tile_count")
        assert_untouched(tiles, 4 * max_tiles(M, k, E, T), "tiles")
    perm = perm[:n]
    np.testing.assert_array_equal(counts[:E], np.bincount(flat, minlength=E), err_msg="counts")
    # perm: a permutation; experts contiguous and increasing; increasing within an expert
    assert np.array_equal(np.sort(perm), np.arange(n)), "perm is not a permutation"
    pe = flat[perm]
    assert (np.diff(pe.astype(np.int64)) >= 0).all(), "experts not contiguous / increasing"
    same = pe[1:] == pe[:-1]
    assert (perm[1:][same] > perm[:-1][same]).all(), "order within an expert not increasing"
    np.testing.assert_array_equal(perm, np.argsort(flat, kind="stable"), err_msg="perm")
    # tile maps, class c (height T >> c) at its own entries of the buffer
    want = tiles_ref(np.bincount(flat, minlength=E), T)
    every = tiles.reshape(-1, 4)
    maps = []
    for c in range(classes):
        base, cap, nt, h = class_base(n, E, T, c), class_capacity(n, E, T, c), int(tile_count[c]), T >> c
        lo = (T >> (c + 1)) + 1 if c + 1 < classes else 1  # fewer rows belong to a smaller class
        assert nt == len(want[c]), f"class {c}: tile_count {nt}, want {len(want[c])}"
        assert nt <= cap, f"class {c}: {nt} tiles over its capacity {cap}"
        got = every[base:base + nt]
        if tails:
            assert (every[base + nt:base + cap].view(np.uint32) == POISON).all(), f"class {c}: tiles past tile_count"
        assert ((got[:, 2] >= lo) & (got[:, 2] <= h)).all(), f"class {c}: tile rows outside [{lo}, {h}]"
        assert (got[:, 3] == 0).all(), "pad not 0"
        assert (np.diff(got[:, 0].astype(np.int64)) >= (0 if c == 0 else 1)).all(), f"class {c}: not in expert order"
        np.testing.assert_array_equal(got, want[c], err_msg=f"tile map of class {c}")
        maps.append(got)
    # every slot in exactly one tile of one class: tiles abut in slot order and cover [0, n)
    allt = np.concatenate(maps) if maps else np.zeros((0, 4), np.uint32)
    allt = allt[np.argsort(allt[:, 1], kind="stable")]
    ends = np.cumsum(allt[:, 2].astype(np.int64))
    np.testing.assert_array_equal(allt[:, 1], np.concatenate([[0], ends[:-1]]), err_msg="tile begins")
    assert ends[-1] == n, "tiles do not cover every slot"
    np.testing.assert_array_equal(np.repeat(allt[:, 0], allt[:, 2]), pe, err_msg="a slot in another expert's tile")
    return maps


# ------------------------------------------------------------------------------ top-k

def run_topk(dev, logits, k, norm=True, R=64, T=32, tg=None):
    M, E = logits.shape[0], logits.shape[1] - 1
    L = upload(dev, logits)
    ids = out_buffer(dev, M * k)
    w = out_buffer(dev, M * (k + 1))
    bc = upload(dev, np.zeros(nblocks(M, R) * E, np.uint32))
    run1(dev, enc_topk, L, ids, w, bc, M, E, k, norm, R, T, tg)
    got_ids, got_w = download(ids, np.uint32), download(w, np.float32)
    assert_untouched(got_ids, M * k, "ids")
    assert_untouched(got_w, M * (k + 1), "w")
    return (got_ids[:M * k].reshape(M, k), got_w[:M * (k + 1)].reshape(M, k + 1),
            download(bc, np.uint32).reshape(-1, E))


def check_topk(logits, k, norm, ids, w, bc, R):
    E = logits.shape[1] - 1
    top, wr = route_ref(logits, k, norm)
    np.testing.assert_array_equal(ids, top, err_msg="top-k picks")
    np.testing.assert_allclose(w[:, :k], wr, rtol=16 * U * math.log2(max(E, 2)) + 8 * U, atol=0)
    sg = sigmoid(logits[:, E].astype(np.float64))
    assert np.abs(w[:, k] - sg).max() <= 8 * U, "shared gate"
    np.testing.assert_array_equal(bc, block_hist(ids, E, R), err_msg="block histogram")


TOPK_CASES = [
    # M, E, k, block_rows, tg
    pytest.param(64, 256, 8, 16, None, id="real-E256-k8"),
    pytest.param(19, 256, 8, 64, 64, id="real-tg64"),
    pytest.param(37, 16, 4, 8, None, id="tiny"),
    pytest.param(33, 32, 8, 5, None, id="demo"),
    pytest.param(1, 256, 8, 64, None, id="M1"),
    pytest.param(6, 1000, 32, 4, 1024, id="E1000-k32"),
    pytest.param(5, 1024, 8, 2, 256, id="E1024"),
    pytest.param(9, 8, 8, 3, None, id="k=E"),
    pytest.param(11, 100, 1, 7, 32, id="k1-ragged"),
]


@pytest.mark.parametrize("M,E,k,R,tg", TOPK_CASES)
def test_topk(dev, M, E, k, R, tg):
    rng = fresh_rng(M * 1009 + E * 31 + k)
    logits = grid_logits(rng, M, E)
    for norm in (True, False):
        ids, w, bc = run_topk(dev, logits, k, norm, R, tg=tg)
        check_topk(logits, k, norm, ids, w, bc, R)


def test_topk_ties(dev):
    """Tied probabilities: the lower expert index first, as argsort(-p, kind="stable")."""
    E, k = 64, 8
    rng = fresh_rng(3)
    rows = [np.zeros(E + 1)]                               # every expert tied: 0..7
    r = np.zeros(E + 1)
    r[[5, 9, 40, 41, 63]] = 3.0                            # five-way tie at the top
    r[[2, 3, 50]] = 1.0                                    # then three more
    r[[60, 7]] = 0.5                                       # tied runners-up, not picked
    rows.append(r)
    r = np.full(E + 1, -1.0)
    r[[63, 62, 61, 60]] = 2.0                              # tie among the last experts
    rows.append(r)
    for _ in range(13):                                    # three levels: heavy ties
        rows.append(rng.integers(0, 3, E + 1).astype(np.float64))
    logits = np.array(rows, np.float32)
    for norm in (True, False):
        ids, w, bc = run_topk(dev, logits, k, norm, R=4)
        check_topk(logits, k, norm, ids, w, bc, R=4)
        np.testing.assert_array_equal(ids[0], np.arange(k))
        np.testing.assert_array_equal(ids[1], [5, 9, 40, 41, 63, 2, 3, 50])
        np.testing.assert_array_equal(ids[2][:4], [60, 61, 62, 63])
        np.testing.assert_array_equal(ids[2][4:], [0, 1, 2, 3])


def test_topk_matches_decode(dev):
    """Picks identical to the decode kernel moe_route's on each row, weights the same
    (harness.assert_same_arithmetic)."""
    M, E, k, hidden = 7, 256, 8, 64
    rng = fresh_rng(5)
    logits = (rng.standard_normal((M, E + 1)) * 2).astype(np.float32)  # off-grid: any logits
    logits[3, 100:110] = logits[3, 50]                                  # and a tie
    gate_w = upload(dev, rng.integers(0, 2**32, hidden // 4, dtype=np.uint64).astype(np.uint32))
    gate_s = upload(dev, np.full(1, 0x3C00, np.uint16))                # bf16 0.0078125
    gate_b = upload(dev, np.zeros(1, np.uint16))
    X = upload(dev, rng.standard_normal(hidden).astype(np.float32))
    for norm in (True, False):
        ids, w, _ = run_topk(dev, logits, k, norm, R=3, tg=64)
        for row in range(M):
            L = upload(dev, logits[row, :E].copy())
            di, dw = dev.buffer(4 * k), dev.buffer(4 * (k + 1))
            cb = dev.command_buffer()
            cb.compute_pass().dispatch(
                "moe_route", 1, route_tg(E),
                buffers=[(0, L), (1, X), (2, gate_w), (3, gate_s), (4, gate_b), (5, di), (6, dw)],
                constants=[(7, pack_args("RouteArgs", experts=E, top_k=k, hidden=hidden, norm_topk=norm))],
                reads=[L, X, gate_w, gate_s, gate_b], writes=[di, dw], threadgroups=True)
            cb.commit()
            cb.wait()
            np.testing.assert_array_equal(ids[row], download(di, np.uint32))
            assert_same_arithmetic(dev, w[row, :k], download(dw, np.float32)[:k], f"row {row}: weights vs moe_route")


def test_topk_real_size(fwd_dev):
    """A whole 2K-token chunk at the model's routing shape (M = 2048, E = 256, k = 8)."""
    M, E, k, R = 2048, 256, 8, 64
    logits = grid_logits(fresh_rng(7), M, E)
    ids, w, bc = run_topk(fwd_dev, logits, k, True, R)
    check_topk(logits, k, True, ids, w, bc, R)


# ------------------------------------------------------------------------------ scatter

def ids_random(rng, M, E, k):
    """k distinct experts per row, uniformly."""
    return np.argsort(rng.random((M, E)), axis=1)[:, :k].astype(np.uint32)


def ids_skewed(rng, M, E, k, alpha=1.2):
    """k distinct experts per row drawn with Zipf-like popularity (Gumbel top-k)."""
    logp = -alpha * np.log1p(rng.permutation(E))
    g = logp + rng.gumbel(size=(M, E))
    return np.argsort(-g, axis=1)[:, :k].astype(np.uint32)


def ids_same(rng, M, E, k):
    """Every row routed to the same k experts (in a random order per row)."""
    e = rng.choice(E, k, replace=False)
    return np.array([rng.permutation(e) for _ in range(M)], np.uint32).reshape(M, k)


def ids_with_counts(rng, counts, k):
    """ids [M, k] whose expert e appears counts[e] times, k distinct experts per row
    (sum(counts) a multiple of k, no count above M): the assignments sorted by expert are dealt
    out column by column, so a row's k entries lie M apart in that order; rows shuffled."""
    counts = np.asarray(counts)
    n = int(counts.sum())
    M = n // k
    assert n == M * k and counts.max() <= M
    order = np.repeat(np.arange(len(counts)), counts)
    ids = order.reshape(k, M).T
    return ids[rng.permutation(M)].astype(np.uint32)


# Expert loads with a remainder at every class edge of T = 64 (classes 64, 32, 16), empty
# experts, full tiles with and without remainders; sum 1400 (k = 2, 4, 8 divide it).
EDGE_COUNTS = [0, 1, 16, 17, 0, 32, 33, 63, 64, 65, 80, 81, 96, 97, 128, 0, 129, 144, 145, 2, 15, 31, 48, 40]
EDGE_COUNTS[-1] += 1400 - sum(EDGE_COUNTS)


IDS = {"random": ids_random, "skewed": ids_skewed, "same": ids_same}


def run_scatter(dev, ids, E, R, T, tg=None):
    M, k = ids.shape
    I = upload(dev, ids)
    bc = upload(dev, block_hist(ids, E, R))
    perm = out_buffer(dev, M * k)
    tiles = out_buffer(dev, 4 * max_tiles(M, k, E, T))
    tcount = out_buffer(dev, tile_classes(T))
    counts = out_buffer(dev, E)
    run1(dev, enc_scatter, I, bc, perm, tiles, tcount, counts, M, E, k, R, T, tg)
    np.testing.assert_array_equal(download(bc, np.uint32), block_hist(ids, E, R).ravel())  # read only
    return (download(perm, np.uint32), download(tiles, np.uint32), download(tcount, np.uint32),
            download(counts, np.uint32))


SCATTER_CASES = [
    # M, E, k, block_rows, T, tg, ids
    pytest.param(256, 256, 8, 64, 32, None, "random", id="E256-random"),
    pytest.param(300, 256, 8, 64, 16, None, "skewed", id="E256-skewed-T16"),
    pytest.param(100, 256, 8, 16, 32, None, "same", id="E256-same-experts"),
    pytest.param(100, 256, 8, 16, 32, 64, "skewed", id="tg<E"),
    pytest.param(1, 256, 8, 64, 32, None, "random", id="M1"),
    pytest.param(1, 256, 8, 64, 16, 32, "same", id="M1-tg32"),
    pytest.param(37, 16, 4, 8, 16, None, "skewed", id="tiny"),
    pytest.param(33, 32, 8, 5, 32, None, "random", id="demo-ragged"),
    pytest.param(45, 32, 8, 45, 16, 1024, "skewed", id="one-block-tg1024"),
    pytest.param(50, 8, 8, 1, 32, None, "random", id="k=E-block1"),
    pytest.param(70, 1024, 32, 32, 32, 256, "skewed", id="E1024-k32-full-block"),
    pytest.param(29, 100, 3, 7, 16, 32, "skewed", id="ragged"),
    pytest.param(256, 256, 8, 64, 64, None, "random", id="E256-random-T64"),
    pytest.param(300, 64, 8, 64, 64, 64, "skewed", id="E64-skewed-T64-tg<E"),
    pytest.param(45, 32, 8, 45, 64, 1024, "same", id="same-T64"),
]


@pytest.mark.parametrize("M,E,k,R,T,tg,kind", SCATTER_CASES)
def test_scatter(dev, M, E, k, R, T, tg, kind):
    assert R * k <= MAX_BLOCK_SLOTS
    rng = fresh_rng(M * 13 + E * 7 + k + R + T)
    ids = IDS[kind](rng, M, E, k)
    perm, tiles, tcount, counts = run_scatter(dev, ids, E, R, T, tg)
    check_grouping(ids, perm, tiles, tcount, counts, E, T)
    if kind == "same":  # all but k experts empty
        assert (counts[:E] > 0).sum() == k


@pytest.mark.parametrize("T", [16, 32, 64])
@pytest.mark.parametrize("k", [2, 8])
def test_scatter_class_edges(dev, T, k):
    """Remainders at every class edge (r = 1, 16, 17, 32, 33, 63, 64 of T = 64, and their
    halvings' edges for T = 32 and 16), empty experts, loads of several full tiles."""
    E = len(EDGE_COUNTS)
    ids = ids_with_counts(fresh_rng(T, k, 40), EDGE_COUNTS, k)
    perm, tiles, tcount, counts = run_scatter(dev, ids, E, 64 // k, T)
    maps = check_grouping(ids, perm, tiles, tcount, counts, E, T)
    assert all(len(m) for m in maps), "a class without tiles"
    # the padding the classes leave: less than half of each tail's class height
    pad = sum(int(((T >> c) - m[:, 2].astype(np.int64)).sum()) for c, m in enumerate(maps))
    tails = sum(1 for x in EDGE_COUNTS if x % T)
    assert pad < tails * T / 2 or T == 16


def test_scatter_one_expert(dev):
    """k = 1, every row routed to one expert: full tiles and one tail of the chunk."""
    M, E, k, T = 200, 64, 1, 64
    ids = np.full((M, k), 37, np.uint32)
    perm, tiles, tcount, counts = run_scatter(dev, ids, E, 64, T)
    maps = check_grouping(ids, perm, tiles, tcount, counts, E, T)
    assert [len(m) for m in maps] == [3, 0, 1]  # 200 = 3 x 64 + 8


@pytest.mark.parametrize("T,kind", [(16, "skewed"), (32, "skewed"), (64, "skewed"), (16, "same"), (64, "same"),
                                    (64, "random")])
def test_scatter_real_size(dev, T, kind):
    """A 2K-token chunk: M*k = 16K assignments over 256 experts, 32 blocks of 64 rows."""
    M, E, k, R = 2048, 256, 8, 64
    ids = IDS[kind](fresh_rng(T + len(kind)), M, E, k)
    perm, tiles, tcount, counts = run_scatter(dev, ids, E, R, T)
    check_grouping(ids, perm, tiles, tcount, counts, E, T)


# ------------------------------------------------------------------------------ combine

@pytest.mark.parametrize("M,H,k,tg", [(37, 128, 4, 32), (5, 2048, 8, 64), (1, 256, 8, 64),
                                      (64, 256, 8, 64), (3, 192, 1, 32), (9, 2048, 32, 32)])
def test_combine(dev, M, H, k, tg):
    rng = fresh_rng(M * 3 + H + k)
    h = rng.standard_normal((M, H)).astype(np.float32)
    yx = bact(beyond_half(rng, (M * k, H)))  # bfloat, as the down projections store it
    w = rng.random((M, k + 1)).astype(np.float32)
    Hb = dev.buffer(4 * (M * H + PAD))
    Hb.write(h.reshape(-1).view(np.uint8))
    Y, Wt = upload_bf16(dev, yx), upload(dev, w)
    run1(dev, enc_combine, Hb, Y, Wt, M, H, k, tg)
    got = download(Hb, np.float32)
    assert_untouched(got, M * H, "h")
    want, tol = combine_ref(h.astype(np.float64), yx, w)
    err = np.abs(got[:M * H].reshape(M, H) - want)
    assert (err <= tol).all(), f"moe_combine: worst err/tol {(err / tol).max():.3g}"


def combine_norm_inputs(rng, M, H, k, big_weight=False):
    h, yx, w = combine_inputs(rng, M, H, k)
    nw = 1 + 0.3 * rng.standard_normal(H)
    if big_weight:  # column 1 far beyond the half range after the norm: xn keeps it
        # (ordinary expert outputs, none in column 1, so the combine cannot cancel h's 8
        # towards 0 and the row's RMS stays ~1)
        yx = bact(rng.standard_normal(yx.shape))
        h[:, 1], yx[:, 1], nw[1] = 8.0, 0, 3e7
    return h, yx, w, to_bf16_bits(nw)


def run_combine_norm(dev, h, yx, w, nw, tg):
    M, H, k = h.shape[0], h.shape[1], w.shape[1] - 1
    Hb, XN = dev.buffer(4 * (M * H + PAD)), out_buffer(dev, M * H, 2)
    Hb.write(h.reshape(-1).view(np.uint8))
    run1(dev, enc_combine_norm, Hb, upload_bf16(dev, yx), upload(dev, w), upload(dev, nw), XN,
         M, H, k, tg=tg)
    hout, xn_bits = download(Hb, np.float32), download(XN, np.uint16)
    assert_untouched(hout, M * H, "h")
    assert (xn_bits[M * H:] == 0xFFFF).all(), "xn: wrote past its rows"
    xn = download(XN, "bf16")
    return hout[:M * H].reshape(M, H), xn[:M * H].reshape(M, H)


@pytest.mark.parametrize("M,H,k,tg", [(37, 128, 4, 32), (5, 2048, 8, 256), (1, 256, 8, 1024), (3, 192, 1, 64),
                                      (9, 2048, 32, 128)])
def test_combine_norm(dev, M, H, k, tg):
    """moe_combine_norm: h within moe_combine's bound; xn the RMSNorm of the h it wrote,
    within rms_norm_bf16's bound (norm_bf16_ref), a column beyond +-65504 kept (bfloat)."""
    rng = fresh_rng(M * 5 + H + k + tg)
    h, yx, w, nw = combine_norm_inputs(rng, M, H, k, big_weight=True)
    hout, xn = run_combine_norm(dev, h, yx, w, nw, tg)
    want, tol = combine_ref(h.astype(np.float64), yx, w)
    check(hout, want, tol, "moe_combine_norm h")
    want, tol = norm_bf16_ref(hout, nw)
    assert (np.abs(want[:, 1]) > 65504).all()  # the test drives column 1 past the half range
    check(xn.astype(np.float64), want, tol, "moe_combine_norm xn")


@pytest.mark.parametrize("M,H,k", [(6, 2048, 8), (3, 320, 4)])
def test_combine_norm_bit_identical(dev, M, H, k):
    """With the runtime's thread counts (both kNormThreads, csrc/runtime/families/norm.h),
    moe_combine_norm gives the bits of moe_combine followed by rms_norm_bf16 on the simulator
    (a few ulps on a GPU: harness.assert_same_arithmetic): the fused prefill path changes no
    value. Both as the prefill chunk encodes them (lily._core.encode_moe_combine,
    encode_rms_norm)."""
    rng = fresh_rng(M, H, k, 99)
    h, yx, w, nw = combine_norm_inputs(rng, M, H, k)
    hout, xn = run_combine_norm(dev, h, yx, w, nw, 0)
    Hb, XN = upload(dev, h), dev.buffer(2 * M * H)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    enc_combine(p, Hb, upload_bf16(dev, yx), upload(dev, w), M, H, k)
    _core.encode_rms_norm(p, "rms_norm_bf16", Hb, upload(dev, nw), XN, M, H, 1e-6, 2)
    cb.commit()
    cb.wait()
    assert_same_arithmetic(dev, hout, download(Hb, np.float32, (M, H)), "h: moe_combine_norm vs moe_combine")
    assert_same_arithmetic(dev, to_bf16_bits(xn), download(XN, np.uint16, (M, H)),
                           "xn: moe_combine_norm vs rms_norm_bf16", stored="bf16")


# ------------------------------------------------------------------------------ the chain

class Chunk:
    """Routing buffers of one chunk size (reused by every chunk) and the chain encoder."""

    def __init__(self, dev, max_rows, E, k, H, R, T):
        self.dev, self.E, self.k, self.H, self.R, self.T = dev, E, k, H, R, T
        self.bc = dev.buffer(4 * nblocks(max_rows, R) * E)
        self.ids = dev.buffer(4 * max_rows * k)
        self.w = dev.buffer(4 * max_rows * (k + 1))
        self.perm = dev.buffer(4 * max_rows * k)
        self.tiles = dev.buffer(16 * max_tiles(max_rows, k, E, T))
        self.tcount = dev.buffer(4 * tile_classes(T))
        self.counts = dev.buffer(4 * E)

    def encode(self, cb, M, L, h, yx):
        """moe_route_clear, moe_route_topk, moe_route_scatter, moe_combine in one
        concurrent pass; the barriers come from the declared ranges."""
        E, k, R, T = self.E, self.k, self.R, self.T
        p = cb.compute_pass()
        enc_clear(p, self.bc, M, E, k, R, T)
        enc_topk(p, L, self.ids, self.w, self.bc, M, E, k, True, R, T)
        enc_scatter(p, self.ids, self.bc, self.perm, self.tiles, self.tcount, self.counts, M, E, k, R, T)
        enc_combine(p, h, yx, self.w, M, self.H, k)

    def results(self, M):
        k = self.k
        return (download(self.ids, np.uint32)[:M * k].reshape(M, k),
                download(self.w, np.float32)[:M * (k + 1)].reshape(M, k + 1),
                download(self.perm, np.uint32), download(self.tiles, np.uint32),
                download(self.tcount, np.uint32), download(self.counts, np.uint32))


def chunk_inputs(dev, rng, M, E, k, H, hot=None):
    logits = grid_logits(rng, M, E)
    if hot is not None:  # skew: every row prefers the `hot` experts
        logits[:, hot] += 16.0
    h = rng.standard_normal((M, H)).astype(np.float32)
    yx = bact(rng.standard_normal((M * k, H)))  # bfloat
    return logits, h, yx, [upload(dev, logits), upload(dev, h), upload_bf16(dev, yx)]


def check_chunk(ch, M, logits, h, yx, hbuf, fresh):
    """All outputs of one chunk; fresh: the buffers were poisoned before this chunk (else
    the elements past this chunk's outputs hold an earlier chunk's values)."""
    E, k, T = ch.E, ch.k, ch.T
    ids, w, perm, tiles, tcount, counts = ch.results(M)
    top, wr = route_ref(logits, k)
    np.testing.assert_array_equal(ids, top)
    np.testing.assert_allclose(w[:, :k], wr, rtol=16 * U * math.log2(E) + 8 * U, atol=0)
    assert np.abs(w[:, k] - sigmoid(logits[:, E].astype(np.float64))).max() <= 8 * U
    if fresh:  # no tails in these buffers: check that the tiles past each tile_count are poisoned
        n = M * k
        for c in range(tile_classes(T)):
            base, cap = class_base(n, E, T, c), class_capacity(n, E, T, c)
            assert (tiles.reshape(-1, 4)[base + int(tcount[c]):base + cap] == POISON).all()
    check_grouping(ids, perm, tiles, tcount, counts, E, T, tails=False)
    nb = nblocks(M, ch.R)
    np.testing.assert_array_equal(download(ch.bc, np.uint32)[:nb * E].reshape(nb, E),
                                  block_hist(ids, E, ch.R), err_msg="block histogram")
    hout = download(hbuf, np.float32).reshape(M, -1)
    want, tol = combine_ref(h.astype(np.float64), yx, w)
    assert (np.abs(hout - want) <= tol).all(), "moe_combine in the chain"
    return counts, hout


def test_chain_two_chunks(chain_dev):
    """Two chunks encoded ahead on the same routing buffers, committed back to back: the
    second (fewer rows, other experts) sees no stale counter of the first; each command
    buffer is one concurrent pass in three derived stages (clear | top-k | scatter+combine)."""
    dev = chain_dev
    E, k, H, R, T = 256, 8, 64, 16, 16
    M1, M2 = 75, 37  # M*k not a multiple of T; last blocks partial
    ch = Chunk(dev, max(M1, M2), E, k, H, R, T)
    rng = fresh_rng(11)
    first = chunk_inputs(dev, rng, M1, E, k, H)
    second = chunk_inputs(dev, rng, M2, E, k, H, hot=[200, 3, 77, 150])

    # chunk 1 alone: every output checked
    cb = dev.command_buffer()
    ch.encode(cb, M1, *first[3])
    cb.commit()
    cb.wait()
    _, h_first = check_chunk(ch, M1, *first[:3], first[3][1], fresh=True)
    log = cb.dispatch_log
    assert cb.counters["barrier_stages"] == 3
    assert [d["stage"] for d in log] == [0, 1, 2, 2], log

    # chunk 1 again and chunk 2, both encoded before either is committed (no host work
    # between them); fresh residual buffers so that both combines can be checked
    h1 = upload(dev, first[1])
    h2 = upload(dev, second[1])
    cb1, cb2 = dev.command_buffer(), dev.command_buffer()
    ch.encode(cb1, M1, first[3][0], h1, first[3][2])
    ch.encode(cb2, M2, second[3][0], h2, second[3][2])
    cb1.commit()
    cb2.commit()
    cb1.wait()
    cb2.wait()
    counts, _ = check_chunk(ch, M2, *second[:3], h2, fresh=False)
    assert counts.sum() == M2 * k and (counts[[200, 3, 77, 150]] == M2).all()
    # chunk 1's routing was overwritten by chunk 2; its residual update must equal the
    # first run's bit for bit (same inputs, deterministic kernels)
    np.testing.assert_array_equal(download(h1, np.float32).reshape(M1, H).view(np.uint32),
                                  h_first.view(np.uint32))


# ------------------------------------------------------------------------------ grouped expert GEMMs


MOE_CASES = [  # M, E, k, hidden, inter, skew
    pytest.param(37, 16, 4, 128, 64, False, id="tiny"),
    pytest.param(50, 32, 8, 256, 128, True, id="dims-skewed"),
    pytest.param(70, 16, 4, 128, 192, True, id="ragged-skewed"),
]


@pytest.mark.parametrize("T", MOE_TILES)
@pytest.mark.parametrize("M,E,k,H,I,skew", MOE_CASES)
def test_moe_gate_up(dev, T, M, E, k, H, I, skew):
    rng = fresh_rng(M, E, k, H, I, T, skew)
    ids, perm, tiles = make_routing(rng, M, E, k, T, skew)
    gq, uq = rand_quant(rng, (E,), I, H, 4), rand_quant(rng, (E,), I, H, 4)
    x = bact(beyond_half(rng, (M, H)))
    count = len(tiles) - 2  # the last two tiles are not in the map: their slots stay unwritten
    X, P = upload_bf16(dev, x), upload(dev, perm)
    TL, TC, max_tiles = tile_buffers(dev, tiles, count, M, E, k, T)
    HX = dev.buffer(2 * M * k * I)  # bfloat
    cb = dev.command_buffer()
    enc_gate_up(cb.compute_pass(), T, X, P, TL, TC, max_tiles, upload_q(dev, gq), upload_q(dev, uq), HX, M, k, E, H, I)
    commit(cb, _core.kernel_name("moe_gemm_gate_up", q=4, t=T))
    hx = download(HX, "bf16").reshape(M * k, I)
    covered = np.zeros(M * k, bool)
    for e, begin, rows, _ in tiles[:count]:
        covered[begin:begin + rows] = True
        a = perm[begin:begin + rows]
        want, tol = bf16_stored(*swiglu_ref(x[a // k], gq, uq, int(e)))
        assert (ids.reshape(-1)[a] == e).all()
        check(hx[begin:begin + rows], want, tol, f"gate/up T={T} expert {e}")
    assert np.isnan(hx[~covered]).all(), "wrote slots of tiles past tile_count"


@pytest.mark.parametrize("T", MOE_TILES)
@pytest.mark.parametrize("M,E,k,H,I,skew", MOE_CASES)
def test_moe_down(dev, T, M, E, k, H, I, skew):
    rng = fresh_rng(M, E, k, H, I, T, skew, 2)
    ids, perm, tiles = make_routing(rng, M, E, k, T, skew)
    dq = rand_quant(rng, (E,), H, I, 4)
    hx = bact(beyond_half(rng, (M * k, I)))
    count = len(tiles) - 1
    HX, P = upload_bf16(dev, hx), upload(dev, perm)
    TL, TC, max_tiles = tile_buffers(dev, tiles, count, M, E, k, T)
    YX = dev.buffer(2 * M * k * H)  # bfloat
    cb = dev.command_buffer()
    enc_down(cb.compute_pass(), T, HX, P, TL, TC, max_tiles, upload_q(dev, dq), YX, M, k, E, H, I)
    commit(cb, _core.kernel_name("moe_gemm_down", q=4, t=T))
    yx = download(YX, "bf16").reshape(M * k, H)
    written = np.zeros(M * k, bool)
    for e, begin, rows, _ in tiles[:count]:
        a = perm[begin:begin + rows]
        written[a] = True
        want, tol = bf16_stored(*gemm_ref(hx[begin:begin + rows], dq, int(e)))
        check(yx[a], want, tol, f"down T={T} expert {e}")
    assert np.isnan(yx[~written]).all(), "wrote rows of tiles past tile_count"


def run_chain(dev, T, M, E, k, H, I, skew, rng, lda_pad=0):
    """gate/up then down in one concurrent pass (a barrier derived from the declared ranges),
    every tile in the map; returns what the checks need."""
    ids, perm, tiles = make_routing(rng, M, E, k, T, skew)
    gq, uq, dq = (rand_quant(rng, (E,), I, H, 4), rand_quant(rng, (E,), I, H, 4),
                  rand_quant(rng, (E,), H, I, 4))
    lda = H + lda_pad
    x = bact(beyond_half(rng, (M, lda)))
    X, P = upload_bf16(dev, x), upload(dev, perm)
    TL, TC, max_tiles = tile_buffers(dev, tiles, len(tiles), M, E, k, T)
    HX, YX = dev.buffer(2 * M * k * I), dev.buffer(2 * M * k * H)  # both bfloat
    cb = dev.command_buffer()
    p = cb.compute_pass()
    enc_gate_up(p, T, X, P, TL, TC, max_tiles, upload_q(dev, gq), upload_q(dev, uq), HX, M, k, E, H, I, lda=lda)
    enc_down(p, T, HX, P, TL, TC, max_tiles, upload_q(dev, dq), YX, M, k, E, H, I)
    commit(cb, f"moe chain T={T} {H}x{I}")
    assert cb.counters["barrier_stages"] == 2
    hx = download(HX, "bf16").reshape(M * k, I)
    yx = download(YX, "bf16").reshape(M * k, H)
    check_experts(ids, perm, x[:, :H], hx, yx, gq, uq, dq, f"chain T={T}")
    return tiles


def check_experts(ids, perm, x, hx, yx, gq, uq, dq, what):
    """gate/up of every expert's slots against numpy, then down on the kernel's own hx."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    for e in np.unique(flat):
        slots = np.nonzero(flat[perm] == e)[0]
        a = perm[slots]
        want, tol = bf16_stored(*swiglu_ref(x[a // k], gq, uq, int(e)))
        check(hx[slots], want, tol, f"{what} gate/up expert {e}")
        want, tol = bf16_stored(*gemm_ref(hx[slots], dq, int(e)))
        check(yx[a], want, tol, f"{what} down expert {e}")


@pytest.mark.parametrize("T", MOE_TILES)
def test_moe_chain(dev, T):
    run_chain(dev, T, 41, 16, 4, 128, 64, True, fresh_rng(T, 31), lda_pad=8)


@pytest.mark.parametrize("T", MOE_TILES)
def test_moe_chain_real_shape(dev, T):
    """Real expert dimensions (hidden 2048, inter 512) on a 4-expert stack, a few tiles: the
    routing chooses every expert (make_routing), so the map has ceil(count / T) tiles of each."""
    tiles = run_chain(dev, T, 12, 4, 2, 2048, 512, False, fresh_rng(T, 2048))
    counts = np.bincount(tiles[:, 0], weights=tiles[:, 2], minlength=4).astype(int)
    assert counts.sum() == 12 * 2 and np.all(counts > 0), counts
    assert len(tiles) == sum(-(-int(c) // T) for c in counts) >= 4


# ------------------------------------------------------------------------------ tile classes end to end

CLASS_COUNTS = [0, 5, 16, 17, 32, 33, 64, 65, 100, 20]  # tails in every class of T = 64, empty experts


def run_class_chain(dev, T, counts, k, H, I, rng):
    """moe_route_scatter's tile maps for expert loads `counts`, then gate/up and down as one
    dispatch per tile class (each over its own map and count, its grid the class capacity), in
    one concurrent pass: the classes of a projection write disjoint slots under one tag, so they
    share a barrier stage and the pass has three (scatter | gate/up | down). Every expert's
    outputs against numpy; returns the maps by class."""
    E = len(counts)
    ids = ids_with_counts(rng, counts, k)
    M, n, R, classes = ids.shape[0], int(sum(counts)), max(1, 64 // k), tile_classes(T)
    gq, uq, dq = (rand_quant(rng, (E,), I, H, 4), rand_quant(rng, (E,), I, H, 4), rand_quant(rng, (E,), H, I, 4))
    x = bact(beyond_half(rng, (M, H)))
    Ib, bc, X = upload(dev, ids), upload(dev, block_hist(ids, E, R)), upload_bf16(dev, x)
    perm, tiles, tcount, cnt = (dev.buffer(4 * n), dev.buffer(16 * max_tiles(M, k, E, T)),
                                dev.buffer(4 * classes), dev.buffer(4 * E))
    HX, YX = dev.buffer(2 * n * I), dev.buffer(2 * n * H)  # both bfloat
    G, Up, D = upload_q(dev, gq), upload_q(dev, uq), upload_q(dev, dq)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    enc_scatter(p, Ib, bc, perm, tiles, tcount, cnt, M, E, k, R, T)
    for c in range(classes):
        enc_gate_up(p, T >> c, X, perm, tiles, tcount, class_capacity(n, E, T, c), G, Up, HX, M, k, E, H, I,
                    cls=(c, class_base(n, E, T, c)), tile_rows=T, tag=1)
    for c in range(classes):
        enc_down(p, T >> c, HX, perm, tiles, tcount, class_capacity(n, E, T, c), D, YX, M, k, E, H, I,
                 cls=(c, class_base(n, E, T, c)), tile_rows=T, tag=1)
    commit(cb, f"moe class chain T={T}")
    assert cb.counters["barrier_stages"] == 3
    assert [d["stage"] for d in cb.dispatch_log] == [0] + [1] * classes + [2] * classes
    pm = download(perm, np.uint32)
    maps = check_grouping(ids, pm, download(tiles, np.uint32), download(tcount, np.uint32),
                          download(cnt, np.uint32), E, T, tails=False)
    hx = download(HX, "bf16").reshape(n, I)
    yx = download(YX, "bf16").reshape(n, H)
    check_experts(ids, pm[:n], x, hx, yx, gq, uq, dq, f"class chain T={T}")
    return maps


@pytest.mark.parametrize("T", MOE_TILES)
def test_moe_class_chain(dev, T):
    maps = run_class_chain(dev, T, CLASS_COUNTS, 2, 128, 64, fresh_rng(T, 64))
    assert all(len(m) for m in maps), "a class without tiles"


def test_moe_class_chain_stage_orders(chain_dev):
    """The same with the dispatches of each stage run in reverse / random order: a slot
    written by two classes would differ between orders."""
    run_class_chain(chain_dev, 64, CLASS_COUNTS[::-1], 2, 128, 64, fresh_rng(65))
