"""The Metal simulator runs metal/selftest.metal; each kernel is compared with numpy.

Covers every MSL construct the simulator supports (see docs/device-layer.md), with
geometries that do not divide evenly into threadgroups or simdgroups.
"""

from __future__ import annotations

import functools

import harness
import numpy as np
import pytest
from seeding import fresh_rng

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import constant, download, sim_device, upload  # noqa: E402


@pytest.fixture(scope="module", params=["forward", "reverse", "random"])
def dev(request):
    """Every kernel must give the same result whatever order its threadgroups and threads
    are scheduled in (a data race or missing barrier would show up as a failure)."""
    return sim_device(thread_order=request.param, seed=11)


# dispatchThreads unless a test says threadgroups=True
run = functools.partial(harness.run, threadgroups=False)


def bf16_round(x):
    """numpy reference: float32 -> bfloat16 (round to nearest even) -> float32."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32) << 16
    return r.view(np.float32)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 65, 1000])
@pytest.mark.parametrize("dtype,kernel", [(np.float32, "st_add_f32"), (np.float16, "st_add_f16")])
def test_add(dev, n, dtype, kernel):
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    A, B, O = upload(dev, a), upload(dev, b), dev.buffer(a.nbytes)
    run(dev, kernel, n, 32, buffers=[(0, A), (1, B), (2, O)], constants=[(3, constant(n))],
        reads=[A, B], writes=[O])
    want = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)
    np.testing.assert_array_equal(download(O, dtype), want)


def test_add_bf16(dev):
    n = 100
    rng = np.random.default_rng(0)
    a, b = bf16_round(rng.standard_normal(n)), bf16_round(rng.standard_normal(n))
    to_bits = lambda x: (x.view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    A, B, O = upload(dev, to_bits(a)), upload(dev, to_bits(b)), dev.buffer(2 * n)
    run(dev, "st_add_bf16", n, 64, buffers=[(0, A), (1, B), (2, O)], constants=[(3, constant(n))])
    got = (download(O, np.uint16).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got, bf16_round(a + b))


def test_convert_round_to_nearest_even(dev):
    rng = np.random.default_rng(1)
    x = np.concatenate([
        rng.standard_normal(500).astype(np.float32) * 10,
        np.array([0.0, -0.0, 1e-8, 65504.0, 65520.0, 1e6, np.inf, -np.inf], np.float32),
        # exact ties for half (1 + 2^-11) and bfloat (1 + 2^-8, 1 + 3 * 2^-8)
        np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8], np.float32),
    ])
    n = x.size
    X, H, BF = upload(dev, x), dev.buffer(2 * n), dev.buffer(2 * n)
    run(dev, "st_convert", n, 64, buffers=[(0, X), (1, H), (2, BF)], constants=[(3, constant(n))])
    with np.errstate(over="ignore"):
        want_h = x.astype(np.float16)
    np.testing.assert_array_equal(download(H, np.float16), want_h)
    got_bf = (download(BF, np.uint16).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got_bf, bf16_round(x))


@pytest.mark.parametrize("grid,tg", [((33, 5), (8, 4)), ((65, 3), (32, 2)), ((31, 1), (32, 1)),
                                     ((100, 7), (16, 16))])
def test_coords_dispatch_threads(dev, grid, tg):
    """dispatchThreads: edge threadgroups are partial; every coordinate attribute."""
    W, H = grid
    fields = 13
    out = dev.buffer(W * H * fields * 4)
    run(dev, "st_coords", grid, tg, buffers=[(0, out)], constants=[(1, constant(W, fields))])
    got = download(out, np.uint32, (H, W, fields))
    y, x = np.mgrid[0:H, 0:W]
    tx, ty = tg
    gx, gy = -(-W // tx), -(-H // ty)
    np.testing.assert_array_equal(got[..., 0], x)
    np.testing.assert_array_equal(got[..., 1], y)
    np.testing.assert_array_equal(got[..., 2], x % tx)
    np.testing.assert_array_equal(got[..., 3], y % ty)
    np.testing.assert_array_equal(got[..., 4], x // tx)
    np.testing.assert_array_equal(got[..., 5], y // ty)
    # threads_per_threadgroup: the actual (possibly partial) size of this threadgroup
    aw = np.minimum(tx, W - (x // tx) * tx)
    ah = np.minimum(ty, H - (y // ty) * ty)
    np.testing.assert_array_equal(got[..., 6], aw)
    np.testing.assert_array_equal(got[..., 7], ah)
    np.testing.assert_array_equal(got[..., 8], gx)
    np.testing.assert_array_equal(got[..., 9], gy)
    lin = (y % ty) * aw + (x % tx)
    np.testing.assert_array_equal(got[..., 10], lin)
    np.testing.assert_array_equal(got[..., 11], lin // 32)
    np.testing.assert_array_equal(got[..., 12], lin % 32)


def test_coords_dispatch_threadgroups(dev):
    W, H, fields = 3 * 8, 2 * 4, 13
    out = dev.buffer(W * H * fields * 4)
    run(dev, "st_coords", (3, 2), (8, 4), buffers=[(0, out)], constants=[(1, constant(W, fields))],
        threadgroups=True)
    got = download(out, np.uint32, (H, W, fields))
    assert (got[..., 6] == 8).all() and (got[..., 7] == 4).all()
    assert (got[..., 8] == 3).all() and (got[..., 9] == 2).all()


@pytest.mark.parametrize("tg", [1, 31, 32, 33, 64, 96, 256])
@pytest.mark.parametrize("cols", [1, 65, 300])
def test_row_sum_threadgroup_memory(dev, tg, cols):
    rows = 5
    x = np.random.default_rng(tg + cols).standard_normal((rows, cols)).astype(np.float32)
    X, O = upload(dev, x), dev.buffer(rows * 4)
    run(dev, "st_row_sum", rows, tg, buffers=[(0, X), (1, O)], constants=[(2, constant(cols))],
        threadgroups=True)
    np.testing.assert_allclose(download(O, np.float32), x.sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tg", [32, 33, 65, 100, 1024])
def test_row_max_simd(dev, tg):
    rows, cols = 3, 777
    x = np.random.default_rng(tg).standard_normal((rows, cols)).astype(np.float32)
    X, O = upload(dev, x), dev.buffer(rows * 4)
    run(dev, "st_row_max_simd", rows, tg, buffers=[(0, X), (1, O)], constants=[(2, constant(cols))],
        threadgroups=True)
    np.testing.assert_array_equal(download(O, np.float32), x.max(1))


def simd_reference(x, u, tg):
    """numpy model of st_simd_ops: simdgroups are 32 consecutive threads of a threadgroup;
    a partial last simdgroup has fewer lanes. Returns expected planes and a mask of the
    entries that are defined (shuffles from missing lanes are undefined)."""
    n = x.size
    planes = np.full((15, n), np.nan, np.float32)
    defined = np.ones((15, n), bool)
    for g0 in range(0, n, tg):
        g1 = min(g0 + tg, n)
        for s0 in range(g0, g1, 32):
            s1 = min(s0 + 32, g1)
            v, w = x[s0:s1], u[s0:s1]
            L = s1 - s0
            lanes = np.arange(L)
            planes[0, s0:s1] = v.sum(dtype=np.float32)
            planes[1, s0:s1] = v.max()
            planes[2, s0:s1] = v.min()
            planes[3, s0:s1] = np.cumsum(v, dtype=np.float32)
            planes[4, s0:s1] = np.concatenate([[0], np.cumsum(v, dtype=np.float32)[:-1]])
            src = w % 32
            ok = src < L
            planes[5, s0:s1][ok] = v[src[ok]]
            defined[5, s0:s1] = ok
            src = lanes ^ 1
            ok = src < L
            planes[6, s0:s1][ok] = v[src[ok]]
            defined[6, s0:s1] = ok
            src = np.where(lanes < 3, lanes, lanes - 3)
            planes[7, s0:s1] = v[src]
            src = np.where(lanes + 5 >= 32, lanes, lanes + 5)
            ok = src < L
            planes[8, s0:s1][ok] = v[src[ok]]
            defined[8, s0:s1] = ok
            planes[9, s0:s1] = v[0]
            planes[10, s0:s1] = (v > 0.5).sum()
            planes[11, s0:s1] = float((v > 0.5).any())
            planes[12, s0:s1] = float((v > -10).all())
            planes[13, s0:s1] = float(w.astype(np.uint64).sum() % 2**32)
            planes[14, s0:s1] = lanes
    return planes, defined


@pytest.mark.parametrize("n,tg", [(32, 32), (64, 64), (33, 33), (65, 65), (100, 40), (31, 31), (130, 96)])
def test_simd_collectives(dev, n, tg):
    rng = np.random.default_rng(n * 1000 + tg)
    x = rng.standard_normal(n).astype(np.float32)
    u = rng.integers(0, 1000, n).astype(np.uint32)
    X, U, O = upload(dev, x), upload(dev, u), dev.buffer(15 * n * 4)
    run(dev, "st_simd_ops", n, tg, buffers=[(0, X), (1, U), (2, O)], constants=[(3, constant(n))])
    got = download(O, np.float32, (15, n))
    want, defined = simd_reference(x, u, tg)
    for k in range(15):
        d = defined[k]
        np.testing.assert_allclose(got[k][d], want[k][d], rtol=1e-5, atol=1e-5, err_msg=f"plane {k}")
        # reading a lane that does not exist is undefined: the simulator returns poison
        assert np.isnan(got[k][~d]).all(), f"plane {k}: undefined lanes are not poisoned"


@pytest.mark.parametrize("n,tg", [(64, 32), (99, 33), (40, 40)])
def test_dynamic_threadgroup_memory(dev, n, tg):
    x = np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)
    X, O = upload(dev, x), dev.buffer(x.nbytes)
    run(dev, "st_tg_reverse", n, tg, buffers=[(0, X), (1, O)], tgmem=[(0, tg * 16)])
    got = download(O, np.float32, (n, 4))
    want = np.empty_like(x)
    for g0 in range(0, n, tg):
        g1 = min(g0 + tg, n)
        want[g0:g1] = x[g0:g1][::-1]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n,tg", [(1000, 64), (33, 32), (1, 1)])
def test_atomics(dev, n, tg):
    rng = np.random.default_rng(n)
    keys = rng.integers(0, 10, n).astype(np.uint32)
    vals = rng.integers(-8, 8, n).astype(np.float32) / 4  # exact in any summation order
    K, V = upload(dev, keys), upload(dev, vals)
    hist = upload(dev, np.zeros(10, np.uint32))
    total = upload(dev, np.zeros(1, np.float32))
    seen = upload(dev, np.zeros(1, np.uint32))
    run(dev, "st_atomics", n, tg, buffers=[(0, K), (1, V), (2, hist), (3, total), (4, seen)],
        constants=[(5, constant(n))])
    np.testing.assert_array_equal(download(hist, np.uint32), np.bincount(keys, minlength=10))
    assert download(total, np.float32)[0] == vals.sum()
    assert download(seen, np.uint32)[0] == -(-n // tg)


@pytest.mark.parametrize("n", [1, 33, 100])
def test_vector_math(dev, n):
    rng = np.random.default_rng(n)
    a = rng.standard_normal((n, 4)).astype(np.float32)
    b = rng.standard_normal((n, 4)).astype(np.float32)
    A, B = upload(dev, a), upload(dev, b)
    O, BITS, H = dev.buffer(a.nbytes), dev.buffer(4 * n), dev.buffer(8 * n)
    run(dev, "st_vec_math", n, 32, buffers=[(0, A), (1, B), (2, O), (3, BITS), (4, H)],
        constants=[(5, constant(n))])
    r = a[:, ::-1] * 2 + b
    r[:, [0, 1]] = r[:, [1, 0]]
    r[:, 2] = (a * b).sum(1) + (a[:, 0] * b[:, 1] + 1)
    r[:, 3] = np.clip(np.exp(-np.abs(a[:, 3])) + 1 / np.sqrt(b[:, 3] ** 2 + 1), 0, 1.5)
    c = np.concatenate([a[:, :2], np.ones((n, 1), np.float32), np.zeros((n, 1), np.float32)], 1)
    r += c * np.where(a > b, -1.0, 1.0).astype(np.float32)
    np.testing.assert_allclose(download(O, np.float32, (n, 4)), r, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(download(BITS, np.uint32), a[:, 0].view(np.uint32))
    want_h = (a.astype(np.float16) + np.float16(1)).astype(np.float16)
    np.testing.assert_allclose(download(H, np.float16, (n, 4)).astype(np.float32),
                               want_h.astype(np.float32), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype,kernel", [(np.float32, "st_matmul_f32"), (np.float16, "st_matmul_f16")])
@pytest.mark.parametrize("m,n,k", [(8, 8, 8), (16, 24, 32), (40, 8, 16)])
def test_simdgroup_matrix(dev, dtype, kernel, m, n, k):
    rng = np.random.default_rng(m * n + k)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    A, B, C = upload(dev, a), upload(dev, b), dev.buffer(m * n * 4)
    run(dev, kernel, (n // 8, m // 8), 32, buffers=[(0, A), (1, B), (2, C)],
        constants=[(3, constant(m, n, k, 0))], threadgroups=True)
    want = a.astype(np.float32) @ b.astype(np.float32)
    np.testing.assert_allclose(download(C, np.float32, (m, n)), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n,tg", [(64, 32), (33, 33), (70, 64)])
def test_bits_half_math_vector_collectives(dev, n, tg):
    rng = np.random.default_rng(n + tg)
    packed = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    scale = (rng.random(n) + 0.5).astype(np.float16)
    grid = -(-n // tg) * tg  # whole threadgroups: threads past n still join the collectives
    P, S = upload(dev, packed), upload(dev, scale)
    DEQ, INTS = dev.buffer(8 * n * 4), dev.buffer(4 * n * 4)
    H, V = dev.buffer(2 * n), dev.buffer(8 * grid)
    run(dev, "st_bits", grid, tg, buffers=[(0, P), (1, S), (2, DEQ), (3, INTS), (4, H), (5, V)],
        constants=[(6, constant(n))])
    nib = (packed[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    want = (nib.astype(np.float32) - 8) * scale.astype(np.float32)[:, None]
    np.testing.assert_array_equal(download(DEQ, np.float32, (n, 8)), want)
    ints = download(INTS, np.uint32, (n, 4))
    np.testing.assert_array_equal(ints[:, 0], (packed >> 16) ^ (packed & 0xFFFF))
    np.testing.assert_array_equal(ints[:, 1], np.minimum(packed, 1000) + np.maximum((packed % 7).astype(np.int64) - 3, 0))
    clz = np.array([32 - int(w).bit_length() for w in packed])
    ctz = np.array([(int(w) | 0x80000000) & -(int(w) | 0x80000000) for w in packed]).astype(np.uint64)
    ctz = np.log2(ctz).astype(np.int64)
    pop = np.array([bin(int(w)).count("1") for w in packed])
    np.testing.assert_array_equal(ints[:, 2], clz + 32 * ctz + pop)
    h = scale.astype(np.float32)
    want_h = (np.exp(h * 0.5).astype(np.float16).astype(np.float32) + np.sqrt(h).astype(np.float16)).astype(np.float16)
    np.testing.assert_allclose(download(H, np.float16).astype(np.float32), want_h.astype(np.float32), rtol=2e-3)
    v = download(V, np.float32, (grid, 2))
    s = np.zeros(grid, np.float32)
    s[:n] = scale.astype(np.float32)
    w = np.zeros(grid, np.uint32)
    w[:n] = packed
    for g0 in range(0, grid, tg):
        for s0 in range(g0, g0 + tg, 32):
            s1 = min(s0 + 32, g0 + tg)
            np.testing.assert_allclose(v[s0:s1, 0], s[s0:s1].sum(), rtol=1e-5)
            excl = np.concatenate([[0], np.cumsum(w[s0:s1] & 1)[:-1]])
            np.testing.assert_allclose(v[s0:s1, 1], (w[s0:s1] & 0xFF).sum() + excl, rtol=1e-6)
            live = np.arange(s0, s1) < n
            if live.any():
                assert (ints[np.arange(s0, s1)[live], 3] == (w[s0:s1] >> 8).max()).all()


@pytest.mark.parametrize("live", [1, 20, 32])
def test_collectives_skip_returned_lanes(dev, live):
    x = np.random.default_rng(live).standard_normal(64).astype(np.float32)
    X, O = upload(dev, x), upload(dev, np.zeros(64, np.float32))
    run(dev, "st_partial_sum", 64, 64, buffers=[(0, X), (1, O)], constants=[(2, constant(live))])
    got = download(O, np.float32)
    for s0 in (0, 32):
        np.testing.assert_allclose(got[s0:s0 + live], x[s0:s0 + live].sum(), rtol=1e-5)
        assert (got[s0 + live:s0 + 32] == 0).all()


@pytest.mark.parametrize("mode,msg", [(0, "divergent simd collectives.*simd_max.*simd_sum|divergent simd collectives.*simd_sum.*simd_max"),
                                      (1, "deadlock.*threadgroup_barrier.*simd_sum")])
def test_divergent_synchronisation_is_reported(dev, mode, msg):
    O = dev.buffer(4 * 32)
    cb = dev.command_buffer()
    cb.compute_pass().dispatch("st_divergent", 32, 32, buffers=[(0, O)], constants=[(1, constant(mode))])
    cb.commit()
    with pytest.raises(RuntimeError, match=msg):
        cb.wait()


@pytest.mark.parametrize("n,tg", [(256, 256), (1000, 256), (65, 33), (31, 32), (100, 1)])
def test_block_scan_nested_barriers(dev, n, tg):
    x = np.random.default_rng(n).integers(0, 100, n).astype(np.uint32)
    X, O = upload(dev, x), dev.buffer(4 * n)
    run(dev, "st_block_scan", n, tg, buffers=[(0, X), (1, O)], constants=[(2, constant(n))])
    want = np.concatenate([np.cumsum(x[g:g + tg]) for g in range(0, n, tg)]).astype(np.uint32)
    np.testing.assert_array_equal(download(O, np.uint32), want)


def test_float3_layout(dev):
    n = 37
    rng = np.random.default_rng(5)
    v = rng.standard_normal((n, 4)).astype(np.float32)   # float3: 16-byte stride
    pv = rng.standard_normal((n, 3)).astype(np.float32)  # packed_float3: 12-byte stride
    V, PV, O = upload(dev, v), upload(dev, pv), dev.buffer(8 * n)
    run(dev, "st_float3", n, 32, buffers=[(0, V), (1, PV), (2, O)], constants=[(3, constant(n))])
    got = download(O, np.float32, (n, 2))
    w = np.array([1, 10, 100], np.float32)
    np.testing.assert_allclose(got[:, 0], v[:, :3] @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[:, 1], pv @ w, rtol=1e-5, atol=1e-5)


def test_quad_and_shuffle_fill(dev):
    n = 64  # two full simdgroups
    x = np.random.default_rng(9).standard_normal(n).astype(np.float32)
    X, O = upload(dev, x), dev.buffer(8 * n * 4)
    run(dev, "st_quad", n, 64, buffers=[(0, X), (1, O)], constants=[(2, constant(n))])
    got = download(O, np.float32, (8, n))
    q = x.reshape(-1, 4)
    np.testing.assert_allclose(got[0], np.repeat(q.sum(1), 4), rtol=1e-5)
    np.testing.assert_array_equal(got[1], np.repeat(q.max(1), 4))
    np.testing.assert_allclose(got[2], np.concatenate([np.cumsum(r) - r for r in q]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[3], np.repeat(q[:, 3], 4))
    np.testing.assert_array_equal(got[4], q[:, [1, 0, 3, 2]].reshape(-1))
    np.testing.assert_array_equal(got[5], q[:, [1, 2, 3, 3]].reshape(-1))
    want6, want7 = np.empty(n, np.float32), np.empty(n, np.float32)
    for s0 in (0, 32):
        for i in range(32):
            j = i + 3
            want6[s0 + i] = x[s0 + j] if j < 32 else -x[s0 + j - 32]
            b, k = i - i % 8, i % 8
            j = k - 2
            want7[s0 + i] = x[s0 + b + j] if j >= 0 else -x[s0 + b + j + 8]
    np.testing.assert_array_equal(got[6], want6)
    np.testing.assert_array_equal(got[7], want7)


@pytest.mark.parametrize("same", [1, 0])
@pytest.mark.parametrize("threads", [32, 40, 96])
def test_sim_matrix_products_per_lane(dev, same, threads):
    """The simulator computes a simdgroup_matrix product once per simdgroup and copies it to
    the lanes whose operands are byte-identical (kernel_runtime.h, simd_matrix_op); a lane with
    other operands (here: lane-dependent loads, undefined on a GPU) still gets its own
    product, including in a partial last simdgroup (40 threads: 32 + 8 lanes)."""
    rng = fresh_rng(threads, same)
    A = rng.standard_normal((threads, 8, 8)).astype(np.float32)
    B = rng.standard_normal((8, 8)).astype(np.float32)
    Ab, Bb, C = upload(dev, A), upload(dev, B), dev.buffer(4 * 64 * threads)
    cb = dev.command_buffer()
    cb.compute_pass().dispatch("st_matmul_lanes", threads, threads, buffers=[(0, Ab), (1, Bb), (2, C)],
                               constants=[(3, constant(same))], reads=[Ab, Bb], writes=[C])
    cb.commit()
    cb.wait()
    got = download(C, np.float32).reshape(threads, 8, 8)
    for t in range(threads):
        a = A[0 if same else t].astype(np.float64)
        want = 1.0 + 3 * (a @ B.astype(np.float64))
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5, err_msg=f"thread {t}")
