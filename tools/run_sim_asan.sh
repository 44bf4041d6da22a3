#!/usr/bin/env bash
# Builds lily._core with AddressSanitizer and the alignment sanitizer (CMake option
# LILY_SANITIZE=address,alignment: a misaligned vector access is reported) and runs the
# simulator and kernel tests (tests/sim/*.py tests/kernels/*.py, or the files in
# $LILY_ASAN_TESTS) against it.
#
#   tools/run_sim_asan.sh [BUILD_DIR] [-- extra pytest args]
#
# Needs cmake, ninja (or make), a C++17 compiler with ASan and the Python environment
# that has nanobind, numpy and pytest (PYTHON, default: python3).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${1:-$ROOT/build/asan}"
shift || true
[[ "${1:-}" == "--" ]] && shift
PYTHON="${PYTHON:-python3}"
GEN=()
command -v ninja > /dev/null && GEN=(-G Ninja)

cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DLILY_SANITIZE=address,alignment -DPython_EXECUTABLE="$(command -v "$PYTHON")" \
  -DSKBUILD_PROJECT_VERSION=0.0.0+asan > "$BUILD.configure.log" 2>&1 \
  || { cat "$BUILD.configure.log"; exit 1; }
cmake --build "$BUILD" --parallel 2

# Stage a package: the Python sources plus the instrumented extension.
STAGE="$BUILD/stage"
rm -rf "$STAGE" && mkdir -p "$STAGE"
cp -r "$ROOT/src/lily" "$STAGE/lily"
# An extension already in src/lily (a developer's build, or a link to an installed one) is
# removed first: copying over a link would overwrite the installed extension it points to.
rm -f "$STAGE"/lily/_core*.so
cp "$BUILD"/_core*.so "$STAGE/lily/"

# The interpreter is not instrumented: preload the ASan runtime. Leak checking is off
# (CPython's own allocations would be reported).
CXX_BIN="$(grep -m1 '^CMAKE_CXX_COMPILER:' "$BUILD/CMakeCache.txt" | cut -d= -f2)"
ASAN_LIB="$("$CXX_BIN" -print-file-name=libasan.so 2>/dev/null || true)"
if [[ ! -f "$ASAN_LIB" ]]; then
  ASAN_LIB="$("$CXX_BIN" -print-file-name=libclang_rt.asan-x86_64.so 2>/dev/null || true)"
fi
[[ -f "$ASAN_LIB" ]] || { echo "cannot find the ASan runtime for $CXX_BIN" >&2; exit 1; }
# libstdc++ must be loaded when ASan starts, or its __cxa_throw interceptor cannot bind.
PRELOAD="$ASAN_LIB"
STDCXX="$("$CXX_BIN" -print-file-name=libstdc++.so 2>/dev/null || true)"
[[ -f "$STDCXX" ]] && PRELOAD="$PRELOAD:$STDCXX"

cd "$ROOT"
shopt -s nullglob
if [[ -n "${LILY_ASAN_TESTS:-}" ]]; then
  read -r -a TESTS <<< "$LILY_ASAN_TESTS"
else
  TESTS=(tests/sim/test_*.py tests/kernels/test_*.py)
fi
LILY_IN_ASAN=1 LD_PRELOAD="$PRELOAD" ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=0" \
  PYTHONPATH="$STAGE" "$PYTHON" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
