#!/usr/bin/env bash
# Type-checks the Objective-C++ Metal backend (csrc/gpu/metal/*.mm) against real macOS SDK
# headers, without a Mac (docs/verification.md):
#
#   tools/check_objc.sh SDK_PATH
#
# SDK_PATH is a macOS SDK root (…/MacOSX12.sdk, or a checkout of the public
# hexops-graveyard/sdk-macos-12.0 repository's root/ directory; never commit SDK files).
# Uses clang (Debian's clang 14 works: apt-get install -y clang). With no SDK_PATH it
# prints a skip message and exits 0. It also type-checks the simulator and the device
# interface for arm64-apple-macos12, since they are built on macOS too.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SDK="${1:-${LILY_MACOS_SDK:-}}"
if [[ -z "$SDK" ]]; then
  echo "check_objc: SKIPPED (no macOS SDK path given; usage: tools/check_objc.sh SDK_PATH)"
  exit 0
fi
[[ -d "$SDK/root/System" && ! -d "$SDK/System" ]] && SDK="$SDK/root"  # repository layout
if [[ ! -d "$SDK/System/Library/Frameworks/Metal.framework" ]]; then
  echo "check_objc: $SDK does not look like a macOS SDK (no System/Library/Frameworks/Metal.framework)" >&2
  exit 2
fi
CLANG="${CLANG:-}"
if [[ -z "$CLANG" ]]; then
  for c in clang++ clang++-14 clang clang-14; do
    command -v "$c" > /dev/null && { CLANG="$c"; break; }
  done
fi
[[ -n "$CLANG" ]] || { echo "check_objc: clang not found (apt-get install -y clang)" >&2; exit 2; }

PY_INC="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)"
COMMON=(-target arm64-apple-macos12 -isysroot "$SDK" -stdlib=libc++ -std=c++17 -fsyntax-only
        -Wall -Wextra -Wno-unused-parameter -I "$ROOT/csrc" -I "$ROOT/metal")
# CHECK_OBJC_EXTRA: more flags, e.g. -Werror=deprecated-declarations (tools/check_sdk26.py --compile)
read -r -a EXTRA <<< "${CHECK_OBJC_EXTRA:-}"
COMMON+=(${EXTRA[@]+"${EXTRA[@]}"})  # bash 3.2 (macOS) safe with an empty array
status=0
echo "check_objc: $("$CLANG" --version | head -1), SDK $SDK"
for mm in "$ROOT"/csrc/gpu/metal/*.mm; do
  echo "check_objc: $mm"
  "$CLANG" "${COMMON[@]}" -fobjc-arc -x objective-c++ -Werror=unguarded-availability-new \
    -Werror=objc-method-access "$mm" || status=1
done
# Plain C++ that is also compiled on macOS: the device interface, the simulator, the runtime.
for cpp in "$ROOT"/csrc/gpu/device.cpp "$ROOT"/csrc/gpu/sim/executor.cpp "$ROOT"/csrc/gpu/sim/fibers.cpp \
           "$ROOT"/csrc/gpu/sim/sim_device.cpp "$ROOT"/csrc/gpu/sim/tensor_ops.cpp \
           "$ROOT"/csrc/runtime/model.cpp "$ROOT"/csrc/runtime/runtime.cpp "$ROOT"/csrc/runtime/decode.cpp \
           "$ROOT"/csrc/runtime/prefill.cpp; do
  echo "check_objc: $cpp (C++, macOS target)"
  "$CLANG" "${COMMON[@]}" -x c++ "$cpp" || status=1
done
# The shipped kernels as the simulator compiles them (msl2cpp.py + the <metal_stdlib> shim).
GEN="$(mktemp -d)"
trap 'rm -rf "$GEN"' EXIT
shopt -s nullglob
headers=("$ROOT"/metal/*.h)
kernels=("$ROOT"/metal/*.metal)
if (( ${#kernels[@]} )); then
  python3 "$ROOT/csrc/gpu/sim/msl2cpp.py" "$GEN" "${headers[@]}" "${kernels[@]}" || status=1
  for gen in "$GEN"/*.metal.cpp; do
    echo "check_objc: $(basename "$gen") (simulator kernels, macOS target)"
    # C++20, as cmake/sim.cmake builds them (matmul2d's descriptor is a class-type template argument)
    "$CLANG" "${COMMON[@]}" -std=c++20 -Wno-unknown-pragmas -Werror=unknown-attributes -I "$ROOT/csrc/gpu/sim/msl" \
      -I "$GEN" -x c++ "$gen" || status=1
  done
fi
if [[ $status -eq 0 ]]; then
  echo "check_objc: OK"
else
  echo "check_objc: FAILED" >&2
fi
exit $status
