"""The MSL -> C++ source transform (csrc/gpu/sim/msl2cpp.py): unsupported constructs are
build errors with a file:line, never silently mis-simulated."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MSL2CPP = ROOT / "csrc" / "gpu" / "sim" / "msl2cpp.py"
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

pytestmark = pytest.mark.skipif(not MSL2CPP.exists(), reason="needs the source tree")

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"


def transform(tmp_path, source, name="k.metal"):
    src = tmp_path / name
    src.write_text(HEADER + source)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(MSL2CPP), str(out), str(src)], capture_output=True, text=True)
    return r, out / (src.stem + ".metal.cpp")


def compile_cpp(path):
    return subprocess.run(
        [CXX, "-std=c++17", "-fsyntax-only", "-Werror=attributes" if "clang" not in CXX else "-Werror=unknown-attributes",
         "-I", str(ROOT / "csrc"), "-I", str(ROOT / "csrc" / "gpu" / "sim" / "msl"), "-I", str(path.parent),
         "-x", "c++", str(path)],
        capture_output=True, text=True)


@pytest.mark.parametrize("source,message", [
    ("kernel void f(device float* x [[buffer(0)]], float4 p [[stage_in]]) {}",
     r"k.metal:3: error: unsupported kernel parameter attribute \[\[stage_in\]\]"),
    ("kernel void f(device float* x [[buffer(0)]], uint i) {}",
     r"k.metal:3: error: kernel 'f': every parameter needs an attribute"),
    ("kernel void f(device float* x [[buffer(0)]]) {\n  threadgroup float t[4] = {0};\n}",
     r"k.metal:4: error: threadgroup variables cannot have initializers"),
    ("template <typename T> kernel void f(device T* x [[buffer(0)]]) {}\n"
     "template [[kernel]] decltype(f<float>) f<float>;",
     r"k.metal:4: error: kernel instantiation without \[\[host_name"),
    # Apple's compiler rejects grid-position attributes of different component counts
    ("kernel void f(device float* x [[buffer(0)]], uint2 tg [[threadgroup_position_in_grid]],\n"
     "              uint n [[threads_per_threadgroup]]) {}",
     r"k.metal:4: error: kernel 'f': \[\[threads_per_threadgroup\]\] 'uint n' has 1 component\(s\) but "
     r"\[\[threadgroup_position_in_grid\]\] 'uint2 tg' has 2"),
    ("kernel void f(device float* x [[buffer(0)]], float p [[thread_position_in_grid]]) {}",
     r"k.metal:3: error: kernel 'f': \[\[thread_position_in_grid\]\] needs a uint or ushort"),
    ("[[max_total_threads_per_threadgroup(64)]] void f(device float* x [[buffer(0)]]) {}",
     r"k.metal:3: error: \[\[max_total_threads_per_threadgroup\]\] must precede `kernel`"),
])
def test_transform_rejects_unsupported(tmp_path, source, message):
    r, _ = transform(tmp_path, source)
    assert r.returncode == 1
    assert __import__("re").search(message, r.stderr), r.stderr


def test_transform_preserves_lines_and_registers(tmp_path):
    r, out = transform(tmp_path, (
        "template <typename T>\n"
        "kernel void scale(device T* x [[buffer(0)]],\n"
        "                  constant float& s [[buffer(1)]],\n"
        "                  uint i [[thread_position_in_grid]]) {\n"
        "  threadgroup T tile[32];\n"
        "  tile[i % 32] = x[i];\n"
        "  x[i] = T(float(tile[i % 32]) * s);\n"
        "}\n"
        "template [[host_name(\"scale_f32\")]] [[kernel]] decltype(scale<float>) scale<float>;\n"))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert 'Registrar<decltype(scale<float>)>' in text and '"scale_f32"' in text
    assert "using __lily_tgt_0 = T [ 32 ];" in text and "tg_var<__lily_tgt_0>" in text
    body = text.split("#line 1", 1)[1].split("\n", 1)[1]
    assert body.count("\n") >= (HEADER.count("\n") + 9)  # one output line per source line


def test_thread_limit_attribute_before_kernel_is_recorded(tmp_path):
    """`[[max_total_threads_per_threadgroup(N)]] kernel void f` (the spelling the shipped
    kernels use, also with a template header) becomes the registered limit, and mixed
    scalar/vector grid attributes of matching counts pass."""
    r, out = transform(tmp_path, (
        "template <typename T>\n"
        "[[max_total_threads_per_threadgroup(96)]] kernel void g(device T* x [[buffer(0)]],\n"
        "    uint2 tg [[threadgroup_position_in_grid]], uint2 n [[threads_per_threadgroup]],\n"
        "    uint i [[thread_index_in_threadgroup]]) {}\n"
        "template [[host_name(\"g_f32\")]] [[kernel]] decltype(g<float>) g<float>;\n"))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "__lily_maxtg_g = 96;" in text and "max_total_threads" not in text.split("#line 1", 1)[1]


# ---- threadgroup declarations: storage, pointers, or a build error; never a silent guess

TG_KERNEL = (
    "constant constexpr uint DK = 8;\n"
    "template <typename T, uint DV>\n"
    "kernel void f(device float* x [[buffer(0)]], threadgroup float* dyn [[threadgroup(0)]],\n"
    "              uint i [[thread_position_in_grid]]) {{\n"
    "{body}\n"
    "}}\n"
    "template [[host_name(\"f\")]] [[kernel]] decltype(f<float, 16>) f<float, 16>;\n")


@pytest.mark.parametrize("decl,name,type_", [
    ("threadgroup float act[2 * DK + DV];", "act", "float [ 2 * DK + DV ]"),          # the regression
    ("threadgroup T tile[(DK + 4) * 2][DV / 2];", "tile", "T [ ( DK + 4 ) * 2 ] [ DV / 2 ]"),
    ("threadgroup float s[sizeof(float4) / sizeof(float)];", "s", "float [ sizeof ( float4 ) / sizeof ( float ) ]"),
    ("threadgroup float m[DK > DV ? DK : DV];", "m", "float [ DK > DV ? DK : DV ]"),
    ("threadgroup vec<float, 4> v[DK & 12];", "v", "vec < float , 4 > [ DK & 12 ]"),
    ("threadgroup metal::atomic_uint counter;", "counter", "metal :: atomic_uint"),
    ("threadgroup unsigned int u[DK*DV];", "u", "unsigned int [ DK * DV ]"),
    ("threadgroup\n  float split[\n  DK * 2];", "split", "float [ DK * 2 ]"),
])
def test_threadgroup_storage_with_any_constant_size(tmp_path, decl, name, type_):
    r, out = transform(tmp_path, TG_KERNEL.format(body="  " + decl + f"\n  (void){name};"))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert f"using __lily_tgt_0 = {type_};" in text, text
    assert f"auto& {name} = ::lily::sim::tg_var<__lily_tgt_0>" in text
    code = __import__("re").sub(r'"[^"\n]*"', '""', text.split("#line 1", 1)[1])  # not in messages
    assert "threadgroup " not in code
    if CXX:
        c = compile_cpp(out)
        assert c.returncode == 0, c.stderr[-3000:]


@pytest.mark.parametrize("decl,kept", [
    ("threadgroup float* p = dyn + 2 * DK;", "float* p = dyn + 2 * DK;"),
    ("threadgroup float *p = dyn, *q = dyn + 1;", "float *p = dyn, *q = dyn + 1;"),
    ("const threadgroup float* p = (const threadgroup float*)dyn;", "const  float* p = (const  float*)dyn;"),
    ("threadgroup float (*rows)[4] = reinterpret_cast<threadgroup float (*)[4]>(dyn);",
     "float (*rows)[4] = reinterpret_cast< float (*)[4]>(dyn);"),
    ("threadgroup float& r = dyn[DK * 2];", "float& r = dyn[DK * 2];"),
    ("x[i] = sizeof(threadgroup float) + static_cast<threadgroup float*>(dyn)[0];",
     "x[i] = sizeof( float) + static_cast< float*>(dyn)[0];"),
])
def test_threadgroup_pointers_stay_pointers(tmp_path, decl, kept):
    r, out = transform(tmp_path, TG_KERNEL.format(body="  " + decl))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert kept in text and "tg_var" not in text, text
    if CXX:
        c = compile_cpp(out)
        assert c.returncode == 0, c.stderr[-3000:]


def test_threadgroup_in_helper_functions_and_structs(tmp_path):
    r, out = transform(tmp_path, (
        "struct Tiles { threadgroup float* a; uint n; };\n"
        "static inline void h(threadgroup float* a, threadgroup float b[4], const threadgroup float4* c) {}\n"
        "threadgroup float* pick(threadgroup float* a, uint i) { uint q, w; return a + i; }\n"
        "kernel void f(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
        "  threadgroup float t[4 * 8];\n"
        "  if (i == 0) { threadgroup float inner[2 + 2]; inner[0] = 1.0f; }\n"
        "  x[i] = pick(t, 1)[0];\n"
        "}\n"))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert text.count("tg_var<") == 2 and "float* pick( float* a, uint i)" in text
    if CXX:
        c = compile_cpp(out)
        assert c.returncode == 0, c.stderr[-3000:]


@pytest.mark.parametrize("source,message", [
    ("kernel void f(device float* x [[buffer(0)]]) {\n  threadgroup float a[4], b[2 * 4];\n}",
     r"k.metal:4: error: declare one threadgroup variable per statement"),
    ("kernel void f(device float* x [[buffer(0)]]) {\n  threadgroup float *a, b[2 * 4];\n}",
     r"k.metal:4: error: declare one threadgroup variable per statement"),
    ("kernel void f(device float* x [[buffer(0)]]) {\n  const threadgroup float a[2 * 4];\n}",
     r"k.metal:4: error: cannot classify the threadgroup declaration of 'a'"),
    ("kernel void f(device float* x [[buffer(0)]]) {\n  static threadgroup float a[4];\n}",
     r"k.metal:4: error: cannot classify the threadgroup declaration of 'a'"),
    ("kernel void f(device float* x [[buffer(0)]]) {\n  threadgroup float a[4] b;\n}",
     r"k.metal:4: error: cannot classify the threadgroup declaration of 'a'"),
    ("kernel void f(device float* x [[buffer(0)]]) {\n  threadgroup float a[];\n}",
     r"k.metal:4: error: threadgroup variable 'a' needs an array size"),
    ("kernel void f(device float* x [[buffer(0)]]) {\n  threadgroup 4;\n}",
     r"k.metal:4: error: cannot parse the type after 'threadgroup'"),
    ("threadgroup float g[2 * 4];", r"k.metal:3: error: threadgroup variable 'g' declared outside a function body"),
    ("struct S { threadgroup float g[4]; };", r"k.metal:3: error: threadgroup variable 'g' declared outside"),
    ("#define TILE threadgroup float tile[2 * 4]\n", r"k.metal:3: error: 'threadgroup' inside a macro"),
])
def test_unclassifiable_threadgroup_is_a_build_error(tmp_path, source, message):
    r, _ = transform(tmp_path, source)
    assert r.returncode == 1
    assert __import__("re").search(message, r.stderr), r.stderr


DRIVER = r"""
#include <cstdio>
#include <vector>
#include "gpu/sim/executor.h"
int main() {
  using namespace lily::sim;
  const KernelInfo* k = nullptr;
  for (const KernelInfo& ki : registered_kernels()) if (ki.name == "tg_expr") k = &ki;
  if (!k || !k->error.empty()) { std::puts("no kernel"); return 2; }
  const uint32_t n = 32;
  std::vector<float> out(n, -1.0f);
  Executor ex(1);
  for (int order = 0; order < 3; ++order) {
    ExecDispatch d;
    d.kernel = k; d.label = "tg_expr"; d.thread_order = order; d.seed = 7;
    d.threadgroups = U3{1, 1, 1}; d.threadgroup_size = U3{n, 1, 1}; d.threads_per_grid = U3{n, 1, 1};
    d.buffers[0].ptr = reinterpret_cast<unsigned char*>(out.data());
    d.buffers[0].available = out.size() * sizeof(float);
    d.buffers[0].bound = true;
    ex.run(&d, 1);
    for (float v : out) std::printf("%g ", v);
    std::printf("\n");
  }
  return 0;
}
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.timeout(300)
def test_threadgroup_size_expression_is_shared_when_run(tmp_path):
    """The regression end to end: `threadgroup float act[2 * DK + DV];` used to become a
    per-thread array (the '*' read as a pointer declarator) and every thread read garbage."""
    r, out = transform(tmp_path, (
        "constant constexpr uint DK = 8;\n"
        "template <uint DV>\n"
        "kernel void tg_expr(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],\n"
        "                    uint n [[threads_per_threadgroup]]) {\n"
        "  threadgroup float act[2 * DK + DV];\n"
        "  threadgroup float scaled[(DK + DV) * sizeof(float) / 4];\n"
        "  for (uint i = tid; i < 2 * DK + DV; i += n) act[i] = float(i);\n"
        "  if (tid < DK + DV) scaled[tid] = 10.0f * float(tid);\n"
        "  threadgroup_barrier(mem_flags::mem_threadgroup);\n"
        "  out[tid] = act[(tid + 1) % (2 * DK + DV)] + scaled[(tid + 3) % (DK + DV)];\n"
        "}\n"
        "template [[host_name(\"tg_expr\")]] [[kernel]] decltype(tg_expr<16>) tg_expr<16>;\n"))
    assert r.returncode == 0, r.stderr
    main = tmp_path / "main.cpp"
    main.write_text(DRIVER)
    exe = tmp_path / "run"
    c = subprocess.run([CXX, "-std=c++17", "-O1", "-I", str(ROOT / "csrc"), "-I", str(ROOT / "csrc" / "gpu" / "sim" / "msl"),
                        "-I", str(out.parent), str(out), str(ROOT / "csrc" / "gpu" / "sim" / "executor.cpp"),
                        str(ROOT / "csrc" / "gpu" / "sim" / "fibers.cpp"), str(main),
                        "-o", str(exe), "-pthread"], capture_output=True, text=True, timeout=280)
    assert c.returncode == 0, c.stderr[-3000:]
    env = {k: v for k, v in __import__("os").environ.items() if k != "LD_PRELOAD"}  # not instrumented
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    t = __import__("numpy").arange(32)
    want = ((t + 1) % 32) + 10 * ((t + 3) % 24)
    for line in res.stdout.strip().splitlines():  # forward, reverse and random thread order
        assert [float(v) for v in line.split()] == want.tolist()


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("body,needle", [
    ("  x[i] = quad_all(x[i] > 0.0f) ? 1.0f : 0.0f;", "quad_all"),      # not in the shim
    ("  float2x2 m = float2x2(1.0f);\n  x[i] = m[0][0];", "float2x2"),   # matrix types
    ("  simdgroup_float8x8 m;\n  x[i] = m.thread_elements()[0];", "thread_elements"),
])
def test_unsupported_construct_is_a_compile_error(tmp_path, body, needle):
    r, out = transform(tmp_path, (
        "kernel void f(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
        f"{body}\n}}\n"))
    assert r.returncode == 0, r.stderr
    c = compile_cpp(out)
    assert c.returncode != 0
    assert needle in c.stderr and "k.metal" in c.stderr  # the error points at the .metal source


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_unknown_attribute_is_a_compile_error(tmp_path):
    r, out = transform(tmp_path, (
        "struct V { float4 p [[position]]; };\n"
        "kernel void f(device float* x [[buffer(0)]]) { x[0] = 1.0f; }\n"))
    assert r.returncode == 0, r.stderr
    c = compile_cpp(out)
    assert c.returncode != 0 and "position" in c.stderr


# ---- strict checks: what Apple's compiler rejects is rejected here too (docs/device-layer.md,
# "Strictness"). Each rule has a kernel that must fail; the shipped kernels must pass.

K = "kernel void f({params}) {{\n{body}\n}}\n"


@pytest.mark.parametrize("source,message", [
    # address spaces of kernel parameters
    (K.format(params="float* x [[buffer(0)]]", body=""),
     r"k.metal:3: error: kernel 'f': parameter 'float\* x' \[\[buffer\(n\)\]\] must be a device or constant pointer"),
    (K.format(params="threadgroup float* x [[buffer(0)]]", body=""), r"must be a device or constant pointer"),
    (K.format(params="device float x [[buffer(0)]]", body=""), r"must be a device or constant pointer"),
    (K.format(params="device float* x [[threadgroup(0)]]", body=""), r"\[\[threadgroup\(n\)\]\] must be a threadgroup pointer"),
    # attribute types
    (K.format(params="device float* x [[buffer(0)]], uint2 i [[thread_index_in_simdgroup]]", body=""),
     r"\[\[thread_index_in_simdgroup\]\] must be uint or ushort"),
    (K.format(params="device float* x [[buffer(0)]], device uint* i [[thread_position_in_grid]]", body=""),
     r"must be a plain uint or ushort"),
    # pointers and references without an address space outside kernels
    ("inline float get(const float* p) { return p[0]; }\n", r"k.metal:3: error: parameter 'const float\* p' is a "
     r"pointer or reference without an address space"),
    ("inline void put(float& r) { r = 1.0f; }\n", r"parameter 'float& r' is a pointer or reference without"),
    (K.format(params="device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]",
              body="  const float* p = x + i;\n  x[i] = p[0];"),
     r"k.metal:4: error: pointer 'p' declared without an address space"),
    (K.format(params="device float4* x [[buffer(0)]]", body="  for (float4 *p = x; p != x + 4; ++p) {}"),
     r"pointer 'p' declared without an address space"),
    # threadgroup storage belongs to kernels
    ("inline float h(uint i) {\n  threadgroup float t[32];\n  return t[i];\n}\n",
     r"k.metal:4: error: threadgroup variable 't' declared outside a kernel function"),
    # float atomics: device memory only
    (K.format(params="device float* x [[buffer(0)]]", body="  threadgroup atomic_float total;"),
     r"k.metal:4: error: atomic<float> in threadgroup memory"),
    (K.format(params="threadgroup atomic_float* t [[threadgroup(0)]]", body=""), r"atomic<float> in threadgroup memory"),
    # program-scope variables live in the constant address space
    ("template <uint D>\nstruct Lane {\n  static constexpr uint NE = D / 32;\n};\n",
     r"k.metal:5: error: 'static constexpr uint NE' is a program-scope variable outside the constant address space"),
    ("constexpr uint kRows = 64;\n", r"'constexpr uint kRows' is a program-scope variable outside the constant"),
    ("namespace d {\nstatic const float kScale = 0.5f;\n}\n", r"'static const float kScale' is a program-scope"),
])
def test_strict_rules_reject(tmp_path, source, message):
    r, _ = transform(tmp_path, source)
    assert r.returncode == 1, "accepted"
    assert __import__("re").search(message, r.stderr), r.stderr


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("body,needle", [
    ("  half4 h = half4(half(x[i]));\n  h = h * x[i];\n  x[i] = float(h.x);", "narrows"),        # vector op scalar narrowing
    ("  float2 v = float2(1.0f) * 2u;\n  uint2 u = uint2(2u) * 0.5f;\n  x[i] = v.x + float(u.x);", "narrows"),
    ("  x[i] = float(simd_shuffle(x[i] > 0.0f, 1u));", "bool operands"),          # SIMD collectives
    ("  x[i] = float(simd_sum(ulong(i)));", "64-bit operands"),
    ("  half h = half(x[i]);\n  bfloat b = h;\n  x[i] = float(b);", "bfloat"),    # bfloat <-> half
    ("  bfloat b = bfloat(x[i]);\n  half h = b;\n  x[i] = float(h);", "bfloat"),
])
def test_strict_shim_rejects(tmp_path, body, needle):
    r, out = transform(tmp_path, K.format(params="device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]",
                                          body=body))
    assert r.returncode == 0, r.stderr
    c = compile_cpp(out)
    assert c.returncode != 0, "compiled"
    assert needle in c.stderr or "deleted" in c.stderr, c.stderr[-2000:]


def test_shipped_kernels_pass_the_strict_rules(tmp_path):
    """Every shipped .metal file goes through the same rules (the build compiles them with the
    shim's strict overloads too)."""
    files = sorted(str(p) for p in (ROOT / "metal").iterdir() if p.suffix in (".metal", ".h"))
    r = subprocess.run([sys.executable, str(MSL2CPP), str(tmp_path / "out"), *files], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


CHECK_OBJC = ROOT / "tools" / "check_objc.sh"


def test_check_objc_skips_without_sdk():
    r = subprocess.run(["bash", str(CHECK_OBJC)], capture_output=True, text=True,
                       env={k: v for k, v in __import__("os").environ.items() if k != "LILY_MACOS_SDK"})
    assert r.returncode == 0 and "SKIPPED" in r.stdout


@pytest.mark.skipif(not __import__("os").environ.get("LILY_MACOS_SDK") or not shutil.which("clang++"),
                    reason="set LILY_MACOS_SDK to a macOS SDK (and install clang) to type-check the Metal backend")
def test_check_objc_against_sdk():
    r = subprocess.run(["bash", str(CHECK_OBJC), __import__("os").environ["LILY_MACOS_SDK"]],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "check_objc: OK" in r.stdout
