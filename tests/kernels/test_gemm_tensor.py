"""Dense prefill GEMMs, Metal 4 tensor-operation path (metal/gemm_tensor.metal,
gemm_tensor.h), on the Metal simulator with gpu_family="apple10"; the grouped expert GEMMs'
twins (metal/moe_prefill_tensor.metal) are tested in tests/kernels/test_moe_prefill_tensor.py
with the same device, and the checks of part 3 cover both families.

1. h-gemm's suite, unchanged, on the twins: every test of tests/kernels/test_gemm.py
   (dense shapes, strides and column blocks, _add_h, _add_hs, _bf16, SwiGLU, the router/shared-gate layout,
   operands beyond the half range) is collected here again with its own parametrisation,
   inputs and tolerances, on a device on which the GEMM builder (``lily._core.encode_gemm``)
   encodes a kernel's ``_tensor`` twin (``harness.TwinDevice``: same bindings and outputs,
   the twin's grid as the builder picks it). Its
   references model the bfloat operands (``gemm_ref``) and its tolerances are the float32
   bounds documented in that module (``(K + 8) u M`` per output, first-order SwiGLU
   propagation), which hold for any summation order, so they are also what a GPU must meet.
   Excluded: its simulator-timing test (not a GEMM kernel).
2. Simulator exactness, in addition: the simulator's tensor operation rounds each fp32
   product and adds it in increasing k order (docs/device-layer.md), as does its
   simdgroup_matrix multiply-accumulate; both paths stage the same bfloat operands (x as
   stored, the weight dequantized as ``bfloat(fma(q, s, b))``). So every output of a twin
   equals its simdgroup kernel's bit for bit (SwiGLU included: the same ``silu`` on the same
   values), and the plain products equal a numpy float32 model that accumulates
   ``acc = acc + xb[:, k] * wb[:, k]`` in k order on the bfloat operands (products of bfloats
   are exact in fp32). (Not so on a GPU: other order, fma.)
3. The twins' bindings match the simdgroup kernels', they exist only on apple10 devices with
   bfloat tensor operands, the Metal backend's start-up probe kernels compute what they
   should, and the structure is pinned (MLX qmm_t_nax's: a bfloat cooperative left input
   filled from device memory, the dequantized bfloat weight tile alone in threadgroup
   memory, a float destination; the tile geometry).

Correctness tests run in the three simulator modes of tests/simdev.py (forward;
reverse with undeclared-read detection; random), all with out-of-range write detection, on
poisoned (NaN) outputs; the extra exactness checks of part 2 run in forward order.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from seeding import fresh_rng
from harness import ORDERS, THREAD_ORDERS

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import download, pack_args, sim_device, upload  # noqa: E402
from lily.reference import silu  # noqa: E402
from lily.checkpoint import bf16_to_f32  # noqa: E402
from harness import TwinDevice, cdiv, check_bound, pitched, seq_model, swiglu_check  # noqa: E402
import test_gemm as simd_suite  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
U = 2.0**-24


@pytest.fixture(scope="module", params=ORDERS)
def dev(request):
    return TwinDevice(sim_device(gpu_family="apple10", **THREAD_ORDERS[request.param]))


@pytest.fixture(scope="module")
def fwd_dev():
    return TwinDevice(sim_device(gpu_family="apple10", verify_writes=True))


@pytest.fixture(scope="module")
def fwd():
    return sim_device(gpu_family="apple10", verify_writes=True)


# ---- part 1: h-gemm's suite on the twins (module docstring)
_NOT_GEMM = {"test_time_lm_head_shape"}
for _name, _fn in list(vars(simd_suite).items()):
    if _name.startswith("test_") and callable(_fn) and _name not in _NOT_GEMM:
        globals()[_name + "_tensor"] = _fn
del _name, _fn


def test_suite_reaches_the_twins(dev):
    """A GEMM kernel dispatched by hand on a TwinDevice is refused (it would bypass the
    builder that picks the twin and its grid), and test_moe_prefill.py's grouped GEMM
    encoder on a TwinDevice dispatches the twin (the dense one's: the next test)."""
    cb = dev.command_buffer()
    with pytest.raises(AssertionError, match="gemm_q4 dispatched by hand on a TwinDevice"):
        cb.compute_pass().dispatch("gemm_q4", (1, 1), 128)
    import test_moe_prefill as moe_suite
    M, k, E, H, I, T = 1, 1, 1, 64, 64, 32
    tiles = upload(dev, np.array([0, 0, 1, 0], np.uint32))
    G, Up = (moe_suite.upload_q(dev, rand_quant(fresh_rng(10, j), (E,), I, H, 4)) for j in range(2))
    X, P, HX = upload(dev, np.zeros(H, np.uint16)), upload(dev, np.zeros(1, np.uint32)), dev.buffer(2 * I)
    cb = dev.command_buffer()
    moe_suite.enc_gate_up(cb.compute_pass(), T, X, P, tiles, upload(dev, np.ones(1, np.uint32)), 1, G, Up, HX, M, k,
                          E, H, I)
    cb.commit()
    cb.wait()
    assert cb.dispatch_log[0]["kernel"] == _core.kernel_name("moe_gemm_gate_up", "_tensor", q=4, t=T)


def test_suite_encodes_the_twins(dev):
    """h-gemm's suite encodes through the prefill plan's builder (its enc_gemm): on a
    TwinDevice that builder dispatches the tensor twin on the twin's grid."""
    qt = rand_quant(fresh_rng(11), (), 8, 64, 4)
    Y = dev.buffer(4 * 2 * 8)
    cb = dev.command_buffer()
    simd_suite.enc_gemm(cb.compute_pass(), "gemm_q4", simd_suite.qbufs(dev, qt), upload(dev, np.zeros(128, np.uint16)),
                        Y, 2, 8, 64, 64, 8)
    cb.commit()
    cb.wait()
    (rec,) = cb.dispatch_log
    assert rec["kernel"] == "gemm_q4_tensor" and rec["threads"] == (GEMM_TENSOR_TG, 1, 1)


# ----------------------------------------------------------------------------- helpers

# the reference helpers live with lily doctor's kernel checks (one home)
from lily.lab.kernels.gemm import (  # noqa: E402,F401
    GEMM_BK, GEMM_BM, GEMM_BN, GEMM_SWIGLU_BN, GEMM_TENSOR_BM, GEMM_TENSOR_TG, GEMM_TG, beyond_half, gemm_args,
    enc_gemm, gemm_geometry, gemm_ref, row_scale, row_scale_operand, scaled_operand, swiglu_ref,
)
from lily.lab.kernels.harness import bf16_operand, bf16_weights, run, run_encoder, upload_bf16  # noqa: E402,F401
from lily.lab.kernels.moe_prefill import (  # noqa: E402,F401
    MOE_BN, MOE_DOWN_BN, MOE_TENSOR_TILES, MOE_TG, MOE_TILES, moe_geometry,
)
from lily.lab.kernels.harness import bf16_activations as bact  # noqa: E402
from harness import rand_quant, run_bound as dispatch, to_bf16_bits  # noqa: E402,F401


# ----------------------------------------------------------------------------- dense

def run_dense(dev, kernel, qts, x, n, k, ldy, y0=None, scale=None):
    """Runs a dense GEMM kernel on x (stored as bfloat, as the producers do); returns y [m, ldy]
    (bfloat for SwiGLU, widened to float32). scale: SwiGLU's row scale as row_scale returns it."""
    m, lda = x.shape[0], k + 4
    X = upload_bf16(dev, pitched(bact(x), lda, 0.0))
    ysize = 2 if "swiglu" in kernel else 4
    Y = upload(dev, y0) if y0 is not None else dev.buffer(m * ldy * ysize)
    wb = []
    for qt in qts:
        wb += [upload(dev, qt.weight), upload(dev, qt.scales), upload(dev, qt.biases)]
    run_encoder(dev, enc_gemm, kernel, wb, X, Y, m, n, k, lda, ldy,
                row_scale=None if scale is None else row_scale_operand(dev, *scale))
    return download(Y, "bf16" if ysize == 2 else np.float32, (m, ldy))


# ---- part 2: bit-exactness in the simulator (forward order)

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k", [(45, 100, 128), (1, 64, 64), (64, 130, 192), (150, 70, 128)])
def test_gemm_q_exact(fwd, bits, m, n, k):
    dev = fwd
    rng = fresh_rng(11, bits, m, n, k)
    qt = rand_quant(rng, (), n, k, bits)
    x = beyond_half(rng, (m, k))
    ldy = n + 3
    kernel = _core.kernel_name("gemm", q=bits)
    y = run_dense(dev, kernel + "_tensor", [qt], x, n, k, ldy)
    np.testing.assert_array_equal(y[:, :n], seq_model(x, qt))
    assert np.isnan(y[:, n:]).all()  # nothing written past n
    np.testing.assert_array_equal(y, run_dense(dev, kernel, [qt], x, n, k, ldy))
    check_bound(y[:, :n], x, qt)


def test_gemm_q4_add_exact(fwd):
    """y += x W^T on bfloat x (gemm_q4_add_h: o_proj, the shared expert's down)."""
    dev, kernel = fwd, "gemm_q4_add_h"
    m, n, k = 37, 90, 128
    rng = fresh_rng(12)
    qt = rand_quant(rng, (), n, k, 4)
    x = beyond_half(rng, (m, k))
    ldy = n + 1
    y0 = rng.standard_normal((m, ldy), dtype=np.float32)
    y = run_dense(dev, kernel + "_tensor", [qt], x, n, k, ldy, y0)
    np.testing.assert_array_equal(y[:, :n], y0[:, :n] + seq_model(x, qt))
    np.testing.assert_array_equal(y[:, n:], y0[:, n:])
    np.testing.assert_array_equal(y, run_dense(dev, kernel, [qt], x, n, k, ldy, y0))
    check_bound(y[:, :n] - y0[:, :n].astype(np.float64), x, qt)


def test_gemm_q4_add_hs_exact(fwd):
    """y += (x * f) W^T (gemm_q4_add_hs: the GDN out_proj, u times a half factor per 32
    elements of a row): the twin equals the simdgroup kernel bit for bit and the float32 model
    on the staged bfloat products."""
    m, n, k, shift = 37, 90, 128, 5
    rng = fresh_rng(15)
    qt = rand_quant(rng, (), n, k, 4)
    x = bact(4 * beyond_half(rng, (m, k)))
    f = rng.uniform(0.0, 1.0, (m, k >> shift)).astype(np.float16)
    ldy = n + 1
    y0 = rng.standard_normal((m, ldy), dtype=np.float32)

    def go(kernel):
        wb = [upload(fwd, a) for a in (qt.weight, qt.scales, qt.biases)]
        Y = upload(fwd, y0)
        run_encoder(fwd, enc_gemm, kernel, wb, upload_bf16(fwd, x), Y, m, n, k, k, ldy, x_scale=upload(fwd, f),
                    x_shift=shift)
        return download(Y, np.float32, (m, ldy))

    y = go("gemm_q4_add_hs_tensor")
    xs = scaled_operand(x, f, shift)  # the staged bfloat products
    np.testing.assert_array_equal(y[:, :n], y0[:, :n] + seq_model(xs, qt))
    np.testing.assert_array_equal(y[:, n:], y0[:, n:])
    np.testing.assert_array_equal(y, go("gemm_q4_add_hs"))
    check_bound(y[:, :n] - y0[:, :n].astype(np.float64), xs, qt)


@pytest.mark.parametrize("m,n,k", [(33, 70, 128), (5, 64, 256)])
def test_gemm_swiglu_q4_exact(fwd, m, n, k):
    dev = fwd
    rng = fresh_rng(13, m, n, k)
    gq, uq = rand_quant(rng, (), n, k, 4), rand_quant(rng, (), n, k, 4)
    x = beyond_half(rng, (m, k))
    ldy = n + 2
    w, col = row_scale(rng, m)
    y = run_dense(dev, "gemm_swiglu_q4_tensor", [gq, uq], x, n, k, ldy, scale=(w, col))
    np.testing.assert_array_equal(y, run_dense(dev, "gemm_swiglu_q4", [gq, uq], x, n, k, ldy, scale=(w, col)))
    g, u = seq_model(x, gq), seq_model(x, uq)
    # silu's and the row scale's float32 roundings, then the bfloat store
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(y[:, :n], silu(g) * u * w[:, col, None], rtol=2.0**-8 + 2e-6, atol=2.0**-133)
    swiglu_check(y[:, :n], x, gq, uq, scale=w[:, col])


def test_gemm_q4_real_size_exact(fwd):
    """One real-model shape: a 24-token chunk through a 2048 -> 512 projection."""
    m, n, k = 24, 512, 2048
    rng = fresh_rng(14)
    qt = rand_quant(rng, (), n, k, 4)
    x = rng.standard_normal((m, k), dtype=np.float32)
    y = run_dense(fwd, "gemm_q4_tensor", [qt], x, n, k, n)
    np.testing.assert_array_equal(y, seq_model(x, qt))
    check_bound(y, x, qt)


# ---- part 3: twins and probe

def kernel_bindings(path):
    """{kernel function: [(binding index, parameter declaration)]} of a .metal file."""
    src = path.read_text()
    out = {}
    for m in re.finditer(r"kernel void (\w+)\((.*?)\)\s*\{", src, re.S):
        params = re.findall(r"((?:device|constant)[^,\[]*?)\s*\[\[buffer\((\d+)\)\]\]", m.group(2))
        out[m.group(1)] = [(int(i), " ".join(d.split())) for d, i in params]
    return out


SIMD_FILES = ("gemm.metal", "moe_prefill.metal")
TENSOR_FILES = ("gemm_tensor.metal", "moe_prefill_tensor.metal")


def _gemm_kernels(files):
    out = {}
    for f in files:
        out.update({k: v for k, v in kernel_bindings(ROOT / "metal" / f).items() if "gemm" in k})
    return out


def test_tensor_twins_have_the_simdgroup_bindings():
    """Every GEMM kernel of gemm.metal / moe_prefill.metal has a twin f_tensor with the same
    [[buffer(n)]] parameters, and every host name h an instantiation h_tensor."""
    simd, tensor = _gemm_kernels(SIMD_FILES), _gemm_kernels(TENSOR_FILES)
    assert len(simd) == 5, sorted(simd)
    assert sorted(tensor) == sorted(name + "_tensor" for name in simd)
    for name, params in simd.items():
        assert tensor.get(name + "_tensor") == params, f"{name}_tensor: bindings differ from {name}'s"
    host = [h for f in SIMD_FILES for h in re.findall(r'host_name\("(\w*gemm\w*)"\)', (ROOT / "metal" / f).read_text())]
    host += ["gemm_swiglu_q4", "gemm_q4_add_hs"]  # non-template kernels: registered under their own names
    host_t = [h for f in TENSOR_FILES for h in re.findall(r'host_name\("(\w+)"\)', (ROOT / "metal" / f).read_text())]
    # the 128-row expert tiles exist on the tensor-op path only
    own = [_core.kernel_name(f"moe_gemm_{kind}", "_tensor", q=4, t=128) for kind in ("gate_up", "down")]
    assert sorted([h + "_tensor" for h in host] + own) == sorted(host_t + ["gemm_swiglu_q4_tensor", "gemm_q4_add_hs_tensor"])
    assert not re.search(r"moe_gemm", (ROOT / "metal" / "gemm.metal").read_text().split("#include")[-1]), \
        "the grouped expert GEMMs live in the MoE prefill family (moe_prefill*.metal)"


def test_tensor_kernels_only_on_apple10(fwd):
    names = [h + "_tensor" for h in ("gemm_q4", "gemm_q8", "gemm_q4_add_h", "gemm_q4_add_hs", "gemm_q4_bf16",
                                     "gemm_swiglu_q4",
                                     *(_core.kernel_name(f"moe_gemm_{kind}", q=4, t=T) for kind in ("gate_up", "down")
                                       for T in MOE_TENSOR_TILES))]
    d9 = sim_device(gpu_family="apple9")
    for name in names:
        assert fwd.has_kernel(name) and not d9.has_kernel(name), name
        assert d9.has_kernel(name[:-len("_tensor")]) == ("_t128" not in name), name


def test_probe_kernels(fwd):
    """The start-up probes run each kind of tensor operation of the kernels, each exactly as
    the simulator's sequential fp32 model of its operands: tensor_ops_probe the GEMMs' (a
    bfloat cooperative left input times a bfloat threadgroup tile), tensor_ops_probe_bfloat
    the attention's bfloat QK^T from device memory and PV with V in a cooperative input."""
    x = fresh_rng(17).standard_normal((64, GEMM_BK), dtype=np.float32)
    bits = to_bf16_bits(x)
    xb = bf16_to_f32(bits)
    X, XB = upload(fwd, x), upload(fwd, bits)
    O, QK, PV = (fwd.buffer(32 * 64 * 4) for _ in range(3))
    dispatch(fwd, "tensor_ops_probe", 1, 128, [X, O], None, reads=[X], writes=[O])
    np.testing.assert_array_equal(download(O, np.float32, (32, 64)), seq_model(x[:32], w=bf16_operand(x)))
    dispatch(fwd, "tensor_ops_probe_bfloat", 1, 128, [XB, QK, PV], None, reads=[XB], writes=[QK, PV])
    np.testing.assert_array_equal(download(QK, np.float32, (32, 64)), _seq(xb[:32], xb))
    np.testing.assert_array_equal(download(PV, np.float32, (32, 64)), _seq(xb[:32], xb.T))


def test_half_only_device_has_no_tensor_gemms(fwd):
    """With bfloat tensor ops off (sim_device(bfloat_tensor_ops=False): a tensor library whose
    operand table lacks bfloat, MacOSX 26.0's) no prefill tensor kernel remains (every one
    takes bfloat operands), nor either probe; they are refused, saying why."""
    half = sim_device(gpu_family="apple10", bfloat_tensor_ops=False)
    for name in ("tensor_ops_probe", "tensor_ops_probe_bfloat", "gemm_q4_tensor", "moe_gemm_down_q4_t128_tensor"):
        assert not half.has_kernel(name) and fwd.has_kernel(name), name
    with pytest.raises(ValueError, match="gemm_q4_tensor.*bfloat operands.*bfloat_tensor_ops=False"):
        half.pipeline_info("gemm_q4_tensor")


def _seq(a, b):
    """a b^T in float32, products exact (bfloat operands), added in increasing k."""
    acc = np.zeros((a.shape[0], b.shape[0]), np.float32)
    for k in range(a.shape[1]):
        acc = acc + a[:, k:k + 1] * b[None, :, k]
    return acc


def _constants(path, *names):
    src = (ROOT / path).read_text()
    return [int(re.search(rf"\b{n}\s*=\s*(\d+)", src).group(1)) for n in names]


def test_structure_mlx_tiles():
    """Pins the design (docs/prefill.md, "GEMM"): on the tensor-op path MLX qmm_t_nax's
    structure: the A operand a bfloat cooperative left input filled from device memory
    (never staged in threadgroup memory), the dequantized weight a bfloat threadgroup tensor
    on the right, a float destination left in registers (no staging), each simdgroup its own
    operation (execution_simdgroup) of k = 32; on the simdgroup_matrix path bfloat operands
    with fp32 accumulators; k steps of 64 (one quantization group), each step's loads issued
    after the barrier that publishes the step before's tiles (register-staged double
    buffering, both paths); dense 64 x 64 output blocks (SwiGLU 64 x 32 of gate and of up) of
    2 x 2 simdgroups on the simdgroup_matrix path, 128 x 64 (128 x 32) of 4 x 2 on the
    tensor-op path (32 x 32 per simdgroup, qmm_t_nax's); one 9 KiB weight tile per tensor-op
    threadgroup at every tile height; the host, the cost table and the tests agree on the
    geometry."""
    tiles = (ROOT / "metal" / "gemm_tiles.h").read_text()
    tensor = (ROOT / "metal" / "gemm_tensor.h").read_text()
    body = tensor[tensor.index("inline void gemm_tensor_gemm"):]
    assert "get_left_input_cooperative_tensor<bfloat, bfloat, float>" in body
    assert re.search(r"using GemmTensorW = tensor<threadgroup bfloat, extents<int32_t, kGemmTensorK, RN>", tensor)
    assert "matmul2d<desc, execution_simdgroup>" in body and "GemmAStep" not in body  # A is never staged
    assert ".store(" not in body and "sink.put(" in body  # results written from the registers
    prefetch = r"threadgroup_barrier\(mem_flags::mem_threadgroup\);\s*if \(k0 \+ kGemmBK < k\) \{\s*(an\.fetch\(.*\s*)?wn\.fetch"
    assert re.search(prefetch, body)  # the next step's weight codes load during this step's products
    acc = tiles[tiles.index("inline void gemm_accumulate"):]
    assert re.search(prefetch, acc) and "an.fetch(x, a, k0 + kGemmBK" in acc  # and its A pieces (simdgroup path)
    assert re.search(r"simdgroup_bfloat8x8 a\[FM\]", tiles) and re.search(r"simdgroup_bfloat8x8 wt;", tiles)
    assert re.search(r"simdgroup_float8x8 acc\[", tiles)
    (bk,) = _constants("metal/gemm_args.h", "kGemmBK")
    (tk,) = _constants("metal/gemm_tensor.h", "kGemmTensorK")
    assert bk == GEMM_BK == 64 and tk == 32
    assert _constants("metal/gemm_args.h", "kGemmBM", "kGemmBN", "kGemmSwigluBN") == [GEMM_BM, GEMM_BN, GEMM_SWIGLU_BN]
    assert _constants("metal/gemm_args.h", "kGemmSM", "kGemmSN", "kGemmSwigluSM", "kGemmSwigluSN") == [2, 2, 4, 1]
    assert 32 * 2 * 2 == 32 * 4 * 1 == GEMM_TG  # both simdgroup layouts fill kGemmThreads
    assert [GEMM_BM, GEMM_BN, GEMM_SWIGLU_BN, GEMM_TENSOR_BM, GEMM_TENSOR_TG] == [64, 64, 32, 128, 256]
    assert _constants("metal/gemm_args.h", "kGemmTensorBM", "kGemmTensorBN", "kGemmTensorSwigluBN",
                      "kGemmTensorSM", "kGemmTensorSN") == [GEMM_TENSOR_BM, GEMM_BN, GEMM_SWIGLU_BN, 4, 2]
    assert 32 * 4 * 2 == GEMM_TENSOR_TG and GEMM_TENSOR_BM // 4 == GEMM_BN // 2 == 32  # 32 x 32 per simdgroup
    dense = (ROOT / "metal" / "gemm_tensor.metal").read_text()
    assert len(re.findall(r"kGemmTensorBM, kGemmTensor(Swiglu)?BN, kGemmTensorSM, kGemmTensorSN>", dense)) == 3
    assert dense.count("max_total_threads_per_threadgroup(kGemmTensorThreads)") == 3  # test_kernel_facts: its value
    simd = (ROOT / "metal" / "gemm.metal").read_text()
    assert re.search(r"gemm_dense<BITS, 1, ADD, kGemmBM, kGemmBN, kGemmSM, kGemmSN>", simd)
    assert len(re.findall(r"kGemmBM, kGemm(Swiglu)?BN, kGemm(Swiglu)?SM, kGemm(Swiglu)?SN>", simd)) == 3
    # the host and the lab read these from metal/gemm_args.h (kernel_args.h, lily._core.CONSTANTS)
    assert _core.CONSTANTS["kGemmLd"] == GEMM_BK + 8

    def smem(bm, bn, nb):  # GemmSmem of gemm_tiles.h: bfloat tiles, or the staged fp32 results
        return max((bm + nb * bn) * (GEMM_BK + 8) * 2, nb * bm * (bn + 4) * 4)

    def tensor_smem(bn, nb):  # GemmTensorSmem of gemm_tensor.h: the weight tiles only
        return nb * bn * (GEMM_BK + 8) * 2

    assert smem(GEMM_BM, GEMM_BN, 1) <= 32768 and smem(GEMM_BM, GEMM_SWIGLU_BN, 2) <= 32768
    assert tensor_smem(GEMM_BN, 1) == tensor_smem(GEMM_SWIGLU_BN, 2) == 9216  # qmm_t_nax's tile
    for T in MOE_TILES:
        assert smem(T, MOE_BN[T], 2) <= 32768 and smem(T, MOE_DOWN_BN[T], 1) <= 32768
    for T in MOE_TENSOR_TILES:
        threads, bn, down_bn = moe_geometry(T, True)
        assert tensor_smem(bn, 2) == tensor_smem(down_bn, 1) == 9216
    # the grouped kernels are instantiated by tile height alone and take the rest of their
    # geometry from metal/prefill_args.h's moe_gemm_* (what moe_geometry gives the host),
    # within their declared maximum threads
    for kind, nb in (("gate_up", 2), ("down", 1)):
        for f, tensor_path, heights, limit in (
                ("moe_prefill.metal", False, MOE_TILES, "kMoeGemmMaxThreads"),
                ("moe_prefill_tensor.metal", True, MOE_TENSOR_TILES, "kMoeGemmTensorMaxThreads")):
            src = (ROOT / "metal" / f).read_text()
            path = "true" if tensor_path else "false"
            assert all(f"moe_gemm_{g}(T, {path}, {nb})" in src for g in ("bn", "sm", "sn")), (f, kind)
            for T in heights:
                suffix = "_tensor" if tensor_path else ""
                assert re.search(rf'host_name\("moe_gemm_{kind}_q4_t{T}{suffix}"\)\]\] \[\[kernel\]\] '
                                 rf"decltype\(\w+<{T}>\)", src), (f, kind, T)
                threads = moe_geometry(T, tensor_path)[0]
                assert threads <= _core.CONSTANTS[limit] and threads % 32 == 0, (f, kind, T)
