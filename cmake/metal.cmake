# Compiles metal/*.metal into lily.metallib with Apple's Metal compiler, and the Metal 4
# tensor-op kernels (metal/*_tensor.metal) into lily_tensor.metallib when the SDK supports
# them. Recent Xcode releases ship the Metal toolchain as a separate download, and the
# Command Line Tools alone do not contain `metal`: fail early and name the fix.
execute_process(COMMAND xcrun -sdk macosx --find metal
  OUTPUT_VARIABLE LILY_METAL_COMPILER OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _metal_rc ERROR_QUIET)
if(NOT _metal_rc EQUAL 0 OR NOT EXISTS "${LILY_METAL_COMPILER}")
  message(FATAL_ERROR
    "Lily: the Metal shader compiler (`xcrun -sdk macosx metal`) was not found.\n"
    "Install Xcode (the Command Line Tools alone do not include `metal`), then the Metal toolchain:\n"
    "    xcodebuild -downloadComponent MetalToolchain\n"
    "and select Xcode with `sudo xcode-select -s /Applications/Xcode.app`.")
endif()

set(LILY_METAL_TENSOR "AUTO" CACHE STRING
  "Build lily_tensor.metallib (Metal 4 tensor ops for apple10 GPUs): AUTO (if the SDK supports it), ON (required), OFF")
set_property(CACHE LILY_METAL_TENSOR PROPERTY STRINGS AUTO ON OFF)

file(GLOB LILY_METAL_ALL CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/metal/*.metal")
file(GLOB LILY_METAL_HEADERS CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/metal/*.h")
set(LILY_METAL_SOURCES ${LILY_METAL_ALL})
list(FILTER LILY_METAL_SOURCES EXCLUDE REGEX "_tensor\\.metal$")
set(LILY_METAL_TENSOR_SOURCES ${LILY_METAL_ALL})
list(FILTER LILY_METAL_TENSOR_SOURCES INCLUDE REGEX "_tensor\\.metal$")

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

# lily_tensor.metallib: MSL 4.0 (macOS 26), loaded by the Metal device only on
# apple10-family GPUs (csrc/gpu/metal/metal_device.mm). The probe compiles a kernel with the
# element-type combinations the tensor kernels use (float x float and bfloat rows need the
# macOS 26.1 SDK: Xcode 26.1 or newer).
set(LILY_TENSOR_METALLIB "")
if(LILY_METAL_TENSOR_SOURCES AND NOT LILY_METAL_TENSOR STREQUAL "OFF")
  execute_process(
    COMMAND xcrun -sdk macosx metal -c -std=metal4.0 -mmacosx-version-min=26.0
            "${CMAKE_SOURCE_DIR}/cmake/metal_tensor_probe.metal" -o "${CMAKE_BINARY_DIR}/metal_tensor_probe.air"
    RESULT_VARIABLE _tensor_rc OUTPUT_VARIABLE _tensor_out ERROR_VARIABLE _tensor_err)
  if(_tensor_rc EQUAL 0)
    message(STATUS "Lily: the Metal compiler supports Metal 4 tensor operations: building lily_tensor.metallib "
                   "(the tensor-op GEMMs used on apple10-family GPUs such as M5)")
    lily_metallib(lily_tensor.metallib LILY_TENSOR_METALLIB metal4.0 26.0 ${LILY_METAL_TENSOR_SOURCES})
    add_custom_target(lily_tensor_metallib ALL DEPENDS "${LILY_TENSOR_METALLIB}")
  else()
    string(CONCAT _why "Lily: this SDK's Metal compiler cannot build the Metal 4 tensor operations Lily uses "
           "(-std=metal4.0 with <MetalPerformancePrimitives/MetalPerformancePrimitives.h> matmul2d on float, half "
           "and bfloat inputs: Xcode 26.1 or newer with the macOS 26.1 SDK and the Metal toolchain).\n"
           "Compiler output:\n${_tensor_err}")
    if(LILY_METAL_TENSOR STREQUAL "ON")
      message(FATAL_ERROR "${_why}\nLILY_METAL_TENSOR=ON requires it; use AUTO or OFF to build without it.")
    endif()
    message(WARNING "${_why}\nBuilding lily.metallib only: apple10-family GPUs (M5) will use the "
                    "simdgroup_matrix GEMMs. Set LILY_METAL_TENSOR=OFF to silence this.")
  endif()
endif()
