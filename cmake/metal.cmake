# Compiles metal/*.metal into lily.metallib with Apple's Metal compiler.
# Recent Xcode releases ship the Metal toolchain as a separate download, and the
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

# MSL 3.1 (macOS 14 / Xcode 15) is the first with the `bfloat` type the kernels use.
file(GLOB LILY_METAL_SOURCES CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/metal/*.metal")
file(GLOB LILY_METAL_HEADERS CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/metal/*.h")
set(LILY_AIR_FILES "")
foreach(src ${LILY_METAL_SOURCES})
  get_filename_component(name "${src}" NAME_WE)
  set(air "${CMAKE_BINARY_DIR}/metal/${name}.air")
  add_custom_command(OUTPUT "${air}"
    COMMAND ${CMAKE_COMMAND} -E make_directory "${CMAKE_BINARY_DIR}/metal"
    COMMAND xcrun -sdk macosx metal -c -std=metal3.1 -Wall -Wextra -fno-fast-math
            -I "${CMAKE_SOURCE_DIR}/metal" "${src}" -o "${air}"
    DEPENDS "${src}" ${LILY_METAL_HEADERS}
    COMMENT "metal ${name}.metal")
  list(APPEND LILY_AIR_FILES "${air}")
endforeach()
if(LILY_AIR_FILES)
  set(LILY_METALLIB "${CMAKE_BINARY_DIR}/lily.metallib")
  add_custom_command(OUTPUT "${LILY_METALLIB}"
    COMMAND xcrun -sdk macosx metallib ${LILY_AIR_FILES} -o "${LILY_METALLIB}"
    DEPENDS ${LILY_AIR_FILES}
    COMMENT "metallib lily.metallib")
  add_custom_target(lily_metallib ALL DEPENDS "${LILY_METALLIB}")
  list(APPEND LILY_DEVICES "metal")
endif()
