"""The Metal 4 tensor-operation subset of the simulator (docs/device-layer.md, "Metal 4 tensor
operations"): metal/selftest_tensor.metal against numpy, GPU-family selection, misuse the
simulator must report, and constructs outside the subset that must not compile.

Tolerance: none. The simulator's documented arithmetic is float32 with every product
float(a) * float(b) rounded to float32 and added to the destination element in increasing
k order (starting from the destination for multiply_accumulate, from 0 for multiply). The
numpy model below performs exactly those float32 operations (one vectorised
``acc = acc + a[:, k] * b[k, :]`` per k), and half / bfloat inputs are drawn already
representable, so results must be bit-identical. (A GPU may sum in another order or fuse
multiply-adds: a test on a Mac would need a float32 summation tolerance.)

Kernel tests run in the three simulator modes of tests/simdev.py (forward;
reverse with undeclared-read detection; random), all with out-of-range write detection, on
a device created with gpu_family="apple10"; outputs start poisoned (NaN), shapes do not
divide the tiles.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from seeding import fresh_rng
from simdev import ORDERS, THREAD_ORDERS
from harness import run  # noqa: E402

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import constant, download, sim_device, upload  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MSL2CPP = ROOT / "csrc" / "gpu" / "sim" / "msl2cpp.py"
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@pytest.fixture(scope="module", params=ORDERS)
def dev(request):
    """An apple10 simulator (tensor ops available) in each thread order."""
    return sim_device(gpu_family="apple10", **THREAD_ORDERS[request.param])


@pytest.fixture(scope="module")
def fwd():
    return sim_device(gpu_family="apple10")


@pytest.fixture(scope="module", params=[*ORDERS, "nax"])
def any_layout(request):
    """As ``dev``, plus a forward device with the M5's fragment layout (tensor_layout="nax"):
    for the kernels whose cooperative tensors are on execution_simdgroup, where it applies."""
    if request.param == "nax":
        return sim_device(gpu_family="apple10", tensor_layout="nax", **THREAD_ORDERS["forward"])
    return sim_device(gpu_family="apple10", **THREAD_ORDERS[request.param])


# ------------------------------------------------------------------------------ helpers

def bf16(x):
    """float32 -> nearest bfloat16 (round to nearest even), as float32."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32) << 16).view(np.float32)


def bf16_bits(x):
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": "bf16"}


def draw(rng, shape, kind):
    """Values exactly representable in `kind`, as float32, and their bytes for upload."""
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "f16":
        v = x.astype(np.float16)
        return v.astype(np.float32), v
    if kind == "bf16":
        v = bf16(x)
        return v, bf16_bits(v)
    return x, x


def mm_model(a, b, c0=None):
    """C = a @ b (+ c0) with the simulator's documented float32 accumulation."""
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32) if c0 is None else c0.astype(np.float32).copy()
    for k in range(a.shape[1]):
        acc = acc + a[:, k:k + 1] * b[k:k + 1, :]
    return acc


def args(M, N, K, lda=None):
    return constant(M, N, K, K if lda is None else lda)


def cdiv(a, b):
    return (a + b - 1) // b


# ------------------------------------------------------------------------------ selection

def test_gpu_family_selects_the_tensor_kernels(monkeypatch):
    d9 = sim_device()
    assert d9.gpu_family == "apple9" and not d9.supports_tensor_ops
    assert "apple10" in d9.tensor_ops_status
    assert not [k for k in d9.kernel_names() if "tensor" in k]
    assert not d9.has_kernel("st_tensor_mm_device_f32_f32") and d9.has_kernel("st_add_f32")
    with pytest.raises(ValueError, match=r"st_tensor_mm_device_f32_f32.*selftest_tensor\.metal.*Metal 4 tensor"):
        d9.command_buffer().compute_pass().dispatch("st_tensor_mm_device_f32_f32", 1, 128)
    d10 = sim_device(gpu_family="apple10")
    assert d10.gpu_family == "apple10" and d10.supports_tensor_ops and d10.tensor_ops_status == ""
    assert d10.has_kernel("st_tensor_mm_device_f32_f32") and d10.has_kernel("tensor_ops_probe")
    assert d10.has_kernel("st_add_f32")  # the rest of the library is there too
    assert _core.gpu_family(d10) == "apple10"
    for f in ("apple7", "apple8"):
        assert not sim_device(gpu_family=f).supports_tensor_ops
    with pytest.raises(ValueError, match="gpu_family"):
        sim_device(gpu_family="apple11")
    assert d10.supports_bfloat_tensor_ops and d10.bfloat_tensor_ops_status == ""
    assert not d9.supports_bfloat_tensor_ops and d9.bfloat_tensor_ops_status == d9.tensor_ops_status
    monkeypatch.setenv("LILY_DISABLE_TENSOR_OPS", "1")
    assert not d10.supports_tensor_ops and "LILY_DISABLE_TENSOR_OPS" in d10.tensor_ops_status
    assert not d10.supports_bfloat_tensor_ops and "LILY_DISABLE_TENSOR_OPS" in d10.bfloat_tensor_ops_status


def test_half_only_tensor_ops_leave_out_the_bfloat_kernels():
    """sim_device(bfloat_tensor_ops=False): a system whose tensor ops take half but not bfloat
    operands (MacOSX 26.0's operand table). The kernels of a tensor file that declares bfloat
    tensors or bfloat cooperative inputs (every prefill tensor kernel since nothing is clipped:
    the dense and expert GEMMs, the attention, both probes; the self-tests of a file that has
    bfloat ones) are left out and refused at lookup, saying why; the simdgroup kernels stay."""
    d = sim_device(gpu_family="apple10", bfloat_tensor_ops=False)
    full = sim_device(gpu_family="apple10")
    assert d.supports_tensor_ops and d.tensor_ops_status == ""
    assert not d.supports_bfloat_tensor_ops and "bfloat_tensor_ops=False" in d.bfloat_tensor_ops_status
    gone = sorted(set(full.kernel_names()) - set(d.kernel_names()))
    assert {"attn_prefill_d256_g8_tensor", "gemm_q4_tensor", "gemm_swiglu_q4_tensor", "moe_gemm_down_q4_t128_tensor",
            "tensor_ops_probe", "tensor_ops_probe_bfloat"} <= set(gone)
    assert not [k for k in d.kernel_names() if k.endswith("_tensor") or k.startswith("tensor_ops_probe")]
    assert d.has_kernel("gemm_q4") and d.has_kernel("attn_prefill_d256_g8")
    with pytest.raises(ValueError, match=r"gemm_q4_tensor.*gemm_tensor\.metal.*bfloat operands.*bfloat_tensor_ops=False"):
        d.command_buffer().compute_pass().dispatch("gemm_q4_tensor", 1, 256)
    with pytest.raises(ValueError, match=r"attn_prefill_d256_g8_tensor.*attention_prefill_tensor\.metal.*bfloat "
                                         r"operands.*bfloat_tensor_ops=False"):
        d.command_buffer().compute_pass().dispatch("attn_prefill_d256_g8_tensor", 1, 256)
    # without tensor ops at all the option changes nothing
    assert sim_device(bfloat_tensor_ops=False).tensor_ops_status == sim_device().tensor_ops_status
    # the Metal device, whose library does not say which kernels take bfloat operands, leaves
    # them out by a naming rule: it must pick exactly the kernels the source marks
    from lily import _core
    shipped = [k for k in full.kernel_names() if not k.startswith("st_")]
    assert [k for k in shipped if _core.is_bfloat_tensor_kernel(k)] == [k for k in shipped if k in gone]


def test_transform_marks_tensor_files(tmp_path):
    """Tensor headers only in *_tensor.metal; their kernels register as tensor-op kernels."""
    src = ("#include <metal_stdlib>\n#include <metal_tensor>\n"
           "#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>\n"
           "kernel void f(device float* x [[buffer(0)]]) {}\n")

    def transform(name, body="{}"):
        """msl2cpp of src with kernel body `body` as file `name`: (process, the C++ text or None)."""
        (tmp_path / name).write_text(src.replace("{}", body))
        r = subprocess.run([sys.executable, str(MSL2CPP), str(tmp_path / "o"), str(tmp_path / name)],
                           capture_output=True, text=True)
        out = tmp_path / "o" / f"{name}.cpp"
        return r, out.read_text() if r.returncode == 0 else None

    r, text = transform("a_tensor.metal")
    assert r.returncode == 0, r.stderr
    head = text.split("namespace lily_msl_", 1)[0]
    assert "#include <metal_tensor>" in head and "MetalPerformancePrimitives.h>" in head
    assert re.search(r'Registrar<decltype\(f\)>.*"a_tensor\.metal:4", true\);', text)
    # a tensor file that names a bfloat tensor type: its kernels register with bfloat operands
    r, text = transform("b_tensor.metal", "{ using T = tensor<device const bfloat, dextents<int32_t, 2>, tensor_inline>; }")
    assert r.returncode == 0, r.stderr
    assert re.search(r'"b_tensor\.metal:4", true, true\);', text)
    # ... or asks for a bfloat cooperative input (the prefill GEMMs' left operand)
    r, text = transform("c_tensor.metal", "{ auto a = op.template get_left_input_cooperative_tensor<bfloat, bfloat, float>(); }")
    assert r.returncode == 0, r.stderr
    assert re.search(r'"c_tensor\.metal:4", true, true\);', text)
    r, _ = transform("plain.metal")
    assert r.returncode == 1 and "plain.metal:2: error: <metal_tensor>: Metal 4 tensor operations belong in" in r.stderr



def test_transform_tensor_headers(tmp_path):
    """A header with tensor code (*_tensor.h, e.g. metal/gemm_tensor.h) may include the
    tensor headers (its *_tensor.metal includer names them too, hoisted out of the kernel
    namespace); a plain .metal file including such a header is rejected."""
    hdr = ("#pragma once\n#include <metal_stdlib>\n#include <metal_tensor>\n"
           "#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>\ninline int g() { return 1; }\n")
    (tmp_path / "k_tensor.h").write_text(hdr)
    r = subprocess.run([sys.executable, str(MSL2CPP), str(tmp_path / "o"), str(tmp_path / "k_tensor.h")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    body = (tmp_path / "o" / "k_tensor.h").read_text()
    assert "#include <metal_tensor>" not in body and "inline int g()" in body
    (tmp_path / "user.metal").write_text('#include <metal_stdlib>\n#include "k_tensor.h"\n')
    r = subprocess.run([sys.executable, str(MSL2CPP), str(tmp_path / "o"), str(tmp_path / "user.metal")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and 'user.metal:2: error: #include "k_tensor.h": tensor-operation headers' in r.stderr


# ------------------------------------------------------------------------------ kernels

@pytest.mark.parametrize("ta,tb", [("f16", "f16"), ("f32", "f32"), ("bf16", "bf16"), ("f32", "f16"),
                                   ("bf16", "f32"), ("f16", "bf16")])
@pytest.mark.parametrize("M,N,K", [(70, 45, 37), (64, 32, 64), (1, 1, 1)])
def test_mm_device(dev, ta, tb, M, N, K):
    """Device operands and destination, execution_simdgroups<4>, 64 x 32 tiles, dynamic k."""
    rng = fresh_rng(1, M, N, K, len(ta), len(tb))
    a, a_up = draw(rng, (M, K), ta)
    b, b_up = draw(rng, (K, N), tb)
    # mode multiply: Apple's header assumes a zeroed destination (C = A B + C)
    A, B, C = upload(dev, a_up), upload(dev, b_up), upload(dev, np.zeros((M, N), np.float32))
    run(dev, f"st_tensor_mm_device_{ta}_{tb}", (cdiv(N, 32), cdiv(M, 64)), 128,
        [(0, A), (1, B), (2, C)], [(3, args(M, N, K))], [A, B], [C])
    np.testing.assert_array_equal(download(C, np.float32, (M, N)), mm_model(a, b))


def test_multiply_into_a_nonzero_destination_is_reported(dev):
    """mode::multiply into a tensor that is not zero is refused by name: whether Metal then
    overwrites or accumulates is not promised, so the simulator does not pick one."""
    M, N, K = 64, 32, 16
    rng = fresh_rng(6)
    a, a_up = draw(rng, (M, K), "f32")
    b, b_up = draw(rng, (K, N), "f32")
    C = upload(dev, np.zeros((M, N), np.float32) + np.float32(1.0))
    with pytest.raises(RuntimeError, match=r"mode::multiply|multiply\) into a tensor whose element \(row 0, column 0\) "
                                           r"is not zero: zero the destination first"):
        run(dev, "st_tensor_mm_device_f32_f32", (1, 1), 128, [(0, upload(dev, a_up)), (1, upload(dev, b_up)), (2, C)],
            [(3, args(M, N, K))], [], [C])


@pytest.mark.parametrize("variant", ["f32_f32_nt", "f32_f32_nn", "f32_f32_tn", "f32_f32_tt", "f16_f16_nt",
                                     "bf16_bf16_nt", "f32_f16_nt", "f32_bf16_nt"])
def test_mm_staged(dev, variant):
    """Threadgroup tiles (transposed or not), a cooperative destination accumulated over K
    in steps of k = 32 with multiply_accumulate, an element-wise epilogue."""
    tl, tr, _ = variant.split("_")
    M, N, K, lda = 45, 70, 96, 99
    rng = fresh_rng(2, len(variant), ord(variant[-2]), ord(variant[-1]))
    a, _ = draw(rng, (M, K), tl)
    w, _ = draw(rng, (N, K), tr)
    bias = rng.standard_normal(N).astype(np.float32)
    a_pitched = np.zeros((M, lda), np.float32)
    a_pitched[:, :K] = a
    A, W, Bi, C = upload(dev, a_pitched), upload(dev, w), upload(dev, bias), dev.buffer(M * N * 4)
    run(dev, f"st_tensor_mm_staged_{variant}", (cdiv(N, 32), cdiv(M, 32)), 64,
        [(0, A), (1, W), (2, Bi), (3, C)], [(4, args(M, N, K, lda))], [A, W, Bi], [C])
    np.testing.assert_array_equal(download(C, np.float32, (M, N)), mm_model(a, w.T) + bias)


def test_mm_simdgroup(any_layout):
    """execution_simdgroup: one 16 x 32 tile per simdgroup on strided device operands, the
    product scaled in registers and stored with cooperative_tensor::store (edges skipped)."""
    dev = any_layout
    M, N, K, lda = 50, 40, 37, 41
    rng = fresh_rng(3)
    a = rng.standard_normal((M, lda)).astype(np.float32)
    w16 = rng.standard_normal((N, K)).astype(np.float16)
    A, W, C = upload(dev, a), upload(dev, w16), dev.buffer(M * N * 4)
    run(dev, "st_tensor_mm_simdgroup", (cdiv(N, 32), cdiv(M, 32)), 64,
        [(0, A), (1, W), (2, C)], [(3, args(M, N, K, lda))], [A, W], [C])
    want = mm_model(a[:, :K], w16.astype(np.float32).T) * np.float32(0.5)
    np.testing.assert_array_equal(download(C, np.float32, (M, N)), want)


def test_mm_thread(dev):
    """execution_thread: a device destination accumulated in place, static slices along K."""
    M, N, K = 40, 70, 64
    rng = fresh_rng(4)
    a16 = rng.standard_normal((M, K)).astype(np.float16)
    b = rng.standard_normal((K, N)).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    A, B, C = upload(dev, a16), upload(dev, b), upload(dev, c0)
    run(dev, "st_tensor_mm_thread", (cdiv(cdiv(N, 16), 4), cdiv(M, 16)), 4,
        [(0, A), (1, B), (2, C)], [(3, args(M, N, K))], [A, B, C], [C])
    np.testing.assert_array_equal(download(C, np.float32, (M, N)), mm_model(a16.astype(np.float32), b, c0))


def test_coop_load(dev):
    """A cooperative destination loaded from memory, accumulated over a dynamic K, stored."""
    M, N, K = 70, 45, 21
    rng = fresh_rng(5)
    a, a_up = draw(rng, (M, K), "bf16")
    b, b_up = draw(rng, (K, N), "f16")
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    A, B, Cin, D = upload(dev, a_up), upload(dev, b_up), upload(dev, c0), dev.buffer(M * N * 4)
    run(dev, "st_tensor_coop_load", (cdiv(N, 32), cdiv(M, 64)), 128,
        [(0, A), (1, B), (2, Cin), (3, D)], [(4, args(M, N, K))], [A, B, Cin], [D])
    np.testing.assert_array_equal(download(D, np.float32, (M, N)), mm_model(a, b, c0))


def _as(x, kind):
    """float32 x rounded to `kind` (f32, f16, bf16), as float32: what a cooperative input of
    that element type holds after the conversion of the kernel's float value."""
    return bf16(x) if kind == "bf16" else x.astype(np.float16).astype(np.float32) if kind == "f16" else x


@pytest.mark.parametrize("variant", ["f32_f32_nn", "f32_f32_tt", "bf16_bf16_nt", "f16_f16_tn", "f32_bf16_nt"])
def test_coop_inputs(any_layout, variant):
    """Both operands in cooperative input tensors filled from device memory through
    get_multidimensional_index (transposed or not), K in steps of k = 32 on
    execution_simdgroup, zeros past the edges; the conversion to the element type happens
    as each slot is written."""
    dev = any_layout
    tl, tr, _ = variant.split("_")
    M, N, K, lda = 37, 45, 70, 73
    rng = fresh_rng(8, len(variant), ord(variant[-2]), ord(variant[-1]))
    a = rng.standard_normal((M, lda)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    A, B, C = upload(dev, a), upload(dev, b), dev.buffer(M * N * 4)
    run(dev, f"st_tensor_coop_inputs_{variant}", (cdiv(N, 32), cdiv(M, 32)), 64,
        [(0, A), (1, B), (2, C)], [(3, args(M, N, K, lda)), (4, constant(0))], [A, B], [C])
    kp = cdiv(K, 32) * 32  # the K steps, zero-padded
    ap, bp = np.zeros((M, kp), np.float32), np.zeros((kp, N), np.float32)
    ap[:, :K], bp[:K] = _as(a[:, :K], tl), _as(b, tr)
    np.testing.assert_array_equal(download(C, np.float32, (M, N)), mm_model(ap, bp))


def test_coop_input_slot_left_unfilled_is_poison(fwd):
    """A slot of a cooperative input the kernel never writes holds poison (NaN), which
    reaches the products that use it: a kernel must fill every valid slot."""
    M, N, K = 16, 32, 32
    A, B = upload(fwd, np.ones((M, K), np.float32)), upload(fwd, np.ones((K, N), np.float32))
    C = fwd.buffer(M * N * 4)
    run(fwd, "st_tensor_coop_inputs_f32_f32_nn", (1, 1), 64, [(0, A), (1, B), (2, C)],
        [(3, args(M, N, K)), (4, constant(1))], [A, B], [C])
    c = download(C, np.float32, (M, N))
    assert np.isnan(c).any() and not np.isnan(c).all() and (c[~np.isnan(c)] == K).all()


def test_coop_left_input_with_a_threadgroup_right_operand(dev):
    """The prefill GEMMs' form: a bfloat left input filled from device memory times a
    bfloat threadgroup tensor (transpose_right), execution_simdgroups<4>, two k = 32 steps."""
    M, N, K, lda = 100, 27, 64, 70
    rng = fresh_rng(9)
    a = rng.standard_normal((M, lda)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    A, W, C = upload(dev, a), upload(dev, w), dev.buffer(M * N * 4)
    run(dev, "st_tensor_coop_left_tg", (1, cdiv(M, 64)), 128, [(0, A), (1, W), (2, C)], [(3, args(M, N, K, lda))],
        [A, W], [C])
    np.testing.assert_array_equal(download(C, np.float32, (M, N)), mm_model(bf16(a[:, :K]), bf16(w).T))


# ------------------------------------------------------------------------------ layouts

def sim_layout(role, ext0, ext1, T, t, slot):
    """tensor_ops.h's adversarial layout: (i0, i1) of a valid slot, else None."""
    e = slot * T + (t if role == 0 else T - 1 - t)  # inputs: the threads in reverse
    if e >= ext0 * ext1:
        return None
    return e // ext1, e % ext1


def nax_layout(rows, cols, t, slot, k_major):
    """The M5's fragment layout (the spec in tensor_ops.h, written out independently):
    (column, row) of a valid slot, else None."""
    if slot >= rows * cols // 32:
        return None
    frag, e = divmod(slot, 8)
    if k_major:  # a transposed right input: fragments numbered along k (its columns) first
        fc, fr = divmod(frag, rows // 16)
    else:
        fr, fc = divmod(frag, cols // 16)
    fm = (4 if t & 16 else 0) + (2 if t & 4 else 0) + (1 if t & 2 else 0)
    fn = 4 * ((2 if t & 8 else 0) + (1 if t & 1 else 0))
    return 16 * fc + fn + e % 4, 16 * fr + fm + (e // 4) * 8


def dump_layout(dev, kernel, T):
    out = dev.buffer(3 * T * 64 * 3 * 4)
    run(dev, kernel, (1, 1), T, [(0, out)], [], [], [out])
    return download(out, np.int32, (3, T, 64, 3))


@pytest.mark.parametrize("tensor_layout", ["sim", "nax"])
@pytest.mark.parametrize("trans", ["nn", "nt", "tn", "tt"])
def test_cooperative_tensor_layouts(tensor_layout, trans):
    """Every slot of every lane of an execution_simdgroup destination (16 x 32), left input
    (16 x 32, k = 32) and right input (32 x 32), transposed or not, reports exactly the
    coordinates of the device's layout, and get_capacity() does not depend on it (one
    invalid slot beyond R * C / 32 in both). nax: rows = extent 1, columns = extent 0; the
    right input's fragments k-major also when transposed (MLX's numbering)."""
    dev = sim_device(gpu_family="apple10", tensor_layout=tensor_layout)
    got = dump_layout(dev, f"st_tensor_layout_sg_{trans}", 32)
    tl, tr = trans[0] == "t", trans[1] == "t"
    m, n, k = 16, 32, 32
    exts = [(n, m), (m, k) if tl else (k, m), (k, n) if tr else (n, k)]  # (extent 0, extent 1) per role
    for role, (e0, e1) in enumerate(exts):
        cap = e0 * e1 // 32 + 1
        for t in range(32):
            for slot in range(64):
                want = (sim_layout(role, e0, e1, 32, t, slot) if tensor_layout == "sim"
                        else nax_layout(e1, e0, t, slot, role == 2 and tr))
                row = got[role, t, slot].tolist()
                if slot >= cap:
                    assert row == [-1, -1, -1], (role, t, slot)
                else:
                    assert row == ([1, *want] if want else [0, 0, 0]), (role, t, slot, row, want)
    if tensor_layout == "nax":
        # spot values straight from the hardware's description: lane 0 holds (0, 0) and
        # (0, 8); lane 1 column 4; lane 2 row 1; lane 8 column 8; lane 16 row 4
        d = got[0]
        assert d[0, 0].tolist() == [1, 0, 0] and d[0, 4].tolist() == [1, 0, 8]
        assert d[1, 0, 1:].tolist() == [4, 0] and d[2, 0, 1:].tolist() == [0, 1]
        assert d[8, 0, 1:].tolist() == [8, 0] and d[16, 0, 1:].tolist() == [0, 4]
        assert d[0, 8, 1:].tolist() == [16, 0]  # fragment 1: the next 16 columns


def test_nax_layout_only_on_execution_simdgroup():
    """tensor_layout="nax" leaves execution_simdgroups<N> on the simulator's layout."""
    T = 64
    got = [dump_layout(sim_device(gpu_family="apple10", tensor_layout=lay), "st_tensor_layout_sg2_nn", T)
           for lay in ("sim", "nax")]
    np.testing.assert_array_equal(got[0], got[1])
    assert got[0][0, 5, 0].tolist() == [1, *sim_layout(0, 32, 16, T, 5, 0)]


def test_tensor_layout_is_validated():
    assert sim_device().gpu_family == "apple9"  # the default layout: "sim" (the tests above)
    with pytest.raises(ValueError, match=r"tensor_layout must be 'sim' or 'nax', not 'mlx'"):
        sim_device(gpu_family="apple10", tensor_layout="mlx")
    sim_device(tensor_layout="nax")  # accepted on any family; only apple10 runs tensor ops


# ------------------------------------------------------------------------------ misuse

def dispatch_error(dev, kernel, groups, tg, buffers, cst=(), threadgroups=True):
    cb = dev.command_buffer()
    cb.compute_pass().dispatch(kernel, groups, tg, buffers=buffers, constants=list(cst), threadgroups=threadgroups)
    cb.commit()
    with pytest.raises(RuntimeError) as e:
        cb.wait()
    return str(e.value)


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_missing_barrier_before_run_is_reported(order):
    dev = sim_device(gpu_family="apple10", thread_order=order, seed=5)
    x = fresh_rng(7).standard_normal(32 * 32).astype(np.float32)
    X, C = upload(dev, x), upload(dev, np.zeros(32 * 32, np.float32))  # mode multiply: a zeroed C
    msg = dispatch_error(dev, "st_tensor_race", 1, 64, [(0, X), (1, C)], [(2, constant(0))])
    assert "operand changed" in msg and "missing threadgroup_barrier" in msg
    run(dev, "st_tensor_race", 1, 64, [(0, X), (1, C)], [(2, constant(1))], [X], [C])
    t = x.reshape(32, 32)
    np.testing.assert_array_equal(download(C, np.float32, (32, 32)), mm_model(t, t.T))


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_divergent_tensor_operations_are_reported(order):
    dev = sim_device(gpu_family="apple10", thread_order=order)
    x = fresh_rng(8).standard_normal(64 * 32).astype(np.float32)
    X, C = upload(dev, x), upload(dev, np.zeros(32 * 32, np.float32))  # mode multiply: a zeroed C
    msg = dispatch_error(dev, "st_tensor_divergent", 1, 64, [(0, X), (1, C)], [(2, constant(0))])
    assert re.search(r"returned while .* wait in matmul2d::run|matmul2d::run reached after .* returned", msg), msg
    msg = dispatch_error(dev, "st_tensor_divergent", 1, 64, [(0, X), (1, C)], [(2, constant(1))])
    assert "divergent tensor operations" in msg
    run(dev, "st_tensor_divergent", 1, 64, [(0, X), (1, C)], [(2, constant(2))], [X], [C])
    r = x.reshape(64, 32)[:32]
    np.testing.assert_array_equal(download(C, np.float32, (32, 32)), mm_model(r, r.T))


def test_scope_geometry_is_checked(fwd):
    M = N = K = 32
    A, B, C = upload(fwd, np.ones((M, K), np.float32)), upload(fwd, np.ones((K, N), np.float32)), fwd.buffer(M * N * 4)
    bufs = [(0, A), (1, B), (2, C)]
    msg = dispatch_error(fwd, "st_tensor_mm_device_f32_f32", 1, 64, bufs, [(3, args(M, N, K))])
    assert "execution_simdgroups<4> runs on 4 simdgroups" in msg and "64 threads" in msg
    # a partial edge threadgroup of a dispatchThreads grid: the scope is incomplete
    msg = dispatch_error(fwd, "st_tensor_mm_device_f32_f32", (32 * 2, 1), (32, 4), bufs, [(3, args(M, N, K))],
                         threadgroups=False)
    assert "execution_simdgroups<4>" in msg
    # execution_simdgroup needs full simdgroups
    W = upload(fwd, np.ones((N, K), np.float16))
    msg = dispatch_error(fwd, "st_tensor_mm_simdgroup", 1, 48, [(0, A), (1, W), (2, C)], [(3, args(M, N, K))])
    assert "execution_simdgroup needs full simdgroups" in msg


# ------------------------------------------------------------------------------ outside the subset

PRELUDE = ("#include <metal_stdlib>\n#include <metal_tensor>\n"
           "#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>\n"
           "using namespace metal;\nusing namespace mpp::tensor_ops;\n"
           "using D2 = dextents<int32_t, 2>;\n")
KERNEL = ("kernel void f(device half* h [[buffer(0)]], device float* x [[buffer(1)]], device float* y [[buffer(2)]]) {{\n"
          "  auto H = tensor<device half, D2, tensor_inline>(h, D2(64, 64));\n"
          "  auto X = tensor<device float, D2, tensor_inline>(x, D2(64, 64));\n"
          "  auto Y = tensor<device float, D2, tensor_inline>(y, D2(64, 64));\n"
          "  {body}\n}}\n")
OK_OP = "matmul2d<matmul2d_descriptor(32, 32), execution_simdgroups<1>> op;"


@pytest.mark.parametrize("body,needle", [
    ("matmul2d<matmul2d_descriptor(32, 32, 16), execution_simdgroup> op; op.run(H, H, X);", "multiple of 32"),
    ("matmul2d<matmul2d_descriptor(32, 32, 0), execution_simdgroup> op; op.run(H, H, X);", "k = 0 does not mean"),
    ("matmul2d<matmul2d_descriptor(8, 32), execution_simdgroup> op; op.run(H, H, X);", "multiples of 16"),
    ("matmul2d<matmul2d_descriptor(32, 32, 64, false, false, true), execution_simdgroup> op; op.run(H, H, X);",
     "relaxed_precision"),
    ("matmul2d<matmul2d_descriptor(32, 32), int> op; op.run(H, H, X);", "the scope must be"),
    (OK_OP + " auto T = tensor<device half, D2, tensor_inline>(h, D2(64, 64)); op.run(H, H, T);",
     "destination's element type must be float"),
    (OK_OP + " auto c = op.get_destination_cooperative_tensor<decltype(H), decltype(H), half>();",
     "destination element type must be float"),
    (OK_OP + " auto c = op.get_left_input_cooperative_tensor<half, half, float>();", "need an explicit k"),
    ("matmul2d<matmul2d_descriptor(32, 32, 32), execution_simdgroup> op; "
     "auto a = op.get_left_input_cooperative_tensor<half, half, float>(); a.load(H);",
     "load / store of a cooperative input"),
    ("matmul2d<matmul2d_descriptor(32, 32, 32), execution_simdgroup> op; "
     "auto a = op.get_left_input_cooperative_tensor<half, half, float>(); "
     "auto b = op.get_right_input_cooperative_tensor<half, half, float>(); op.run(b, a, X);",
     "cooperative left / right inputs"),
    ("matmul2d<matmul2d_descriptor(32, 32, 32), execution_simdgroup> op; "
     "matmul2d<matmul2d_descriptor(32, 32, 64), execution_simdgroup> op2; "
     "auto a = op2.get_left_input_cooperative_tensor<half, half, float>(); op.run(a, H, X);",
     "cooperative left / right inputs"),
    (OK_OP + " auto c = op.get_destination_cooperative_tensor<decltype(H), decltype(H), float>(); "
     "matmul2d<matmul2d_descriptor(32, 64), execution_simdgroups<1>> op2; op2.run(H, H, c);",
     "made by an operation with another descriptor"),
    (OK_OP + " auto c = op.get_destination_cooperative_tensor<decltype(H), decltype(H), float>(); op.run(X, H, c);",
     "another descriptor, scope or operand element types"),
    (OK_OP + " auto c = op.get_destination_cooperative_tensor<decltype(H), decltype(H), float>(); "
     "auto hT = tensor<device half, D2, tensor_inline>(h, D2(64, 64)); c.store(hT);", "same element type"),
    (OK_OP + " op.run(H.slice(0, 0), H, X);", "cannot bind non-const lvalue reference"),
    ("auto t = tensor<device half, D2>(h, D2(64, 64));", "tensor_inline tensors only"),
    ("auto t = tensor<device char, D2, tensor_inline>((device char*)h, D2(64, 64));", "element type must be float, half"),
    ("device const half* ch = h; auto t = tensor<device half, D2, tensor_inline>(ch, D2(64, 64));",
     "invalid conversion|no matching"),
    ("auto t = tensor<device float, dextents<int32_t, 3>, tensor_inline>(x, dextents<int32_t, 3>(2, 2, 2));",
     "rank-2"),
    ("auto t = tensor<device float, dextents<uint, 2>, tensor_inline>(x, dextents<uint, 2>(2, 2));",
     "index type int"),
    ("float v = X[1, 2];", "no match for .operator\\[\\]"),
    ("auto d = matmul2d_descriptor(32, 32, dynamic_length_v<int>);", "dynamic_length_v"),
    (OK_OP + " auto c = op.get_destination_cooperative_tensor<decltype(H), decltype(H), float>(); reduce_rows(c, c);",
     "reduce_rows"),
])
def test_outside_the_subset_does_not_compile(tmp_path, body, needle):
    if CXX is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "k_tensor.metal"
    src.write_text(PRELUDE + KERNEL.format(body=body))
    r = subprocess.run([sys.executable, str(MSL2CPP), str(tmp_path / "o"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    c = subprocess.run([CXX, "-std=c++20", "-fsyntax-only", "-Wno-unknown-pragmas",
                        "-I", str(ROOT / "csrc"), "-I", str(ROOT / "csrc" / "gpu" / "sim" / "msl"),
                        "-x", "c++", str(tmp_path / "o" / "k_tensor.metal.cpp")], capture_output=True, text=True,
                       env={**os.environ, "LC_ALL": "C"})
    assert c.returncode != 0, "compiled, but it is outside the subset"
    assert re.search(needle, c.stderr), c.stderr[-3000:]


def test_convolution_header_is_rejected(tmp_path):
    src = tmp_path / "k_tensor.metal"
    src.write_text("#include <MetalPerformancePrimitives/MPPTensorOpsConvolution2d.h>\n")
    r = subprocess.run([sys.executable, str(MSL2CPP), str(tmp_path / "o"), str(src)], capture_output=True, text=True)
    assert r.returncode == 1 and "k_tensor.metal:1: error: <MetalPerformancePrimitives/MPPTensorOpsConvolution2d.h>" \
        " is not supported" in r.stderr
