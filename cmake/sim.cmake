# The Metal simulator (csrc/gpu/sim): every metal/*.metal is turned into C++ by
# csrc/gpu/sim/msl2cpp.py at build time and compiled against the <metal_stdlib> shim.
set(LILY_MSL_OUT "${CMAKE_BINARY_DIR}/msl")
set(LILY_MSL2CPP "${CMAKE_SOURCE_DIR}/csrc/gpu/sim/msl2cpp.py")
file(GLOB LILY_SIM_METAL CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/metal/*.metal")
file(GLOB LILY_SIM_METAL_H CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/metal/*.h")
file(GLOB LILY_SIM_SHIM LIST_DIRECTORIES false CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/csrc/gpu/sim/msl/*"
     "${CMAKE_SOURCE_DIR}/csrc/gpu/sim/msl/*/*.h" "${CMAKE_SOURCE_DIR}/csrc/gpu/sim/*.h")

set(LILY_SIM_GEN_HEADERS "")
foreach(h ${LILY_SIM_METAL_H})
  get_filename_component(name "${h}" NAME)
  add_custom_command(OUTPUT "${LILY_MSL_OUT}/${name}"
    COMMAND "${Python_EXECUTABLE}" "${LILY_MSL2CPP}" "${LILY_MSL_OUT}" "${h}"
    DEPENDS "${h}" "${LILY_MSL2CPP}"
    COMMENT "msl2cpp ${name}")
  list(APPEND LILY_SIM_GEN_HEADERS "${LILY_MSL_OUT}/${name}")
endforeach()
set(LILY_SIM_GEN_SOURCES "")
foreach(src ${LILY_SIM_METAL})
  get_filename_component(name "${src}" NAME_WE)
  set(out "${LILY_MSL_OUT}/${name}.metal.cpp")
  add_custom_command(OUTPUT "${out}"
    COMMAND "${Python_EXECUTABLE}" "${LILY_MSL2CPP}" "${LILY_MSL_OUT}" "${src}"
    DEPENDS "${src}" "${LILY_MSL2CPP}" ${LILY_SIM_GEN_HEADERS}
    COMMENT "msl2cpp ${name}.metal")
  list(APPEND LILY_SIM_GEN_SOURCES "${out}")
endforeach()

add_library(lily_sim_kernels OBJECT ${LILY_SIM_GEN_SOURCES} ${LILY_SIM_GEN_HEADERS})
# C++20: the Metal 4 tensor-op shim needs class-type template arguments (matmul2d<descriptor, scope>).
set_target_properties(lily_sim_kernels PROPERTIES CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON)
target_include_directories(lily_sim_kernels PRIVATE
  "${CMAKE_SOURCE_DIR}/csrc" "${CMAKE_SOURCE_DIR}/csrc/gpu/sim/msl" "${LILY_MSL_OUT}")
# An MSL attribute the transform does not understand must not be silently ignored.
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  target_compile_options(lily_sim_kernels PRIVATE -Werror=unknown-attributes -Wno-unknown-pragmas)
else()
  target_compile_options(lily_sim_kernels PRIVATE -Werror=attributes -Wno-unknown-pragmas)
endif()
set_source_files_properties(${LILY_SIM_GEN_SOURCES} PROPERTIES OBJECT_DEPENDS "${LILY_SIM_SHIM}")
# No multiply-add contraction: the kernel tests compare with numpy bit for bit in places, and
# Apple clang (arm64) fuses a * b + c into one rounding by default where GCC on x86-64 cannot.
target_compile_options(lily_sim_kernels PRIVATE -ffp-contract=off)

add_library(lily_sim OBJECT
  "${CMAKE_SOURCE_DIR}/csrc/gpu/sim/executor.cpp"
  "${CMAKE_SOURCE_DIR}/csrc/gpu/sim/fibers.cpp"
  "${CMAKE_SOURCE_DIR}/csrc/gpu/sim/sim_device.cpp"
  "${CMAKE_SOURCE_DIR}/csrc/gpu/sim/tensor_ops.cpp")
# The simulator's own arithmetic (tensor-op reference products, collectives) rounds each
# product and each sum (no FMA contraction), on every compiler.
target_compile_options(lily_sim PRIVATE -ffp-contract=off)
target_include_directories(lily_sim PRIVATE "${CMAKE_SOURCE_DIR}/csrc")
list(APPEND LILY_DEVICES "sim")

# Instruction sets the simulator uses when the compiler takes the flag and the building CPU
# has them (the simulator is built where it runs; a cross build cannot ask the CPU, so it
# keeps the library calls). Results are exact either way, and -ffp-contract=off keeps the
# compiler from fusing anything itself:
#   f16c  half <-> float conversions, otherwise libgcc calls (a quarter of a simulated prefill)
#   fma   the kernels' explicit fma (e.g. the half-FMA weight dequantization), otherwise a
#         libm call per element
include(CheckCXXCompilerFlag)
include(CheckCXXSourceRuns)
foreach(isa f16c fma)
  string(TOUPPER ${isa} ISA)
  check_cxx_compiler_flag(-m${isa} LILY_CXX_HAS_M${ISA})
  if(LILY_CXX_HAS_M${ISA} AND NOT CMAKE_CROSSCOMPILING)
    check_cxx_source_runs("int main() { return __builtin_cpu_supports(\"${isa}\") ? 0 : 1; }" LILY_HOST_HAS_${ISA})
    if(LILY_HOST_HAS_${ISA})
      target_compile_options(lily_sim_kernels PRIVATE -m${isa})
      target_compile_options(lily_sim PRIVATE -m${isa})
    endif()
  endif()
endforeach()
