# Compiles metal/*.metal into lily.metallib with Apple's Metal compiler, and the Metal 4
# tensor-op kernels (metal/<family>_tensor.metal) into one lily_tensor_<family>.metallib each
# when the SDK supports them. The simulator's self-test kernels (metal/selftest*.metal) are not shipped: they are
# compiled into lily_selftest*.metallib in the build directory only, so Apple's compiler
# still checks that they are valid MSL. Recent Xcode releases ship the Metal toolchain as a
# separate download: `xcrun --find metal` may succeed while the compiler cannot run, so the probe compiles a one-line kernel.
# Without a working toolchain (e.g. only the Command Line Tools) the package is built with
# the simulator only, with a notice, unless LILY_METAL=ON asks for the GPU device.
set(LILY_METAL "AUTO" CACHE STRING
  "Build the Metal GPU device: AUTO (when the Metal toolchain works), ON (required), OFF")
set_property(CACHE LILY_METAL PROPERTY STRINGS AUTO ON OFF)
if(LILY_METAL STREQUAL "OFF")
  return()
endif()

set(_probe_dir "${CMAKE_BINARY_DIR}/metal_probe")
file(MAKE_DIRECTORY "${_probe_dir}")
file(WRITE "${_probe_dir}/probe.metal" "kernel void lily_probe(device float* x [[buffer(0)]]) { x[0] = 1.0f; }\n")
execute_process(
  COMMAND xcrun -sdk macosx metal -c -std=metal3.1 -mmacosx-version-min=14.0 "${_probe_dir}/probe.metal"
          -o "${_probe_dir}/probe.air"
  RESULT_VARIABLE _metal_rc OUTPUT_VARIABLE _metal_out ERROR_VARIABLE _metal_err)
if(_metal_rc EQUAL 0)
  execute_process(COMMAND xcrun -sdk macosx metallib "${_probe_dir}/probe.air" -o "${_probe_dir}/probe.metallib"
    RESULT_VARIABLE _metal_rc OUTPUT_VARIABLE _metal_out ERROR_VARIABLE _metal_err)
endif()
if(NOT _metal_rc EQUAL 0)
  string(CONCAT _why "Lily: the Metal shader compiler does not work here (`xcrun -sdk macosx metal` on a one-line "
         "kernel failed: ${_metal_rc} ${_metal_err}).\n"
         "To build the GPU device, install Xcode (the Command Line Tools alone do not include `metal`), then "
         "the Metal toolchain:\n    xcodebuild -downloadComponent MetalToolchain\n"
         "select Xcode with `sudo xcode-select -s /Applications/Xcode.app`, and reinstall.")
  if(LILY_METAL STREQUAL "ON")
    message(FATAL_ERROR "${_why}\nLILY_METAL=ON requires it.")
  endif()
  message(WARNING "${_why}\nBuilding WITHOUT the Metal GPU device: only device='reference' (and the 'sim' "
                  "simulator) will be available. Set LILY_METAL=OFF to silence this.")
  return()
endif()

set(LILY_METAL_TENSOR "AUTO" CACHE STRING
  "Build the lily_tensor_<family>.metallib files (Metal 4 tensor ops for apple10 GPUs): AUTO (those the SDK compiles), ON (all required), OFF")
set_property(CACHE LILY_METAL_TENSOR PROPERTY STRINGS AUTO ON OFF)
# The self-test kernels are the simulator's and never shipped: compiling them with Apple's
# compiler is a developer's check, so a kernel it rejects cannot fail `pip install .`.
option(LILY_METAL_SELFTEST "Also build the self-test kernels' metallibs (a compile check, not installed)" OFF)
set(_selftest_all "")
if(LILY_METAL_SELFTEST)
  set(_selftest_all ALL)
endif()

file(GLOB LILY_METAL_ALL CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/metal/*.metal")
file(GLOB LILY_METAL_HEADERS CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/metal/*.h")
set(LILY_METAL_SOURCES ${LILY_METAL_ALL})
list(FILTER LILY_METAL_SOURCES EXCLUDE REGEX "_tensor\\.metal$")
set(LILY_METAL_TENSOR_SOURCES ${LILY_METAL_ALL})
list(FILTER LILY_METAL_TENSOR_SOURCES INCLUDE REGEX "_tensor\\.metal$")
# The self-test kernels (st_*), apart from the shipped ones.
set(LILY_METAL_SELFTEST_SOURCES ${LILY_METAL_SOURCES})
list(FILTER LILY_METAL_SELFTEST_SOURCES INCLUDE REGEX "/selftest[^/]*\\.metal$")
list(FILTER LILY_METAL_SOURCES EXCLUDE REGEX "/selftest[^/]*\\.metal$")
set(LILY_METAL_SELFTEST_TENSOR_SOURCES ${LILY_METAL_TENSOR_SOURCES})
list(FILTER LILY_METAL_SELFTEST_TENSOR_SOURCES INCLUDE REGEX "/selftest[^/]*\\.metal$")

# Compiles the given sources to .air and links them into OUT; sets ${OUT_VAR} to its path.
function(lily_metallib OUT_NAME OUT_VAR STD MIN_OS)
  set(air_files "")
  foreach(src ${ARGN})
    get_filename_component(name "${src}" NAME_WE)
    set(air "${CMAKE_BINARY_DIR}/metal/${name}.air")
    add_custom_command(OUTPUT "${air}"
      COMMAND ${CMAKE_COMMAND} -E make_directory "${CMAKE_BINARY_DIR}/metal"
      COMMAND xcrun -sdk macosx metal -c -std=${STD} -mmacosx-version-min=${MIN_OS} -Wall -Wextra -fno-fast-math
              -I "${CMAKE_SOURCE_DIR}/metal" "${src}" -o "${air}"
      DEPENDS "${src}" ${LILY_METAL_HEADERS}
      COMMENT "metal ${name}.metal (${STD})")
    list(APPEND air_files "${air}")
  endforeach()
  set(lib "${CMAKE_BINARY_DIR}/${OUT_NAME}")
  add_custom_command(OUTPUT "${lib}"
    COMMAND xcrun -sdk macosx metallib ${air_files} -o "${lib}"
    DEPENDS ${air_files}
    COMMENT "metallib ${OUT_NAME}")
  set(${OUT_VAR} "${lib}" PARENT_SCOPE)
endfunction()

# lily.metallib: MSL 3.1 (macOS 14 / Xcode 15) is the first with the `bfloat` type the
# kernels use; it loads on every supported GPU (apple7 .. apple10).
if(LILY_METAL_SOURCES)
  lily_metallib(lily.metallib LILY_METALLIB metal3.1 14.0 ${LILY_METAL_SOURCES})
  add_custom_target(lily_metallib ALL DEPENDS "${LILY_METALLIB}")
  list(APPEND LILY_DEVICES "metal")
endif()
if(LILY_METAL_SELFTEST_SOURCES)  # a compile check, never installed
  lily_metallib(lily_selftest.metallib LILY_SELFTEST_METALLIB metal3.1 14.0 ${LILY_METAL_SELFTEST_SOURCES})
  add_custom_target(lily_selftest_metallib ${_selftest_all} DEPENDS "${LILY_SELFTEST_METALLIB}")
endif()

# The tensor libraries: MSL 4.0, loaded by the Metal device only on apple10-family GPUs
# (csrc/gpu/metal/metal_device.mm). Each metal/<family>_tensor.metal becomes its own
# lily_tensor_<family>.metallib (gemm, moe_prefill, attention_prefill), so a source this SDK's
# compiler rejects drops only its family: prefill runs that family's simdgroup_matrix kernels
# and the others keep their tensor ones. The probe compiles each real source (every operand
# combination it uses). Apple's MetalPerformancePrimitives headers make some operand types
# (bfloat) available only from a later macOS 26 release than 26.0: the libraries' minimum
# macOS is LILY_METAL_TENSOR_MIN_OS; on an older macOS they do not load and prefill uses the
# simdgroup_matrix kernels.
set(LILY_METAL_TENSOR_MIN_OS "26.2" CACHE STRING
  "Minimum macOS of the tensor libraries (-mmacosx-version-min for the Metal 4 tensor kernels)")
set(LILY_TENSOR_METALLIBS "")
if(LILY_METAL_TENSOR_SOURCES AND NOT LILY_METAL_TENSOR STREQUAL "OFF")
  set(_tensor_err "")
  set(_tensor_ok "")
  foreach(src ${LILY_METAL_TENSOR_SOURCES})
    get_filename_component(name "${src}" NAME_WE)
    execute_process(
      COMMAND xcrun -sdk macosx metal -c -std=metal4.0 -mmacosx-version-min=${LILY_METAL_TENSOR_MIN_OS}
              -I "${CMAKE_SOURCE_DIR}/metal" "${src}" -o "${_probe_dir}/${name}.air"
      RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
    if(NOT _rc EQUAL 0 AND src MATCHES "/selftest[^/]*\\.metal$")
      # Only the compile check of the self-test kernels is skipped; the shipped library is not.
      message(STATUS "Lily: this SDK's Metal compiler rejects ${name}.metal (self-test kernels, not shipped): "
                     "skipping lily_selftest_tensor.metallib\n${_err}")
      list(REMOVE_ITEM LILY_METAL_SELFTEST_TENSOR_SOURCES "${src}")
    elseif(NOT _rc EQUAL 0)
      string(APPEND _tensor_err "${name}.metal:\n${_err}\n")
    elseif(NOT src MATCHES "/selftest[^/]*\\.metal$")
      list(APPEND _tensor_ok "${src}")
    endif()
  endforeach()
  if(_tensor_err)
    string(CONCAT _why "Lily: this SDK's Metal compiler cannot build some Metal 4 tensor kernels "
           "(-std=metal4.0 -mmacosx-version-min=${LILY_METAL_TENSOR_MIN_OS}: Xcode 26.2 or newer with the Metal "
           "toolchain; LILY_METAL_TENSOR_MIN_OS sets the minimum macOS); their families will use the "
           "simdgroup_matrix kernels on apple10-family GPUs (M5).\nCompiler output:\n${_tensor_err}")
    if(LILY_METAL_TENSOR STREQUAL "ON")
      message(FATAL_ERROR "${_why}\nLILY_METAL_TENSOR=ON requires them all; use AUTO or OFF to build without them.")
    endif()
    message(WARNING "${_why}\nSet LILY_METAL_TENSOR=OFF to silence this.")
  endif()
  foreach(src ${_tensor_ok})
    get_filename_component(name "${src}" NAME_WE)
    string(REGEX REPLACE "_tensor$" "" family "${name}")
    lily_metallib(lily_tensor_${family}.metallib _lib metal4.0 ${LILY_METAL_TENSOR_MIN_OS} "${src}")
    add_custom_target(lily_tensor_${family}_metallib ALL DEPENDS "${_lib}")
    list(APPEND LILY_TENSOR_METALLIBS "${_lib}")
    message(STATUS "Lily: building lily_tensor_${family}.metallib (Metal 4 tensor kernels of ${name}.metal, "
                   "macOS ${LILY_METAL_TENSOR_MIN_OS}, used on apple10-family GPUs such as M5)")
  endforeach()
  if(LILY_METAL_SELFTEST_TENSOR_SOURCES AND LILY_TENSOR_METALLIBS)  # built (a compile check), never installed
    lily_metallib(lily_selftest_tensor.metallib LILY_SELFTEST_TENSOR_METALLIB metal4.0 ${LILY_METAL_TENSOR_MIN_OS}
                  ${LILY_METAL_SELFTEST_TENSOR_SOURCES})
    add_custom_target(lily_selftest_tensor_metallib ${_selftest_all} DEPENDS "${LILY_SELFTEST_TENSOR_METALLIB}")
  endif()
endif()
