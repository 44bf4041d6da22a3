"""The grouped expert GEMMs of the MoE prefill family, Metal 4 tensor-operation path
(metal/moe_prefill_tensor.metal, gemm_tensor.h), on the Metal simulator with
gpu_family="apple10". The dense GEMMs' twins, the bindings / probe / structure checks shared
by both families are in tests/kernels/test_gemm_tensor.py, whose docstring this mirrors.

1. The grouped GEMM tests of tests/kernels/test_moe_prefill.py (gate/up and down over
   skewed / empty / stale tile maps, the gate/up -> down chain, a real-model-shaped layer),
   and the tile classes end to end (scatter, then one dispatch per class in one stage),
   unchanged, on a device on which the grouped GEMM builder (``lily._core.encode_moe_gemm``)
   encodes a kernel's ``_tensor`` twin (``harness.TwinDevice``: same bindings and outputs,
   the twins' own threads and column blocks, as the builder picks them). Their
   tolerances are the float32 bounds of tests/kernels/test_gemm.py's docstring, which hold
   for any summation order. The routing tests of that file dispatch no GEMM and are not
   repeated.
2. Simulator exactness, in addition (forward order): every output of a twin equals its
   simdgroup kernel's bit for bit, and the down projection equals the float32 model
   ``harness.seq_model`` (products of the bfloat operands added in increasing k) stored as
   bfloat the way the kernels store it (rounded to nearest: ``bf16_activations``), for the
   reasons given in test_gemm_tensor.py.

Correctness tests run in the three simulator modes of tests/simdev.py (forward; reverse
with undeclared-read detection; random), all with out-of-range write detection, on
poisoned (NaN) outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from seeding import fresh_rng
from harness import ORDERS, THREAD_ORDERS

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import download, sim_device, upload  # noqa: E402
from lily.lab.kernels.moe_prefill import MOE_TENSOR_TILES, MOE_TILES, enc_moe_gemm_down, enc_moe_gemm_gate_up  # noqa: E402
from lily.lab.kernels.gemm import beyond_half  # noqa: E402
from lily.lab.kernels.harness import bf16_activations as bact, upload_bf16  # noqa: E402
from harness import rand_quant, run_encoder, upload_q  # noqa: E402
from harness import TwinDevice, cdiv, check_bound, pitched, seq_model, swiglu_check  # noqa: E402
import test_moe_prefill as simd_suite  # noqa: E402


@pytest.fixture(scope="module", params=ORDERS)
def dev(request):
    return TwinDevice(sim_device(gpu_family="apple10", **THREAD_ORDERS[request.param]))


@pytest.fixture(scope="module")
def fwd():
    return sim_device(gpu_family="apple10", verify_writes=True)


# ---- part 1: the grouped GEMM tests of test_moe_prefill.py on the twins (module docstring)
_GROUPED = ("test_moe_gate_up", "test_moe_down", "test_moe_chain", "test_moe_chain_real_shape", "test_moe_class_chain")
for _name in _GROUPED:
    globals()[_name + "_tensor"] = getattr(simd_suite, _name)
del _name


# Expert loads for T = 128 (tensor-op path only, one class): empty, one band, band edges,
# exactly one tile, a tile and a row, full tiles plus partial bands.
T128_COUNTS = [0, 6, 16, 17, 100, 128, 129, 200, 300, 20]  # an even sum: 2 experts per row


def test_moe_class_chain_t128(dev):
    """T = 128 end to end as test_moe_prefill.py's class chain: moe_route_scatter's single
    class map, then the 128-row gate/up and down kernels (a partial tile runs the operations
    of its live 32-row simdgroup blocks only), every expert's outputs against numpy."""
    maps = simd_suite.run_class_chain(dev, 128, T128_COUNTS, 2, 128, 64, fresh_rng(128, 64))
    assert len(maps) == 1 and len(maps[0]) == sum(-(-c // 128) for c in T128_COUNTS)


# ---- part 2: bit-exactness in the simulator (forward order)

def tile_map(ids, experts, T):
    """Host model of the routing stage: perm (slots grouped by expert, increasing), the
    MoeTile list {expert, begin, rows, 0} and max_tiles (docs/prefill.md)."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable").astype(np.uint32)  # slot -> row * top_k + j
    tiles = []
    begin = 0
    for e in range(experts):
        cnt = int((flat == e).sum())
        for off in range(0, cnt, T):
            tiles.append((e, begin + off, min(T, cnt - off), 0))
        begin += cnt
    max_tiles = cdiv(flat.size, T) + min(experts, flat.size)
    arr = np.full((max_tiles, 4), 0xFFFFFFFF, np.uint32)  # entries past tile_count: garbage
    arr[:len(tiles)] = np.array(tiles, np.uint32)
    return order, arr, len(tiles), max_tiles


def routed(rng, m, experts, top_k):
    return np.stack([rng.choice(experts, top_k, replace=False) for _ in range(m)]).astype(np.uint32)


MOE_SHAPES = [  # (m, experts, top_k, hidden, inter): the tiny and dims presets, ragged m
    (21, 16, 4, 128, 64),
    (13, 32, 8, 256, 128),
]
# T = 128 also on ~150 rows per expert: a full tile and a tail of several 16-row bands each
EXACT_CASES = [(T, *shape) for T in MOE_TENSOR_TILES for shape in MOE_SHAPES] + [(128, 150, 4, 4, 128, 64)]


def twin_of(kernel, T):
    """The simdgroup_matrix kernel whose outputs a tensor-op kernel of height T must equal,
    and its height: its twin, or for T = 128 (no twin) the 64-row kernel on its own tiling of
    the same grouped order (a slot's output does not depend on the tiling)."""
    return (kernel, T) if T in MOE_TILES else (kernel.replace(f"_t{T}", "_t64"), 64)


def run_grouped(dev, kernel, T, ids, experts, a, qts, n, k, ldy):
    """``kernel`` (a grouped GEMM of height T: gate/up with qts = (gate, up), down with qts =
    (down,)) as the prefill chunk encodes it (moe_prefill.enc_moe_gemm_gate_up / _down:
    lily._core.encode_moe_gemm's grid, threads and declared ranges) over tile_map's map of ids
    at height T. a: its operand (gate/up: the chunk's rows, down: the slots' rows), pitched,
    stored as bfloat. Returns y bfloat [m * top_k, ldy]."""
    (m, top_k), lda = ids.shape, a.shape[1]
    perm, tiles, count, max_tiles = tile_map(ids, experts, T)
    A = upload_bf16(dev, a)
    P, Ti, C = upload(dev, perm), upload(dev, tiles), upload(dev, np.array([count], np.uint32))
    Y = dev.buffer(m * top_k * ldy * 2)  # bfloat
    W = [upload_q(dev, q) for q in qts]
    if "_gate_up_" in kernel:
        run_encoder(dev, enc_moe_gemm_gate_up, T, A, P, Ti, C, max_tiles, *W, Y, m, top_k, experts, k, n, lda=lda,
                    ldy=ldy, kernel=kernel)
    else:
        run_encoder(dev, enc_moe_gemm_down, T, A, P, Ti, C, max_tiles, *W, Y, m, top_k, experts, n, k, lda=lda,
                    ldy=ldy, kernel=kernel)
    return download(Y, "bf16", (m * top_k, ldy))


def run_exact(dev, kind, T, ids, experts, a, qts, n, k, ldy):
    """moe_gemm_{kind}_q4_t{T}_tensor's y (run_grouped), equal bit for bit to its simdgroup
    twin's (twin_of, on the twin's own tiling), nothing written past column n."""
    kern = _core.kernel_name(f"moe_gemm_{kind}", q=4, t=T)
    y = run_grouped(dev, kern + "_tensor", T, ids, experts, a, qts, n, k, ldy)
    twin, Tt = twin_of(kern, T)
    np.testing.assert_array_equal(y, run_grouped(dev, twin, Tt, ids, experts, a, qts, n, k, ldy))
    assert np.isnan(y[:, n:]).all()
    return y


@pytest.mark.parametrize("T,m,experts,top_k,hidden,inter", EXACT_CASES)
def test_moe_gemm_gate_up_exact(fwd, T, m, experts, top_k, hidden, inter):
    rng = fresh_rng(15, T, m, experts)
    ids = routed(rng, m, experts, top_k)
    gq, uq = rand_quant(rng, (experts,), inter, hidden, 4), rand_quant(rng, (experts,), inter, hidden, 4)
    x = beyond_half(rng, (m, hidden))
    hx = run_exact(fwd, "gate_up", T, ids, experts, pitched(bact(x), hidden + 4, 0.0), (gq, uq), inter, hidden,
                   inter + 4)
    perm = tile_map(ids, experts, T)[0]
    for s, a in enumerate(perm):
        row, e = a // top_k, ids.reshape(-1)[a]
        swiglu_check(hx[s:s + 1, :inter], x[row:row + 1], gq, uq, int(e))


@pytest.mark.parametrize("T,m,experts,top_k,hidden,inter", EXACT_CASES)
def test_moe_gemm_down_exact(fwd, T, m, experts, top_k, hidden, inter):
    rng = fresh_rng(16, T, m, experts)
    ids = routed(rng, m, experts, top_k)
    dq = rand_quant(rng, (experts,), hidden, inter, 4)
    hx = pitched(bact(beyond_half(rng, (m * top_k, inter))), inter + 4, 0.0)
    yx = run_exact(fwd, "down", T, ids, experts, hx, (dq,), hidden, inter, hidden + 4)
    perm = tile_map(ids, experts, T)[0]
    flat = ids.reshape(-1)
    for s, a in enumerate(perm):
        e = flat[a]
        want = bact(seq_model(hx[s:s + 1, :inter], dq, int(e)))  # stored as bfloat
        np.testing.assert_array_equal(yx[a:a + 1, :hidden], want)
        check_bound(yx[a:a + 1, :hidden], hx[s:s + 1, :inter], dq, int(e), stored_bf16=True)
