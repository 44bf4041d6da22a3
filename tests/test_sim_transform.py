"""The MSL -> C++ source transform (csrc/gpu/sim/msl2cpp.py): unsupported constructs are
build errors with a file:line, never silently mis-simulated."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
    assert "tg_var<T [32]>" in text
    body = text.split("#line 1", 1)[1].split("\n", 1)[1]
    assert body.count("\n") >= (HEADER.count("\n") + 9)  # one output line per source line


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
